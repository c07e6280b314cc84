"""Trackers (``training_args.report_to``): a run's metrics and recipe sent through each tool's
own library, as it is set up. No secret reaches one: URIs are redacted, W&B gets no argv."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtrain.console import QUIET_ENV
from llmtrain.errors import ConfigError
from llmtrain.training.callbacks import Callback
from llmtrain.uri import redact_uri
from llmtrain.versions import library_versions

if TYPE_CHECKING:
    from llmtrain.training.run import FitRun

log = logging.getLogger("llmtrain.trackers")


def check_trackers(report_to: Sequence[str]) -> None:
    """ConfigError naming the extra a missing tracker needs; found without importing (slow)."""
    for name in report_to:
        found = sys.modules[name] if name in sys.modules else importlib.util.find_spec(name)
        if found is None:
            raise ConfigError(
                f"training_args.report_to: {name!r} needs the {name} package: "
                f"pip install 'llmtrain[{name}]' (or drop {name!r} from report_to)"
            )


def make_trackers(report_to: Sequence[str]) -> list[Tracker]:
    check_trackers(report_to)
    return [_TRACKERS[name]() for name in report_to]


def scrub(value: Any) -> Any:
    """``value`` with every URI in it redacted (a recipe's database, a model path)."""
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_uri(value)
    return value


def flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys; lists and ``None`` as JSON text (scalar-only params)."""
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict) and item:
            flat.update(flatten(item, f"{name}."))
        else:
            flat[name] = item if isinstance(item, (bool, int, float, str)) else json.dumps(item)
    return flat


class RunFacts:
    """What every tracker receives about a run, secrets removed."""

    def __init__(self, run: FitRun) -> None:
        plan = run.plan
        self.identifier, self.version, self.run_id = plan.identifier, plan.version, plan.run_id
        self.name = f"{self.identifier}-v{self.version}-{self.run_id[:8]}"
        self.recipe: dict[str, Any] = scrub(plan.config.model_dump(mode="json"))
        self.data_fingerprint = plan.fit.data_fingerprint
        self.versions = library_versions()

    def params(self) -> dict[str, Any]:
        return {
            **self.recipe,
            "trainer_version": self.version,
            "run_id": self.run_id,
            "data_fingerprint": self.data_fingerprint,
            "versions": self.versions,
        }


class Tracker(Callback, ABC):
    """A failure to start or send stops the fit (a silent gap in a dashboard is worse),
    except while finishing a run that already failed. Rank 0 alone holds trackers."""

    name = ""
    started = False
    run: Any  # the library's run object, where it has one

    def on_train_begin(self, run: Any) -> None:
        if not self.started:
            self.start(RunFacts(run))
            self.started = True

    def on_log(self, run: Any, metrics: dict[str, float]) -> None:
        if self.started:
            # loss -> train/loss, eval_loss -> eval/loss: one name in every tracker
            named = {
                (f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): float(v)
                for k, v in metrics.items()
            }
            self.log(named, run.step)

    def on_cleanup(self, run: Any, failed: bool) -> None:
        if not self.started:
            return
        self.started = False
        try:
            self.finish(failed)
        except Exception:
            if not failed:
                raise
            log.exception("could not finish the %s run", self.name)

    @abstractmethod
    def start(self, facts: RunFacts) -> None: ...

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    @abstractmethod
    def finish(self, failed: bool) -> None: ...


class TensorBoardTracker(Tracker):
    """Event files in ``$LLMTRAIN_TENSORBOARD_DIR/NAME`` (default ``runs/``)."""

    name = "tensorboard"

    def start(self, facts: RunFacts) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        root = Path(os.environ.get("LLMTRAIN_TENSORBOARD_DIR") or "runs")
        self.writer = SummaryWriter(log_dir=str(root / facts.name))
        events = self.writer.file_writer
        assert events is not None  # opened by SummaryWriter()
        for summary in hparams(flatten(facts.params()), {}):  # the HPARAMS tab
            events.add_summary(summary)
        for tag in ("recipe", "data_fingerprint", "versions"):
            self.writer.add_text(tag, f"```\n{json.dumps(getattr(facts, tag), indent=2)}\n```")
        self.writer.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


class MLflowTracker(Tracker):
    """A run in ``$MLFLOW_TRACKING_URI``, experiment ``$MLFLOW_EXPERIMENT_NAME`` or the trainer."""

    name = "mlflow"

    def start(self, facts: RunFacts) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or facts.identifier
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        tags = {
            "llmtrain.trainer": facts.identifier,
            "llmtrain.trainer_version": str(facts.version),
            "llmtrain.run_id": facts.run_id,
            "llmtrain.data_fingerprint": str(facts.data_fingerprint),
        }
        run = self.client.create_run(experiment_id, run_name=facts.name, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(facts.params()).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, facts.params(), "llmtrain/recipe.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()]
        )

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbTracker(Tracker):
    """A W&B run in ``$WANDB_PROJECT`` (default ``llmtrain``), as ``WANDB_MODE`` says."""

    name = "wandb"

    def start(self, facts: RunFacts) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "llmtrain",
            name=facts.name,
            group=facts.identifier,
            config=facts.params(),
            settings=wandb.Settings(
                x_disable_meta=True,  # the command line (a --db URI with its password), host, git
                x_disable_stats=True,
                disable_git=True,
                save_code=False,
                console="off",
                silent=os.environ.get(QUIET_ENV) == "1",
            ),
            reinit="create_new",
        )

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


_TRACKERS = {t.name: t for t in (TensorBoardTracker, MLflowTracker, WandbTracker)}
