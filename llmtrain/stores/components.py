"""Components: named, versioned things stored as plain JSON in the metadata store. Loading goes
through this registry, so a stored record can only become one of these classes, never code."""

from __future__ import annotations

import importlib
import re
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from llmtrain.errors import ConfigError, StoreError

_IDENTIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_registry: dict[str, type[Any]] = {}

T = TypeVar("T")


@runtime_checkable
class Component(Protocol):
    type_id: ClassVar[str]

    @property
    def identifier(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any: ...


def check_identifier(identifier: object) -> str:
    """Letters, digits and ``-_.``, not starting with a dot: safe as a file or key name."""
    if not isinstance(identifier, str) or not _IDENTIFIER.match(identifier) or ".." in identifier:
        raise ConfigError(
            f"identifier {identifier!r} is invalid: use 1-128 letters, digits, "
            "'-', '_' or '.', starting with a letter or digit"
        )
    return identifier


def register_component(cls: type[T]) -> type[T]:
    type_id = cls.type_id  # type: ignore[attr-defined]
    check_identifier(type_id)
    _registry[type_id] = cls
    return cls


def component_class(type_id: str) -> type[Any]:
    if type_id not in _registry:
        # the built-in types register on import; an ImportError (a missing dependency) is real
        for module in ("llmtrain.running.trainer", "llmtrain.training.model"):
            importlib.import_module(module)
    if type_id not in _registry:
        raise StoreError(f"unknown component type {type_id!r}; known: {sorted(_registry)}")
    return _registry[type_id]
