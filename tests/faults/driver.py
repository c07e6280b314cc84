"""Runs one fit in a fresh process, for the kill -9 tests: ``python driver.py '<json>'``.

The JSON names the database, the trainer options, the ``trace`` path (the run's keys, step
by step, through a KeyTrace callback) and, optionally, a ``hold``
point: when the fit reaches it the driver writes ``hold.marker`` and sleeps, so the parent
can ``kill -9`` it exactly there. Hold points: ``after-step`` (step N's keys are traced),
``mid-step`` (the forward pass of step N is done, its backward not), ``checkpoint-write``
(the artifact store is half-way through writing a file of the checkpoint at step N).
``select`` (a stored query) replaces the table ``docs``; ``fields`` fit()'s field names.
``load_model`` names a model (of another process) to load after the fit, reporting the
digests of its LoRA weights.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"


def hold(marker: Path, where: str) -> None:
    """Tell the parent where we are, then wait for its SIGKILL."""
    marker.write_text(where)
    time.sleep(600)
    raise SystemExit(f"was not killed at {where}")


def install_hold(spec: dict[str, Any]) -> Any:
    """The callback that holds after a step (the others patch the code): None for those."""
    from llmtrain.stores.artifacts import local
    from llmtrain.training import checkpoint
    from llmtrain.training.callbacks import Callback

    kind, at, marker = spec["kind"], int(spec["step"]), Path(spec["marker"])
    traced = {"step": 0}

    class HoldAfterStep(Callback):
        """After the trace: step N's keys are on disk when it holds."""

        def on_step(self, fit: Any, keys: list[str]) -> None:
            traced["step"] = fit.step
            if kind == "after-step" and fit.step == at:
                hold(marker, f"after step {at}")

    holder = HoldAfterStep()

    if kind == "mid-step":
        from llmtrain.objectives.loss import LossFunction

        compute = LossFunction.__call__

        def forward_then_hold(self: Any, model: Any, batch: dict[str, Any]) -> Any:
            loss = compute(self, model, batch)
            if traced["step"] == at - 1:
                hold(marker, f"in step {at}, between forward and backward")
            return loss

        LossFunction.__call__ = forward_then_hold  # type: ignore[method-assign]

    if kind == "checkpoint-write":
        saving = {"step": None}
        save = checkpoint.Checkpointer.save

        def note_step(
            self: Any, model: Any, optimizer: Any, scheduler: Any, state: dict[str, Any]
        ) -> Any:
            saving["step"] = state["step"]
            return save(self, model, optimizer, scheduler, state)

        checkpoint.Checkpointer.save = note_step  # type: ignore[method-assign]
        store_save = local.LocalArtifactStore._save

        class Trickle:
            """8 KiB per read; on the third read (16 KiB already written) or on a tree's
            first read, the process holds: the file is half-written."""

            def __init__(self, raw: Any, artifact_id: str) -> None:
                self.raw, self.reads, self.artifact_id = raw, 0, artifact_id

            def read(self, size: int = -1) -> bytes:
                self.reads += 1
                if self.reads == 3 or self.artifact_id.startswith("tree:"):
                    hold(marker, f"writing {self.artifact_id} of the checkpoint at step {at}")
                return self.raw.read(8192)

        def slow_save(self: Any, artifact_id: str, source: Any) -> None:
            if saving["step"] == at:
                source = Trickle(source, artifact_id)
            store_save(self, artifact_id, source)

        local.LocalArtifactStore._save = slow_save  # type: ignore[method-assign]
    return holder


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(1)
    from hooks import KeyTrace

    import llmtrain as lt

    callbacks = [KeyTrace(cfg["trace"])]  # the trace first: a hold after a step follows it
    if cfg.get("hold"):
        callbacks.append(install_hold(cfg["hold"]))
    key_pages: list[int] = []
    if cfg.get("count_key_pages"):  # pages of keys: what taking a snapshot reads
        from llmtrain.db.sql import SQLBackend

        pages = SQLBackend.key_pages

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            for page in pages(self, *args, **kwargs):
                key_pages.append(1)
                yield page

        SQLBackend.key_pages = counted  # type: ignore[method-assign]
    db = lt.connect(cfg["uri"], artifacts=cfg["artifacts"])
    trainer = lt.LLMTrainer(
        cfg["identifier"], model=cfg["model"], prompt_template=TEMPLATE, **cfg["options"]
    )
    select = cfg.get("select")  # a stored query (a mixture names its sources' fields)
    fields = cfg.get("fields") or ({} if select else {"X": "instruction", "Y": "output"})
    model = trainer.fit(
        **fields,
        db=db,
        select=lt.Query.from_dict(select) if select else lt.Table(cfg.get("table", "docs")),
        resume=cfg.get("resume", False),
        callbacks=callbacks,
    )
    loaded: list[str] = []
    if cfg.get("load_model"):  # then load another process's model, as a user would
        import hashlib

        other, _ = db.load("model", cfg["load_model"]).load("cpu")
        loaded = sorted(
            hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
            for name, p in other.named_parameters()
            if "lora_" in name
        )
    print(
        "RESULT "
        + json.dumps(
            {
                "run_id": model.record.run_id,
                "adapter": model.record.adapter,
                "key_pages": len(key_pages),
                "loaded": loaded,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
