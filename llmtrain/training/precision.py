"""Which dtypes a run loads and computes in. fp16 compute always comes with a loss scaler:
without one a GPU without bf16 (T4, V100) silently stops learning."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIXED_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _bf16_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that has it, else float32 (CPUs train reliably in fp32)."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if _bf16_gpu(device) else torch.float32


@dataclass(frozen=True)
class Precision:
    """The resolved dtypes of one run on one device."""

    device_type: str = "cpu"
    weights: torch.dtype = torch.float32  # the base model is loaded in this dtype
    quant_compute: torch.dtype = torch.float32  # bitsandbytes' compute dtype (bits=4)
    autocast_dtype: torch.dtype | None = None  # None: no autocast

    @classmethod
    def resolve(
        cls, model_args: Any, device: torch.device, mixed_precision: str = "no"
    ) -> Precision:
        """``"auto"``: bf16 on a GPU that has it, else none (an explicit bf16/fp16 holds on CPU)."""
        if mixed_precision == "auto":
            mixed_precision = "bf16" if _bf16_gpu(device) else "no"
        return cls(
            device.type,
            resolve_dtype(model_args.torch_dtype, device),
            resolve_dtype(model_args.bnb_4bit_compute_dtype, device),
            MIXED_DTYPES[mixed_precision],
        )

    @property
    def scaled(self) -> bool:
        return self.autocast_dtype == torch.float16

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device_type) if self.scaled else None
