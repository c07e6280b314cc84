"""Library versions recorded on every run, so a replay can tell what differs."""

from __future__ import annotations

import contextlib
import platform
from importlib import metadata

_PACKAGES = "llmtrain torch transformers peft bitsandbytes deepspeed sqlalchemy pymongo tokenizers"


def library_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _PACKAGES.split():
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found
