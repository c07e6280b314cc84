"""Terminal output for the CLI and the demo: quiet third-party noise, print aligned tables.

Only programs (``llmtrain ...``, the demo, the examples) call :func:`quiet`: importing the
library never changes logging or warning filters behind a user's back.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

# Messages that are noise on every run: (logger name, message prefix).
_NOISY_LOGS = (
    # bitsandbytes on a CPU without the optional `kernels` package; 4-bit still works
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # DeepSpeed's accelerator probe on a machine without a GPU
    ("DeepSpeed", "Setting accelerator to CPU"),
)
_NOISY_WARNINGS = (
    (FutureWarning, r".*is_gradient_checkpointing.*"),
    (DeprecationWarning, r".*torch\.jit\.script_method.*"),
    (UserWarning, r".*TypedStorage is deprecated.*"),
)


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: Sequence[str]) -> None:
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet() -> None:
    """Silence the known banners and warnings of transformers, bitsandbytes and DeepSpeed.

    Call before those libraries are imported: some of them log while being imported.
    Real errors still show; set ``TRANSFORMERS_VERBOSITY`` yourself to see more.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name, prefix in _NOISY_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes([prefix]))
    for category, pattern in _NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Writing model shards" bars on every save


def table(rows: Iterable[Sequence[Any]], header: Sequence[str]) -> str:
    """Rows as left-aligned columns under ``header``; ``None`` shows as ``-``."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
