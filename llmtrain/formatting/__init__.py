"""The formatting layer: rows -> prompt text -> token ids and labels -> padded or packed batches."""

from llmtrain.formatting.collate import PackedCollator, pack_examples, pad_collate
from llmtrain.formatting.template import PromptTemplate
from llmtrain.formatting.tokenize import IGNORE_INDEX, Example, Formatter, Prompt

__all__ = [
    "IGNORE_INDEX",
    "Example",
    "Formatter",
    "PackedCollator",
    "Prompt",
    "PromptTemplate",
    "pack_examples",
    "pad_collate",
]
