"""Padding-free packing on a GPU: packed losses equal the unpacked ones, and what packing buys.

    python benchmarks/gpu_packing.py [--attn sdpa,flash_attention_2] [--smoke]

A Qwen2-shaped model with random weights (hidden 1024, 8 layers, 16/2 heads; ``--smoke``: a
tiny one on the CPU), examples of 40 to 1500 random tokens, rows of 4096 tokens. For each
attention (``flash_attention_2`` only when ``flash_attn`` imports; its packed layout is the
one-row ``flat`` batch), in float32 where the kernel takes it and in bf16:

1. the per-example losses of the packed batch (``PackedCollator``: restarting ``position_ids``,
   no mask) against the same examples right-padded with an attention mask, as
   ``max |packed - padded|``; a negative control (the packed row with a 2D all-ones mask, so
   examples see each other) must differ by more, or the comparison proves nothing;
2. tokens/s of a forward and backward over the packed batch and over the padded one (real
   tokens only), after a warm-up, synchronised.

Prints one ``GPU_PACKING_RESULT {json}`` line; exit status 1 when a loss check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's llmtrain, installed or not
    sys.path.insert(0, str(ROOT))

RESULT = "GPU_PACKING_RESULT "
#: largest max |packed - padded| of a per-example loss, by dtype; the control must exceed it
TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2}
DIMS = {
    "gpu": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, heads=16, kv=2),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, heads=4, kv=2),
}


def make_examples(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[Any]:
    """Examples of random ids; the first third of each is prompt (not a target)."""
    from llmtrain.formatting.tokenize import IGNORE_INDEX, Example

    rng = random.Random(seed)
    out = []
    for key in range(n):
        length = rng.randint(low, high)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        labels = [IGNORE_INDEX] * (length // 3) + ids[length // 3 :]
        out.append(Example(ids, labels, key))
    return out


def span_losses(logits: Any, labels: Any, spans: list[tuple[int, int, int]]) -> Any:
    """Mean next-token loss of each example, found at ``(row, start, end)`` of the batch."""
    import torch
    import torch.nn.functional as F

    from llmtrain.formatting.tokenize import IGNORE_INDEX

    token = F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(),
        labels[:, 1:],
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    targets = labels[:, 1:] != IGNORE_INDEX
    return torch.stack(
        [token[r, a : b - 1].sum() / targets[r, a : b - 1].sum() for r, a, b in spans]
    )


def layouts(examples: list[Any], max_length: int, pad_id: int, flat: bool) -> dict[str, Any]:
    """The padded and the packed batch, and where each example lies in each (input order)."""
    from llmtrain.formatting.collate import PackedCollator, pack_examples, pad_collate

    rows = pack_examples(examples, max_length)
    if flat:
        rows = [[e for row in rows for e in row]]
    where: dict[object, tuple[int, int, int]] = {}
    for r, row in enumerate(rows):
        start = 0
        for e in row:
            where[e.key] = (r, start, start + len(e))
            start += len(e)
    return {
        "padded": pad_collate(examples, pad_id),
        "padded_spans": [(i, 0, len(e)) for i, e in enumerate(examples)],
        "packed": PackedCollator(max_length, pad_id, flat=flat).collate_rows(rows),
        "packed_spans": [where[e.key] for e in examples],
    }


def timed(step: Any, repeat: int, cuda: bool) -> float:
    import torch

    step()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat


def check(attn: str, dtype_name: str, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    dims = dict(DIMS["smoke" if args.smoke else "gpu"])
    heads, kv = dims.pop("heads"), dims.pop("kv")
    vocab = 512 if args.smoke else 32000
    config = Qwen2Config(
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(args.max_length, 4096),
        pad_token_id=0,
        use_cache=False,
        initializer_range=0.1,  # peaked attention: a leak across examples shows in the loss
        **dims,
    )
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    low, high = (8, 120) if args.smoke else (40, 1500)
    examples = make_examples(args.examples, low, high, vocab)
    lay = layouts(examples, args.max_length, 0, flat="flash" in attn)
    to = {k: v.to(device) for k, v in lay["padded"].items()}
    packed = {k: v.to(device) for k, v in lay["packed"].items()}
    with torch.no_grad():
        if "flash" in attn:  # flash kernels take no padded mask with holes: one example a call
            expected = torch.cat(
                [
                    span_losses(
                        model(input_ids=to["input_ids"][i : i + 1, : len(e)]).logits,
                        to["labels"][i : i + 1, : len(e)],
                        [(0, 0, len(e))],
                    )
                    for i, e in enumerate(examples)
                ]
            )
        else:
            logits = model(input_ids=to["input_ids"], attention_mask=to["attention_mask"]).logits
            expected = span_losses(logits, to["labels"], lay["padded_spans"])
        spans, ids = lay["packed_spans"], packed["input_ids"]
        logits = model(input_ids=ids, position_ids=packed["position_ids"], use_cache=False).logits
        got = span_losses(logits, packed["labels"], spans)
        # the negative control: one all-ones 2D mask, positions running on, examples mixed
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        leaky = span_losses(logits, packed["labels"], spans)
    diff = float((got - expected).abs().max())
    control = float((leaky - expected).abs().max())
    tolerance = TOLERANCE[dtype_name]

    def step(batch: dict[str, Any], **kw: Any) -> Any:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=batch["input_ids"], use_cache=False, **kw).logits
            logits.float().mean().backward()

        return run

    real = sum(len(e) for e in examples)
    repeat = 2 if args.smoke else 5
    mask = {} if "flash" in attn else {"attention_mask": to["attention_mask"]}
    padded_s = timed(step(to, **mask), repeat, cuda) if "flash" not in attn else None
    packed_s = timed(step(packed, position_ids=packed["position_ids"]), repeat, cuda)
    return {
        "attn": attn,
        "dtype": dtype_name,
        "examples": len(examples),
        "real_tokens": real,
        "padded_shape": list(to["input_ids"].shape),
        "packed_shape": list(packed["input_ids"].shape),
        "max_loss_diff": diff,
        "control_diff": control,
        "tolerance": tolerance,
        "ok": diff <= tolerance < control,
        "padded_tok_s": real / padded_s if padded_s else None,
        "packed_tok_s": real / packed_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", default="sdpa,flash_attention_2")
    p.add_argument("--examples", type=int, default=24)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_packing: no CUDA device here; refusing (use --smoke for the CPU code path)")
        return 2
    if args.smoke:
        args.examples, args.max_length = min(args.examples, 10), min(args.max_length, 256)
    results = []
    for attn in [a for a in args.attn.split(",") if a]:
        if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            print("flash_attention_2: flash_attn does not import here; skipped")
            continue
        dtypes = ["bfloat16"] if "flash" in attn else ["float32", "bfloat16"]
        for dtype in dtypes:
            r = check(attn, dtype, args, cuda)
            results.append(r)
            speed = (
                f", padded {r['padded_tok_s']:.0f} tok/s" if r["padded_tok_s"] is not None else ""
            )
            print(
                f"== {attn} {dtype}: max |packed - padded| loss {r['max_loss_diff']:.2e} "
                f"(tolerance {r['tolerance']:.0e}; control {r['control_diff']:.2e}): "
                f"{'ok' if r['ok'] else 'FAILED'}; packed {r['packed_tok_s']:.0f} tok/s{speed}",
                flush=True,
            )
    print(RESULT + json.dumps(results), flush=True)
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
