"""TrainedModel: the result of a fit, stored as a component; it generates with the exact
prompt formatting of training (serving prompts never drift) and exports or merges its adapter."""

from __future__ import annotations

import shutil
import tempfile
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from llmtrain.config.args import ModelArguments, build
from llmtrain.console import quieted
from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.stores.components import register_component

if TYPE_CHECKING:
    from llmtrain.formatting import Formatter
    from llmtrain.stores.handle import Components
    from llmtrain.training.export import MergeInto


class ModelRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    identifier: str
    base: ModelArguments
    adapter: str | None  # artifact id of the PEFT adapter folder
    full_model: bool = False  # the artifact holds all weights (lora_args=None)
    merged: str | None = None  # artifact id of the merged model folder
    prompt_template: str | None
    chat_template: bool = False
    max_length: int
    run_id: str
    trainer_version: int | None
    history: list[dict[str, float]] = []
    artifacts: str | None = None  # where the adapter was stored (connect(artifacts=))


@register_component
class TrainedModel:
    type_id: ClassVar[str] = "model"

    def __init__(self, record: ModelRecord) -> None:
        self.record = record
        self.version: int | None = None
        self.db: Components | None = None
        self._loaded: tuple[Any, Any] | None = None
        self._formatters: dict[str, Formatter] = {}
        self.checkpoint: dict[str, Any] | None = None  # a checkpoint's weights instead
        self._adapters: dict[str, tuple[str, ModelRecord]] = {}  # identifier: (PEFT name, record)
        self._active: str | None = None

    @property
    def identifier(self) -> str:
        return self.record.identifier

    def to_dict(self) -> dict[str, Any]:
        return self.record.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainedModel:
        return cls(build(ModelRecord, data))

    def _attach(self, db: Components) -> None:
        self.db = db

    def __repr__(self) -> str:
        return f"TrainedModel({self.identifier!r}, version={self.version})"

    def use_checkpoint(self, checkpoint: str | int) -> None:
        """Use a checkpoint of the run instead of the final weights: ``"best"`` or a step."""
        db = self._require_db()
        run_id = self.record.run_id
        if checkpoint == "best":
            from llmtrain.training.checkpoint import BEST

            best = db.metadata.get_run(run_id).info.get(BEST)
            if not best:
                raise CheckpointError(
                    f"run {run_id} of model {self.identifier!r} v{self.version} recorded no best "
                    "checkpoint: train with training_args.save_best_by"
                )
            self.checkpoint = dict(best)
        else:
            for record in db.metadata.list_checkpoints(run_id):
                if str(checkpoint) in (str(record.step), record.artifact_id):
                    self.checkpoint = {"step": record.step, "artifact": record.artifact_id}
                    break
            else:
                raise CheckpointError(
                    f"run {run_id} of model {self.identifier!r} has no checkpoint "
                    f"{str(checkpoint)!r}"
                )
        self._loaded = None

    def _require_db(self) -> Components:
        if self.db is None:
            raise ConfigError(
                "this model is not attached to a database; use db.load('model', "
                f"{self.identifier!r})"
            )
        return self.db

    def _weights(self) -> str:
        what = f"model {self.identifier!r} v{self.version}"
        if self.record.adapter is None:
            raise ConfigError(f"{what} has no stored weights")
        self._require_db().artifacts.require(self.record.adapter, self.record.artifacts, what)
        return self.record.adapter

    def _adapter_folder(self, dest: Path) -> Path:
        """The adapter in PEFT's layout at ``dest`` (the chosen checkpoint's weights if any)."""
        from llmtrain.training.export import stable_adapter_config

        db = self._require_db()
        if self.record.full_model:
            raise ConfigError(f"model {self.identifier!r} was fully fine-tuned: it has no adapter")
        db.artifacts.get_dir(self._weights(), dest)
        if self.checkpoint is not None:
            from safetensors.torch import save_file

            weights = self._checkpoint_weights()
            save_file(weights, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
        stable_adapter_config(dest)
        return dest

    def _checkpoint_weights(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        from llmtrain.training.checkpoint import verify

        assert self.checkpoint is not None
        with tempfile.TemporaryDirectory(prefix="llmtrain-checkpoint-") as scratch:
            folder = Path(scratch) / "checkpoint"
            self._require_db().artifacts.get_dir(self.checkpoint["artifact"], folder)
            verify(folder)
            return load_file(str(folder / "weights.safetensors"))

    def load(self, device: str | None = None) -> tuple[Any, Any]:
        """``(model, tokenizer)``: the base model with the adapter, ready for generation."""
        if self._loaded is not None:
            return self._loaded
        import torch

        from llmtrain.training.modeling import load_model, load_tokenizer

        db = self._require_db()
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with quieted(), tempfile.TemporaryDirectory(prefix="llmtrain-model-") as scratch:
            weights = Path(scratch) / "weights"
            if self.record.full_model:
                db.artifacts.get_dir(self._weights(), weights)
                args = self.record.base.model_copy(update={"model_name_or_path": str(weights)})
                model, tokenizer = load_model(args, dev), load_tokenizer(args)
                if self.checkpoint is not None:
                    model.load_state_dict(self._checkpoint_weights())
            else:
                from peft import PeftModel

                tokenizer = load_tokenizer(self.record.base)
                base = load_model(self.record.base, dev)
                model = PeftModel.from_pretrained(base, self._adapter_folder(weights))
        model.eval()
        self._loaded = (model, tokenizer)
        return self._loaded

    def with_adapters(self, *others: str | TrainedModel) -> TrainedModel:
        """Load the adapters of ``others`` (identifiers or loaded models) trained on the same
        base beside this one (one base in memory); :meth:`set_adapter` switches."""
        model, _ = self.load()
        if self.record.full_model:
            raise ConfigError(f"model {self.identifier!r} was fully fine-tuned: it has no adapter")
        db = self._require_db()
        if not self._adapters:
            self._adapters[self.identifier] = ("default", self.record)
            self._active = self.identifier
        for other in others:
            loaded = db.load("model", other) if isinstance(other, str) else other
            if loaded.identifier in self._adapters:
                raise ConfigError(f"adapter {loaded.identifier!r} is loaded already")
            mine, theirs = self.record.base, loaded.record.base
            source = attrgetter("model_name_or_path", "revision")
            if loaded.record.full_model or source(mine) != source(theirs):
                raise ConfigError(
                    f"model {loaded.identifier!r} was trained on "
                    f"{'all weights of ' if loaded.record.full_model else ''}"
                    f"{theirs.model_name_or_path!r}, not on this model's base "
                    f"{mine.model_name_or_path!r}: its adapter cannot share the base"
                )
            name = f"adapter_{len(self._adapters)}"
            with tempfile.TemporaryDirectory(prefix="llmtrain-adapter-") as scratch:
                folder = loaded._adapter_folder(Path(scratch) / "a")
                model.load_adapter(str(folder), adapter_name=name)
            self._adapters[loaded.identifier] = (name, loaded.record)
        model.eval()
        return self

    @property
    def adapters(self) -> list[str]:
        return list(self._adapters) or [self.identifier]

    def set_adapter(self, identifier: str) -> TrainedModel:
        """Answer with the adapter (and prompt format) of model ``identifier``."""
        if identifier not in self._adapters:
            raise ConfigError(
                f"no adapter {identifier!r} is loaded; loaded: {', '.join(self.adapters)}"
            )
        model, _ = self.load()
        model.set_adapter(self._adapters[identifier][0])
        self._active = identifier
        return self

    def formatter(self) -> Formatter:
        """The training prompt format of the active adapter, built once."""
        record = self.record if self._active is None else self._adapters[self._active][1]
        if record.identifier not in self._formatters:
            from llmtrain.formatting import Formatter

            _, tokenizer = self.load()
            template = None if record.chat_template else record.prompt_template
            self._formatters[record.identifier] = Formatter(
                tokenizer,
                template,
                chat_template=record.chat_template,
                max_length=record.max_length,
            )
        return self._formatters[record.identifier]

    def generate(
        self, X: str | list[str], *, max_new_tokens: int = 64, **generate_kwargs: Any
    ) -> str | list[str]:
        """Responses to ``X`` through the training prompt, one at a time; greedy by default."""
        from llmtrain.training.generation import generate_batch

        model, tokenizer = self.load()
        prompts = [self.formatter().prompt(x) for x in ([X] if isinstance(X, str) else X)]
        with quieted():  # transformers' deprecation notes on every call
            outputs = [
                generate_batch(model, tokenizer, [p], max_new_tokens, **generate_kwargs)[0]
                for p in prompts
            ]
        return outputs[0] if isinstance(X, str) else outputs

    def predict(self, X: str | list[str], **kwargs: Any) -> str | list[str]:  # noqa: N803
        """:meth:`generate` by its scikit-learn name."""
        return self.generate(X, **kwargs)

    def export_adapter(self, dest: str | Path) -> Path:
        """Write the adapter in PEFT's layout to the new folder ``dest``."""
        from llmtrain.training.export import check_new_folder

        return self._adapter_folder(check_new_folder(dest, "adapter destination"))

    def export_merged(self, dest: str | Path, *, into: MergeInto = "trained") -> str:
        """Write the merged model and the tokenizer to the new folder ``dest`` (nothing stored);
        returns what it was merged into (:mod:`llmtrain.training.export`)."""
        from llmtrain.training.export import check_new_folder, write_merged

        dest = check_new_folder(dest, "merged destination")
        with tempfile.TemporaryDirectory(prefix="llmtrain-export-") as scratch:
            adapter = self._adapter_folder(Path(scratch) / "adapter")
            return write_merged(self.record.base, adapter, dest, into)

    def merge(
        self, dest: str | Path | None = None, *, store: bool = True, into: MergeInto = "trained"
    ) -> str:
        """Store the merged model as an artifact (and copy it to ``dest``), record it on this
        component and, with ``store``, store that as a new version; returns the artifact id."""
        db = self._require_db()
        with tempfile.TemporaryDirectory(prefix="llmtrain-merge-") as scratch:
            merged = Path(scratch) / "merged"
            self.export_merged(merged, into=into)
            artifact = db.artifacts.put_dir(merged)
            if dest is not None:
                shutil.copytree(merged, dest, dirs_exist_ok=False)
        self.record = self.record.model_copy(update={"merged": artifact})
        if store:
            db.add(self)
        return artifact
