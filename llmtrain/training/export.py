"""The adapter in PEFT's layout and the merged model, each with the prompt it was trained on.
After QLoRA, ``into="trained"`` merges into what training saw (merging into the full-precision
base moved the tiny test model's logits by 3.9). Serving stacks render the tokenizer's chat
template, so an export carries one rendering the training prompt (with the base's, vLLM's CPU
build and llama.cpp answered 0/16), and ``llmtrain_export.json``. What a stack refuses is checked
before anything is written: one DoRA adapter, or a rank above ``max_lora_rank``, kills vLLM's
engine and every adapter it serves."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llmtrain.config.args import ModelArguments
from llmtrain.errors import ConfigError

if TYPE_CHECKING:
    from llmtrain.formatting import Formatter

MergeInto = Literal["trained", "base"]
#: the serving stacks an export is checked for (``export --check``)
STACKS = ("vllm", "llama.cpp", "ollama")
#: the ranks vLLM's ``max_lora_rank`` takes
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def serving_problems(adapter: dict[str, Any] | None, heal: str, stacks: Sequence[str]) -> list[str]:
    """What ``stacks`` refuse or answer wrongly, one line each with the way out; ``adapter``:
    the exported adapter_config.json (None for a merged model). llama.cpp's LoRA converter,
    which Ollama's adapters go through too, takes lora_A/lora_B tensors alone."""
    if unknown := sorted(set(stacks) - set(STACKS)):
        raise ConfigError(f"--check {','.join(unknown)}: not a stack; name some of {STACKS}")
    problems: list[str] = []
    if adapter is not None:
        saved = set(adapter.get("modules_to_save") or ())
        other = saved - {"classifier", "score"}  # vLLM takes these alone; llama.cpp none
        for refusing, what in (
            (stacks if adapter.get("use_dora") else [], "a DoRA adapter"),
            ([s for s in stacks if saved and (s != "vllm" or other)], f"modules_to_save {saved}"),
            (stacks if adapter.get("bias", "none") != "none" else [], "trained LoRA biases"),
        ):
            if refusing:
                problems.append(f"{', '.join(refusing)} refuse {what}: export --merged instead")
        rank = int(adapter["r"])
        if "vllm" in stacks and rank not in VLLM_RANKS:
            fits = [r for r in VLLM_RANKS if r >= rank]
            way = f"serve with max_lora_rank={fits[0]}" if fits else "export --merged instead"
            problems.append(f"vllm: rank {rank} is not one of max_lora_rank {VLLM_RANKS}: {way}")
    if heal and stacks:
        problems.append(
            f"{', '.join(stacks)}: the prompt's last characters {heal!r} are the start of the "
            "answer's first token in training: send completions the prompt without them (as the "
            "exported chat template renders it), and cut them from each answer's start"
        )
    return problems


def write_prompt(dest: Path, formatter: Formatter, note: dict[str, Any]) -> None:
    """The tokenizer, its chat template rendering the training prompt, and llmtrain_export.json."""
    formatter.tokenizer.save_pretrained(dest)
    (dest / "chat_template.jinja").write_text(formatter.served_chat_template())
    note = {**note, "eos_token": formatter.tokenizer.eos_token, "heal": formatter.prompt("").heal}
    (dest / "llmtrain_export.json").write_text(json.dumps(note, indent=2, sort_keys=True))


def write_adapter(config: Any, weights: dict[str, Any], folder: Path) -> None:
    """The trained adapter alone (PeftModel.save_pretrained converted the weights twice, failing
    on modules_to_save, and wrote the reference adapter too), lists sorted (hash-seed order)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    fields = {**config.to_dict(), "inference_mode": True}
    for key, value in fields.items():
        if isinstance(value, (set, list)) and all(isinstance(v, str) for v in value):
            fields[key] = sorted(value)
    (folder / "adapter_config.json").write_text(json.dumps(fields, indent=2, sort_keys=True))
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def check_new_folder(dest: str | Path, option: str) -> Path:
    """``dest`` must not exist, or be an empty folder (removed, so a copy can create it)."""
    dest = Path(dest)
    if dest.exists():
        if not dest.is_dir() or any(dest.iterdir()):
            raise ConfigError(f"{option} {dest} already exists and is not an empty folder")
        dest.rmdir()
    return dest


def write_merged(args: ModelArguments, adapter_dir: Path, dest: Path, into: MergeInto) -> str:
    """Write base + adapter merged to ``dest``; returns what it merged into."""
    import torch
    from peft import PeftModel

    from llmtrain.training.modeling import load_model

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
    return what
