"""Kubeflow Trainer V2 without a cluster: the CRDs' schemas and the torch plugin's rendering.

What the pinned release (tests/fixtures/kubeflow-trainer, v2.3.0) does, read from its source
and reproduced here for the manifests in deploy/kubeflow/:

- ``kubectl apply`` checks a custom resource against its CRD's OpenAPI v3 schema, and with
  strict field validation (kubectl's default) refuses a field the schema does not name;
- the JobSet plugin gives the runtime's trainer container (``name: node`` in the replicated
  job labelled ``trainer.kubeflow.org/trainjob-ancestor-step: trainer``) the TrainJob's
  ``image``, ``command`` and ``args`` (each replacing the runtime's when set), and upserts
  its ``env``; ``numNodes`` sets the number of nodes;
- the torch plugin upserts ``PET_NNODES``, ``PET_NPROC_PER_NODE`` (``numProcPerNode``, else
  ``auto`` with GPUs in ``resourcesPerNode``, else its CPU request, else its CPU limit, at
  least 1), ``PET_NODE_RANK`` (the pod's job completion index), ``PET_MASTER_ADDR``
  (``<job>-node-0-0.<job>``) and ``PET_MASTER_PORT`` (29500); a TrainJob may not set them.

A rendered node runs here as a local process group: the Secret's keys are resolved into its
environment, the ConfigMap's files are written to a folder standing for the mount, and the
master's DNS name and port map to 127.0.0.1 and a free port.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "kubeflow"
CRDS = Path(__file__).parent / "fixtures" / "kubeflow-trainer"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
PET = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
MASTER_PORT = 29500


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every document in deploy/kubeflow/ and its subfolders, with its file."""
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def manifest(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in manifests() if d["kind"] == kind]
    return doc


def crd_schema(kind: str) -> dict[str, Any]:
    """The CRD's v1alpha1 schema, closed as strict field validation reads it: an object with
    ``properties`` takes no other field unless it says so."""
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
            return _closed(version["schema"]["openAPIV3Schema"])
    raise LookupError(f"no vendored CRD for kind {kind}")


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    open_ = "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in node and not open_:
        out["additionalProperties"] = False
    return out


def trainer_pod(runtime: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of the replicated job labelled as the trainer."""
    (job,) = [
        r
        for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
        if r["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR) == "trainer"
    ]
    return dict(job["template"]["spec"]["template"]["spec"])


def trainer_container(runtime: dict[str, Any]) -> dict[str, Any]:
    """The container the TrainJob's trainer fields and the PET_* variables go to."""
    (container,) = [c for c in trainer_pod(runtime)["containers"] if c["name"] == "node"]
    return dict(container)


def _cpus(quantity: str | int) -> int:
    """A CPU quantity rounded up to whole CPUs, as resource.Quantity.Value() does."""
    text = str(quantity)
    return math.ceil(int(text[:-1]) / 1000) if text.endswith("m") else math.ceil(float(text))


def _upsert(env: list[dict[str, Any]], more: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = {e["name"]: e for e in env}
    out.update({e["name"]: e for e in more})
    return list(out.values())


@dataclass
class Node:
    """One rendered pod of the trainer job: its container's argv and environment entries."""

    index: int
    argv: list[str]
    env: list[dict[str, Any]]
    mounts: dict[str, str]  # mount path -> ConfigMap name


def render(runtime: dict[str, Any], job: dict[str, Any]) -> list[Node]:
    """The trainer pods of ``job`` on ``runtime``, as the JobSet and torch plugins build them."""
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert "torch" in runtime["spec"]["mlPolicy"], "the torch plugin sets PET_* only then"
    trainer, container = job["spec"].get("trainer", {}), trainer_container(runtime)
    reserved = {e["name"] for e in trainer.get("env", [])} & set(PET)
    assert not reserved, f"the torch plugin's webhook refuses a TrainJob setting {reserved}"
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    resources = trainer.get("resourcesPerNode", container.get("resources", {}))
    nproc = trainer.get("numProcPerNode")
    if nproc is None:
        gpus = any(k.endswith("/gpu") for part in resources.values() for k in part)
        cpu = resources.get("requests", {}).get("cpu") or resources.get("limits", {}).get("cpu")
        nproc = "auto" if gpus else max(1, _cpus(cpu) if cpu else 0)
    argv = trainer.get("command", container.get("command", [])) + trainer.get(
        "args", container.get("args", [])
    )
    env = _upsert(container.get("env", []), trainer.get("env", []))
    name = job["metadata"]["name"]
    volumes = {v["name"]: v for v in trainer_pod(runtime).get("volumes", [])}
    mounts = {
        m["mountPath"]: volumes[m["name"]]["configMap"]["name"]
        for m in container.get("volumeMounts", [])
    }
    rendered = []
    for index in range(nodes):
        pet = dict(zip(PET, (nodes, nproc, index, f"{name}-node-0-0.{name}", MASTER_PORT)))
        values = [{"name": k, "value": str(v)} for k, v in pet.items()]
        rendered.append(Node(index, list(argv), _upsert(env, values), mounts))
    return rendered


def resolve_env(node: Node, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The kubelet's part: values, and Secret keys (a missing optional key is left out)."""
    out = {}
    for entry in node.env:
        if "value" in entry:
            out[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"]["secretKeyRef"]
        secret = secrets.get(ref["name"], {})
        if ref["key"] in secret:
            out[entry["name"]] = secret[ref["key"]]
        elif not ref.get("optional"):
            raise LookupError(f"secret {ref['name']} has no key {ref['key']} (pod not started)")
    return out


def config_maps() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["data"] for _, d in manifests() if d["kind"] == "ConfigMap"}


def local_argv(node: Node, root: Path) -> list[str]:
    """The container's argv with each mount path under ``root``, where its files are written."""
    argv = list(node.argv)
    for mount, name in node.mounts.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for file, text in config_maps()[name].items():
            (folder / file).write_text(text)
        argv = [a.replace(mount, str(folder)) if a.startswith(mount) else a for a in argv]
    if argv[0] == "llmtrain" and shutil.which("llmtrain") is None:  # the module: same code
        argv = [sys.executable, "-m", "llmtrain.cli", *argv[1:]]
    return argv


def start(node: Node, root: Path, env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    """The pod as a process group; the master's DNS name is 127.0.0.1 here, its port ``port``.
    The environment is the image's (PATH, HOME, PYTHONPATH) and the container's alone."""
    env = {**env, "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    base = {k: os.environ[k] for k in ("PATH", "HOME", "PYTHONPATH") if k in os.environ}
    with open(log, "w") as out:
        return subprocess.Popen(
            local_argv(node, root),
            env={**base, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Every process of the pod, as the kubelet ends a container (torchrun starts each worker
    in a session of its own: the tree, not the process group)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
