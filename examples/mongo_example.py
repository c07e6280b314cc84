"""Fine-tune on a MongoDB collection, with the prompt in a nested field.

    export LLMTRAIN_MONGO_URI=mongodb://user:password@host:27017/mydb
    python examples/mongo_example.py

The default URI, ``mongomock://localhost/example``, is an in-process MongoDB stand-in, so
the example runs anywhere. It inserts documents shaped like
``{"meta": {"prompt": "..."}, "answer": "...", "lang": "en"}`` into ``llmtrain_example_docs``,
trains on the English ones for a few steps and drops the collection again.
"""

import os
import tempfile
from pathlib import Path

import demo  # examples/demo.py: the quick start's table

import llmtrain as lt
from llmtrain.console import quiet
from llmtrain.db.engines import mongo_database
from llmtrain.testing import tiny_model
from llmtrain.uri import redact_uri

URI = os.environ.get("LLMTRAIN_MONGO_URI", "mongomock://localhost/example")
COLLECTION = "llmtrain_example_docs"


def insert_documents() -> object:
    """Your data: any collection; llmtrain pages through it in ``_id`` order."""
    collection = mongo_database(URI)[COLLECTION]
    collection.drop()
    collection.insert_many(
        [
            {
                "_id": r["id"],
                "meta": {"prompt": r["instruction"]},
                "answer": r["output"],
                "lang": r["lang"],
            }
            for r in demo.rows()
        ]
    )
    return collection


def main() -> None:
    quiet()
    print(f"MongoDB: {redact_uri(URI)}")  # never print a password
    collection = insert_documents()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base_model = tiny_model(Path(tmp) / "tiny-llama")  # or a hub id
            # Trainers, models and runs go to `metadata_uri`, adapters to `artifacts` (a folder
            # or an fsspec URL such as s3://); leave both out to keep the records in this
            # database. Here they go to a temporary folder: nothing is left behind.
            db = lt.connect(
                URI, metadata_uri=f"sqlite:///{tmp}/llmtrain.db", artifacts=f"{tmp}/artifacts"
            )
            trainer = lt.LLMTrainer(
                "mongo-qa",
                model=base_model,
                prompt_template="Q: {X}\nA: {Y}",
                max_steps=5,
                batch_size=8,
                learning_rate=1e-2,
            )
            select = lt.Collection(COLLECTION).find({"lang": "en"})
            model = trainer.fit(X="meta.prompt", Y="answer", db=db, select=select)
            history = model.record.history
            print(
                f"trained {model.identifier} on {COLLECTION} (X=meta.prompt, Y=answer): loss "
                f"{history[0]['loss']:.2f} -> {history[-1]['loss']:.2f} in "
                f"{len(history)} steps"
            )
            stored = db.load("trainer", "mongo-qa")
            print(
                f"stored selection: {stored.config.fit.select['filter']}, "
                f"reloads equal: {stored == trainer}"
            )
            db.close()
    finally:
        collection.drop()
        print(f"dropped {COLLECTION}")


if __name__ == "__main__":
    main()
