"""Generation: answers to prompts (greedy by default), their healed text re-spelled first."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from llmtrain.formatting import Prompt


class _Healing:
    """Logits processor: until a row re-spells its prompt's ``heal``, only tokens continuing it."""

    def __init__(self, tokenizer: Any, heals: Sequence[str], width: int) -> None:
        self.heals, self.width = heals, width
        self.texts = token_texts(tokenizer)
        self._allowed: dict[str, torch.Tensor] = {}

    def allowed(self, rest: str) -> torch.Tensor:
        if rest not in self._allowed:
            texts = enumerate(self.texts)
            ids = [i for i, t in texts if t and (t.startswith(rest) or rest.startswith(t))]
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


@functools.cache
def token_texts(tokenizer: Any) -> list[str]:
    """Each token's text after another token (``Ġbanana``, ``▁banana`` -> ``" banana"``)."""
    anchor = tokenizer("a", add_special_tokens=False)["input_ids"][:1]
    lead = len(tokenizer.decode(anchor))
    pairs = [anchor + [i] for i in range(len(tokenizer))]
    return [t[lead:] for t in tokenizer.batch_decode(pairs, clean_up_tokenization_spaces=False)]


def generate_batch(
    model: Any, tokenizer: Any, prompts: Sequence[Prompt], max_new_tokens: int, **kwargs: Any
) -> list[str]:
    """Answers to ``prompts`` in one left-padded batch, each without its generated ``heal``."""
    from transformers import LogitsProcessorList

    pad = tokenizer.pad_token_id
    width = max(len(p.ids) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p.ids)) + p.ids for p in prompts])
    mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts])
    device = next(model.parameters()).device
    greedy: dict[str, Any] = dict(
        do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id
    )
    heals = [p.heal for p in prompts]
    if any(heals):
        greedy["logits_processor"] = LogitsProcessorList([_Healing(tokenizer, heals, width)])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            **{**greedy, **kwargs},
        )
    answers = [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]
    return [a.removeprefix(h) for a, h in zip(answers, heals)]
