"""Database URIs: which backend serves them, and how to show them without secrets."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"
_SECRET_PARAMS = re.compile(r"(pass(word)?|pwd|secret|token|key|credential)", re.IGNORECASE)


def scheme_of(uri: str) -> str:
    """The URI's scheme without a driver suffix: ``postgresql+psycopg`` -> ``postgresql``."""
    scheme = uri.split("://", 1)[0] if "://" in uri else uri.split(":", 1)[0]
    return scheme.split("+", 1)[0].lower()


def is_mongo_uri(uri: str) -> bool:
    return scheme_of(uri) in {"mongodb", "mongomock"}  # mongodb+srv: scheme_of drops +srv


def redact_uri(uri: str) -> str:
    """Hide the password in the authority and any secret-looking query parameter."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    userinfo, _, host = parts.netloc.rpartition("@")
    netloc = f"{userinfo.split(':', 1)[0]}:{REDACTED}@{host}" if ":" in userinfo else parts.netloc
    pairs = [
        (k, REDACTED if _SECRET_PARAMS.search(k) else v)
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    ]
    query = urlencode(pairs, safe="*") if parts.query else ""
    if netloc == parts.netloc and query == parts.query:
        return uri  # nothing secret; urlunsplit would turn sqlite:///x.db into sqlite:/x.db
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
