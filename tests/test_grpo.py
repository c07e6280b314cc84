"""GRPO from the database: TRL's loss on the same answers, rewards the database computes (read-only,
a bad one recorded, not a crash) or a function, learning on a tiny model, and every sampled answer
kept as a row a later fit selects from."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from conftest import fill

import llmtrain as lt
from llmtrain.errors import ConfigError
from llmtrain.objectives.grpo import advantages, grpo_loss, nanstd

LETTERS = "eatn"
ROWS = [
    {"id": i, "prompt": f"write the letter {LETTERS[i % 4]}", "letter": LETTERS[i % 4]}
    for i in range(16)
]
#: the share of the answer's characters that are the row's stored letter, computed by the database
SHARE = (
    "SELECT (length(:completion) - length(replace(:completion, letter, ''))) * 1.0 / "
    "{longest} FROM qa WHERE id = :key"
)
OPTIONS: dict[str, Any] = {
    "objective": "grpo",
    "prompt_template": "Q: {X}\nA: {Y}",
    "max_length": 48,
    "batch_size": 4,
    "lora_dropout": 0.0,
    "logging_steps": 1,
    "progress_bar": False,
    "max_new_tokens": 8,
    "num_generations": 4,
    "beta": 0.04,
}


def letter_share(prompts: list[str], completions: list[str], letter: list[str], **_: Any) -> Any:
    """A function reward, as TRL calls one: the row's fields come as keywords."""
    return [c.count(t) / 8 for c, t in zip(completions, letter)]


def _db(uri: str, tmp_path: Path) -> Any:
    fill(uri, "qa", ROWS)
    return lt.connect(uri, artifacts=tmp_path / "artifacts")


def _rewards(db: Any, name: str) -> list[float]:
    (run,) = db.metadata.list_runs("trainer", name)
    return [m.values["reward"] for m in db.metadata.get_metrics(run.run_id)]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_the_loss_equals_trls_on_the_same_answers(loss_type: str) -> None:
    """TRL 1.16's GRPOTrainer._compute_loss and ours, fed the same per-token log-probs, old and
    reference log-probs, advantages and answer mask: loss and gradient alike to 1e-5."""
    from trl import GRPOTrainer

    torch.manual_seed(0)
    n, t = 6, 5
    logps = (torch.randn(n, t) * 0.3 - 2).requires_grad_()
    old, ref = logps.detach() + torch.randn(n, t) * 0.2, logps.detach() + torch.randn(n, t) * 0.1
    mask = (torch.arange(t)[None] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]).long()
    adv = torch.randn(n)
    options = {"beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": loss_type}
    trl = SimpleNamespace(
        **{k: v for k, v in options.items() if k != "epsilon"},
        epsilon_low=0.2,
        max_completion_length=t,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        accelerator=SimpleNamespace(
            reduce=lambda x, reduction: x, gather=lambda x: x, num_processes=1
        ),
        _metrics={"train": __import__("collections").defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros(n, t), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(n, 2, dtype=torch.long),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    theirs = GRPOTrainer._compute_loss(trl, None, inputs)
    (their_grad,) = torch.autograd.grad(theirs, logps)
    ours, metrics = grpo_loss(logps, old, ref, adv, mask, max_new_tokens=t, **options)
    (our_grad,) = torch.autograd.grad(ours, logps)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-5)
    assert metrics["kl"].item() == pytest.approx(trl._metrics["train"]["kl"][0], abs=1e-6)


def test_advantages_are_trls_group_normalised_rewards() -> None:
    """The weighted sum less its group's mean over the group's std (+1e-4); an answer no reward
    scored (NaN) has advantage 0 and stays out of its group's mean."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, float("nan")], [float("nan")] * 2])
    out, total = advantages(rewards, [1.0, 2.0], 2, "group")
    torch.testing.assert_close(total[:3], torch.tensor([1.0, 2.0, 0.5]))
    std = nanstd(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(out[:2], (torch.tensor([1.0, 2.0]) - 1.5) / (std + 1e-4))
    assert out[2] == 0 and out[3] == 0 and torch.isnan(total[3])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_tiny_model_learns_what_the_rows_reward(backend: str, tiny: Path, tmp_path: Path) -> None:
    """Answer with the row's letter: SQLite's reward is computed by the database, PostgreSQL's
    by a Python function given the row's fields; the mean reward rises over 50 steps."""
    from conftest import fresh_database

    made = fresh_database(backend, tmp_path)
    db = _db(next(made), tmp_path)
    try:
        rewards = _learn(db, tiny, backend)
    finally:
        db.close()
        made.close()  # a server's database dropped
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last > first + 0.05, (first, last)


def _learn(db: Any, tiny: Path, backend: str) -> list[float]:
    function = f"{__name__}:letter_share"
    reward = lt.sql_reward(SHARE.format(longest="8")) if backend == "sqlite" else function
    options = {**OPTIONS, "max_steps": 50, "learning_rate": 3e-2, "lr_scheduler_type": "constant"}
    lt.LLMTrainer("learns", model=tiny, **options).fit(
        X="prompt", Y="letter", db=db, select=lt.Table("qa"), reward=reward
    )  # Y: the stored answer, a reward's field
    return _rewards(db, "learns")


def test_rollouts_are_rows_a_later_fit_selects_and_bad_rewards_are_recorded(
    tiny: Path, tmp_path: Path
) -> None:
    """Every sampled answer is a row of rollouts_table (run, step, prompt key, answer, rewards,
    advantage); a reward the database cannot compute (NULL) is recorded as missing and the other
    reward still trains; an SFT fit selects the best answers from the table, lineage to them."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    db = _db(uri, tmp_path)
    bad = lt.sql_reward(
        "SELECT CASE WHEN id % 2 = 0 THEN NULL ELSE 1.0 END FROM qa WHERE id = :key"
    )
    options = {**OPTIONS, "max_steps": 2, "rollouts_table": "rollouts"}
    lt.LLMTrainer("rollouts", model=tiny, **options).fit(
        X="prompt",
        db=db,
        select=lt.Table("qa"),
        reward=[bad, lt.sql_reward(SHARE.format(longest=8))],
    )
    (run,) = db.metadata.list_runs("trainer", "rollouts")
    with sa.create_engine(uri).connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM rollouts ORDER BY step, id")).mappings().all()
    assert len(rows) == 2 * 4 * 4 and {r["run_id"] for r in rows} == {run.run_id}
    assert [r["step"] for r in rows] == [1] * 16 + [2] * 16
    by_prompt = {r["prompt_key"] for r in rows}
    assert len(by_prompt) == 8 and all(r["tokens"] <= 8 for r in rows)
    import json

    for r in rows:
        first, second = json.loads(r["rewards"])
        even = int(r["prompt_key"].split(":")[1]) % 2 == 0
        assert (first is None) == even and first in (None, 1.0)
        assert r["reward"] == pytest.approx((first or 0.0) + second)
    best = lt.sql("SELECT id, prompt_key, completion FROM rollouts WHERE advantage > 0", key="id")
    model = lt.LLMTrainer(
        "rft", model=tiny, prompt_template="{X} {Y}", max_length=48, max_steps=1, progress_bar=False
    ).fit(X="prompt_key", Y="completion", db=db, select=best)
    assert model is not None and {c.key for c in db.lineage("model", "rft")} <= {
        r["id"] for r in rows if r["advantage"] > 0
    }


@pytest.mark.parametrize(
    "text",
    [
        "DELETE FROM qa WHERE id = :key",
        "SELECT 1; DELETE FROM qa",
        "UPDATE qa SET letter = 'x' RETURNING 1",
    ],
)
def test_a_sql_reward_that_writes_is_refused_before_anything_is_recorded(
    text: str, tiny: Path, tmp_path: Path
) -> None:
    db = _db(f"sqlite:///{tmp_path / 'data.db'}", tmp_path)
    with pytest.raises(ConfigError, match="not a single SELECT"):
        lt.LLMTrainer("writes", model=tiny, **OPTIONS, max_steps=1).fit(
            X="prompt", db=db, select=lt.Table("qa"), reward=lt.sql_reward(text)
        )
    assert db.metadata.list_runs() == [] and db.show("trainer") == []


def test_a_yaml_fit_takes_its_rewards(tiny: Path, tmp_path: Path) -> None:
    """`llmtrain fit config.yaml`: data.reward as recorded (an SQL reward, a function path)."""
    import yaml

    from llmtrain.cli import main

    uri = f"sqlite:///{tmp_path / 'data.db'}"
    db = _db(uri, tmp_path)
    config = {
        "name": "yaml-grpo",
        "db": uri,
        "artifacts": str(tmp_path / "artifacts"),
        "model_args": {"model_name_or_path": str(tiny)},
        "prompt_template": OPTIONS["prompt_template"],
        "training_args": {"max_steps": 2, "per_device_train_batch_size": 4, "progress_bar": False},
        "objective_args": {"objective": "grpo", "max_new_tokens": 8, "num_generations": 4},
        "data": {
            "X": "prompt",
            "Y": "letter",
            "select": {"table": "qa"},
            "reward": [{"sql": SHARE.format(longest=8)}, {"function": f"{__name__}:letter_share"}],
        },
    }
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    assert main(["fit", str(tmp_path / "grpo.yaml")]) == 0
    (run,) = db.metadata.list_runs("trainer", "yaml-grpo")
    recorded = db.load("trainer", "yaml-grpo").config.fit
    assert recorded is not None and recorded.reward == [
        {"sql": SHARE.format(longest=8), "timeout_s": 10.0},
        {"function": f"{__name__}:letter_share"},
    ]
    assert {"rewards/sql0", "rewards/letter_share"} <= set(
        db.metadata.get_metrics(run.run_id)[0].values
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"])
def test_a_sql_reward_past_its_timeout_or_failing_is_missing_and_writes_nothing(
    backend: str, tmp_path: Path
) -> None:
    """The database stops a reward past ``timeout_s`` and one that errs: each is a missing
    reward (None), the next one still runs, and the statement cannot write."""
    import time

    from conftest import fresh_database

    made = fresh_database(backend, tmp_path)
    db = _db(next(made), tmp_path)
    try:
        slow = (
            "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 100000000) "
            "SELECT count(*) FROM r WHERE :key >= 0"
        )
        if backend == "mariadb":  # its recursion limit would end the CTE first
            slow = "SELECT SLEEP(5) + 1 FROM qa WHERE id = :key"
        started = time.monotonic()
        assert db.backend.scores(slow, [{"key": 1}], 0.5) == [None]
        assert time.monotonic() - started < 10
        failing = "SELECT CAST(letter AS INTEGER) + 1 / (id - id) FROM qa WHERE id = :key"
        sane = "SELECT 2 * id FROM qa WHERE id = :key"
        assert [db.backend.scores(q, [{"key": 3}], 5)[0] for q in (failing, sane)][1] == 6
        assert db.backend.scores(failing, [{"key": 3}], 5) in ([None],)  # SQLite: NULL
        writing = "WITH gone AS (DELETE FROM qa RETURNING id) SELECT count(*) FROM gone"
        if backend == "postgresql":  # a CTE that deletes parses as a SELECT: the database refuses
            assert db.backend.scores(writing, [{}], 5) == [None]
        with sa.create_engine(db.secret_uri()).connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM qa")).scalar() == len(ROWS)
    finally:
        db.close()
        made.close()


def test_a_forgotten_prompt_is_never_sampled(tiny: Path, tmp_path: Path) -> None:
    """db.forget of a prompt row: no later GRPO step samples it (no rollout row names it), and
    trained_on says no run used it."""
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    db = _db(uri, tmp_path)
    db.forget("qa", [3, 7])
    options = {**OPTIONS, "max_steps": 4, "rollouts_table": "rollouts"}
    lt.LLMTrainer("after-forget", model=tiny, **options).fit(
        X="prompt", db=db, select=lt.Table("qa"), reward=lt.sql_reward(SHARE.format(longest=8))
    )
    with sa.create_engine(uri).connect() as conn:
        sampled = {k for (k,) in conn.execute(sa.text("SELECT DISTINCT prompt_key FROM rollouts"))}
    assert sampled == {f"int:{r['id']}" for r in ROWS if r["id"] not in (3, 7)}
    assert not db.trained_on("qa", 3) and db.trained_on("qa", 4)


def test_grpo_on_mongodb_takes_function_rewards_and_refuses_sql_ones(
    tiny: Path, tmp_path: Path
) -> None:
    """MongoDB (mongomock behind the pymongo-shaped backend): a function reward trains and the
    run's lineage names its prompts; an SQL reward, or a rollouts table, is refused up front."""
    uri = f"mongomock://localhost/grpo_{tmp_path.name[-8:]}"
    fill(uri, "qa", ROWS)
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    options = {**OPTIONS, "max_steps": 2}
    model = lt.LLMTrainer("mongo-grpo", model=tiny, **options).fit(
        X="prompt", Y="letter", db=db, select=lt.Collection("qa"), reward=f"{__name__}:letter_share"
    )
    assert model is not None and len(list(db.lineage("model", "mongo-grpo"))) == 2 * 4
    with pytest.raises(ConfigError, match="sql_reward needs an SQL database"):
        lt.LLMTrainer("mongo-sql", model=tiny, **options).fit(
            X="prompt", db=db, select=lt.Collection("qa"), reward=lt.sql_reward("SELECT 1")
        )
    with pytest.raises(ConfigError, match="rollouts_table= writes a table of an SQL database"):
        lt.LLMTrainer("mongo-rollouts", model=tiny, rollouts_table="r", **options).fit(
            X="prompt", db=db, select=lt.Collection("qa"), reward=f"{__name__}:letter_share"
        )
    assert [r.identifier for r in db.metadata.list_runs()] == ["mongo-grpo"]
