"""Training on Ray Train for real: one local Ray instance (2 CPUs), 2 workers running DDP.

The database stays with the driver: each worker reports what it could see of it (open files,
live SQLAlchemy engines) and the configuration shipped to the workers is searched for the
database's path and secret. Every rank traces the row keys of each step; the traces must be
exactly the rows (and order) the local dataset gives that rank in a 2-process run. A worker
killed mid-run with ``max_failures=1`` makes Ray restart the group from its last checkpoint,
and the run ends with the same adapter as the uninterrupted one; with ``max_failures=0`` a
worker's error fails the run, and ``fit(resume=True)`` of the stored recipe finishes it in a
new Ray job, again with the same rows and adapter. Four fits, sharing one Ray instance.
"""

from __future__ import annotations

import gc
import json
import math
import os
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import ray  # the dev extra installs it: no skip
import torch
from conftest import S3Server, fill
from safetensors.torch import load_file

import llmtrain as lt
from llmtrain.testing import tiny_model
from llmtrain.training.callbacks import Callback

pytestmark = pytest.mark.slow

TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
SECRET = "hunter2-s3cret"
N_ROWS, MICRO, ACCUM, WORLD, STEPS = 32, 2, 2, 2, 4
OPTIONS: dict[str, Any] = {
    "max_steps": STEPS,
    "batch_size": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "learning_rate": 5e-3,
    "lora_r": 4,
    "lora_dropout": 0.0,
    "shuffle": True,
    "cache_size": 4,
    "save_steps": 2,
    "progress_bar": False,
    "logging_steps": 1,
    "seed": 0,
}


class DieOnce(Callback):
    """Rank ``rank`` dies (no Python error, as a lost machine) after step ``step``, once."""

    def __init__(self, step: int, rank: int, marker: Path) -> None:
        self.step, self.rank, self.marker = step, rank, marker

    def on_step(self, run: Any, keys: list[str]) -> None:
        if run.step == self.step and run.strategy.rank == self.rank and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)


class Attempts(Callback):
    """Each rank's attempts at the run, as JSON lines in ``{path}.rank{r}``: where an attempt
    began (its pid, the step its setup restored, the optimizer's step counters) and each step
    it trained (pid, step, keys). A restart or a resume is a new pid."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, run: Any, entry: dict[str, Any]) -> None:
        with open(f"{self.path}.rank{run.strategy.rank}", "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), **entry}) + "\n")

    def on_train_begin(self, run: Any) -> None:
        counters = sorted({float(s["step"]) for s in run.optimizer.state.values() if "step" in s})
        self._write(run, {"begin": run.step, "optimizer_steps": counters})

    def on_step(self, run: Any, keys: list[str]) -> None:
        self._write(run, {"step": run.step, "keys": keys})


def attempts(path: Path) -> list[dict[str, Any]]:
    """A rank's attempts in order: ``{begin, optimizer_steps, steps: [step, ...]}``."""
    out: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "begin" in entry:
            out.append({**entry, "steps": []})
        else:
            assert out and out[-1]["pid"] == entry["pid"], "a step outside its attempt"
            out[-1]["steps"].append(entry["step"])
    return out


class FailAt(Callback):
    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_step(self, run: Any, keys: list[str]) -> None:
        if run.step == self.step and run.strategy.rank == self.rank:
            raise RuntimeError(f"worker boom at step {run.step}")


class DatabaseSeen(Callback):
    """What a worker holds of the database at the end: open files, SQLAlchemy engines."""

    def __init__(self, db_file: Path, out: Path) -> None:
        self.db_file, self.out = db_file, out

    def on_train_end(self, run: Any) -> None:
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        engines = 0
        if "sqlalchemy" in sys.modules:
            from sqlalchemy.engine import Engine

            engines = sum(isinstance(o, Engine) for o in gc.get_objects())
        report = {
            "pid": os.getpid(),
            "open": [f for f in fds if str(self.db_file) in f],
            "engines": engines,
            "db": type(run.db).__name__,
        }
        Path(f"{self.out}.rank{run.strategy.rank}.json").write_text(json.dumps(report))


@dataclass
class Env:
    root: Path
    uri: str
    db: Any
    tiny: Path
    bucket: str
    fits: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Env]:
    """One Ray instance, started after the S3 server so its workers see the endpoint."""
    root = tmp_path_factory.mktemp("ray")
    tiny = tiny_model(root / "llama")
    uri = f"sqlite:///file:{root / 'data.db'}?uri=true&token={SECRET}"
    rows = [
        {"id": i, "instruction": f"Item {i}: color {i % 8}?", "output": COLORS[(3 * i) % 8]}
        for i in range(N_ROWS)
    ]
    fill(uri, "docs", rows)
    db = lt.connect(uri, artifacts=root / "artifacts")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's callbacks
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield Env(root, uri, db, tiny, s3_server.new_bucket())
    finally:
        ray.shutdown()
        db.close()


def _fit(
    env: Env, name: str, *callbacks: Callback, max_failures: int = 0, storage: str = ""
) -> Any:
    ray_config = lt.RayConfig(
        num_workers=WORLD, max_failures=max_failures, storage=storage or str(env.root / "ray")
    )
    trainer = lt.LLMTrainer(
        name, model=env.tiny, prompt_template=TEMPLATE, ray_config=ray_config, **OPTIONS
    )
    return trainer.fit(
        X="instruction", Y="output", db=env.db, select=lt.Table("docs"), callbacks=callbacks
    )


def _uninterrupted(env: Env) -> Any:
    if "plain" not in env.fits:
        trace, seen = (
            Attempts(env.root / "trace-plain"),
            DatabaseSeen(env.root / "data.db", env.root / "seen"),
        )
        env.fits["plain"] = _fit(env, "ray-plain", trace, seen)
    return env.fits["plain"]


def _adapter(env: Env, model: Any) -> dict[str, torch.Tensor]:
    folder = env.root / f"adapter-{model.identifier}"
    if not folder.exists():
        env.db.artifacts.get_dir(model.record.adapter, folder)
    return load_file(str(folder / "adapter_model.safetensors"))


def _trace(path: Path) -> dict[int, list[str]]:
    """Step -> keys; a step trained again after a restart counts once (its last run)."""
    steps: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "step" in entry:
            steps[entry["step"]] = entry["keys"]
    return steps


def test_fit_on_ray_trains_records_and_loads_in_peft(env: Env) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _uninterrupted(env)
    (run,) = env.db.metadata.list_runs("trainer", "ray-plain")
    assert run.status == "completed", run.error
    assert run.info["strategy"] == "ddp" and run.info["world_size"] == WORLD
    assert run.info["steps"] == STEPS
    world = run.info["world"]  # the node ranks Ray gave its workers: one node here
    assert world["nodes"] == 1 and [r["node_rank"] for r in world["ranks"]] == [0] * WORLD
    info = run.info["ray"]
    assert info["status"] == "completed" and info["num_workers"] == WORLD
    assert info["checkpoints"] == ["checkpoint-00000002", "checkpoint-00000004"]
    assert info["metrics"]["step"] == STEPS
    # Ray's checkpoints are the run's checkpoints, in the artifact store as a local run's
    steps = [c.step for c in env.db.metadata.list_checkpoints(run.run_id)]
    assert steps == [2, 4]
    assert (env.root / "ray" / info["name"] / "checkpoint-00000004").is_dir()
    assert len(env.db.metadata.get_metrics(run.run_id)) >= STEPS
    # stock PEFT loads the adapter, and it changed the model's output
    folder = env.root / "peft-adapter"
    env.db.artifacts.get_dir(model.record.adapter, folder)
    base = AutoModelForCausalLM.from_pretrained(env.tiny)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(env.tiny), folder)
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, tuned(ids).logits)
    # replaying the stored recipe keeps its Ray configuration
    loaded = env.db.load("trainer", "ray-plain")
    assert loaded.config.ray_config == lt.RayConfig(
        num_workers=WORLD, storage=str(env.root / "ray")
    )


def test_workers_never_reach_the_database(env: Env) -> None:
    from llmtrain.running.ray.driver import RayRun

    _uninterrupted(env)
    for rank in range(WORLD):
        seen = json.loads((env.root / f"seen.rank{rank}.json").read_text())
        assert seen["pid"] != os.getpid()
        assert seen == {**seen, "open": [], "engines": 0, "db": "RemoteDB"}
    # what is shipped to the workers names neither the database nor its secret
    from llmtrain.training.plan import RunPlan

    (run,) = env.db.metadata.list_runs("trainer", "ray-plain")
    shipped = ray.cloudpickle.dumps(
        RayRun(RunPlan.from_record(run), env.db, []).loop_config(broker=None)
    )
    for secret in (SECRET, str(env.root / "data.db"), "data.db", "sqlite"):
        assert secret.encode() not in shipped
    assert SECRET not in json.dumps(run.info, default=str)


def test_each_worker_trains_its_rank_rows_in_the_local_order(env: Env) -> None:
    _uninterrupted(env)
    (run,) = env.db.metadata.list_runs("trainer", "ray-plain")
    from llmtrain.data import RunSnapshot

    pinned = RunSnapshot.from_record(run.info["snapshot"])
    trained: list[str] = []
    for rank in range(WORLD):
        local = lt.CachedQueryDataset(
            env.db,
            lt.Table("docs"),
            ["instruction", "output"],
            cache_size=OPTIONS["cache_size"],
            shuffle=True,
            seed=0,
            rank=rank,
            world_size=WORLD,
            split="train",
            snapshot=pinned,
            return_keys=True,
        )
        expected = [f"int:{row['_key']}" for row in local]
        traced = _trace(env.root / f"trace-plain.rank{rank}")
        (only,) = attempts(env.root / f"trace-plain.rank{rank}")  # one attempt, from scratch
        assert only["begin"] == 0 and only["steps"] == list(range(1, STEPS + 1))
        got = [k for step in sorted(traced) for k in traced[step]]
        assert got == expected[: len(got)] and len(got) == N_ROWS // WORLD
        trained += got
    assert sorted(trained) == sorted(f"int:{i}" for i in range(N_ROWS))


def test_losses_and_adapter_equal_a_local_two_process_ddp_run(env: Env) -> None:
    """The same recipe launched by torchrun on this machine (2 processes reading the database
    themselves): the same loss at every step and the same adapter as on Ray."""
    on_ray = _uninterrupted(env)
    launcher = lt.Launcher(kind="torchrun", num_processes=WORLD)
    local = lt.LLMTrainer(
        "ddp-local", model=env.tiny, prompt_template=TEMPLATE, launcher=launcher, **OPTIONS
    ).fit(X="instruction", Y="output", db=env.db, select=lt.Table("docs"))
    runs = [env.db.metadata.list_runs("trainer", name)[0] for name in ("ray-plain", "ddp-local")]
    assert [r.info["world_size"] for r in runs] == [WORLD, WORLD]
    losses = [[m.values["loss"] for m in env.db.metadata.get_metrics(r.run_id)] for r in runs]
    assert len(losses[0]) == STEPS and losses[0] == pytest.approx(losses[1], rel=1e-5)
    expected, got = _adapter(env, local), _adapter(env, on_ray)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_killed_worker_restarts_from_checkpoint_with_the_same_adapter(env: Env) -> None:
    uninterrupted = _uninterrupted(env)
    marker = env.root / "killed"
    trace = Attempts(env.root / "trace-killed")
    storage = f"s3://{env.bucket}/ray"  # Ray's storage on S3 (moto): written, restored from
    model = _fit(env, "ray-killed", DieOnce(3, 1, marker), trace, max_failures=1, storage=storage)
    assert marker.exists()  # a worker really died
    (run,) = env.db.metadata.list_runs("trainer", "ray-killed")
    assert run.status == "completed" and run.info["steps"] == STEPS
    assert run.info["ray"]["storage"] == storage
    import s3fs

    written = s3fs.S3FileSystem().find(f"{env.bucket}/ray/{run.info['ray']['name']}")
    assert any("checkpoint-00000004/" in path for path in written), written
    # Ray restarted the group from the step-2 checkpoint: every rank's second attempt began
    # there, with the optimizer's state of step 2, and trained steps 3 and 4 only
    for rank in range(WORLD):
        first, second = attempts(env.root / f"trace-killed.rank{rank}")
        assert first["begin"] == 0 and first["steps"][:2] == [1, 2]
        assert second["begin"] == 2 and second["optimizer_steps"] == [2.0]
        assert second["steps"] == [3, 4] and second["pid"] != first["pid"]
    # every row trained as often as in the uninterrupted run, in the same steps
    for rank in range(WORLD):
        assert _trace(env.root / f"trace-killed.rank{rank}") == _trace(
            env.root / f"trace-plain.rank{rank}"
        )
    plain, killed = _adapter(env, uninterrupted), _adapter(env, model)
    assert plain.keys() == killed.keys()
    for name in plain:
        torch.testing.assert_close(killed[name], plain[name], rtol=1e-5, atol=1e-6)


def test_worker_error_fails_the_run_and_a_resume_on_ray_finishes_it(env: Env) -> None:
    trace = Attempts(env.root / "trace-resumed")
    with pytest.raises(Exception, match="worker boom at step 3"):
        _fit(env, "ray-failing", FailAt(3, 1), trace, max_failures=0)
    (run,) = env.db.metadata.list_runs("trainer", "ray-failing")
    assert run.status == "failed"
    assert "worker boom at step 3" in run.error
    assert run.info["ray"]["status"] == "failed"
    assert [c.step for c in env.db.metadata.list_checkpoints(run.run_id)] == [2]
    # the stored recipe, replayed: a new Ray job continues the run from its checkpoint
    model = env.db.load("trainer", "ray-failing").fit(resume=True, callbacks=[trace])
    uninterrupted = _uninterrupted(env)  # its trace too: this test may run alone
    (run,) = env.db.metadata.list_runs("trainer", "ray-failing")
    assert run.status == "completed" and run.info["steps"] == STEPS
    for rank in range(WORLD):  # the new Ray job began at the checkpoint, optimizer restored
        first, resumed = attempts(env.root / f"trace-resumed.rank{rank}")
        assert first["begin"] == 0 and first["steps"][:2] == [1, 2]
        assert resumed["begin"] == 2 and resumed["optimizer_steps"] == [2.0]
        assert resumed["steps"] == [3, 4]
        assert _trace(env.root / f"trace-resumed.rank{rank}") == _trace(
            env.root / f"trace-plain.rank{rank}"
        )
    plain, resumed = _adapter(env, uninterrupted), _adapter(env, model)
    for name in plain:
        torch.testing.assert_close(resumed[name], plain[name], rtol=1e-5, atol=1e-6)


def test_ray_config_rules() -> None:
    with pytest.raises(lt.ConfigError, match="ray_config and launcher"):
        lt.LLMTrainer(
            "x",
            model="m",
            prompt_template=TEMPLATE,
            ray_config=lt.RayConfig(),
            launcher=lt.Launcher(kind="torchrun", num_processes=2),
        )
    with pytest.raises(lt.ConfigError, match="use_gpu"):
        lt.RayConfig(use_gpu=True, resources_per_worker={"GPU": 0})
    with pytest.raises(lt.ConfigError, match="num_workers"):
        lt.RayConfig(num_workers=0)
    plain = lt.LLMTrainer("x", model="m", prompt_template=TEMPLATE)
    assert plain.to_dict()["ray_config"] is None
    assert pickle.loads(pickle.dumps(lt.RayConfig(storage="s3://b/p"))).storage == "s3://b/p"
    with pytest.raises(lt.ConfigError, match="credentials and options do not belong"):
        lt.RayConfig(storage="s3://key:secret@bucket/ray")


def test_workers_the_cluster_cannot_place_are_refused_at_once(env: Env) -> None:
    """use_gpu on a cluster without a GPU: Ray would wait for one (printing its autoscaler's
    lines for minutes); the fit fails at once, naming the request and what the cluster has."""
    trainer = lt.LLMTrainer(
        "ray-gpu",
        model=env.tiny,
        prompt_template=TEMPLATE,
        ray_config=lt.RayConfig(num_workers=WORLD, use_gpu=True, storage=str(env.root / "ray")),
        **OPTIONS,
    )
    with pytest.raises(lt.ConfigError, match=r"\{'GPU': 2\.0\}.*'GPU': 0.*not enough GPU"):
        trainer.fit(X="instruction", Y="output", db=env.db, select=lt.Table("docs"))
    # refused before anything was recorded
    assert env.db.metadata.list_runs("trainer", "ray-gpu") == []
    assert "ray-gpu" not in env.db.show("trainer")


def test_dpo_on_ray_from_an_earlier_model_keeps_its_reference_values(env: Env) -> None:
    """DPO on Ray workers that never reach the database: the SFT model trained on Ray is
    where they start and their reference (step 1 at ln 2); the reference log-probs both
    workers computed reach the store through the driver, each pair's once (a replay reads
    them: tested in one process, test_preference.py), and so does the key of the pair a
    worker skipped (its answers are equal)."""
    from llmtrain.data.skips import read_skips

    _uninterrupted(env)
    pairs = [
        {"id": i, "prompt": f"Item {i}: color {i % 8}?", "chosen": COLORS[(3 * i) % 8], "no": "x"}
        for i in range(N_ROWS)
    ]
    pairs[3]["chosen"] = "x"
    fill(env.uri, "pairs", pairs)
    ray_config = lt.RayConfig(num_workers=WORLD, storage=str(env.root / "ray"))
    trainer = lt.LLMTrainer(
        "ray-dpo",
        model=env.tiny,
        prompt_template=TEMPLATE,
        ray_config=ray_config,
        objective="dpo",
        init_from="ray-plain",
        **{**OPTIONS, "on_bad_row": "skip"},
    )
    fields = {"X": "prompt", "chosen": "chosen", "rejected": "no"}
    assert trainer.fit(db=env.db, select=lt.Table("pairs"), **fields) is not None
    (run,) = env.db.metadata.list_runs("trainer", "ray-dpo")
    assert run.status == "completed" and run.info["parent"]["run_id"]
    first = env.db.metadata.get_metrics(run.run_id)[0].values
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    *_, kept = env.db.metadata.list_components("reference_logps")  # its newest index
    values = [json.loads(env.db.artifacts.get_bytes(b)) for b in kept.payload["blobs"]]
    assert sum(map(len, values)) == len(set().union(*values)) == N_ROWS - 1  # each pair once
    assert [key for key, _ in read_skips(env.db.artifacts, run.info).skipped.values()] == [3]
