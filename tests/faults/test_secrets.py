"""Passwords never leave the URI they came in.

Promise: after fits against a PostgreSQL database whose URI carries a password (in the
authority, or as a ``?password=`` parameter), including a fit that fails with a database
error, the password appears in no stored byte (every ``_llmtrain_*`` table, every file and
file name under the artifact store), in no log record or progress output, and in no command
line of the training process or its children; stored URIs hold the redacted ``***`` form.
"""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import PG_ADMIN, fill

import llmtrain as lt
from llmtrain.db.retry import RetryPolicy
from llmtrain.errors import DatabaseUnavailableError

from .helpers import SessionKiller, admin_engine, doc_rows, trainer

PASSWORD = "s3cr3t-pw"


@pytest.fixture
def secret_database() -> Iterator[tuple[str, str]]:
    """A role with a password and a database it owns: ``(role, database)``. (pg_hba trusts
    127.0.0.1, so the password is not checked; what matters is that it is in the URI.)"""
    admin = admin_engine("postgresql")
    suffix = uuid.uuid4().hex[:8]
    role, database = f"lt_secret_{suffix}", f"lt_secret_db_{suffix}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'"))
        conn.execute(sa.text(f"CREATE DATABASE {database} OWNER {role}"))
    try:
        yield role, database
    finally:
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"
                ),
                {"d": database},
            )
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {database}"))
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


class ProcessTable:
    """``ps`` of this process and its children, sampled on a thread while a block runs."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            out = subprocess.run(
                ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=False
            ).stdout
            for line in out.splitlines():
                pid, ppid, *_ = line.split(None, 2)
                if me in (int(pid), int(ppid)):
                    self.lines.append(line)
            self._stop.wait(0.1)

    def __enter__(self) -> ProcessTable:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def stored_bytes(uri: str, artifacts: Path) -> tuple[bytes, list[str]]:
    """Every value of every ``_llmtrain_*`` table, and every file (and file name) under the
    artifact store."""
    admin = sa.create_engine(
        f"{PG_ADMIN}/{sa.engine.make_url(uri).database}", poolclass=sa.pool.NullPool
    )
    dump: list[bytes] = []
    tables: list[str] = []
    with admin.connect() as conn:
        for (name,) in conn.execute(
            sa.text("SELECT tablename FROM pg_tables WHERE tablename LIKE '\\_llmtrain\\_%'")
        ):
            tables.append(name)
            for row in conn.execute(sa.text(f'SELECT * FROM "{name}"')):
                dump.append(repr(tuple(row)).encode())
    admin.dispose()
    for path in sorted(artifacts.rglob("*")):
        dump.append(str(path).encode())
        if path.is_file():
            dump.append(path.read_bytes())
    return b"\n".join(dump), tables


@pytest.mark.parametrize("form", ["authority", "query parameter"])
def test_the_password_is_nowhere_after_training(
    form: str,
    secret_database: tuple[str, str],
    tiny: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    role, database = secret_database
    host = PG_ADMIN.split("@", 1)[1]
    uri = (
        f"postgresql+psycopg://{role}:{PASSWORD}@{host}/{database}"
        if form == "authority"
        else f"postgresql+psycopg://{role}@{host}/{database}?password={PASSWORD}"
    )
    fill(uri, "docs", doc_rows(16))
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))  # default artifact folder
    caplog.set_level("DEBUG")
    db = lt.connect(uri, retry=RetryPolicy(attempts=2, base=0.01, cap=0.01))
    with sa.create_engine(uri, poolclass=sa.pool.NullPool).connect() as conn:
        assert conn.execute(sa.text("SELECT current_user")).scalar() == role  # it connects
    with ProcessTable() as ps:
        model = trainer(
            tiny,
            "secret",
            max_steps=3,
            save_steps=2,
            progress_bar=True,
            eval_steps=3,
            eval_fraction=0.25,
        ).fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
        assert model.generate("What is color number 1?", max_new_tokens=2) is not None
        # a fit whose data reads fail for good stores the error (which names the URI)
        from llmtrain.training import run as run_module

        save = run_module.FitRun.save_checkpoint
        with SessionKiller(
            "postgresql", database, every=1, thread="llmtrain-prefetch", armed=False
        ) as killer:

            def outage_after_step_1(self: Any) -> Any:
                record = save(self)
                killer.armed = True
                return record

            monkeypatch.setattr(run_module.FitRun, "save_checkpoint", outage_after_step_1)
            with pytest.raises(DatabaseUnavailableError):
                trainer(tiny, "doomed", max_steps=8, save_steps=1, cache_size=4).fit(
                    X="instruction", Y="output", db=db, select=lt.Table("docs")
                )
        monkeypatch.setattr(run_module.FitRun, "save_checkpoint", save)
        print(repr(db), db.show(), db.load("trainer", "secret").to_dict())
    db.close()

    artifacts = tmp_path / "home" / "artifacts"
    assert any(artifacts.rglob("*")), "the default artifact folder was not used"
    stored, tables = stored_bytes(uri, artifacts)
    assert {
        "_llmtrain_components",
        "_llmtrain_runs",
        "_llmtrain_metrics",
        "_llmtrain_checkpoints",
    } <= set(tables)
    assert PASSWORD.encode() not in stored
    out, err = capfd.readouterr()
    assert "fit secret" in err  # the progress bar was shown, and captured
    for where, text in [
        ("stdout", out),
        ("stderr", err),
        ("logs", caplog.text),
        ("process table", "\n".join(ps.lines)),
    ]:
        assert PASSWORD not in text, f"the password leaked into the {where}"
    assert ps.lines, "the process table was never sampled"

    runs = {r.identifier: r for r in lt.connect(f"{PG_ADMIN}/{database}").metadata.list_runs()}
    doomed = runs["doomed"]
    assert doomed.status == "failed" and "DatabaseUnavailableError" in (doomed.error or "")
    assert f"{role}:***@" in (doomed.error or "") or "password=***" in (doomed.error or "")
    for run in runs.values():
        assert "***" in run.info["db"] and role in run.info["db"]
    assert b"***" in stored


def test_the_stored_uri_still_names_a_database_without_secrets(tmp_path: Path, tiny: Path) -> None:
    """Redaction leaves a URI with nothing to hide as it was (``sqlite:///x.db`` must not
    become ``sqlite:/x.db``, another file)."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", doc_rows(8))
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    trainer(tiny, "plain", max_steps=1).fit(
        X="instruction", Y="output", db=db, select=lt.Table("docs")
    )
    (run,) = db.metadata.list_runs("trainer", "plain")
    assert run.info["db"] == uri == db.uri
    assert db.load("trainer", "plain").config.fit.db == uri
    relative = lt.connect("sqlite:///data.db")
    assert relative.uri == "sqlite:///data.db"
