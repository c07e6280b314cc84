"""Examples to batches: right-padded, or packed several to a row. Packed rows carry
``position_ids`` restarting at 0 per example and no ``attention_mask``: transformers 5.x finds the
example boundaries from them (eager, SDPA, flex; flash attention only in a single row, hence
``flat``). Call the model with ``use_cache=False``: with a cache it skips the detection and
examples silently attend to each other. An example's first label is ignored (the previous example
would predict it); padding is its own run of positions."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from llmtrain.errors import ConfigError
from llmtrain.formatting.tokenize import IGNORE_INDEX, Example


def _long(rows: list[list[int]]) -> torch.Tensor:
    return torch.from_numpy(np.array(rows, dtype=np.int64))


def _batch(
    ids: list[list[int]], labels: list[list[int]], name: str, values: list[list[int]]
) -> dict[str, torch.Tensor]:
    """The tensors, with ``values`` as ``name``, and ``num_target_tokens`` (the terms of the
    shifted loss). Built through NumPy: 3x faster than ``torch.tensor`` on nested lists."""
    label_tensor = _long(labels)
    return {
        "input_ids": _long(ids),
        "labels": label_tensor,
        name: _long(values),
        "num_target_tokens": (label_tensor[:, 1:] != IGNORE_INDEX).sum(),
    }


def pad_collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``examples`` into ``input_ids``, ``labels``, ``attention_mask``."""
    width = max(len(e) for e in examples)
    ids = [e.input_ids + [pad_id] * (width - len(e)) for e in examples]
    labels = [e.labels + [IGNORE_INDEX] * (width - len(e)) for e in examples]
    mask = [[1] * len(e) + [0] * (width - len(e)) for e in examples]
    return _batch(ids, labels, "attention_mask", mask)


def pack_examples(examples: Sequence[Example], max_length: int) -> list[list[Example]]:
    """Best-fit-decreasing (longest first, into the fullest row it fits); all in input order."""
    for e in examples:
        if not 0 < len(e) <= max_length:
            raise ConfigError(
                f"example with key {e.key!r} has {len(e)} tokens; packing needs 1 to "
                f"max_length={max_length} (format with the same max_length)"
            )
    rows: list[list[int]] = []  # indices into examples
    used: list[int] = []
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i])):
        n = len(examples[i])
        fits = [r for r, u in enumerate(used) if u + n <= max_length]
        if fits:  # the fullest row it fits in
            best = max(fits, key=lambda r: used[r])
            rows[best].append(i)
            used[best] += n
        else:
            rows.append([i])
            used.append(n)
    return [[examples[i] for i in sorted(row)] for row in sorted(rows, key=min)]


class PackedCollator:
    """Packs examples into rows of at most ``max_length`` tokens (``flat``: all in one row)."""

    def __init__(self, max_length: int, pad_id: int, *, flat: bool = False) -> None:
        self.max_length, self.pad_id, self.flat = max_length, pad_id, flat

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        return self.collate_rows(pack_examples(examples, self.max_length))

    def collate_rows(
        self, rows: Sequence[Sequence[Example]], sequences: Sequence[Example] | None = None
    ) -> dict[str, torch.Tensor]:
        """The batch of rows already packed (each at most ``max_length`` tokens); with
        ``sequences``, each token's index in it as ``sequence_index`` (padding: 0)."""
        if not rows:
            raise ValueError("PackedCollator: no examples")
        if self.flat:
            rows = [[e for row in rows for e in row]]
        width = max(sum(map(len, row)) for row in rows)
        index = {id(e): i for i, e in enumerate(sequences or ())}
        ids, labels, positions, owners = [], [], [], []
        for row in rows:
            pad = width - sum(map(len, row))
            ids.append([*chain(*(e.input_ids for e in row)), *[self.pad_id] * pad])
            labels.append(
                [*chain(*([IGNORE_INDEX, *e.labels[1:]] for e in row)), *[IGNORE_INDEX] * pad]
            )
            positions.append([*chain(*(range(len(e)) for e in row)), *range(pad)])
            owners.append([*chain(*([index.get(id(e), 0)] * len(e) for e in row)), *[0] * pad])
        batch = _batch(ids, labels, "position_ids", positions)
        return batch | ({"sequence_index": _long(owners)} if sequences is not None else {})
