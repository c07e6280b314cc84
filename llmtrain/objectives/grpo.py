"""GRPO: each step samples ``num_generations`` answers a prompt from the policy, scores them with
rewards the database computes (``lt.sql_reward``) or functions (``"module:name"``, TRL's
signature), and trains TRL 1.16's clipped objective on the group-normalised advantages with a KL
penalty to the reference (the model with its adapter off, or its parent). Each answer can be
written back as a row (``rollouts_table``) that later fits select from."""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

import sqlalchemy as sa
import torch
from pydantic import Field

from llmtrain.db.keys import key_repr
from llmtrain.errors import ConfigError
from llmtrain.formatting import IGNORE_INDEX, Formatter
from llmtrain.objectives.base import Averaged, Batching, Objective, Settings
from llmtrain.objectives.loss import LossFunction, target_logprobs
from llmtrain.objectives.reference import reference_model


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    epsilon: float,
    epsilon_high: float | None,
    loss_type: str,
    max_new_tokens: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL 1.16's loss of [N, T] per-token log-probs on ``mask``'s answer tokens (token-level
    importance ratios): ``grpo`` the mean of each answer's token mean, ``dr_grpo`` the sum over
    N x max_new_tokens, ``dapo`` the token mean."""
    high = epsilon_high if epsilon_high is not None else epsilon
    ratio, adv, m = torch.exp(logps - old_logps), advantages[:, None], mask.float()
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + high) * adv)
    kl = torch.zeros_like(per_token)
    if beta and ref_logps is not None:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (per_token.size(0) * max_new_tokens)
    else:
        loss = (per_token * m).sum() / m.sum().clamp(min=1)
    clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    tokens = m.sum().clamp(min=1)
    return loss, {
        "kl": (kl.detach() * m).sum() / tokens,
        "clip_ratio": (clipped * m).sum() / tokens,
    }


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs (Bessel-corrected, NaN below two values; TRL's)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim)
    return torch.sqrt(torch.where(count > 1, variance * count / (count - 1), math.nan))


def advantages(rewards: torch.Tensor, weights: list[float], group: int, scale: str) -> Any:
    """(advantage, weighted reward) of each answer from its [N, R] rewards (NaN: bad): the
    weighted sum less its group's mean, over the group's (or batch's) std; unscorable: 0."""
    total = (rewards * torch.tensor(weights)).nansum(1)
    total[torch.isnan(rewards).all(1)] = math.nan
    grouped = total.view(-1, group)
    mean = torch.nanmean(grouped, 1).repeat_interleave(group)
    std = nanstd(grouped, 1).repeat_interleave(group) if scale == "group" else nanstd(total)
    out = total - mean if scale == "none" else (total - mean) / (std + 1e-4)
    return torch.nan_to_num(out, nan=0.0), total


def _number(value: Any) -> float:
    ok = isinstance(value, (int, float, Decimal)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(float(value)) else math.nan


def scores(db: Any, rewards: list[dict[str, Any]], **row: list[Any]) -> torch.Tensor:
    """[N, R] rewards of N answers: an SQL reward run by the database per answer (its row's
    fields, ``completion``, ``prompt`` and ``key`` as parameters), a function called as TRL calls
    it (``prompts``, ``completions``, each field a keyword). Not a finite number: NaN."""
    prompts, completions, keys = row.pop("prompts"), row.pop("completions"), row.pop("keys")
    columns = []
    for reward in rewards:
        if "sql" in reward:
            params = [
                {**{f: v[i] for f, v in row.items()}, "completion": c, "prompt": p, "key": k}
                for i, (c, p, k) in enumerate(zip(completions, prompts, keys))
            ]
            values = db.backend.scores(reward["sql"], params, reward["timeout_s"])
        else:
            module, name = reward["function"].split(":")
            function = getattr(importlib.import_module(module), name)
            values = function(prompts=prompts, completions=completions, **row)
        columns.append([_number(v) for v in values])
    return torch.tensor(columns, dtype=torch.float32).T


class Rollouts:
    """Sampled answers as rows of ``table`` in the data database, made by the first write (of
    whichever rank comes first); a step run again after a resume replaces its rows (``id``:
    run/step/prompt key/answer)."""

    def __init__(self, db: Any, table: str) -> None:
        text, number, whole = sa.Text(), sa.Float(), sa.Integer()
        columns: list[tuple[str, Any]] = [("run_id", sa.String(64)), ("step", whole)]
        columns += [("prompt_key", text), ("generation", whole), ("completion", text)]
        columns += [("tokens", whole), ("reward", number), ("rewards", text), ("advantage", number)]
        self.table = sa.Table(
            table,
            sa.MetaData(),
            sa.Column("id", sa.String(255), primary_key=True),
            *(sa.Column(name, kind) for name, kind in columns),
        )
        self.engine, self.made = db.backend.engine, False

    def write(self, rows: list[dict[str, Any]]) -> None:
        t = self.table
        if not self.made:
            try:
                t.create(self.engine, checkfirst=True)
            except sa.exc.DBAPIError:  # another rank made it first
                if not sa.inspect(self.engine).has_table(t.name):
                    raise
            self.made = True
        with self.engine.begin() as conn:
            conn.execute(t.delete().where(t.c.id.in_([r["id"] for r in rows])))
            conn.execute(t.insert(), rows)


@dataclass
class PromptCollate:
    """Prompt rows to their prompt ids, left-padded for sampling; the rows ride along for the
    rewards. ``num_target_tokens`` counts prompts, what a step is normalised by."""

    formatter: Formatter
    room: int  # the prompt's tokens at most: max_length less the answer's
    pad_id: int

    def __call__(self, rows: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        f = self.formatter
        ids = [f.prompt(row[f.x_field], max_tokens=self.room).ids for _, row in rows]
        width = max(map(len, ids))
        return {
            "prompt_ids": torch.tensor([[self.pad_id] * (width - len(i)) + i for i in ids]),
            "prompt_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
            "rows": [row for _, row in rows],
            "row_keys": [key for key, _ in rows],
            "keys": [key_repr(key) for key, _ in rows],
            "num_target_tokens": len(rows),
            "num_tokens": 0,  # the loss counts prompts and answers once it has sampled
        }


class GRPOSettings(Settings):
    num_generations: int = Field(default=4, ge=2)
    """GRPO: answers sampled a prompt each step, whose rewards are normalised as a group."""
    max_new_tokens: int = Field(default=64, ge=1)
    """GRPO: the longest answer sampled (TRL's max_completion_length)."""
    temperature: float = Field(default=1.0, gt=0)
    """GRPO: the sampling temperature."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """GRPO: nucleus sampling's probability mass."""
    epsilon: float = Field(default=0.2, gt=0, lt=1)
    """GRPO: the ratio's clip range below (and above, unless epsilon_high)."""
    epsilon_high: float | None = Field(default=None, gt=0)
    """GRPO: the clip range above (DAPO's clip-higher); None: epsilon."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """GRPO: advantages divided by the rewards' std in the group, the batch, or not at all."""
    reward_weights: list[float] | None = None
    """GRPO: each reward's weight in the sum (None: 1 each)."""
    rollouts_table: str | None = Field(default=None, min_length=1)
    """GRPO: a table of the data database llmtrain writes every sampled answer to (run, step,
    prompt key, answer, rewards, advantage), for later fits to select from."""


class GRPO(Objective):
    name, roles, optional, trains = "grpo", ("X", "Y"), ("Y",), "prompts scored by rewards"
    reference, generated, loss_types = True, True, ("dapo", "grpo", "dr_grpo")
    shown, settings = ("reward", "kl", "completions/mean_length"), GRPOSettings

    def problems(self, config: Any) -> list[str]:
        fit, a, problems = config.fit, config.objective_args, []
        rewards = (fit.reward or []) if fit is not None else None
        if rewards == []:
            problems.append(
                "objective='grpo' needs fit(reward=): lt.sql_reward(...), a function "
                "'module:name', or a list of them"
            )
        if rewards and a.reward_weights is not None and len(a.reward_weights) != len(rewards):
            problems.append(
                f"reward_weights has {len(a.reward_weights)} weight(s) for {len(rewards)} reward(s)"
            )
        if fit is not None and fit.query().kind == "mix":
            problems.append("objective='grpo' trains one source, not lt.mix(...)")
        if a.beta and config.lora_args is None:
            problems.append(
                "objective='grpo' with lora_args=None: the KL reference is the model with its "
                "adapter off; train an adapter or set beta=0"
            )
        sharded = config.fsdp_config is not None or config.deepspeed_config is not None
        if sharded or config.data_args.packing or config.training_args.eval_metrics:
            problems.append(
                "objective='grpo' samples answers with the whole model in one process or under "
                "DDP, unpacked, without eval_metrics: drop fsdp_config, deepspeed_config, "
                "packing and eval_metrics"
            )
        if a.max_new_tokens >= config.data_args.max_length:
            problems.append(
                f"max_new_tokens={a.max_new_tokens} leaves no room for a prompt in "
                f"max_length={config.data_args.max_length}"
            )
        return problems

    def prepare(self, db: Any, config: Any, snapshot: Any) -> Any:
        """SQL rewards (one read-only SELECT) and the rollouts table need an SQL database:
        checked before anything is recorded."""
        sql = hasattr(db.backend, "scores")
        if config.objective_args.rollouts_table and not sql:
            raise ConfigError("rollouts_table= writes a table of an SQL database, not MongoDB")
        for reward in config.fit.reward:
            if "sql" in reward:
                if not sql:
                    raise ConfigError("sql_reward needs an SQL database; use a function reward")
                db.backend.scores(reward["sql"], [], reward["timeout_s"])
        return config

    def collate(self, how: Batching) -> PromptCollate:
        """One batch a loader batch: GRPO refuses packing, so no token budget splits it."""
        room = how.formatters[0].max_length - how.settings.max_new_tokens
        return PromptCollate(how.formatters[0], room, how.pad_id)

    def loss(self, run: Any) -> GRPOLoss:
        return GRPOLoss(run)


class GRPOLoss:
    """``loss(model, batch)``: sample, score, then the policy's loss on its own answers, summed
    over the prompts (each prompt's answers: their mean); metrics add up until :meth:`logged`."""

    def __init__(self, run: Any) -> None:
        self.run, self.base = run, run.base_model
        self.args, self.fit = run.config.objective_args, run.plan.fit
        self.head, self.metrics = LossFunction(self.base), Averaged()
        table = self.args.rollouts_table
        self.rollouts = Rollouts(run.db, table) if table else None

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        if not batch.get("rows"):  # a rank's filler batch: its collectives, no gradient
            return target_logprobs(model, batch, head=self.head).sum()
        a, run, group = self.args, self.run, self.args.num_generations
        tok, rows, eos = run.tokenizer, batch["rows"], run.tokenizer.eos_token_id
        ids = batch["prompt_ids"].repeat_interleave(group, 0)  # each prompt's answers together
        seen = batch["prompt_mask"].repeat_interleave(group, 0)
        width, device, training = ids.size(1), ids.device, self.base.training
        self.base.eval()
        with torch.no_grad():
            out = self.base.generate(
                input_ids=ids,
                attention_mask=seen,
                do_sample=True,
                temperature=a.temperature,
                top_p=a.top_p,
                top_k=0,
                max_new_tokens=a.max_new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=eos,
            )
        self.base.train(training)
        answers = out[:, width:]
        ends = answers == eos
        lengths = torch.where(ends.any(1), ends.int().argmax(1) + 1, answers.size(1))
        mask = torch.arange(answers.size(1), device=device)[None] < lengths[:, None]
        texts = tok.batch_decode(
            [r[:n] for r, n in zip(answers.tolist(), lengths.tolist())], skip_special_tokens=True
        )
        fields = {f: [r[f] for r in rows for _ in range(group)] for f in self.fit.fields}
        keys = [k for k in batch["row_keys"] for _ in range(group)]
        each = scores(
            run.db,
            self.fit.reward,
            prompts=fields[self.fit.X],
            completions=texts,
            keys=keys,
            **fields,
        )
        weights = a.reward_weights or [1.0] * each.size(1)
        advantage, reward = advantages(each, weights, group, a.scale_rewards)
        attention = torch.cat([seen, mask.long()], 1)
        batch["num_tokens"] = int(attention.sum())  # what the loop counts: prompts and answers
        labels = torch.full_like(out, IGNORE_INDEX)
        labels[:, width:][mask] = answers[mask]
        train = {
            "input_ids": out,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "labels": labels,
        }
        logps = self._per_token(model, train, width)
        ref = None
        if a.beta:
            with torch.no_grad(), reference_model(self.base):
                ref = self._per_token(model, train, width)
        loss, metrics = grpo_loss(
            logps,
            logps.detach(),
            ref,
            advantage.to(device),
            mask,
            beta=a.beta,
            epsilon=a.epsilon,
            epsilon_high=a.epsilon_high,
            loss_type=a.loss_type or GRPO.loss_types[0],
            max_new_tokens=a.max_new_tokens,
        )
        names = [r.get("function", f"sql{i}").split(":")[-1] for i, r in enumerate(self.fit.reward)]
        metrics |= {f"rewards/{n}": torch.nanmean(each[:, i]) for i, n in enumerate(names)}
        metrics |= {"reward": torch.nanmean(reward), "reward_std": nanstd(reward)}
        metrics["completions/mean_length"] = lengths.float().mean()
        self.metrics.add(metrics, len(ids), {})
        if self.rollouts and torch.is_grad_enabled():  # training's answers, not evaluation's
            self.rollouts.write(self._rows(keys, texts, lengths, each, reward, advantage))
        return loss * len(rows)

    def _per_token(self, model: Any, batch: dict[str, Any], width: int) -> torch.Tensor:
        """[N, answer length] log p of each answer token (0 where masked)."""
        flat = target_logprobs(model, batch, head=self.head)
        keep = batch["labels"][:, 1:] != IGNORE_INDEX
        return torch.zeros_like(keep, dtype=flat.dtype).masked_scatter(keep, flat)[:, width - 1 :]

    def _rows(
        self, keys: list[Any], texts: list[str], *values: torch.Tensor
    ) -> list[dict[str, Any]]:
        """Rank by rank, this micro-batch's answers as rows (their step: the one running)."""
        lengths, each, reward, advantage = (v.tolist() for v in values)
        step, group, run_id = self.run.step + 1, self.args.num_generations, self.run.run_id
        return [
            {
                "id": f"{run_id}/{step}/{key_repr(k)}/{i % group}",
                "run_id": run_id,
                "step": step,
                "prompt_key": key_repr(k),
                "generation": i % group,
                "completion": t,
                "tokens": n,
                "reward": None if math.isnan(r) else r,
                "rewards": json.dumps([None if math.isnan(v) else v for v in e]),
                "advantage": adv,
            }
            for i, (k, t, n, r, e, adv) in enumerate(
                zip(keys, texts, lengths, reward, each, advantage)
            )
        ]

    def logged(self) -> dict[str, float]:
        return self.metrics.logged()
