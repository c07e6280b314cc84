"""The one way Ray workers reach the database and the stores: calls the driver answers.

Workers never hold the database URI. Each call (read these keys' rows, get a snapshot chunk,
log metrics, record a checkpoint) goes to a small :class:`Broker` actor on the driver's node;
a thread of the driver takes it, runs it against the driver's own connection and answers.
Rows travel as one object-store object per window, straight from the driver to the worker
that asked, and a worker asks for at most two windows at a time (the one it reads and the one
its prefetch thread fetches), so the driver holds a few windows per worker whatever the
table's size.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from llmtrain.errors import DistributedError

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer

log = logging.getLogger("llmtrain.running.ray")

#: what a worker may ask of the driver's stores: reads of its rows and of the run's state,
#: and the writes a run makes (metrics, status, checkpoints); nothing else is served
SERVED: dict[str, frozenset[str]] = {
    "backend": frozenset({"fetch_by_keys"}),
    "metadata": frozenset(
        {
            "get_run",
            "update_run",
            "log_metrics",
            "list_checkpoints",
            "add_checkpoint",
            "remove_checkpoint",
        }
    ),
    "artifacts": frozenset({"get_bytes", "exists", "delete", "get_dir", "put_dir"}),
}
Files = dict[str, bytes]  # a folder as relative path -> content


class Broker:
    """Ray actor on the driver's node: workers' calls wait here until the driver answers."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._calls: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()  # binds a loop on use

    async def call(self, request: Any) -> Any:
        """A worker's call; returns the driver's answer."""
        call_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answer
        self._calls.put_nowait((call_id, request))
        return await answer

    async def take(self, timeout_s: float) -> tuple[int, Any] | None:
        """The next call for the driver, or None after ``timeout_s``."""
        try:
            return await asyncio.wait_for(self._calls.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def answer(self, call_id: int, reply: Any) -> None:
        waiting = self._waiting.pop(call_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(reply)


# -- the worker's side -------------------------------------------------------------------------
class Channel:
    """A worker's line to the driver."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker

    def call(self, target: str, method: str, *args: Any, **kwargs: Any) -> Any:
        kind, value = ray.get(self.broker.call.remote((target, method, args, kwargs)))
        if kind == "error":
            raise value
        return ray.get(value[0]) if kind == "ref" else value


class _Proxy:
    """``db.metadata`` / ``db.backend`` on a worker: each method is a call to the driver."""

    def __init__(self, channel: Channel, target: str) -> None:
        self._channel, self._target = channel, target

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in SERVED[self._target]:
            raise AttributeError(f"a Ray worker cannot call {self._target}.{method}")
        return lambda *args, **kwargs: self._channel.call(self._target, method, *args, **kwargs)


class RemoteArtifacts(_Proxy):
    """The artifact store through the driver; folders travel as their files."""

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel, "artifacts")

    def get_dir(self, artifact_id: str, dest: str | Path) -> Path:
        dest = Path(dest)
        write_files(self._channel.call("artifacts", "get_dir", artifact_id), dest)
        return dest

    def put_dir(self, path: str | Path) -> str:
        return str(self._channel.call("artifacts", "put_dir", read_files(Path(path))))


class RemoteDB:
    """What a run on a Ray worker sees of the database: the driver's, through its channel.
    ``backend`` is the worker's own connection when the workers read the database."""

    def __init__(self, channel: Channel, backend: Any = None, uri: str = "ray-driver://") -> None:
        self.uri = uri
        self.backend = backend if backend is not None else _Proxy(channel, "backend")
        self.metadata = _Proxy(channel, "metadata")
        self.artifacts = RemoteArtifacts(channel)


def read_files(folder: Path) -> Files:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write_files(files: Files, dest: Path) -> None:
    for rel, data in files.items():
        path = dest / rel
        if dest.resolve() not in path.resolve().parents:
            raise DistributedError(f"refused a file outside its folder: {rel!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


# -- the driver's side -------------------------------------------------------------------------
class DriverService:
    """Answers the workers' calls from ``threads`` threads of the driver (one window read
    each at a time: the driver's memory is bounded by them) while ``TorchTrainer.fit()``
    blocks its main thread. ``extra`` adds the driver's own calls (``driver.<name>``)."""

    def __init__(
        self, db: Datalayer, extra: dict[str, Callable[..., Any]], *, threads: int = 2
    ) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.db, self.extra = db, extra
        here = ray.get_runtime_context().get_node_id()  # the broker runs on the driver's node
        self.broker: Any = (
            ray.remote(Broker)
            .options(
                num_cpus=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            )
            .remote()
        )
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve, name=f"llmtrain-ray-driver-{i}", daemon=True)
            for i in range(threads)
        ]
        self.calls = 0

    def __enter__(self) -> DriverService:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        ray.kill(self.broker)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                item = ray.get(self.broker.take.remote(0.5))
            except Exception:  # noqa: BLE001 - the broker is gone: Ray shut down
                if not self._stop.is_set():
                    log.exception("the Ray driver's broker stopped answering")
                return
            if item is None:
                continue
            call_id, (target, method, args, kwargs) = item
            self.calls += 1
            self.broker.answer.remote(call_id, self._reply(target, method, args, kwargs))

    def _reply(self, target: str, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        try:
            value = self._run(target, method, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - raised again in the worker
            return ("error", _portable(exc))
        if target == "backend" or method == "get_dir":  # rows and files: one object each
            return ("ref", [ray.put(value)])
        return ("value", value)

    def _run(self, target: str, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if target == "driver" and method in self.extra:
            return self.extra[method](*args, **kwargs)
        if method not in SERVED.get(target, ()):
            raise DistributedError(f"a Ray worker asked for {target}.{method}, which is not served")
        if (target, method) == ("artifacts", "get_dir"):
            with tempfile.TemporaryDirectory(prefix="llmtrain-ray-get-") as folder:
                self.db.artifacts.get_dir(args[0], Path(folder) / "d")
                return read_files(Path(folder) / "d")
        if (target, method) == ("artifacts", "put_dir"):
            with tempfile.TemporaryDirectory(prefix="llmtrain-ray-put-") as folder:
                write_files(args[0], Path(folder))
                return self.db.artifacts.put_dir(folder)
        return getattr(getattr(self.db, target), method)(*args, **kwargs)


def _portable(exc: Exception) -> Exception:
    """The error itself when it survives pickling, else one that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any error that does not round-trip
        return DistributedError(f"{type(exc).__name__}: {exc}")
