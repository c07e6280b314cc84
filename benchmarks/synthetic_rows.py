"""The benchmarks' synthetic instruction rows: prompts and answers whose word counts are
log-normal (short to long, with a long tail), drawn from a fixed vocabulary and seed. No
imports beyond the standard library, so a bare GPU image can run it."""

from __future__ import annotations

import random
from collections.abc import Sequence

# (mu, sigma, least, most) of the log-normal word count
Words = tuple[float, float, int, int]


def make_rows(
    n: int,
    seed: int,
    vocabulary: Sequence[str],
    *,
    prompt: Words = (2.0, 0.5, 2, 60),
    answer: Words = (2.6, 0.8, 1, 150),
    verbs: Sequence[str] = (),
) -> list[tuple[int, str, str]]:
    """``(id, instruction, output)`` rows; each instruction starts with one of ``verbs``
    (drawn) or "Explain"."""
    rng = random.Random(seed)

    def count(mu: float, sigma: float, least: int, most: int) -> int:
        return min(most, max(least, int(rng.lognormvariate(mu, sigma))))

    rows = []
    for i in range(n):
        k_in, k_out = count(*prompt), count(*answer)
        verb = rng.choice(verbs) if verbs else "Explain"
        instruction = f"{verb} " + " ".join(rng.choices(vocabulary, k=k_in)) + "?"
        rows.append((i, instruction, " ".join(rng.choices(vocabulary, k=k_out)) + "."))
    return rows
