"""Queries are plain data: they round-trip through JSON with a stable fingerprint."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import pytest
from bson import ObjectId

import llmtrain as lt
from llmtrain.db.queries import Query
from llmtrain.errors import QueryError

QUERIES = [
    lt.Table("docs"),
    lt.Table("docs", schema="public", key="uid")
    .where("lang = :l", l="en")
    .where("n < :n", n=5)
    .select("instruction", "output"),
    lt.sql("SELECT d.id, d.q FROM docs d WHERE d.ok = :ok", key="id", ok=True),
    lt.Collection("docs").find({"lang": "en", "n": {"$gte": 3}}, projection=["meta.prompt"]),
    lt.Collection("docs").find(
        {
            "_id": {"$gt": ObjectId("65a000000000000000000000")},
            "at": {"$lt": dt.datetime(2024, 5, 1, 12, 30)},
        }
    ),
]


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.kind)
def test_round_trip_through_json(query: Query) -> None:
    data = json.loads(json.dumps(query.to_dict()))
    back = Query.from_dict(data)
    assert back == query and type(back) is type(query)
    assert back.fingerprint() == query.fingerprint()


def test_mongo_types_survive_the_round_trip() -> None:
    back = Query.from_dict(json.loads(json.dumps(QUERIES[-1].to_dict())))
    assert isinstance(back, lt.Collection)
    assert back.filter["_id"]["$gt"] == ObjectId("65a000000000000000000000")
    assert back.filter["at"]["$lt"] == dt.datetime(2024, 5, 1, 12, 30)


def test_fingerprint_is_stable_across_processes() -> None:
    code = "import llmtrain as lt; print(lt.Table('docs').where('lang = :l', l='en').fingerprint())"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == lt.Table("docs").where("lang = :l", l="en").fingerprint()
    assert other != lt.Table("docs").where("lang = :l", l="fr").fingerprint()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: lt.Table(""), "table name"),
        (lambda: lt.Table("docs").where("a = :x", x=[1, 2]), "only str, int"),
        (lambda: lt.Table("docs").where("a = :x", x=1).where("b = :x", x=2), "already bound"),
        (lambda: lt.sql("SELECT 1; DROP TABLE docs", key="id"), "single SELECT"),
        (lambda: lt.Table("docs").where("1 = 1; DROP TABLE docs"), "without ';'"),
        (lambda: lt.sql("SELECT id FROM docs", key=""), "key="),
        (lambda: lt.Collection("docs").find({"$where": "sleep(1000)"}), r"\$where"),
        (
            lambda: lt.Collection("docs").find({"a": {"$elemMatch": {"$function": {}}}}),
            r"\$function",
        ),
        (lambda: Query.from_dict({"kind": "nope"}), "unknown query kind"),
        (
            lambda: Query.from_dict({"kind": "sql_table", "name": "docs", "filter": {}}),
            "not a stored sql_table query: .*'filter'",
        ),
        (
            lambda: Query.from_dict({"kind": "sql_raw", "text": "SELECT 1"}),
            "not a stored sql_raw query: .*'key'",
        ),
    ],
)
def test_bad_queries_are_refused(make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(QueryError, match=message):
        make()


def test_javascript_allowed_only_on_request() -> None:
    q = lt.Collection("docs").find({"$where": "this.a > 1"}, allow_javascript=True)
    assert Query.from_dict(q.to_dict()).allow_javascript
