"""Evaluation beyond loss: the eval rows answered by greedy generation and scored.

A metric is a built-in name (``exact_match``, ``contains``) or a user function
``(prediction, reference) -> float`` named by its import path ``package.module:function``:
the path is what the trainer's record stores (never a pickle), and it is imported when the
config is built, so a typo fails there, naming the field. Each metric is logged per eval step
as ``eval_<name>`` (``eval_exact_match``, ``eval_<function>``), the mean over the rows scored.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmtrain.formatting import Prompt

Metric = Callable[[str, str], float]

_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the answer is the reference, surrounding whitespace aside."""
    return float(prediction.strip() == reference.strip())


def contains(prediction: str, reference: str) -> float:
    """1.0 when the reference (stripped) appears in the answer."""
    return float(reference.strip() in prediction)


BUILTIN: dict[str, Metric] = {"exact_match": exact_match, "contains": contains}


def logged_name(entry: str) -> str:
    """The metric's key in the run's metrics: ``exact_match`` -> ``eval_exact_match``,
    ``pkg.mod:f1`` -> ``eval_f1``; ``eval_loss`` (and any ``eval_`` name) stays."""
    name = entry.rsplit(":", 1)[-1]
    return name if name.startswith("eval_") else f"eval_{name}"


def resolve(entry: str) -> Metric:
    """The function an eval_metrics entry names (ValueError saying why it cannot be had)."""
    if entry in BUILTIN:
        return BUILTIN[entry]
    if not _PATH.match(entry):
        raise ValueError(
            f"{entry!r} is neither {' nor '.join(repr(b) for b in BUILTIN)} nor an import "
            "path 'package.module:function'"
        )
    module, name = entry.split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{entry!r} cannot be imported ({type(exc).__name__}: {exc})") from None
    if not callable(fn):
        raise ValueError(f"{entry!r} is not callable")
    return fn


def metric_problems(entries: Sequence[str], save_best_by: str | None) -> list[str]:
    """Every bad eval_metrics entry and an unknown save_best_by, each naming its field."""
    problems = []
    for i, entry in enumerate(entries):
        try:
            resolve(entry)
        except ValueError as exc:
            problems.append(f"eval_metrics[{i}]: {exc}")
    names = [logged_name(e) for e in entries]
    if len(set(names)) < len(names):
        problems.append(f"eval_metrics: two entries log as the same name {names}")
    if save_best_by is not None and logged_name(save_best_by) not in {"eval_loss", *names}:
        choices = ", ".join(["eval_loss", *entries])
        problems.append(f"save_best_by={save_best_by!r} is not scored: choose one of {choices}")
    return problems


class _Healing:
    """A logits processor: until a row's generated text has re-spelled its prompt's ``heal``
    (see :mod:`llmtrain.formatting.tokenize`), only tokens that continue it may come."""

    def __init__(self, tokenizer: Any, heals: Sequence[str], width: int) -> None:
        self.heals, self.width = heals, width
        self.texts = token_texts(tokenizer)
        self._allowed: dict[str, torch.Tensor] = {}

    def allowed(self, rest: str) -> torch.Tensor:
        if rest not in self._allowed:
            ids = [
                i
                for i, text in enumerate(self.texts)
                if text and (text.startswith(rest) or rest.startswith(text))
            ]
            self._allowed[rest] = torch.tensor(ids, dtype=torch.long)
        return self._allowed[rest]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, heal in enumerate(self.heals):
            made = "".join(self.texts[t] for t in input_ids[row, self.width :].tolist())
            if len(made) >= len(heal):
                continue
            keep = self.allowed(heal[len(made) :]).to(scores.device)
            masked = torch.full_like(scores[row], -math.inf)
            masked[keep] = scores[row, keep]
            scores[row] = masked
        return scores


_TEXTS: dict[int, tuple[Any, list[str]]] = {}


def token_texts(tokenizer: Any) -> list[str]:
    """Each token id's text as it reads after another token (``Ġbanana`` -> ``" banana"``,
    ``▁banana`` too), found once per tokenizer by decoding it behind an anchor token."""
    known = _TEXTS.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    anchor = tokenizer("a", add_special_tokens=False)["input_ids"][:1]
    lead = len(tokenizer.decode(anchor))
    pairs = [anchor + [i] for i in range(len(tokenizer))]
    texts = [t[lead:] for t in tokenizer.batch_decode(pairs, clean_up_tokenization_spaces=False)]
    _TEXTS[id(tokenizer)] = (tokenizer, texts)
    return texts


def generate_batch(
    model: Any, tokenizer: Any, prompts: Sequence[Prompt], max_new_tokens: int, **kwargs: Any
) -> list[str]:
    """Answers (greedy unless ``kwargs`` say otherwise) to prompts, in one left-padded batch;
    a prompt's ``heal`` is generated first and left out of its answer."""
    from transformers import LogitsProcessorList

    pad = tokenizer.pad_token_id
    width = max(len(p.ids) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p.ids)) + p.ids for p in prompts])
    mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts])
    device = next(model.parameters()).device
    greedy: dict[str, Any] = {
        "do_sample": False,
        "pad_token_id": pad,
        "eos_token_id": tokenizer.eos_token_id,
    }
    heals = [p.heal for p in prompts]
    if any(heals):
        healing = _Healing(tokenizer, heals, width)
        greedy["logits_processor"] = LogitsProcessorList([healing])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            **{**greedy, **kwargs},
        )
    answers = [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]
    return [a.removeprefix(h) for a, h in zip(answers, heals)]
