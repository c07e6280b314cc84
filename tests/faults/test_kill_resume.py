"""kill -9 at an arbitrary point of a fit, then ``fit(resume=True)`` in a fresh process.

Promise: the resumed run trains every row exactly as often as an uninterrupted run (the
steps after the last complete checkpoint replace the lost ones, batch for batch), ends with
the same adapter bit for bit, and a checkpoint killed half-way through its write is never
taken for a good one.

All processes of a phase run at once (the reference with the three that get killed, then
the three resumes), each a real ``python driver.py`` tracing its keys to a file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import fill

import llmtrain as lt

from .helpers import adapter, assert_same_weights, doc_rows

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("driver.py")
#: 32 rows in batches of 4: 8 steps an epoch, so 12 steps cross into the second epoch;
#: windows of 8 rows, so a resume lands inside a window as well as between them
OPTIONS: dict[str, Any] = {
    "max_steps": 12,
    "save_steps": 3,
    "batch_size": 4,
    "cache_size": 8,
    "learning_rate": 1e-2,
    "lora_r": 8,
    "lora_dropout": 0.1,
    "progress_bar": False,
    "logging_steps": 1,
}
#: case -> (where the process is held and killed, at which step, the last good checkpoint)
CASES: dict[str, tuple[str, int, int]] = {
    "after-step-5": ("after-step", 5, 3),
    "mid-step-11": ("mid-step", 11, 9),  # in the second epoch
    "checkpoint-write-6": ("checkpoint-write", 6, 3),
}
Trace = list[tuple[int, list[str]]]


@dataclass
class Case:
    first: Trace = field(default_factory=list)  # what the killed process traced
    returncode: int | None = None
    held_at: str = ""
    checkpoints_after_kill: list[int] = field(default_factory=list)
    status_after_kill: str = ""
    partial_files: list[Path] = field(default_factory=list)
    resumed: Trace = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class World:
    db: Any
    root: Path
    reference: Trace
    reference_result: dict[str, Any]
    cases: dict[str, Case]


def read_trace(path: Path) -> Trace:
    file = Path(f"{path}.rank0")
    if not file.exists():
        return []
    return [(e["step"], e["keys"]) for e in map(json.loads, file.read_text().splitlines())]


def launch(cfg: dict[str, Any], trace: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # tests/: the driver's key trace (hooks.py)
        "PYTHONPATH": os.pathsep.join(
            [str(DRIVER.parent.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, str(DRIVER), json.dumps({**cfg, "trace": str(trace)})],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> dict[str, Any]:
    proc.wait(timeout=timeout)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    line = next(s for s in text.splitlines() if s.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def kill_when_held(
    procs: dict[str, subprocess.Popen[bytes]], root: Path, timeout: float = 400
) -> dict[str, str]:
    """SIGKILL each process as soon as it reports its hold point (they hold in any order:
    one held inside the artifact store can make another wait for the store's lock)."""
    held: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(held) < len(procs):
        for name, proc in procs.items():
            marker = root / f"{name}.held"
            if name in held or not marker.exists():
                assert name in held or proc.poll() is None, (
                    f"{name} exited before its hold point:\n"
                    f"{(root / f'{name}.first.log').read_text(errors='replace')[-4000:]}"
                )
                continue
            held[name] = marker.read_text()
            proc.send_signal(signal.SIGKILL)  # kill -9: no finally block, no atexit, nothing
        assert time.monotonic() < deadline, (
            f"never reached their hold points: {sorted(set(procs) - set(held))}"
        )
        time.sleep(0.05)
    return held


@pytest.fixture(scope="module")
def world(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("kill9")
    uri = f"sqlite:///{root / 'data.db'}"
    fill(uri, "docs", doc_rows(32))
    base = {
        "uri": uri,
        "artifacts": str(root / "artifacts"),
        "model": str(tiny),
        "options": OPTIONS,
    }
    db = lt.connect(uri, artifacts=root / "artifacts")
    started: list[subprocess.Popen[bytes]] = []
    try:
        return _run_the_world(db, root, base, started)
    finally:  # a failed phase leaves no held process behind
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def _run_the_world(
    db: Any, root: Path, base: dict[str, Any], started: list[subprocess.Popen[bytes]]
) -> World:
    def start(cfg: dict[str, Any], trace: Path, log: Path) -> subprocess.Popen[bytes]:
        started.append(launch(cfg, trace, log))
        return started[-1]

    # phase 1: the uninterrupted reference, and three fits that get killed
    reference = start(
        {**base, "identifier": "reference"}, root / "reference.trace", root / "reference.log"
    )
    killed = {}
    for name, (kind, step, _) in CASES.items():
        hold = {"kind": kind, "step": step, "marker": str(root / f"{name}.held")}
        killed[name] = start(
            {**base, "identifier": name, "hold": hold},
            root / f"{name}.first",
            root / f"{name}.first.log",
        )
    cases = {name: Case() for name in CASES}
    held = kill_when_held(killed, root)
    for name, proc in killed.items():
        case = cases[name]
        case.held_at = held[name]
        case.returncode = proc.wait(timeout=60)
        case.first = read_trace(root / f"{name}.first")
        (run,) = db.metadata.list_runs("trainer", name)
        case.status_after_kill = run.status
        case.checkpoints_after_kill = [c.step for c in db.metadata.list_checkpoints(run.run_id)]
        case.partial_files = sorted((root / "artifacts").rglob(".tmp-*"))
    reference_result = finish(reference, root / "reference.log")

    # phase 2: every killed fit resumes in a fresh process
    resumed = {
        name: start(
            {**base, "identifier": name, "resume": True},
            root / f"{name}.resumed",
            root / f"{name}.resumed.log",
        )
        for name in CASES
    }
    for name, proc in resumed.items():
        cases[name].result = finish(proc, root / f"{name}.resumed.log")
        cases[name].resumed = read_trace(root / f"{name}.resumed")
    return World(db, root, read_trace(root / "reference.trace"), reference_result, cases)


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_run_trains_every_row_exactly_as_often_as_an_uninterrupted_one(
    world: World, name: str
) -> None:
    last_good = CASES[name][2]
    case = world.cases[name]
    assert case.returncode == -signal.SIGKILL, case.returncode
    assert case.status_after_kill == "running"  # nobody got the chance to mark it
    assert max(case.checkpoints_after_kill) == last_good, case.checkpoints_after_kill
    # the killed process had trained past its last checkpoint: that work is lost...
    lost = [s for s, _ in case.first if s > last_good]
    assert lost, case.first
    assert [s for s, _ in case.first] == list(range(1, max(lost) + 1))
    # ...and the resumed process starts right after the checkpoint, replacing it
    assert [s for s, _ in case.resumed] == list(range(last_good + 1, OPTIONS["max_steps"] + 1))

    timeline = [e for e in case.first if e[0] <= last_good] + case.resumed
    assert [s for s, _ in timeline] == [s for s, _ in world.reference]
    for (s, keys), (_, expected) in zip(timeline, world.reference):
        assert sorted(keys) == sorted(expected), f"step {s}"
    trained = Counter(k for _, keys in timeline for k in keys)
    assert trained == Counter(k for _, keys in world.reference for k in keys)
    assert len(trained) == 32  # 12 steps x 4 rows: every row once, half of them twice
    assert sorted(Counter(trained.values()).items()) == [(1, 16), (2, 16)]


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_run_ends_with_the_uninterrupted_adapter_bit_for_bit(
    world: World, name: str, tmp_path: Path
) -> None:
    case, db = world.cases[name], world.db
    (run,) = db.metadata.list_runs("trainer", name)
    assert run.status == "completed" and run.run_id == case.result["run_id"]
    assert run.info["steps"] == OPTIONS["max_steps"]
    resumed, reference = db.load("model", name), db.load("model", "reference")
    assert_same_weights(adapter(db, reference, tmp_path), adapter(db, resumed, tmp_path))
    metrics = db.metadata.get_metrics(run.run_id)
    assert sorted({m.step for m in metrics}) == list(range(1, OPTIONS["max_steps"] + 1))


def test_a_checkpoint_killed_half_way_through_its_write_is_never_used(world: World) -> None:
    case = world.cases["checkpoint-write-6"]
    assert "of the checkpoint at step 6" in case.held_at
    # the write was really cut off: a partial temporary file is all that is left of it...
    assert case.partial_files, "the kill left no partial file: it did not hit the write"
    # ...no record points at it, so the resume went back to step 3, not to step 6
    assert 6 not in case.checkpoints_after_kill
    assert case.resumed[0][0] == 4
    store = world.db.artifacts
    for partial in case.partial_files:
        assert not any(partial.name in t for t in store._tree_ids())
    # every checkpoint the run now records is complete and verifies
    from llmtrain.training.checkpoint import verify

    (run,) = world.db.metadata.list_runs("trainer", "checkpoint-write-6")
    for i, record in enumerate(world.db.metadata.list_checkpoints(run.run_id)):
        folder = store.get_dir(record.artifact_id, world.root / f"verify-{i}")
        verify(folder)


@pytest.mark.parametrize("shape", ["mixture", "feedback", "sampled"])
def test_a_mixture_or_a_kto_run_killed_mid_run_resumes_the_same_steps(
    shape: str, tiny: Path, tmp_path: Path
) -> None:
    """kill -9 after step 5, then a resume: the steps, their rows and the adapter are the
    uninterrupted run's. A 32-row and 8-row mixture at 0.5/0.5 (the small source in its third
    pass by then); KTO on thumbs up/down (its reference values kept in the store as they
    were computed, read back by the resumed attempt); GRPO, whose resumed attempt samples the
    uninterrupted run's answers (the sampling RNG is the checkpoint's), scored by the database."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", doc_rows(32))
    fill(uri, "extra", doc_rows(8, start=100))
    base = {
        "uri": uri,
        "artifacts": str(tmp_path / "artifacts"),
        "model": str(tiny),
        "options": OPTIONS,
    }
    if shape == "mixture":
        parts = [lt.Table(t).fields("instruction", "output") for t in ("docs", "extra")]
        base["select"] = lt.mix(*parts, weights=[0.5, 0.5]).to_dict()
    elif shape == "sampled":
        base["options"] = {**OPTIONS, "objective": "grpo", "max_new_tokens": 6, "max_length": 96}
        share = "SELECT length(:completion) * 1.0 / (length(output) + 1) FROM docs WHERE id = :key"
        base["fields"] = {"X": "instruction", "Y": "output", "reward": lt.sql_reward(share)}
    else:
        fill(uri, "thumbs", [{**r, "liked": r["id"] % 3 != 0} for r in doc_rows(48)])
        base["options"] = {**OPTIONS, "objective": "kto"}
        base["fields"] = {"X": "instruction", "Y": "output", "label": "liked"}
        base["table"] = "thumbs"
    hold = {"kind": "after-step", "step": 5, "marker": str(tmp_path / "killed.held")}
    procs = {
        name: launch(
            {**base, "identifier": name, **extra},
            tmp_path / f"{name}.trace",
            tmp_path / f"{name}.first.log",
        )
        for name, extra in (("reference", {}), ("killed", {"hold": hold}))
    }
    try:
        kill_when_held({"killed": procs["killed"]}, tmp_path)
        assert procs["killed"].wait(timeout=60) == -signal.SIGKILL
        finish(procs["reference"], tmp_path / "reference.first.log")
        first = read_trace(tmp_path / "killed.trace")
        again = launch(
            {**base, "identifier": "killed", "resume": True},
            tmp_path / "killed.resumed",
            tmp_path / "killed.resumed.log",
        )
        finish(again, tmp_path / "killed.resumed.log")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    reference = read_trace(tmp_path / "reference.trace")
    resumed = read_trace(tmp_path / "killed.resumed")
    assert [s for s, _ in resumed] == list(range(4, OPTIONS["max_steps"] + 1))  # from step 3
    timeline = [e for e in first if e[0] <= 3] + resumed
    assert timeline == reference  # the same rows at the same steps, in the same order
    if shape == "mixture":
        extra = [k for _, keys in reference for k in keys if "'part': 1" in k]
        assert len(extra) == 24 and len(set(extra[:8])) == 8  # 3 passes, each whole
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    resumed_model, reference_model = db.load("model", "killed"), db.load("model", "reference")
    assert_same_weights(
        adapter(db, reference_model, tmp_path), adapter(db, resumed_model, tmp_path)
    )
