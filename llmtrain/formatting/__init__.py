"""The formatting layer: rows -> prompt text -> token ids and labels -> padded or packed batches."""

from llmtrain.formatting.collate import (
    PackedCollator,
    PaddingEfficiency,
    pack_examples,
    pad_collate,
    padding_efficiency,
)
from llmtrain.formatting.template import PromptTemplate
from llmtrain.formatting.tokenize import IGNORE_INDEX, Example, Formatter, Prompt

__all__ = [
    "IGNORE_INDEX",
    "Example",
    "Formatter",
    "PackedCollator",
    "PaddingEfficiency",
    "Prompt",
    "PromptTemplate",
    "pack_examples",
    "pad_collate",
    "padding_efficiency",
]
