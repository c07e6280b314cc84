"""Hostile rows: nulls, missing fields, numbers, lists, nested objects, bytes, huge and empty
strings, lone surrogates, invalid UTF-8 stored in a SQLite TEXT value, SQL-looking text.

Promise: through ``CachedQueryDataset``, the ``Formatter`` and a short fit, every row either
trains (it is text: empty and huge strings included) or is rejected, or skipped and counted,
with a ``BadRowError`` / warning naming the row's key and field; nothing crashes deep inside
torch or the tokenizer, and a skipped row is never trained on.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hooks import KeyTrace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import llmtrain as lt
from llmtrain.errors import BadRowError
from llmtrain.formatting import Formatter

from .helpers import TEMPLATE, count_reconnects, doc_rows, trainer, warnings_of

MAX_LENGTH = 64
FIELDS = ("x", "y")
MISSING = object()
_tables = itertools.count()


def text_or_problem(value: Any) -> str | None:
    """The oracle, written independently of the library: None if ``value`` is usable text,
    else the kind of problem."""
    if value is MISSING:
        return "missing"
    if value is None:
        return "null"
    if not isinstance(value, str):
        return "not text"
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        return "not UTF-8"
    return None


def first_bad_field(row: Mapping[str, Any]) -> str | None:
    for name in FIELDS:
        if text_or_problem(row.get(name, MISSING)) is not None:
            return name
    return None


texts = st.one_of(
    st.text(max_size=40),
    st.just(""),
    st.integers(1, 3).map(lambda n: "huge " * (5_000 * n)),  # 25k-75k characters
    st.sampled_from(
        [
            "'; DROP TABLE docs; --",
            "</s><s><pad>",
            "{X} {Y} {{",
            "nul\x00byte",
            "\u202eright-to-left",
            "🙂" * 20,
            "\r\n\t",
            "ẞ̵̡͠ ǆ ﬁ",
        ]
    ),
)
lone_surrogates = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3
).map(lambda s: "ok " + s)
others = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.binary(max_size=8),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text("abc", min_size=1, max_size=3), st.text(max_size=3), max_size=2),
)
row_values = st.one_of(texts, others, lone_surrogates)
rows = st.fixed_dictionaries({}, optional={"x": row_values, "y": row_values})


@pytest.fixture(scope="module")
def formatter(tiny: Path) -> Formatter:
    return Formatter(
        AutoTokenizer.from_pretrained(tiny),
        TEMPLATE,
        max_length=MAX_LENGTH,
        x_field="x",
        y_field="y",
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=rows, key=st.one_of(st.integers(), st.text(max_size=5)))
def test_formatter_trains_any_text_and_names_key_and_field_of_anything_else(
    formatter: Formatter, row: dict[str, Any], key: Any
) -> None:
    bad = first_bad_field(row)
    if bad is None:
        example = formatter.format(row, key=key, source="rows")
        assert 1 <= len(example) <= MAX_LENGTH and example.key == key
        assert example.num_target_tokens >= 1  # the response (or its EOS) is trained
        return
    with pytest.raises(BadRowError) as info:
        formatter.format(row, key=key, source="rows")
    assert (info.value.key, info.value.field) == (key, bad)
    assert repr(key) in str(info.value) and repr(bad) in str(info.value)


def _check_dataset(
    db: Any, select: lt.Query, keyed: list[tuple[int, dict[str, Any]]], formatter: Formatter
) -> None:
    """Skip mode yields exactly the text rows (and counts the rest, by key); raise mode stops
    at the first bad row, naming it; the formatter takes every row the dataset lets through."""
    good = [k for k, r in keyed if first_bad_field(r) is None]
    bad = [k for k, r in keyed if first_bad_field(r) is not None]
    skip = lt.CachedQueryDataset(
        db, select, list(FIELDS), cache_size=4, shuffle=False, on_bad_row="skip", return_keys=True
    )
    yielded = list(skip)
    assert [r["_key"] for r in yielded] == good
    assert skip.stats.skipped == len(bad) and skip.stats.skipped_keys == bad
    examples = formatter.format_batch([(r["_key"], r) for r in yielded], source=select.source)
    assert all(len(e) <= MAX_LENGTH for e in examples) and len(examples) == len(good)

    strict = lt.CachedQueryDataset(
        db, select, list(FIELDS), cache_size=4, shuffle=False, return_keys=True
    )
    if not bad:
        assert [r["_key"] for r in strict] == good
        return
    seen: list[Any] = []
    with pytest.raises(BadRowError) as info:
        for r in strict:
            seen.append(r["_key"])
    first = bad[0]
    assert (info.value.key, info.value.field) == (first, first_bad_field(dict(keyed)[first]))
    assert seen == [k for k in good if k < first]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    docs=st.lists(
        st.fixed_dictionaries(
            {}, optional={"x": st.one_of(texts, others), "y": st.one_of(texts, others)}
        ),
        max_size=12,
    )
)
def test_mongo_documents_of_any_shape_are_trained_or_named(
    formatter: Formatter, docs: list[dict[str, Any]]
) -> None:
    """(BSON cannot hold a lone surrogate, so MongoDB never returns one.)"""
    uri = f"mongomock://localhost/lt_hostile_{os.getpid()}"
    name = f"docs{next(_tables)}"
    db = lt.connect(uri)
    keyed = list(enumerate(docs))
    if docs:
        from llmtrain.db.engines import mongo_database

        mongo_database(uri)[name].insert_many([{"_id": k, **d} for k, d in keyed])
    _check_dataset(db, lt.Collection(name), keyed, formatter)


# SQLite keeps whatever type a value has in a column declared without one
sqlite_cells = st.one_of(
    st.tuples(st.just("text"), texts.filter(lambda s: "\x00" not in s)),
    st.tuples(st.just("null"), st.none()),
    st.tuples(st.just("int"), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("float"), st.floats(allow_nan=False)),
    st.tuples(st.just("blob"), st.binary(max_size=8)),
    st.tuples(st.just("bad utf-8"), st.binary(max_size=6).map(lambda b: b + b"\xff")),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cells=st.lists(st.tuples(sqlite_cells, sqlite_cells), max_size=12))
def test_sqlite_values_of_any_type_and_invalid_utf8_are_trained_or_named(
    formatter: Formatter,
    tmp_path_factory: pytest.TempPathFactory,
    cells: list[tuple[tuple[str, Any], tuple[str, Any]]],
) -> None:
    path = tmp_path_factory.getbasetemp() / "hostile.db"
    name = f"docs{next(_tables)}"
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, x, y)")
        for key, cell_pair in enumerate(cells):
            sql = ["CAST(? AS TEXT)" if kind == "bad utf-8" else "?" for kind, _ in cell_pair]
            conn.execute(
                f"INSERT INTO {name} VALUES (?, {', '.join(sql)})",
                [key, *[value for _, value in cell_pair]],
            )
    keyed = []
    for key, ((kx, vx), (ky, vy)) in enumerate(cells):
        # what the oracle expects to read back: invalid UTF-8 as a lone-surrogate string
        def read_back(kind: str, value: Any) -> Any:
            return value.decode("utf-8", "surrogateescape") if kind == "bad utf-8" else value

        keyed.append((key, {"x": read_back(kx, vx), "y": read_back(ky, vy)}))
    db = lt.connect(f"sqlite:///{path}")
    _check_dataset(db, lt.Table(name), keyed, formatter)


def test_invalid_utf8_in_sqlite_names_the_row_at_once_instead_of_retrying(tmp_path: Path) -> None:
    """It is a bad row, not a lost connection: no retry (no reconnect), no
    DatabaseUnavailableError."""
    path = tmp_path / "utf8.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, x TEXT, y TEXT)")
        conn.execute("INSERT INTO docs VALUES (1, 'fine', 'fine')")
        conn.execute("INSERT INTO docs VALUES (2, 'fine', CAST(x'c328ff' AS TEXT))")
    db = lt.connect(f"sqlite:///{path}")
    reconnects = count_reconnects(db)
    with pytest.raises(BadRowError, match=r"key 2: field 'y' is not valid UTF-8") as info:
        list(lt.CachedQueryDataset(db, lt.Table("docs"), ["x", "y"]))
    assert info.value.key == 2 and reconnects == []
    rows = lt.QueryDataset(db, lt.Table("docs"), ["x", "y"], on_bad_row="skip")
    assert rows.keys == [1] and rows.stats.skipped_keys == [2]


# -- a short fit over hostile rows ------------------------------------------------------------
HOSTILE: dict[int, tuple[str, Any, str]] = {  # key -> (field, value, problem the error names)
    100: ("instruction", None, "is null"),
    101: ("output", 42, "int"),
    102: ("instruction", b"\x00\x01", "bytes"),
    103: ("output", "bad utf-8", "not valid UTF-8"),
    104: ("instruction", 3.5, "float"),
}


def hostile_db(tmp_path: Path) -> Any:
    path = tmp_path / "hostile-fit.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, instruction, output)")
        good = doc_rows(28)
        good += [
            {"id": 200, "instruction": "", "output": ""},  # empty: still trains the EOS
            {"id": 201, "instruction": "word " * 20_000, "output": "long " * 20_000},
            {"id": 202, "instruction": "'; DROP TABLE docs; --", "output": "🙂 ẞ"},
        ]
        conn.executemany("INSERT INTO docs VALUES (:id, :instruction, :output)", good)
        for key, (field, value, _) in HOSTILE.items():
            other = "output" if field == "instruction" else "instruction"
            if value == "bad utf-8":
                conn.execute(
                    f"INSERT INTO docs (id, {other}, {field}) "
                    "VALUES (?, 'fine', CAST(x'ff' AS TEXT))",
                    [key],
                )
            else:
                conn.execute(
                    f"INSERT INTO docs (id, {other}, {field}) VALUES (?, 'fine', ?)", [key, value]
                )
    return lt.connect(f"sqlite:///{path}", artifacts=tmp_path / "artifacts")


def test_a_fit_skips_hostile_rows_by_key_and_field_and_trains_all_the_others(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = hostile_db(tmp_path)
    trace = KeyTrace()
    with warnings_of(caplog, "llmtrain.data") as warned:
        trainer(
            tiny, "hostile", max_steps=-1, epochs=1, batch_size=4, on_bad_row="skip", max_length=128
        ).fit(X="instruction", Y="output", db=db, select=lt.Table("docs"), callbacks=[trace])
    (run,) = db.metadata.list_runs("trainer", "hostile")
    assert run.status == "completed"
    assert sorted(trace.keys) == sorted(f"int:{k}" for k in [*range(28), 200, 201, 202])
    for key, (field, _, problem) in HOSTILE.items():
        assert any(f"skipping row {key}: field {field!r}" in w and problem in w for w in warned), (
            key,
            warned,
        )


def test_a_fit_stops_at_the_first_hostile_row_naming_it(tiny: Path, tmp_path: Path) -> None:
    db = hostile_db(tmp_path)
    with pytest.raises(BadRowError) as info:
        trainer(tiny, "strict", max_steps=-1, epochs=1, batch_size=4).fit(
            X="instruction", Y="output", db=db, select=lt.Table("docs")
        )
    key, error = info.value.key, info.value
    assert key in HOSTILE and error.field == HOSTILE[key][0] and HOSTILE[key][2] in str(error)
    (run,) = db.metadata.list_runs("trainer", "strict")
    assert run.status == "failed" and f"row with key {key!r}" in (run.error or "")
