"""``python -m llmtrain.launchers.worker``: one rank of a launched fit.

It reconnects from the environment (the URIs never appear on the command line), loads the
trainer by name and version from the metadata store, exactly as a replay would, and trains
its share. On failure it writes its traceback to the job folder, where the parent finds
which rank failed first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from llmtrain.console import QUIET_ENV, quieted
from llmtrain.launchers.command import ARTIFACTS_ENV, DB_ENV, JOB_ENV, METADATA_ENV
from llmtrain.placement import Placement


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.launchers.worker")
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--resume", type=json.loads, default=False)
    parser.add_argument("--merge", action="store_true")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # deepspeed's
    return parser.parse_args(argv)


def train(args: argparse.Namespace, placement: Placement) -> None:
    from llmtrain import connect
    from llmtrain.training.callbacks import install_from_environment
    from llmtrain.training.launch import run_in_process
    from llmtrain.training.strategies import strategy_for

    # popped: nothing this process starts (compilers, loader workers) inherits the secrets
    db = connect(
        os.environ.pop(DB_ENV),
        metadata_uri=os.environ.pop(METADATA_ENV, None),
        artifacts=os.environ.pop(ARTIFACTS_ENV, None) or None,
    )
    # after the pops: the code LLMTRAIN_CALLBACKS names imports with the secrets gone
    install_from_environment()
    trainer = db.load("trainer", args.trainer, args.version)
    run_in_process(
        trainer,
        db,
        args.run_id,
        strategy_for(trainer.config, placement),
        resume=args.resume,
        merge=args.merge,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    placement = Placement.from_environment()
    rank = placement.rank
    job_dir = Path(os.environ[JOB_ENV]) if os.environ.get(JOB_ENV) else None
    if job_dir is not None:
        (job_dir / "pids" / f"rank{rank}").write_text(str(os.getpid()))
    try:
        with quieted(os.environ.get(QUIET_ENV) == "1"):  # as quiet as the fit that launched it
            train(args, placement)
    except BaseException as exc:
        text = f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"
        if job_dir is not None:
            path = job_dir / "errors" / f"rank{rank}.txt"
            path.with_suffix(".tmp").write_text(text)
            path.with_suffix(".tmp").replace(path)  # whole, or not at all
        print(f"[rank {rank}] {text}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
