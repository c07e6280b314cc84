"""Every GPU check in one run, in order of value, each under its own time limit.

    python benchmarks/gpu_run.py [--out DIR] [--budget 540] [--only NAME,...] [--smoke]

``benchmarks/gpu_run.sh`` installs the carried wheels on the lent GPU machine and calls this
(``benchmarks/GPU.md`` says how to run it). ``--smoke`` runs the same scripts on the CPU with
tiny sizes (``tests/test_gpu_run.py`` runs a part of it). The checks, each a subprocess in its
own process group, killed with its children at its limit:

1. ``lora_1.5b``: LoRA bf16 on the Qwen2.5-1.5B shape, llmtrain against TRL's SFTTrainer:
   tokens/s, MFU, peak memory (``gpu_check.py --mfu``);
2. ``qlora``: 4-bit base through ``fit()``: the loss falls, the merged export equals the
   trained model; 3. ``dora`` likewise; 4. ``fsdp``, ``zero2``, ``zero3``, ``fsdp_qlora``
   with world size 1 through torchrun and the deepspeed launcher (``gpu_check.py``);
5. ``loss_memory``: chunked loss against full logits, vocabulary 151936, 4096 tokens
   (``bench_loss_memory.py``); 6. ``packing``: padding-free packing with SDPA (and flash
   attention's varlen kernel when ``flash_attn`` imports) (``gpu_packing.py``);
7. ``lora_0.5b``: check 1 on the 0.5B shape, if time is left.

A check starts only with at least ``FLOOR`` seconds for itself and each one after it; its limit
is its own cap or what the budget leaves. Writes ``table.md`` (the environment, one row a
check, the MFU table), ``results.json`` and ``gpu_run.log`` (every check's output) under
``--out``, and prints the table last. Exit status 0 when every check that ran passed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FLOOR = 20  # seconds: the least a check is started with
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "deepspeed",
    "trl",
    "datasets",
    "pydantic",
    "sqlalchemy",
    "flash-attn",
)
OFFLINE = {  # nothing outside the device machine can be reached: never wait on a hub
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class Check:
    name: str
    argv: list[str]  # after ``python3``, on the GPU
    cap: int  # seconds
    smoke: list[str] | None  # the CPU's argv; None: GPU only
    parse: str  # which result line to read
    result: dict[str, Any] = field(default_factory=dict)


def checks(work: Path) -> list[Check]:
    check, mfu = str(HERE / "gpu_check.py"), [str(HERE / "gpu_check.py"), "--mfu"]
    sizes = ["--rows", "1500", "--steps", "30", "--batch-size", "4"]
    tiny = ["--smoke", "--rows", "48", "--steps", "4", "--batch-size", "2"]
    out = [
        Check(
            "lora_1.5b",
            [*mfu, "--models", "1.5b", "--attn", "sdpa", "--steps", "20", "--child-timeout", "110"],
            240,
            [*mfu, "--smoke"],
            "mfu",
        )
    ]
    caps = {"qlora": 110, "dora": 70, "fsdp": 70, "zero2": 80, "zero3": 80, "fsdp_qlora": 70}
    for name, cap in caps.items():
        own = ["--only", name, "--workdir", str(work / "check")]
        smoke = None if name == "fsdp_qlora" else [check, *own, *tiny]
        out.append(Check(name, [check, *own, *sizes], cap, smoke, "check"))
    loss = str(HERE / "bench_loss_memory.py")
    out += [
        Check(
            "loss_memory",
            [loss, "--device", "cuda", "--vocab", "151936", "--tokens", "4096"],
            60,
            [loss, "--vocab", "8192", "--tokens", "256"],
            "loss",
        ),
        Check(
            "packing",
            [str(HERE / "gpu_packing.py")],
            60,
            [str(HERE / "gpu_packing.py"), "--smoke"],
            "packing",
        ),
        Check(
            "lora_0.5b",
            [*mfu, "--models", "0.5b", "--attn", "sdpa", "--steps", "20", "--child-timeout", "90"],
            180,
            None,
            "mfu",
        ),
    ]
    for c in out:  # each check's own working folder
        for argv in (c.argv, c.smoke or []):
            if "--mfu" in argv:
                argv += ["--workdir", str(work / c.name)]
    return out


def environment() -> dict[str, Any]:
    """Date, GPU, driver and the versions the figures depend on."""
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "python": sys.version.split()[0],
    }
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[name] = importlib.metadata.version(name)
    query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    try:
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        env["gpu"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        env["gpu"] = f"no nvidia-smi ({exc.__class__.__name__})"
    try:
        import torch

        env["cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
    except ImportError:
        env["cuda"] = None
    return env


def run_one(check: Check, argv: list[str], limit: int, log: Path) -> tuple[str, int | None]:
    """Run ``argv`` in its own process group; kill the group at ``limit`` seconds."""
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **OFFLINE},
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
                    break
            return f"TIMED OUT ({limit} s)", None
    # a launcher's workers left behind must not hold the GPU for the next check
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return ("ok" if code == 0 else f"FAILED (exit {code})"), code


def read_result(check: Check, text: str, work: Path) -> dict[str, Any]:
    prefix = {
        "check": "GPU_CHECK_SUMMARY ",
        "loss": "LOSS_MEMORY_RESULT ",
        "packing": "GPU_PACKING_RESULT ",
    }.get(check.parse)
    if prefix:
        lines = [x[len(prefix) :] for x in text.splitlines() if x.startswith(prefix)]
        return {"result": json.loads(lines[-1])} if lines else {}
    path = work / check.name / "gpu_mfu.json"
    table = [x for x in text.splitlines() if x.startswith(("|", "goal "))]
    return {"result": json.loads(path.read_text()) if path.is_file() else [], "table": table}


def figures(check: Check) -> str:
    """The row's figures, from the check's own result."""
    r = check.result.get("result")
    if not r:
        return ""
    if check.parse == "check":
        one = r["results"].get(check.name)
        if not one:
            return ""
        text = (
            f"{one['tokens_per_s']:.0f} tok/s, peak {one['peak_mem_gib']:.2f} GiB, "
            f"MFU {100 * one['mfu']:.1f}% (6N, measured peak), loss {one['losses'][0]:.3f} -> "
            f"{one['losses'][-1]:.3f}"
        )
        if "merge_rel_err" in one:
            text += f", merged vs trained rel. err. {one['merge_rel_err']:.1e}"
            if one.get("merge_base_rel_err") is not None:
                text += f" (merged into the fp base: {one['merge_base_rel_err']:.1e})"
        if "agrees_with_qlora" in one:
            text += (
                f", first losses {'agree' if one['agrees_with_qlora'] else 'DIFFER'} from qlora's"
            )
        return text
    if check.parse == "loss":
        if "cuda_ratio" in r:
            return (
                f"peak CUDA memory chunked {r['chunked']['cuda_peak_mb']:.0f} MiB vs full "
                f"logits {r['plain']['cuda_peak_mb']:.0f} MiB: {r['cuda_ratio']:.2f}x "
                f"(goal <= {r['goal']}x)"
            )
        return f"peak RSS chunked / full logits {r['rss_ratio']:.2f}x (goal <= {r['goal']}x)"
    if check.parse == "packing":
        parts = []
        for x in r:
            speed = f", packed {x['packed_tok_s']:.0f} tok/s"
            if x.get("padded_tok_s"):
                speed += f" vs padded {x['padded_tok_s']:.0f}"
            parts.append(
                f"{x['attn']} {x['dtype']}: loss packed - padded {x['max_loss_diff']:.1e} "
                f"(control {x['control_diff']:.1e}){speed}"
            )
        return "; ".join(parts)
    rows = {x["side"]: x for x in r}
    if "llmtrain" not in rows:
        return ""
    ours = rows["llmtrain"]
    sheet = ours.get("mfu_sheet")
    text = f"llmtrain {ours['tok_s']:.0f} tok/s, {ours['peak_mem_gib']:.2f} GiB, MFU "
    text += f"{100 * sheet:.1f}% (datasheet) / " if sheet is not None else ""
    text += f"{100 * ours['mfu_measured']:.1f}% (measured)"
    if "trl" in rows:
        theirs = rows["trl"]
        text += (
            f"; TRL {theirs['tok_s']:.0f} tok/s, {theirs['peak_mem_gib']:.2f} GiB; "
            f"{ours['speed_vs_trl']:.2f}x the speed at {ours['mem_vs_trl']:.2f}x the memory"
        )
    return text


def render(env: dict[str, Any], done: list[Check], smoke: bool) -> str:
    versions = ", ".join(f"{k} {env[k]}" for k in PACKAGES if k in env)
    lines = [
        f"# GPU checks{' (CPU smoke: code path only, no figures)' if smoke else ''}",
        "",
        f"{env['date_utc']} UTC; GPU: {env.get('gpu')}; CUDA {env.get('cuda')}; "
        f"Python {env['python']}; {versions}",
        "",
        "| # | check | status | seconds | figures |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, c in enumerate(done, 1):
        seconds = c.result.get("seconds")
        wall = f"{seconds:.0f}" if seconds is not None else ""
        lines.append(f"| {i} | {c.name} | {c.result['status']} | {wall} | {figures(c)} |")
    for c in done:
        if c.result.get("table"):
            lines += ["", f"{c.name}:", "", *c.result["table"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-out")
    p.add_argument("--budget", type=int, default=540, help="seconds for all the checks")
    p.add_argument("--only", default=None, help="comma-separated check names")
    p.add_argument("--smoke", action="store_true", help="the CPU, tiny sizes: the code path")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args(argv)
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or os.environ.get("TMPDIR", "/tmp")) / f"llmtrain-gpu-run-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    env = environment()
    if not env.get("cuda_available") and not args.smoke:
        print("gpu_run: no CUDA device here; refusing (use --smoke for the CPU code path)")
        return 2
    todo = checks(work)
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {c.name for c in todo}
        if unknown:
            sys.exit(f"gpu_run: no check named {sorted(unknown)}")
        todo = [c for c in todo if c.name in names]
    print(f"gpu_run: {env.get('gpu')}; {len(todo)} checks; budget {args.budget} s", flush=True)
    log = out / "gpu_run.log"
    log.write_text("")
    ok = True
    for i, c in enumerate(todo):
        argv = c.smoke if args.smoke else c.argv
        left = args.budget - (time.monotonic() - started)
        limit = int(min(c.cap * (3 if args.smoke else 1), left - FLOOR * (len(todo) - i - 1)))
        if argv is None:
            c.result["status"] = "skipped (GPU only)"
        elif limit < FLOOR:
            c.result["status"] = f"skipped ({left:.0f} s of the budget left)"
        else:
            print(f"== {c.name}: up to {limit} s", flush=True)
            t0 = time.monotonic()
            part = work / f"{c.name}.log"
            c.result["status"], _ = run_one(c, argv, limit, part)
            c.result["seconds"] = time.monotonic() - t0
            text = part.read_text(errors="replace")
            with log.open("a") as fh:
                fh.write(f"\n\n===== {c.name}: {' '.join(argv)}\n{text[-200_000:]}")
            try:
                c.result.update(read_result(c, text, work))
            except (ValueError, KeyError, OSError) as exc:
                c.result["status"] += f"; result unreadable ({exc!r})"
            ok &= c.result["status"] == "ok"
            print(
                f"   {c.result['status']} in {c.result['seconds']:.0f} s: {figures(c)}", flush=True
            )
            if c.result["status"] != "ok":
                print(text[-3000:], flush=True)
    table = render(env, todo, args.smoke)
    (out / "table.md").write_text(table)
    results = {"environment": env, "checks": {c.name: c.result for c in todo}}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print("\n" + table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
