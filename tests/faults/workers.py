"""Functions the load tests run in spawned processes (importable without the test modules)."""

from __future__ import annotations

import os
from typing import Any


def add_versions(uri: str, barrier: Any, queue: Any, count: int) -> None:
    """Wait for the others, then add ``count`` versions of one component; report them."""
    from llmtrain.stores.metadata import open_metadata

    store = open_metadata(uri)
    try:
        barrier.wait(timeout=120)
        queue.put(
            (
                os.getpid(),
                [
                    store.add_component("model", "shared", {"pid": os.getpid(), "i": i})
                    for i in range(count)
                ],
            )
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((os.getpid(), repr(exc)))
    finally:
        store.close()


def fit_at_once(
    uris: list[str], artifacts: list[str], model: str, barrier: Any, queue: Any, steps: int
) -> None:
    """For each store in turn: wait for the other trainer, then fit on it at the same time."""
    import torch

    torch.set_num_threads(1)
    import llmtrain as lt

    for uri, folder in zip(uris, artifacts):
        try:
            db = lt.connect(uri, artifacts=folder)
            trainer = lt.LLMTrainer(
                "shared",
                model=model,
                prompt_template="Q: {X}\nA: {Y}",
                max_steps=steps,
                batch_size=4,
                save_steps=2,
                logging_steps=1,
                progress_bar=False,
                seed=os.getpid() % 1000,
            )
            barrier.wait(timeout=300)
            result = trainer.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
            queue.put((uri, result.record.run_id, result.version))
            db.close()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            queue.put((uri, "error", repr(exc)))
