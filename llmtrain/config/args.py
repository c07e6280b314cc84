"""The argument models and :class:`TrainerConfig`, the one source of truth: LLMTrainer's flat
keywords, YAML sections, ``--section.field`` overrides and keyword reference derive from them."""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmtrain.config.metrics import logged_name, metric_problems
from llmtrain.config.spec import FitSpec
from llmtrain.db.queries import Conversations
from llmtrain.errors import ConfigError
from llmtrain.objectives import (
    OBJECTIVES,
    SETTINGS,
    as_stored,
    objective_of,
    objective_problems,
)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
#: a TrainerConfig section whose fields are also LLMTrainer's flat keywords
_FLAT: Any = {"flat": True}


if TYPE_CHECKING:  # the metaclass only rewords errors: type checkers see pydantic's own
    from pydantic._internal._model_construction import ModelMetaclass as _ArgsMeta
else:

    class _ArgsMeta(type(BaseModel)):  # type: ignore[misc]
        """ConfigErrors naming the field (an ``__init__`` would also reword nested models')."""

        def __call__(cls, **kwargs: Any) -> Any:
            return build(cls, kwargs)


class _Args(BaseModel, metaclass=_ArgsMeta):
    # defaults validated too: a float field never holds an int (``lora_alpha=16`` would reach
    # PEFT as 16 in a first fit and as 16.0 read back from its record: another adapter id)
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_default=True,
        use_attribute_docstrings=True,
    )

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


def build(cls: type[BaseModel], data: dict[str, Any], where: str | None = None) -> Any:
    """Validate ``data`` into ``cls``; every problem in one ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(where or cls.__name__, exc)) from None


def describe(where: str, exc: ValidationError) -> str:
    """Every problem, each naming its field: ``where.section.field: message``."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        message = "unknown option" if err["type"] == "extra_forbidden" else err["msg"]
        message = message.removeprefix("Value error, ")  # a rule names its fields itself
        problems.append(f"{where}.{loc}: {message}" if loc else f"{where}: {message}")
    return "invalid configuration: " + "; ".join(problems)


class ModelArguments(_Args):
    """Which base model, and how to load it (quantisation, dtype, attention)."""

    model_name_or_path: str = Field(min_length=1, json_schema_extra={"flat": "model"})
    """A hub id or a local model folder."""
    bits: Literal[4, 8] | None = None
    """Quantise the frozen base weights with bitsandbytes (QLoRA)."""
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    """The 4-bit data type (bits=4)."""
    bnb_4bit_use_double_quant: bool = True
    """Also quantise the quantisation constants (bits=4)."""
    bnb_4bit_compute_dtype: Dtype = "auto"
    """Dtype of the 4-bit matmuls; auto: bf16 where the GPU has it."""
    bnb_4bit_quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = "uint8"
    """Set to the compute dtype to shard 4-bit weights with FSDP."""
    torch_dtype: Dtype = "auto"
    """Dtype of the unquantised weights; auto: bf16 where the GPU has it."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None
    """Attention kernel; None lets transformers choose."""
    trust_remote_code: bool = False
    """Run the model repository's own code (only for sources you trust)."""
    revision: str | None = None
    """A hub branch, tag or commit."""


class LoraArguments(_Args):
    """The adapter: LoRA, or DoRA with ``use_dora``."""

    r: int = Field(default=8, ge=1, le=4096, json_schema_extra={"flat": "lora_r"})
    """Adapter rank."""
    lora_alpha: float = Field(default=16, gt=0)
    """Scale: the update is multiplied by alpha/r."""
    lora_dropout: float = Field(default=0.05, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: list[str] | Literal["all-linear"] | None = None
    """Default: the attention and MLP projections of the architecture."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train along with the adapter."""
    use_dora: bool = False
    """DoRA: also learn each weight's magnitude."""
    use_rslora: bool = False
    """Scale by alpha/sqrt(r) (rank-stabilised LoRA)."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and stored with the adapter (e.g. lm_head)."""


class TrainingArguments(_Args):
    """The optimisation loop."""

    learning_rate: float = Field(default=2e-4, gt=0, le=1)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_epsilon: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    optim: Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit"] = "adamw_torch"
    """The optimizer; the 8-bit ones come from bitsandbytes."""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """Learning-rate schedule after the warmup."""
    warmup_steps: int = Field(default=0, ge=0)
    """Warmup length in optimizer steps."""
    warmup_ratio: float = Field(default=0.0, ge=0, le=1)
    """Warmup as a share of all steps."""
    num_train_epochs: int = Field(default=1, ge=1, json_schema_extra={"flat": "epochs"})
    """Passes over the rows (when max_steps is -1)."""
    max_steps: int = -1
    """Optimizer steps; -1 runs num_train_epochs."""
    per_device_train_batch_size: int = Field(
        default=4, ge=1, json_schema_extra={"flat": "batch_size"}
    )
    """Rows per micro-batch on each process."""
    per_device_eval_batch_size: int = Field(default=8, ge=1)
    """Rows per evaluation batch."""
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    """Micro-batches per optimizer step."""
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    """Clip the gradient norm to this; None: no clipping."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 on a GPU that supports it, else full precision."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, more time."""
    seed: int = 0
    """Seeds the adapter's initialisation, dropout and shuffle."""
    logging_steps: int = Field(default=10, ge=1)
    """Record the metrics every N steps."""
    save_steps: int | None = Field(default=None, ge=1)
    """Checkpoint every N steps."""
    save_total_limit: int | None = Field(default=2, ge=1)
    """Checkpoints kept per run (the newest); None keeps all."""
    eval_steps: int | None = Field(default=None, ge=1)
    """Evaluate on the held-out rows every N steps."""
    progress_bar: bool = True
    """Show progress on the main process: a tqdm bar on a terminal, else a line per log."""
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    """Also send the metrics, recipe and versions to these trackers (rank 0; optional extras)."""
    eval_metrics: list[str] = []
    """Score eval rows' greedy answers: 'exact_match', 'contains' or 'package.module:function'."""
    eval_max_new_tokens: int = Field(default=32, ge=1)
    """Tokens generated per eval row for eval_metrics (greedy)."""
    save_best_by: str | None = None
    """Also keep the checkpoint best by 'eval_loss' or an eval metric (checkpoint='best')."""
    greater_is_better: bool | None = None
    """Direction of save_best_by; None: lower for a loss, higher for a metric."""
    torch_compile: bool = False
    """torch.compile each decoder layer (one process or DDP; not with bits, FSDP, DeepSpeed)."""

    @model_validator(mode="after")
    def _steps(self) -> TrainingArguments:
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError("max_steps must be -1 (use num_train_epochs) or >= 1")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"report_to names a tracker twice: {self.report_to}")
        if problems := metric_problems(self.eval_metrics, self.save_best_by):
            raise ValueError("; ".join(problems))
        return self

    def best_key(self) -> str | None:
        """The logged metric save_best_by names (``eval_loss``, ``eval_exact_match``, ...)."""
        return None if self.save_best_by is None else logged_name(self.save_best_by)

    def best_is_greater(self) -> bool:
        """Whether a larger save_best_by value is better (a loss: no; a metric: yes)."""
        greater = self.greater_is_better
        return not (self.best_key() or "").endswith("loss") if greater is None else greater


class DataArguments(_Args):
    """From rows to token ids: template, truncation, packing, streaming, evaluation."""

    max_length: int = Field(default=512, ge=8)
    """Tokens per example; prompts cut from the left."""
    train_on_inputs: bool = False
    """Also train on prompt tokens."""
    chat_template: bool = False
    """Use the tokenizer's chat template (fit() with no Y: X holds conversations)."""
    assistant_turns: Literal["all", "last"] = "all"
    """Conversations: train every assistant reply, or the last one only."""
    packing: bool | None = None
    """Pack examples into rows; no cross-attention. None: documents packed, other rows not."""
    max_tokens_per_batch: int | None = Field(default=None, ge=8)
    """Token cap of a packed micro-batch; None with packing: batch_size rows of max_length."""
    cache_size: int = Field(default=1024, ge=1)
    """Rows per database read (a window's statement); changes no order."""
    shuffle_block: int = Field(default=1024, ge=1)
    """Keys per block of the epoch order: blocks are permuted, rows shuffled within."""
    shuffle: bool = True
    """Shuffle the rows each epoch (seeded, resumable)."""
    drop_remainder: bool = True
    """Drop the rows that do not fill a last batch on every rank."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A row with a missing or non-text field: fail, or skip it."""
    dataloader_num_workers: int = Field(default=0, ge=0)
    """DataLoader worker processes that read and tokenize a rank's rows."""
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)
    """Hold out rows by key hash (stable across runs)."""
    max_eval_rows: int = Field(default=1000, ge=1)
    """Held-out rows scored per evaluation."""
    allow_changed_data: bool = False
    """Replay a fit on changed rows (fit(allow_changed_data=) wins)."""
    version_column: str | None = None
    """Column whose value changes when a row is edited (e.g. updated_at), kept per key."""
    stride: int = Field(default=0, ge=0)
    """Documents (no Y): context tokens a window repeats from the one before (not retrained)."""

    def token_budget(self, batch_size: int) -> int | None:
        """Tokens a packed micro-batch holds (None without packing). Packing a step's rows
        together: 0.998 real tokens, against 0.84 packing each batch alone (B=8, T=256)."""
        return (self.max_tokens_per_batch or batch_size * self.max_length) if self.packing else None


class ObjectiveArguments(_Args, *SETTINGS):  # type: ignore[misc]
    """What the loss trains, and each objective's own settings (its module's ``Settings``)."""

    objective: str = "sft"
    """A registered objective, by name (``llmtrain.objectives.OBJECTIVES``)."""
    beta: float = Field(default=0.1, ge=0)
    """The objective's strength: its inverse temperature, lambda or KL weight (its module's)."""
    loss_type: str | None = None
    """The objective's variant (None: its first; each objective lists its own)."""

    @model_validator(mode="before")
    @classmethod
    def _as_stored(cls, data: Any) -> Any:
        return as_stored(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _known(self) -> ObjectiveArguments:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}: not one of {sorted(OBJECTIVES)}")
        return self


class DeepspeedConfig(_Args):
    """DeepSpeed ZeRO: a stage and offload options, or a raw config dict/path."""

    stage: Literal[1, 2, 3] = 2
    """ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters partitioned."""
    offload_optimizer: bool = False
    """Keep the optimizer state on the CPU."""
    offload_param: bool = False
    """Keep the parameters on the CPU (stage 3)."""
    raw: dict[str, Any] | str | None = None
    """A DeepSpeed JSON config (dict or path) used as given."""

    @model_validator(mode="after")
    def _offload(self) -> DeepspeedConfig:
        if self.offload_param and self.stage != 3:
            raise ValueError("offload_param needs stage 3")
        return self

    @property
    def zero_stage(self) -> int | None:
        """The stage that will run; None for a raw config file (read at run time)."""
        if isinstance(self.raw, str):
            return None
        if self.raw is not None:
            return int(self.raw.get("zero_optimization", {}).get("stage", 0))
        return self.stage


class FSDPConfig(_Args):
    """FSDP2 (``fully_shard``) per decoder layer, with mixed precision and offload options."""

    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Dtype FSDP2 gathers parameters and reduces gradients in."""
    cpu_offload: bool = False
    """Keep the sharded parameters on the CPU."""
    reshard_after_forward: bool = True
    """Free gathered layers after forward (less memory, one more gather)."""


class Launcher(_Args):
    """How fit() starts its worker processes (no launcher: fit() trains in its own process)."""

    kind: Literal["torchrun", "deepspeed"]
    """torchrun or deepspeed."""
    num_processes: int = Field(default=1, ge=1)
    """Worker processes per node."""
    num_nodes: int = Field(default=1, ge=1)
    """Machines; each runs fit() with its node_rank."""
    node_rank: int = Field(default=0, ge=0)
    """This machine's index among num_nodes."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, reachable by all."""
    master_port: int | None = Field(default=None, ge=1, le=65535)
    """Port on node 0; None: a free one (one node only)."""
    hostfile: str | None = None
    """The deepspeed launcher's hostfile."""
    timeout_s: float | None = Field(default=None, gt=0)
    """Stop the whole job after this many seconds."""

    @model_validator(mode="after")
    def _nodes(self) -> Launcher:
        problems = []
        if self.num_nodes > 1 and self.master_port is None:
            problems.append(
                "launcher.master_port must be set for several nodes: every node has to reach it"
            )
        if self.node_rank >= self.num_nodes:
            problems.append(
                f"launcher.node_rank={self.node_rank} needs num_nodes={self.num_nodes} above it"
            )
        if self.hostfile is not None and self.kind != "deepspeed":
            problems.append(
                f"launcher.hostfile is read by the deepspeed launcher only, not kind={self.kind!r}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RayConfig(_Args):
    """Train on a Ray cluster through Ray Train's ``TorchTrainer`` (DDP in its workers)."""

    address: str | None = None
    """Ray cluster address ('auto', 'ray://host:10001'); None: this process's or a new local one."""
    num_workers: int = Field(default=2, ge=1)
    """Training workers (the world size)."""
    use_gpu: bool = False
    """One GPU per worker."""
    resources_per_worker: dict[str, float] | None = None
    """Ray resources each worker needs (e.g. {'CPU': 2})."""
    max_failures: int = Field(default=0, ge=-1)
    """Restarts of the worker group from its last checkpoint after a failure; -1: no limit."""
    storage: str | None = None
    """Where Ray Train keeps checkpoints: a folder or a URL (s3://...) every node reaches."""

    @model_validator(mode="after")
    def _resources(self) -> RayConfig:
        resources = self.resources_per_worker or {}
        if self.use_gpu and resources.get("GPU", 1) <= 0:
            raise ValueError(
                "ray_config.use_gpu=True with ray_config.resources_per_worker GPU=0: "
                "give the workers a GPU or drop use_gpu"
            )
        if any(value < 0 for value in resources.values()):
            raise ValueError("ray_config.resources_per_worker: amounts must be >= 0")
        parts = urlsplit(self.storage or "")
        if "@" in parts.netloc or parts.query or parts.fragment:
            raise ValueError(
                "ray_config.storage: credentials and options do not belong in the URL (it is "
                "stored); set them in the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL...)"
            )
        return self


class TrainerConfig(_Args):
    """Everything a trainer is; stored as JSON, validated on the way back. ``flat`` sections
    lend their fields (and aliases) to ``LLMTrainer``'s keywords; a None section is unused."""

    identifier: str
    """The trainer's name in the metadata store."""
    prompt_template: str | None = None
    """The prompt, with {X} and {Y} (e.g. 'Q: {X}\\nA: {Y}')."""
    model_args: ModelArguments = Field(json_schema_extra=_FLAT)
    """The base model."""
    lora_args: LoraArguments | None = Field(default_factory=LoraArguments, json_schema_extra=_FLAT)
    """The adapter; None: full fine-tuning."""
    init_from: str | None = Field(default=None, min_length=1)
    """An earlier model to go on from, 'name' (its newest, recorded as 'name:N') or 'name:N'."""
    training_args: TrainingArguments = Field(
        default_factory=TrainingArguments, json_schema_extra=_FLAT
    )
    """The optimisation loop."""
    data_args: DataArguments = Field(default_factory=DataArguments, json_schema_extra=_FLAT)
    """Rows to token ids, and evaluation."""
    objective_args: ObjectiveArguments = Field(
        default_factory=ObjectiveArguments, json_schema_extra=_FLAT
    )
    """What the loss trains: responses, or preferences."""
    deepspeed_config: DeepspeedConfig | None = None
    """Train with DeepSpeed ZeRO ({} for the defaults)."""
    fsdp_config: FSDPConfig | None = None
    """Train with FSDP2 ({} for the defaults)."""
    launcher: Launcher | None = None
    """Start worker processes (torchrun, deepspeed) from fit()."""
    ray_config: RayConfig | None = None
    """Train on Ray (Ray Train's TorchTrainer); None: on this machine."""
    fit: FitSpec | None = None
    """The data of the last fit(), for replays."""

    @classmethod
    def sections(cls) -> dict[str, type[_Args]]:
        return {
            name: candidate
            for name, field in cls.model_fields.items()
            for candidate in (field.annotation, *typing.get_args(field.annotation))
            if isinstance(candidate, type) and issubclass(candidate, _Args)
        }

    @classmethod
    def options(cls) -> list[str]:
        """Every top-level option a user sets: not the name, nor ``fit`` (written by fit())."""
        return [name for name in cls.model_fields if name not in ("identifier", "fit")]

    @classmethod
    def flat_keywords(cls) -> dict[str, tuple[str, str]]:
        """``LLMTrainer``'s flat keyword -> (section, field)."""
        return {
            keyword: (section, name)
            for section, model in cls.sections().items()
            if _extra(cls.model_fields[section]).get("flat")
            for name, field in model.model_fields.items()
            for keyword in filter(None, (name, _extra(field).get("flat")))
        }

    @model_validator(mode="after")
    def _rules(self) -> TrainerConfig:
        problems = self._objective_problems() + self._template_problems()  # missing fields first
        if self.deepspeed_config is not None and self.fsdp_config is not None:
            problems.append("deepspeed_config and fsdp_config: choose one strategy, not both")
        if self.ray_config is not None and self.launcher is not None:
            problems.append(
                "ray_config and launcher: Ray starts the workers; drop launcher= to train on Ray"
            )
        if self.ray_config is not None and self.deepspeed_config is not None:
            problems.append(
                "ray_config and deepspeed_config: Ray workers train with DDP or FSDP2, "
                "not DeepSpeed"
            )
        d = self.data_args
        if d.max_tokens_per_batch is not None and not d.packing:
            problems.append("data_args.max_tokens_per_batch needs packing=True")
        if d.max_tokens_per_batch is not None and d.max_tokens_per_batch < d.max_length:
            problems.append(
                f"data_args.max_tokens_per_batch={d.max_tokens_per_batch} is less than one "
                f"row of max_length={d.max_length}"
            )
        problems += self._evaluation_problems()
        m = self.model_args
        if self.training_args.torch_compile:
            # bitsandbytes breaks the graph at every layer; FSDP2's and DeepSpeed's hooks are
            # not compiled with the layers (untested, so refused)
            problems += [
                f"training_args.torch_compile=True with {name}: compile works in a single "
                "process or under DDP on an unquantised model; drop one of them"
                for name, on in (
                    ("model_args.bits", m.bits),
                    ("fsdp_config", self.fsdp_config is not None),
                    ("deepspeed_config", self.deepspeed_config is not None),
                )
                if on
            ]
        changed = [
            f"model_args.{name}={getattr(m, name)!r}"
            for name, field in ModelArguments.model_fields.items()
            if name.startswith("bnb_4bit_") and getattr(m, name) != field.default
        ]
        if changed and m.bits != 4:
            problems.append(
                f"{', '.join(changed)} without model_args.bits=4: they set up the 4-bit "
                "quantisation only; set bits=4 or leave them out"
            )
        fsdp = self.fsdp_config
        if fsdp and fsdp.mixed_precision != "no" and self.training_args.mixed_precision != "auto":
            problems.append(
                f"fsdp_config.mixed_precision={fsdp.mixed_precision!r} with "
                f"training_args.mixed_precision={self.training_args.mixed_precision!r}: "
                "two precision settings for one run; under FSDP2 set one of them"
            )
        if m.bits and self.lora_args is None:
            problems.append(
                f"model_args.bits={m.bits} with lora_args=None: bits quantises the frozen base "
                "model, which only an adapter can train; keep lora_args (QLoRA) or drop bits"
            )
        problems += quantization_problems(
            m.bits,
            fsdp=self.fsdp_config is not None,
            quant_storage=m.bnb_4bit_quant_storage,
            deepspeed_stage=self.deepspeed_config.zero_stage if self.deepspeed_config else None,
            compute_dtype=None if m.bnb_4bit_compute_dtype == "auto" else m.bnb_4bit_compute_dtype,
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _objective_problems(self) -> list[str]:
        """The objective's fields and rules (its module's), then what any objective needs."""
        problems = objective_problems(self)
        if self.fit is not None and self.fit.reward and not objective_of(self).generated:
            takes = " or ".join(repr(n) for n, o in OBJECTIVES.items() if o.generated)
            problems.append(f"fit(reward=) scores sampled answers: set objective={takes}")
        if self.init_from is not None and self.lora_args is None:
            problems.append(
                f"init_from={self.init_from!r} continues an earlier model's adapter; "
                "lora_args=None trains none"
            )
        return problems

    def _evaluation_problems(self) -> list[str]:
        """eval_metrics and save_best_by need rows to evaluate on and the whole model."""
        t, fit, problems = self.training_args, self.fit, []
        wanted = [
            f"training_args.{n}"
            for n in ("eval_metrics", "save_best_by", "eval_steps")
            if getattr(t, n)
        ]
        if t.eval_metrics and fit and fit.Y is None:
            problems.append(
                "training_args.eval_metrics compare generated answers with Y; fit() with no Y "
                "(documents) has none: evaluate with eval_loss"
            )
        if wanted and fit and fit.eval_select is None and self.data_args.eval_fraction <= 0:
            problems.append(
                f"{' and '.join(wanted)} need rows to evaluate on: pass fit(eval_select=) "
                "or set data_args.eval_fraction > 0"
            )
        sharded = self.fsdp_config is not None or (
            self.deepspeed_config is not None and self.deepspeed_config.zero_stage == 3
        )
        if t.eval_metrics and sharded:
            problems.append(
                "training_args.eval_metrics with fsdp_config or deepspeed_config stage 3: "
                "generation needs the whole model on each process; use ddp or ZeRO stage 1/2"
            )
        return problems

    def _template_problems(self) -> list[str]:
        """{X} and {Y} (or the chat template) for responses, none or {X} alone for documents."""
        fit, d, template = self.fit, self.data_args, self.prompt_template
        if template is not None and d.chat_template:
            return ["prompt_template and data_args.chat_template=True: give one, not both"]
        if d.stride >= d.max_length - 1:
            return [f"data_args.stride={d.stride} leaves no new token in a window of max_length"]
        from llmtrain.formatting.template import PromptTemplate

        try:
            documents = PromptTemplate(template).documents if template else None
        except ConfigError as exc:
            return [f"prompt_template: {exc}"]
        mixed = fit is not None and len(fit.parts()) > 1
        generated = ["(generated)"] if objective_of(self).generated else []  # the answer slot
        for part in fit.parts() if fit else ():
            y = part.fields_or(fit.fields)[1:2] or generated if fit else []
            conversations = isinstance(part.select, Conversations)
            if problem := self._shape_problem(y, conversations, mixed, documents):
                return [problem]
        return []

    def _shape_problem(
        self, y: list[str], conversations: bool, mixed: bool, documents: bool | None
    ) -> str | None:
        """What keeps rows of this shape (a Y or not, conversations) from training."""
        d, template = self.data_args, self.prompt_template
        if conversations and (y or not d.chat_template or d.version_column):
            return (
                "select=lt.Conversations(...) trains conversations: fit() with no Y, "
                "data_args.chat_template=True and no data_args.version_column (a "
                "conversation's version is its last turn)"
            )
        if not y and d.chat_template:  # conversations: lt.Conversations, or X's JSON lists
            return None
        if not y and d.packing is None:  # documents pack: a long one's windows fill rows
            d.packing = True
        if not y and not d.packing:
            return (
                "fit() with no Y (documents) cannot take data_args.packing=False: a long "
                "document's windows are packed under the step's token budget"
            )
        if template is None:
            if d.chat_template or not y:
                return None
            return (
                "prompt_template: needed (with {X} and {Y}) unless data_args.chat_template=True "
                "or fit() has no Y (continued pre-training)"
            )
        if documents == bool(y) and not (mixed and not y):  # a mixture's documents go bare
            if not y:
                return (
                    f"prompt_template {template!r} has {{Y}} but fit() has no Y: "
                    "give Y=, or a template with {X} alone for continued pre-training"
                )
            return (
                f"prompt_template {template!r} has no {{Y}}: it formats documents "
                f"(fit() with no Y), not responses from Y={y[0]!r}"
            )
        return None

    def method(self) -> str:
        """What trains, for people: ``LoRA r=16``, ``DoRA r=8, 4-bit``, ``full``."""
        lora = self.lora_args
        text = "full" if lora is None else f"{'DoRA' if lora.use_dora else 'LoRA'} r={lora.r}"
        text += f", {self.model_args.bits}-bit" if self.model_args.bits else ""
        objective = objective_of(self).method()
        return f"{objective}, {text}" if objective else text


def quantization_problems(
    bits: int | None,
    *,
    deepspeed_stage: int | None = None,
    fsdp: bool = False,
    quant_storage: str | None = None,
    compute_dtype: str | None = None,
    cuda: bool | None = None,
) -> list[str]:
    """What a quantised base cannot do sharded: from the config, then at run time (None: unknown)"""
    if not bits:
        return []
    problems = []
    if deepspeed_stage == 3:
        # Measured: after one step a ZeRO-3-partitioned 4-bit model gives another loss than
        # the same update applied in a single process; ZeRO-2 matches it exactly.
        problems.append(
            f"model_args.bits={bits} with deepspeed_config stage 3: QLoRA cannot train with "
            "DeepSpeed ZeRO stage 3 (it partitions the packed quantised weights and the results "
            "are wrong): use deepspeed_config stage 1 or 2, or drop bits"
        )
    if fsdp and bits == 8:
        problems.append(
            "model_args.bits=8 with fsdp_config: FSDP2 cannot shard bitsandbytes 8-bit weights: "
            "use bits=4 on a GPU, deepspeed_config with stage 1 or 2, or drop bits"
        )
    elif fsdp:
        if cuda is False:
            # Measured: a sharded 4-bit model returns a different loss on every forward with
            # no update in between (the re-gathered packed weights are not the loaded ones).
            problems.append(
                "model_args.bits=4 with fsdp_config: QLoRA (bits=4) with FSDP2 does not work "
                "on the CPU: train it with deepspeed_config (stage 1 or 2: the 4-bit base stays "
                "replicated, the adapter's gradients and optimizer state are partitioned), or "
                "drop bits to shard an unquantised base with FSDP2"
            )
        if quant_storage is not None and (
            quant_storage not in ("float32", "bfloat16", "float16")
            or (compute_dtype is not None and quant_storage != compute_dtype)
        ):
            problems.append(
                f"model_args.bnb_4bit_quant_storage={quant_storage!r} with fsdp_config: FSDP2 "
                "shards the packed 4-bit weights as tensors of the compute dtype: set it to "
                f"model_args.bnb_4bit_compute_dtype ({compute_dtype or 'a float dtype, not auto'})"
            )
    return problems


def quantized_bits(model: Any) -> int | None:
    """8 or 4 when the loaded model holds bitsandbytes layers (also a pre-quantised checkpoint)."""
    kinds = {type(m).__name__ for m in model.modules()}
    return 8 if "Linear8bitLt" in kinds else 4 if "Linear4bit" in kinds else None


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _extra(field: Any) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def keyword_reference() -> str:
    """``LLMTrainer``'s keywords, generated from the schema (appended to its docstring)."""
    aliases = {target: k for k, target in TrainerConfig.flat_keywords().items() if k != target[1]}
    lines = ["Keywords (generated from the argument models):", ""]
    for name in TrainerConfig.options():
        field = TrainerConfig.model_fields[name]
        lines.append(f"``{name}=``: {field.description}")
        model = TrainerConfig.sections().get(name)
        if model is None:
            continue
        for fname, f in model.model_fields.items():
            alias = aliases.get((name, fname))
            keyword = f"``{fname}=``" + (f" (or ``{alias}=``)" if alias else "")
            if not _extra(field).get("flat"):
                keyword = f"``{name}.{fname}``"
            lines.append(f"    {keyword}: {f.description}")
    lines.append(
        "``qlora=``: True quantises the base to ``bits=4`` unless bits is given "
        "(QLoRA: needs the adapter)."
    )
    return "\n".join(lines)
