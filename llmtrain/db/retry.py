"""The bounded exponential backoff a backend retries a read with (``DataBackend._with_retry``)."""

from __future__ import annotations

import random
from dataclasses import dataclass


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
