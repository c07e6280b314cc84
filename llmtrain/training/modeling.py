"""Loading the base model and tokenizer, and preparing the model to train."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

from llmtrain.config.args import LoraArguments, ModelArguments
from llmtrain.errors import ConfigError
from llmtrain.training.precision import DTYPES, Precision

# LoRA's default targets: the attention and MLP projections of common decoder architectures.
_DEFAULT_TARGETS: dict[str, list[str]] = {
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "gemma"),
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    **dict.fromkeys(
        ("gpt_neox", "falcon"), ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    ),
}


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# How long the hub gets to answer before a name that is not a local folder is refused: a
# mistyped path otherwise spends ~48 s in transformers' retries against an unreachable hub.
HUB_CHECK_TIMEOUT_S = 3.0
_TRUE = {"1", "true", "yes", "on"}
_LAYER_LISTS = ("layers", "h", "blocks", "decoder_layers")


def check_model_path(
    name: str, *, tokenizer: bool = False, revision: str | None = None
) -> dict[str, Any]:
    """Refuse a model source that cannot load, at once; returns the extra ``from_pretrained``
    keywords (``local_files_only`` when the hub is offline but the cache has the model)."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        files = set(os.listdir(path))
        has_model, has_tokenizer = "config.json" in files, bool(files & set(_TOKENIZER_FILES))
        if not has_model and not has_tokenizer:
            missing = "model (no config.json, no tokenizer files)"
        elif tokenizer and not has_tokenizer:
            missing = f"tokenizer (none of {', '.join(_TOKENIZER_FILES)})"
        elif not tokenizer and not has_model:
            missing = "model (no config.json)"
        else:
            return {}
        raise ConfigError(f"model_args.model_name_or_path: the folder {name!r} has no {missing}")
    local = name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name
    if local or name.count("/") > 1:
        raise ConfigError(f"model_args.model_name_or_path: no model folder at {name!r}")
    from huggingface_hub import constants, try_to_load_from_cache

    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        offline = "the hub is offline (HF_HUB_OFFLINE is set)"
    elif not _reachable(endpoint):
        offline = f"the hub {endpoint} is unreachable (no answer within {HUB_CHECK_TIMEOUT_S:g} s)"
    else:
        return {}
    with contextlib.suppress(ValueError):  # ValueError: not a valid repo id
        if isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str):
            return {"local_files_only": True}
    raise ConfigError(
        f"model_args.model_name_or_path: {name!r} is not a local folder and {offline}, "
        "so it cannot be downloaded (and it is not in the Hugging Face cache)"
    )


@functools.lru_cache(maxsize=8)
def _reachable(endpoint: str) -> bool:
    """The endpoint answers in time (any status), asked in a thread: name lookup has no timeout."""
    import threading
    import urllib.error
    import urllib.request

    answered: list[bool] = []

    def probe() -> None:
        try:
            request = urllib.request.Request(endpoint, method="HEAD")
            urllib.request.urlopen(request, timeout=HUB_CHECK_TIMEOUT_S).close()  # noqa: S310
        except urllib.error.HTTPError:  # an answer, if not a welcome one
            pass
        except (OSError, ValueError):
            return
        answered.append(True)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_CHECK_TIMEOUT_S + 0.5)
    return bool(answered)


def load_tokenizer(args: ModelArguments) -> Any:
    """The tokenizer, with a pad token: the model's own, else EOS (labels are masked by
    position, so an EOS that shares the pad id is still trained)."""
    from transformers import AutoTokenizer

    hub = check_model_path(args.model_name_or_path, tokenizer=True, revision=args.revision)
    tok = AutoTokenizer.from_pretrained(
        args.model_name_or_path,
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        **hub,
    )
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(
                f"tokenizer of {args.model_name_or_path!r} has neither a pad nor "
                "an EOS token; the model could not learn to stop"
            )
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    args: ModelArguments,
    device: torch.device,
    *,
    quantize: bool = True,
    precision: Precision | None = None,
) -> Any:
    """The base causal LM on ``device``, quantised with bitsandbytes when ``bits`` is set."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    precision = precision or Precision.resolve(args, device)
    kwargs: dict[str, Any] = {
        **check_model_path(args.model_name_or_path, revision=args.revision),
        "revision": args.revision,
        "trust_remote_code": args.trust_remote_code,
        "dtype": precision.weights,
    }
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
    quantized = quantize and bool(args.bits)
    if quantized:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise ConfigError("bits=4/8 needs bitsandbytes: pip install 'llmtrain[qlora]'") from exc
        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_8bit=True)
            if args.bits == 8
            else BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=args.bnb_4bit_quant_type,
                bnb_4bit_use_double_quant=args.bnb_4bit_use_double_quant,
                bnb_4bit_compute_dtype=precision.quant_compute,
                bnb_4bit_quant_storage=DTYPES.get(args.bnb_4bit_quant_storage, torch.uint8),
            )
        )
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else "cpu"}
    model: Any = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, **kwargs)
    if not quantized:
        model.to(device)
    return model


def target_modules_for(model: Any, lora: LoraArguments) -> list[str] | str:
    """The configured targets, checked against the model, or the architecture's default."""
    if lora.target_modules == "all-linear":
        return "all-linear"
    available = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
            or type(module).__name__ in {"Linear4bit", "Linear8bitLt", "Conv1D"}
        }
        - {"lm_head"}
    )
    targets = lora.target_modules
    if targets is None:
        defaults = _DEFAULT_TARGETS.get(getattr(model.config, "model_type", ""), [])
        return [t for t in defaults if t in available] or "all-linear"
    if missing := [t for t in targets if t not in available]:
        raise ConfigError(
            f"lora_args.target_modules {missing} match no linear layer of "
            f"{model.config.model_type}; its linear layers are {available}"
        )
    return list(targets)


def prepare_for_training(
    model: Any, lora: LoraArguments | None, *, quantized: bool, gradient_checkpointing: bool
) -> Any:
    """Gradient checkpointing (switched on only here), then the LoRA/DoRA adapter if any."""
    kwargs = {"use_reentrant": False}
    if lora is not None and quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs=kwargs,
        )
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if lora is not None:
            model.enable_input_require_grads()  # the frozen embeddings' output must carry grads
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int, takes floats
        lora_dropout=lora.lora_dropout,
        target_modules=target_modules_for(model, lora),
        bias=lora.bias,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        modules_to_save=lora.modules_to_save,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def decoder_layers(model: torch.nn.Module, option: str) -> list[torch.nn.Module]:
    """The transformer blocks: classes named by ``_no_split_modules``, else a ``layers`` list;
    none is a ConfigError naming ``option``, not a run that silently shards or compiles nothing."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    if found := [m for m in model.modules() if type(m).__name__ in names]:
        return found
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.ModuleList) and last in _LAYER_LISTS and len(module) > 0:
            return list(module)
    raise ConfigError(
        f"{option}: found no decoder layers in {type(model).__name__} "
        "(no _no_split_modules and no 'layers' module list)"
    )
