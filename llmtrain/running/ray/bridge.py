"""Ray workers reach the database and stores only through calls the driver answers (they
never hold the URI): a call waits in a :class:`Broker` actor until a driver thread runs it.
Rows and folders travel as one object-store object each, straight to the worker that asked."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray

from llmtrain.datalayer import Datalayer
from llmtrain.errors import DistributedError
from llmtrain.stores.artifacts.base import check_relpath

log = logging.getLogger("llmtrain.running.ray")

#: what a worker may ask of the driver's stores: its rows, the run's state and its writes
#: (components: the reference log-probs a preference run keeps)
SERVED: dict[str, set[str]] = {
    "backend": {"fetch_by_keys"},
    "metadata": {
        "get_component",
        "add_component",
        "get_run",
        "update_run",
        "log_metrics",
        "list_checkpoints",
        "add_checkpoint",
        "remove_checkpoint",
    },
    "artifacts": {"get_bytes", "put_bytes", "exists", "delete", "get_dir", "put_dir"},
}


class Broker:
    """Ray actor on the driver's node: workers' calls wait here until the driver answers."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._calls: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()  # binds a loop on use

    async def call(self, request: Any) -> Any:
        call_id = next(self._ids)
        self._waiting[call_id] = answer = asyncio.get_running_loop().create_future()
        self._calls.put_nowait((call_id, request))
        return await answer

    async def take(self, timeout_s: float) -> tuple[int, Any] | None:
        try:
            return await asyncio.wait_for(self._calls.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def answer(self, call_id: int, reply: Any) -> None:
        waiting = self._waiting.pop(call_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(reply)


def call(broker: Any, target: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """``target.method(*args, **kwargs)`` run by the driver; its error is raised here."""
    kind, value = ray.get(broker.call.remote((target, method, args, kwargs)))
    if kind == "error":
        raise value
    return ray.get(value[0]) if kind == "ref" else value


class _Proxy:
    """``db.metadata`` / ``db.backend`` / ``db.artifacts`` on a worker: calls to the driver."""

    def __init__(self, broker: Any, target: str) -> None:
        self._broker, self._target = broker, target

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in SERVED[self._target]:
            raise AttributeError(f"a Ray worker cannot call {self._target}.{method}")
        if (self._target, method) == ("artifacts", "get_dir"):  # a folder comes as its files
            return lambda artifact_id, dest: write_files(
                call(self._broker, "artifacts", "get_dir", artifact_id), Path(dest)
            )
        if (self._target, method) == ("artifacts", "put_dir"):
            return lambda path: str(call(self._broker, "artifacts", "put_dir", read_files(path)))
        return lambda *args, **kwargs: call(self._broker, self._target, method, *args, **kwargs)


class RemoteDB:
    """A Ray worker's view of the driver's database: every call answered by the driver."""

    uri = "ray-driver://"  #: all a worker knows of the database (its plan's ``fit.db`` too)

    def __init__(self, broker: Any) -> None:
        self.backend = _Proxy(broker, "backend")
        self.metadata, self.artifacts = _Proxy(broker, "metadata"), _Proxy(broker, "artifacts")


def read_files(folder: str | Path) -> dict[str, bytes]:
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def write_files(files: dict[str, bytes], dest: Path) -> Path:
    for rel, data in files.items():
        path = dest.joinpath(*check_relpath(rel).split("/"))  # never outside ``dest``
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return dest


@contextlib.contextmanager
def serving(db: Datalayer, extra: dict[str, Callable[..., Any]], *, threads: int) -> Iterator[Any]:
    """A Broker on this node (yielded), answered by ``threads`` driver threads (one window read
    each bounds the driver's memory); ``extra`` adds the driver's own calls (``driver.<name>``)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    options = {"num_cpus": 0, "max_concurrency": 1000, "scheduling_strategy": here}
    broker: Any = ray.remote(Broker).options(**options).remote()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                item = ray.get(broker.take.remote(0.5))
            except Exception:  # noqa: BLE001 - the broker is gone: Ray shut down
                if not stop.is_set():
                    log.exception("the Ray driver's broker stopped answering")
                return
            if item is not None:
                call_id, request = item
                broker.answer.remote(call_id, _reply(db, extra, request))

    workers = [threading.Thread(target=serve, daemon=True) for _ in range(threads)]
    for thread in workers:
        thread.start()
    try:
        yield broker
    finally:
        stop.set()
        for thread in workers:
            thread.join(timeout=10)
        ray.kill(broker)


def _reply(
    db: Datalayer, extra: dict[str, Callable[..., Any]], request: tuple[Any, ...]
) -> tuple[str, Any]:
    target, method, args, kwargs = request
    try:
        if target == "driver" and method in extra:
            value = extra[method](*args, **kwargs)
        elif method not in SERVED.get(target, ()):
            raise DistributedError(f"a Ray worker asked for {target}.{method}, which is not served")
        elif (target, method) == ("artifacts", "get_dir"):
            with tempfile.TemporaryDirectory(prefix="llmtrain-ray-get-") as folder:
                value = read_files(db.artifacts.get_dir(args[0], Path(folder) / "d"))
        elif (target, method) == ("artifacts", "put_dir"):
            with tempfile.TemporaryDirectory(prefix="llmtrain-ray-put-") as folder:
                write_files(args[0], Path(folder))
                value = db.artifacts.put_dir(folder)
        else:
            value = getattr(getattr(db, target), method)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - raised again in the worker
        return ("error", _portable(exc))
    if target == "backend" or method == "get_dir":  # rows and files: one object each
        return ("ref", [ray.put(value)])
    return ("value", value)


def _portable(exc: Exception) -> Exception:
    """The error itself when it survives pickling, else one that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any error that does not round-trip
        return DistributedError(f"{type(exc).__name__}: {exc}")
