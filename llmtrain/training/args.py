"""The argument models: the one source of truth for what a trainer does.

They are what is validated, stored in the metadata store, shown and replayed. Each rejects
unknown keys and out-of-range values, naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmtrain.errors import ConfigError

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class _ArgsMeta(type(BaseModel)):  # type: ignore[misc]
    """Built directly (``LoraArguments(r=0)``), a bad value is a ConfigError naming the field,
    as everywhere else, not pydantic's ValidationError. (Not an ``__init__`` override: that
    would make pydantic call it for nested models too and reword their errors.)"""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as exc:
            raise ConfigError(describe(cls.__name__, exc)) from None


class _Args(BaseModel, metaclass=_ArgsMeta):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigError(describe(type(self).__name__, exc)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return build(cls, data)


def build(cls: type[_Args], data: dict[str, Any]) -> Any:
    """Validate ``data`` into ``cls``, turning every problem into one ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(cls.__name__, exc)) from None


def describe(where: str, exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(model)"
        message = "unknown option" if err["type"] == "extra_forbidden" else err["msg"]
        problems.append(f"{where}.{field}: {message}")
    return "invalid configuration: " + "; ".join(problems)


class ModelArguments(_Args):
    """Which base model, and how to load it (quantisation, dtype, attention)."""

    model_name_or_path: str = Field(min_length=1)
    bits: Literal[4, 8] | None = Field(
        None, description="Quantise the frozen base weights with bitsandbytes (QLoRA).")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    bnb_4bit_use_double_quant: bool = True
    bnb_4bit_compute_dtype: Dtype = "auto"
    bnb_4bit_quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = Field(
        "uint8", description="Set to the compute dtype to shard 4-bit weights with FSDP.")
    torch_dtype: Dtype = "auto"
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None
    trust_remote_code: bool = False
    revision: str | None = None


class LoraArguments(_Args):
    """The adapter: LoRA, or DoRA with ``use_dora``."""

    r: int = Field(8, ge=1, le=4096)
    lora_alpha: float = Field(16, gt=0)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="Default: the attention and MLP projections of the architecture.")
    bias: Literal["none", "all", "lora_only"] = "none"
    use_dora: bool = False
    use_rslora: bool = False
    modules_to_save: list[str] | None = None


class TrainingArguments(_Args):
    """The optimisation loop."""

    learning_rate: float = Field(2e-4, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    optim: Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit"] = "adamw_torch"
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    num_train_epochs: int = Field(1, ge=1)
    max_steps: int = Field(-1, description="Optimizer steps; -1 runs num_train_epochs.")
    per_device_train_batch_size: int = Field(4, ge=1)
    per_device_eval_batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 on a GPU that supports it, else full precision.")
    gradient_checkpointing: bool = False
    seed: int = 0
    logging_steps: int = Field(10, ge=1)
    save_steps: int | None = Field(None, ge=1, description="Checkpoint every N steps.")
    save_total_limit: int | None = Field(2, ge=1)
    eval_steps: int | None = Field(None, ge=1)
    progress_bar: bool = True

    @model_validator(mode="after")
    def _steps(self) -> TrainingArguments:
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError("max_steps must be -1 (use num_train_epochs) or >= 1")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        return self


class DataArguments(_Args):
    """From rows to token ids: template, truncation, packing, streaming, evaluation."""

    max_length: int = Field(512, ge=8)
    train_on_inputs: bool = Field(False, description="Also train on prompt tokens.")
    chat_template: bool = Field(False, description="Use the tokenizer's chat template.")
    packing: bool = Field(False, description="Pack examples into rows; no cross-attention.")
    cache_size: int = Field(1024, ge=1, description="Rows per database window.")
    shuffle: bool = True
    drop_remainder: bool = True
    on_bad_row: Literal["raise", "skip"] = "raise"
    num_workers: int = Field(0, ge=0)
    eval_fraction: float = Field(0.0, ge=0, lt=1,
                                 description="Hold out rows by key hash (stable across runs).")
    max_eval_rows: int = Field(1000, ge=1)
    allow_changed_data: bool = Field(False, description="Resume even if rows changed.")


class DeepspeedConfig(_Args):
    """DeepSpeed ZeRO: a stage and offload options, or a raw config dict/path."""

    stage: Literal[1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    raw: dict[str, Any] | str | None = Field(
        None, description="A DeepSpeed JSON config (dict or path) used as given.")

    @model_validator(mode="after")
    def _offload(self) -> DeepspeedConfig:
        if self.offload_param and self.stage != 3:
            raise ValueError("offload_param needs stage 3")
        return self


class FSDPConfig(_Args):
    """FSDP2 (``fully_shard``) per decoder layer, with mixed precision and offload options."""

    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    cpu_offload: bool = False
    reshard_after_forward: bool = True


# flat keyword -> (group, field) for LLMTrainer(..., learning_rate=..., lora_r=...)
_GROUPS: dict[str, type[_Args]] = {"model_args": ModelArguments, "lora_args": LoraArguments,
                                   "training_args": TrainingArguments,
                                   "data_args": DataArguments}
_ALIASES = {
    "model": ("model_args", "model_name_or_path"),
    "lora_r": ("lora_args", "r"),
    "lora_dropout": ("lora_args", "lora_dropout"),
    "lora_alpha": ("lora_args", "lora_alpha"),
    "target_modules": ("lora_args", "target_modules"),
    "use_dora": ("lora_args", "use_dora"),
    "batch_size": ("training_args", "per_device_train_batch_size"),
    "epochs": ("training_args", "num_train_epochs"),
}


def flat_keyword_target(name: str) -> tuple[str, str]:
    """Which argument model a flat keyword belongs to; ConfigError naming it if none."""
    if name in _ALIASES:
        return _ALIASES[name]
    owners = [group for group, cls in _GROUPS.items() if name in cls.model_fields]
    if len(owners) == 1:
        return owners[0], name
    raise ConfigError(f"unknown option {name!r}: it is not a field of ModelArguments, "
                      "LoraArguments, TrainingArguments or DataArguments")
