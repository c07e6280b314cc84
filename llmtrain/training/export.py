"""The adapter in PEFT's layout and the merged model. After QLoRA, merging into the full-precision
base moved the tiny test model's logits by 3.9: ``into="trained"`` merges into what training saw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from llmtrain.config.args import ModelArguments
from llmtrain.errors import ConfigError

MergeInto = Literal["trained", "base"]


def stable_adapter_config(folder: Path) -> None:
    """Sort the lists of adapter_config.json: PEFT's hash-seed order gave one adapter many ids."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    for key in ("target_modules", "modules_to_save", "exclude_modules"):
        value = config.get(key)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            config[key] = sorted(value)
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def check_new_folder(dest: str | Path, option: str) -> Path:
    """``dest`` must not exist, or be an empty folder (removed, so a copy can create it)."""
    dest = Path(dest)
    if dest.exists():
        if not dest.is_dir() or any(dest.iterdir()):
            raise ConfigError(f"{option} {dest} already exists and is not an empty folder")
        dest.rmdir()
    return dest


def write_merged(args: ModelArguments, adapter_dir: Path, dest: Path, into: MergeInto) -> str:
    """Write base + adapter merged, and the tokenizer, to ``dest``; returns what it merged into."""
    from peft import PeftModel

    from llmtrain.training.modeling import load_model, load_tokenizer

    if into not in ("trained", "base"):
        raise ConfigError(f"merge into= must be 'trained' or 'base', not {into!r}")
    cpu = torch.device("cpu")
    base = load_model(args, cpu, quantize=False)
    what = "full-precision base weights"
    if args.bits and into == "base":
        what += f" (not the {args.bits}-bit ones trained on)"
    elif args.bits:
        from peft.utils.integrations import dequantize_bnb_weight

        kinds = {"Linear4bit", "Linear8bitLt"}
        layers = [
            (n, m) for n, m in load_model(args, cpu).named_modules() if type(m).__name__ in kinds
        ]
        if not layers:
            raise ConfigError(
                f"model_args.bits={args.bits} but the loaded base has no quantised layer"
            )
        for name, module in layers:
            weight = dequantize_bnb_weight(module.weight, state=getattr(module, "state", None))
            target = base.get_submodule(name).weight
            with torch.no_grad():
                target.copy_(weight.reshape(target.shape).to(target.dtype))
        what = f"dequantised {args.bits}-bit base weights (what training saw)"
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(dest, safe_serialization=True)
    load_tokenizer(args).save_pretrained(dest)
    note = {"base": args.model_name_or_path, "into": into, "merged_into": what}
    (dest / "llmtrain_merge.json").write_text(json.dumps(note, indent=2, sort_keys=True))
    return what
