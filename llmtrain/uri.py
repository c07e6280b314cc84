"""Database URIs: which backend serves them, and how to show them without secrets."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode

REDACTED = "***"
_SECRET_PARAMS = re.compile(r"(pass(word)?|pwd|secret|token|key|credential)", re.IGNORECASE)
_USER_INFO = re.compile(r"([^:/@]*):([^@]*)@")  # user:password@, as SQLAlchemy's URL pattern


def scheme_of(uri: str) -> str:
    """The URI's scheme without a driver suffix: ``postgresql+psycopg`` -> ``postgresql``."""
    scheme = uri.split("://", 1)[0] if "://" in uri else uri.split(":", 1)[0]
    return scheme.split("+", 1)[0].lower()


def is_mongo_uri(uri: str) -> bool:
    return scheme_of(uri) in {"mongodb", "mongomock"}  # mongodb+srv: scheme_of drops +srv


def redact_uri(uri: str) -> str:
    """Hide the password and any secret-looking query parameter. The user info is read as the
    drivers read it (SQLAlchemy, pymongo): the password runs to the next ``@``, so one holding
    ``/``, ``?`` or ``#`` is hidden whole."""
    if "://" not in uri:
        return uri
    scheme, rest = uri.split("://", 1)
    if user := _USER_INFO.match(rest):
        rest = f"{user.group(1)}:{REDACTED}@{rest[user.end() :]}"
    base, mark, query = rest.partition("?")
    query, hash_mark, fragment = query.partition("#")
    pairs = [
        (k, REDACTED if _SECRET_PARAMS.search(k) else v)
        for k, v in parse_qsl(query, keep_blank_values=True)
    ]
    if any(v == REDACTED for _, v in pairs):
        query = urlencode(pairs, safe="*")
    return f"{scheme}://{base}{mark}{query}{hash_mark}{fragment}"
