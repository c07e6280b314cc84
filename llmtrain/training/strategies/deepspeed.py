"""DeepSpeed ZeRO (``deepspeed.initialize``). The boundary is set per micro-batch, so a short
last group still steps; ``backward`` does not divide by the accumulation (the loop's loss is
normalised); the LR scheduler is the loop's own, on the torch optimizer ZeRO keeps."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.config.args import (
    DeepspeedConfig,
    TrainingArguments,
    quantization_problems,
    quantized_bits,
)
from llmtrain.console import restored_env
from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.placement import Placement
from llmtrain.training.precision import Precision
from llmtrain.training.strategies.base import (
    MakeOptimizer,
    ProcessGroupStrategy,
    init_single_process_group,
    trainable_parameters,
)

_TAG = "state"  # one checkpoint per folder: the Checkpointer makes a folder per save
_OWN_SECTIONS = ("optimizer", "scheduler")


def build_config(
    config: DeepspeedConfig,
    args: TrainingArguments,
    *,
    world_size: int,
    trainable_dtype: torch.dtype,
    on_gpu: bool,
    fp16_compute: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config (``raw``, or the stage's), its "auto" values filled from ``args``."""
    if config.raw is None:
        zero: dict[str, Any] = {"stage": config.stage}
        if config.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
        if config.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
        cfg: dict[str, Any] = {"zero_optimization": zero}
    elif isinstance(config.raw, dict):
        cfg = copy.deepcopy(config.raw)
    else:
        try:
            cfg = json.loads(Path(config.raw).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"deepspeed_config.raw: cannot read a JSON config from {config.raw!r}: {exc}"
            ) from None
    if present := [s for s in _OWN_SECTIONS if s in cfg]:  # never in the config built above
        raise ConfigError(
            f"deepspeed_config.raw has {present}: the trainer builds the "
            "optimizer and LR scheduler from training_args; remove them"
        )

    def fill(key: str, value: Any) -> None:
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value

    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", micro)
    fill("gradient_accumulation_steps", accum)
    fill("train_batch_size", micro * accum * world_size)
    fill("gradient_clipping", args.max_grad_norm or 0.0)
    # fp32 master weights when the trained weights are half precision, and fp16 compute
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = cfg.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = trainable_dtype == dtype or (key == "fp16" and fp16_compute)
    cfg.setdefault("zero_allow_untested_optimizer", True)  # the optimizer is training_args'
    if cfg.get("zero_optimization", {}).get("offload_optimizer"):
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)  # the torch optimizer on CPU
    cfg.setdefault("steps_per_print", 2**31 - 1)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def check_quantization(model: torch.nn.Module, stage: int) -> None:
    """The stage a raw config file sets, against the loaded model's quantisation."""
    if problems := quantization_problems(quantized_bits(model), deepspeed_stage=stage):
        raise ConfigError("; ".join(problems))


@contextlib.contextmanager
def _weights_only_loads(engine: Any) -> Iterator[None]:
    """The engine loads with ``weights_only=True`` (DeepSpeed's own load unpickles anything)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    checkpoint_engine = engine.checkpoint_engine
    allowed = [LossScaler, ZeroStageEnum, fragment_address]

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    checkpoint_engine.load = load
    try:
        yield
    finally:
        del checkpoint_engine.load  # the class's method again


class DeepSpeed(ProcessGroupStrategy):
    name = "deepspeed"

    def __init__(
        self, config: DeepspeedConfig, training_args: TrainingArguments, placement: Placement | None
    ) -> None:
        super().__init__(placement)
        self.config, self.training_args, self.stage = config, training_args, 0
        self._environment = contextlib.ExitStack()

    def launch(self) -> None:
        import deepspeed
        import deepspeed.ops as ops
        from deepspeed.accelerator import get_accelerator

        if self.device.type != "cuda":
            # a shared-memory op DeepSpeed JIT-compiles (minutes) for CPU inference only
            builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
            if builder is not None:
                ops.__compatible_ops__[builder.NAME] = False
        if not self.placement.launched:
            # DeepSpeed reads LOCAL_RANK all run long: set for it alone, until teardown
            self._environment.enter_context(restored_env("LOCAL_RANK"))
            os.environ["LOCAL_RANK"] = str(self.placement.local_rank)
        init_single_process_group(self.placement)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        self.placement = self.placement.joined(dist.get_rank(), dist.get_world_size())

    def teardown(self) -> None:
        import deepspeed.comm.comm as ds_comm

        if ds_comm.is_initialized():
            # DeepSpeed's own also drops its cached groups (stale in this process's next run)
            ds_comm.destroy_process_group()
        super().teardown()  # a group DeepSpeed did not join
        self._environment.close()

    def setup(
        self, model: Any, make_optimizer: MakeOptimizer, precision: Precision
    ) -> tuple[Any, Any]:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        params = trainable_parameters(model)
        if not params:
            raise ConfigError("DeepSpeed: the model has no trainable parameter")
        cfg = build_config(
            self.config,
            self.training_args,
            world_size=self.world_size,
            trainable_dtype=params[0].dtype,
            on_gpu=self.device.type == "cuda",
            fp16_compute=precision.scaled,
        )
        if cfg["fp16"].get("enabled") is True and not get_accelerator().is_fp16_supported():
            raise ConfigError(
                f"DeepSpeed has no fp16 mode on this device ({self.device.type}): "
                "set training_args.mixed_precision to 'bf16' or 'no' (and no "
                "fp16 section in deepspeed_config.raw)"
            )
        self.stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
        check_quantization(model, self.stage)
        optimizer = make_optimizer(params)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        # the torch optimizer: the loop's scheduler sets the lr ZeRO applies
        return engine, optimizer

    @contextlib.contextmanager
    def accumulate(self, model: Any, *, sync: bool) -> Iterator[None]:
        model.set_gradient_accumulation_boundary(sync)
        yield

    def backward(self, model: Any, loss: torch.Tensor) -> None:
        model.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, model: Any, optimizer: Any, max_grad_norm: float | None) -> float:
        model.step()  # clips to the config's gradient_clipping (= max_grad_norm)
        norm = model.get_global_grad_norm()
        return math.nan if norm is None else float(norm)

    def unwrap(self, model: Any) -> Any:
        return model.module

    def _gathered(self, model: Any, *, modifier_rank: int | None) -> Any:
        """ZeRO-3 holds each rank's partition only: gather the trainable weights (all ranks)."""
        if self.stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        params = trainable_parameters(self.unwrap(model))
        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)

    def trainable_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        with self._gathered(model, modifier_rank=None):
            return super().trainable_state_dict(model) if self.is_main else {}

    def load_trainable_state_dict(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        with self._gathered(model, modifier_rank=0):
            if self.stage != 3 or self.is_main:
                super().load_trainable_state_dict(model, state)

    def save_optimizer(self, model: Any, optimizer: Any, folder: Path) -> None:
        """Collective: each rank writes its ZeRO partitions into the (shared, local) folder."""
        model.save_checkpoint(str(folder / "deepspeed"), tag=_TAG, exclude_frozen_parameters=True)

    def load_optimizer(self, model: Any, optimizer: Any, folder: Path) -> None:
        with _weights_only_loads(model):
            path, _ = model.load_checkpoint(
                str(folder / "deepspeed"),
                tag=_TAG,
                load_module_strict=False,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        if path is None:
            raise CheckpointError(f"DeepSpeed found no engine checkpoint under {folder}")
