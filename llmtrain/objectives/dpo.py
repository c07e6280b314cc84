"""DPO against the reference (the starting model), with its loss types: sigmoid (conservative
with label smoothing), robust, hinge and IPO; TRL 1.16's formulas and defaults."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from llmtrain.objectives.base import Settings
from llmtrain.objectives.preference import Metrics, Preference, pair_metrics, smoothed


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPO on summed log-probs; ``sigmoid`` with ``label_smoothing`` is conservative DPO (TRL's has
    none; ``robust`` is its form); ``ipo`` divides each log-ratio by its ``*_tokens``, as TRL."""
    chosen, rejected = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    delta, eps = chosen - rejected, label_smoothing
    if loss_type == "sigmoid":
        losses = smoothed(beta * delta, eps)
    elif loss_type == "robust":  # unbiased: the flipped label's term subtracted, rescaled
        flipped = eps * F.logsigmoid(-beta * delta)
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + flipped) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:  # ipo (DPO.loss_types: the config took no other)
        assert chosen_tokens is not None and rejected_tokens is not None
        delta = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    return losses.mean(), pair_metrics(chosen, rejected, beta, chosen_logps, rejected_logps)


class DPOSettings(Settings):
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """DPO: how likely a preference is flipped (conservative and robust DPO)."""


class DPO(Preference):
    name, reference, loss_types = "dpo", True, ("sigmoid", "ipo", "hinge", "robust")
    settings = DPOSettings

    def compute(
        self, logps: torch.Tensor, counts: torch.Tensor, ref: Any, batch: dict[str, Any], args: Any
    ) -> tuple[torch.Tensor, Metrics, dict[str, int]]:
        n = batch["pairs"]
        loss, metrics = dpo_loss(
            logps[:n],
            logps[n:],
            ref[:n],
            ref[n:],
            beta=args.beta,
            loss_type=args.loss_type or self.loss_types[0],
            label_smoothing=args.label_smoothing,
            chosen_tokens=counts[:n],
            rejected_tokens=counts[n:],
        )
        return loss, metrics, {}
