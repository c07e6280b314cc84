"""``db.forget(source, keys)``: a right-to-be-forgotten request, from the record alone.

It stores the keys in the source's ``forgotten`` record (every later run of any trainer on
that source leaves them out of its snapshot, and records that it did), marks each run that
trained on them (``forgotten_keys`` in its info: its checkpoints and model carry the rows),
and reports the models and checkpoints affected. Nothing is deleted: ``db.remove`` does that
when asked. ``retrain()`` fits each affected trainer again from its recipe, without them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmtrain.data.snapshot import key_repr
from llmtrain.db.backend import Key
from llmtrain.errors import ConfigError
from llmtrain.provenance.lineage import FORGOTTEN, TrainedOn, trained_on

if TYPE_CHECKING:
    from llmtrain.stores.handle import Components

log = logging.getLogger("llmtrain")


@dataclass
class Forgotten:
    """What a forget request found: the runs, checkpoints and models that trained on the
    rows, and the trainers (identifier, version) to retrain without them."""

    db: Components
    found: TrainedOn
    trainers: list[tuple[str, int]] = field(default_factory=list)
    retrained: list[Any] = field(default_factory=list)  # the models retrain() made

    @property
    def models(self) -> list[tuple[str, int]]:
        return self.found.models

    @property
    def checkpoints(self) -> list[Any]:
        return self.found.checkpoints

    @property
    def runs(self) -> list[str]:
        return self.found.runs

    def retrain(self, **fit_options: Any) -> list[Any]:
        """Fit every affected trainer again (its stored recipe and selection, a full run):
        the new runs leave the forgotten rows out and record so. Returns the new models."""
        models = []
        for identifier, version in self.trainers:
            trainer = self.db.load("trainer", identifier, version)
            models.append(trainer.fit(allow_changed_data=True, **fit_options))
        self.retrained = models
        return models


def forget(db: Components, source: Any, keys: Sequence[Key], *, retrain: bool = False) -> Forgotten:
    """Forget the rows ``keys`` of ``source`` (a table or collection name, or a query)."""
    from llmtrain.db.queries import Query

    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or not keys:
        raise ConfigError(f"forget() needs a non-empty list of keys, got {keys!r}")
    if not isinstance(source, (str, Query)) or not source:
        raise ConfigError(f"forget() needs a table or collection name or a query, got {source!r}")
    stored_source = source.to_dict() if isinstance(source, Query) else source
    identifier = source.fingerprint() if isinstance(source, Query) else source
    reprs = sorted({key_repr(k) for k in keys})
    try:
        earlier = db.metadata.get_component(FORGOTTEN, identifier).payload.get("keys") or []
    except LookupError:
        earlier = []
    db.metadata.add_component(
        FORGOTTEN,
        identifier,
        {"source": stored_source, "keys": sorted(set(earlier) | set(reprs))},
        unless_unchanged=True,
    )
    found = trained_on(db, source, keys)
    by_run: dict[str, set[str]] = {}
    for use in found.uses:
        by_run.setdefault(use.run_id, set()).add(key_repr(use.key))
    consumed = set().union(*by_run.values())
    trainers: dict[str, int] = {}
    for run_id in found.runs:
        run = db.metadata.get_run(run_id)
        mine = sorted(set(run.info.get("forgotten_keys") or []) | by_run.get(run_id, consumed))
        db.metadata.update_run(run_id, info={"forgotten_keys": mine})
        trainers[run.identifier] = max(trainers.get(run.identifier, run.version), run.version)
    for run_id in found.underivable:
        log.warning("run %s predates key snapshots: whether it trained on them is unknown", run_id)
    result = Forgotten(db, found, sorted(trainers.items()))
    if retrain:
        result.retrain()
    return result
