"""Quick start: fine-tune a language model on the rows of a SQL table, then ask it questions.

    python examples/quickstart.py

About half a minute on a laptop CPU, no download: ``demo.prepare`` writes a SQLite file
with a ``docs`` table (id, instruction, output, lang) and builds a tiny local model, both
in ./llmtrain-demo/. With your own data, connect to your database and name a real model
instead (``model="Qwen/Qwen2.5-0.5B"``). ``llmtrain demo`` makes these same calls.
"""

import llmtrain as lt
from llmtrain.cli import demo
from llmtrain.console import quiet


def main() -> None:
    quiet()  # hide the banners of transformers & co
    steps = 60
    uri, base_model = demo.prepare("llmtrain-demo")  # sqlite:///.../demo.db, a model folder

    db = lt.connect(uri)
    trainer = lt.LLMTrainer(
        "demo-qa",
        model=base_model,
        prompt_template="### Question:\n{X}\n\n### Answer:\n{Y}",
        max_steps=steps,
        batch_size=16,
        learning_rate=2e-2,
        lora_r=16,
        lora_dropout=0.0,
    )
    model = trainer.fit(
        X="instruction", Y="output", db=db, select=lt.Table("docs").where("lang = :l", l="en")
    )
    history = model.record.history
    print(f"loss {history[0]['loss']:.2f} -> {history[-1]['loss']:.2f} in {steps} steps")

    # The trainer, its data selection and the model are stored in the database:
    # load them back from any process, any time.
    model = db.load("model", "demo-qa")
    for question in [
        "What is the capital of Japan?",
        "What sound does a cow make?",
        "What is 3 plus 4?",
    ]:
        print(f"{question} -> {model.generate(question, max_new_tokens=8)}")
    db.close()


if __name__ == "__main__":
    main()
