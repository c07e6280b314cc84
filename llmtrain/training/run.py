"""One training run, as every process executes it: setup -> train -> finish -> cleanup; the
strategy, batches, checkpointer and stores are collaborators handed in, never base classes."""

from __future__ import annotations

import copy
import logging
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmtrain.config.metrics import logged_name, resolve
from llmtrain.data.skips import SKIPS, Skips
from llmtrain.db.keys import key_repr
from llmtrain.db.queries import Mix, Query
from llmtrain.errors import CheckpointError, DataError
from llmtrain.formatting import Formatter
from llmtrain.formatting.template import PromptTemplate
from llmtrain.objectives import objective_of
from llmtrain.objectives.reference import REFERENCE
from llmtrain.stores.handle import Database
from llmtrain.stores.metadata.base import CheckpointRecord
from llmtrain.training.batches import (
    StepGroup,
    TrainBatches,
    empty_batch,
    make_collate,
    to_device,
    view_dataset,
)
from llmtrain.training.callbacks import Callback
from llmtrain.training.checkpoint import Checkpointer
from llmtrain.training.export import write_adapter
from llmtrain.training.modeling import (
    decoder_layers,
    load_model,
    load_tokenizer,
    prepare_for_training,
)
from llmtrain.training.plan import RunPlan
from llmtrain.training.precision import Precision
from llmtrain.training.progress import Progress, make_progress
from llmtrain.training.strategies.base import Strategy

log = logging.getLogger("llmtrain.training")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class FitRun:
    """Everything one process needs to train one run of a trainer."""

    def __init__(
        self,
        plan: RunPlan,
        db: Database,
        strategy: Strategy,
        *,
        callbacks: Sequence[Callback] = (),
        checkpointer: Callable[..., Checkpointer] = Checkpointer,
        progress_stream: Any = None,
    ) -> None:
        self.plan, self.db, self.run_id, self.strategy = plan, db, plan.run_id, strategy
        self.make_checkpointer = checkpointer  # Ray's reports its checkpoints to Ray Train
        self.progress_stream = progress_stream  # None: stderr; a Ray worker's goes to the driver
        self.config, self.snapshot = plan.config, plan.snapshot
        self.targs, self.dargs = self.config.training_args, self.config.data_args
        self.callbacks = list(callbacks)
        self.workdir = Path(tempfile.mkdtemp(prefix="llmtrain-run-"))
        self.step, self.tokens_seen, self.examples, self.last_grad_norm = 0, 0, 0, 0.0
        self.skips = Skips()  # what the steps trained since the last checkpoint skipped
        self.skipped: dict[str, None] = {}  # every key this attempt skipped, in reading order
        self.history: list[dict[str, float]] = []
        self.best: float | None = None  # the best save_best_by value so far
        self._saved_step: int | None = None
        self._eval_data: Any = None  # this rank's view of the eval rows, built once

    def setup(self) -> None:
        from transformers import get_scheduler

        s, cfg, t = self.strategy, self.config, self.targs
        s.launch()
        seed_everything(t.seed)
        self.precision = Precision.resolve(cfg.model_args, s.device, t.mixed_precision)
        self.tokenizer = load_tokenizer(cfg.model_args)
        model = prepare_for_training(
            load_model(cfg.model_args, s.device, precision=self.precision),
            cfg.lora_args,
            quantized=bool(cfg.model_args.bits),
            gradient_checkpointing=t.gradient_checkpointing,
        )
        self._start_from_parent(model)
        if t.torch_compile:  # each decoder layer; the head and the chunked loss stay eager
            for layer in decoder_layers(model, "training_args.torch_compile"):
                layer.compile()
        self.model, self.optimizer = s.setup(model, self._make_optimizer, self.precision)
        self.base_model = model
        self.objective = objective_of(cfg)
        self.loss = self.objective.loss(self)  # it reads this run's model, config and stores
        fit = self.plan.fit
        self.formatter = self._formatter(fit.fields)
        select = fit.query()
        batch_size = t.per_device_train_batch_size
        budget = self.dargs.token_budget(batch_size)
        collate = self._collate(select, token_budget=budget, batch_size=batch_size)
        train = view_dataset(
            self.db,
            select,
            fit.fields,
            self.dargs,
            check=self.objective.row_check(),
            split="train",
            snapshot=self.snapshot,
            seed=t.seed,
            rank=s.rank,
            world_size=s.world_size,
        )
        self.batches = TrainBatches(
            train,
            self.dargs,
            batch_size=batch_size,
            collate=collate,
            accumulation=t.gradient_accumulation_steps,
        )
        if len(self.batches) == 0:
            raise DataError(
                f"{select.source} selects {self.snapshot.count} row(s), "
                f"{train.view.count} to train on: too few to give each of "
                f"{s.world_size} process(es) one"
            )
        epochs = len(self.batches) * t.num_train_epochs
        self.total_steps = t.max_steps if t.max_steps > 0 else epochs
        self.scheduler = get_scheduler(
            t.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=t.warmup_steps or int(t.warmup_ratio * self.total_steps),
            num_training_steps=self.total_steps,
        )
        self.checkpointer = self.make_checkpointer(
            self.db, self.run_id, s, keep=t.save_total_limit, workdir=self.workdir
        )
        self.metrics = {logged_name(e): resolve(e) for e in t.eval_metrics}
        if self.plan.resume_from is not None:
            self._restore(self.plan.resume_from)

    def _formatter(self, fields: list[str]) -> Formatter:
        """The formatter of rows with ``fields`` (a {Y} template only formats sources with a Y)."""
        d, template = self.dargs, None if self.dargs.chat_template else self.config.prompt_template
        answered = len(fields) > 1 or self.objective.generated
        if template and not answered and not PromptTemplate(template).documents:
            template = None
        return Formatter(
            self.tokenizer,
            template,
            chat_template=d.chat_template,
            max_length=d.max_length,
            train_on_inputs=d.train_on_inputs,
            x_field=fields[0],
            y_field=fields[1] if len(fields) > 1 else None,
            stride=d.stride,
            conversations=d.chat_template and len(fields) == 1,
            assistant_turns=d.assistant_turns,
            on_bad_row=d.on_bad_row,
        )

    def _collate(self, query: Query, **options: Any) -> Any:
        """Rows to batches, with one formatter a source (a mixture's each in its own shape)."""
        fit, formatters = self.plan.fit, [self.formatter]
        if isinstance(query, Mix):
            formatters = [self._formatter(p.fields_or(fit.fields)) for p in query.parts]
        return make_collate(
            formatters,
            self.tokenizer,
            self.base_model,
            self.dargs,
            query.source,
            objective=self.objective,
            fields=fit.fields,
            settings=self.config.objective_args,
            **options,
        )

    def _start_from_parent(self, model: Any) -> None:
        """Load the parent's adapter (a checkpoint overrides it), and a frozen copy as the
        reference of an objective that trains against one."""
        parent = self.plan.parent
        if not parent:
            return
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        folder = self.workdir / "parent"
        self.db.artifacts.get_dir(parent["adapter"], folder)
        weights = load_file(folder / "adapter_model.safetensors")
        loaded = set_peft_model_state_dict(model, weights)
        if unexpected := list(getattr(loaded, "unexpected_keys", None) or []):
            raise CheckpointError(
                f"the adapter of model v{parent.get('model_version')} does not fit this "
                f"trainer's LoRA layers ({', '.join(unexpected[:3])}, ...)"
            )
        if objective_of(self.config).reference:
            frozen = copy.copy(model.peft_config["default"])
            frozen.lora_dropout = 0.0  # the reference is deterministic: its values are kept
            model.add_adapter(REFERENCE, frozen)
            set_peft_model_state_dict(model, weights, adapter_name=REFERENCE)
            model.set_adapter("default")  # trains "default" alone: the reference stays frozen

    def _make_optimizer(self, params: list[torch.nn.Parameter]) -> Any:
        t = self.targs
        kwargs: dict[str, Any] = {
            "lr": t.learning_rate,
            "betas": (t.adam_beta1, t.adam_beta2),
            "eps": t.adam_epsilon,
            "weight_decay": t.weight_decay,
        }
        if t.optim == "adamw_torch":
            return torch.optim.AdamW(params, **kwargs)
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if t.optim == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return cls(params, **kwargs)

    def _restore(self, record: CheckpointRecord) -> None:
        state = self.checkpointer.restore(record, self.model, self.optimizer, self.scheduler)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.history = state.get("history", [])
        best = self.checkpointer.best_record()
        if best is not None and best["step"] <= self.step:
            self.best = best["value"]
        if self.strategy.is_main:
            epoch = self.batches.rule.after(self.step)[0]
            log.info("resumed run %s at step %d (epoch %d)", self.run_id, self.step, epoch)

    def train(self) -> None:
        t, first, epoch_examples = self.targs, self.step, 0
        stream = self.batches.steps(self.step, self.total_steps)
        self.model.train()
        for callback in self.callbacks:
            callback.on_train_begin(self)
        started, tokens_at_start = time.perf_counter(), self.tokens_seen
        progress = Progress()  # silent; rank 0 shows a bar, or plain lines off a terminal
        if t.progress_bar and self.strategy.is_main:
            desc, total = f"fit {self.config.identifier}", self.total_steps
            out, shown = self.progress_stream, self.objective.shown
            progress = make_progress(desc, total, self.step, t.logging_steps, out, shown)
        try:
            for group in stream:
                batches, targets = self._pair(group)
                lr = self.scheduler.get_last_lr()[0]  # this step's: the step moves it on
                loss = self._train_step(batches, targets) if targets else self._empty_step()
                keys = group.keys  # derived from the step's batches: once
                self.examples += len(keys)
                epoch_examples += len(keys)
                self.skips.add(group.skipped, group.epoch, group.deleted, group.changed)
                self.skipped.update(dict.fromkeys(map(key_repr, group.skipped)))
                per_epoch = self.batches.rule.per_epoch
                if group.step % per_epoch == 0:  # an epoch ended: whole in this attempt?
                    if group.step - per_epoch >= first and not self._everywhere(epoch_examples):
                        self._nothing_trained()  # every row of it skipped: all will be
                    epoch_examples = 0
                for callback in self.callbacks:
                    callback.on_step(self, keys)
                rate = (self.tokens_seen - tokens_at_start) / (time.perf_counter() - started)
                metrics = {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": self.last_grad_norm,
                    "tokens": float(self.tokens_seen),
                    "tokens_per_s": rate,
                }
                metrics |= self.loss.logged()  # the objective's: rewards, margins
                self.history.append({"step": self.step, "loss": loss})
                progress.step(self.step, metrics)
                if self.step % t.logging_steps == 0 or self.step == self.total_steps:
                    self._log(metrics)
                if t.eval_steps and self.step % t.eval_steps == 0:
                    self._eval_step(progress)
                if t.save_steps and self.step % t.save_steps == 0 and self._saved_step != self.step:
                    self.save_checkpoint()
            if self.step > first and not self._everywhere(self.examples):
                self._nothing_trained()
            evaluated_now = t.eval_steps and self.step % t.eval_steps == 0
            if not evaluated_now and self._eval_dataset() is not None:
                self._eval_step(progress)
        finally:
            stream.close()  # stops the thread making batches ahead
            progress.close()
        for callback in self.callbacks:
            callback.on_train_end(self)

    def _nothing_trained(self) -> None:
        """A fit that trained no example fails (every row was skipped)."""
        first = list(self.skipped)
        keys = f" (keys {', '.join(first[:5])}{', ...' if len(first) > 5 else ''})" if first else ""
        raise DataError(
            f"{self.plan.fit.query().source}: no example was trained: "
            f"{len(first)} row(s) skipped as bad{keys}; fix the rows or the "
            "X/Y fields (the warnings above name each row's problem)"
        )

    def _everywhere(self, count: int) -> int:
        """``count`` summed over the ranks (no collective for one process)."""
        s = self.strategy
        return count if s.world_size == 1 else int(s.all_reduce(torch.tensor(count)))

    def _pair(self, group: StepGroup) -> tuple[list[dict[str, Any]], int]:
        """The step's micro-batches, as many on every rank (empty ones added: collectives stay
        paired), and the step's target tokens on all ranks (one collective)."""
        batches, s = group.batches, self.strategy
        targets = sum(b["num_target_tokens"] for b in batches)  # plain ints: no torch call
        if s.world_size == 1:
            return batches, targets
        counts = s.all_gather(torch.tensor([len(batches), targets]))
        empty = [empty_batch(self.tokenizer.pad_token_id)]
        return batches + empty * (int(counts[:, 0].max()) - len(batches)), int(counts[:, 1].sum())

    def _empty_step(self) -> float:
        """A step whose rows were all skipped on every rank: no update (a zero gradient would
        still move AdamW's weights), but it keeps its number and place in the schedule."""
        self.scheduler.step()
        self.step += 1
        return math.nan

    def _train_step(self, group: list[dict[str, Any]], targets: int) -> float:
        """One optimizer step; returns the mean loss. Normalised by the step's target tokens on
        all ranks (each token weighs the same); the device is read once, at the end."""
        s, tokens = self.strategy, 0
        scale = s.world_size / max(targets, 1)
        total = torch.zeros((), device=s.device)
        for i, host_batch in enumerate(group):
            batch = to_device(host_batch, s.device)
            with s.accumulate(self.model, sync=i == len(group) - 1), self.precision.autocast():
                loss = self.loss(self.model, batch)
            s.backward(self.model, loss * scale)
            total += loss.detach().float()
            tokens += batch["num_tokens"]  # a plain int (an objective that samples: its own)
        norm = s.optimizer_step(self.model, self.optimizer, self.targs.max_grad_norm)
        self.scheduler.step()
        self.step += 1
        summed = s.all_reduce(torch.stack([total, torch.tensor(float(tokens), device=s.device)]))
        norm_t = torch.as_tensor(norm, dtype=torch.float32, device=summed.device).reshape(1)
        read = torch.cat([summed.float(), norm_t])
        loss_sum, all_tokens, self.last_grad_norm = read.tolist()  # the step's one host sync
        self.tokens_seen += int(all_tokens)
        return loss_sum / max(targets, 1)

    def _log(self, metrics: dict[str, float]) -> None:
        """Rank 0 records ``metrics``, then hands them to the callbacks."""
        if self.strategy.is_main:
            self.db.metadata.log_metrics(self.run_id, self.step, metrics)
            for callback in self.callbacks:
                callback.on_log(self, metrics)

    def _eval_step(self, progress: Progress) -> None:
        """Collective. Evaluate, log, and checkpoint a new best by save_best_by."""
        metrics = {"eval_loss": self.evaluate(), **self.score_generations()}
        metrics |= {f"eval_{name}": v for name, v in self.loss.logged().items()}
        self._log(metrics)
        progress.evaluated(self.step, metrics["eval_loss"])
        key = self.targs.best_key()
        value = metrics.get(key) if key else None
        if key is None or value is None or value != value:  # nothing scored (nan)
            return
        greater = self.targs.best_is_greater()
        if self.best is None or (value > self.best if greater else value < self.best):
            self.best = value
            record = self.save_checkpoint()
            if self.strategy.is_main:
                self.checkpointer.mark_best(record, key, value)

    def score_generations(self) -> dict[str, float]:
        """Collective. Mean eval metrics over greedy answers to up to max_eval_rows per rank."""
        ds = self._eval_dataset() if self.metrics else None
        if ds is None:
            return {}
        from llmtrain.training.generation import generate_batch

        s, fit, t, d = self.strategy, self.plan.fit, self.targs, self.dargs
        loader = ds.loader(t.per_device_eval_batch_size, collate_fn=list, with_keys=True)
        room = max(d.max_length - t.eval_max_new_tokens, d.max_length // 2)  # prompt tokens
        sums, count = torch.zeros(len(self.metrics), dtype=torch.float64), 0
        model = s.unwrap(self.model).eval()
        for rows in loader:
            pairs = [
                (r[fit.X], r[fit.Y])
                for _, r in rows
                if isinstance(r.get(fit.X), str) and isinstance(r.get(fit.Y), str)
            ][: d.max_eval_rows - count]
            if pairs:
                prompts = [self.formatter.prompt(x, max_tokens=room) for x, _ in pairs]
                with self.precision.autocast():
                    answers = generate_batch(model, self.tokenizer, prompts, t.eval_max_new_tokens)
                for i, fn in enumerate(self.metrics.values()):
                    sums[i] += sum(float(fn(a, y)) for a, (_, y) in zip(answers, pairs))
                count += len(pairs)
            if count >= d.max_eval_rows:
                break
        self.model.train()
        sums = s.all_reduce(sums)
        total = float(s.all_reduce(torch.tensor(float(count))))
        return {name: float(sums[i]) / max(total, 1.0) for i, name in enumerate(self.metrics)}

    def evaluate(self) -> float:
        """Mean token loss on the eval selection or the held-out rows (up to max_eval_rows)."""
        s, ds = self.strategy, self._eval_dataset()
        if ds is None:
            return float("nan")
        collate = self._collate(ds.query)
        batches = ds.loader(
            self.targs.per_device_eval_batch_size, collate_fn=collate, with_keys=True
        )
        total, count, seen = torch.zeros(()), torch.zeros(()), 0
        self.model.eval()
        with torch.no_grad():
            for batch in batches:
                if "input_ids" not in batch:  # every row of it skipped by the formatter
                    continue
                batch = to_device(batch, s.device)
                with self.precision.autocast():
                    total += self.loss(self.model, batch).float().cpu()
                count += batch["num_target_tokens"]
                seen += len(batch["keys"])
                if seen >= self.dargs.max_eval_rows:
                    break
        self.model.train()
        total, count = s.all_reduce(total), s.all_reduce(count)
        return float(total / count.clamp(min=1))

    def _eval_dataset(self) -> Any:
        """This rank's eval rows (selection or held out), built once and rewound, or None."""
        fit, s = self.plan.fit, self.strategy
        other = fit.eval_query()
        held = other is None
        if held and self.dargs.eval_fraction <= 0:
            return None
        if self._eval_data is None:
            self._eval_data = view_dataset(
                self.db,
                fit.query() if other is None else other,
                fit.fields,
                self.dargs,
                check=self.objective.row_check(),
                split="held_out" if held else "all",
                snapshot=self.snapshot if held else self.plan.eval_snapshot,
                shuffle=False,
                drop_remainder=False,
                rank=s.rank,
                world_size=s.world_size,
            )
        self._eval_data.position.restore(0, 0)
        return self._eval_data

    def save_checkpoint(self) -> Any:
        """Collective. Rank 0 also records what every rank skipped since the last checkpoint."""
        s = self.strategy
        found = Skips()
        for theirs in s.gather_object(self.skips):
            found.merge(theirs)
        if s.is_main and found:
            info = self.db.metadata.get_run(self.run_id).info
            blob = self.db.artifacts.put_bytes(found.to_bytes())
            deleted = int(info.get("deleted_rows") or 0) + len(found.deleted)
            skips = [*(info.get(SKIPS) or []), blob]
            self.db.metadata.update_run(self.run_id, info={SKIPS: skips, "deleted_rows": deleted})
        self.skips = Skips()
        self._keep_references()
        state = {
            "step": self.step,
            "epoch": self.batches.rule.epoch_of(self.step) if self.step else 0,
            "tokens_seen": self.tokens_seen,
            "run_id": self.run_id,
            "history": self.history[-1000:],
        }
        self._saved_step = self.step
        return self.checkpointer.save(self.model, self.optimizer, self.scheduler, state)

    def _keep_references(self) -> None:
        """Collective. Rank 0 stores the reference values all ranks computed since the last call."""
        cache = getattr(self.loss, "cache", None)
        if cache is not None:
            gathered = self.strategy.gather_object(cache.take_new())
            if self.strategy.is_main:
                cache.store({k: v for new in gathered for k, v in new.items()})

    def save_adapter(self) -> str | None:
        """Collective. Rank 0 stores the adapter (PEFT format) or full model; returns its id."""
        self._keep_references()
        weights = self.strategy.trainable_state_dict(self.model)
        artifact = None
        if self.strategy.is_main:
            folder = self.workdir / "final"
            inner = self.strategy.unwrap(self.model)
            if self.config.lora_args is None:
                inner.save_pretrained(folder, state_dict=weights, safe_serialization=True)
                self.tokenizer.save_pretrained(folder)
            else:
                write_adapter(inner.peft_config["default"], weights, folder)
            artifact = self.db.artifacts.put_dir(folder)
            shutil.rmtree(folder, ignore_errors=True)
        self.strategy.barrier()
        return artifact

    def cleanup(self, failed: bool = False) -> None:
        try:
            for callback in self.callbacks:
                callback.on_cleanup(self, failed)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.strategy.teardown()
