"""Bad configurations and hostile names.

Promises: a configuration with an unknown key, a wrong type or an out-of-range value, or with
target modules the model does not have, is rejected with a ``ConfigError`` naming the field
before any row is read. Table, column and key names with quotes, semicolons, spaces or SQL
keywords are quoted (a real table named ``weird "name"; DROP TABLE x`` works and nothing is
dropped); values are only ever bound; component identifiers and artifact ids cannot name a
path; a Mongo filter with ``$where``/``$function`` is refused unless allowed, even when it comes
back from the metadata store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import fill

import llmtrain as lt
from llmtrain.db.engines import sql_engine
from llmtrain.errors import ConfigError, QueryError, StoreError

from .helpers import TEMPLATE, count_reads, doc_rows, trainer


@pytest.fixture
def db(tmp_path: Path) -> Any:
    uri = f"sqlite:///{tmp_path / 'data.db'}"
    fill(uri, "docs", doc_rows(16))
    return lt.connect(uri, artifacts=tmp_path / "artifacts")


# -- configurations ---------------------------------------------------------------------------
BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"warmup": 3}, "unknown option 'warmup'"),
    ({"training_args": {"learning_rate": 1e-3, "lr_warmup": 1}}, "training_args.lr_warmup"),
    ({"data_args": {"cache_size": 0}}, "data_args.cache_size"),
    ({"learning_rate": 0}, "learning_rate"),
    ({"learning_rate": -1e-4}, "learning_rate"),
    ({"learning_rate": "fast"}, "learning_rate"),
    ({"lora_r": 0}, "lora_args.r"),
    ({"lora_r": 2.5}, "lora_args.r"),
    ({"lora_dropout": 1.0}, "lora_args.lora_dropout"),
    ({"bits": 3}, "model_args.bits"),
    ({"bits": 16, "qlora": True}, "model_args.bits"),
    ({"batch_size": "four"}, "per_device_train_batch_size"),
    ({"max_steps": 0}, "max_steps"),
    ({"max_length": 4}, "max_length"),
    ({"on_bad_row": "ignore"}, "on_bad_row"),
    ({"deepspeed_config": {"stage": 4}}, "deepspeed_config.stage"),
    ({"deepspeed_config": {"stage": 0}}, "deepspeed_config.stage"),
    ({"deepspeed_config": {"stage": 2, "offload_param": True}}, "needs stage 3"),
    ({"fsdp_config": {"sharding": "full"}}, "fsdp_config.sharding"),
    ({"launcher": {"kind": "mpirun"}}, "launcher.kind"),
]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    BAD_CONFIGS,
    ids=[next(iter(k)) + "-" + str(i) for i, (k, _) in enumerate(BAD_CONFIGS)],
)
def test_a_bad_configuration_is_rejected_naming_the_field_when_the_trainer_is_built(
    tiny: Path, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        lt.LLMTrainer("bad", model=tiny, prompt_template=TEMPLATE, **kwargs)


#: what only fit() can find wrong: the model, its layers, the rows to evaluate on
FIT_REFUSES: list[tuple[dict[str, Any], str]] = [
    ({"target_modules": ["no_such_proj"]}, r"lora_args.target_modules \['no_such_proj'\]"),
    ({"model": "./no-model-here"}, "model_args.model_name_or_path: no model folder"),
    ({"save_best_by": "eval_loss"}, "save_best_by need rows to evaluate on"),
    ({"eval_metrics": ["exact_match"]}, "eval_metrics need rows to evaluate on"),
    ({"eval_steps": 2}, "eval_steps need rows to evaluate on"),
]


@pytest.mark.parametrize(
    ("kwargs", "field"), FIT_REFUSES, ids=[next(iter(k)) for k, _ in FIT_REFUSES]
)
def test_what_only_fit_can_refuse_is_refused_before_any_read(
    tiny: Path, db: Any, kwargs: dict[str, Any], field: str
) -> None:
    bad = lt.LLMTrainer("bad", prompt_template=TEMPLATE, **{"model": tiny, **kwargs})
    reads = count_reads(db)
    with pytest.raises(ConfigError, match=field):
        bad.fit(X="instruction", Y="output", db=db, select=lt.Table("docs"))
    assert reads.calls == {}  # nothing was read, not even the keys
    assert db.show() == []  # and nothing was stored


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: lt.DeepspeedConfig(stage=4), "DeepspeedConfig.stage"),
        (lambda: lt.DeepspeedConfig(stage=2, offload_param=True), "offload_param needs stage 3"),
        (lambda: lt.LoraArguments(r=0), "LoraArguments.r"),
        (lambda: lt.ModelArguments(model_name_or_path="m", bits=2), "ModelArguments.bits"),
        (lambda: lt.TrainingArguments(learning_rate=0), "TrainingArguments.learning_rate"),
        (lambda: lt.DataArguments(pack=True), "DataArguments.pack: unknown option"),
        (lambda: setattr(lt.DataArguments(), "cache_size", -1), "DataArguments.cache_size"),
    ],
)
def test_argument_models_built_directly_raise_config_errors_too(make: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make()


def test_fit_arguments_of_the_wrong_type_are_config_errors(tiny: Path, db: Any) -> None:
    reads = count_reads(db)
    t = trainer(tiny, "args")
    for bad in [
        {"X": "instruction", "Y": "instruction", "select": lt.Table("docs")},
        {"X": "instruction", "Y": "output", "select": "SELECT * FROM docs"},
        {
            "X": "instruction",
            "Y": "output",
            "select": lt.Table("docs"),
            "allow_changed_data": "maybe",
        },
    ]:
        with pytest.raises(ConfigError):
            t.fit(db=db, **bad)
    assert reads.rows == 0


def test_target_modules_the_model_lacks_are_rejected_before_any_row_is_read(
    tiny: Path, db: Any
) -> None:
    reads = count_reads(db)
    with pytest.raises(ConfigError, match=r"target_modules \['attention'\].*q_proj"):
        trainer(tiny, "targets", target_modules=["q_proj", "attention"]).fit(
            X="instruction", Y="output", db=db, select=lt.Table("docs")
        )
    # refused before the rows' keys were snapshotted: nothing was read
    assert not reads.calls and reads.rows == 0


def test_a_misspelled_column_is_named_and_no_row_is_fetched(tiny: Path, db: Any) -> None:
    reads = count_reads(db)
    with pytest.raises(QueryError, match="no column 'outptu'"):
        trainer(tiny, "typo").fit(X="instruction", Y="outptu", db=db, select=lt.Table("docs"))
    assert reads.rows == 0


# -- names and values in SQL ------------------------------------------------------------------
WEIRD_TABLE = 'weird "name"; DROP TABLE x'
WEIRD_COLUMNS = {"prompt": 'select "a"; DROP TABLE x; --', "answer": "order by", "key": "from"}


def test_hostile_table_and_column_names_are_quoted_and_nothing_is_dropped(
    sql_uri: str, tiny: Path, tmp_path: Path
) -> None:
    engine = sql_engine(sql_uri, create=True)
    meta = sa.MetaData()
    victim = sa.Table("x", meta, sa.Column("id", sa.Integer, primary_key=True))
    weird = sa.Table(
        WEIRD_TABLE,
        meta,
        sa.Column(WEIRD_COLUMNS["key"], sa.Integer, primary_key=True, autoincrement=False),
        sa.Column(WEIRD_COLUMNS["prompt"], sa.Text),
        sa.Column(WEIRD_COLUMNS["answer"], sa.Text),
    )
    meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(victim.insert(), [{"id": 1}])
        conn.execute(
            weird.insert(),
            [
                {
                    WEIRD_COLUMNS["key"]: r["id"],
                    WEIRD_COLUMNS["prompt"]: r["instruction"],
                    WEIRD_COLUMNS["answer"]: r["output"],
                }
                for r in doc_rows(12)
            ],
        )
    db = lt.connect(sql_uri, artifacts=tmp_path / "artifacts")
    select = lt.Table(WEIRD_TABLE).where(f"{_q(engine, WEIRD_COLUMNS['key'])} < :n", n=8)
    ds = lt.CachedQueryDataset(
        db,
        select,
        [WEIRD_COLUMNS["prompt"], WEIRD_COLUMNS["answer"]],
        cache_size=3,
        return_keys=True,
    )
    rows = list(ds)
    assert sorted(r["_key"] for r in rows) == list(range(8))
    assert all(r[WEIRD_COLUMNS["prompt"]].startswith("What is color") for r in rows)
    trainer(tiny, "weird", max_steps=2).fit(
        X=WEIRD_COLUMNS["prompt"], Y=WEIRD_COLUMNS["answer"], db=db, select=select
    )
    with engine.connect() as conn:  # nothing was dropped, nothing was changed
        assert conn.execute(sa.select(sa.func.count()).select_from(victim)).scalar() == 1
        assert conn.execute(sa.select(sa.func.count()).select_from(weird)).scalar() == 12
    assert db.load("trainer", "weird").config.fit.select["name"] == WEIRD_TABLE


def _q(engine: sa.Engine, name: str) -> str:
    return engine.dialect.identifier_preparer.quote(name)


INJECTION = "'; DROP TABLE docs; --"


def test_values_are_only_ever_bound(any_uri: str) -> None:
    fill(
        any_uri,
        "docs",
        [
            {"id": 1, "instruction": INJECTION, "output": "o", "lang": "en"},
            {"id": 2, "instruction": "i", "output": "o", "lang": INJECTION},
        ],
    )
    db = lt.connect(any_uri)
    if any_uri.startswith("mongo"):
        select = lt.Collection("docs").find({"lang": INJECTION})
        none = lt.Collection("docs").find({"lang": {"$eq": INJECTION + " OR 1=1"}})
    else:
        select = lt.Table("docs").where("lang = :lang", lang=INJECTION)
        none = lt.Table("docs").where("lang = :lang", lang="x' OR '1'='1")
    rows = list(lt.CachedQueryDataset(db, select, ["instruction", "output"], return_keys=True))
    assert [r["_key"] for r in rows] == [2]
    assert list(lt.CachedQueryDataset(db, none, ["instruction"])) == []
    everything = lt.QueryDataset(
        db,
        lt.Collection("docs") if any_uri.startswith("mongo") else lt.Table("docs"),
        ["instruction"],
        return_keys=True,
    )
    assert [r["instruction"] for r in everything.rows] == [INJECTION, "i"]  # table intact
    # a stored query replays its values as values too
    stored = lt.Query.from_dict(select.to_dict())
    assert [
        r["_key"] for r in lt.CachedQueryDataset(db, stored, ["instruction"], return_keys=True)
    ] == [2]


def test_parameter_names_cannot_carry_sql() -> None:
    with pytest.raises(QueryError, match="parameter name"):
        lt.Table("docs").where("lang = :l", **{"l OR 1=1; --": "x"})
    with pytest.raises(QueryError, match="single SELECT"):
        lt.sql("SELECT id FROM docs; DROP TABLE docs", key="id")


# -- identifiers and artifact ids -------------------------------------------------------------
@pytest.mark.parametrize(
    "identifier", ["../x", "..", "a/../../b", "/etc/passwd", "..\\x", "x/..", "~root", "a b", ""]
)
def test_identifiers_cannot_name_a_path(tiny: Path, db: Any, identifier: str) -> None:
    with pytest.raises(ConfigError, match="identifier"):
        lt.LLMTrainer(identifier, model=tiny, prompt_template=TEMPLATE)
    with pytest.raises(ConfigError, match="identifier"):
        db.load("trainer", identifier)
    with pytest.raises(ConfigError, match="identifier"):
        db.remove("model", identifier)


@pytest.mark.parametrize(
    "artifact_id",
    [
        "sha256:../../etc/passwd",
        "tree:../../x",
        "../blobs/ab/cd",
        "sha256:" + "a" * 63 + "/",
        "tree:" + "0" * 64 + "/../../x",
    ],
)
def test_artifact_ids_cannot_name_a_path(db: Any, tmp_path: Path, artifact_id: str) -> None:
    store = db.artifacts
    for call in (
        lambda: store.get_bytes(artifact_id),
        lambda: store.exists(artifact_id),
        lambda: store.get_dir(artifact_id, tmp_path / "out"),
        lambda: store.delete(artifact_id),
    ):
        with pytest.raises(StoreError, match="invalid artifact id"):
            call()
    assert not (tmp_path / "out").exists()


# -- server-side JavaScript -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "mongo_filter",
    [
        {"$where": "sleep(10000) || true"},
        {"$or": [{"lang": "en"}, {"$where": "this.a > 1"}]},
        {"$expr": {"$function": {"body": "function() {return true}", "args": [], "lang": "js"}}},
        {"a": {"$elemMatch": {"$where": "1"}}},
        {"$and": [{"$nor": [{"$expr": {"$accumulator": {}}}]}]},
    ],
)
def test_javascript_in_a_filter_is_refused_unless_allowed_also_from_the_store(
    tiny: Path, tmp_path: Path, mongo_filter: dict[str, Any]
) -> None:
    with pytest.raises(QueryError, match="JavaScript"):
        lt.Collection("docs").find(mongo_filter)
    allowed = lt.Collection("docs").find(mongo_filter, allow_javascript=True)
    # a stored query that a tamperer edited to hold JavaScript is refused when replayed
    tampered = {**lt.Collection("docs").to_dict(), "filter": mongo_filter}
    with pytest.raises(QueryError, match="JavaScript"):
        lt.Query.from_dict(tampered)
    assert lt.Query.from_dict(allowed.to_dict()).allow_javascript
