"""What the main process shows while it trains: a tqdm bar on a terminal, plain lines elsewhere
(a bar's redraws piped to a CI log made one 20 kB line for a 60-step fit)."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    """Shows the steps of one run (silently); ``close`` when done. ``shown``: the objective's
    metrics shown after the loss (rewards, KL)."""

    shown: tuple[str, ...] = ()

    def extra(self, metrics: dict[str, float]) -> dict[str, str]:
        return {k.rsplit("/", 1)[-1]: f"{metrics[k]:.4g}" for k in self.shown if k in metrics}

    def step(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def evaluated(self, step: int, eval_loss: float) -> None:
        pass

    def close(self) -> None:
        pass


class Bar(Progress):
    """A tqdm bar with the newest loss, learning rate and throughput as its postfix."""

    def __init__(self, desc: str, total: int, initial: int, stream: TextIO) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total, initial=initial, unit="step", dynamic_ncols=True, desc=desc, file=stream
        )

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{metrics['loss']:.4f}",
            lr=f"{metrics['lr']:.2e}",
            tok_s=f"{metrics['tokens_per_s']:.0f}",
            **self.extra(metrics),
        )

    def evaluated(self, step: int, eval_loss: float) -> None:
        self.bar.write(f"{self.bar.desc}: step {step} eval_loss {eval_loss:.4f}")

    def close(self) -> None:
        self.bar.close()


class Lines(Progress):
    """One flushed line per logged step and per evaluation."""

    def __init__(self, desc: str, total: int, every: int, stream: TextIO) -> None:
        self.desc, self.total, self.every, self.stream = desc, total, every, stream

    def step(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every and step != self.total:
            return
        self._say(
            f"step {step}/{self.total} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
            f"tokens/s {metrics['tokens_per_s']:.0f}"
            + "".join(f" {k} {v}" for k, v in self.extra(metrics).items())
        )

    def evaluated(self, step: int, eval_loss: float) -> None:
        self._say(f"step {step}/{self.total} eval_loss {eval_loss:.4f}")

    def _say(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self.stream, flush=True)


def make_progress(
    desc: str, total: int, initial: int, every: int, stream: Any = None, shown: Any = ()
) -> Progress:
    """A bar when ``stream`` (default: stderr, where tqdm writes) is a terminal, else lines."""
    stream = sys.stderr if stream is None else stream
    made: Progress = Lines(desc, total, every, stream)
    if getattr(stream, "isatty", lambda: False)():
        made = Bar(desc, total, initial, stream)
    made.shown = tuple(shown)
    return made
