"""The preference losses equal TRL 1.16's own computation (its trainers' loss code, called on
trainers made with ``object.__new__`` and only the attributes that code reads, the model's
forward replaced by a stand-in returning fixed per-token log-probs); per-sequence log-probs
equal the full-logits computation, values and gradients, and packing leaks nothing."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from llmtrain.formatting import IGNORE_INDEX, Example, PackedCollator
from llmtrain.objectives.dpo import dpo_loss
from llmtrain.objectives.kto import kto_loss
from llmtrain.objectives.loss import plain_sequence_logprobs, sequence_logprobs
from llmtrain.objectives.orpo import orpo_loss
from llmtrain.objectives.simpo import simpo_loss
from llmtrain.testing import tiny_model

PAIRS, WIDTH = 6, 12
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
LOGPS = ("logps/chosen", "logps/rejected")


def _close(got: Any, expected: Any) -> None:
    torch.testing.assert_close(
        torch.as_tensor(got).float(), torch.as_tensor(expected).float(), rtol=1e-5, atol=1e-5
    )


# -- TRL's code, on stand-ins for what it reads besides the log-probs ---------------------------
class _Accelerator:
    """What the loss code uses of accelerate's Accelerator on one process."""

    device = torch.device("cpu")

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather


class _Model:
    """Returns fixed per-token log-probs for each ``input_ids`` it is handed (what TRL's
    fused head returns: zero off the completion), and neutral entropy/logit statistics."""

    training = True

    def __init__(self, *answers: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.answers = answers

    def __call__(self, input_ids: torch.Tensor, **_: Any) -> Any:
        logps = next(lp for ids, lp in self.answers if torch.equal(ids, input_ids))
        zeros = torch.zeros_like(logps.detach())
        return SimpleNamespace(
            log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
        )


def _trainer(cls: type, **attributes: Any) -> Any:
    trainer = object.__new__(cls)
    common = {
        "accelerator": _Accelerator(),
        "aux_loss_enabled": False,
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
        "_total_train_tokens": 0,
        "_tp_size": 1,
    }
    for name, value in {**common, **attributes}.items():
        setattr(trainer, name, value)
    return trainer


def _completions(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, completion_mask, per-token log-probs [rows, WIDTH - 1] zero off it): a
    prompt of 2-4 tokens, a completion of 1-6, then padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, WIDTH, dtype=torch.long)
    for r in range(rows):
        start = int(torch.randint(2, 5, (1,), generator=g))
        mask[r, start : start + int(torch.randint(1, 7, (1,), generator=g))] = 1
    ids = torch.randint(4, 100, (rows, WIDTH), generator=g)
    logps = -3 * torch.rand(rows, WIDTH - 1, generator=g, dtype=torch.float64).float()
    return ids, mask, (logps * mask[:, 1:]).requires_grad_()


def _trl_dpo(loss_type: str, beta: float, smoothing: float) -> tuple[Any, dict[str, float], Any]:
    """TRL's DPOTrainer._compute_loss on precomputed reference log-probs. Attributes it reads:
    beta, loss_types, loss_weights, ld_alpha, f_divergence_type, label_smoothing,
    use_weighting, precompute_ref_logps, aux_loss_enabled, accelerator, model.training,
    _metrics, _total_train_tokens, _tp_size."""
    from trl.trainer.dpo_trainer import DPOTrainer

    ids, mask, per_token = _completions(2 * PAIRS, seed=1)
    ref = -3 * torch.rand(2 * PAIRS, generator=torch.Generator().manual_seed(2)) * mask.sum(1)
    model = _Model((ids, per_token))
    trainer = _trainer(
        DPOTrainer,
        beta=beta,
        loss_types=[loss_type],
        loss_weights=[1.0],
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        label_smoothing=smoothing,
        use_weighting=False,
        precompute_ref_logps=True,
        model=model,
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask,
        "ref_chosen_logps": ref[:PAIRS],
        "ref_rejected_logps": ref[PAIRS:],
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss, metrics, (per_token, mask[:, 1:].sum(1), ref)


@pytest.mark.parametrize(
    ("loss_type", "smoothing"), [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.15)]
)
def test_dpo_equals_trl(loss_type: str, smoothing: float) -> None:
    beta = 0.3
    expected, trl_metrics, (per_token, tokens, ref) = _trl_dpo(loss_type, beta, smoothing)
    (expected_grad,) = torch.autograd.grad(expected, per_token)
    logps = per_token.sum(1)
    loss, metrics = dpo_loss(
        logps[:PAIRS],
        logps[PAIRS:],
        ref[:PAIRS],
        ref[PAIRS:],
        beta=beta,
        loss_type=loss_type,
        label_smoothing=smoothing,
        chosen_tokens=tokens[:PAIRS],
        rejected_tokens=tokens[PAIRS:],
    )
    _close(loss, expected)
    _close(torch.autograd.grad(loss, per_token)[0], expected_grad)
    for name in METRICS + LOGPS:
        _close(metrics[name], trl_metrics[name])


def test_conservative_dpo_is_trls_smoothed_sigmoid_on_the_log_ratios() -> None:
    """TRL 1.16's DPO sigmoid has no label smoothing; its smoothed sigmoid (cDPO's form) is
    CPOTrainer.cpo_loss (reads beta, label_smoothing, loss_type, alpha, accelerator), which
    is DPO's when handed the policy/reference log-ratios (``robust``: DPOTrainer's own)."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    g = torch.Generator().manual_seed(3)
    chosen, rejected, ref_c, ref_r = (-20 * torch.rand(PAIRS, generator=g) for _ in range(4))
    cpo = _trainer(CPOTrainer, beta=0.2, label_smoothing=0.15, loss_type="sigmoid", alpha=0.0)
    expected, _, _ = cpo.cpo_loss(chosen - ref_c, rejected - ref_r)
    loss, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.2, label_smoothing=0.15)
    _close(loss, expected.mean())


@pytest.mark.parametrize("kl_sign", [1.0, -1.0], ids=["kl_positive", "kl_clamped"])
def test_kto_equals_trl(kl_sign: float) -> None:
    """KTOTrainer._compute_loss with the KL term; attributes it reads: beta, loss_type,
    desirable_weight, undesirable_weight, calculate_KL, precompute_ref_logps,
    aux_loss_enabled, accelerator, model.training, _metrics, _total_train_tokens, _tp_size."""
    from trl.trainer.kto_trainer import KTOTrainer

    n = 8
    ids, mask, per_token = _completions(n, seed=4)
    kl_ids, kl_mask, kl_per_token = _completions(n, seed=5)
    g = torch.Generator().manual_seed(6)
    ref = per_token.detach().sum(1) + torch.randn(n, generator=g)
    ref_kl = kl_per_token.detach().sum(1) - kl_sign * (0.5 + torch.rand(n, generator=g))
    desirable = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    model = _Model((ids, per_token), (kl_ids, kl_per_token))
    options = {"beta": 0.2, "desirable_weight": 1.3, "undesirable_weight": 0.7}
    trainer = _trainer(
        KTOTrainer,
        loss_type="kto",
        calculate_KL=True,
        precompute_ref_logps=True,
        model=model,
        **options,
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask,
        "label": desirable,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones_like(ids),
        "KL_completion_mask": kl_mask,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    expected = trainer._compute_loss(model, inputs, return_outputs=False)
    (expected_grad,) = torch.autograd.grad(expected, per_token)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    with torch.no_grad():
        kl_logps = kl_per_token.sum(1)
    loss, metrics = kto_loss(per_token.sum(1), ref, desirable, kl_logps, ref_kl, **options)
    _close(loss, expected)
    _close(torch.autograd.grad(loss, per_token)[0], expected_grad)
    assert (metrics["kl"] > 0) == (kl_sign > 0)
    names = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", *LOGPS)
    for name in names:
        _close(metrics[name], trl_metrics[name])


def _forward_stub(chosen: torch.Tensor, rejected: torch.Tensor, nll: torch.Tensor) -> Any:
    """Stands in for concatenated_forward: (chosen, rejected log-probs, logits x2, nll)."""
    logits = torch.zeros(PAIRS, WIDTH, 3)
    return lambda model, batch: (chosen, rejected, logits, logits, nll)


def _average_logps(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    chosen, rejected = (-3 * torch.rand(PAIRS, generator=g) - 1e-3 for _ in range(2))
    return chosen.requires_grad_(), rejected.requires_grad_(), torch.tensor(2.5).requires_grad_()


def _check(
    loss: Any,
    metrics: dict[str, Any],
    expected: Any,
    trl: dict[str, float],
    leaves: tuple[torch.Tensor, ...],
) -> None:
    _close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, leaves)):
        _close(got, want)
    assert set(metrics) <= set(trl)
    for name, value in metrics.items():
        _close(value, trl[name])


def test_orpo_equals_trl() -> None:
    """ORPOTrainer.get_batch_loss_metrics (its odds_ratio_loss included) with its forward
    stubbed; attributes it reads: beta, accelerator, aux_loss_enabled."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    chosen, rejected, nll = _average_logps(7)
    trainer = _trainer(ORPOTrainer, beta=0.25)
    trainer.concatenated_forward = _forward_stub(chosen, rejected, nll)
    expected, trl_metrics = trainer.get_batch_loss_metrics(None, {})
    loss, metrics = orpo_loss(chosen, rejected, nll, beta=0.25)
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen", *METRICS} <= set(metrics)
    _check(loss, metrics, expected, trl_metrics, (chosen, rejected, nll))


@pytest.mark.parametrize(("cpo_alpha", "smoothing"), [(0.0, 0.0), (1.0, 0.1)])
def test_simpo_equals_trl_cpo(cpo_alpha: float, smoothing: float) -> None:
    """CPOTrainer.get_batch_loss_metrics (cpo_loss, loss_type="simpo") with its forward
    stubbed; attributes: beta, simpo_gamma, label_smoothing, loss_type, alpha, cpo_alpha,
    accelerator, aux_loss_enabled."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    chosen, rejected, nll = _average_logps(8)
    options = {"beta": 2.0, "label_smoothing": smoothing, "cpo_alpha": cpo_alpha}
    trainer = _trainer(CPOTrainer, loss_type="simpo", simpo_gamma=1.2, alpha=0.0, **options)
    trainer.concatenated_forward = _forward_stub(chosen, rejected, nll)
    expected, trl_metrics = trainer.get_batch_loss_metrics(None, {})
    loss, metrics = simpo_loss(chosen, rejected, gamma=1.2, chosen_nll=nll, **options)
    _check(loss, metrics, expected, trl_metrics, (chosen, rejected, nll))


# -- per-sequence log-probs on a real tiny model -------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(
        tmp_path_factory.mktemp("models") / "llama", hidden_size=32, num_layers=1, vocab_size=400
    )


def _lora(path: Path, *, fresh: bool = False) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    targets = ["q_proj", "v_proj", "down_proj", "lm_head"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, p in model.named_parameters():  # LoRA B starts at zero: give it a gradient path
        if "lora_B" in name and not fresh:
            torch.nn.init.normal_(p, std=0.05)
    return model


LENGTHS, PROMPTS = (9, 5, 12), (3, 2, 4)


def _sequences(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three (input_ids, labels) of different lengths, their prompts ignored."""
    g = torch.Generator().manual_seed(9)
    out = []
    for length, prompt in zip(LENGTHS, PROMPTS):
        ids = torch.randint(4, vocab, (length,), generator=g)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _packed(seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Two sequences a row through the library's collator: each token's sequence, positions
    restarting per sequence, the shorter row padded."""
    examples = [Example(i.tolist(), lab.tolist()) for i, lab in seqs]
    rows = [examples[i : i + 2] for i in range(0, len(examples), 2)]
    return PackedCollator(64, 0).collate_rows(rows, sequences=examples)


def _padded(seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(len(s[0]) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for r, (i, lab) in enumerate(seqs):
        ids[r, : len(i)], labels[r, : len(i)], mask[r, : len(i)] = i, lab, 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _full_logits_reference(model: Any, batch: dict[str, torch.Tensor], n: int) -> Any:
    """The plain computation: every position's logits, log-softmax, the targets summed."""
    inputs = {
        k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")
    }
    logps = model(**inputs, use_cache=False).logits[:, :-1].float().log_softmax(-1)
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    picked = logps.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    index = batch.get("sequence_index")
    if index is None:
        index = torch.arange(labels.size(0))[:, None].expand_as(batch["labels"])
    index = index[:, 1:][keep]
    return torch.zeros(n).index_add(0, index, picked[keep]), torch.bincount(index, minlength=n)


def _value_and_grads(model: Any, compute: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logps, _ = compute()
    weights = torch.tensor([0.7, -1.3, 0.4])  # each sequence's own share of the gradient
    (logps * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), grads


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_sequence_logprobs_equal_the_full_logits_values_and_gradients(
    tiny: Path, layout: str
) -> None:
    model = _lora(tiny)
    vocab = model.config.vocab_size
    batch = (_packed if layout == "packed" else _padded)(_sequences(vocab))
    expected, expected_grads = _value_and_grads(
        model, lambda: _full_logits_reference(model, batch, 3)
    )
    head = model.get_output_embeddings()
    rows: list[int] = []  # what the head's weight projects, call by call
    hook = head.base_layer.register_forward_hook(lambda m, i, o: rows.append(o.shape[:-1].numel()))
    # 4 targets per chunk: several chunks, the last one partial
    got, grads = _value_and_grads(
        model, lambda: sequence_logprobs(model, batch, num_sequences=3, chunk_elements=4 * vocab)
    )
    hook.remove()
    counts = torch.tensor([n - p for n, p in zip(LENGTHS, PROMPTS)])
    # only targets reach the head, a chunk at a time: in the forward, then again in backward
    assert max(rows) == 4 and sum(rows) == 2 * int(counts.sum())
    _close(got, expected)
    assert grads.keys() == expected_grads.keys()
    assert all(grads[n].abs().sum() > 0 for n in grads if "lm_head" in n)
    for name, grad in expected_grads.items():
        _close(grads[name], grad)
    assert "forward" not in vars(head)  # the head is its own again
    with torch.no_grad():  # the reference's path: no checkpointing, same values
        for compute in (sequence_logprobs, plain_sequence_logprobs):
            logps, tokens = compute(model, batch)
            _close(logps, expected)
            assert tokens.tolist() == counts.tolist()


def test_packing_leaks_no_attention_between_sequences(tiny: Path) -> None:
    model = _lora(tiny)
    seqs = _sequences(model.config.vocab_size)
    with torch.no_grad():
        alone = torch.cat(
            [
                sequence_logprobs(model, {"input_ids": i[None], "labels": lab[None]})[0]
                for i, lab in seqs
            ]
        )
        packed = _packed(seqs)
        _close(sequence_logprobs(model, packed)[0], alone)
        # the check can fail: positions running on (one sequence) let the later ones look back
        packed["position_ids"] = torch.arange(packed["input_ids"].size(1))[None]
        leaked = sequence_logprobs(model, packed, num_sequences=3)[0]
    assert not torch.allclose(leaked[1:], alone[1:], atol=1e-3)


def test_at_a_fresh_adapter_dpo_is_ln2_with_zero_margin(tiny: Path) -> None:
    model = _lora(tiny, fresh=True)
    seqs = _sequences(model.config.vocab_size)
    batch = _packed([seqs[0], seqs[1], seqs[1], seqs[2]])  # pairs (0, 1) and (2, 3)
    logps, _ = sequence_logprobs(model, batch, num_sequences=4)
    with torch.no_grad(), model.disable_adapter():
        ref, _ = sequence_logprobs(model, batch, num_sequences=4)
    loss, metrics = dpo_loss(logps[[0, 2]], logps[[1, 3]], ref[[0, 2]], ref[[1, 3]])
    assert loss.requires_grad
    assert math.isclose(loss.item(), math.log(2), abs_tol=1e-6)
    assert metrics["rewards/margins"].item() == 0.0
    assert metrics["rewards/accuracies"].item() == 0.0
