"""Running the launcher: stream its output, notice the first failing rank, leave nothing. The
launcher and every worker (pids in the job folder: torchrun gives each its own session) are
signalled by process group on failure, timeout or Ctrl-C, then killed if they linger."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from llmtrain.errors import DistributedError

POLL_S = 0.2
GRACE_S = 3.0
TAIL_LINES = 200


def alive(pid: int) -> bool:
    """Running (a zombie has finished: it only waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone
        return False


class WorkerJob:
    """One launcher process and the workers it starts."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        job_dir: Path,
        *,
        timeout_s: float | None = None,
        echo: IO[str] | None = None,
    ) -> None:
        self.argv, self.env, self.job_dir, self.timeout_s = argv, env, job_dir, timeout_s
        self.echo, self.echo_err = echo or sys.stdout, echo or sys.stderr
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.worker_pids: set[int] = set()
        self.proc: subprocess.Popen[str] | None = None

    def run(self) -> None:
        """DistributedError (with the first failing rank's error) on failure."""
        for sub in ("pids", "errors"):
            (self.job_dir / sub).mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            bufsize=1,
        )
        readers = [  # the workers' stdout to ours, their stderr (warnings, logs) to ours
            threading.Thread(target=self._stream, args=(pipe, echo), daemon=True)
            for pipe, echo in ((self.proc.stdout, self.echo), (self.proc.stderr, self.echo_err))
        ]
        for reader in readers:
            reader.start()
        started = time.monotonic()
        try:
            while self.proc.poll() is None:
                self._note_workers()
                if self.first_error() is not None:
                    break
                if self.timeout_s and time.monotonic() - started > self.timeout_s:
                    raise DistributedError(
                        f"the distributed job did not finish within "
                        f"{self.timeout_s:g} s and was stopped"
                    )
                time.sleep(POLL_S)
        finally:
            self.stop()  # notes the workers last started, too
            for reader in readers:
                reader.join(timeout=5)
        if (failure := self.first_error()) is not None:
            rank, text = failure
            err = DistributedError(f"rank {rank} failed: {text.strip().splitlines()[0]}\n{text}")
            err.rank, err.details = rank, text  # type: ignore[attr-defined]
            raise err
        if self.proc.returncode != 0:
            tail = "".join(list(self.tail)[-40:])
            raise DistributedError(
                f"the launcher exited with status {self.proc.returncode} "
                f"and no rank reported an error; its last output:\n{tail}"
            )

    def _stream(self, pipe: IO[str] | None, echo: IO[str]) -> None:
        assert pipe is not None
        for line in pipe:
            self.tail.append(line)
            with contextlib.suppress(OSError, ValueError):  # a closed notebook stream
                echo.write(line)
                echo.flush()

    def _note_workers(self) -> None:
        for path in (self.job_dir / "pids").glob("rank*"):
            with contextlib.suppress(ValueError):  # being written
                self.worker_pids.add(int(path.read_text().strip()))

    def first_error(self) -> tuple[int, str] | None:
        """The rank whose traceback was written first (later ones are usually its echo)."""
        errors = (self.job_dir / "errors").glob("rank*.txt")
        for path in sorted(errors, key=lambda p: p.stat().st_mtime_ns):
            text = path.read_text(errors="replace")
            if text.strip():
                return int(path.name[4:-4]), text
        return None

    def pids(self) -> list[int]:
        return ([self.proc.pid] if self.proc is not None else []) + sorted(self.worker_pids)

    def stop(self) -> None:
        """SIGTERM every process group involved, SIGKILL what is left after a grace period."""
        assert self.proc is not None
        self._note_workers()
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(alive(p) for p in self.pids()):
            self.proc.poll()  # reap the launcher
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=GRACE_S)

    def _signal(self, sig: int) -> None:
        for pid in filter(alive, self.pids()):
            with contextlib.suppress(ProcessLookupError):
                group = os.getpgid(pid)
                if group != os.getpgrp():
                    os.killpg(group, sig)
                else:
                    os.kill(pid, sig)
