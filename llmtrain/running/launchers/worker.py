"""``python -m llmtrain.running.launchers.worker``: one rank of a launched fit; on failure its
traceback goes to the job folder, where the parent finds which rank failed first."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from llmtrain.console import QUIET_ENV, quieted
from llmtrain.placement import Placement
from llmtrain.running.launchers.command import ARTIFACTS_ENV, DB_ENV, JOB_ENV, METADATA_ENV


def train(args: argparse.Namespace, placement: Placement) -> None:
    from llmtrain.datalayer import connect
    from llmtrain.running.local import run_here
    from llmtrain.training.plan import RunPlan

    # popped: nothing this process starts (loader workers, callbacks) inherits the secrets
    db = connect(
        os.environ.pop(DB_ENV),
        metadata_uri=os.environ.pop(METADATA_ENV, None),
        artifacts=os.environ.pop(ARTIFACTS_ENV, None) or None,
    )
    found = {c.artifact_id: c for c in db.metadata.list_checkpoints(args.run_id)}
    resume_from = found[args.resume_from] if args.resume_from else None  # never a silent restart
    plan = RunPlan.from_record(db.metadata.get_run(args.run_id), resume_from)
    run_here(plan, db, placement)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.running.launchers.worker")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--resume-from", help="the artifact id of the checkpoint to resume")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # deepspeed's
    args, placement = parser.parse_args(argv), Placement.from_environment()
    rank = placement.rank
    job_dir = Path(os.environ[JOB_ENV])  # set by the launching fit, always
    (job_dir / "pids" / f"rank{rank}").write_text(str(os.getpid()))
    try:
        with quieted(os.environ.get(QUIET_ENV) == "1"):  # as quiet as the fit that launched it
            train(args, placement)
    except BaseException as exc:
        text = f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"
        path = job_dir / "errors" / f"rank{rank}.txt"
        path.with_suffix(".tmp").write_text(text)
        path.with_suffix(".tmp").replace(path)  # whole, or not at all
        print(f"[rank {rank}] {text}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
