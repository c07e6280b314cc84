"""What preference objectives share: two sequences a row (the prompt with each answer) scored
as per-sequence log-probabilities, TRL's logged metrics, and the reference's values cached."""

from __future__ import annotations

import contextlib
import json
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmtrain.data.rows import ROLES, RowCheck, text_problem
from llmtrain.formatting import (
    IGNORE_INDEX,
    Example,
    Formatter,
    PackedCollator,
    pack_examples,
    pad_collate,
)
from llmtrain.objectives.base import Averaged, Batching, Objective, counted
from llmtrain.objectives.loss import LossFunction, sequence_logprobs
from llmtrain.objectives.reference import (
    ReferenceCache,
    pair_digest,
    reference_fingerprint,
    reference_model,
)

Metrics = dict[str, torch.Tensor]


def smoothed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """-log sigmoid(x), the label flipped with probability ``eps`` (conservative DPO)."""
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


def pair_metrics(good: torch.Tensor, bad: torch.Tensor, beta: float, *logps: Any) -> Metrics:
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


def answered(row: Mapping[str, Any], fields: Sequence[str]) -> tuple[str, str] | None:
    """A blank answer judges nothing."""
    for field in fields:
        if isinstance(row[field], str) and not row[field].strip():
            return field, "is empty: there is no answer to judge"
    return None


def messages(row: Mapping[str, Any], field: str, answer: bool) -> str | None:
    """TRL's conversational preference rows: a prompt as a list of messages (or its JSON text),
    an answer as one assistant message (made its text). Why not, or None (plain text too)."""
    value = row.get(field)
    if isinstance(value, str) and value.startswith("[{"):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    if not isinstance(value, list):
        return text_problem(row, field)
    if answer and [m.get("role") for m in value if isinstance(m, dict)] == ["assistant"]:
        row[field] = value[0].get("content")  # type: ignore[index]
        return text_problem(row, field)
    fine = (
        isinstance(m, dict) and m.get("role") in ROLES and not text_problem(m, "content")
        for m in value
    )
    if answer or not value or not all(fine):
        return "is not a prompt's messages (role, content) or one assistant answer"
    row[field] = value  # type: ignore[index]
    return None


def pair_problem(row: Mapping[str, Any], fields: Sequence[str]) -> tuple[str, str] | None:
    """A prompt (text or messages) and two different, non-blank answers to prefer between."""
    for i, field in enumerate(fields):
        if (problem := messages(row, field, answer=i > 0)) is not None:
            return field, problem
    _, chosen, rejected = fields
    if row[chosen] == row[rejected]:
        return rejected, f"equals field {chosen!r}: there is nothing to prefer"
    return answered(row, fields[1:])


class Preference(Objective):
    """Pairs: ``compute`` turns the batch's per-sequence log-probs into the loss."""

    roles, trains, shown = ("X", "chosen", "rejected"), "preferences", ("rewards/margins",)
    feedback = False  # the second sequence: the rejected answer (or KTO's mismatched one)

    def row_check(self) -> RowCheck | None:
        return pair_problem

    def problems(self, config: Any) -> list[str]:
        name, problems = self.name, []
        if not config.objective_args.beta:
            problems.append(f"objective={name!r} with beta=0: its loss needs beta > 0")
        if config.fit is not None and config.fit.query().kind == "mix":
            problems.append(f"objective={name!r} trains one source, not lt.mix(...)")
        if self.reference and config.lora_args is None:
            problems.append(
                f"objective={name!r} with lora_args=None: the reference is the model "
                "with its adapter off; train an adapter"
            )
        if config.training_args.eval_metrics:
            problems.append(
                f"training_args.eval_metrics compare answers with Y; "
                f"objective={name!r} logs preference accuracy and margins"
            )
        return problems

    def collate(self, how: Batching) -> PairCollate:
        per_batch = how.batch_size if how.token_budget is not None else None
        f, (answer, second) = how.formatters[0], how.fields[1:]
        return PairCollate(
            f, answer, second, how.pad_id, how.source, how.packer, per_batch, self.feedback
        )

    def loss(self, run: Any) -> PreferenceLoss:
        """With a reference, its values are cached by its identity (base, precision, parent)."""
        cache, config = None, run.config
        if self.reference:
            parent = (run.plan.parent or {}).get("adapter")
            fingerprint = reference_fingerprint(config.model_args, str(run.precision), parent)
            cache = ReferenceCache(run.db, fingerprint)
        return PreferenceLoss(self, run.base_model, config.objective_args, cache)

    @abstractmethod
    def compute(
        self, logps: torch.Tensor, counts: torch.Tensor, ref: Any, batch: dict[str, Any], args: Any
    ) -> tuple[torch.Tensor, Metrics, dict[str, int]]:
        """(loss, metrics, each metric's row count where not every pair's) of ``n`` pairs:
        chosen (or the completion) first, then rejected (or the mismatched)."""

    def summarized(self, means: dict[str, float]) -> dict[str, float]:
        """The logged means, completed where the objective derives a metric from others."""
        return means


@dataclass
class PairCollate:
    """Preference rows (the reader checked them) -> two sequences a row: the prompt with the answer
    (``chosen``, or KTO's completion), then with ``second`` (the rejected answer) or, with
    ``feedback`` (``second``: the label), the previous row's completion, KTO's mismatched pair for
    its KL estimate (TRL's). ``num_target_tokens`` counts rows, what a step is normalised by;
    ``per_batch``: each micro-batch's rows when the loader hands over a step's rows at once."""

    formatter: Formatter
    answer: str
    second: str
    pad_id: int
    source: str
    packer: PackedCollator | None
    per_batch: int | None = None
    feedback: bool = False

    def __call__(self, rows: list[tuple[Any, dict[str, Any]]]) -> Any:
        if self.per_batch is None:
            return self._pairs(rows)
        size = self.per_batch
        return [self._pairs(rows[i : i + size]) for i in range(0, len(rows), size)]

    def _pairs(self, rows: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        f, n = self.formatter, len(rows)
        donors = rows[-1:] + rows[:-1] if self.feedback else rows  # feedback: the row before's
        field = self.answer if self.feedback else self.second
        others = [(k, {**r, self.answer: s[field]}) for (k, r), (_, s) in zip(rows, donors)]
        examples = f.format_pairs(rows, others, mismatched=self.feedback, source=self.source)
        if not f.train_on_inputs:  # both sequences after the same prompt ids: the shorter one
            for i in range(n):
                examples[i], examples[n + i] = same_prompt(examples[i], examples[n + i])
        if self.packer is None:
            batch = pad_collate(examples, self.pad_id)
        else:
            packed = pack_examples(examples, self.packer.max_length)
            batch = self.packer.collate_rows(packed, sequences=examples)
        pairs = zip(rows, examples[:n], examples[n:])
        digests = [pair_digest(key, a.input_ids, b.input_ids) for (key, _), a, b in pairs]
        liked = {"liked": [row[self.second] for _, row in rows]} if self.feedback else {}
        counts = {"num_target_tokens": n, "pairs": n, "pair_digests": digests}
        return counted(batch, examples) | counts | liked


def same_prompt(a: Example, b: Example) -> tuple[Example, Example]:
    """A pair's sequences after one prompt: a long answer cuts its prompt from the left (BOS and
    the prompt's end kept), so the other takes that shorter prompt too, and the two log-probs
    compare answers to the same context."""
    na, nb = (
        next((i for i, t in enumerate(e.labels) if t != IGNORE_INDEX), len(e)) for e in (a, b)
    )
    if a.input_ids[:na] == b.input_ids[:nb]:
        return a, b
    short, n = (a.input_ids[:na], na) if na < nb else (b.input_ids[:nb], nb)
    long = b.input_ids[:nb] if na < nb else a.input_ids[:na]
    head = next((i for i, (s, t) in enumerate(zip(short, long)) if s != t), n)  # BOS
    if head == n or short[head:] != long[len(long) - (n - head) :]:
        return a, b  # not one prompt cut from the left: left as they are

    def cut(e: Example, m: int) -> Example:
        ids = short + e.input_ids[m:]
        return Example(ids, [IGNORE_INDEX] * n + e.labels[m:], e.key, truncated=True)

    return (a, cut(b, nb)) if na < nb else (cut(a, na), b)


class PreferenceLoss:
    """``loss(model, batch)``, summed over its ``pairs``; metrics add up until :meth:`logged`."""

    def __init__(
        self, objective: Preference, base: Any, args: Any, cache: ReferenceCache | None = None
    ) -> None:
        self.objective, self.base, self.args, self.cache = objective, base, args, cache
        self.head = LossFunction(base)  # the unwrapped model's head, found once
        self.metrics = Averaged()

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        n = int(batch.get("pairs", 0))
        logps, counts = sequence_logprobs(model, batch, head=self.head, num_sequences=2 * n)
        if n == 0:  # a rank's filler batch (every row skipped): its collectives, no gradient
            return logps.sum()
        ref = None
        if self.objective.reference:
            ref = self._reference(model, batch, n).to(logps.device)
        loss, metrics, weights = self.objective.compute(logps, counts, ref, batch, self.args)
        self.metrics.add(metrics, n, weights)
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
        return self.objective.summarized(self.metrics.logged())
