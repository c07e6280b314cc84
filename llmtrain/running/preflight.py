"""Checks a fit makes before it records anything: a mistake found here leaves no trainer
version and no run behind, where the same mistake found in the run's setup leaves both.

Each check is cheap: one short read of the selection's first rows, the model's config file,
and for LoRA targets the model's skeleton on the meta device (no weights are read).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.config.args import TrainerConfig
from llmtrain.db.queries import Query
from llmtrain.errors import ConfigError
from llmtrain.integrations.trackers import check_trackers

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer

#: rows read to tell whether a field exists (MongoDB documents need not share fields)
FIRST_ROWS = 16


def check_before_recording(config: TrainerConfig, db: Datalayer) -> None:
    """Raise ConfigError/QueryError for a fit that cannot train, before it is recorded: a
    tracker's library missing, an X/Y field missing, a missing model, unmatched targets (an
    empty selection is found when the run's rows are snapshotted)."""
    fit = config.fit
    assert fit is not None  # set by fit() before it checks
    check_trackers(config.training_args.report_to)  # a loaded trainer, on this machine
    folder = local_model_folder(config.model_args.model_name_or_path)  # no row read for these
    if folder is not None and config.lora_args is not None:
        check_lora_targets(folder, config)
    for query in (fit.query(), fit.eval_query()):
        if query is not None:
            check_fields(db, query, fit.X, fit.Y)


def check_fields(db: Datalayer, select: Query, x: str, y: str | None) -> None:
    """A SQL backend refuses a missing column itself (QueryError); a MongoDB field missing
    from every one of the first rows is taken for a mistyped name."""
    named = [("X", x)] if y is None else [("X", x), ("Y", y)]
    rows = db.backend.fetch_rows(select, [n for _, n in named], None, FIRST_ROWS)
    for role, name in named:
        if rows and not any(name in row for _, row in rows):
            raise ConfigError(
                f"fit({role}={name!r}): no field {name!r} in the first {len(rows)} row(s) "
                f"of {select.source}; fields there: {sorted({f for _, r in rows for f in r})}"
            )


def local_model_folder(name: str) -> Path | None:
    """The local model folder ``name`` names (checked to hold a config), or None for a hub
    id: a name that exists here, or is clearly a path, is local."""
    from llmtrain.training.modeling import check_model_path

    check_model_path(name)
    path = Path(os.path.expanduser(name))
    if not path.exists():
        return None
    if not path.is_dir():
        raise ConfigError(f"model_args.model_name_or_path: {name!r} is a file, not a model folder")
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model_args.model_name_or_path: {name!r} has no config.json: not a model folder"
        )
    return path


def check_lora_targets(folder: Path, config: TrainerConfig) -> None:
    """The targets against the model's linear layers, on a weightless skeleton."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.training.modeling import target_modules_for

    margs = config.model_args
    try:
        hf_config = AutoConfig.from_pretrained(
            folder, revision=margs.revision, trust_remote_code=margs.trust_remote_code
        )
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(
                hf_config, trust_remote_code=margs.trust_remote_code
            )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model_args.model_name_or_path: cannot read {folder}: {exc}") from None
    assert config.lora_args is not None
    target_modules_for(skeleton, config.lora_args)
