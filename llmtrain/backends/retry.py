"""Bounded exponential backoff around single, idempotent database statements."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from llmtrain.errors import DatabaseUnavailableError

T = TypeVar("T")
log = logging.getLogger("llmtrain.backends")


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; waits ``base * 2**i`` seconds (jittered), at most ``cap``."""

    attempts: int = 6
    base: float = 0.2
    cap: float = 5.0

    def delays(self) -> list[float]:
        return [
            min(self.cap, self.base * 2**i) * (0.5 + random.random() / 2)
            for i in range(self.attempts - 1)
        ]


def with_retry(
    call: Callable[[], T],
    *,
    policy: RetryPolicy,
    transient: tuple[type[BaseException], ...],
    reconnect: Callable[[], None],
    what: str,
    where: str,
    permanent: Callable[[BaseException], bool] = lambda exc: False,
) -> T:
    """Run ``call``; on a transient fault reconnect, back off and try again.

    ``permanent`` picks out errors of a transient type that no retry can cure (a missing
    table, say), so they surface at once instead of after the whole budget.
    """
    delays = policy.delays()
    for attempt in range(policy.attempts):
        try:
            return call()
        except transient as exc:
            if permanent(exc):
                raise
            first_line = str(exc).splitlines()[0] if str(exc) else ""  # one line to show
            if attempt == policy.attempts - 1:
                raise DatabaseUnavailableError(
                    f"{what} on {where} failed after {policy.attempts} attempts: "
                    f"{type(exc).__name__}: {first_line}"
                ) from exc
            log.warning(
                "%s on %s failed (%s: %s); retrying in %.1fs",
                what,
                where,
                type(exc).__name__,
                first_line,
                delays[attempt],
            )
            reconnect()
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")
