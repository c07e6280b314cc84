"""Peak memory of one training step, chunked loss vs the full logits, side by side:

    python benchmarks/bench_loss_memory.py [--vocab 128256] [--tokens 2048] [--batch 1]

Each path runs in its own subprocess: a Llama-shaped model of tiny width (hidden 64, one
layer) with a large vocabulary, LoRA r=8 on q/v and on ``lm_head``, one forward, backward and
AdamW step over ``batch x tokens`` tokens, every position a target (the worst case for the
chunked path, which projects only target positions). The figure is the subprocess's peak
resident set size (``ru_maxrss``) and its growth over the RSS just before the step (the
model, the optimizer and torch itself are in both). Goal: chunked <= 0.5x plain.
On CUDA (``--device cuda``) the figure is ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL = 0.5


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_step(mode: str, vocab: int, tokens: int, batch: int, device: str) -> dict[str, float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.objectives.loss import LossFunction, plain_loss_sum

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=tokens,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(device)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "lm_head"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, vocab, (batch, tokens), device=device)
    data = {"input_ids": ids, "labels": ids.clone()}
    loss_fn = LossFunction(model) if mode == "chunked" else plain_loss_sum
    before = _rss_mb()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = loss_fn(model, data)
    (loss / (tokens * batch)).backward()
    optimizer.step()
    out = {"loss": float(loss) / (tokens * batch), "rss_before_mb": before}
    out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_step_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_step(args.child, args.vocab, args.tokens, args.batch, args.device)))
        return
    results = {}
    for mode in ("plain", "chunked"):
        cmd = [sys.executable, __file__, "--child", mode]
        cmd += ["--vocab", str(args.vocab), "--tokens", str(args.tokens)]
        cmd += ["--batch", str(args.batch), "--device", args.device]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"vocab {args.vocab}, {args.batch} x {args.tokens} tokens, one LoRA step ({args.device})")
    print(f"{'path':<8} {'loss':>8} {'peak RSS MB':>12} {'step growth MB':>15}")
    for mode, r in results.items():
        growth = r["peak_mb"] - r["rss_before_mb"]
        print(f"{mode:<8} {r['loss']:>8.4f} {r['peak_mb']:>12.0f} {growth:>15.0f}")
    plain, chunked = results["plain"], results["chunked"]
    ratio = chunked["peak_mb"] / plain["peak_mb"]
    step_ratio = (chunked["peak_mb"] - chunked["rss_before_mb"]) / (
        plain["peak_mb"] - plain["rss_before_mb"]
    )
    print(f"chunked / plain peak RSS: {ratio:.2f}x (goal <= {GOAL}x)")
    print(f"chunked / plain growth over the RSS before the step: {step_ratio:.2f}x")
    summary = {"vocab": args.vocab, "tokens": args.tokens, "batch": args.batch, **results}
    summary |= {"rss_ratio": ratio, "growth_ratio": step_ratio, "goal": GOAL}
    if args.device == "cuda":
        r = chunked["cuda_peak_mb"] / plain["cuda_peak_mb"]
        step = chunked["cuda_step_mb"] / plain["cuda_step_mb"]
        print(
            f"chunked / plain torch.cuda.max_memory_allocated: {r:.2f}x "
            f"(the step's own: {step:.2f}x)"
        )
        summary |= {"cuda_ratio": r, "cuda_step_ratio": step}
    print("LOSS_MEMORY_RESULT " + json.dumps(summary))  # for benchmarks/gpu_run.py


if __name__ == "__main__":
    main()
