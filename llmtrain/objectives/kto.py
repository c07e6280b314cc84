"""KTO: (prompt, completion, liked) feedback on single answers against the reference; the
reference point is the log-ratio on mismatched completions (each prompt with its micro-batch
neighbour's answer, TRL's pairing); default weights balance liked and disliked rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import Field

from llmtrain.console import say
from llmtrain.data.rows import RowCheck, text_problem
from llmtrain.data.snapshot import value_counts
from llmtrain.objectives.base import Settings
from llmtrain.objectives.preference import Metrics, Preference, answered


def label_problem(row: Mapping[str, Any], field: str) -> str | None:
    """Why ``row[field]`` is not a like (true, 1) or a dislike (false, 0); made a bool."""
    value = row.get(field)
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        row[field] = bool(value)  # type: ignore[index]
        return None
    return f"is {value!r}, not a label (true/false or 1/0)"


def feedback_problem(row: Mapping[str, Any], fields: Sequence[str]) -> tuple[str, str] | None:
    """A text prompt and completion, and a label (made a bool)."""
    *texts, label = fields
    for field in texts:
        if (problem := text_problem(row, field)) is not None:
            return field, problem
    if (problem := label_problem(row, label)) is not None:
        return label, problem
    return answered(row, texts[1:])


def label_counts(db: Any, query: Any, view: Any, label: str) -> tuple[int, int]:
    """(liked, disliked) rows of the snapshot's ``view``; a value that is no label does not
    count, as the reader would skip it."""
    counts = {True: 0, False: 0}
    for (_, value), n in value_counts(db, query, view, label).items():
        row = {label: value}
        if label_problem(row, label) is None:
            counts[bool(row[label])] += n
    return counts[True], counts[False]


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, Metrics]:
    """KTO on summed log-probs; the reference point: the mean log-ratio on mismatched completions
    (``kl_*``), detached, clamped at 0. Metrics of a kind the batch lacks are nan."""
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


class KTOSettings(Settings):
    desirable_weight: float | None = Field(default=None, gt=0)
    """KTO: the weight of liked completions. Both None: disliked / liked from the snapshot's
    label counts (undesirable 1), so each kind weighs the same (recorded); one None: 1."""
    undesirable_weight: float | None = Field(default=None, gt=0)
    """KTO: the weight of disliked completions (see desirable_weight)."""


class KTO(Preference):
    name, roles, trains = "kto", ("X", "Y", "label"), "feedback on single answers"
    reference, feedback, settings = True, True, KTOSettings

    def row_check(self) -> RowCheck | None:
        return feedback_problem

    def problems(self, config: Any) -> list[str]:
        problems, best = super().problems(config), config.training_args.best_key()
        if best == "eval_rewards/accuracies":
            problems.append(
                f"training_args.save_best_by={best!r}: KTO has no pairs to be accurate on; "
                "use eval_rewards/margins"
            )
        if config.training_args.per_device_train_batch_size < 2:
            problems.append(
                "objective='kto' with per_device_train_batch_size=1: KTO's KL estimate pairs "
                "each prompt with another row's completion of its micro-batch; use 2 or more"
            )
        return problems

    def prepare(self, db: Any, config: Any, snapshot: Any) -> Any:
        """The weights (KTOSettings') the run records: a resume keeps them, a replay counts its
        own snapshot."""
        args, fit = config.objective_args, config.fit
        desirable, undesirable = args.desirable_weight, args.undesirable_weight
        if desirable is None and undesirable is None:
            liked, disliked = label_counts(db, fit.query(), snapshot.train, fit.label)
            desirable = disliked / liked if liked and disliked else 1.0
            say(
                f"{config.identifier}: {liked} liked and {disliked} disliked row(s): KTO "
                f"desirable_weight={desirable:.4g}, undesirable_weight=1"
            )
        weights = {"desirable_weight": desirable or 1.0, "undesirable_weight": undesirable or 1.0}
        return config.model_copy(update={"objective_args": args.model_copy(update=weights)})

    def compute(
        self, logps: torch.Tensor, counts: torch.Tensor, ref: Any, batch: dict[str, Any], args: Any
    ) -> tuple[torch.Tensor, Metrics, dict[str, int]]:
        n, liked = batch["pairs"], sum(batch["liked"])  # margins: of the means, when logged
        loss, metrics = kto_loss(
            logps[:n],
            ref[:n],
            torch.tensor(batch["liked"], device=logps.device),
            logps[n:],
            ref[n:],
            beta=args.beta,
            desirable_weight=args.desirable_weight or 1.0,
            undesirable_weight=args.undesirable_weight or 1.0,
        )
        return loss, metrics, {"chosen": liked, "rejected": n - liked, "margins": 0}

    def summarized(self, means: dict[str, float]) -> dict[str, float]:
        """Margins of the means: liked and disliked rewards are means of different rows."""
        if {"rewards/chosen", "rewards/rejected"} <= set(means):
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        return means
