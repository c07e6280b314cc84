"""Incremental fits read what earlier runs trained as data: each run's trained rows are kept as
sorted digests beside its record when it completes; a kept array that is gone is derived again
from the run's lineage (said in the log), with the same answer."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import fill

import llmtrain as lt
from llmtrain.db.engines import sql_engine
from llmtrain.testing import tiny_model

TEMPLATE = "Q: {X}\nA: {Y}"


def _trainer(tiny: Path) -> lt.LLMTrainer:
    return lt.LLMTrainer(
        "nightly",
        model=tiny,
        prompt_template=TEMPLATE,
        num_train_epochs=1,
        batch_size=4,
        lora_r=4,
        progress_bar=False,
        version_column="v",
    )


def _insert(uri: str, ids: range, version: int = 1) -> None:
    with sql_engine(uri).begin() as conn:
        conn.execute(
            sa.text("INSERT INTO docs (id, q, a, v) VALUES (:i, :q, 'a', :v)"),
            [{"i": i, "q": f"question {i}", "v": version} for i in ids],
        )


def test_nightly_fits_read_kept_digests_and_derive_them_again_when_gone(
    tmp_path: Path, caplog: Any
) -> None:
    tiny = tiny_model(tmp_path / "tiny")
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", [{"id": i, "q": f"question {i}", "a": "a", "v": 1} for i in range(12)])
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    _trainer(tiny).fit(X="q", Y="a", db=db, select=lt.Table("docs"))

    def derived() -> set[str]:  # the runs whose digests were derived from their lineage
        return set(re.findall(r"run (\w+): its trained rows' digests derived", caplog.text))

    def nightly(new: range, changed: int | None = None) -> dict[str, Any]:
        _insert(uri, new)
        if changed is not None:
            with sql_engine(uri).begin() as conn:
                conn.execute(
                    sa.text("UPDATE docs SET a = 'b', v = 2 WHERE id = :i"), {"i": changed}
                )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="llmtrain.training"):
            child = db.load("trainer", "nightly").fit(incremental=True)
        assert child is not None
        run = db.metadata.get_run(child.record.run_id)
        return {**run.info["incremental"], "run": run.run_id}

    # each run's digests are kept when it completes: a nightly fit reads them, derives none
    assert db.metadata.list_runs("trainer", "nightly")[0].info["trained"]
    first = nightly(range(12, 15))  # only its own, as it completes
    assert first["new_rows"] == 3 and derived() == {first["run"]}
    second = nightly(range(15, 17), changed=3)  # a changed row is new again
    assert second["new_rows"] == 3 and derived() == {second["run"]}
    runs = db.metadata.list_runs("trainer", "nightly")
    assert all(r.info.get("trained") for r in runs)

    # a kept array gone (another machine's store, a cleanup): derived again, the same answer
    blob = runs[0].info["trained"]
    db.artifacts.delete(blob)
    third = nightly(range(17, 18))
    assert third["new_rows"] == 1
    assert "unreadable" in caplog.text and derived() == {runs[0].run_id, third["run"]}
    assert db.metadata.get_run(runs[0].run_id).info["trained"] == blob  # same digests again
    keys = {row.key for row in db.lineage("model", "nightly")}
    assert keys == set(range(18))
    db.close()


@pytest.mark.parametrize("versions", [[1, 2, "x", None], [b"a", 2.5, "2.5", 3]])
def test_a_pair_digest_changes_with_the_version_alone(versions: list[Any]) -> None:
    from llmtrain.provenance.selection import pair_digests

    digests = pair_digests([7] * len(versions), versions)
    assert len(set(digests.tolist())) == len(versions)
    assert (pair_digests([7], versions[:1]) == digests[:1]).all()
    assert len(set(pair_digests([1, 2], [5, 5]).tolist())) == 2
