"""TrainedModel: the result of a fit, stored as a component, usable for generation.

It applies the exact prompt formatting used in training, so training and serving prompts
never drift, and it can write the base model with the adapter merged in (for vLLM & co).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from llmtrain.components import register_component
from llmtrain.errors import ConfigError
from llmtrain.training.args import ModelArguments, build

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer
    from llmtrain.formatting import Formatter
    from llmtrain.training.trainer import LLMTrainer


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


@register_component
class TrainedModel:
    type_id: ClassVar[str] = "model"

    def __init__(self, record: ModelRecord) -> None:
        self.record = record
        self.version: int | None = None
        self.db: Datalayer | None = None
        self._loaded: tuple[Any, Any] | None = None
        self._formatter: Formatter | None = None

    @property
    def identifier(self) -> str:
        return self.record.identifier

    @classmethod
    def from_run(
        cls, trainer: LLMTrainer, run_id: str, artifact: str | None, history: list[dict[str, float]]
    ) -> TrainedModel:
        cfg = trainer.config
        model = cls(
            ModelRecord(
                identifier=trainer.identifier,
                base=cfg.model_args,
                adapter=artifact,
                full_model=cfg.lora_args is None,
                prompt_template=cfg.prompt_template,
                chat_template=cfg.data_args.chat_template,
                max_length=cfg.data_args.max_length,
                run_id=run_id,
                trainer_version=trainer.version,
                history=history[-200:],
            )
        )
        model.db = trainer.db
        return model

    def to_dict(self) -> dict[str, Any]:
        return self.record.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainedModel:
        return cls(build(ModelRecord, data))

    def _attach(self, db: Datalayer) -> None:
        self.db = db

    def __repr__(self) -> str:
        return f"TrainedModel({self.identifier!r}, version={self.version})"

    # -- loading -------------------------------------------------------------------------------
    def _require_db(self) -> Datalayer:
        if self.db is None:
            raise ConfigError(
                "this model is not attached to a database; use db.load('model', "
                f"{self.identifier!r})"
            )
        return self.db

    def _weights(self) -> str:
        if self.record.adapter is None:
            raise ConfigError(f"model {self.identifier!r} v{self.version} has no stored weights")
        return self.record.adapter

    def load(self, device: str | None = None) -> tuple[Any, Any]:
        """``(model, tokenizer)``: the base model with the adapter, ready for generation."""
        if self._loaded is None:
            import torch

            from llmtrain.training.modeling import load_model, load_tokenizer

            db = self._require_db()
            dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            folder = Path(tempfile.mkdtemp(prefix="llmtrain-model-"))
            try:
                db.artifacts.get_dir(self._weights(), folder / "weights")
                if self.record.full_model:
                    args = self.record.base.model_copy(
                        update={"model_name_or_path": str(folder / "weights")}
                    )
                    model, tokenizer = load_model(args, dev), load_tokenizer(args)
                else:
                    from peft import PeftModel

                    tokenizer = load_tokenizer(self.record.base)
                    base = load_model(self.record.base, dev)
                    model = PeftModel.from_pretrained(base, folder / "weights")
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            model.eval()
            self._loaded = (model, tokenizer)
        return self._loaded

    def formatter(self) -> Formatter:
        """The training prompt format, built once per loaded model."""
        if self._formatter is None:
            from llmtrain.formatting import Formatter

            _, tokenizer = self.load()
            template = None if self.record.chat_template else self.record.prompt_template
            self._formatter = Formatter(
                tokenizer,
                template,
                chat_template=self.record.chat_template,
                max_length=self.record.max_length,
            )
        return self._formatter

    # -- inference -----------------------------------------------------------------------------
    def generate(
        self,
        X: str | list[str],
        *,
        max_new_tokens: int = 64,  # noqa: N803
        **generate_kwargs: Any,
    ) -> str | list[str]:
        """Responses to ``X`` rendered with the training prompt; greedy unless told otherwise."""
        import torch

        model, tokenizer = self.load()
        formatter = self.formatter()
        prompts = [X] if isinstance(X, str) else list(X)
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([formatter.prompt_ids(prompt)], device=model.device)
            kwargs = {
                "do_sample": False,
                "max_new_tokens": max_new_tokens,
                "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                **generate_kwargs,
            }
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
            outputs.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return outputs[0] if isinstance(X, str) else outputs

    def predict(self, X: str | list[str], **kwargs: Any) -> str | list[str]:  # noqa: N803
        """The scikit-learn style name of :meth:`generate` (same arguments, same result)."""
        return self.generate(X, **kwargs)

    # -- export ----------------------------------------------------------------------------------
    def merge(self, dest: str | Path | None = None, *, store: bool = True) -> str:
        """Write the base model with the adapter merged in (safetensors) to the artifact store
        (and to ``dest`` if given); record it on this component and, with ``store``, store
        that as a new version (fit(merge=True) merges before the model is first stored, so
        one fit adds one version). Returns the artifact id."""
        import torch
        from peft import PeftModel

        from llmtrain.training.modeling import load_model, load_tokenizer

        db = self._require_db()
        if self.record.full_model:
            raise ConfigError("this model was fully fine-tuned: there is no adapter to merge")
        folder = Path(tempfile.mkdtemp(prefix="llmtrain-merge-"))
        try:
            db.artifacts.get_dir(self._weights(), folder / "adapter")
            # merge into full-precision base weights, never into quantised ones
            base = load_model(self.record.base, torch.device("cpu"), quantize=False)
            merged = PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload()
            merged.save_pretrained(folder / "merged", safe_serialization=True)
            load_tokenizer(self.record.base).save_pretrained(folder / "merged")
            artifact = db.artifacts.put_dir(folder / "merged")
            if dest is not None:
                shutil.copytree(folder / "merged", dest, dirs_exist_ok=False)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.record = self.record.model_copy(update={"merged": artifact})
        if store:
            db.add(self)
        return artifact
