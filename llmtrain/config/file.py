"""``llmtrain fit``'s YAML files (LLMTrainer's options, ``data:``) and ``--a.b value`` overrides,
checked against TrainerConfig's schema: a typo is a ConfigError naming it, never a no-op."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model

from llmtrain.config.args import TrainerConfig, build
from llmtrain.config.spec import DataSelection
from llmtrain.db.queries import Collection, Conversations, Mix, Query, RawSQL, Table
from llmtrain.errors import ConfigError, QueryError
from llmtrain.uri import scheme_of

DB_ENV = "LLMTRAIN_DB_URI"


class _FileHead(BaseModel):
    """What a file has besides the trainer's options: its name, where, and which rows."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The trainer's identifier."""
    db: str | None = None
    """Database URI; default: $LLMTRAIN_DB_URI."""
    artifacts: str | None = None
    """Artifact folder, or an fsspec URL (s3://bucket/prefix)."""
    data: DataSelection
    """X, Y and the rows (select, eval_select)."""


#: The top level: the head plus TrainerConfig's options (their values validated by LLMTrainer).
_OPTIONS: dict[str, Any] = {
    name: (Any, ... if TrainerConfig.model_fields[name].is_required() else None)
    for name in TrainerConfig.options()
}
FitFile = create_model("FitFile", __base__=_FileHead, **_OPTIONS)

#: Sections that are one of the argument models: overrides may name their fields.
SECTIONS = TrainerConfig.sections()
SCALARS = (
    *(k for k in _FileHead.model_fields if k != "data"),
    *(k for k in TrainerConfig.options() if k not in SECTIONS),
)
#: The friendlier forms of a selection: the query built, and the keys each form takes.
_FORMS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "table": (Table, ("schema", "key", "where", "params", "columns")),
    "collection": (Collection, ("filter", "projection", "allow_javascript")),
    "sql": (RawSQL, ("key", "params")),
    "conversations": (Conversations, ("by", "order", "role", "content")),
}
#: A mixture: ``{mix: [{table: docs, X: body}, {table: qa, X: q, Y: a}], weights: [3, 1]}``
_MIX = ("mix", "weights", "epoch_rows", "X", "Y")
#: Every key a selection may have: the stored form's, or a friendlier form's.
SELECT_KEYS = ("kind", "name", "text", "messages", "parts", *_FORMS, *_MIX) + tuple(
    dict.fromkeys(key for _, keys in _FORMS.values() for key in keys)
)
#: Fields holding free-form mappings: any key below them is allowed.
_FREE_FORM = {"params", "filter", "projection", "raw"}


class _Loader(yaml.SafeLoader):
    """Also reads ``1e-4`` as a float (YAML 1.1 wants ``1.0e-4``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_value(text: str) -> Any:
    """An override value as YAML (``1e-4``, ``true``, ``[q_proj, v_proj]``), else a string."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file as a dict (relative paths in it are relative to the working directory)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        where = f"byte {exc.object[exc.start]:#04x} at position {exc.start}"
        raise ConfigError(f"cannot read config file {path}: not UTF-8 text ({where})") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a mapping (name:, model_args:, data: ...), not {type(data).__name__}"
        )
    return data


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """``["--a.b", "1", "--c=x"]`` -> ``[("a.b", 1), ("c", "x")]``."""
    out: list[tuple[str, Any]] = []
    items = iter(args)
    for arg in items:
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like "
                "--training_args.learning_rate 1e-4"
            )
        path, eq, value = arg[2:].partition("=")
        check_path(path)
        if not eq:
            value = next(items, "--")  # none left reads as a missing value too
            if value.startswith("--"):
                raise ConfigError(f"override --{path} needs a value")
        out.append((path, parse_value(value)))
    return out


def check_path(path: str) -> None:
    """ConfigError naming ``path`` unless it addresses a known option of the schema."""
    parts = path.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"unknown option --{path}: empty part in the dotted path")
    head, *rest = parts
    _check_key(path, head, [*SCALARS, *SECTIONS, "data"], "the config file")
    if not rest:
        return
    if head in SCALARS:
        raise ConfigError(f"unknown option --{path}: {head} is a single value")
    if head in SECTIONS:
        _check_key(path, rest[0], list(SECTIONS[head].model_fields), SECTIONS[head].__name__)
        named = rest[:1]  # the section's field
    else:
        _check_key(path, rest[0], list(DataSelection.model_fields), "data")
        if rest[0] in ("X", "Y") and len(rest) > 1:
            raise ConfigError(f"unknown option --{path}: data.{rest[0]} is a field name")
        if len(rest) > 1:
            _check_key(path, rest[1], list(SELECT_KEYS), f"data.{rest[0]}")
        named = rest[:2]  # data.select's key
    if len(rest) > len(named) and named[-1] not in _FREE_FORM:
        raise ConfigError(f"unknown option --{path}: {'.'.join([head, *named])} has no sub-options")


def _check_key(path: str, key: str, known: list[str], where: str) -> None:
    if key not in known:
        raise ConfigError(
            f"unknown option --{path}: {where} has no {key!r}; known: {', '.join(known)}"
        )


def apply_overrides(config: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``config`` with each dotted path set."""
    out = _copy(config)
    for path, value in overrides:
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return out


def _copy(value: Any) -> Any:
    """Every dict and list anew: a YAML alias (``eval_select: *s``) becomes its own copy, so
    an override of one path never changes another (``copy.deepcopy`` keeps them shared)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return [_copy(v) for v in value] if isinstance(value, list) else value


def build_query(spec: Any, where: str = "data.select") -> Query:
    """A query from its stored form (``kind: sql_table, ...``) or a friendlier one (``table:``)."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where} must be a mapping like {{table: docs}}, got {spec!r}")
    spec = dict(spec)
    if unknown := sorted(set(spec) - set(SELECT_KEYS)):
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; a selection has one of "
            "kind:, table:, collection:, sql: or conversations:"
        )
    forms = [k for k in ("kind", *_FORMS) if k in spec]
    if len(forms) != 1 and "mix" not in spec:
        raise ConfigError(
            f"{where} needs exactly one of kind:, table:, collection:, sql: or conversations:"
            + (f" (got {forms})" if forms else "")
        )
    form = forms[0] if forms else "mix"
    try:
        if form == "mix":
            return _mix(spec, where)
        if form == "kind":
            return Query.from_dict(spec)
        query_class, allowed = _FORMS[form]
        if extra := sorted(set(spec) - set(allowed) - {form}):
            raise ConfigError(f"{where}: {form}: does not take {extra}")
        if form == "sql" and "key" not in spec:
            raise ConfigError(f"{where}: sql: needs key: (a unique column to page on)")
        if form == "conversations":  # {conversations: {table: messages}, by: ...}
            spec[form] = build_query(spec[form], f"{where}.conversations")
        if "allow_javascript" in spec:
            spec["allow_javascript"] = bool(spec["allow_javascript"])
        return query_class(spec.pop(form), **spec)
    except TypeError as exc:  # "__init__() missing ... argument: 'by'": as the file names it
        needs = re.findall(r"'(\w+)'", str(exc).partition("argument")[2])
        raise ConfigError(f"{where}: {form}: needs {', '.join(n + ':' for n in needs)}") from None
    except (QueryError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _mix(spec: dict[str, Any], where: str) -> Mix:
    if set(spec) - {"mix", "weights", "epoch_rows"} or not isinstance(spec["mix"], list):
        raise ConfigError(f"{where}: mix: a list of selections (with weights:, epoch_rows:)")
    parts = []
    for i, item in enumerate(spec["mix"]):
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where}.mix[{i}] must be a mapping like {{table: docs, X: body}}")
        item = dict(item)
        x, y = item.pop("X", None), item.pop("Y", None)
        query = build_query(item, f"{where}.mix[{i}]")
        parts.append(query.fields(x, y) if x else query)
    return Mix(parts, weights=spec.get("weights"), epoch_rows=spec.get("epoch_rows"))


@dataclass
class FitJob:
    """A validated config file: what to build, where to connect, which rows to train on."""

    config: Any  # a FitFile
    db_uri: str
    select: Query
    eval_select: Query | None

    @property
    def options(self) -> dict[str, Any]:
        """The keywords the file sets (``lora_args: null``: full fine-tuning; unset: LoRA)."""
        return self.config.model_dump(include=set(TrainerConfig.options()), exclude_unset=True)


def build_job(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> FitJob:
    """Validate a config dict; the database is ``db:``, else ``$LLMTRAIN_DB_URI``."""
    env = os.environ if env is None else env
    config = dict(config)
    model_args: Any = config.get("model_args")
    name = model_args.get("model_name_or_path") if isinstance(model_args, dict) else None
    if isinstance(name, str) and not Path(name).is_absolute() and Path(name).exists():
        # a relative local model folder made absolute: the stored trainer replays anywhere
        config["model_args"] = {**model_args, "model_name_or_path": str(Path(name).resolve())}
    parsed = build(FitFile, config, "config")
    db_uri = parsed.db or env.get(DB_ENV)
    if not db_uri:
        raise ConfigError(
            f"config: no database; set db: (e.g. sqlite:///data.db) or the "
            f"{DB_ENV} environment variable"
        )
    eval_select = parsed.data.eval_select
    job = FitJob(
        parsed,
        _absolute_sqlite(db_uri),
        build_query(parsed.data.select, "data.select"),
        None if eval_select is None else build_query(eval_select, "data.eval_select"),
    )
    # every section validated now, before any connection is opened
    build(TrainerConfig, {"identifier": parsed.name, **job.options}, "LLMTrainer")
    return job


def _absolute_sqlite(uri: str) -> str:
    """``sqlite:///data.db`` -> ``sqlite:////abs/data.db``: the stored trainer replays anywhere."""
    head, sep, rest = uri.partition(":///")
    if not sep or scheme_of(uri) != "sqlite":
        return uri
    file, qsep, query = rest.partition("?")
    if not file or file == ":memory:" or file.startswith("file:") or Path(file).is_absolute():
        return uri
    return f"{head}:///{Path(file).resolve()}{qsep}{query}"


def load_job(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> FitJob:
    """``llmtrain fit PATH --a.b value ...``: read, override, validate."""
    return build_job(apply_overrides(read_config(path), parse_overrides(overrides)), env)
