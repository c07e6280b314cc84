"""Fine-tune on a PostgreSQL table.

    export LLMTRAIN_PG_URI=postgresql+psycopg://user:password@host:5432/db
    python examples/postgres_example.py

The default URI is a local server (``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``).
The example creates its own table ``llmtrain_example_docs``, trains for a few steps and
drops the table again. Any SQLAlchemy URL works the same way (MySQL, MariaDB, SQLite, ...).
"""

import os
import tempfile
from pathlib import Path

import demo  # examples/demo.py: the quick start's table
import sqlalchemy as sa

import llmtrain as lt
from llmtrain.console import quiet
from llmtrain.testing import tiny_model
from llmtrain.uri import redact_uri

URI = os.environ.get("LLMTRAIN_PG_URI", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
TABLE = "llmtrain_example_docs"


def create_table(engine: sa.Engine) -> sa.Table:
    """Your data: any table with a primary key (llmtrain pages through it in key order)."""
    docs = sa.Table(
        TABLE,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("instruction", sa.Text, nullable=False),
        sa.Column("output", sa.Text, nullable=False),
        sa.Column("lang", sa.Text, nullable=False),
    )
    docs.drop(engine, checkfirst=True)
    docs.create(engine)
    with engine.begin() as conn:
        conn.execute(docs.insert(), demo.rows())
    return docs


def main() -> None:
    quiet()
    print(f"PostgreSQL: {redact_uri(URI)}")  # never print a password
    engine = sa.create_engine(URI)
    docs = create_table(engine)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base_model = tiny_model(Path(tmp) / "tiny-llama")  # or a hub id
            # Trainers, models and runs go to `metadata_uri`, adapters to `artifacts`; leave
            # both out to keep everything in PostgreSQL. Here they go to a temporary folder,
            # so the example leaves nothing behind.
            db = lt.connect(
                URI, metadata_uri=f"sqlite:///{tmp}/llmtrain.db", artifacts=f"{tmp}/artifacts"
            )
            trainer = lt.LLMTrainer(
                "pg-qa",
                model=base_model,
                prompt_template="Q: {X}\nA: {Y}",
                max_steps=5,
                batch_size=8,
                learning_rate=1e-2,
            )
            model = trainer.fit(
                X="instruction",
                Y="output",
                db=db,
                select=lt.Table(TABLE).where("lang = :l", l="en"),
            )
            history = model.record.history
            print(
                f"trained {model.identifier} on {TABLE}: loss {history[0]['loss']:.2f} -> "
                f"{history[-1]['loss']:.2f} in {len(history)} steps"
            )
            (run,) = db.metadata.list_runs("trainer", "pg-qa")
            print(
                f"run {run.run_id}: {run.status}, rows {run.info['query']['where']} "
                f"{run.info['query']['params']}, data fingerprint {run.info['data_fingerprint']}"
            )
            print(f"stored trainer reloads equal: {db.load('trainer', 'pg-qa') == trainer}")
            db.close()
    finally:
        docs.drop(engine)
        engine.dispose()
        print(f"dropped {TABLE}")


if __name__ == "__main__":
    main()
