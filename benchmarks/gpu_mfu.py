"""GPU throughput and MFU: llmtrain against TRL's SFTTrainer on Qwen2.5-shaped models.

    python benchmarks/gpu_check.py --mfu [--models 0.5b,1.5b] [--attn sdpa,flash_attention_2]
        [--warmup 3] [--steps 10] [--pack-rows 4] [--max-length 2048] [--workdir DIR]
    python benchmarks/gpu_check.py --mfu --smoke     # CPU, tiny model: the code path only

Needs CUDA; without it the script refuses (exit 2) unless ``--smoke``.

What it does, all offline, in one run:

1. Builds Qwen2 models with random weights from a config with the real dimensions of
   Qwen2.5-0.5B (hidden 896, 24 layers, 14/2 heads, MLP 4864) and Qwen2.5-1.5B (1536, 28,
   12/2, 8960), vocabulary 151936, tied embeddings (speed and memory do not depend on the
   weights), with the byte-level BPE tokenizer of ``llmtrain.testing.tiny_model``, and
   prompt/response rows with log-normal lengths (a SQLite table for llmtrain, a
   prompt/completion ``datasets.Dataset`` for TRL, the same rows and template).
2. Times an 8192^3 bf16 matmul: the rate this GPU really reaches.
3. Trains each model x attention (``sdpa``; ``flash_attention_2`` when ``flash_attn``
   imports) with llmtrain and with TRL, each in its own subprocess, on the same settings:
   LoRA r=16 (alpha 32, dropout 0) on q/k/v/o/gate/up/down, bf16 weights and autocast,
   AdamW lr 1e-4, no gradient checkpointing, packing into rows of ``--max-length`` tokens:
   TRL packs ``--pack-rows`` rows a step (best-fit, padding-free); llmtrain packs each step's
   examples into micro-batches of ``max_tokens_per_batch = pack-rows x max-length`` with as
   many examples a step as fill that budget on average. ``--warmup`` steps, then ``--steps``
   timed ones (a CUDA sync at every step end).
4. Prints a markdown table: tokens/s (real tokens fed to the model over the timed steps),
   MFU, peak ``torch.cuda.max_memory_allocated`` and the llmtrain/TRL ratios, then the goals
   (MFU >= 40% on the 1.5B model; tokens/s >= TRL's at <= its memory) as PASS/FAIL.

MFU counts the model's FLOPs per token, the same for both trainers: 4 N for the frozen
base (forward, and the backward to the inputs; no weight gradients), N the weights of every
linear layer plus the output projection; 6 x the LoRA weights; attention 12 L d c per token
(QK^T and AV, forward and backward; d the query width), c the mean number of tokens a token
attends to under the causal mask within its own example (n/2 for n tokens; packed examples
never attend to each other). Divided by the
GPU's dense bf16 datasheet peak (``PEAK_TFLOPS``, matched on the device name) and, second,
by the measured matmul rate. llmtrain projects only target positions onto the vocabulary,
so its hardware does less than the counted work; the count is the model's, not the kernels'.

On the lent H200 machine (``/work/.library/device``): it has torch, transformers, peft and
accelerate, but not trl, datasets, pydantic, sqlalchemy or pymongo, nor ``flash_attn``; carry those
as wheels (the device README says how) or the run reports them missing and stops.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's llmtrain, installed or not
    sys.path.insert(0, str(ROOT))

import synthetic_rows  # noqa: E402

RESULT = "GPU_MFU_RESULT "
TEMPLATE = "### Instruction:\n{X}\n\n### Response:\n{Y}"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR, LORA_R, LORA_ALPHA = 1e-4, 16, 32
REQUIRED = ("torch", "transformers", "peft", "pydantic", "sqlalchemy", "pymongo", "datasets", "trl")

#: the real Qwen2.5 dimensions; ``smoke`` is a tiny one for the CPU code-path check
MODELS: dict[str, dict[str, Any]] = {
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    },
    "smoke": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": None,  # the tokenizer's
    },
}

#: dense (no sparsity) bf16 tensor-core peak, TFLOP/s, by datasheet; first match wins
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)

_TEXT = (
    "the model reads rows from a database and learns to answer questions about colors "
    "numbers cities rivers planets music history science code tables keys values training "
    "steps tokens gradients adapters layers memory speed batches examples prompts responses"
)
_WORDS = _TEXT.split()


def make_rows(n: int, seed: int = 0) -> list[tuple[int, str, str]]:
    """Prompts of tens to hundreds of words, answers with a long tail (log-normal)."""
    return synthetic_rows.make_rows(
        n, seed, _WORDS, prompt=(4.3, 0.6, 4, 600), answer=(5.0, 0.8, 2, 1200)
    )


def datasheet_peak(name: str) -> float | None:
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def measured_tflops(cuda: bool) -> float:
    """The dense matmul rate this device reaches (bf16 8192^3 on CUDA, fp32 512^3 on CPU)."""
    import torch

    n, dtype, device, iters = (8192, torch.bfloat16, "cuda", 30) if cuda else (512, None, "cpu", 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return 2 * n**3 * iters / seconds / 1e12


# -- setup (orchestrator) ---------------------------------------------------------------------
def build_model(workdir: Path, name: str, tokenizer: Any, max_length: int, cuda: bool) -> Path:
    """A random Qwen2 of ``MODELS[name]`` saved like a hub checkpoint (once per workdir)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = workdir / f"qwen2-{name}"
    if (path / "config.json").is_file():
        return path
    dims = dict(MODELS[name])
    dims["vocab_size"] = dims["vocab_size"] or len(tokenizer)
    config = Qwen2Config(
        **dims,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.02,
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):  # random init on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(path)
    del model
    if cuda:  # the children need the memory, not this process's cache
        torch.cuda.empty_cache()
    return path


def flops_per_token(config: dict[str, Any], context: float) -> tuple[float, int]:
    """Model FLOPs per trained token (see the module docstring) and the base's matmul N."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    base = layers * sum(i * o for i, o in shapes) + h * vocab
    lora = layers * sum(LORA_R * (i + o) for i, o in shapes)
    attention = 12 * layers * q * context
    return 4 * base + 6 * lora + attention, base


def fill_database(path: Path, rows: list[tuple[int, str, str]]) -> None:
    if path.exists():
        path.unlink()
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, instruction TEXT, output TEXT)")
    con.executemany("INSERT INTO docs VALUES (?, ?, ?)", rows)
    con.commit()
    con.close()


def missing_modules() -> list[str]:
    return [m for m in REQUIRED if importlib.util.find_spec(m) is None]


def orchestrate(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_check --mfu: no CUDA device here; refusing (use --smoke for the CPU code path)")
        return 2
    missing = missing_modules()
    if missing:
        print(f"gpu_check --mfu: missing Python packages {missing}; carry them as wheels")
        return 2
    from transformers import AutoTokenizer

    from llmtrain.testing import tiny_model

    if args.smoke:
        args.models, args.attn, args.warmup, args.steps = "smoke", "sdpa", 1, 2
        args.pack_rows, args.max_length = 2, 512
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="llmtrain-gpu-mfu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if cuda else "CPU (smoke: float32)"
    attns = [a for a in args.attn.split(",") if a]
    if "flash_attention_2" in attns and importlib.util.find_spec("flash_attn") is None:
        attns.remove("flash_attention_2")
        print("flash_attention_2: flash_attn does not import here; skipped")

    tok_path = tiny_model(workdir / "tokenizer", arch="qwen2", corpus=[" ".join(_WORDS)])
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    tokenizer.model_max_length = 10**9  # measuring lengths; each model's copy gets max_length
    budget = args.pack_rows * args.max_length
    sample = make_rows(400)
    lengths = [
        min(args.max_length, len(tokenizer(TEMPLATE.format(X=x, Y=y)).input_ids) + 1)
        for _, x, y in sample
    ]
    mean = sum(lengths) / len(lengths)
    context = sum(n * n for n in lengths) / 2 / sum(lengths)  # mean causal context of a token
    rows_per_step = max(1, round(budget / mean))
    n_rows = math.ceil(1.5 * (args.warmup + args.steps) * budget / mean) + 50
    rows = make_rows(n_rows)
    fill_database(workdir / "rows.db", rows)
    (workdir / "rows.json").write_text(json.dumps(rows))

    peak_sheet = datasheet_peak(device) if cuda else None
    peak_measured = measured_tflops(cuda)
    print(
        f"gpu_mfu: {device}; datasheet bf16 peak "
        f"{f'{peak_sheet:.0f} TFLOP/s' if peak_sheet else 'unknown'}, measured matmul "
        f"{peak_measured:.1f} TFLOP/s; rows of {args.max_length} tokens, {args.pack_rows} a "
        f"step (llmtrain: {rows_per_step} examples a step, mean {mean:.0f} tokens); "
        f"{args.warmup} warmup + {args.steps} timed steps; workdir {workdir}",
        flush=True,
    )

    results: list[dict[str, Any]] = []
    ok = True
    for name in [m for m in args.models.split(",") if m]:
        model_path = build_model(workdir, name, tokenizer, args.max_length, cuda)
        config = json.loads((model_path / "config.json").read_text())
        flops, base = flops_per_token(config, context)
        for attn in attns:
            pair: dict[str, dict[str, Any]] = {}
            for side in ("llmtrain", "trl"):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side]
                cmd += ["--model", str(model_path), "--attn", attn, "--workdir", str(workdir)]
                cmd += ["--rows-per-step", str(rows_per_step)]
                for flag in ("warmup", "steps", "pack_rows", "max_length"):
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                started = time.perf_counter()
                try:
                    done = subprocess.run(
                        cmd, capture_output=True, text=True, timeout=args.child_timeout
                    )
                except subprocess.TimeoutExpired:
                    ok = False
                    print(f"== {name} {attn} {side}: TIMED OUT after {args.child_timeout} s")
                    continue
                line = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
                if done.returncode or not line:
                    ok = False
                    print(
                        f"== {name} {attn} {side}: FAILED (status {done.returncode})\n"
                        f"{(done.stdout + done.stderr)[-3000:]}"
                    )
                    continue
                r = json.loads(line[-1].removeprefix(RESULT))
                r.update(model=name, attn=attn, side=side, params=base)
                r["mfu_sheet"] = r["tok_s"] * flops / (peak_sheet * 1e12) if peak_sheet else None
                r["mfu_measured"] = r["tok_s"] * flops / (peak_measured * 1e12)
                r["wall_s"] = time.perf_counter() - started
                pair[side] = r
                results.append(r)
                print(
                    f"== {name} {attn} {side}: {r['tok_s']:.0f} tok/s, peak "
                    f"{r['peak_mem_gib']:.2f} GiB, loss {r['loss']:.3f} ({r['wall_s']:.0f} s)",
                    flush=True,
                )
            if len(pair) == 2:
                ours, theirs = pair["llmtrain"], pair["trl"]
                ours["speed_vs_trl"] = ours["tok_s"] / theirs["tok_s"]
                ours["mem_vs_trl"] = ours["peak_mem_gib"] / theirs["peak_mem_gib"]
    (workdir / "gpu_mfu.json").write_text(json.dumps(results, indent=2))
    print_table(results, device, peak_sheet, peak_measured, cuda)
    ok &= print_goals(results, cuda)
    return 0 if ok else 1


def _size(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def print_table(
    results: list[dict[str, Any]],
    device: str,
    peak_sheet: float | None,
    peak_measured: float,
    cuda: bool,
) -> None:
    sheet = f"{peak_sheet:.0f}" if peak_sheet else "?"
    memory = "peak CUDA memory" if cuda else "peak RSS"
    print(
        f"\n{device}: LoRA r={LORA_R} on all linear layers, "
        f"{'bf16' if cuda else 'float32'}, packed rows\n"
    )
    print(
        f"| model | attention | trainer | tokens/s | MFU ({sheet} TF datasheet) | "
        f"MFU ({peak_measured:.3g} TF measured) | {memory} | tokens/s vs TRL | memory vs TRL |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        speed = f"{r['speed_vs_trl']:.2f}x" if "speed_vs_trl" in r else ""
        mem = f"{r['mem_vs_trl']:.2f}x" if "mem_vs_trl" in r else ""
        print(
            f"| {r['model']} ({_size(r['params'])}) | {r['attn']} | {r['side']} | "
            f"{r['tok_s']:.0f} | {_pct(r['mfu_sheet'])} | {_pct(r['mfu_measured'])} | "
            f"{r['peak_mem_gib']:.2f} GiB | {speed} | {mem} |"
        )


def print_goals(results: list[dict[str, Any]], cuda: bool) -> bool:
    """Goals of the GPU check; on the CPU smoke run they are shown but not judged."""
    ok = True
    for r in results:
        if r["side"] != "llmtrain":
            continue
        checks = []
        if r["model"] == "1.5b" and r["mfu_sheet"] is not None:
            checks.append(("MFU >= 40%", r["mfu_sheet"] >= 0.40))
        if "speed_vs_trl" in r:
            checks.append(("tokens/s >= TRL", r["speed_vs_trl"] >= 1.0))
            checks.append(("memory <= TRL", r["mem_vs_trl"] <= 1.0))
        for what, passed in checks:
            verdict = ("PASS" if passed else "FAIL") if cuda else "not judged on CPU"
            print(f"goal {r['model']} {r['attn']}: {what}: {verdict}")
            ok &= passed or not cuda
    return ok


# -- one trainer (child process) ---------------------------------------------------------------
class _Clock:
    """(seconds, cumulative real tokens) at the end of every optimizer step, after a sync."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []

    def mark(self, tokens: int) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.marks.append((time.perf_counter(), tokens))

    def tokens_per_s(self, warmup: int) -> float:
        (t0, n0), (t1, n1) = self.marks[warmup - 1], self.marks[-1]
        return (n1 - n0) / (t1 - t0)


def _peak_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_llmtrain(args: argparse.Namespace, clock: _Clock) -> float:
    import torch

    import llmtrain as lt
    from llmtrain.training.callbacks import Callback

    cuda = torch.cuda.is_available()

    class Steps(Callback):
        def on_step(self, run: Any, keys: list[str]) -> None:
            clock.mark(run.tokens_seen)

    workdir = Path(args.workdir)
    trainer = lt.LLMTrainer(
        f"mfu-{Path(args.model).name}-{args.attn}",
        model=args.model,
        prompt_template=TEMPLATE,
        torch_dtype="bfloat16" if cuda else "float32",
        mixed_precision="bf16" if cuda else "no",
        attn_implementation=args.attn,
        max_steps=args.warmup + args.steps,
        batch_size=args.rows_per_step,
        packing=True,
        max_length=args.max_length,
        max_tokens_per_batch=args.pack_rows * args.max_length,
        learning_rate=LR,
        lora_r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=TARGETS,
        gradient_checkpointing=False,
        logging_steps=1,
        progress_bar=False,
        seed=0,
    )
    db = lt.connect(f"sqlite:///{workdir / 'rows.db'}", artifacts=workdir / "artifacts")
    model = trainer.fit(
        X="instruction", Y="output", db=db, select=lt.Table("docs"), callbacks=[Steps()]
    )
    return float(db.metadata.get_metrics(model.record.run_id)[-1].values["loss"])


def run_trl(args: argparse.Namespace, clock: _Clock) -> float:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTTrainer
    from trl_recipe import trl_configs

    cuda = torch.cuda.is_available()
    prompt_only = TEMPLATE.replace("{Y}", "")
    rows = json.loads((Path(args.workdir) / "rows.json").read_text())
    data = [{"prompt": prompt_only.replace("{X}", x), "completion": y} for _, x, y in rows]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        dtype=torch.bfloat16 if cuda else torch.float32,
        attn_implementation=args.attn,
    )
    config, lora = trl_configs(
        str(Path(args.workdir) / "trl"),
        steps=args.warmup + args.steps,
        batch_size=args.pack_rows,
        max_length=args.max_length,
        packing=True,
        lr=LR,
        lora_r=LORA_R,
        lora_alpha=LORA_ALPHA,
        targets=TARGETS,
        cuda=cuda,
    )
    seen = {"tokens": 0}

    def count(module: Any, inputs: Any, kwargs: dict[str, Any]) -> None:
        """Real tokens, counted where the model receives them (padding-free: all of them)."""
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is not None and torch.is_grad_enabled():
            seen["tokens"] += int(mask.sum()) if mask is not None else ids.numel()

    class Steps(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.mark(seen["tokens"])

    model.model.register_forward_pre_hook(count, with_kwargs=True)  # the inner Qwen2Model
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(data),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Steps()],
    )
    trainer.train()
    return float([h["loss"] for h in trainer.state.log_history if "loss" in h][-1])


def child(args: argparse.Namespace) -> None:
    import torch

    clock = _Clock()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    loss = (run_llmtrain if args.child == "llmtrain" else run_trl)(args, clock)
    if len(clock.marks) < args.warmup + 1:
        sys.exit(f"{args.child}: only {len(clock.marks)} steps ran")
    result = {
        "tok_s": clock.tokens_per_s(args.warmup),
        "steps": len(clock.marks),
        "loss": loss,
        "peak_mem_gib": _peak_gib(),
    }
    print(RESULT + json.dumps(result), flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mfu", action="store_true", help="(gpu_check.py's switch to this mode)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 2 timed steps")
    p.add_argument("--models", default="0.5b,1.5b")
    p.add_argument("--attn", default="sdpa,flash_attention_2")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--pack-rows", type=int, default=4)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--child-timeout", type=int, default=240)
    p.add_argument("--workdir", default=None)
    p.add_argument("--child", choices=("llmtrain", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--rows-per-step", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        sys.exit("gpu_mfu: --warmup and --steps must be at least 1")
    if args.child:
        child(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
