"""``llmtrain``: exit status 0 done, 2 a mistake the user can fix, 1 failed, 130 interrupted."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import closing, suppress
from pathlib import Path
from typing import Any, NoReturn

from llmtrain import __version__
from llmtrain.cli.report import query_text, report_fit, report_usage, show, stored_records
from llmtrain.config.file import DB_ENV, SCALARS, SECTIONS, load_job
from llmtrain.console import quiet, say
from llmtrain.datalayer import Datalayer, connect
from llmtrain.errors import (
    ComponentNotFoundError,
    ConfigError,
    DatabaseUnavailableError,
    DataError,
    DistributedError,
    LlmtrainError,
    QueryError,
)
from llmtrain.provenance.lineage import trained_on
from llmtrain.training.export import STACKS
from llmtrain.training.gguf import LLAMA_CPP_PYTHON, QUANTS

USAGE_EXAMPLES = """\
examples:
  python3 examples/demo.py                          # the quick start: ./llmtrain-demo/
  llmtrain fit examples/config.yaml --training_args.learning_rate 1e-4
  llmtrain show run --db sqlite:///llmtrain-demo/demo.db
  llmtrain show run demo-qa --db sqlite:///llmtrain-demo/demo.db
  llmtrain replay demo-qa --db sqlite:///llmtrain-demo/demo.db
  llmtrain export demo-qa --db sqlite:///llmtrain-demo/demo.db --adapter adapter/ --merged m/
"""


class _Parser(argparse.ArgumentParser):
    """A mistake in one line, not argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmtrain",
        description="Fine-tune LLMs on rows streamed from SQL and MongoDB.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"llmtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(commands=sub.choices)  # each command reports its own mistakes

    fit = sub.add_parser(
        "fit",
        allow_abbrev=False,
        help="fit a trainer described by a YAML file",
        description="Fit the trainer a YAML file describes. Any option of the file can be "
        "overridden: --training_args.learning_rate 1e-4, --lora_args null, --db URI (values are "
        f"read as YAML). Sections: {', '.join(SECTIONS)}, data; values: {', '.join(SCALARS)}.",
    )
    fit.add_argument("config", help="YAML file (see examples/config.yaml)")
    fit.set_defaults(run=cmd_fit)
    _flag(fit, "--resume", "continue the newest run that has checkpoints instead of a new one")

    what = "list trainers, models and runs stored in a database"
    show = _with_db(sub, "show", cmd_show, help=what)
    show.add_argument("type", nargs="?", choices=["trainer", "model", "run"])
    show.add_argument(
        "name",
        nargs="?",
        help="an identifier (for run: a trainer name, whose newest run is detailed, or a run "
        "id, or its first characters)",
    )

    what = "fit a stored trainer again with its stored recipe"
    replay = _stored(sub, "replay", cmd_replay, "trainer", help=what)
    _flag(replay, "--resume", "continue its newest interrupted run instead")
    _flag(replay, "--allow-changed-data", "train though the selected rows changed since")

    export = _stored(
        sub,
        "export",
        cmd_export,
        "model",
        help="write a model for serving stacks: the adapter (PEFT) and/or the merged model",
        description="Write a trained model to folders that serving stacks load, each with the "
        "tokenizer, a chat template rendering the training prompt and llmtrain_export.json. "
        "What the stacks would refuse is a warning (with --strict, refused). Nothing is stored "
        "in the database.",
    )
    export.add_argument(
        "--check",
        metavar="STACKS",
        help=f"the serving stacks to check for, comma-separated (default: {','.join(STACKS)}); "
        "without --adapter/--merged, only check the adapter",
    )
    _flag(export, "--strict", "refuse to export what the checked stacks would refuse")
    export.add_argument(
        "--checkpoint", help="'best' (save_best_by) or a step: that checkpoint's weights"
    )
    export.add_argument(
        "--adapter",
        type=Path,
        help="new folder for the adapter in PEFT's layout (PeftModel.from_pretrained, "
        "vLLM --lora-modules)",
    )
    export.add_argument(
        "--merged",
        type=Path,
        help="new folder for the base with the adapter merged in, and the tokenizer "
        "(safetensors; AutoModelForCausalLM.from_pretrained)",
    )
    export.add_argument(
        "--merge-into",
        choices=["trained", "base"],
        default="trained",
        help="after QLoRA: merge into the dequantised weights training saw (trained, the "
        "default: answers as the trained model) or into the full-precision base",
    )
    what = "safetensors (the default) or gguf: model.gguf, or base.gguf + adapter.gguf (LoRA)"
    export.add_argument("--format", choices=["safetensors", "gguf"], help=what)
    export.add_argument("--quant", default="f16", help=f"GGUF type: {', '.join(QUANTS)}")
    what = f"llama.cpp's convert_*.py (default: $LLMTRAIN_LLAMA_CPP, or {LLAMA_CPP_PYTHON}'s sdist)"
    export.add_argument("--llama-cpp", type=Path, help=what)

    what = "the rows that trained a model: key, epoch, step, rank"
    _stored(sub, "lineage", cmd_lineage, "model", help=what)

    what = "the runs, checkpoints and models that trained on a row"
    trained_on = _with_db(sub, "trained-on", cmd_trained_on, help=what)
    trained_on.add_argument("table", help="the table or collection")
    trained_on.add_argument("key", help="the row's key (typed as the key column holds it)")

    what = "forget rows: later runs leave them out; list who used them"
    forget = _with_db(sub, "forget", cmd_forget, help=what)
    forget.add_argument("table", help="the table or collection")
    forget.add_argument("keys", nargs="+", help="row keys (typed as the key column holds them)")
    _flag(forget, "--retrain", "fit the affected trainers again without them")

    return parser


def _flag(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    parser.add_argument(name, action="store_true", help=help)


def _with_db(sub: Any, command: str, run: Any, **kwargs: Any) -> argparse.ArgumentParser:
    """A command that opens a database; its help line is its description too."""
    kwargs.setdefault("description", kwargs.get("help"))
    parser: argparse.ArgumentParser = sub.add_parser(command, allow_abbrev=False, **kwargs)
    parser.set_defaults(run=run)
    parser.add_argument(
        "--db", default=os.environ.get(DB_ENV), help=f"database URI (default: ${DB_ENV})"
    )
    parser.add_argument(
        "--artifacts",
        help="the artifact store: a folder or a URL (s3://bucket/prefix); default: "
        "where the newest run recorded its artifacts, else the database's default folder",
    )
    return parser


def _stored(sub: Any, command: str, run: Any, what: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A command on one stored trainer or model: NAME [--version V]."""
    parser = _with_db(sub, command, run, **kwargs)
    parser.add_argument("name", help=f"the {what}'s identifier")
    parser.add_argument("--version", type=int, help=f"{what} version (default: the newest)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra and args.command != "fit":
            args.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse's --help, --version and usage errors
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    quiet()
    args.overrides = extra
    try:
        args.run(args)
    except BrokenPipeError:  # the reader stopped reading (`| head`): not an error
        # stdout to /dev/null: no "Exception ignored ... BrokenPipeError" at the final flush
        devnull = os.open(os.devnull, os.O_WRONLY)
        with suppress(OSError, ValueError):  # stdout is not a real file (captured in tests)
            os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except DatabaseUnavailableError as exc:  # an outage, not the user's mistake
        return _error(exc, 1)
    except (ConfigError, QueryError, DataError, ComponentNotFoundError) as exc:
        return _error(exc, 2)  # a mistake the user can fix in the command, config or data
    except (LlmtrainError, OSError) as exc:  # OSError: e.g. a disk full, a folder not writable
        return _error(exc, 1)
    except KeyboardInterrupt:
        print("llmtrain: interrupted", file=sys.stderr)
        return 130
    return 0


def _error(exc: Exception, status: int) -> int:
    """One line (a database's message may span several); a failed worker's keeps its traceback."""
    text = str(exc) or type(exc).__name__
    text = text if isinstance(exc, DistributedError) else " ".join(text.split())
    print(f"llmtrain: error: {text}", file=sys.stderr, flush=True)
    return status


def _connect(args: argparse.Namespace) -> closing[Datalayer]:
    if not args.db:
        raise ConfigError(f"no database: pass --db URI or set {DB_ENV}")
    db = connect(args.db, artifacts=args.artifacts)
    if args.artifacts is None:  # where the newest run stored its artifacts (s3://)
        runs = db.metadata.list_runs()
        recorded = runs[-1].info.get("artifacts") if runs else None
        if isinstance(recorded, str) and recorded != db.artifacts.location:
            db = connect(args.db, artifacts=recorded)
    return closing(db)


def cmd_fit(args: argparse.Namespace) -> None:
    job = load_job(args.config, args.overrides)  # mistakes: here, once
    from llmtrain.placement import Placement
    from llmtrain.running.launchers.command import PET_ENV, TORCHRUN
    from llmtrain.running.trainer import LLMTrainer

    if os.environ.get(PET_ENV) and not Placement.from_environment().launched:
        # one entry point on one node or several: torchrun (reading PET_*) starts this fit in
        # each process, where rank 0 registers the run and every rank trains its own rows
        again = ["fit", args.config, *(["--resume"] if args.resume else []), *args.overrides]
        sys.stdout.flush()
        os.execv(TORCHRUN[0], [*TORCHRUN, "-m", "llmtrain.cli", *again])

    trainer = LLMTrainer(job.config.name, **job.options)
    with closing(connect(job.db_uri, artifacts=job.config.artifacts)) as db:
        say(f"fitting {trainer.identifier} on {query_text(job.select.to_dict())} in {db.uri}")
        model = trainer.fit(
            job.config.data.X,
            job.config.data.Y,
            db,
            job.select,
            chosen=job.config.data.chosen,
            rejected=job.config.data.rejected,
            label=job.config.data.label,
            reward=job.config.data.reward,
            eval_select=job.eval_select,
            resume=args.resume,
        )
        report_fit(db, trainer, model)


def cmd_replay(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        trainer = db.load("trainer", args.name, args.version)
        source = query_text(trainer.config.fit.select) if trainer.config.fit else "?"
        say(f"replaying {trainer.identifier} v{trainer.version} on {source} in {db.uri}")
        model = trainer.fit(resume=args.resume, allow_changed_data=args.allow_changed_data or None)
        report_fit(db, trainer, model)


def cmd_show(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        show(db, args.type, args.name)


def cmd_lineage(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        stored_records(db, "model", args.name)  # an unknown model is an error, not no rows
        for row in db.lineage("model", args.name, args.version):
            print(f"{row.key}\t{row.epoch}\t{row.step}\t{row.rank}")
        sys.stdout.flush()


def cmd_trained_on(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        report_usage(trained_on(db, args.table, [args.key]))


def cmd_forget(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        result = db.forget(args.table, args.keys)
        say(f"forgot {len(args.keys)} key(s) of {result.source}: later runs leave them out")
        if result.unmatched:
            shown = ", ".join(map(str, result.unmatched[:10]))
            say(f"no row has {len(result.unmatched)} of them ({shown}): recorded all the same")
        report_usage(result.found)
        if args.retrain:
            for model in result.retrain():
                say(f"retrained {model.identifier} v{model.version} without them")
        elif result.trainers:
            names = ", ".join(f"{name} v{version}" for name, version in result.trainers)
            say(f"to retrain {names} without them: llmtrain forget ... --retrain")


def cmd_export(args: argparse.Namespace) -> None:
    only_check = args.adapter is None and args.merged is None
    if only_check and args.check is None:
        raise ConfigError("export needs --adapter DIR and/or --merged DIR, or --check STACKS")
    default = tuple(s for s in STACKS if args.format != "gguf" or s != "vllm")  # GGUF: no vLLM
    stacks = default if args.check is None else tuple(s for s in args.check.split(",") if s)
    with _connect(args) as db:
        checkpoint = int(args.checkpoint) if (args.checkpoint or "").isdigit() else args.checkpoint
        model = db.load("model", args.name, args.version, checkpoint=checkpoint)
        which = f"{model.identifier} v{model.version}"
        which += f" (checkpoint {args.checkpoint})" if checkpoint is not None else ""
        problems = model.serving_problems(stacks, adapter=args.adapter is not None or only_check)
        say(*(f"warning: {problem}" for problem in problems))
        if problems and (args.strict or only_check):
            raise ConfigError(f"export of {which} refused for {','.join(stacks)}: see the warnings")
        if only_check:
            say(f"{which}: {', '.join(stacks)} serve it as trained")
        if args.format == "gguf":
            options = {"quant": args.quant, "llama_cpp": args.llama_cpp}
            for dest in (d for d in (args.merged, args.adapter) if d):
                folder = model.export_gguf(dest, lora=dest is args.adapter, **options)
                say(f"wrote {which} as GGUF {args.quant}, with an Ollama Modelfile, to {folder}")
            return
        if args.adapter is not None:
            folder = model.export_adapter(args.adapter, check=())
            say(f"wrote the adapter of {which} to {folder.resolve()} (PEFT layout)")
        if args.merged is not None:
            what = model.export_merged(args.merged, into=args.merge_into, check=())
            say(
                f"wrote {which} merged into the {what} to {args.merged.resolve()} "
                "(safetensors, with the tokenizer and the training prompt)"
            )
