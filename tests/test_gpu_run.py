"""The one-command GPU run (``benchmarks/gpu_run.py``) kept from rotting on a machine without a
GPU: its plan, its time limits, and a CPU smoke of part of its code path (``--smoke``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("gpu_run", BENCH / "gpu_run.py")
assert _spec is not None and _spec.loader is not None
gpu_run = importlib.util.module_from_spec(_spec)
sys.modules["gpu_run"] = gpu_run  # the dataclass looks its module up
_spec.loader.exec_module(gpu_run)


def test_the_plan_runs_every_check_in_order_with_a_cpu_path(tmp_path: Path) -> None:
    checks = gpu_run.checks(tmp_path)
    names = [c.name for c in checks]
    assert names == [
        "lora_1.5b",
        "qlora",
        "dora",
        "fsdp",
        "zero2",
        "zero3",
        "fsdp_qlora",
        "loss_memory",
        "packing",
        "lora_0.5b",
    ]
    for c in checks:
        for argv in (c.argv, c.smoke):
            if argv is not None:
                assert Path(argv[0]).is_file(), argv
    assert all(c.smoke for c in checks if c.name not in ("fsdp_qlora", "lora_0.5b"))
    # the priority checks fit the 9-minute budget when none is cut short by another
    assert sum(c.cap for c in checks[:-1]) <= 9 * 60 + 300  # caps, not expected times
    assert "--smoke" in checks[0].smoke and "--workdir" in checks[0].argv


def test_a_hanging_check_is_killed_with_its_children_at_its_limit(tmp_path: Path) -> None:
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    code += "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"
    check = gpu_run.Check("hang", [], 1, None, "check")
    started = time.monotonic()
    status, _ = gpu_run.run_one(check, ["-c", code], 2, tmp_path / "hang.log")
    assert status == "TIMED OUT (2 s)"
    assert time.monotonic() - started < 20
    assert "started" in (tmp_path / "hang.log").read_text()
    alive = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True)
    assert alive.stdout.strip() == ""  # the grandchild went with the group


def test_without_a_gpu_the_real_run_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on every CPU machine
    assert gpu_run.main(["--out", str(tmp_path), "--only", "packing"]) == 2


def test_a_check_the_budget_cannot_hold_is_skipped_not_started(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--smoke", "--only", "packing", "--budget", "10", "--out", str(out)]
    assert gpu_run.main([*argv, "--work", str(tmp_path)]) == 0
    status = json.loads((out / "results.json").read_text())["checks"]["packing"]["status"]
    assert status.startswith("skipped (") and "of the budget left" in status, status
    assert (out / "gpu_run.log").read_text() == ""


def test_cpu_smoke_of_the_gpu_run(tmp_path: Path) -> None:
    """The loss-memory and packing checks run for real on the CPU with tiny sizes; the table,
    results and log land under --out."""
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_run.py"),
            "--smoke",
            "--only",
            "packing,loss_memory",
            "--budget",
            "240",
            "--out",
            str(tmp_path / "out"),
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_run.log", "results.json", "table.md"]
    results = json.loads((out / "results.json").read_text())["checks"]
    assert results["packing"]["status"] == "ok"
    assert all(r["ok"] for r in results["packing"]["result"])
    assert results["loss_memory"]["status"] == "ok"
    assert results["loss_memory"]["result"]["rss_ratio"] > 0
    table = (out / "table.md").read_text()
    assert "| 2 | packing | ok |" in table and "sdpa float32: loss packed - padded" in table
    assert "| 1 | loss_memory | ok |" in table
    assert "===== packing:" in (out / "gpu_run.log").read_text()
