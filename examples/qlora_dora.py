"""QLoRA with DoRA: a 4-bit quantised, frozen base model with a weight-decomposed adapter.

    python examples/qlora_dora.py

``bits=4, qlora=True`` loads the base weights as NF4 with bitsandbytes (on a GPU in
practice; recent bitsandbytes also runs on CPU, which is what makes this example portable),
and ``use_dora=True`` trains a DoRA adapter on top. Everything goes to a temporary folder.
"""

import tempfile
from pathlib import Path

import demo  # examples/demo.py: the quick start's table

import llmtrain as lt
from llmtrain.console import quiet
from llmtrain.testing import tiny_model


def main() -> None:
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        demo.write_table(Path(tmp) / "data.db")  # the demo's docs table
        db = lt.connect(f"sqlite:///{tmp}/data.db")
        trainer = lt.LLMTrainer(
            "qdora",
            model=tiny_model(Path(tmp) / "tiny-llama"),  # or e.g. "Qwen/Qwen2.5-7B"
            prompt_template="Q: {X}\nA: {Y}",
            bits=4,
            qlora=True,  # NF4 base weights, double quantisation
            use_dora=True,
            lora_r=8,
            max_steps=3,
            batch_size=8,
            learning_rate=1e-2,
        )
        model = trainer.fit(
            X="instruction", Y="output", db=db, select=lt.Table("docs").where("lang = :l", l="en")
        )
        history = model.record.history
        print(
            f"trained {model.identifier} for {len(history)} steps, "
            f"final loss {history[-1]['loss']:.2f}"
        )

        network, _ = db.load("model", "qdora").load()  # the base in 4-bit, plus the adapter
        quantized = [m for m in network.modules() if type(m).__module__.startswith("bitsandbytes")]
        kinds = {m.weight.quant_state.quant_type for m in quantized}
        dora = [n for n, _ in network.named_parameters() if "lora_magnitude_vector" in n]
        print(
            f"base layers in 4-bit: {len(quantized)} ({', '.join(sorted(kinds))}); "
            f"DoRA magnitude vectors: {len(dora)}"
        )
        db.close()


if __name__ == "__main__":
    main()
