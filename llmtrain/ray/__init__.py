"""Training on Ray: ``LLMTrainer(..., ray_config=RayConfig(...))`` then ``fit()``.

Ray Train's ``TorchTrainer`` starts the workers; each runs the same FitRun as a local rank
(DDP inside the Ray worker group). The database stays with the driver, which streams each
worker its rows (:mod:`llmtrain.ray.bridge`); checkpoints go through Ray Train into
``ray_config.storage`` and are recorded by the driver (:mod:`llmtrain.ray.driver`).
Nothing here is imported unless a trainer has a ``ray_config``.
"""

from __future__ import annotations

from typing import Any


def run_on_ray(trainer: Any, db: Any, run_id: str, *, resume: bool | str, merge: bool) -> Any:
    """Train run ``run_id`` of ``trainer`` on Ray and return its model (see driver)."""
    from llmtrain.ray.driver import run_on_ray as run

    return run(trainer, db, run_id, resume=resume, merge=merge)


__all__ = ["run_on_ray"]
