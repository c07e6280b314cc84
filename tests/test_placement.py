"""Placement, precision and strategies as units: one place decides rank, world size, device
and dtypes; fp16 never trains without a loss scaler; strategies use the placement they are
given and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from llmtrain.config.args import ModelArguments
from llmtrain.errors import ConfigError, DistributedError
from llmtrain.placement import Placement
from llmtrain.training.precision import Precision
from llmtrain.training.strategies import make_strategy, strategy_for

CPU = torch.device("cpu")


# -- placement ------------------------------------------------------------------------------
def test_placement_comes_from_the_launcher_environment_once() -> None:
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert Placement.from_environment(torchrun) == Placement(1, 2, 1, launched=True)
    assert Placement.from_environment({}) == Placement(0, 1, 0, launched=False)
    one = Placement.from_environment({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert one.launched and not one.in_launched_job  # torchrun with one process
    assert Placement(1, 2, 1, launched=True).in_launched_job
    with pytest.raises(ConfigError, match="rank 2 / world_size 2"):
        Placement.from_environment({"RANK": "2", "WORLD_SIZE": "2"})


def test_joining_the_group_must_agree_with_the_launcher() -> None:
    launched = Placement(1, 2, 1, launched=True)
    assert launched.joined(1, 2) == launched
    with pytest.raises(DistributedError, match="rank 0 of 2, its launcher at rank 1 of 2"):
        launched.joined(0, 2)
    # unlaunched (a notebook's one-process group): the group's ranks are taken as they are
    assert Placement().joined(0, 1) == Placement()


def test_strategies_use_the_placement_they_are_given_not_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    given = Placement(1, 2, 0, launched=True)
    ddp = make_strategy("ddp", given)
    assert (ddp.name, ddp.rank, ddp.world_size, ddp.is_main) == ("ddp", 1, 2, False)
    assert make_strategy("fsdp", given).placement == given
    single = make_strategy("single", given)  # one process, whatever it was handed
    assert (single.rank, single.world_size, single.device) == (0, 1, CPU)


def test_strategy_for_picks_ddp_only_for_several_processes() -> None:
    import llmtrain as lt

    config = lt.LLMTrainer("t", model="m", prompt_template="{X} {Y}").config
    assert strategy_for(config, Placement()).name == "single"
    assert strategy_for(config, Placement(0, 2, 0, launched=True)).name == "ddp"
    fsdp = lt.LLMTrainer("t", model="m", prompt_template="{X} {Y}", fsdp_config={}).config
    assert strategy_for(fsdp, Placement()).name == "fsdp"


def test_only_placement_reads_the_rank_variables() -> None:
    """No other module of the package reads (or writes as a signal) RANK / WORLD_SIZE.
    (LOCAL_RANK is set for DeepSpeed alone, inside its strategy: see deepspeed.py.)"""
    import llmtrain

    root = Path(llmtrain.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if path.name != "placement.py"
        and any(f'"{var}"' in path.read_text() for var in ("RANK", "WORLD_SIZE"))
    ]
    assert offenders == []


def test_the_launch_modules_import_alone_and_without_a_cycle() -> None:
    """training.launch never imports the launchers (they call into it)."""
    code = (
        "import sys, llmtrain.running.local; "
        "print(any(m.startswith('llmtrain.running.launchers') for m in sys.modules))"
    )
    alone = [  # each in a fresh interpreter, all at once
        subprocess.Popen([sys.executable, "-c", f"import {module}"])
        for module in (
            "llmtrain.running.launchers",
            "llmtrain.running.launchers.worker",
            "llmtrain.training.strategies.deepspeed",
            "llmtrain.running.local",
        )
    ]
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert [proc.wait(timeout=120) for proc in alone] == [0] * 4
    assert out.strip() == "False"


# -- precision --------------------------------------------------------------------------------
def _args(**kwargs: Any) -> ModelArguments:
    return ModelArguments(model_name_or_path="m", **kwargs)


def test_auto_is_resolved_once_into_one_precision() -> None:
    auto = Precision.resolve(_args(), CPU, "auto")  # a CPU: full precision, no autocast
    assert (auto.weights, auto.quant_compute, auto.autocast_dtype) == (torch.float32,) * 2 + (None,)
    assert not auto.scaled and auto.grad_scaler() is None
    fp16 = Precision.resolve(_args(torch_dtype="bfloat16"), CPU, "fp16")
    assert (fp16.weights, fp16.autocast_dtype, fp16.scaled) == (torch.bfloat16, torch.float16, True)
    assert isinstance(fp16.grad_scaler(), torch.amp.GradScaler)
    bf16 = Precision.resolve(_args(), CPU, "bf16")
    assert bf16.autocast_dtype == torch.bfloat16 and bf16.grad_scaler() is None
    with bf16.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16


def _step_on_a_tiny_loss(precision: Precision, *, scaler: bool) -> torch.Tensor:
    """One strategy step on a loss whose fp16 gradient (1e-8) flushes to zero unscaled."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    before = model.weight.detach().clone()
    strategy = make_strategy("single", Placement())
    model, optimizer = strategy.setup(model, lambda p: torch.optim.SGD(p, lr=1e4), precision)
    if not scaler:
        strategy.scaler = None  # what fp16 did before: autocast alone
    with precision.autocast():
        out = model(torch.randn(4, 8))
    assert out.dtype == torch.float16
    strategy.backward(model, out.float().sum() * 1e-8)
    strategy.optimizer_step(model, optimizer, max_grad_norm=None)
    return model.weight.detach() - before


def test_fp16_gradients_that_underflow_unscaled_still_train_with_the_scaler() -> None:
    fp16 = Precision.resolve(_args(), CPU, "fp16")
    assert torch.count_nonzero(_step_on_a_tiny_loss(fp16, scaler=False)) == 0  # the old bug
    update = _step_on_a_tiny_loss(fp16, scaler=True)
    assert torch.count_nonzero(update) == update.numel()
    # the unscaled update is the true one: lr x (1e-8 x the column sums of the inputs)
    assert 1e-6 < update.abs().max() < 1e-2


# -- callbacks ----------------------------------------------------------------------------------
def test_the_key_trace_writes_one_synced_line_per_step(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from hooks import KeyTrace

    trace = KeyTrace(tmp_path / "keys")
    run = SimpleNamespace(step=1, strategy=make_strategy("single", Placement()))
    trace.on_step(run, ["int:1", "int:2"])
    run.step = 2
    trace.on_step(run, ["int:3"])
    assert trace.keys == ["int:1", "int:2", "int:3"]
    lines = (tmp_path / "keys.rank0").read_text().splitlines()
    assert lines == ['{"step": 1, "keys": ["int:1", "int:2"]}', '{"step": 2, "keys": ["int:3"]}']
