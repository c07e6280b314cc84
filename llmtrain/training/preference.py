"""Per-sequence log-probabilities without the full logits, and the DPO, KTO, ORPO and SimPO losses
as pure tensor functions (TRL 1.16's formulas and defaults). A :func:`sequence_logprobs` batch is
padded (``input_ids``, ``labels``, ``attention_mask`` [B, T]; sequence ``i``: row ``i``) or packed
(``position_ids`` restart at 0 per sequence, no ``attention_mask``: transformers keeps sequences
apart; ``sequence_index`` [B, T]: each token's sequence). ``labels``: IGNORE_INDEX if unscored."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llmtrain.formatting import IGNORE_INDEX
from llmtrain.training.loss import CHUNK_ELEMENTS, LossFunction, model_inputs
from llmtrain.training.reference import ReferenceCache

Metrics = dict[str, torch.Tensor]


def _targets(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask over the shifted positions, target ids, their sequence); position 0 is no target."""
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    if "position_ids" in batch:
        keep &= batch["position_ids"][:, 1:] != 0
    index = batch.get("sequence_index")
    if index is None:
        rows = torch.arange(labels.size(0), device=labels.device)
        index = rows[:, None].expand_as(batch["labels"])
    return keep, labels[keep], index[:, 1:][keep]


def _per_sequence(
    logps: torch.Tensor, index: torch.Tensor, batch: dict[str, Any], size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if size is None:  # the packed case reads the device once: pass num_sequences to avoid it
        packed = "sequence_index" in batch
        size = int(batch["sequence_index"].max()) + 1 if packed else batch["labels"].size(0)
    return logps.new_zeros(size).index_add(0, index, logps), torch.bincount(index, minlength=size)


def plain_sequence_logprobs(
    model: Any, batch: dict[str, Any], *, num_sequences: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logprobs` from the full logits (the reference; softcapped heads)."""
    keep, targets, index = _targets(batch)
    logits = model(**model_inputs(batch), use_cache=False).logits[:, :-1][keep]
    logps = logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    return _per_sequence(logps, index, batch, num_sequences)


def sequence_logprobs(
    model: Any,
    batch: dict[str, Any],
    *,
    head: LossFunction | None = None,
    num_sequences: int | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(target) [S] float32, target count [S]) per sequence; the head projects only
    targets, a chunk at a time, checkpointed: the gradient is only known after the forward."""
    found = head if head is not None else LossFunction(model, chunk_elements=chunk_elements)
    if not found.chunked:
        return plain_sequence_logprobs(model, batch, num_sequences=num_sequences)
    keep, targets, index = _targets(batch)

    def logps_from_hidden(hidden: torch.Tensor, own_forward: Any) -> torch.Tensor:
        def chunk_logps(hidden: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
            logits = own_forward(hidden).float()
            return logits.log_softmax(-1).gather(-1, picked[:, None]).squeeze(-1)

        selected, size = hidden[:, :-1][keep], found.chunk
        compute: Callable[..., torch.Tensor] = chunk_logps
        if torch.is_grad_enabled():
            compute = partial(checkpoint, chunk_logps, use_reentrant=False)
        starts = range(0, selected.size(0), size)
        parts = [compute(selected[i : i + size], targets[i : i + size]) for i in starts]
        return torch.cat(parts) if parts else selected.new_zeros(0, dtype=torch.float32)

    logps = found.through_head(model, batch, logps_from_hidden)
    return _per_sequence(logps, index, batch, num_sequences)


def _smoothed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """-log sigmoid(x), the label flipped with probability ``eps`` (conservative DPO)."""
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


def _pair_metrics(good: torch.Tensor, bad: torch.Tensor, beta: float, *logps: Any) -> Metrics:
    """TRL's logged names, means of detached tensors (no device read); rewards: ``beta`` * x."""
    chosen, rejected = beta * good.detach(), beta * bad.detach()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": logps[0].detach().mean(),
        "logps/rejected": logps[1].detach().mean(),
    }


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
        losses = _smoothed(beta * delta, eps)
    elif loss_type == "robust":  # unbiased: the flipped label's term subtracted, rescaled
        flipped = eps * F.logsigmoid(-beta * delta)
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + flipped) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_loss: loss_type='ipo' needs chosen_tokens and rejected_tokens")
        delta = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r}")
    return losses.mean(), _pair_metrics(chosen, rejected, beta, chosen_logps, rejected_logps)


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl_logps: torch.Tensor | None,
    ref_kl_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, Metrics]:
    """KTO on summed log-probs; the reference point: the mean log-ratio on mismatched completions
    (``kl_*``), detached, clamped at 0 (0 without). Metrics of a kind the batch lacks are nan."""
    kl = torch.zeros((), device=logps.device)
    if kl_logps is not None and ref_kl_logps is not None:
        kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    ratios = logps - ref_logps
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (ratios - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratios))),
    )
    good, bad = desirable.float(), 1 - desirable.float()

    def mean(x: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
        return (x.detach() * of).sum() / of.sum()

    chosen, rejected = mean(beta * ratios, good), mean(beta * ratios, bad)
    return losses.mean(), {
        "kl": kl,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "logps/chosen": mean(logps, good),
        "logps/rejected": mean(logps, bad),
    }


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
    metrics = _pair_metrics(chosen, rejected, beta, chosen, rejected)
    metrics.update(
        nll_loss=chosen_nll.detach(),
        log_odds_ratio=ratio.detach().mean(),
        log_odds_chosen=log_odds.detach().mean(),
    )
    return chosen_nll - (beta * ratio).mean(), metrics


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
    if cpo_alpha and chosen_nll is None:
        raise ValueError("simpo_loss: cpo_alpha needs chosen_nll")
    losses = _smoothed(beta * (chosen_logps - rejected_logps - gamma / beta), label_smoothing)
    metrics = _pair_metrics(chosen_logps, rejected_logps, beta, chosen_logps, rejected_logps)
    nll = chosen_nll if chosen_nll is not None else torch.zeros((), device=losses.device)
    metrics["nll_loss"] = nll.detach()
    return losses.mean() + cpo_alpha * nll, metrics


PREFERENCE = ("dpo", "kto", "orpo", "simpo")
WITH_REFERENCE = ("dpo", "kto")
#: a reference adapter: the adapter an earlier model trained, kept frozen beside the trained one
REFERENCE = "reference"


@contextmanager
def reference_model(base: Any) -> Iterator[None]:
    """The reference: the :data:`REFERENCE` adapter, set on each LoRA layer (PEFT's ``set_adapter``
    would touch ``requires_grad`` under a wrapped model), else the base with its adapter off."""
    if REFERENCE not in getattr(base, "peft_config", {}):
        with base.disable_adapter():
            yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in base.modules() if isinstance(m, BaseTunerLayer)]
    active = [layer.active_adapters for layer in layers]
    for layer in layers:
        layer._active_adapter = [REFERENCE]
    try:
        yield
    finally:
        for layer, names in zip(layers, active):
            layer._active_adapter = names


class PreferenceLoss:
    """``loss(model, batch)``, summed over ``pairs`` rows (chosen or KTO's completion first, then
    rejected or mismatched); metrics add up until :meth:`logged`, each over its rows."""

    def __init__(self, base: Any, args: Any, cache: ReferenceCache | None = None) -> None:
        self.base, self.args, self.cache = base, args, cache
        self.head = LossFunction(base)  # the unwrapped model's head, found once
        self.sums: dict[str, list[float | torch.Tensor]] = {}

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        a, n = self.args, int(batch.get("pairs", 0))
        logps, counts = sequence_logprobs(model, batch, head=self.head, num_sequences=2 * n)
        if n == 0:  # a rank's filler batch (every row skipped): its collectives, no gradient
            return logps.sum()
        means = logps / counts.clamp(min=1)
        weights: dict[str, int] = {}
        if a.objective in WITH_REFERENCE:
            ref = self._reference(model, batch, n).to(logps.device)
        if a.objective == "dpo":
            loss, metrics = dpo_loss(
                logps[:n],
                logps[n:],
                ref[:n],
                ref[n:],
                beta=a.beta,
                loss_type=a.loss_type,
                label_smoothing=a.label_smoothing,
                chosen_tokens=counts[:n],
                rejected_tokens=counts[n:],
            )
        elif a.objective == "kto":
            liked = sum(batch["liked"])  # margins: of the means, in logged()
            weights = {"chosen": liked, "rejected": n - liked, "margins": 0}
            loss, metrics = kto_loss(
                logps[:n],
                ref[:n],
                torch.tensor(batch["liked"], device=logps.device),
                logps[n:],
                ref[n:],
                beta=a.beta,
                desirable_weight=a.desirable_weight or 1.0,
                undesirable_weight=a.undesirable_weight or 1.0,
            )
        elif a.objective == "orpo":  # the NLL of the chosen answers, as SFT would train them
            nll = -logps[:n].sum() / counts[:n].sum().clamp(min=1)
            loss, metrics = orpo_loss(means[:n], means[n:], nll, beta=a.beta)
        else:
            loss, metrics = simpo_loss(means[:n], means[n:], beta=a.beta, gamma=a.simpo_gamma)
        for name, value in metrics.items():
            if weight := weights.get(name.rsplit("/", 1)[-1], n):
                total = self.sums.setdefault(name, [0.0, 0])
                total[0] = total[0] + value.detach().float() * weight
                total[1] = total[1] + weight
        return loss * n

    def _reference(self, model: Any, batch: dict[str, Any], n: int) -> torch.Tensor:
        """The reference's log-probs, from the cache, else a forward (kept for next time)."""
        digests = batch.get("pair_digests") or []
        kept = self.cache.get(digests) if self.cache is not None else None
        if kept is not None:
            return torch.tensor([c for c, _ in kept] + [r for _, r in kept])
        with torch.no_grad(), reference_model(self.base):
            ref, _ = sequence_logprobs(model, batch, head=self.head, num_sequences=2 * n)
        if self.cache is not None:
            values = ref.float().cpu().tolist()
            self.cache.add(digests, values[:n], values[n:])
        return ref

    def logged(self) -> dict[str, float]:
        """The mean of each metric over its rows since the last call (reads the device)."""
        sums, self.sums = self.sums, {}
        out = {name: float(total) / max(float(rows), 1) for name, (total, rows) in sums.items()}
        if self.args.objective == "kto" and {"rewards/chosen", "rewards/rejected"} <= set(out):
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out
