"""The chunked loss equals the plain one (full logits + cross-entropy), loss and gradients,
with LoRA on every linear layer including ``lm_head``, and for full fine-tuning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmtrain.formatting import IGNORE_INDEX
from llmtrain.objectives.loss import LossFunction, plain_loss_sum
from llmtrain.testing import tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(
        tmp_path_factory.mktemp("models") / "llama", hidden_size=32, num_layers=1, vocab_size=400
    )


LORA_TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def lora_model(tiny: Path) -> Any:
    """Shared by the tests below: they compute gradients but never change a weight."""
    return _model(tiny, LORA_TARGETS)


def _model(path: Path, lora_targets: list[str] | None) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora_targets is None:
        return model
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=lora_targets)
    model = get_peft_model(model, config)
    for name, p in model.named_parameters():  # LoRA B starts at zero: give it a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two padded rows with prompt positions ignored, and a packed-style position reset."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX  # the prompt
    labels[1, 18:] = IGNORE_INDEX  # padding
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _loss_and_grads(model: Any, loss: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    value = loss(model, batch)
    (value * 0.37).backward()  # a scaled loss, as the loop scales it
    return value.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
    }


@pytest.mark.parametrize(
    "targets", [LORA_TARGETS, None], ids=["lora_with_lm_head", "full_fine_tuning"]
)
def test_chunked_loss_and_gradients_equal_the_plain_path(
    tiny: Path, lora_model: Any, targets: Any
) -> None:
    model = lora_model if targets else _model(tiny, None)
    batch = _batch(model.config.vocab_size)
    expected, expected_grads = _loss_and_grads(model, plain_loss_sum, batch)
    # 7 target tokens per chunk: several chunks, the last one partial
    chunked = LossFunction(model, chunk_elements=7 * model.config.vocab_size)
    assert chunked.chunked and chunked.chunk == 7
    got, grads = _loss_and_grads(model, chunked, batch)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    head = [n for n in grads if "lm_head" in n]
    assert head and all(grads[n].abs().sum() > 0 for n in head)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)
    # the head's forward is the module's own again, and evaluation (no grad) agrees too
    assert "forward" not in vars(chunked.head)
    with torch.no_grad():
        torch.testing.assert_close(chunked(model, batch), expected, rtol=1e-6, atol=1e-5)


def test_a_batch_without_targets_gives_zero_loss_and_zero_gradients(lora_model: Any) -> None:
    model = lora_model
    batch = _batch(model.config.vocab_size)
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    value, grads = _loss_and_grads(model, LossFunction(model), batch)
    assert value.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_the_loss_reaches_the_head_through_a_wrapper(lora_model: Any) -> None:
    """The loss runs the model it is handed (here a plain Module that forwards, as DDP's
    does); the head it swaps is the wrapped model's own, so the swap is seen through it."""
    model = lora_model

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.module = inner

        def forward(self, **kwargs: Any) -> Any:
            return self.module(**kwargs)

    batch = _batch(model.config.vocab_size)
    expected, _ = _loss_and_grads(model, plain_loss_sum, batch)
    got, _ = _loss_and_grads(Wrapper(model), LossFunction(model), batch)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


# -- the loop: one read of the device per optimizer step ---------------------------------------
class Watched(torch.Tensor):
    """A tensor that counts how often its value is read on the host (what waits for a GPU)."""

    reads = 0
    READS = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.tolist,
            torch.Tensor.__float__,
            torch.Tensor.__int__,
            torch.Tensor.__bool__,
            torch.Tensor.__index__,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
        }
    )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in cls.READS:
            Watched.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_loop_reads_the_device_once_per_step_and_moves_one_micro_batch_at_a_time(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real fit with a token budget (groups of varying length): every value the step
    computes on the device (losses, gradient norm) is watched, and so are the collectives."""
    from conftest import fill

    import llmtrain as lt
    from llmtrain.objectives.loss import LossFunction as Loss
    from llmtrain.training import run as run_module
    from llmtrain.training.callbacks import Callback
    from llmtrain.training.strategies.single import SingleProcess

    events: list[str] = []
    compute, step, to_device = Loss.__call__, SingleProcess.optimizer_step, run_module.to_device

    def watched_loss(self: Any, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        events.append("loss")
        return compute(self, model, batch).as_subclass(Watched)

    def watched_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.as_tensor(step(self, *args, **kwargs)).as_subclass(Watched)

    def moved(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        events.append("to_device")
        return to_device(batch, device)

    collectives = {"n": 0}
    for name in ("all_reduce", "all_gather", "broadcast_object", "gather_object"):
        original = getattr(SingleProcess, name)

        def counted(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            collectives["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(SingleProcess, name, counted)
    monkeypatch.setattr(Loss, "__call__", watched_loss)
    monkeypatch.setattr(SingleProcess, "optimizer_step", watched_step)
    monkeypatch.setattr(run_module, "to_device", moved)

    per_step: list[tuple[int, int, int]] = []

    class Count(Callback):
        start = (0, 0, 0)  # what setup did before the first step (the world's report)

        def on_train_begin(self, run: Any) -> None:
            self.start = (Watched.reads, collectives["n"], events.count("loss"))

        def on_step(self, run: Any, keys: list[str]) -> None:
            per_step.append((Watched.reads, collectives["n"], events.count("loss")))

    uri = f"sqlite:///{tmp_path / 'data.db'}"
    words = ["red", "blue sky", "a green field of grass", "black", "white snow on a hill"]
    fill(
        uri,
        "docs",
        [{"id": i, "q": f"Say {i}?" * (1 + i % 3), "a": words[i % 5]} for i in range(24)],
    )
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    trainer = lt.LLMTrainer(
        "syncs",
        model=str(tiny),
        prompt_template="Q: {X}\nA: {Y}",
        max_steps=3,
        batch_size=4,
        gradient_accumulation_steps=2,
        max_length=48,
        packing=True,
        max_tokens_per_batch=48,
        lora_r=4,
        logging_steps=1,
        progress_bar=False,
    )
    Watched.reads = 0
    count = Count()
    trainer.fit(X="q", Y="a", db=db, select=lt.Table("docs"), callbacks=[count])

    assert len(per_step) == 3
    starts = [count.start, *per_step[:-1]]
    deltas = [
        tuple(b - a for a, b in zip(s, e, strict=True))
        for s, e in zip(starts, per_step, strict=True)
    ]
    assert [(reads, calls) for reads, calls, _ in deltas] == [(1, 1)] * 3, deltas
    micro = [n for _, _, n in deltas]
    assert max(micro) > 1  # accumulation groups of several micro-batches (varying with the budget)
    # each micro-batch reaches the device just before its own forward, never the group at once
    train_events = events[: 2 * sum(micro)]
    assert train_events == ["to_device", "loss"] * sum(micro)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"bits": 4}, "model_args.bits"),
        ({"fsdp_config": {}}, "fsdp_config"),
        ({"deepspeed_config": {"stage": 2}}, "deepspeed_config"),
    ],
)
def test_torch_compile_is_refused_where_it_cannot_work(options: dict[str, Any], named: str) -> None:
    import llmtrain as lt
    from llmtrain.errors import ConfigError

    kwargs = {"model": "m", "prompt_template": "{X} {Y}", "torch_compile": True, **options}
    with pytest.raises(ConfigError, match=rf"training_args.torch_compile=True with {named}"):
        lt.LLMTrainer("compiled", **kwargs)
    assert not lt.LLMTrainer(
        "plain", **{**kwargs, "torch_compile": False}
    ).config.training_args.torch_compile
    off = lt.LLMTrainer("c", model="m", prompt_template="{X} {Y}").to_dict()["training_args"]
    assert off["torch_compile"] is False
