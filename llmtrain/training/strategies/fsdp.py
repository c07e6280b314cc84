"""FSDP2: parameters sharded per tensor (``fully_shard``, DTensor), one unit per decoder layer
and the root for the rest; frozen base shards simply get no gradient and no optimizer state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, distribute_tensor

from llmtrain.config.args import FSDPConfig, dtype_name, quantization_problems, quantized_bits
from llmtrain.errors import ConfigError
from llmtrain.placement import Placement
from llmtrain.training.modeling import decoder_layers
from llmtrain.training.precision import MIXED_DTYPES, Precision
from llmtrain.training.strategies.base import MakeOptimizer, ProcessGroupStrategy


def check_quantization(model: torch.nn.Module, device: torch.device) -> None:
    """The quantisation rules only the loaded model decides (the trainer checked the config's)."""
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if problems := quantization_problems(
        quantized_bits(model),
        fsdp=True,
        cuda=device.type == "cuda",
        quant_storage=dtype_name(getattr(quant, "bnb_4bit_quant_storage", None)),
        compute_dtype=dtype_name(getattr(quant, "bnb_4bit_compute_dtype", None)),
    ):
        raise ConfigError("; ".join(problems))


class FSDP2(ProcessGroupStrategy):
    name = "fsdp"

    def __init__(
        self, config: FSDPConfig | None = None, placement: Placement | None = None
    ) -> None:
        super().__init__(placement)
        self.config = config or FSDPConfig()

    def setup(
        self, model: Any, make_optimizer: MakeOptimizer, precision: Precision
    ) -> tuple[Any, Any]:
        check_quantization(model, self.device)
        cfg = self.config
        options: dict[str, Any] = {
            "mesh": init_device_mesh(self.device.type, (self.world_size,)),
            "reshard_after_forward": cfg.reshard_after_forward,
        }
        if cfg.mixed_precision != "no":
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=MIXED_DTYPES[cfg.mixed_precision], reduce_dtype=torch.float32
            )
        if cfg.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        # every decoder layer, then the root; before the optimizer: its parameters are DTensors
        for module in [*decoder_layers(model, "fsdp_config"), model]:
            fully_shard(module, **options)
        model, optimizer = super().setup(model, make_optimizer, precision)
        if cfg.mixed_precision == "fp16" or precision.scaled:
            # fp16 compute (autocast or the shards' param_dtype): scale, per shard
            self.scaler = ShardedGradScaler(device=self.device.type)
        return model, optimizer

    @contextlib.contextmanager
    def accumulate(self, model: Any, *, sync: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(sync)  # off: keep unsharded grads, reduce later
        yield

    def trainable_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """Collective: every rank gathers each tensor, in one order; rank 0 keeps them."""
        state, full = self._named_state(model), {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, DTensor):
                local = value.to_local()
                if local.device.type != self.device.type:  # offloaded shard: gather on device
                    value = DTensor.from_local(
                        local.to(self.device),
                        value.device_mesh,
                        value.placements,
                        shape=value.shape,
                        stride=value.stride(),
                    )
                value = value.full_tensor()
            if self.is_main:
                full[key] = value.detach().cpu().clone()
        return full

    def load_trainable_state_dict(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        """Every rank holds the full tensors: each keeps its own shard (no communication)."""
        current = self._named_state(model)
        sharded: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if isinstance(ref := current.get(key), DTensor):
                local = value.to(device=ref.to_local().device, dtype=ref.dtype)
                value = distribute_tensor(
                    local, ref.device_mesh, ref.placements, src_data_rank=None
                )
            sharded[key] = value
        super().load_trainable_state_dict(model, sharded)

    # the full (unsharded) optimizer state, gathered by every rank, written by rank 0
    def _optimizer_state(self, model: Any, optimizer: Any) -> dict[str, Any]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=options)

    def _load_optimizer_state(self, model: Any, optimizer: Any, state: dict[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)
