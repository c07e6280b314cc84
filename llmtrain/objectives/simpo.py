"""SimPO: token-averaged log-probs against a target margin; no reference."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from llmtrain.objectives.base import Settings
from llmtrain.objectives.preference import Metrics, Preference, pair_metrics, smoothed


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 0.0,
    chosen_nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SimPO (TRL's CPO ``loss_type="simpo"``): -log sigmoid(beta * (chosen - rejected) - gamma) on
    token-averaged log-probs, no reference; plus ``cpo_alpha`` * ``chosen_nll`` (CPO, off here)."""
    losses = smoothed(beta * (chosen_logps - rejected_logps - gamma / beta), label_smoothing)
    metrics = pair_metrics(chosen_logps, rejected_logps, beta, chosen_logps, rejected_logps)
    nll = chosen_nll if chosen_nll is not None else torch.zeros((), device=losses.device)
    metrics["nll_loss"] = nll.detach()
    return losses.mean() + cpo_alpha * nll, metrics


class SimPOSettings(Settings):
    simpo_gamma: float = Field(default=0.5, ge=0)
    """SimPO's target reward margin."""


class SimPO(Preference):
    name, settings = "simpo", SimPOSettings

    def compute(
        self, logps: torch.Tensor, counts: torch.Tensor, ref: Any, batch: dict[str, Any], args: Any
    ) -> tuple[torch.Tensor, Metrics, dict[str, int]]:
        n, means = batch["pairs"], logps / counts.clamp(min=1)
        return (*simpo_loss(means[:n], means[n:], beta=args.beta, gamma=args.simpo_gamma), {})
