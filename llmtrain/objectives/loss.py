"""The training loss without the full logits (8.4 GB of float32 at vocab 128k, 8 x 2048 tokens):
the head projects only targets a chunk at a time, gradients taken in the forward (Liger's scheme):
peak RSS 0.22x the plain path's at 1 x 2048 (``benchmarks/bench_loss_memory.py``). Gemma-2's
softcapped logits take the plain path. Preference objectives take per-sequence log-probabilities
the same way: a batch is padded (sequence ``i``: row ``i``) or packed (``position_ids`` restart
at 0 per sequence; ``sequence_index`` [B, T]: each token's sequence)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llmtrain.formatting import IGNORE_INDEX

#: logits elements per chunk: 2**24 float32 values (64 MB, and as much for their gradient)
CHUNK_ELEMENTS = 2**24
_INPUTS = ("input_ids", "attention_mask", "position_ids")


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: batch[k] for k in _INPUTS if k in batch}


def plain_loss_sum(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Summed next-token loss over target tokens from the full logits (the reference)."""
    logits = model(**model_inputs(batch), use_cache=False).logits[:, :-1]
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of head(hidden), its gradient taken a chunk at a time in the forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        chunk: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        # the inputs whose gradient is wanted: hidden, then the head's trainable parameters
        need = [bool(n) for i, n in enumerate(ctx.needs_input_grad) if i == 0 or i >= 4]
        grads: list[Any] = [
            torch.zeros_like(t) if n else None for t, n in zip([hidden, *params], need)
        ]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), chunk):
            rows = slice(start, start + chunk)
            with torch.set_grad_enabled(any(need)):
                h = hidden[rows].detach().requires_grad_(need[0])
                loss = F.cross_entropy(head(h).float(), targets[rows], reduction="sum")
                if any(need):
                    inputs = [t for t, n in zip([h, *params], need, strict=True) if n]
                    found = torch.autograd.grad(loss, inputs, allow_unused=True)
                    for i, g in zip([i for i, n in enumerate(need) if n], found):
                        if g is not None and i == 0:
                            grads[0][rows] = g
                        elif g is not None:
                            grads[i] += g
            total += loss.detach()
        ctx.grads = grads  # a weight no target touched (no targets at all) gets zeros
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        scaled = [None if g is None else g * grad_out.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return (scaled[0], None, None, None, *scaled[1:])


class LossFunction:
    """``loss(model, batch)``: the summed next-token cross-entropy (float32) over the batch's
    targets. ``base`` is the unwrapped model whose head is swapped; ``model`` what wraps it."""

    def __init__(self, base: Any, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        self.head: torch.nn.Module = base.get_output_embeddings()
        config = getattr(base, "config", None)
        softcapped = getattr(config, "final_logit_softcapping", None) is not None
        self.chunked = self.head is not None and not softcapped
        vocab = int(getattr(self.head, "out_features", 0) or getattr(config, "vocab_size", 1))
        self.chunk = max(1, chunk_elements // max(vocab, 1))

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        if not self.chunked:
            return plain_loss_sum(model, batch)
        targets = batch["labels"][:, 1:]
        keep = targets != IGNORE_INDEX

        def loss_from_hidden(hidden: torch.Tensor, own_forward: Callable[..., Any]) -> Any:
            selected = hidden[:, :-1][keep]
            picked = targets[keep]
            params = [p for p in self.head.parameters() if p.requires_grad]
            return _ChunkedCrossEntropy.apply(selected, picked, own_forward, self.chunk, *params)

        return self.through_head(model, batch, loss_from_hidden)

    def logged(self) -> dict[str, float]:
        return {}

    def through_head(
        self, model: Any, batch: dict[str, Any], on_hidden: Callable[..., Any]
    ) -> torch.Tensor:
        """A forward whose head returns ``on_hidden(hidden, own_forward)`` (its hooks still run)."""
        head = self.head
        own_forward = type(head).forward.__get__(head)  # the module's own, adapters included
        head.forward = lambda hidden: on_hidden(hidden, own_forward)
        try:
            return model(**model_inputs(batch), use_cache=False).logits
        finally:
            del head.forward


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


def target_logprobs(
    model: Any,
    batch: dict[str, Any],
    *,
    head: LossFunction | None = None,
    plain: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """log p(target) of each target token, float32, flat in the order of the batch's target
    mask; the head projects only targets, a chunk at a time, checkpointed (the gradient is only
    known after the forward). ``plain``: from the full logits (the reference; softcapped heads)."""
    found = head if head is not None else LossFunction(model, chunk_elements=chunk_elements)
    keep, targets, _ = _targets(batch)
    if plain or not found.chunked:
        logits = model(**model_inputs(batch), use_cache=False).logits[:, :-1][keep]
        return logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)

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

    return found.through_head(model, batch, logps_from_hidden)


def sequence_logprobs(
    model: Any,
    batch: dict[str, Any],
    *,
    head: LossFunction | None = None,
    num_sequences: int | None = None,
    plain: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(target) [S] float32, target count [S]) per sequence."""
    logps = target_logprobs(model, batch, head=head, plain=plain, chunk_elements=chunk_elements)
    index, size = _targets(batch)[2], num_sequences
    if size is None:  # the packed case reads the device once: pass num_sequences to avoid it
        packed = "sequence_index" in batch
        size = int(batch["sequence_index"].max()) + 1 if packed else batch["labels"].size(0)
    return logps.new_zeros(size).index_add(0, index, logps), torch.bincount(index, minlength=size)


def plain_sequence_logprobs(
    model: Any, batch: dict[str, Any], *, num_sequences: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logprobs` from the full logits."""
    return sequence_logprobs(model, batch, num_sequences=num_sequences, plain=True)
