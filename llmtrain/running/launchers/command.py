"""The worker command line and its environment: the secrets (the database URIs) travel in
the environment, which other users cannot read, not on the command line ``ps`` shows."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import NamedTuple

from llmtrain.config.args import Launcher
from llmtrain.config.file import DB_ENV  # the same URI a fit reads by default
from llmtrain.datalayer import Datalayer
from llmtrain.errors import ConfigError

METADATA_ENV = "LLMTRAIN_METADATA_URI"
ARTIFACTS_ENV = "LLMTRAIN_ARTIFACTS"
JOB_ENV = "LLMTRAIN_JOB_DIR"  # where workers write their pid and, on failure, the traceback
#: torchrun reads its nodes, processes, node rank and master from PET_NNODES, PET_NPROC_PER_NODE,
#: PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT (Kubeflow Trainer's torch plugin sets them)
PET_ENV = "PET_NNODES"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class WorkerCommand(NamedTuple):
    argv: list[str]
    env: dict[str, str]  # added to the parent's environment for the launcher and workers


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def artifacts_location(db: Datalayer) -> str:
    """A folder or an fsspec URL (credentials from the environment) workers reopen."""
    from llmtrain.stores.artifacts import LocalArtifactStore
    from llmtrain.stores.artifacts.fsspec_store import FsspecArtifactStore

    store, reopened = db.artifacts, (LocalArtifactStore, FsspecArtifactStore)
    if isinstance(store, reopened):
        return store.location
    raise ConfigError(
        f"worker processes cannot reopen the artifact store {store!r}: connect "
        "with artifacts= a folder or a URL to train with a launcher"
    )


def launcher_argv(launcher: Launcher, port: int) -> list[str]:
    """``torchrun`` or ``deepspeed`` (as ``python -m``, so this interpreter) up to the module."""
    if launcher.kind == "torchrun":
        flags = {
            "nproc_per_node": launcher.num_processes,
            "nnodes": launcher.num_nodes,
            "node_rank": launcher.node_rank,
            "master_addr": launcher.master_addr,
            "master_port": port,
            "max_restarts": 0,
        }
        pairs = [item for name, value in flags.items() for item in (f"--{name}", str(value))]
        return [*TORCHRUN, *pairs, "-m"]
    argv = [sys.executable, "-m", "deepspeed.launcher.runner"]
    argv += ["--num_gpus", str(launcher.num_processes), "--master_port", str(port)]
    if launcher.hostfile:
        argv += ["--hostfile", launcher.hostfile]
    if launcher.num_nodes > 1:
        argv += ["--num_nodes", str(launcher.num_nodes)]
    if launcher.node_rank:  # this node only, started by the caller on every node
        argv += ["--no_ssh", "--node_rank", str(launcher.node_rank)]
    if launcher.hostfile or launcher.node_rank:
        argv += ["--master_addr", launcher.master_addr]
    return [*argv, "--module"]


def build_command(
    launcher: Launcher, db: Datalayer, job_dir: Path, *, run_id: str, resume_from: str | None
) -> WorkerCommand:
    # master_port (>= 1) is set for several nodes: Launcher's validator sees to it
    port = launcher.master_port or free_port(launcher.master_addr)
    argv = [
        *launcher_argv(launcher, port),
        "llmtrain.running.launchers.worker",
        *("--run-id", run_id, *(["--resume-from", resume_from] if resume_from else [])),
    ]
    env = {
        DB_ENV: db.secret_uri(),
        METADATA_ENV: db.secret_metadata_uri(),
        ARTIFACTS_ENV: artifacts_location(db),
        JOB_ENV: str(job_dir),
        "PYTHONUNBUFFERED": "1",
        # torchrun sets 1 when unset, with a banner on the fit's output: the same, said quietly
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    return WorkerCommand(argv, env)
