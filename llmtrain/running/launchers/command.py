"""The worker command line and its environment, kept apart on purpose.

Everything secret (the database URIs with their passwords) travels in the environment,
which other users cannot read; the command line, which ``ps`` shows everyone, carries only
the run id (and the checkpoint a resume starts from).
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.config.args import Launcher
from llmtrain.errors import ConfigError

if TYPE_CHECKING:
    from llmtrain.datalayer import Datalayer

DB_ENV = "LLMTRAIN_DB_URI"
METADATA_ENV = "LLMTRAIN_METADATA_URI"
ARTIFACTS_ENV = "LLMTRAIN_ARTIFACTS"
JOB_ENV = "LLMTRAIN_JOB_DIR"  # where workers write their pid and, on failure, the traceback
WORKER_MODULE = "llmtrain.running.launchers.worker"


@dataclass(frozen=True)
class WorkerCommand:
    argv: list[str]
    env: dict[str, str]  # added to the parent's environment for the launcher and workers


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def artifacts_location(db: Datalayer) -> str:
    """A spec a worker can reopen the same artifact store from: a folder, ``gridfs`` or an
    fsspec URL (which carries no credentials: workers find theirs in the environment)."""
    from llmtrain.stores.artifacts import LocalArtifactStore, is_url
    from llmtrain.stores.artifacts.fsspec_store import FsspecArtifactStore

    spec = db.artifacts_spec
    if spec == "gridfs" or (spec is not None and is_url(spec)):
        return str(spec)
    if spec is not None:
        return str(Path(spec).expanduser().absolute())
    store = db.artifacts
    if isinstance(store, LocalArtifactStore):
        return str(store.root)
    if isinstance(store, FsspecArtifactStore):
        return store.url
    if type(store).__name__ == "GridFSArtifactStore":
        return "gridfs"
    raise ConfigError(
        f"worker processes cannot reopen the artifact store {store!r}: connect "
        "with artifacts= a folder, 'gridfs' or a URL to train with a launcher"
    )


def _flags(**values: object) -> list[str]:
    """``--name value`` pairs, in the order given."""
    return [item for name, value in values.items() for item in (f"--{name}", str(value))]


def launcher_argv(launcher: Launcher, port: int) -> list[str]:
    """``torchrun`` or ``deepspeed`` (as ``python -m``, so this interpreter) up to the module."""
    if launcher.kind == "torchrun":
        flags = _flags(
            nproc_per_node=launcher.num_processes,
            nnodes=launcher.num_nodes,
            node_rank=launcher.node_rank,
            master_addr=launcher.master_addr,
            master_port=port,
            max_restarts=0,
        )
        return [sys.executable, "-m", "torch.distributed.run", *flags, "-m"]
    if launcher.kind == "deepspeed":
        argv = [sys.executable, "-m", "deepspeed.launcher.runner"]
        argv += _flags(num_gpus=launcher.num_processes, master_port=port)
        if launcher.hostfile:
            argv += ["--hostfile", launcher.hostfile]
        if launcher.num_nodes > 1:
            argv += ["--num_nodes", str(launcher.num_nodes)]
        if launcher.node_rank:  # this node only, started by the caller on every node
            argv += ["--no_ssh", "--node_rank", str(launcher.node_rank)]
        if launcher.hostfile or launcher.node_rank:
            argv += ["--master_addr", launcher.master_addr]
        return [*argv, "--module"]
    raise ConfigError(f"launcher kind {launcher.kind!r} starts no worker processes")


def build_command(
    launcher: Launcher,
    db: Datalayer,
    job_dir: Path,
    *,
    run_id: str,
    resume_from: str | None,
    merge: bool,
) -> WorkerCommand:
    # master_port (>= 1) is set for several nodes: Launcher's validator sees to it
    port = launcher.master_port or free_port(launcher.master_addr)
    argv = [
        *launcher_argv(launcher, port),
        WORKER_MODULE,
        *("--run-id", run_id, *(["--resume-from", resume_from] if resume_from else [])),
        *(["--merge"] if merge else []),
    ]
    env = {
        DB_ENV: db.secret_uri(),
        METADATA_ENV: db.secret_metadata_uri(),
        ARTIFACTS_ENV: artifacts_location(db),
        JOB_ENV: str(job_dir),
        "PYTHONUNBUFFERED": "1",
    }
    return WorkerCommand(argv, env)
