"""Artifacts on S3 (moto's server on loopback, through s3fs), end to end across processes.

A fit writes its checkpoints and adapter to ``s3://bucket/runs``; a fit killed with SIGKILL
after step 3 resumes in a fresh process from its step-2 checkpoint there and ends with the
uninterrupted run's adapter, bit for bit, and loads the reference model, which another
process wrote, from the bucket. The credentials, which every process finds in its
environment, are nowhere in the metadata database, the logs or the bucket.

Two phases: the reference and the killed fit side by side, then the resumed fit, which also
loads the reference model.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Server, fill

import llmtrain as lt
from llmtrain.stores.artifacts.fsspec_store import FsspecArtifactStore

from .helpers import adapter, assert_same_weights, doc_rows
from .test_kill_resume import OPTIONS as KILL_OPTIONS
from .test_kill_resume import Trace, finish, kill_when_held, launch, read_trace

pytestmark = pytest.mark.slow

#: 16 rows in batches of 4; checkpoints at steps 2, 4, 6 (the newest two kept); killed after
#: step 3, so it resumes from step 2
OPTIONS: dict[str, Any] = {**KILL_OPTIONS, "max_steps": 6, "save_steps": 2}
KILLED_AFTER, LAST_GOOD = 3, 2


@dataclass
class World:
    db: Any
    root: Path
    s3: S3Server
    bucket: str
    reference: Trace
    killed_returncode: int | None
    killed_checkpoints: list[int]
    first: Trace
    resumed: Trace
    loaded: list[str]


@pytest.fixture(scope="module")
def world(tiny: Path, tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> World:
    root = tmp_path_factory.mktemp("s3fit")
    uri = f"sqlite:///{root / 'data.db'}"
    fill(uri, "docs", doc_rows(16))
    bucket = s3_server.new_bucket()
    artifacts = f"s3://{bucket}/runs"
    base = {"uri": uri, "artifacts": artifacts, "model": str(tiny), "options": OPTIONS}
    db = lt.connect(uri, artifacts=artifacts)
    started: list[subprocess.Popen[bytes]] = []

    def start(cfg: dict[str, Any], name: str) -> subprocess.Popen[bytes]:
        started.append(launch(cfg, root / f"{name}.trace", root / f"{name}.log"))
        return started[-1]

    try:
        reference = start({**base, "identifier": "reference"}, "reference")
        hold = {"kind": "after-step", "step": KILLED_AFTER, "marker": str(root / "killed.held")}
        killed = start({**base, "identifier": "killed", "hold": hold}, "killed.first")
        kill_when_held({"killed": killed}, root)
        returncode = killed.wait(timeout=60)
        (run,) = db.metadata.list_runs("trainer", "killed")
        checkpoints = [c.step for c in db.metadata.list_checkpoints(run.run_id)]
        finish(reference, root / "reference.log")

        # the resumed process also loads the reference model, which another process wrote
        resumed = start(
            {**base, "identifier": "killed", "resume": True, "load_model": "reference"},
            "killed.resumed",
        )
        loaded = finish(resumed, root / "killed.resumed.log")["loaded"]
        return World(
            db,
            root,
            s3_server,
            bucket,
            read_trace(root / "reference.trace"),
            returncode,
            checkpoints,
            read_trace(root / "killed.first.trace"),
            read_trace(root / "killed.resumed.trace"),
            loaded,
        )
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def test_checkpoints_and_adapter_are_written_to_the_bucket(world: World) -> None:
    store = world.db.artifacts
    assert isinstance(store, FsspecArtifactStore)
    model = world.db.load("model", "reference")
    (run,) = world.db.metadata.list_runs("trainer", "reference")
    checkpoints = world.db.metadata.list_checkpoints(run.run_id)
    assert [c.step for c in checkpoints] == [4, 6]  # the newest two are kept
    keys = set(store.fs.find(world.bucket))
    for artifact_id in [model.record.adapter, *(c.artifact_id for c in checkpoints)]:
        assert store._path(artifact_id) in keys
    assert all(k.startswith(f"{world.bucket}/runs/") for k in keys)
    assert not (world.root / "data.db.artifacts").exists()  # the default folder stayed unused


def test_a_fresh_process_loads_the_model_from_the_bucket(world: World, tmp_path: Path) -> None:
    weights = adapter(world.db, world.db.load("model", "reference"), tmp_path)
    stored = sorted(
        hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for t in weights.values()
    )
    assert world.loaded == stored and len(stored) > 0


def test_a_killed_fit_resumes_from_the_bucket_and_ends_as_an_uninterrupted_one(
    world: World, tmp_path: Path
) -> None:
    assert world.killed_returncode == -signal.SIGKILL
    assert max(world.killed_checkpoints) == LAST_GOOD
    assert [s for s, _ in world.first] == list(range(1, KILLED_AFTER + 1))
    assert [s for s, _ in world.resumed] == list(range(LAST_GOOD + 1, OPTIONS["max_steps"] + 1))
    timeline = [e for e in world.first if e[0] <= LAST_GOOD] + world.resumed
    assert [s for s, _ in timeline] == [s for s, _ in world.reference]
    for (step, keys), (_, expected) in zip(timeline, world.reference):
        assert sorted(keys) == sorted(expected), f"step {step}"
    assert Counter(k for _, ks in timeline for k in ks) == Counter(
        k for _, ks in world.reference for k in ks
    )
    (run,) = world.db.metadata.list_runs("trainer", "killed")
    assert run.status == "completed" and run.info["steps"] == OPTIONS["max_steps"]
    db = world.db
    resumed, reference = db.load("model", "killed"), db.load("model", "reference")
    assert_same_weights(adapter(db, reference, tmp_path), adapter(db, resumed, tmp_path))


def test_no_credential_reaches_the_database_the_logs_or_the_bucket(world: World) -> None:
    secrets = [world.s3.secret_key.encode(), world.s3.access_key.encode()]
    for path in world.root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s in data for s in secrets), f"a credential is in {path.name}"
    store = world.db.artifacts
    assert isinstance(store, FsspecArtifactStore)
    keys = store.fs.find(world.bucket)
    assert len(keys) > 10
    for key in keys:
        data = store.fs.cat_file(key)
        assert not any(s in data for s in secrets), f"a credential is in s3://{key}"


def test_a_reader_without_the_bucket_is_told_where_the_artifacts_are(
    world: World, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Runs and models record their artifact store: the CLI reads from it when --artifacts is
    not given, lineage reads a run's snapshot from it, and a Datalayer opened on another store
    names it instead of a bare not-found when it loads a model's weights."""
    from llmtrain.cli import main
    from llmtrain.errors import ArtifactNotFoundError

    (run,) = world.db.metadata.list_runs("trainer", "reference")
    bucket = f"s3://{world.bucket}/runs"
    assert run.info["artifacts"] == bucket
    assert world.db.load("model", "reference").record.artifacts == bucket
    uri = world.db.secret_uri()
    assert main(["lineage", "reference", "--db", uri]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == OPTIONS["max_steps"] * OPTIONS["batch_size"]
    elsewhere = lt.connect(uri)  # the default folder next to the file: not where they are
    # lineage reads each run's snapshot where the run recorded it (the bucket), not a blank
    assert len(list(elsewhere.lineage("model", "reference"))) == len(lines)
    with pytest.raises(ArtifactNotFoundError, match=f"artifacts='{bucket}'"):
        elsewhere.load("model", "reference").export_adapter(tmp_path / "adapter")
    assert not (world.root / "data.db.artifacts").exists()  # reading created nothing
