"""GPU check: QLoRA, DoRA, FSDP2 and DeepSpeed ZeRO-2/3 through ``LLMTrainer.fit`` on a ~0.5B Llama.

    python benchmarks/gpu_check.py [--workdir DIR] [--rows 3000] [--steps 30]
        [--batch-size 4] [--only qlora,dora,fsdp,zero2,zero3,fsdp_qlora] [--smoke]

Needs CUDA; without it the script says so and exits 0 (nothing to check on this machine),
unless ``--smoke``: a tiny Llama on the CPU, every configuration but ``fsdp_qlora``, the same
code path. ``benchmarks/gpu_run.sh`` runs this with the other GPU checks in one device run.

``--mfu`` switches to a different check, ``benchmarks/gpu_mfu.py`` (tokens/s, MFU and peak
memory of LoRA on Qwen2.5-0.5B/1.5B-shaped models, llmtrain against TRL's ``SFTTrainer``;
``--mfu --smoke`` runs its code path on the CPU); its docstring has the options.

What it does, all offline:

1. Builds a Llama with random weights from a config (hidden 1280, 24 layers: ~0.48B
   parameters, bf16) with the tokenizer of ``llmtrain.testing.tiny_model``, and a SQLite
   database of ``--rows`` prompt/response rows of a few hundred tokens.
2. Times a large bf16 matmul: the peak this GPU really reaches, the denominator of MFU.
3. Trains each configuration in its own processes, on every visible GPU:
   ``qlora`` (4-bit base + LoRA, one process), ``dora`` (DoRA on a bf16 base, one process),
   ``zero2`` and ``zero3`` (``deepspeed`` launcher, LoRA on a bf16 base), ``fsdp``
   (``torchrun``, FSDP2, LoRA on a bf16 base) and ``fsdp_qlora`` (FSDP2 on a 4-bit base
   stored as bf16, which llmtrain refuses on the CPU). Each script instance calls ``fit()``
   itself, so this also exercises the "script run by torchrun / deepspeed" path.
4. Prints per configuration: steady-state tokens/s (from the run's metrics, first steps
   excluded), peak ``torch.cuda.max_memory_allocated`` (max over ranks), and MFU =
   tokens/s x FLOPs per token / (GPUs x measured peak). FLOPs per token use the usual
   ``6 N + 12 L h s`` (N parameters, L layers, h hidden size, s sequence length); LoRA skips
   the frozen weights' gradients, so about 2/3 of that is work actually done.
5. Correctness: the loss falls (mean of the last 3 logged losses under the first 3's); for
   ``qlora`` and ``dora`` the merged export (``export_merged``, into the weights training
   saw) gives the trained model's logits (relative error under ``MERGE_TOLERANCE``; for
   ``qlora`` the merge into the full-precision base is shown beside it as the control); with
   one GPU, ``fsdp_qlora`` and ``qlora`` see the same batches, so their first losses must
   agree (bf16 tolerance); a mismatch means sharded 4-bit weights are wrong on this GPU too.
   Exit status 0 when every configuration trained and passed. The last line is
   ``GPU_CHECK_SUMMARY {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT = "GPU_CHECK_RESULT "
SUMMARY = "GPU_CHECK_SUMMARY "
CONFIGS = ("qlora", "dora", "fsdp", "zero2", "zero3", "fsdp_qlora")
MERGE_TOLERANCE = 3e-2  # relative error of the merged model's logits (bf16 on the GPU)
PROBE = "### Instruction:\nwhich planets and rivers are large?\n\n### Response:\n"
TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
ARCH = {
    "hidden_size": 1280,
    "intermediate_size": 3456,
    "num_hidden_layers": 24,
    "num_attention_heads": 10,
    "num_key_value_heads": 10,
    "max_position_embeddings": 2048,
}
SMOKE_ARCH = {**ARCH, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
SMOKE_ARCH |= {"num_attention_heads": 4, "num_key_value_heads": 4}
WORDS = (
    "the model reads rows from a database and learns to answer questions about colors "
    "numbers cities rivers planets music history science small large quickly slowly "
    "because therefore however although every each some many few table key value "
    "train evaluate adapter weight gradient token sequence batch step epoch"
)


# -- setup (orchestrator) ---------------------------------------------------------------------
def build_model(workdir: Path, smoke: bool = False) -> Path:
    """A random ~0.5B Llama saved like a hub checkpoint (once per workdir; tiny for smoke)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from llmtrain.testing import tiny_model

    path = workdir / "llama-0.5b"
    if (path / "config.json").is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(tiny_model(workdir / "tiny"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
        **(SMOKE_ARCH if smoke else ARCH),
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # seconds on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    tokenizer.model_max_length = 1024
    tokenizer.save_pretrained(path)
    return path


def fill_database(workdir: Path, rows: int) -> str:
    import sqlalchemy as sa

    db_path = workdir / "data.db"
    uri = f"sqlite:///{db_path}"
    engine = sa.create_engine(uri)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE IF NOT EXISTS docs (id INTEGER PRIMARY KEY, "
                "instruction TEXT NOT NULL, output TEXT NOT NULL)"
            )
        )
        have = conn.execute(sa.text("SELECT COUNT(*) FROM docs")).scalar()
        if have != rows:
            rng, words = random.Random(0), WORDS.split()
            conn.execute(sa.text("DELETE FROM docs"))
            conn.execute(
                sa.text("INSERT INTO docs VALUES (:id, :instruction, :output)"),
                [
                    {
                        "id": i,
                        "instruction": " ".join(rng.choices(words, k=rng.randint(30, 90))) + "?",
                        "output": " ".join(rng.choices(words, k=rng.randint(30, 120))) + ".",
                    }
                    for i in range(rows)
                ],
            )
    engine.dispose()
    return uri


def matmul_tflops(n: int = 8192, iters: int = 50) -> float:
    """Measured dense bf16 matmul rate of GPU 0, in TFLOP/s."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - started) / 1e12


def command(name: str, gpus: int, workdir: Path, args: argparse.Namespace) -> list[str]:
    from llmtrain.running.launchers import free_port

    me = [
        str(Path(__file__).resolve()),
        "--one",
        name,
        "--workdir",
        str(workdir),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        *(["--smoke"] if args.smoke else []),
    ]
    if name == "qlora":
        return [sys.executable, *me]
    if name == "zero2":
        return [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(gpus),
            "--master_port",
            str(free_port()),
            *me,
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(gpus),
        "--master_port",
        str(free_port()),
        *me,
    ]


def orchestrate(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)")
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="llmtrain-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if cuda else 1
    device = torch.cuda.get_device_name(0) if cuda else "CPU (smoke)"
    print(f"gpu_check: {gpus} x {device}, workdir {workdir}", flush=True)
    model_path = build_model(workdir, args.smoke)
    fill_database(workdir, args.rows)
    peak = matmul_tflops() if cuda else None
    print(f"measured bf16 matmul: {peak or 0:.1f} TFLOP/s per GPU", flush=True)

    results: dict[str, dict[str, Any]] = {}
    ok = True
    for name in [n for n in args.only.split(",") if n]:
        if name not in CONFIGS:
            sys.exit(f"gpu_check: --only {name!r}: not one of {CONFIGS}")
        started = time.perf_counter()
        proc = subprocess.run(
            command(name, gpus, workdir, args),
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        lines = [
            json.loads(line[len(RESULT) :])
            for line in proc.stdout.splitlines()
            if line.startswith(RESULT)
        ]
        main = next((r for r in lines if r.get("rank") == 0 and "tokens_per_s" in r), None)
        if proc.returncode != 0 or main is None:
            ok = False
            print(
                f"\n== {name}: FAILED (status {proc.returncode})\n"
                f"{(proc.stdout + proc.stderr)[-4000:]}"
            )
            continue
        main["peak_mem_gib"] = max(r["peak_mem_gib"] for r in lines)
        main["wall_s"] = time.perf_counter() - started
        flops = flops_per_token(model_path, main["seq_len"])
        main["mfu"] = (
            main["tokens_per_s"] * flops / (main["world_size"] * peak * 1e12) if peak else 0
        )
        losses = main["losses"]
        main["loss_falls"] = len(losses) >= 2 and mean(losses[-3:]) < mean(losses[:3])
        ok &= main["loss_falls"] and main.get("merge_ok", True)
        results[name] = main
        merge = ""
        if "merge_rel_err" in main:
            base = main.get("merge_base_rel_err")
            merge = f"  merge rel err {main['merge_rel_err']:.1e}"
            merge += f" (into the fp base: {base:.1e})" if base is not None else ""
        print(
            f"== {name:<10} world {main['world_size']}  {main['tokens_per_s']:>9.0f} tok/s  "
            f"peak {main['peak_mem_gib']:6.2f} GiB  MFU {100 * main['mfu']:5.1f}%  "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"({'falls' if main['loss_falls'] else 'DOES NOT FALL'}){merge}  "
            f"({main['wall_s']:.0f} s)",
            flush=True,
        )
    saved = workdir / "gpu_check.json"  # one call a configuration (gpu_run.py): compare across
    both = {**(json.loads(saved.read_text()) if saved.is_file() else {}), **results}
    if gpus == 1 and {"qlora", "fsdp_qlora"} <= both.keys() & set(CONFIGS):
        a, b = both["qlora"]["losses"][:3], both["fsdp_qlora"]["losses"][:3]
        agree = all(abs(x - y) <= 2e-2 * abs(x) for x, y in zip(a, b))
        ok &= agree or not {"qlora", "fsdp_qlora"} & results.keys()
        if "fsdp_qlora" in results:
            results["fsdp_qlora"]["agrees_with_qlora"] = agree
        print(
            f"fsdp_qlora vs qlora first losses: {a} vs {b}: "
            f"{'agree' if agree else 'MISMATCH (sharded 4-bit weights are wrong)'}"
        )
    saved.write_text(json.dumps({**both, **results}, indent=2))
    print(SUMMARY + json.dumps({"device": device, "matmul_tflops": peak, "results": results}))
    return 0 if ok else 1


def mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


def flops_per_token(model_path: Path, seq_len: float) -> float:
    """``6 N + 12 L h s``: weights forward and backward, plus attention over ``s`` tokens."""
    from safetensors import safe_open

    config = json.loads((model_path / "config.json").read_text())
    params = 0
    for shard in model_path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as fh:
            params += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())  # noqa: SIM118
    return 6 * params + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq_len


# -- one configuration (every rank) ----------------------------------------------------------
def train_one(name: str, args: argparse.Namespace) -> None:
    import torch

    import llmtrain as lt

    workdir = Path(args.workdir)
    db = lt.connect(f"sqlite:///{workdir / 'data.db'}", artifacts=workdir / "artifacts")
    options: dict[str, Any] = {
        "model": str(workdir / "llama-0.5b"),
        "prompt_template": TEMPLATE,
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": 1e-2 if args.smoke else 3e-4,
        "lora_r": 16,
        "lora_dropout": 0.0,
        "max_length": 128 if args.smoke else 512,
        "logging_steps": 1,
        "progress_bar": False,
        "mixed_precision": "no" if args.smoke else "bf16",
        "seed": 0,
    }
    qlora = {"bits": 4, "qlora": True, "bnb_4bit_compute_dtype": "bfloat16"}
    options.update(
        {
            "qlora": qlora,
            "dora": {"use_dora": True},
            "zero2": {"deepspeed_config": {"stage": 2}},
            "zero3": {"deepspeed_config": {"stage": 3}},
            # FSDP2 gathers bf16 shards; "auto" autocasts to bf16 on the GPU as well
            "fsdp": {"fsdp_config": {"mixed_precision": "bf16"}, "mixed_precision": "auto"},
            "fsdp_qlora": {
                **qlora,
                "bnb_4bit_quant_storage": "bfloat16",
                "fsdp_config": {"mixed_precision": "bf16"},
                "mixed_precision": "auto",
            },
        }[name]
    )
    if args.smoke:  # the CPU: no bf16 autocast or bf16 shards
        options["mixed_precision"] = "no"
        if "fsdp_config" in options:
            options["fsdp_config"] = {}
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = lt.LLMTrainer(f"gpu-{name}", **options).fit(
        X="instruction", Y="output", db=db, select=lt.Table("docs")
    )
    rank = int(os.environ.get("RANK", 0))
    result: dict[str, Any] = {
        "rank": rank,
        "config": name,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }
    if model is not None:  # rank 0
        run = db.metadata.get_run(model.record.run_id)
        metrics = db.metadata.get_metrics(run.run_id)
        skip = min(5, len(metrics) - 2)
        first, last = metrics[skip], metrics[-1]
        seconds = (last.created_at - first.created_at).total_seconds()
        result.update(
            {
                "world_size": run.info["world_size"],
                "strategy": run.info["strategy"],
                "tokens_per_s": (last.values["tokens"] - first.values["tokens"])
                / max(seconds, 1e-9),
                "seq_len": run.info["tokens"]
                / max(1, run.info["steps"] * run.info["global_batch_size"]),
                "losses": [m.values["loss"] for m in metrics],
            }
        )
        if name in ("qlora", "dora"):
            result.update(merge_check(model, workdir, name))
    print(RESULT + json.dumps(result), flush=True)


def merge_check(model: Any, workdir: Path, name: str) -> dict[str, Any]:
    """The merged export's logits against the trained model's (train mode, as training computed
    them; dropout is 0): relative error; for QLoRA also the merge into the full-precision base."""
    import torch
    from transformers import AutoModelForCausalLM

    trained, tokenizer = model.load()
    device = next(trained.parameters()).device
    ids = tokenizer([PROBE], return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        expected = trained.train()(input_ids=ids).logits.float()
    out: dict[str, Any] = {}
    for into in ("trained", "base") if name == "qlora" else ("trained",):
        dest = workdir / f"merged-{name}-{into}"
        shutil.rmtree(dest, ignore_errors=True)
        model.export_merged(dest, into=into)
        merged = AutoModelForCausalLM.from_pretrained(dest, dtype=expected.dtype).to(device)
        with torch.no_grad():
            got = merged.eval()(input_ids=ids).logits.float()
        error = float((got - expected).norm() / expected.norm())
        out["merge_rel_err" if into == "trained" else "merge_base_rel_err"] = error
        del merged

    out["merge_ok"] = out["merge_rel_err"] <= MERGE_TOLERANCE
    return out


def main() -> int:
    if "--mfu" in sys.argv[1:]:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_mfu

        return gpu_mfu.main(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--only", default=None, help="default: all (all but fsdp_qlora on smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # deepspeed's
    args = parser.parse_args()
    if args.only is None:
        args.only = ",".join(c for c in CONFIGS if not (args.smoke and c == "fsdp_qlora"))
    if args.one:
        train_one(args.one, args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
