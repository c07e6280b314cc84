"""One exception root with a subclass per concern, so callers can catch precisely."""

from __future__ import annotations


class LlmtrainError(Exception):
    """Root of every error llmtrain raises on purpose."""


class ConfigError(LlmtrainError, ValueError):
    """A configuration value, option or combination is invalid; the message names the field."""


class DatabaseNotFoundError(ConfigError):
    """The URI names a database that is not there: reading never creates one."""


class QueryError(LlmtrainError, ValueError):
    """A query is malformed, unsafe, or cannot be paged (no usable unique key)."""


class DataError(LlmtrainError):
    """The data read from the database cannot be used as asked."""


class BadRowError(DataError, ValueError):
    """A row has a missing, null or wrongly typed field."""

    def __init__(self, source: str, key: object, field: str, problem: str) -> None:
        self.source, self.key, self.field, self.problem = source, key, field, problem
        super().__init__(f"{source}: row with key {key!r}: field {field!r} {problem}")


class DataChangedError(DataError):
    """The selected rows changed since a dataset state or run was recorded."""


class DatabaseUnavailableError(DataError):
    """The database could not be reached within the retry budget."""


class StoreError(LlmtrainError):
    """The metadata or artifact store refused an operation."""


class ComponentNotFoundError(StoreError, KeyError):
    """No component with that type, identifier and version exists."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ArtifactNotFoundError(StoreError):
    """No artifact with that id is in the store (it was deleted, or is in another store)."""


class ArtifactCorruptError(StoreError):
    """An artifact's bytes no longer match its content address."""


class CheckpointError(LlmtrainError):
    """A checkpoint is missing, incomplete or does not match the run."""


class DistributedError(LlmtrainError):
    """A distributed job failed; the message carries the failing rank's error."""


class ServingWarning(UserWarning):
    """An export that a serving stack would refuse or answer wrongly (``export --strict``)."""
