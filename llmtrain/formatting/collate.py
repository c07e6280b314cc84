"""Examples to batches: right-padded, or packed several to a row without cross-attention.

Packing, as transformers 5.x (Llama, Qwen2, ...) supports it for eager and SDPA attention:
``create_causal_mask`` returns a 4D ``attention_mask`` unchanged, so :class:`PackedCollator`
passes a block-diagonal causal mask of shape ``[batch, 1, seq, seq]`` plus ``position_ids``
that restart at 0 for each example (RoPE then sees each example at its own positions).

Two traps this avoids, both checked by the tests:

* transformers only infers packing from ``position_ids`` alone when ``attention_mask`` is None
  *and* no cache exists; with the config default ``use_cache=True`` a cache is created even in
  training, the check is skipped and examples silently attend to each other;
* eager attention *adds* the 4D mask to the scores, so a boolean mask there is silently wrong
  (True becomes +1); eager needs an additive float mask in the model's dtype, while SDPA takes
  a boolean one. :func:`mask_dtype_for` picks the right one for a model.

Within a packed row, the first label of each example is set to ignored: it would otherwise be
predicted from the previous example's last token (it is never a target when unpacked either).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmtrain.errors import ConfigError
from llmtrain.formatting.tokenize import IGNORE_INDEX, Example

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def _count_targets(labels: torch.Tensor) -> torch.Tensor:
    """The number of terms in the shifted causal-LM loss: normalise by this, not by rows."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def pad_collate(
    examples: Sequence[Example], pad_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad ``examples`` into ``input_ids``, ``labels`` (ignored on padding),
    ``attention_mask`` and the scalar ``num_target_tokens``."""
    if not examples:
        raise ValueError("pad_collate: no examples")
    width = _round_up(max(len(e) for e in examples), pad_to_multiple_of)
    ids, labels, mask = [], [], []
    for e in examples:
        pad = width - len(e)
        ids.append(e.input_ids + [pad_id] * pad)
        labels.append(e.labels + [IGNORE_INDEX] * pad)
        mask.append([1] * len(e) + [0] * pad)
    label_tensor = torch.tensor(labels, dtype=torch.long)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "labels": label_tensor,
        "attention_mask": torch.tensor(mask, dtype=torch.long),
        "num_target_tokens": _count_targets(label_tensor),
    }


def pack_examples(examples: Sequence[Example], max_length: int) -> list[list[Example]]:
    """Greedy first-fit: each example goes into the first row with room, in input order."""
    rows: list[list[Example]] = []
    used: list[int] = []
    for e in examples:
        if not 0 < len(e) <= max_length:
            raise ConfigError(
                f"example with key {e.key!r} has {len(e)} tokens; packing needs 1 to "
                f"max_length={max_length} (format with the same max_length)"
            )
        for i, n in enumerate(used):
            if n + len(e) <= max_length:
                rows[i].append(e)
                used[i] += len(e)
                break
        else:
            rows.append([e])
            used.append(len(e))
    return rows


def block_causal_mask(sequence_ids: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` mask letting a token see only earlier tokens of its own
    sequence (same id in ``sequence_ids [batch, seq]``). Boolean (True = attend) for
    ``dtype=torch.bool``, otherwise additive: 0 to attend, the dtype's minimum to block."""
    index = torch.arange(sequence_ids.shape[-1], device=sequence_ids.device)
    allowed = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    allowed &= index[None, :] <= index[:, None]  # in place: 5x faster than a tril'd ones
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    return torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def mask_dtype_for(model: PreTrainedModel) -> torch.dtype:
    """The 4D mask dtype ``model`` needs: bool for SDPA, an additive float mask in the model's
    dtype for eager (which adds the mask to the scores). Other kernels are refused."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "sdpa":
        return torch.bool
    if impl == "eager":
        return model.dtype
    raise ConfigError(
        f"packing passes a 4D attention mask, which only the 'eager' and 'sdpa' "
        f"attention implementations accept; this model uses {impl!r}"
    )


class PackedCollator:
    """Packs examples into rows of at most ``max_length`` tokens.

    Returns ``input_ids``, ``labels``, ``position_ids`` (restarting at 0 per example), a 4D
    block-diagonal causal ``attention_mask`` of ``mask_dtype`` and ``num_target_tokens``. The
    default, an additive float32 mask, is correct for both eager and SDPA; pass
    ``mask_dtype_for(model)`` to get the 4x smaller boolean mask under SDPA. Padding after the
    last example forms its own causal block (so no attention row is empty, which would give
    NaN) and is never a target. Pass ``use_cache=False`` to the model when training: a cache
    is not needed and would only hold memory.
    """

    def __init__(
        self,
        max_length: int,
        pad_id: int,
        *,
        mask_dtype: torch.dtype = torch.float32,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if max_length < 1:
            raise ConfigError(f"max_length must be >= 1, got {max_length}")
        if pad_to_multiple_of and max_length % pad_to_multiple_of:
            raise ConfigError(
                f"max_length {max_length} must be a multiple of "
                f"pad_to_multiple_of {pad_to_multiple_of}"
            )
        self.max_length, self.pad_id = max_length, pad_id
        self.mask_dtype, self.pad_to_multiple_of = mask_dtype, pad_to_multiple_of

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        rows = pack_examples(examples, self.max_length)
        if not rows:
            raise ValueError("PackedCollator: no examples")
        width = _round_up(max(sum(map(len, row)) for row in rows), self.pad_to_multiple_of)
        ids, labels, positions, sequences = [], [], [], []
        for row in rows:
            row_ids: list[int] = []
            row_labels: list[int] = []
            row_pos: list[int] = []
            row_seq: list[int] = []
            for n, e in enumerate(row):
                row_ids += e.input_ids
                row_labels += [IGNORE_INDEX, *e.labels[1:]]
                row_pos += range(len(e))
                row_seq += [n] * len(e)
            pad = width - len(row_ids)
            ids.append(row_ids + [self.pad_id] * pad)
            labels.append(row_labels + [IGNORE_INDEX] * pad)
            positions.append(row_pos + list(range(pad)))
            sequences.append(row_seq + [-1] * pad)
        label_tensor = torch.tensor(labels, dtype=torch.long)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": label_tensor,
            "position_ids": torch.tensor(positions, dtype=torch.long),
            "attention_mask": block_causal_mask(torch.tensor(sequences), self.mask_dtype),
            "num_target_tokens": _count_targets(label_tensor),
        }


@dataclass(frozen=True)
class PaddingEfficiency:
    """Fractions of real (non-padding) tokens in the batches each strategy would build."""

    padded: float
    packed: float
    tokens: int


def padding_efficiency(
    examples: Sequence[Example],
    max_length: int,
    *,
    batch_size: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> PaddingEfficiency:
    """Compare :func:`pad_collate` with :class:`PackedCollator` over ``examples`` taken
    ``batch_size`` at a time (all at once when None), by the shapes they would produce."""
    size = batch_size or max(len(examples), 1)
    tokens = sum(map(len, examples))
    padded = packed = 0
    for start in range(0, len(examples), size):
        batch = examples[start : start + size]
        padded += len(batch) * _round_up(max(map(len, batch)), pad_to_multiple_of)
        rows = pack_examples(batch, max_length)
        packed += len(rows) * _round_up(max(sum(map(len, r)) for r in rows), pad_to_multiple_of)
    return PaddingEfficiency(
        padded=tokens / padded if padded else 1.0,
        packed=tokens / packed if packed else 1.0,
        tokens=tokens,
    )
