"""Preference rewards are TRL 1.16's, end to end: the same rows, tiny model and reference give the
same per-answer log-probs, rewards and DPO (sigmoid, IPO) and KTO losses as TRL's own trainers
(their dataset tokenization, collators and ``_compute_loss``, lr 0), with Metaspace (Llama) and
byte-level tokenizers, for answers that merge with the template's tail (``"▁The"``) and ones that
do not (``"I"``): an answer is scored from where the ids of prompt + answer leave the prompt's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmtrain.formatting import Formatter
from llmtrain.objectives import OBJECTIVES
from llmtrain.objectives.loss import sequence_logprobs
from llmtrain.objectives.preference import PairCollate, PreferenceLoss
from llmtrain.testing import tiny_model

ALPACA = "### Instruction:\n{X}\n\n### Response:\n{Y}"  # Metaspace: ":\n" was scored as answer
QA = "Q: {X}\nA: {Y}"  # "The" absorbs the prompt's last space ("ĠThe", "▁The"), "I" does not
QUESTIONS = ["What is the capital of France?", "Name a color.", "Is it raining?", "Say hi."]
ANSWERS = ["The capital is Paris.", "I think it is red.", "The sky says no.", "I say hello."]
OTHERS = ["I do not know.", "The color blue.", "I am not sure.", "The word hi."]
BETA = 0.2
LOGPS = ("logps/chosen", "logps/rejected")


def _close(got: Any, want: Any) -> None:
    """Equal to 1e-5, or to float32's resolution (llmtrain sums log-probs in float32 and the
    sequences' log-probs reach -90: a float32 step there is 2^-17)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    torch.testing.assert_close(got, want, rtol=5e-7, atol=1e-5)


@pytest.fixture(scope="module", params=["metaspace", "bytelevel"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(request.param)
    policy, ref = (tiny_model(root / f"s{s}", tokenizer=request.param, seed=s) for s in (0, 1))
    return policy, ref


def _load(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def _config(cls: type, tmp: Path, n: int, **options: Any) -> Any:
    common = dict(output_dir=str(tmp), per_device_train_batch_size=n, learning_rate=0.0)
    common.update(report_to="none", use_cpu=True, bf16=False, beta=BETA, max_length=None)
    return cls(**common, **options)


def _ours(policy: Path, ref: Path, collate: PairCollate, rows: list[Any], **args: Any) -> Any:
    """llmtrain's loss, metrics and per-sequence log-probs on the PairCollate batch of ``rows``."""
    model, reference = _load(policy), _load(ref)
    batch = collate(rows)
    n = batch["pairs"]
    options = SimpleNamespace(label_smoothing=0.0, desirable_weight=None, undesirable_weight=None)
    objective = OBJECTIVES[args["objective"]]
    loss_fn = PreferenceLoss(objective, model, SimpleNamespace(**vars(options), beta=BETA, **args))
    loss_fn._reference = lambda _m, b, n: sequence_logprobs(reference, b, num_sequences=2 * n)[0]
    with torch.no_grad():
        loss = loss_fn(model, batch) / n
        logps = sequence_logprobs(model, batch, num_sequences=2 * n)[0]
        ref_logps = sequence_logprobs(reference, batch, num_sequences=2 * n)[0]
    return loss, loss_fn.logged(), logps, ref_logps


def _trl(cls: Any, config: Any, models: Any, formatter: Any, rows: list[Any]) -> Any:
    """TRL's trainer on the same rows (prompts as the template renders them): the trainer, its
    collated batch, its loss and its logged metrics."""
    from datasets import Dataset

    text = [{**r, "prompt": formatter.template.prompt(r["prompt"])} for r in rows]
    policy, ref = models
    trainer = cls(
        _load(policy),
        ref_model=_load(ref),
        args=config,
        processing_class=formatter.tokenizer,
        train_dataset=Dataset.from_list(text),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    with torch.no_grad():
        expected = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    trl = {k: v[-1] for mode in ("train", "eval") for k, v in trainer._metrics[mode].items()}
    return trainer, batch, expected, trl


def _trl_logps(model: Any, batch: dict[str, Any], prefix: str = "") -> torch.Tensor:
    """Per-sequence log-probs by the fused head TRL's trainer put on ``model``."""
    ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}completion_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=batch[f"{prefix}attention_mask"],
            labels=labels,
            fused_lm_head=True,
        )
    return out.log_probs.sum(-1)


@pytest.mark.parametrize("template", [ALPACA, QA], ids=["alpaca", "qa"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_log_probs_rewards_and_loss_equal_trls(
    models: Any, template: str, loss_type: str, tmp_path: Path
) -> None:
    from trl import DPOConfig, DPOTrainer

    policy, ref = models
    tokenizer = AutoTokenizer.from_pretrained(policy)
    formatter = Formatter(tokenizer, template, x_field="prompt", y_field="chosen")
    pairs = [(ANSWERS[i], OTHERS[i]) for i in range(4)] + [
        (OTHERS[i], ANSWERS[i]) for i in range(2)
    ]
    pairs += [(ANSWERS[0], ANSWERS[2]), (OTHERS[0], OTHERS[2])]  # both merge, neither does
    rows = [
        {"prompt": QUESTIONS[i % 4], "chosen": c, "rejected": r} for i, (c, r) in enumerate(pairs)
    ]
    collate = PairCollate(formatter, "chosen", "rejected", tokenizer.pad_token_id, "t", None)
    loss, metrics, logps, ref_logps = _ours(
        policy, ref, collate, list(enumerate(rows)), objective="dpo", loss_type=loss_type
    )

    trainer, batch, expected, trl = _trl(
        DPOTrainer,
        _config(DPOConfig, tmp_path, len(rows), loss_type=[loss_type]),
        models,
        formatter,
        rows,
    )
    _close(loss, expected)
    _close(logps, _trl_logps(trainer.model, batch))  # chosen, then rejected
    _close(ref_logps, _trl_logps(trainer.ref_model, batch))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", *LOGPS):
        _close(metrics[name], trl[name])


@pytest.mark.parametrize("template", [ALPACA, QA], ids=["alpaca", "qa"])
def test_kto_log_probs_rewards_kl_and_loss_equal_trls(
    models: Any, template: str, tmp_path: Path
) -> None:
    from trl import KTOConfig, KTOTrainer

    policy, ref = models
    tokenizer = AutoTokenizer.from_pretrained(policy)
    formatter = Formatter(tokenizer, template, x_field="prompt", y_field="completion")
    answers = ANSWERS + OTHERS
    liked = [True, False, False, True, True, True, False, False]
    rows = [
        {"prompt": QUESTIONS[i % 4], "completion": a, "label": good}
        for i, (a, good) in enumerate(zip(answers, liked))
    ]
    collate = PairCollate(
        formatter, "completion", "label", tokenizer.pad_token_id, "t", None, feedback=True
    )
    loss, metrics, logps, ref_logps = _ours(
        policy, ref, collate, list(enumerate(rows)), objective="kto"
    )

    trainer, batch, expected, trl = _trl(
        KTOTrainer, _config(KTOConfig, tmp_path, len(rows)), models, formatter, rows
    )
    trl_logps = torch.cat(
        [_trl_logps(trainer.model, batch), _trl_logps(trainer.model, batch, "KL_")]
    )
    trl_ref = torch.cat(
        [_trl_logps(trainer.ref_model, batch), _trl_logps(trainer.ref_model, batch, "KL_")]
    )
    _close(loss, expected)
    _close(logps, trl_logps)  # the completions, then the KL estimate's mismatched ones
    _close(ref_logps, trl_ref)
    for name in ("kl", "rewards/chosen", "rewards/rejected", *LOGPS):
        _close(metrics[name], trl[name])
