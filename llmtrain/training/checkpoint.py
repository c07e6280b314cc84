"""Checkpoints: a folder sealed with a manifest, stored, then recorded on the run (a killed
write leaves no checkpoint that looks good); loads verify every file and unpickle nothing."""

from __future__ import annotations

import json
import pickle
import random
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llmtrain.errors import CheckpointError, StoreError
from llmtrain.stores.artifacts.base import hashed_copy
from llmtrain.stores.handle import Database
from llmtrain.stores.metadata.base import CheckpointRecord
from llmtrain.training.strategies.base import Strategy

MANIFEST = "manifest.json"
BEST = "best_checkpoint"  # the run's info key: step, artifact, metric, value
STATE = "trainer_state.json"
FORMAT = 1


def sha256_file(path: Path) -> str:
    with path.open("rb") as fh:
        return hashed_copy(fh)


def digests(folder: Path) -> dict[str, str]:
    """Each file under ``folder`` (its path relative to it) -> its sha256: a manifest's lines."""
    return {
        p.relative_to(folder).as_posix(): sha256_file(p) for p in folder.rglob("*") if p.is_file()
    }


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": json.dumps(random.getstate()),
        "numpy": json.dumps([kind, np.asarray(keys).tolist(), pos, has_gauss, gauss]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = json.loads(state["numpy"])
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves and restores the training state of one run through the artifact store."""

    def __init__(
        self, db: Database, run_id: str, strategy: Strategy, *, keep: int | None, workdir: Path
    ) -> None:
        self.db, self.run_id, self.strategy, self.keep = db, run_id, strategy, keep
        self.workdir = workdir

    def save(
        self, model: Any, optimizer: Any, scheduler: Any, state: dict[str, Any]
    ) -> CheckpointRecord | None:
        """Collective: every rank calls it. Returns the record on rank 0."""
        s, name = self.strategy, f"ckpt-{state['step']}-{uuid.uuid4().hex[:8]}"
        folder = Path(s.broadcast_object(str(self.workdir / name)))
        folder.mkdir(parents=True, exist_ok=True)
        weights = s.trainable_state_dict(model)  # gathers shards: all ranks take part
        s.save_optimizer(model, optimizer, folder)
        torch.save(rng_state(), folder / f"rng_rank{s.rank}.pt")
        s.barrier()
        record = None
        if s.is_main:
            try:
                with _saving(state["step"]):
                    seal(folder, weights, scheduler, state, world_size=s.world_size)
                record = self.record(folder, {**state, "world_size": s.world_size})
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        s.barrier()
        return record

    def record(self, folder: Path, state: dict[str, Any]) -> CheckpointRecord:
        """Store a sealed checkpoint folder and record it on the run (also Ray's driver)."""
        with _saving(state["step"]):
            artifact = self.db.artifacts.put_dir(folder)
            record = self.db.metadata.add_checkpoint(
                self.run_id,
                state["step"],
                artifact,
                {"epoch": state["epoch"], "world_size": state["world_size"]},
            )
            self._prune()
        return record

    def mark_best(self, record: CheckpointRecord, metric: str, value: float) -> None:
        """Rank 0: record ``record`` as the run's best checkpoint (never pruned), then prune."""
        best = {"step": record.step, "artifact": record.artifact_id, "metric": metric}
        self.db.metadata.update_run(self.run_id, info={BEST: {**best, "value": value}})
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep`` checkpoints and the best one (save_best_by)."""
        if self.keep is None:
            return
        meta, best = self.db.metadata, self.best_record() or {}
        for old in meta.list_checkpoints(self.run_id)[: -self.keep]:
            if old.step == best.get("step"):
                continue
            meta.remove_checkpoint(self.run_id, old.step)
            if all(r.artifact_id != old.artifact_id for r in meta.list_checkpoints(self.run_id)):
                self.db.artifacts.delete(old.artifact_id)

    def best_record(self) -> dict[str, Any] | None:
        """The run's best checkpoint by save_best_by (step, artifact, metric, value), if any."""
        best = self.db.metadata.get_run(self.run_id).info.get(BEST)
        return dict(best) if best else None

    def latest(self) -> CheckpointRecord | None:
        records = self.db.metadata.list_checkpoints(self.run_id)
        return records[-1] if records else None

    def restore(
        self, record: CheckpointRecord, model: Any, optimizer: Any, scheduler: Any
    ) -> dict[str, Any]:
        """Load weights, optimizer, scheduler and RNG; return the saved trainer state."""
        with tempfile.TemporaryDirectory(dir=self.workdir, ignore_cleanup_errors=True) as tmp:
            folder = Path(tmp) / "ckpt"
            self.db.artifacts.get_dir(record.artifact_id, folder)
            return self.restore_folder(folder, record.step, model, optimizer, scheduler)

    def restore_folder(
        self, folder: Path, step: int, model: Any, optimizer: Any, scheduler: Any
    ) -> dict[str, Any]:
        """Restore from a checkpoint folder already on this machine (verified first)."""
        s = self.strategy
        verify(folder)
        state: dict[str, Any] = json.loads((folder / STATE).read_text())
        if state.get("world_size") != s.world_size:
            raise CheckpointError(
                f"checkpoint at step {step} was written by {state.get('world_size')}"
                f" process(es); resume it with the same world size, not {s.world_size}"
            )
        with _refused("weights.safetensors", step):
            weights = load_file(str(folder / "weights.safetensors"))
        s.load_trainable_state_dict(model, weights)
        with _refused("optimizer.pt", step):
            s.load_optimizer(model, optimizer, folder)
        with _refused("scheduler.pt", step):
            scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        with _refused(f"rng_rank{s.rank}.pt", step):
            set_rng_state(torch.load(folder / f"rng_rank{s.rank}.pt", weights_only=True))
        return state


def seal(
    folder: Path,
    weights: dict[str, torch.Tensor],
    scheduler: Any,
    state: dict[str, Any],
    *,
    world_size: int,
    more_files: dict[str, str] | None = None,
) -> None:
    """Rank 0 completes a checkpoint folder: weights, scheduler, state and the manifest of
    every file (``more_files``: other ranks' files and sha256s, written elsewhere)."""
    save_file(weights, str(folder / "weights.safetensors"))
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    (folder / STATE).write_text(json.dumps({**state, "format": FORMAT, "world_size": world_size}))
    files = dict(sorted({**digests(folder), **(more_files or {})}.items()))
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}))


@contextmanager
def _saving(step: int) -> Iterator[None]:
    try:
        yield
    except (OSError, StoreError) as exc:
        raise CheckpointError(
            f"could not save the checkpoint at step {step}: "
            f"{exc}; the previous checkpoint is intact"
        ) from exc


@contextmanager
def _refused(name: str, step: int) -> Iterator[None]:
    """A file the safe loaders refuse is a CheckpointError naming it, whatever the manifest."""
    try:
        yield
    except (pickle.UnpicklingError, SafetensorError) as exc:
        lines = [s.strip() for s in str(exc).splitlines() if s.strip()] or [type(exc).__name__]
        reason = next((line for line in lines if "Unsupported global" in line), lines[0])
        raise CheckpointError(
            f"checkpoint at step {step}: {name} was refused by the safe "
            f"loader ({reason[:300]}); it was not written by llmtrain"
        ) from exc


def verify(folder: Path) -> None:
    """Every file listed in the manifest is present and matches its sha256."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{folder} has no {MANIFEST}: the checkpoint is incomplete")
    for rel, digest in json.loads(manifest.read_text())["files"].items():
        if not (folder / rel).is_file() or sha256_file(folder / rel) != digest:
            raise CheckpointError(f"checkpoint file {rel} is missing or corrupt")
