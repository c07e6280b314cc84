"""``connect()`` and the Datalayer: one handle on the data, the metadata and the artifacts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmtrain.db import open_backend
from llmtrain.db.backend import DataBackend
from llmtrain.db.retry import RetryPolicy
from llmtrain.errors import ConfigError, StoreError
from llmtrain.stores.artifacts import check_artifacts_spec, open_artifacts
from llmtrain.stores.artifacts.base import ArtifactStore
from llmtrain.stores.components import Component, check_identifier, component_class
from llmtrain.stores.metadata import open_metadata
from llmtrain.stores.metadata.base import ComponentRecord, MetadataStore, RunRecord
from llmtrain.uri import is_mongo_uri, redact_uri, scheme_of


def default_artifact_dir(uri: str) -> Path:
    """Next to a SQLite file; otherwise ``~/.llmtrain/artifacts/<host>-<database>``."""
    if scheme_of(uri) == "sqlite":
        db_path = uri.split(":///", 1)[1].split("?", 1)[0] if ":///" in uri else ""
        if db_path and db_path != ":memory:":
            path = Path(db_path).expanduser().resolve()
            return path.with_name(path.name + ".artifacts")
        name = "sqlite-memory"
    else:
        parts = urlsplit(redact_uri(uri))  # a password with "/" in it is no path
        name = f"{parts.hostname or 'local'}-{parts.path.strip('/') or 'default'}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return Path(os.environ.get("LLMTRAIN_HOME", Path.home() / ".llmtrain")) / "artifacts" / safe


def check_uri(uri: object, where: str) -> None:
    """A MongoDB URI, or one whose SQLAlchemy dialect and driver are installed; else ConfigError."""
    if not isinstance(uri, str) or "://" not in uri:
        shown = repr(redact_uri(uri)) if isinstance(uri, str) else f"{type(uri).__name__} {uri!r}"
        raise ConfigError(f"{where} needs a database URI like sqlite:///data.db, got {shown}")
    if is_mongo_uri(uri):
        return
    import sqlalchemy as sa

    from llmtrain.db.engines import sqlalchemy_url

    shown = redact_uri(uri)
    try:
        sa.engine.make_url(sqlalchemy_url(uri)).get_dialect().import_dbapi()
        return
    except sa.exc.NoSuchModuleError:
        problem = (
            f"no database backend serves {scheme_of(uri)!r} URIs ({shown}); use sqlite://, "
            "postgresql://, mysql://, mariadb://, mongodb:// or another installed "
            "SQLAlchemy dialect"
        )
    except ImportError as exc:
        problem = f"the database driver for {shown} is not installed ({exc})"
    except (sa.exc.ArgumentError, ValueError) as exc:  # ValueError: a port that is no number
        detail = str(exc).replace(sqlalchemy_url(uri), shown).replace(uri, shown)
        problem = f"{shown} is not a valid database URI: {detail}"
    raise ConfigError(f"{where}: {problem}") from None


def require_datalayer(db: object, where: str) -> None:
    """``db`` is what :func:`connect` returns, not a URI or an engine: say how to get one."""
    if isinstance(db, Datalayer):
        return
    shown = f"the string {redact_uri(db)!r}" if isinstance(db, str) else type(db).__name__
    url = db if isinstance(db, str) else getattr(db, "url", None)  # an engine or connection
    hint = f": pass llmtrain.connect({redact_uri(str(url))!r})" if url is not None else ""
    raise ConfigError(f"{where} needs a database opened with llmtrain.connect(), got {shown}{hint}")


class Datalayer:
    """Opened by ``connect()``: any SQLAlchemy URL, ``mongodb://``, ``mongomock://`` (see
    README.md). Connections open lazily and reopen after pickling; ``retry`` bounds how long
    data reads wait out a lost connection."""

    def __init__(
        self,
        uri: str,
        *,
        metadata_uri: str | None = None,
        artifacts: str | Path | ArtifactStore | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        check_uri(uri, "connect()")
        if metadata_uri is not None:
            check_uri(metadata_uri, "connect(metadata_uri=)")
        if artifacts is not None and not isinstance(artifacts, (str, Path, ArtifactStore)):
            raise ConfigError(
                "connect(artifacts=) must be a folder, an fsspec URL or an "
                f"ArtifactStore, got {type(artifacts).__name__} {artifacts!r}"
            )
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(
                f"connect(retry=) must be a RetryPolicy, got {type(retry).__name__} {retry!r}"
            )
        self._uri, self._metadata_uri = uri, metadata_uri or uri
        if isinstance(artifacts, (str, Path)):
            check_artifacts_spec(artifacts)
        self._artifacts_spec = artifacts
        self.retry = retry  # None: the backend's default RetryPolicy()
        self._backend: DataBackend | None = None
        self._metadata: MetadataStore | None = None
        self._artifacts = artifacts if isinstance(artifacts, ArtifactStore) else None

    @property
    def uri(self) -> str:
        """The data URI with secrets redacted: the only form that is stored or printed."""
        return redact_uri(self._uri)

    def secret_uri(self) -> str:
        """The full URI, for handing to worker processes through their environment only."""
        return self._uri

    def secret_metadata_uri(self) -> str:
        return self._metadata_uri

    def __repr__(self) -> str:
        return f"Datalayer({self.uri!r})"

    @property
    def backend(self) -> DataBackend:
        if self._backend is None:
            self._backend = open_backend(self._uri, retry=self.retry)
        return self._backend

    @property
    def metadata(self) -> MetadataStore:
        if self._metadata is None:
            # a separate metadata database may not exist yet: its first write creates it
            self._metadata = open_metadata(
                self._metadata_uri, missing_ok=self._metadata_uri != self._uri
            )
        return self._metadata

    @property
    def artifacts(self) -> ArtifactStore:
        if self._artifacts is None:
            spec = self._artifacts_spec  # an ArtifactStore was set in __init__
            folder = default_artifact_dir(self._uri) if spec is None else spec
            assert not isinstance(folder, ArtifactStore)
            self._artifacts = open_artifacts(folder)
        return self._artifacts

    def add(self, component: Component) -> int:
        """Store a new version unless the newest has the same payload; returns (and sets) it."""
        if not isinstance(component, Component):
            raise StoreError(
                f"{type(component).__name__} is not a component "
                "(needs type_id, identifier, to_dict and from_dict)"
            )
        identifier = check_identifier(component.identifier)
        version = self.metadata.add_component(
            component.type_id, identifier, component.to_dict(), unless_unchanged=True
        )
        component.version = version  # type: ignore[attr-defined]
        return version

    def load(
        self,
        type_id: str,
        identifier: str,
        version: int | None = None,
        *,
        checkpoint: str | int | None = None,
    ) -> Any:
        """The stored component (the newest unless ``version``); for a model, ``checkpoint=``
        ``"best"`` (see ``save_best_by``) or a step loads that checkpoint's weights."""
        if checkpoint is not None and type_id != "model":
            raise ConfigError(f"load(checkpoint=) is for models, not {type_id!r}")
        record = self.metadata.get_component(type_id, check_identifier(identifier), version)
        cls = component_class(record.type_id)
        try:
            obj = cls.from_dict(record.payload)
        except (TypeError, KeyError, ValueError) as exc:  # a ConfigError or pydantic's too
            raise StoreError(
                f"stored {record.type_id} {record.identifier!r} v{record.version} "
                f"is not a valid {cls.__name__}: {exc}"
            ) from None
        obj.version = record.version
        if hasattr(obj, "_attach"):
            obj._attach(self)
        if checkpoint is not None:
            obj.use_checkpoint(checkpoint)
        return obj

    def show(self, type_id: str | None = None, identifier: str | None = None) -> list[Any]:
        """No argument: ``[{type_id, identifier}]``; a type: its identifiers; both: versions."""
        records = self.metadata.list_components(type_id, identifier)
        if type_id is None:
            seen = sorted({(r.type_id, r.identifier) for r in records})
            return [{"type_id": t, "identifier": i} for t, i in seen]
        if identifier is None:
            return sorted({r.identifier for r in records})
        return [r.version for r in records]

    def remove(
        self, type_id: str, identifier: str, version: int | None = None, *, force: bool = False
    ) -> int:
        """Remove one version (or all); returns how many went. A trainer with runs or models is
        refused; ``force=True`` removes them too, with their artifacts nothing else uses."""
        identifier = check_identifier(identifier)
        runs: list[RunRecord] = []
        models: list[ComponentRecord] = []
        if type_id == "trainer":  # its runs, and the model versions they produced
            runs = self.metadata.list_runs(type_id, identifier)
            runs = [r for r in runs if version in (None, r.version)]
            models = self.metadata.list_components("model", identifier)
            models = [m for m in models if version in (None, m.payload.get("trainer_version"))]
        if (runs or models) and not force:
            what = [f"{len(runs)} run(s) ({', '.join(r.run_id for r in runs)})"] if runs else []
            versions = ", ".join(str(m.version) for m in models)
            what += [f"model {identifier!r} version(s) {versions}"] if models else []
            raise StoreError(
                f"{type_id} {identifier!r} still has {' and '.join(what)}: remove "
                "those first, or pass force=True to remove them with it"
            )
        doomed: set[str] = set()
        for run in runs:
            doomed |= {c.artifact_id for c in self.metadata.list_checkpoints(run.run_id)}
            self.metadata.remove_run(run.run_id)
        for model in models:
            doomed |= _model_artifacts(model)
            self.metadata.remove_component("model", identifier, model.version)
        removed = self.metadata.remove_component(type_id, identifier, version)
        for artifact in sorted(doomed - self._artifacts_in_use() if doomed else ()):
            self.artifacts.delete(artifact)
        return removed

    def _artifacts_in_use(self) -> set[str]:
        """Artifacts that remaining models and checkpoints use (content ids can be shared)."""
        used = set().union(*map(_model_artifacts, self.metadata.list_components("model")))
        for run in self.metadata.list_runs():
            used |= {c.artifact_id for c in self.metadata.list_checkpoints(run.run_id)}
        return used

    def lineage(self, type_id: str, identifier: str, version: int | None = None) -> Iterator[Any]:
        """The rows that trained the model, in step order (see :mod:`llmtrain.provenance`)."""
        from llmtrain.provenance.lineage import model_lineage

        if type_id != "model":
            raise ConfigError(f"lineage() is of a model, not a {type_id!r}: use 'model'")
        return model_lineage(self, check_identifier(identifier), version)

    def trained_on(self, source: Any, key: Any) -> Any:
        """Every run, checkpoint and model version that consumed row ``key`` of ``source``."""
        from llmtrain.provenance.lineage import trained_on

        return trained_on(self, source, [key])

    def forget(self, source: Any, keys: Any, *, retrain: bool = False) -> Any:
        """Forget rows (later runs leave them out): see :mod:`llmtrain.provenance.forget`."""
        from llmtrain.provenance.forget import forget

        return forget(self, source, keys, retrain=retrain)

    def close(self) -> None:
        for part in (self._backend, self._metadata):
            if part is not None:
                part.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_backend"] = state["_metadata"] = None
        if not isinstance(self._artifacts_spec, ArtifactStore):
            state["_artifacts"] = None
        return state


def _model_artifacts(model: ComponentRecord) -> set[str]:
    return {model.payload["adapter"]} if model.payload.get("adapter") else set()


connect = Datalayer  # ``llmtrain.connect(uri, ...)``: the public way to open one
