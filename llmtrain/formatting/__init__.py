"""The formatting layer: rows -> prompt text -> token ids and labels -> padded or packed batches."""

from llmtrain.formatting.collate import (
    PackedCollator,
    PaddingEfficiency,
    block_causal_mask,
    mask_dtype_for,
    pack_examples,
    pad_collate,
    padding_efficiency,
)
from llmtrain.formatting.template import PromptTemplate
from llmtrain.formatting.tokenize import IGNORE_INDEX, Example, Formatter

__all__ = [
    "IGNORE_INDEX",
    "Example",
    "Formatter",
    "PackedCollator",
    "PaddingEfficiency",
    "PromptTemplate",
    "block_causal_mask",
    "mask_dtype_for",
    "pack_examples",
    "pad_collate",
    "padding_efficiency",
]
