"""What serving stacks load: the adapter in PEFT's layout and the merged model.

The adapter folder is PEFT's own (``adapter_config.json`` + ``adapter_model.safetensors``,
what ``PeftModel.from_pretrained`` and vLLM's ``--lora-modules`` read), with its config
written in a stable order: PEFT keeps ``target_modules`` in a set, so its order in the JSON
followed the hash seed and identical weights got different content ids.

A merged model folds the adapter into base weights. After QLoRA the weights the adapter was
trained against are the *dequantised* 4/8-bit ones, not the full-precision checkpoint: on
the tiny test model, merging into the full-precision base moved the logits by 5.1 from the
model that was trained (and changed greedy answers). So a quantised base is merged into its
dequantised weights by default (``into="trained"``, logits match the trained model);
``into="base"`` merges into the full-precision weights instead. The folder says which in
``llmtrain_merge.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from llmtrain.errors import ConfigError
from llmtrain.training.args import ModelArguments

MergeInto = Literal["trained", "base"]
MERGE_NOTE = "llmtrain_merge.json"
ADAPTER_CONFIG = "adapter_config.json"


def stable_adapter_config(folder: Path) -> None:
    """Rewrite PEFT's adapter_config.json with list-valued sets (``target_modules``) sorted,
    in PEFT's own format (indent 2, sorted keys): the same adapter, the same bytes."""
    path = folder / ADAPTER_CONFIG
    config = json.loads(path.read_text())
    for key in ("target_modules", "modules_to_save", "exclude_modules"):
        value = config.get(key)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            config[key] = sorted(value)
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def check_new_folder(dest: Path, option: str) -> None:
    """``dest`` must not exist, or be an empty folder (removed, so a copy can create it)."""
    if dest.exists():
        if not dest.is_dir() or any(dest.iterdir()):
            raise ConfigError(f"{option} {dest} already exists and is not an empty folder")
        dest.rmdir()


def merge_base(args: ModelArguments, into: MergeInto) -> tuple[Any, str]:
    """The full-precision base model on the CPU to merge an adapter into, and a description:
    for a quantised base and ``into="trained"``, its weights are the dequantised ones the
    adapter was trained against."""
    from llmtrain.training.modeling import load_model

    cpu = torch.device("cpu")
    base = load_model(args, cpu, quantize=False)
    if not args.bits or into == "base":
        what = "full-precision base weights"
        return base, what + (f" (not the {args.bits}-bit ones trained on)" if args.bits else "")
    from peft.utils.integrations import dequantize_bnb_weight

    quantized = load_model(args, cpu)
    replaced = 0
    for name, module in quantized.named_modules():
        if type(module).__name__ not in {"Linear4bit", "Linear8bitLt"}:
            continue
        weight = dequantize_bnb_weight(module.weight, state=getattr(module, "state", None))
        target = base.get_submodule(name).weight
        with torch.no_grad():
            target.copy_(weight.reshape(target.shape).to(target.dtype))
        replaced += 1
    if not replaced:
        raise ConfigError(f"model_args.bits={args.bits} but the loaded base has no quantised layer")
    return base, f"dequantised {args.bits}-bit base weights (what training saw)"


def write_merged(
    args: ModelArguments, adapter_dir: Path, tokenizer: Any, dest: Path, into: MergeInto
) -> str:
    """Write base + adapter merged (safetensors) and the tokenizer to ``dest``; returns what
    the adapter was merged into (also written to ``llmtrain_merge.json``)."""
    from peft import PeftModel

    if into not in ("trained", "base"):
        raise ConfigError(f"merge into= must be 'trained' or 'base', not {into!r}")
    base, what = merge_base(args, into)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    note = {"base": args.model_name_or_path, "into": into, "merged_into": what}
    (dest / MERGE_NOTE).write_text(json.dumps(note, indent=2, sort_keys=True))
    return what
