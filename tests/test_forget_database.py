"""Forget enforced by the database: every selection form either leaves a forgotten row out, as
the server's own equality rules decide (views, joins keyed by either table, subqueries that rename
a column to the key, CTEs, unions, casts, a case-insensitive collation, a padded ``char(n)``), or
is refused before anything is read; ``trained_on`` names exactly the runs that trained a row,
through whatever the selection was; a forget committed while a fit runs leaves the row out of the
steps it prepares after, and names the run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import SQL_BACKENDS, fresh_database
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import llmtrain as lt
from llmtrain.db.engines import sql_engine
from llmtrain.db.keys import key_repr
from llmtrain.errors import QueryError
from llmtrain.training.callbacks import Callback

N = 12  # docs rows: id 0..11, ext 100 - id, one feedback row each (fid 1000 + id)


def _kind(uri: str) -> str:
    return uri.split(":", 1)[0].split("+", 1)[0]


def _schema(uri: str) -> None:
    """docs, its feedback, views over it (filtered, renamed, a view of a view), a key the server
    compares by its own rules, and a database function (PostgreSQL, MariaDB)."""
    kind = _kind(uri)
    text_key = {"postgresql": "CHAR(8)", "mysql": "VARCHAR(8) COLLATE utf8mb4_general_ci"}
    with sql_engine(uri, create=True).begin() as conn:
        run = conn.execute
        run(
            sa.text(
                "CREATE TABLE docs (id INTEGER PRIMARY KEY, ext INTEGER, q TEXT, a TEXT, "
                "lang VARCHAR(4))"
            )
        )
        run(sa.text("CREATE TABLE fb (fid INTEGER PRIMARY KEY, doc INTEGER, note TEXT)"))
        run(
            sa.text(
                f"CREATE TABLE sdocs (id {text_key.get(kind, 'TEXT')} PRIMARY KEY, q TEXT, a TEXT)"
            )
        )
        for i in range(N):
            lang = "en" if i % 3 else "de"
            run(
                sa.text("INSERT INTO docs VALUES (:i, :e, :q, :a, :l)"),
                dict(i=i, e=100 - i, q=f"question {i}", a=f"answer {i % 4}", l=lang),
            )
            run(sa.text("INSERT INTO fb VALUES (:f, :d, :n)"), dict(f=1000 + i, d=i, n=f"note {i}"))
            run(
                sa.text("INSERT INTO sdocs VALUES (:i, :q, :a)"), dict(i=f"k{i}", q=f"q {i}", a="a")
            )
        run(sa.text("CREATE VIEW docs_f AS SELECT * FROM docs WHERE lang = 'en'"))
        run(sa.text("CREATE VIEW docs_r AS SELECT id AS kk, q, a FROM docs"))
        run(sa.text("CREATE VIEW docs_vv AS SELECT * FROM docs_f"))
        if kind == "postgresql":
            run(
                sa.text(
                    "CREATE FUNCTION shout(x TEXT) RETURNS TEXT AS $$ SELECT upper(x) $$ "
                    "LANGUAGE SQL"
                )
            )
        elif kind == "mysql":
            run(sa.text("CREATE FUNCTION shout(x TEXT) RETURNS TEXT DETERMINISTIC RETURN upper(x)"))


@dataclass(frozen=True)
class Form:
    """A selection and its witness: (selection key, docs id) as the database derives them from
    the raw tables (None: the row reads no docs row)."""

    name: str
    select: Any
    witness: str
    refused: bool = False


def _forms(uri: str) -> list[Form]:
    kind = _kind(uri)
    text = {"postgresql": "TEXT", "mysql": "CHAR"}.get(kind, "TEXT")
    forms = [
        Form("table", lt.Table("docs"), "SELECT id, id FROM docs"),
        Form(
            "filtered view",
            lt.Table("docs_f", key="id"),
            "SELECT id, id FROM docs WHERE lang = 'en'",
        ),
        Form(
            "renaming view",
            lt.sql("SELECT kk, q, a FROM docs_r", key="kk"),
            "SELECT id, id FROM docs",
        ),
        Form(
            "view of a view",
            lt.sql("SELECT id, q, a FROM docs_vv", key="id"),
            "SELECT id, id FROM docs WHERE lang = 'en'",
        ),
        Form(
            "join keyed by the other table",
            lt.sql("SELECT f.fid, d.q, d.a FROM fb f JOIN docs d ON d.id = f.doc", key="fid"),
            "SELECT fid, doc FROM fb",
        ),
        Form(
            "join keyed by docs",
            lt.sql("SELECT d.id, d.q, f.note AS a FROM docs d JOIN fb f ON f.doc = d.id", key="id"),
            "SELECT id, id FROM docs",
        ),
        Form(
            "subquery renaming a column to the key",
            lt.sql("SELECT s.id, s.q, s.a FROM (SELECT ext AS id, q, a FROM docs) s", key="id"),
            "SELECT ext, id FROM docs",
        ),
        Form(
            "CTE",
            lt.sql(
                "WITH c AS (SELECT id, q, a FROM docs WHERE id > 1) SELECT id, q, a FROM c",
                key="id",
            ),
            "SELECT id, id FROM docs WHERE id > 1",
        ),
        Form(
            "UNION with source=",
            lt.sql(
                "SELECT id, q, a FROM docs WHERE id < 6 UNION ALL SELECT fid, note, note FROM fb",
                key="id",
                source="docs",
            ),
            "SELECT id, id FROM docs WHERE id < 6 UNION ALL SELECT fid, NULL FROM fb",
        ),
        Form(
            "cast key with source=",
            lt.sql(f"SELECT CAST(id AS {text}) AS id, q, a FROM docs", key="id", source="docs"),
            f"SELECT CAST(id AS {text}), id FROM docs",
        ),
        Form(
            "where() with OR",
            lt.Table("docs").where("id = :i OR id > :j", i=3, j=8),
            "SELECT id, id FROM docs WHERE id = 3 OR id > 8",
        ),
    ]
    if kind == "sqlite":
        refused = lt.sql(
            "SELECT value AS id, 'q' AS q, 'a' AS a FROM json_each('[1, 2]')", key="id"
        )
    else:
        refused = lt.sql("SELECT id, shout(q) AS q, a FROM docs", key="id")
    return [*forms, Form("a table function or a database function", refused, "", refused=True)]


def _reset(uri: str) -> None:
    """The data tables only: every forget (its key tables and records) gone."""
    engine = sql_engine(uri)
    names = [n for n in sa.inspect(engine).get_table_names() if n.startswith("_llmtrain")]
    q = engine.dialect.identifier_preparer.quote
    with engine.begin() as conn:
        for name in names:
            conn.execute(sa.text(f"DROP TABLE {q(name)}"))


def _witness(uri: str, sql: str) -> list[tuple[Any, Any]]:
    with sql_engine(uri).connect() as conn:  # the raw tables, not through llmtrain
        return [tuple(r) for r in conn.execute(sa.text(sql))]


def _read(db: Any, select: Any) -> set[str]:
    """Every key the snapshot takes and every row fetched by key (what a fit's loop reads)."""
    keys = {key_repr(k) for page in db.backend.key_pages(select, None, 5) for k in _list(page.keys)}
    rows = db.backend.fetch_by_keys(
        select, ("q",), [k for p in db.backend.key_pages(select, None, 100) for k in _list(p.keys)]
    )
    assert {key_repr(k) for k, _ in rows} == keys
    return keys


def _list(keys: Any) -> list[Any]:
    return keys.tolist() if hasattr(keys, "tolist") else list(keys)


@pytest.mark.parametrize("kind", SQL_BACKENDS)
def test_every_selection_form_leaves_forgotten_rows_out_or_is_refused(
    kind: str, tmp_path: Path
) -> None:
    uris = fresh_database(kind, tmp_path)
    uri = next(uris)
    try:
        _schema(uri)
        forms = _forms(uri)

        @seed(20261205)
        @settings(
            max_examples=24,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            form=st.sampled_from(forms),
            gone=st.sets(st.integers(0, N - 1), max_size=5),
            spelled=st.booleans(),
        )
        def check(form: Form, gone: set[int], spelled: bool) -> None:
            _reset(uri)
            shutil.rmtree(tmp_path / "artifacts", ignore_errors=True)
            db = lt.connect(uri, artifacts=tmp_path / "artifacts")
            try:
                if gone:
                    result = db.forget("docs", sorted(gone))
                    assert not result.unmatched
                if form.refused:
                    if gone:
                        with pytest.raises(QueryError, match=r"forgotten \(db\.forget\)"):
                            _read(db, form.select)
                    else:
                        assert _read(db, form.select)  # nothing forgotten: nothing refused
                    return
                expected = {
                    key_repr(k) for k, base in _witness(uri, form.witness) if base not in gone
                }
                assert _read(db, form.select) == expected, form.name
                # keys the server takes for equal: another case, trailing spaces, padding
                text_gone = sorted(gone)[:2]
                if text_gone:
                    given_keys = [
                        f"K{i} " if spelled and kind == "mariadb" else f"k{i}" for i in text_gone
                    ]
                    assert not db.forget("sdocs", given_keys).unmatched
                    read = {key_repr(k).strip() for k in _read(db, lt.Table("sdocs"))}
                    assert read == {f"k{i}" for i in range(N) if i not in text_gone}
            finally:
                db.close()

        check()
    finally:
        for _ in uris:
            pass


class _Trained(Callback):
    """The keys each step trained; optionally a forget by another process at one step."""

    def __init__(self, uri: str = "", at: int = 0, keys: list[int] | None = None) -> None:
        self.keys: dict[int, list[str]] = {}
        self.uri, self.at, self.forgotten = uri, at, keys or []

    def on_step(self, run: Any, keys: list[Any]) -> None:
        self.keys[run.step] = list(keys)
        if run.step == self.at:  # another process commits a forget while this fit runs
            forget = f"lt.connect({self.uri!r}).forget('docs', {self.forgotten!r})"
            code = f"import llmtrain as lt; {forget}"
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _fit(tiny: Path, db: Any, name: str, select: Any, callback: Callback, **options: Any) -> Any:
    trainer = lt.LLMTrainer(
        name,
        model=tiny,
        prompt_template="Q: {X}\nA: {Y}",
        num_train_epochs=1,
        batch_size=2,
        lora_r=4,
        progress_bar=False,
        shuffle=False,
        **options,
    )
    return trainer.fit(X="q", Y="a", db=db, select=select, callbacks=[callback])


def test_trained_on_names_exactly_the_runs_that_trained_a_row_through_any_selection(
    sql_uri: str, tiny: Path, tmp_path: Path
) -> None:
    """Two runs read docs through a join keyed by feedback and through a renaming view; for every
    docs row, trained_on lists exactly the runs whose trained keys the database derives from it,
    and forget names them; a later fit through either trains none of the forgotten rows."""
    _schema(sql_uri)
    db = lt.connect(sql_uri, artifacts=tmp_path / "artifacts")
    join = lt.sql(
        "SELECT f.fid, d.q, d.a FROM fb f JOIN docs d ON d.id = f.doc WHERE f.fid < 1008", key="fid"
    )
    view = lt.sql("SELECT kk, q, a FROM docs_r WHERE kk > 3", key="kk")
    seen = {}
    for name, select in (("join", join), ("view", view)):
        seen[name] = _Trained()
        _fit(tiny, db, name, select, seen[name])
    runs = {r.identifier: r.run_id for r in db.metadata.list_runs()}
    by_doc: dict[int, set[str]] = {i: set() for i in range(N)}
    for fid in {k for keys in seen["join"].keys.values() for k in keys}:
        by_doc[int(fid.split(":")[1]) - 1000].add(runs["join"])
    for kk in {k for keys in seen["view"].keys.values() for k in keys}:
        by_doc[int(kk.split(":")[1])].add(runs["view"])
    assert {r for v in by_doc.values() for r in v} == set(runs.values())
    for i in range(N):
        assert set(db.trained_on("docs", i).runs) == by_doc[i], i
    gone = [i for i in range(N) if len(by_doc[i]) == 2][:2] + [
        i for i in range(N) if not by_doc[i]
    ][:1]
    result = db.forget("docs", gone)
    assert set(result.runs) == set().union(*(by_doc[i] for i in gone))
    assert {m for m, _ in result.models} == {r for r in ("join", "view") if runs[r] in result.runs}
    for name, select in (("join-2", join), ("view-2", view)):
        again = _Trained()
        _fit(tiny, db, name, select, again)
        trained = {k for keys in again.keys.values() for k in keys}
        offset = 1000 if name.startswith("join") else 0
        assert trained and not {key_repr(i + offset) for i in gone} & trained
    db.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_forget_committed_while_a_fit_runs_leaves_the_row_out_and_names_the_run(
    kind: str, tiny: Path, tmp_path: Path
) -> None:
    uris = fresh_database(kind, tmp_path)
    uri = next(uris)
    try:
        _schema(uri)
        with sql_engine(uri).begin() as conn:
            conn.execute(
                sa.text("INSERT INTO docs (id, q, a) VALUES (:i, :q, 'a')"),
                [{"i": i, "q": f"question {i}"} for i in range(N, 40)],
            )
        db = lt.connect(uri, artifacts=tmp_path / "artifacts")
        # rows in key order, 2 a step: row 2 trains at step 2, row 33 would at step 17; what was
        # read ahead when the forget commits (a few windows of cache_size rows) trains as read
        forget = _Trained(uri, at=2, keys=[2, 33])
        model = _fit(tiny, db, "live", lt.Table("docs"), forget, cache_size=2)
        (run,) = db.metadata.list_runs("trainer", "live")
        # the row trained before the forget is attributed; the one planned after never trains
        assert key_repr(2) in forget.keys[2]
        trained = {k for keys in forget.keys.values() for k in keys}
        assert key_repr(33) not in trained and key_repr(32) in trained
        assert db.trained_on("docs", 2).runs == [run.run_id] and not db.trained_on("docs", 33)
        forgotten_runs = [r.payload["runs"] for r in db.metadata.list_components("forgotten")]
        assert any(run.run_id in runs for runs in forgotten_runs)  # the forget named the run
        with pytest.raises(lt.errors.ConfigError, match="forgotten since"):
            lt.LLMTrainer(
                "live",
                model=tiny,
                prompt_template="Q: {X}\nA: {Y}",
                num_train_epochs=1,
                batch_size=2,
                lora_r=4,
                progress_bar=False,
                shuffle=False,
                cache_size=2,
            ).fit(X="q", Y="a", db=db, select=lt.Table("docs"), incremental=True)
        assert model is not None
        db.close()
    finally:
        for _ in uris:
            pass


@seed(20261205)
@settings(max_examples=12, deadline=None, derandomize=True)
@given(gone=st.sets(st.integers(0, N - 1), max_size=4), lang=st.sampled_from([None, "en"]))
def test_mongodb_leaves_forgotten_documents_and_their_conversations_out(
    gone: set[int], lang: str | None
) -> None:
    """A collection (its filter, its projection) and conversations of a messages collection:
    a forgotten document is not read, a conversation holding a forgotten message goes whole."""
    import uuid

    from llmtrain.db.engines import mongo_database

    uri = f"mongomock://localhost/lt_{uuid.uuid4().hex[:8]}"
    database = mongo_database(uri)
    docs = [{"_id": i, "q": f"q {i}", "lang": "en" if i % 3 else "de"} for i in range(N)]
    database["docs"].insert_many(docs)
    database["messages"].insert_many(
        [
            {"_id": 100 + i, "chat": i // 3, "turn": i % 3, "role": "user", "content": "x"}
            for i in range(N)
        ]
    )
    db = lt.connect(uri)
    if gone:
        db.forget("docs", sorted(gone))
        db.forget("messages", [100 + i for i in sorted(gone)])
    select = lt.Collection("docs").find({"lang": lang} if lang else {}, projection=["q"])
    expected = {i for i in range(N) if i not in gone and (lang is None or docs[i]["lang"] == lang)}
    read = {k for page in db.backend.key_pages(select, None, 5) for k in _list(page.keys)}
    assert read == expected
    chats = lt.Conversations(lt.Collection("messages"), by="chat", order="turn")
    kept = {k for page in db.backend.key_pages(chats, None, 5) for k in _list(page.keys)}
    assert kept == {c for c in range(N // 3) if not {3 * c, 3 * c + 1, 3 * c + 2} & gone}
