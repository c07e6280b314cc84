"""TRL's side of the side-by-side benchmarks (`bench_vs_trl.py`, `gpu_mfu.py`): one SFTConfig
and LoraConfig, so both compare llmtrain with the same TRL recipe: linear schedule, no warmup,
clip 1.0, AdamW, completion-only loss, no checkpoints, no reporting."""

from __future__ import annotations

from typing import Any


def trl_configs(
    output_dir: str,
    *,
    steps: int,
    batch_size: int,
    max_length: int,
    packing: bool,
    lr: float,
    lora_r: int,
    lora_alpha: int,
    targets: list[str],
    cuda: bool = False,
) -> tuple[Any, Any]:
    """(SFTConfig, LoraConfig) for TRL's SFTTrainer; bf16 on CUDA, fp32 on the CPU."""
    from trl import SFTConfig

    config = SFTConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_length=max_length,
        packing=packing,
        gradient_checkpointing=False,
        bf16=cuda,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        completion_only_loss=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return config, trl_lora(lora_r, lora_alpha, targets)


def trl_lora(r: int, alpha: int, targets: list[str]) -> Any:
    """The LoraConfig every TRL contender trains: no dropout, a causal LM."""
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )
