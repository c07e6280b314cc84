"""A fit's stored result: it generates with training's exact prompt format (no drift), exports."""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from llmtrain.config.args import ModelArguments, build
from llmtrain.console import quieted
from llmtrain.errors import ConfigError, ServingWarning
from llmtrain.stores.components import register_component
from llmtrain.training import export, gguf
from llmtrain.training.export import STACKS, MergeInto

if TYPE_CHECKING:
    from llmtrain.formatting import Formatter
    from llmtrain.stores.handle import Components


class ModelRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    identifier: str
    base: ModelArguments
    adapter: str | None  # artifact id of the PEFT adapter folder
    full_model: bool = False  # the artifact holds all weights (lora_args=None)
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
        self._formatter: Formatter | None = None
        self.checkpoint: dict[str, Any] | None = None  # a checkpoint's weights instead

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
        db, run_id = self._require_db(), self.record.run_id
        if checkpoint == "best":
            from llmtrain.training.checkpoint import BEST

            if not (best := db.metadata.get_run(run_id).info.get(BEST)):
                raise ConfigError(
                    f"run {run_id} of model {self.identifier!r} v{self.version} recorded no best "
                    "checkpoint: train with training_args.save_best_by"
                )
            self.checkpoint = dict(best)
        else:
            records = db.metadata.list_checkpoints(run_id)
            found = [r for r in records if str(checkpoint) in (str(r.step), r.artifact_id)]
            if not found:
                raise ConfigError(
                    f"run {run_id} of model {self.identifier!r} has no checkpoint "
                    f"{str(checkpoint)!r}"
                )
            self.checkpoint = {"step": found[0].step, "artifact": found[0].artifact_id}
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
        db = self._require_db()
        if self.record.full_model:
            raise ConfigError(f"model {self.identifier!r} was fully fine-tuned: it has no adapter")
        db.artifacts.get_dir(self._weights(), dest)
        if self.checkpoint is not None:
            from safetensors.torch import save_file

            weights = self._checkpoint_weights()
            save_file(weights, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
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

    def formatter(self) -> Formatter:
        """The training prompt format, built once."""
        if self._formatter is None:
            from llmtrain.formatting import Formatter

            record = self.record
            if self._loaded is None and not record.full_model:  # an export needs no weights
                from llmtrain.training.modeling import load_tokenizer

                tokenizer = load_tokenizer(record.base)
            else:
                tokenizer = self.load()[1]
            self._formatter = Formatter(
                tokenizer,
                None if record.chat_template else record.prompt_template,
                chat_template=record.chat_template,
                max_length=record.max_length,
            )
        return self._formatter

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

    def serving_problems(
        self, stacks: Sequence[str] = STACKS, *, adapter: bool = True
    ) -> list[str]:
        """What ``stacks`` would refuse or answer wrongly, served as the adapter (or merged),
        one line each with the way out."""
        with tempfile.TemporaryDirectory(prefix="llmtrain-check-") as scratch:
            config = None
            if adapter:
                folder = self._adapter_folder(Path(scratch) / "adapter")
                config = json.loads((folder / "adapter_config.json").read_text())
            return export.serving_problems(config, self.formatter().prompt("").heal, stacks)

    def export_adapter(
        self, dest: str | Path, *, check: Sequence[str] = STACKS, strict: bool = False
    ) -> Path:
        """Write the adapter in PEFT's layout, with the prompt (:meth:`export_merged`), to the
        new folder ``dest``."""
        self._check(check, strict, adapter=True)
        dest = self._adapter_folder(export.check_new_folder(dest, "adapter destination"))
        self._write_prompt(dest, {"export": "adapter"})
        return dest

    def export_merged(
        self,
        dest: str | Path,
        *,
        into: MergeInto = "trained",
        check: Sequence[str] = STACKS,
        strict: bool = False,
    ) -> str:
        """Merge into the new folder ``dest`` with the tokenizer, a chat template rendering the
        training prompt and llmtrain_export.json; returns what it merged into. What ``check``'s
        stacks refuse is a warning, with ``strict`` a ConfigError before anything is written."""
        self._check(check, strict, adapter=False)
        dest = export.check_new_folder(dest, "merged destination")
        with quieted(), tempfile.TemporaryDirectory(prefix="llmtrain-export-") as scratch:
            adapter = self._adapter_folder(Path(scratch) / "adapter")
            what = export.write_merged(self.record.base, adapter, dest, into)
        self._write_prompt(dest, {"export": "merged", "into": into, "merged_into": what})
        return what

    def export_gguf(
        self, dest: Path, *, quant: str = "f16", lora: bool = False, llama_cpp: Path | None = None
    ) -> Path:
        """The merged model as ``model.gguf`` (``lora``: ``base.gguf`` and ``adapter.gguf``) at
        ``quant`` in the new folder ``dest``, with the prompt and an Ollama Modelfile."""
        scripts, _ = gguf.converters(llama_cpp), gguf.binding(quant)
        dest = export.check_new_folder(dest, "GGUF destination")
        files = ["base.gguf", "adapter.gguf"] if lora else ["model.gguf"]
        with quieted(), tempfile.TemporaryDirectory(prefix="llmtrain-gguf-") as scratch:
            hf, base = Path(scratch) / "hf", self.record.base.model_name_or_path
            if lora:  # llama.cpp's LoRA converter takes lora_A/lora_B tensors alone
                config = json.loads((self._adapter_folder(hf) / "adapter_config.json").read_text())
                if refused := export.serving_problems(config, "", ["llama.cpp"]):
                    raise ConfigError(f"GGUF LoRA refused: {'; '.join(refused)} (as GGUF)")
                if not Path(base).is_dir():  # a hub id: its files, as loading fetched them
                    from huggingface_hub import snapshot_download

                    base = snapshot_download(base, revision=self.record.base.revision)
            else:
                self.export_merged(hf, check=())
            self._write_prompt(dest, {"export": "gguf", "quant": quant, "files": files})
            (dest / "Modelfile").write_text(gguf.modelfile(self.formatter(), files))
            gguf.convert(scripts / gguf.HF, Path(base) if lora else hf, dest / files[0], quant)
            if lora:  # the converter's own types; f16 for the binding's
                kind = quant if quant in gguf.CONVERTED else "f16"
                gguf.convert(scripts / gguf.LORA, hf, dest / files[1], kind, "--base", base)
        return dest

    def _check(self, stacks: Sequence[str], strict: bool, *, adapter: bool) -> None:
        problems = self.serving_problems(stacks, adapter=adapter) if stacks else []
        if strict and problems:
            raise ConfigError("strict export refused: " + "; ".join(problems))
        for problem in problems:
            warnings.warn(problem, ServingWarning, stacklevel=3)

    def _write_prompt(self, dest: Path, note: dict[str, Any]) -> None:
        record, run = self.record, self._require_db().metadata.get_run(self.record.run_id)
        note |= {
            "model": record.identifier,
            "version": self.version,
            "run_id": record.run_id,
            "checkpoint": (self.checkpoint or {}).get("step"),
            "base": record.base.model_name_or_path,
            "revision": record.base.revision,
            "objective": run.info["config"]["objective_args"]["objective"],
            "prompt_template": record.prompt_template,
            "chat_template": record.chat_template,
        }
        export.write_prompt(dest, self.formatter(), note)
