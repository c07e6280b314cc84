"""Terminal output for the CLI and the demo: quiet third-party noise, print aligned tables."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

_NOISY_LOGS = (  # (logger name, message prefix) of what is noise on every run
    # bitsandbytes on a CPU without the optional `kernels` package; 4-bit still works
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # DeepSpeed's accelerator probe on a machine without a GPU
    ("DeepSpeed", "Setting accelerator to CPU"),
    ("kernels._internals.hf_hub", "Skipping publisher trust check"),  # the same, offline
)
_NOISY_WARNINGS = (
    (FutureWarning, r".*is_gradient_checkpointing.*"),
    (DeprecationWarning, r".*torch\.jit\.script_method.*"),
    (UserWarning, r".*TypedStorage is deprecated.*"),
    (UserWarning, r"Detected call of `lr_scheduler.step\(\)` before"),  # a step of skipped rows
)
# Deprecations raised inside the libraries a fit drives: news for us, noise for the user
# (transformers 5 warns on every fit about its own v6 renames).
_THIRD_PARTY = r"(transformers|peft|accelerate|bitsandbytes|deepspeed|torch)(\.|$)"

QUIET_ENV = "LLMTRAIN_QUIET"  # "1" while a fit is quiet: the workers it launches are quiet too
_QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    QUIET_ENV: "1",
}


def _keep(record: logging.LogRecord, prefix: str) -> bool:
    return not str(record.msg).startswith(prefix)


#: one filter object per noisy logger: adding it twice is a no-op
_FILTERS = {name: functools.partial(_keep, prefix=prefix) for name, prefix in _NOISY_LOGS}


def _silence(all_loggers: bool) -> list[tuple[logging.Logger, Any]]:
    """Quiet environment, log filters and warning filters; returns the log filters it added."""
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    added = []
    for name, keep in _FILTERS.items():
        logger = logging.getLogger(name)
        if keep not in logger.filters and (all_loggers or logger.level == logging.NOTSET):
            logger.addFilter(keep)
            added.append((logger, keep))
    for category, pattern in _NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_THIRD_PARTY)
    return added


def quiet() -> None:
    """Silence the known banners and warnings of transformers, bitsandbytes and DeepSpeed for
    the rest of the program. Call before they are imported: some log while being imported."""
    _silence(all_loggers=True)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Writing model shards" bars on every save


@contextlib.contextmanager
def quieted(enabled: bool = True) -> Iterator[None]:
    """:func:`quiet` for one call (a fit), then logging, warnings, progress bars and environment as
    they were; the caller's settings win (a noisy logger's own level, a non-default verbosity)."""
    if not enabled:
        yield
        return
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    lower = "TRANSFORMERS_VERBOSITY" not in os.environ and verbosity == logging.WARNING
    bars = hf_logging.is_progress_bar_enabled()
    hub_bars = not hub_utils.are_progress_bars_disabled()
    added: list[tuple[logging.Logger, Any]] = []
    try:
        with warnings.catch_warnings(), restored_env(*_QUIET_ENV):
            added = _silence(all_loggers=False)
            if lower:
                hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()  # the hub's bars too
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if hub_bars:
            hub_utils.enable_progress_bars()
        for logger, log_filter in added:
            logger.removeFilter(log_filter)


@contextlib.contextmanager
def restored_env(*names: str) -> Iterator[None]:
    """The environment variables ``names`` as they were, once the block ends."""
    old = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def say(*lines: str) -> None:
    """Print each line, flushed: a long command's progress shows as it goes."""
    print(*lines, sep="\n", flush=True)


def table(rows: Iterable[Sequence[Any]], header: Sequence[str]) -> str:
    """Rows as left-aligned columns under ``header``; ``None`` shows as ``-``."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
