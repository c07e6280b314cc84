"""Conversations from message rows: ``lt.Conversations(lt.Table("messages"), by=, order=)``
groups one row per message into one training row per conversation, keyed by the group key.
The snapshot records each conversation's last turn, so one that grows after it trains as it
was; bad conversations are skipped (or refused) with a line naming them; the chat template
renders each whole, its assistant tokens the targets, as TRL's assistant-only loss does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import fill
from transformers import AutoTokenizer

import llmtrain as lt
from llmtrain.data import take_snapshot
from llmtrain.data.snapshot import MemoryStore
from llmtrain.db.queries import Conversations
from llmtrain.errors import BadRowError, ConfigError
from llmtrain.formatting import IGNORE_INDEX, Formatter

CHATS: dict[int, list[tuple[str, str]]] = {
    1: [("user", "hi"), ("assistant", "hello there")],
    2: [("system", "be brief"), ("user", "two plus two"), ("assistant", "four")],
    3: [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")],
    4: [("user", "lonely question")],  # no assistant turn
    5: [("user", "x"), ("wizard", "y"), ("assistant", "z")],  # unknown role
    6: [("user", "x"), ("tool", "42"), ("assistant", "z")],  # a tool result with no call
    7: [("user", "call it"), ("assistant", "calling"), ("tool", "42"), ("assistant", "42!")],
}
GOOD = [1, 2, 3, 7]


def _message_rows(chats: dict[int, list[tuple[str, str]]], first_id: int = 0) -> list[dict]:
    rows = []
    for cid, turns in chats.items():
        for turn, (role, content) in enumerate(turns):
            rows.append(
                {"id": first_id + len(rows), "conversation_id": cid, "turn": turn * 10}
                | {"role": role, "content": content}
            )
    return rows


def _select(uri: str) -> Conversations:
    messages = lt.Collection("messages") if uri.startswith("mongo") else lt.Table("messages")
    return lt.Conversations(messages, by="conversation_id", order="turn")


def _read(db: Any, select: Conversations, snapshot: Any, store: Any, **kwargs: Any) -> dict:
    ds = lt.CachedQueryDataset(
        db, select, "messages", snapshot=snapshot, store=store, shuffle=False, **kwargs
    )
    return {row["_key"]: row["messages"] for row in ds}


def test_a_conversation_trains_as_the_snapshot_saw_it(any_uri: str) -> None:
    fill(any_uri, "messages", _message_rows(CHATS))
    db, select, store = lt.connect(any_uri), _select(any_uri), MemoryStore()
    snapshot = take_snapshot(db, select, store=store)
    assert snapshot.count == len(CHATS)  # conversations, not messages
    # the application goes on: conversation 1 grows, conversation 8 starts
    fill_more = _message_rows({1: [("user", "more?"), ("assistant", "no")], 8: CHATS[1]}, 100)
    for row in fill_more:
        row["turn"] += 1000 if row["conversation_id"] == 1 else 0
    _insert(any_uri, fill_more)
    read = _read(db, select, snapshot, store, on_bad_row="skip", return_keys=True)
    assert sorted(read) == GOOD  # 4, 5, 6 skipped; 8 came after the snapshot
    assert read[1] == [{"role": r, "content": c} for r, c in CHATS[1]]  # as it was
    assert read[7][2] == {"role": "tool", "content": "42"}
    fresh = take_snapshot(db, select, store=store)  # the next run sees the new turns
    assert _read(db, select, fresh, store, on_bad_row="skip", return_keys=True)[1][-1] == {
        "role": "assistant",
        "content": "no",
    }
    with pytest.raises(BadRowError, match=r"key 4: field 'messages' has no assistant turn"):
        _read(db, select, snapshot, store, return_keys=True)


def _insert(uri: str, rows: list[dict]) -> None:
    if uri.startswith("mongo"):
        from llmtrain.db.engines import mongo_database

        mongo_database(uri)["messages"].insert_many(
            [{("_id" if k == "id" else k): v for k, v in r.items()} for r in rows]
        )
        return
    import sqlalchemy as sa

    from llmtrain.db.engines import sql_engine

    table = sa.Table("messages", sa.MetaData(), autoload_with=sql_engine(uri))
    with sql_engine(uri).begin() as conn:
        conn.execute(table.insert(), rows)


def _chat(cid: int) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in CHATS[cid]]


def test_targets_are_the_assistant_tokens_as_trl_masks_them(tiny: Path, tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    trl = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny),
        args=SFTConfig(
            str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], bf16=False, use_cpu=True
        ),
        train_dataset=Dataset.from_list([{"messages": _chat(c)} for c in GOOD]),
        processing_class=tokenizer,
    )
    batch = trl.data_collator([trl.train_dataset[i] for i in range(len(GOOD))])
    formatter = Formatter(tokenizer, chat_template=True, conversations=True, x_field="messages")
    examples = formatter.format_batch([(c, {"messages": _chat(c)}) for c in GOOD])
    for i, (cid, example) in enumerate(zip(GOOD, examples)):
        whole = tokenizer.apply_chat_template(_chat(cid), tokenize=True, return_dict=True)
        assert example.input_ids == list(whole["input_ids"])  # the template applied whole
        n = len(example.input_ids)
        assert batch["input_ids"][i, :n].tolist() == example.input_ids
        assert batch["labels"][i, :n].tolist() == example.labels, cid  # TRL's masking
    two = [t for t in examples[2].labels if t != IGNORE_INDEX]
    assert tokenizer.decode(two) == f"b{tokenizer.eos_token}d{tokenizer.eos_token}"
    last = Formatter(
        tokenizer,
        chat_template=True,
        conversations=True,
        x_field="messages",
        assistant_turns="last",
    )
    (only,) = last.format_batch([(3, {"messages": _chat(3)})])
    assert tokenizer.decode([t for t in only.labels if t != IGNORE_INDEX]) == (
        f"d{tokenizer.eos_token}"
    )


def test_a_long_conversation_loses_its_earliest_exchanges(tiny: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    chat = [{"role": "system", "content": "be brief"}] + [
        {"role": role, "content": f"{role} turn {i}"}
        for i in range(4)
        for role in ("user", "assistant")
    ]
    whole = Formatter(tokenizer, chat_template=True, conversations=True, x_field="m").format(
        {"m": chat}
    )
    limit = len(whole.input_ids) - 5
    cut = Formatter(
        tokenizer, chat_template=True, conversations=True, x_field="m", max_length=limit
    ).format({"m": chat})
    kept = [{"role": "system", "content": "be brief"}, *chat[3:]]  # one exchange dropped
    rendered = tokenizer.apply_chat_template(kept, tokenize=True, return_dict=True)
    assert cut.truncated and cut.input_ids == list(rendered["input_ids"])
    assert len(cut.input_ids) <= limit
    tight = {"max_length": 12, "x_field": "m", "chat_template": True, "conversations": True}
    with pytest.raises(BadRowError, match=r"key 9: field 'm' is longer than max_length=12"):
        Formatter(tokenizer, **tight).format({"m": chat}, key=9)
    skipped = Formatter(tokenizer, on_bad_row="skip", **tight).format({"m": chat}, key=9)
    assert skipped.input_ids == [] and skipped.key == 9  # the collator counts it as skipped


def test_fit_on_conversations_records_and_replays_them(tiny: Path, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'chat.db'}"
    rows = _message_rows({c: CHATS[c] for c in GOOD})
    fill(uri, "messages", rows)
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    select = _select(uri)
    trainer = lt.LLMTrainer(
        "chat", model=tiny, chat_template=True, max_steps=2, batch_size=2, max_length=64
    )
    with pytest.raises(ConfigError, match="fit\\(\\) with no Y"):
        trainer.fit(X="messages", Y="content", db=db, select=select)
    model = trainer.fit(db=db, select=select)
    assert model is not None
    trained = [row.key for row in db.lineage("model", "chat")]
    assert sorted(trained) == GOOD  # conversations, by their key, once each
    by_conversation = lt.Table("messages", key="conversation_id")
    assert db.trained_on(select, 3) and db.trained_on(by_conversation, 7)
    assert not db.trained_on(select, 4)
    # message row 7, by the message table's own key: the conversation holding it trained
    conversation = next(r["conversation_id"] for r in rows if r["id"] == 7)
    assert db.trained_on("messages", 7).runs == db.trained_on(select, conversation).runs != []
    again = db.load("trainer", "chat")
    assert again.config.fit is not None and again.config.fit.X == "messages"
    assert again.fit() is not None  # a replay of the same conversations
    db.forget(select, [3])
    lt.LLMTrainer("chat2", model=tiny, chat_template=True, max_steps=1, batch_size=8).fit(
        db=db, select=select
    )
    assert sorted(row.key for row in db.lineage("model", "chat2")) == [1, 2, 7]


@pytest.mark.parametrize(
    ("template", "problem"),
    [(None, "has no chat template"), ("{{ messages[0]['content'] }}", "generation")],
)
def test_a_chat_template_problem_is_refused_before_anything_is_recorded(
    tiny: Path, tmp_path: Path, template: str | None, problem: str
) -> None:
    import shutil

    model = shutil.copytree(tiny, tmp_path / "model")
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    if template is not None:
        (model / "chat_template.jinja").write_text(template)
    uri = f"sqlite:///{tmp_path / 'chat.db'}"
    fill(uri, "messages", _message_rows({c: CHATS[c] for c in GOOD}))
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    trainer = lt.LLMTrainer("chat", model=model, chat_template=True, max_steps=1)
    with pytest.raises(ConfigError, match=problem):
        trainer.fit(db=db, select=_select(uri))
    assert db.show() == []


def test_bad_and_too_long_conversations_are_skipped_and_recorded(
    tiny: Path, tmp_path: Path
) -> None:
    from llmtrain.data.skips import read_skips

    long = [("user", "tell me everything"), ("assistant", " ".join(["word"] * 200))]
    uri = f"sqlite:///{tmp_path / 'chat.db'}"
    fill(uri, "messages", _message_rows({**CHATS, 9: long}))
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    trainer = lt.LLMTrainer(
        "skips", model=tiny, chat_template=True, on_bad_row="skip", max_length=96, batch_size=8
    )
    trainer.fit(db=db, select=_select(uri))
    (run,) = db.metadata.list_runs("trainer", "skips")
    skipped = {key for key, _ in read_skips(db.artifacts, run.info).skipped.values()}
    assert skipped == {4, 5, 6, 9}  # bad shape (read) and too long (formatted) alike
    assert sorted(row.key for row in db.lineage("model", "skips")) == GOOD


def test_llmtrain_fit_takes_conversations_from_yaml(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmtrain.cli.main import main

    uri = f"sqlite:///{tmp_path / 'chat.db'}"
    fill(uri, "messages", _message_rows({c: CHATS[c] for c in GOOD}))
    config = tmp_path / "chat.yaml"
    config.write_text(
        f"name: yaml-chat\ndb: {uri}\nartifacts: {tmp_path / 'artifacts'}\n"
        f"model_args: {{model_name_or_path: {tiny}}}\n"
        "data_args: {chat_template: true, assistant_turns: last}\n"
        "training_args: {max_steps: 1, per_device_train_batch_size: 4, progress_bar: false}\n"
        "data:\n  select:\n    conversations: {table: messages}\n"
        "    by: conversation_id\n    order: turn\n"
    )
    assert main(["fit", str(config)]) == 0
    db = lt.connect(uri, artifacts=tmp_path / "artifacts")
    fit = db.load("trainer", "yaml-chat").config.fit
    assert fit is not None and fit.X == "messages" and fit.query() == _select(uri)
    assert sorted(row.key for row in db.lineage("model", "yaml-chat")) == GOOD
    capsys.readouterr()
    assert main(["show", "trainer", "yaml-chat", "--db", uri]) == 0  # and its newest run
    shown = "messages (conversations) from conversations of table messages by conversation_id"
    assert capsys.readouterr().out.count(shown) == 2


def test_a_json_column_of_messages_trains_as_conversations(any_uri: str, tiny: Path) -> None:
    import json

    chats = {c: _chat(c) for c in CHATS}
    rows = [
        {"id": c, "history": chat if any_uri.startswith("mongo") else json.dumps(chat)}
        for c, chat in chats.items()
    ]
    rows.append({"id": 99, "history": "not json ["})
    fill(any_uri, "chats", rows)
    db = lt.connect(any_uri)
    ds = lt.CachedQueryDataset(
        db,
        lt.Table("chats") if not any_uri.startswith("mongo") else lt.Collection("chats"),
        "history",
        shuffle=False,
        on_bad_row="skip",
        conversations=True,
        return_keys=True,
    )
    read = {row["_key"]: row["history"] for row in ds}
    assert read == {c: chats[c] for c in GOOD}  # parsed; bad shapes and bad JSON skipped
    assert ds.stats.skipped == 4
    if any_uri.startswith("sqlite"):  # and a fit on it: X names the column, no Y
        trainer = lt.LLMTrainer(
            "json-chat",
            model=tiny,
            chat_template=True,
            on_bad_row="skip",
            max_steps=1,
            batch_size=8,
            max_length=96,
        )
        artifacts = Path(any_uri.removeprefix("sqlite:///")).parent / "artifacts"
        db = lt.connect(any_uri, artifacts=artifacts)
        trainer.fit(X="history", db=db, select=lt.Table("chats"))
        assert sorted(row.key for row in db.lineage("model", "json-chat")) == GOOD


def test_forgetting_a_message_leaves_its_conversation_out(
    any_uri: str, tiny: Path, tmp_path: Path
) -> None:
    rows = _message_rows({c: CHATS[c] for c in GOOD})
    fill(any_uri, "messages", rows)
    db = lt.connect(any_uri, artifacts=tmp_path / "artifacts")
    message = next(r["id"] for r in rows if r["conversation_id"] == 3 and r["turn"] == 20)
    db.forget("messages", [message])  # one message, by the message table's own key
    trainer = lt.LLMTrainer("forgets", model=tiny, chat_template=True, max_steps=1, batch_size=8)
    trainer.fit(db=db, select=_select(any_uri))
    assert sorted(row.key for row in db.lineage("model", "forgets")) == [1, 2, 7]
    (run,) = db.metadata.list_runs("trainer", "forgets")
    assert [f["keys"] for f in run.info["forgets"].values()] == [1]
    # the forget names the runs that trained its conversation, by the message's own key
    assert db.forget("messages", [message]).runs == []  # none did: it was left out since
