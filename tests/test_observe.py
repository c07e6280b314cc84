"""Seeing a run: the trackers of ``report_to`` read back with each tool's own reader, nothing
secret in anything they wrote, plain progress lines off a terminal, ``show run``.

One real fit serves every test: ``llmtrain fit`` in a subprocess, its output piped, a
PostgreSQL URI with a password on its command line, all trackers at once, offline.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from conftest import fill, fresh_database

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.config.file import load_job
from llmtrain.config.spec import FitSpec
from llmtrain.errors import ConfigError
from llmtrain.integrations.trackers import check_trackers
from llmtrain.testing import tiny_model

REPO = Path(__file__).resolve().parents[1]
NAME = "observed"
STEPS = 4
SECRET = "pw-Zq83-not-for-trackers"
TEMPLATE = "### Q:\n{X}\n### A:\n{Y}"
TRACKERS = ["tensorboard", "mlflow", "wandb"]  # all in the dev extra


@dataclass
class Observed:
    tmp: Path
    uri: str  # with the password
    result: subprocess.CompletedProcess[str]
    db: Any
    run: Any

    def metrics(self, key: str) -> dict[int, float]:
        return {
            m.step: m.values[key]
            for m in self.db.metadata.get_metrics(self.run.run_id)
            if key in m.values
        }


def _with_password(uri: str) -> tuple[str, str]:
    """The URI with a password (the server's own one when the URI already carries it)."""
    url = sa.engine.make_url(uri)
    if url.password:
        return uri, str(url.password)
    return url.set(password=SECRET).render_as_string(hide_password=False), SECRET


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observed")
    databases = fresh_database("postgresql", tmp)
    uri, secret = _with_password(next(databases))
    try:
        fill(
            uri,
            "docs",
            [
                {"id": i, "instruction": f"Colour {i % 8}?", "output": f"c{i % 8}"}
                for i in range(32)
            ],
        )
        config = {
            "name": NAME,
            "artifacts": str(tmp / "artifacts"),
            "prompt_template": TEMPLATE,
            "model_args": {"model_name_or_path": str(tiny_model(tmp / "tiny"))},
            "lora_args": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0},
            "training_args": {
                "max_steps": STEPS,
                "per_device_train_batch_size": 4,
                "learning_rate": 0.01,
                "logging_steps": 1,
                "save_steps": 2,
                "eval_steps": 2,
                "report_to": TRACKERS,
            },
            "data_args": {"max_length": 64, "eval_fraction": 0.25},
            "data": {"X": "instruction", "Y": "output", "select": {"table": "docs"}},
        }
        path = tmp / "fit.yaml"
        path.write_text(yaml.safe_dump(config))
        # version 0: the same recipe with another learning rate and no trackers
        job = load_job(
            path,
            [
                "--db",
                uri,
                "--training_args.learning_rate",
                "0.001",
                "--training_args.report_to",
                "[]",
            ],
        )
        db = lt.connect(job.db_uri, artifacts=job.config.artifacts)
        earlier = lt.LLMTrainer(job.config.name, **job.options)
        earlier.config.fit = FitSpec(
            X="instruction", Y="output", select=job.select.to_dict(), db=db.uri
        )
        db.add(earlier)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "LLMTRAIN_TENSORBOARD_DIR": str(tmp / "tb"),
            # a file store: an SQLite one is the same to llmtrain, and 3 s slower to create
            "MLFLOW_TRACKING_URI": f"file://{tmp / 'mlruns'}",
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "WANDB_MODE": "offline",
            "WANDB_PROJECT": "llmtrain-test",
            **{
                f"WANDB_{d}_DIR": str(tmp / f"wandb-{d.lower()}")
                for d in ("CONFIG", "CACHE", "DATA")
            },
            "WANDB_DIR": str(tmp / "wandb"),
        }
        result = subprocess.run(  # the password on the command line, as users pass --db
            [sys.executable, "-m", "llmtrain.cli", "fit", str(path), "--db", uri],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        (run,) = db.metadata.list_runs("trainer", NAME)
        yield Observed(tmp, uri, result, db, run)
        db.close()
    finally:
        next(databases, None)  # drops the database


def test_piped_output_has_plain_lines_and_no_redraws(observed: Observed) -> None:
    out, err = observed.result.stdout, observed.result.stderr
    assert "\r" not in out and "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"fit {NAME}: ")]
    losses, lrs = observed.metrics("loss"), observed.metrics("lr")
    expected = []
    for step in range(1, STEPS + 1):
        expected.append(
            re.escape(f"fit {NAME}: step {step}/{STEPS} loss {losses[step]:.4f} ")
            + re.escape(f"lr {lrs[step]:.2e}")
            + r" tokens/s \d+"
        )
        if step % 2 == 0:
            expected.append(rf"fit {NAME}: step {step}/{STEPS} eval_loss \d+\.\d{{4}}")
    assert len(lines) == len(expected), err
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    assert re.search(rf"run {observed.run.run_id}: completed, {STEPS} steps", out)


def test_tensorboard_event_files(observed: Observed) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = (observed.tmp / "tb").iterdir()
    assert folder.name == f"{NAME}-v1-{observed.run.run_id[:8]}"
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert loss == pytest.approx(observed.metrics("loss"), rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4]

    def text(tag: str) -> Any:
        (event,) = events.Tensors(f"{tag}/text_summary")
        body = event.tensor_proto.string_val[0].decode()
        return json.loads(body.strip("`\n"))

    assert text("recipe")["training_args"]["learning_rate"] == 0.01
    assert text("data_fingerprint") == observed.run.info["data_fingerprint"]
    assert text("versions")["torch"] == observed.run.info["versions"]["torch"]


def test_mlflow_tracking_store(observed: Observed, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file://{observed.tmp / 'mlruns'}")
    experiment = client.get_experiment_by_name(NAME)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name.startswith(f"{NAME}-v1-")
    params = run.data.params
    assert float(params["training_args.learning_rate"]) == 0.01
    assert params["data_fingerprint"] == observed.run.info["data_fingerprint"]
    assert params["versions.transformers"] == observed.run.info["versions"]["transformers"]
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(observed.metrics("loss"))
    assert run.data.metrics["eval/loss"] == pytest.approx(observed.metrics("eval_loss")[STEPS])


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B offline run file: a 7-byte header, then LevelDB-log blocks of
    32 KiB holding (crc, length, type) chunks, each record a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos = path.read_bytes(), 32768, 7
    assert data.startswith(b":W&B")
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run(observed: Observed) -> None:
    (path,) = (observed.tmp / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name.startswith(f"{NAME}-v1-") and run.project == "llmtrain-test"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["training_args"]["learning_rate"] == 0.01
    assert config["data_fingerprint"] == observed.run.info["data_fingerprint"]
    assert config["versions"]["peft"] == observed.run.info["versions"]["peft"]
    rows = [
        {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    loss = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert loss == pytest.approx(observed.metrics("loss"))
    assert [row["_step"] for row in rows if "eval/loss" in row] == [2, 4]
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def test_no_tracker_sees_the_password(observed: Observed) -> None:
    secret = sa.engine.make_url(observed.uri).password
    assert secret and secret.encode() and f":{secret}@" in observed.uri
    written = [p for p in observed.tmp.rglob("*") if p.is_file()]
    assert len(written) > 20  # the trackers' files, the artifacts
    leaked = [str(p) for p in written if str(secret).encode() in p.read_bytes()]
    assert leaked == []
    assert secret not in observed.result.stdout + observed.result.stderr


def test_show_run_summarises(
    observed: Observed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["show", "run", NAME, "--db", observed.uri, "--artifacts", str(observed.tmp / "artifacts")]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    run = observed.run
    losses, evals = observed.metrics("loss"), observed.metrics("eval_loss")
    best = min(losses, key=losses.__getitem__)
    best_eval = min(evals, key=evals.__getitem__)
    for expected in [
        f"run        {run.run_id}",
        "status     completed",
        f"steps      {STEPS}, {run.info['tokens']} tokens",
        f"loss       final {losses[STEPS]:.4f} (step {STEPS}), best {losses[best]:.4f} "
        f"(step {best})",
        f"eval loss  final {evals[STEPS]:.4f} (step {STEPS}), best {evals[best_eval]:.4f} "
        f"(step {best_eval})",
        f"data fingerprint  {run.info['data_fingerprint']}",
        "recipe     changes from v0:",
        "  training_args.learning_rate: 0.001 -> 0.01",
        f"  training_args.report_to: [] -> {json.dumps(TRACKERS)}",
    ]:
        assert expected in out, (expected, out)
    assert re.search(r"^duration   \d+\.\d s$", out, re.M)
    assert re.search(r"^tokens/s   \d+ \(training\)$", out, re.M)
    assert re.search(r"^2\s+[0-9a-z:]+\S*$", out, re.M) and re.search(r"STEP\s+CHECKPOINT", out)
    assert observed.uri not in out and "***" in out  # the database, shown redacted


def test_report_to_checks_names_and_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"training_args\.report_to"):
        lt.LLMTrainer("t", model="m", prompt_template=TEMPLATE, report_to=["tensorbord"])
    with pytest.raises(ConfigError, match="report_to names a tracker twice"):
        lt.LLMTrainer("t", model="m", prompt_template=TEMPLATE, report_to=["wandb", "wandb"])
    plain = lt.LLMTrainer("t", model="m", prompt_template=TEMPLATE).to_dict()
    assert plain["training_args"]["report_to"] == []
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import fails
    with pytest.raises(ConfigError) as caught:
        lt.LLMTrainer("t", model="m", prompt_template=TEMPLATE, report_to=["tensorboard", "wandb"])
    assert str(caught.value) == (
        "training_args.report_to: 'wandb' needs the wandb package: pip install "
        "'llmtrain[wandb]' (or drop 'wandb' from report_to)"
    )
    check_trackers(["tensorboard", "mlflow"])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    from llmtrain.training.progress import Bar, Lines, make_progress

    metrics = {"loss": 1.5, "lr": 1e-4, "tokens_per_s": 99.6}
    for stream, kind in ((_Terminal(), Bar), (io.StringIO(), Lines)):
        progress = make_progress("fit t", 5, 0, 2, stream)
        assert isinstance(progress, kind)
        for step in range(1, 6):
            progress.step(step, metrics)
        progress.evaluated(5, 1.25)
        progress.close()
        text = stream.getvalue()
        assert ("\r" in text) is (kind is Bar)
    assert text.splitlines() == [
        f"fit t: step {step}/5 loss 1.5000 lr 1.00e-04 tokens/s 100" for step in (2, 4, 5)
    ] + ["fit t: step 5/5 eval_loss 1.2500"]


def test_show_run_lists_every_logged_step_and_a_ray_runs_details(tmp_path: Path) -> None:
    """An evaluation at a step that logged no train loss (eval_steps=3, logging_steps=2) has
    its own row; a Ray run shows its Ray run, status, workers, storage and checkpoints."""
    from llmtrain.cli.report import run_summary

    db = lt.connect(f"sqlite:///{tmp_path / 'data.db'}")
    ray = {
        "name": "llmtrain-ab12-cd34",
        "status": "completed",
        "num_workers": 2,
        "storage": "s3://bucket/ray",
        "checkpoints": ["checkpoint-00000002", "checkpoint-00000004"],
    }
    db.metadata.create_run("r1", "trainer", "t", 0, {"ray": ray, "steps": 4})
    db.metadata.log_metrics("r1", 2, {"loss": 1.5, "lr": 1e-3, "tokens_per_s": 10.0})
    db.metadata.log_metrics("r1", 3, {"eval_loss": 1.25})
    db.metadata.log_metrics("r1", 4, {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0})
    lines = run_summary(db, db.metadata.get_run("r1"))
    text = "\n".join(lines)
    assert re.search(r"^3\s+-\s+-\s+-\s+1\.25$", text, re.M), text
    assert [ln.split()[0] for ln in text.split("STEP")[1].splitlines()[1:4]] == ["2", "3", "4"]
    assert (
        "ray        llmtrain-ab12-cd34: completed, 2 worker(s), storage s3://bucket/ray, "
        "checkpoints checkpoint-00000002, checkpoint-00000004"
    ) in lines
