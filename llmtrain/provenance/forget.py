"""``db.forget(source, keys)``: checks the source and keys, then writes one new version of its
``forgotten`` record, which every later run honours. Nothing is deleted (``db.remove`` does)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmtrain.db.keys import DIGEST, Key, key_digests, key_repr
from llmtrain.errors import ConfigError
from llmtrain.provenance.lineage import FORGOTTEN, TrainedOn, chain, forgotten, trained_on

if TYPE_CHECKING:
    from llmtrain.stores.handle import Components

log = logging.getLogger("llmtrain")


@dataclass
class Forgotten:
    """The runs, checkpoints and models that trained on forgotten rows; the trainers to retrain."""

    db: Components
    found: TrainedOn
    trainers: list[tuple[str, int]]

    unmatched: list[Key] = field(default_factory=list)  # keys no row had (recorded all the same)

    def __post_init__(self) -> None:
        self.source = str(self.found.source)
        self.runs, self.checkpoints = self.found.runs, self.found.checkpoints
        self.models = self.found.models

    def retrain(self, **fit_options: Any) -> list[Any]:
        """Fit every affected trainer again, in full, without the forgotten rows: the new models."""
        return [
            self.db.load("trainer", identifier, version).fit(allow_changed_data=True, **fit_options)
            for identifier, version in self.trainers
        ]


def forget(db: Components, source: Any, keys: Sequence[Key], *, retrain: bool = False) -> Forgotten:
    """Forget the rows ``keys`` of ``source`` (a table or collection name, or a query)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or not keys:
        raise ConfigError(f"forget() needs a non-empty list of keys, got {keys!r}")
    resolved = db.backend.resolve(source)
    typed = resolved.typed(keys, "forget()")
    known, earlier_runs = forgotten(db, resolved.identity)
    seen = set(known.tolist())
    new = [k for k, d in zip(typed, key_digests(typed).tolist()) if d not in seen]
    # first the database leaves them out (a fit reading after this commit cannot read them),
    # then the runs that may have read them before are found: none slips between the two
    matched = dict(db.backend.forget_keys(resolved, new)) if new else {}
    rows = [matched.get(i, k) for i, k in enumerate(new)]  # the rows' own keys ("k5" for "K5")
    unmatched = [k for i, k in enumerate(new) if i not in matched]
    typed = list({key_repr(k): k for k in [*typed, *rows]}.values())
    found = trained_on(db, resolved, typed)
    by_run: dict[str, set[str]] = {}
    for use in found.uses:
        by_run.setdefault(use.run_id, set()).add(key_repr(use.key))
    runs = {}
    for run_id in found.runs:  # a run continued from an affected model carries its chain's
        carried = set().union(*(by_run.get(r.run_id, set()) for r, _ in chain(db, run_id)))
        runs[run_id] = sorted(carried - set(earlier_runs.get(run_id, ())))
    fresh = {key_repr(k): d for k, d in zip(typed, key_digests(typed).tolist()) if d not in seen}
    if fresh or any(runs.values()):
        record = {
            "source": resolved.name,
            "key": resolved.key,
            "digest": DIGEST,
            "keys": sorted(fresh),
            "digests": sorted(fresh.values()),
            "unmatched": sorted(map(key_repr, unmatched)),
            "runs": {run_id: keys for run_id, keys in runs.items() if keys},
        }
        db.metadata.add_component(FORGOTTEN, resolved.identity, record)
    trainers: dict[str, int] = {}
    for run_id in found.runs:
        run = db.metadata.get_run(run_id)
        trainers[run.identifier] = max(trainers.get(run.identifier, run.version), run.version)
    for run_id in found.underivable:
        log.warning("run %s: no readable key snapshot, so whether it used them is unknown", run_id)
    result = Forgotten(db, found, sorted(trainers.items()), unmatched)
    if retrain:
        result.retrain()
    return result
