"""Exact losses of the first steps on a tiny deterministic model, pinned as numbers.

"The loss fell" survives a changed prompt format, a shifted label mask, a lost accumulation
step or a reordered batch; these numbers do not. They were computed once with release 0.1.0
(the code before the core refactor); a change that moves them must say why in its commit and
update them. The tolerance absorbs float32 differences between CPUs, not a behaviour change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill

import llmtrain as lt
from llmtrain.testing import tiny_model

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
BASE = {
    "max_steps": 4,
    "batch_size": 4,
    "learning_rate": 1e-2,
    "logging_steps": 1,
    "progress_bar": False,
    "max_length": 64,
}
LORA = {"lora_r": 4}

#: setup -> (trainer keywords, the per-step losses release 0.1.0 logged)
PINNED: dict[str, tuple[dict[str, Any], list[float]]] = {
    "lora_padded": (
        LORA,
        [6.747960707720588, 6.343872547149658, 6.002149245318244, 5.255343914031982],
    ),
    # packing is loss-equivalent to padding: the same numbers, without dropout (its masks are
    # drawn over the batch's layout, and packing each step's rows under a token budget lays
    # them out otherwise); pinned when that budget became packing's default
    "lora_padded_no_dropout": (
        {**LORA, "lora_dropout": 0.0},
        [6.747961156508502, 6.334839820861816, 6.027302012724035, 5.271739959716797],
    ),
    "lora_packed_no_dropout": (
        {**LORA, "lora_dropout": 0.0, "packing": True},
        [6.747961156508502, 6.334839820861816, 6.027302012724035, 5.271739959716797],
    ),
    "full_fine_tuning": (
        {"lora_args": None, "learning_rate": 1e-3},
        [6.747960707720588, 6.500515937805176, 6.2715144437902115, 5.65074348449707],
    ),
    "train_on_inputs": (
        {**LORA, "train_on_inputs": True},
        [6.621945335751488, 6.063541230701265, 5.682473809056028, 5.447218478082896],
    ),
    "gradient_accumulation_2": (
        {**LORA, "gradient_accumulation_steps": 2, "batch_size": 2},
        [6.747960707720588, 6.348605155944824, 6.062353695140166, 5.23138952255249],
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(
        tmp_path_factory.mktemp("models") / "llama", hidden_size=32, num_layers=1, vocab_size=400
    )


@pytest.mark.parametrize("setup", sorted(PINNED))
def test_first_losses_match_the_pinned_numbers(setup: str, tiny: Path, tmp_path: Path) -> None:
    options, expected = PINNED[setup]
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(
        uri,
        "docs",
        [
            {"id": i, "instruction": f"What is color number {i % 8}?", "output": COLORS[i % 8]}
            for i in range(24)
        ],
    )
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    trainer = lt.LLMTrainer(setup, model=str(tiny), prompt_template=TEMPLATE, **{**BASE, **options})
    trainer.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
    (run,) = db.metadata.list_runs("trainer", setup)
    losses = [m.values["loss"] for m in db.metadata.get_metrics(run.run_id)]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=1e-4,
        atol=1e-5,
    )
