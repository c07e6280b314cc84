"""ORPO: the chosen answers' NLL, as SFT trains them, plus an odds-ratio term; no reference."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from llmtrain.objectives.preference import Metrics, Preference, pair_metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, by the branch that does not cancel."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
) -> tuple[torch.Tensor, Metrics]:
    """ORPO: ``chosen_nll`` - ``beta`` (the paper's lambda) * mean log sigmoid(log odds ratio) on
    token-averaged log-probs (TRL's ``chosen_nll`` covers the prompt too, the paper's does not)."""
    chosen, rejected = chosen_logps.float(), rejected_logps.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    metrics = pair_metrics(chosen, rejected, beta, chosen, rejected)
    metrics.update(
        nll_loss=chosen_nll.detach(),
        log_odds_ratio=ratio.detach().mean(),
        log_odds_chosen=log_odds.detach().mean(),
    )
    return chosen_nll - (beta * ratio).mean(), metrics


class ORPO(Preference):
    name = "orpo"

    def compute(
        self, logps: torch.Tensor, counts: torch.Tensor, ref: Any, batch: dict[str, Any], args: Any
    ) -> tuple[torch.Tensor, Metrics, dict[str, int]]:
        n, means = batch["pairs"], logps / counts.clamp(min=1)
        nll = -logps[:n].sum() / counts[:n].sum().clamp(min=1)
        return (*orpo_loss(means[:n], means[n:], nll, beta=args.beta), {})
