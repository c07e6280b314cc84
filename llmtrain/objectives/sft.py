"""Supervised fine-tuning: responses to prompts, documents (no Y) and conversations, trained as
the summed next-token loss on their target tokens."""

from __future__ import annotations

from typing import Any

from llmtrain.objectives.base import Batching, Objective
from llmtrain.objectives.collate import Collate
from llmtrain.objectives.loss import LossFunction


class SFT(Objective):
    name, roles, optional, trains = "sft", ("X", "Y"), ("Y",), "responses"

    def method(self) -> str:
        return ""

    def problems(self, config: Any) -> list[str]:
        best = config.training_args.best_key()
        if best is not None and best.startswith("eval_rewards/"):
            return [f"training_args.save_best_by={best!r}: rewards are a preference objective's"]
        return []

    def collate(self, how: Batching) -> Collate:
        return Collate(how.formatters, how.pad_id, how.source, how.packer, how.token_budget)

    def loss(self, run: Any) -> LossFunction:
        return LossFunction(run.base_model)
