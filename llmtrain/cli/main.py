"""The ``llmtrain`` command: fit from a YAML file, show what is stored, replay, merge, demo.

Exit status: 0 done; 2 a user mistake the message names (an invalid option or config, a
query the database refuses, unusable or changed data, an unknown component or database);
1 the work failed for another reason (the database unreachable, a corrupt artifact or
checkpoint, a failed worker, a file system error); 130 interrupted. Every error is one line
on stderr; output cut short by its reader (``llmtrain show | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from contextlib import closing, suppress
from pathlib import Path
from typing import Any

from llmtrain import __version__
from llmtrain.cli.demo import DEFAULT_DIR, DEFAULT_STEPS
from llmtrain.cli.demo import run as run_demo
from llmtrain.cli.report import plot_run, query_text, recipe, run_summary, when
from llmtrain.config.file import DB_ENV, SCALARS, SECTIONS, load_job
from llmtrain.console import quiet, say, table
from llmtrain.datalayer import Datalayer, connect
from llmtrain.errors import (
    ComponentNotFoundError,
    ConfigError,
    DatabaseUnavailableError,
    DataError,
    LlmtrainError,
    QueryError,
)
from llmtrain.provenance.lineage import chain, forgotten, trained_on
from llmtrain.uri import redact_uri

USAGE_EXAMPLES = """\
examples:
  llmtrain demo                                     # the whole loop in ~30 s, no download
  llmtrain fit examples/config.yaml --training_args.learning_rate 1e-4
  llmtrain show run --db sqlite:///llmtrain-demo/demo.db
  llmtrain show run demo-qa --db sqlite:///llmtrain-demo/demo.db --plot loss.png
  llmtrain replay demo-qa --db sqlite:///llmtrain-demo/demo.db
  llmtrain merge demo-qa --db sqlite:///llmtrain-demo/demo.db --out merged/
  llmtrain export demo-qa --db sqlite:///llmtrain-demo/demo.db --adapter adapter/ --merged m/
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmtrain",
        description="Fine-tune LLMs on rows streamed from SQL and MongoDB.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"llmtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    fit = sub.add_parser(
        "fit",
        allow_abbrev=False,
        help="fit a trainer described by a YAML file",
        description="Fit the trainer a YAML file describes. Any option of the "
        "file can be overridden: --training_args.learning_rate 1e-4, "
        "--lora_args null, --db URI (values are read as YAML). Sections: "
        f"{', '.join(SECTIONS)}, data; values: {', '.join(SCALARS)}.",
    )
    fit.add_argument("config", help="YAML file (see examples/config.yaml)")
    fit.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest run that has checkpoints instead of starting a new one",
    )
    fit.add_argument("--merge", action="store_true", help="also store the merged model")

    show = _with_db(sub, "show", help="list trainers, models and runs stored in a database")
    show.add_argument("type", nargs="?", choices=["trainer", "model", "run"])
    show.add_argument(
        "name",
        nargs="?",
        help="an identifier (for run: a trainer name, whose newest run is detailed, or a run "
        "id, or its first characters)",
    )
    show.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="with `run NAME`: draw its train loss, eval loss and learning rate against steps "
        "into this PNG file (needs matplotlib: pip install 'llmtrain[plot]')",
    )

    replay = _stored(
        sub, "replay", "trainer", help="fit a stored trainer again with its stored recipe"
    )
    replay.add_argument(
        "--resume", action="store_true", help="continue its newest interrupted run instead"
    )
    replay.add_argument(
        "--allow-changed-data",
        action="store_true",
        help="train even though the selected rows changed since the last fit",
    )

    merge = _stored(sub, "merge", "model", help="merge a trained adapter into its base model")
    merge.add_argument(
        "--out",
        type=Path,
        help="also write the merged model to this new "
        "folder (loadable with transformers' from_pretrained)",
    )

    export = _stored(
        sub,
        "export",
        "model",
        help="write a model for serving stacks: the adapter (PEFT) and/or the merged model",
        description="Write a trained model to folders that serving stacks load. Nothing is "
        "stored in the database.",
    )
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

    _stored(
        sub,
        "lineage",
        "model",
        help="the rows that trained a model: key, epoch, step and rank, one line each",
    )

    trained_on = _with_db(
        sub, "trained-on", help="the runs, checkpoints and models that trained on a row"
    )
    trained_on.add_argument("table", help="the table or collection")
    trained_on.add_argument("key", help="the row's key (typed as the key column holds it)")

    forget = _with_db(
        sub,
        "forget",
        help="forget rows: later runs leave them out; list (and retrain) what trained on them",
    )
    forget.add_argument("table", help="the table or collection")
    forget.add_argument("keys", nargs="+", help="row keys (typed as the key column holds them)")
    forget.add_argument(
        "--retrain", action="store_true", help="fit the affected trainers again without them"
    )

    what = "fine-tune a tiny model on a demo SQLite table"
    demo = sub.add_parser("demo", help=what, description=what)
    demo.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help=f"where the database and model go (default: ./{DEFAULT_DIR})",
    )
    demo.add_argument(
        "--steps",
        type=_positive,
        default=DEFAULT_STEPS,
        help=f"training steps (default: {DEFAULT_STEPS})",
    )
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one command (``replay``), which reports its own mistakes and usage."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def _with_db(sub: Any, command: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A command that opens a database; its help line is its description too."""
    kwargs.setdefault("description", kwargs.get("help"))
    parser: argparse.ArgumentParser = sub.add_parser(command, **kwargs)
    parser.add_argument(
        "--db", default=os.environ.get(DB_ENV), help=f"database URI (default: ${DB_ENV})"
    )
    parser.add_argument(
        "--artifacts",
        help="the artifact store: a folder, 'gridfs' or a URL (s3://bucket/prefix); default: "
        "where the newest run recorded its artifacts, else the database's default folder",
    )
    return parser


def _stored(sub: Any, command: str, what: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A command on one stored trainer or model: NAME [--version V]."""
    parser = _with_db(sub, command, **kwargs)
    parser.add_argument("name", help=f"the {what}'s identifier")
    parser.add_argument("--version", type=int, help=f"{what} version (default: the newest)")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (the console script exits with it)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "fit":
            command = _command_parser(parser, args.command)
            options = [o[2:] for o in command._option_string_actions if o.startswith("--")]
            close = difflib.get_close_matches(extra[0].lstrip("-"), options, n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    except SystemExit as exc:  # argparse's --help, --version and usage errors
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    quiet()
    handler = {
        "fit": lambda args: cmd_fit(args, extra),
        "show": cmd_show,
        "replay": cmd_replay,
        "merge": cmd_merge,
        "export": cmd_export,
        "demo": lambda args: run_demo(args.dir, args.steps),
        "lineage": cmd_lineage,
        "trained-on": cmd_trained_on,
        "forget": cmd_forget,
    }
    try:
        handler[args.command](args)
    except BrokenPipeError:  # the reader stopped reading (`| head`): not an error
        # stdout to /dev/null, so the interpreter's final flush into the closed pipe cannot
        # print "Exception ignored ... BrokenPipeError" after we exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        with suppress(OSError, ValueError):  # stdout is not a real file (captured in tests)
            os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except DatabaseUnavailableError as exc:  # an outage, not the user's mistake
        _error(exc)
        return 1
    except _USER_MISTAKES as exc:
        _error(exc, one_line=True)
        return 2
    except (LlmtrainError, OSError) as exc:  # OSError: e.g. a disk full, a folder not writable
        _error(exc)
        return 1
    except KeyboardInterrupt:
        print("llmtrain: interrupted", file=sys.stderr)
        return 130
    return 0


#: errors the user can fix by changing the command, the config or the data (exit status 2)
_USER_MISTAKES = (ConfigError, QueryError, DataError, ComponentNotFoundError)


def _error(exc: Exception, *, one_line: bool = False) -> None:
    """``one_line``: a user mistake is one line, even when the database's own message spans
    several; a failed worker's error keeps its traceback below its first line."""
    text = str(exc) or type(exc).__name__
    if one_line:
        text = " ".join(text.split())
    print(f"llmtrain: error: {text}", file=sys.stderr, flush=True)


def _connect(args: argparse.Namespace) -> closing[Datalayer]:
    if not args.db:
        raise ConfigError(f"no database: pass --db URI or set {DB_ENV}")
    db = connect(args.db, artifacts=args.artifacts)
    if args.artifacts is None:  # where the newest run stored its artifacts (s3://, gridfs)
        runs = db.metadata.list_runs()
        recorded = runs[-1].info.get("artifacts") if runs else None
        if isinstance(recorded, str) and recorded != db.artifacts.location:
            db = connect(args.db, artifacts=recorded)
    return closing(db)


# -- fit / replay -----------------------------------------------------------------------------
def cmd_fit(args: argparse.Namespace, overrides: Sequence[str]) -> None:
    job = load_job(args.config, overrides, flags=("resume", "merge"))
    from llmtrain.running.trainer import LLMTrainer

    trainer = LLMTrainer(job.config.name, **job.options)
    with closing(connect(job.db_uri, artifacts=job.config.artifacts)) as db:
        say(
            f"fitting {trainer.identifier} on {query_text(job.select.to_dict())} in "
            f"{redact_uri(job.db_uri)}"
        )
        model = trainer.fit(
            job.config.data.X,
            job.config.data.Y,
            db,
            job.select,
            eval_select=job.eval_select,
            resume=args.resume,
            merge=args.merge,
        )
        _report_fit(db, trainer, model)


def cmd_replay(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        trainer = db.load("trainer", args.name, args.version)
        fit = trainer.config.fit
        source = query_text(fit.select) if fit else "?"
        say(f"replaying {trainer.identifier} v{trainer.version} on {source} in {db.uri}")
        model = trainer.fit(
            resume=args.resume, allow_changed_data=True if args.allow_changed_data else None
        )
        _report_fit(db, trainer, model)


def _report_fit(db: Datalayer, trainer: Any, model: Any) -> None:
    if model is None:  # a launcher's worker processes stored the model
        say(f"done: see `llmtrain show run {trainer.identifier}`")
        return
    run = db.metadata.get_run(model.record.run_id)
    loss = run.info.get("final_loss")
    loss_text = f", final loss {loss:.4f}" if loss is not None else ""
    store = db.artifacts
    where = getattr(store, "root", None) or getattr(store, "url", None) or "GridFS"
    say(
        f"run {run.run_id}: {run.status}, {run.info.get('steps')} steps{loss_text}",
        f"stored trainer {trainer.identifier} v{run.version} and model "
        f"{model.identifier} v{model.version} (adapter {model.record.adapter})",
        f"database {db.uri}; artifacts in {where}",
    )
    if model.record.merged:
        say(f"merged model: {model.record.merged}")


# -- show ------------------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> None:
    if args.plot is not None and (args.type != "run" or args.name is None):
        raise ConfigError("--plot draws one run: llmtrain show run NAME --plot FILE.png")
    with _connect(args) as db:
        if args.type is None:
            _show_all(db)
        elif args.type == "run":
            run = _show_runs(db, args.name)
            if run is not None and args.plot is not None:
                say("", f"plotted run {run.run_id} into {plot_run(db, run, args.plot)}")
        elif args.name is None:
            _show_identifiers(db, args.type)
        elif args.type == "trainer":
            _show_trainer(db, args.name)
        else:
            _show_model(db, args.name)


def _versions(records: list[Any]) -> dict[tuple[str, str], str]:
    """``(type, identifier)`` -> its stored versions: ``"0, 1, 2"``."""
    versions: dict[tuple[str, str], list[str]] = {}
    for r in records:
        versions.setdefault((r.type_id, r.identifier), []).append(str(r.version))
    return {key: ", ".join(v) for key, v in versions.items()}


def _show_all(db: Datalayer) -> None:
    records = db.metadata.list_components()
    if not records:
        say(f"nothing stored in {db.uri} yet")
        return
    say(
        table(
            [(*key, v) for key, v in sorted(_versions(records).items())],
            ["type", "identifier", "versions"],
        ),
        f"{len(db.metadata.list_runs())} run(s): llmtrain show run",
    )


def _show_identifiers(db: Datalayer, type_id: str) -> None:
    records = db.metadata.list_components(type_id)
    if not records:
        say(f"no {type_id} stored in {db.uri}")
        return
    versions = _versions(records)
    latest = {r.identifier: r for r in records}  # ordered by version: the newest wins
    rows = []
    for name, record in sorted(latest.items()):
        runs = db.metadata.list_runs("trainer", name)
        last = (runs[-1].status, runs[-1].info.get("final_loss")) if runs else (None, None)
        if type_id == "trainer":
            base = recipe(record.payload).model_args.model_name_or_path
        else:
            base = record.payload["base"]["model_name_or_path"]
        rows.append((name, versions[type_id, name], len(runs), *last, base))
    say(table(rows, ["identifier", "versions", "runs", "last run", "final loss", "base model"]))


def _show_trainer(db: Datalayer, name: str) -> None:
    records = db.metadata.list_components("trainer", name)
    if not records:
        raise _not_found(db, "trainer", name)
    rows = []
    for r in records:
        config, fit = recipe(r.payload), r.payload.get("fit")
        target = fit and (
            f"{fit['X']} -> {fit['Y']}" if fit.get("Y") else f"{fit['X']} (documents)"
        )
        data = f"{target} from {query_text(fit['select'])}" if fit else "-"
        base = config.model_args.model_name_or_path
        rows.append((r.version, when(r.created_at), base, config.method(), data))
    say(table(rows, ["version", "created", "base model", "adapter", "data"]), "")
    _show_runs(db, name)


def _show_model(db: Datalayer, name: str) -> None:
    records = db.metadata.list_components("model", name)
    if not records:
        raise _not_found(db, "model", name)
    carried = forgotten(db, None)[1]  # rows forgotten since (db.forget): the model carries them
    rows = []
    for r in records:
        p = r.payload
        history = p.get("history") or []
        rows.append(
            (
                r.version,
                when(r.created_at),
                p["run_id"],
                p.get("trainer_version"),
                history[-1]["loss"] if history else None,
                p.get("adapter"),
                p.get("merged"),
                len({k for run, _ in chain(db, p["run_id"]) for k in carried.get(run.run_id, ())})
                or None,
            )
        )
    headers = ["version", "created", "run id", "trainer v", "final loss", "adapter", "merged"]
    say(table(rows, [*headers, "forgotten rows"]))


def _show_runs(db: Datalayer, name: str | None) -> Any:
    """The runs (of trainer ``name``), then the details of the one run ``name`` names (a run
    id or its prefix) or of the trainer's newest run; returns that run, if any."""
    runs = db.metadata.list_runs()
    if name is not None:
        by_id = [r for r in runs if r.run_id.startswith(name)] if len(name) >= 6 else []
        if len(by_id) == 1:
            say(*run_summary(db, by_id[0]))
            return by_id[0]
        runs = [r for r in runs if r.identifier == name]
        if not runs:
            raise _not_found(db, "run", name)
    if not runs:
        say(f"no runs in {db.uri} yet")
        return None
    say(
        table(
            [
                (
                    r.run_id,
                    f"{r.identifier} v{r.version}",
                    r.status,
                    r.info.get("steps"),
                    r.info.get("final_loss"),
                    when(r.created_at),
                )
                for r in runs
            ],
            ["run id", "trainer", "status", "steps", "final loss", "started"],
        )
    )
    if name is None:
        return None
    say("", f"newest run of {name}:", *run_summary(db, runs[-1]))
    return runs[-1]


def _not_found(db: Datalayer, type_id: str, name: str) -> LlmtrainError:
    known = ", ".join(db.show("trainer" if type_id == "run" else type_id)) or "none"
    return ComponentNotFoundError(f"no {type_id} {name!r} in {db.uri}; known: {known}")


# -- lineage ------------------------------------------------------------------------------------
def cmd_lineage(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        if not db.metadata.list_components("model", args.name):
            raise _not_found(db, "model", args.name)
        for row in db.lineage("model", args.name, args.version):
            print(f"{row.key}\t{row.epoch}\t{row.step}\t{row.rank}")
        sys.stdout.flush()


def _report_usage(found: Any) -> None:
    uses = [(u.run_id, f"{u.trainer} v{u.version}", u.key, u.epoch, u.step) for u in found.uses]
    say(
        table(uses, ["run id", "trainer", "key", "epoch", "step"])
        if uses
        else "no run trained on it"
    )
    if found.checkpoints:
        checkpoints = [(c.run_id, c.step, c.artifact_id) for c in found.checkpoints]
        say(table(checkpoints, ["run id", "step", "checkpoint"]))
    if found.models:
        say("models: " + ", ".join(f"{name} v{version}" for name, version in found.models))
    if found.forgotten:
        shown = ", ".join(str(k) for k in found.forgotten)
        say(f"forgotten (db.forget): {shown}: runs since leave them out")
    if found.underivable:
        say(f"unknown (runs without a key snapshot): {', '.join(found.underivable)}")


def cmd_trained_on(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        _report_usage(trained_on(db, args.table, [args.key]))


def cmd_forget(args: argparse.Namespace) -> None:
    with _connect(args) as db:
        result = db.forget(args.table, args.keys)
        say(f"forgot {len(args.keys)} key(s) of {result.source}: later runs leave them out")
        _report_usage(result.found)
        if args.retrain:
            for model in result.retrain():
                say(f"retrained {model.identifier} v{model.version} without them")
        elif result.trainers:
            names = ", ".join(f"{name} v{version}" for name, version in result.trainers)
            say(f"to retrain {names} without them: llmtrain forget ... --retrain")


# -- merge / export ----------------------------------------------------------------------------
def cmd_merge(args: argparse.Namespace) -> None:
    out: Path | None = args.out
    if out is not None and out.exists():
        if not out.is_dir() or any(out.iterdir()):
            raise ConfigError(f"--out {out} already exists and is not an empty folder")
        out.rmdir()  # merge() writes a new folder
    with _connect(args) as db:
        model = db.load("model", args.name, args.version)
        bits = model.record.base.bits
        say(
            f"merging the adapter of {model.identifier} v{model.version} into "
            f"{model.record.base.model_name_or_path}"
            + (f" (its dequantised {bits}-bit weights, as trained)" if bits else "")
        )
        artifact = model.merge(out)
        say(f"stored merged model {artifact} as {model.identifier} v{model.version}")
        if out is not None:
            say(f"wrote {out.resolve()} (transformers: AutoModelForCausalLM.from_pretrained)")


def cmd_export(args: argparse.Namespace) -> None:
    if args.adapter is None and args.merged is None:
        raise ConfigError("export needs --adapter DIR and/or --merged DIR")
    with _connect(args) as db:
        checkpoint = args.checkpoint
        if checkpoint is not None and checkpoint.isdigit():
            checkpoint = int(checkpoint)
        model = db.load("model", args.name, args.version, checkpoint=checkpoint)
        which = f"{model.identifier} v{model.version}" + (
            f" (checkpoint {args.checkpoint})" if checkpoint is not None else ""
        )
        if args.adapter is not None:
            folder = model.export_adapter(args.adapter)
            say(f"wrote the adapter of {which} to {folder.resolve()} (PEFT layout)")
        if args.merged is not None:
            what = model.export_merged(args.merged, into=args.merge_into)
            say(
                f"wrote {which} merged into the {what} to {args.merged.resolve()} "
                "(safetensors, with the tokenizer)"
            )


if __name__ == "__main__":
    sys.exit(main())
