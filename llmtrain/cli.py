"""The ``llmtrain`` command: fit from a YAML file, show what is stored, replay, merge, demo.

Exit status: 0 done; 2 a user mistake the message names (an invalid option or config, a
query the database refuses, unusable or changed data, an unknown component or database);
1 the work failed for another reason (the database unreachable, a corrupt artifact or
checkpoint, a failed worker, a file system error); 130 interrupted. Every error is one line
on stderr; output cut short by its reader (``llmtrain show | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmtrain.config_file import DB_ENV
from llmtrain.console import quiet, table
from llmtrain.errors import (
    ComponentNotFoundError,
    ConfigError,
    DatabaseUnavailableError,
    DataError,
    LlmtrainError,
    QueryError,
)
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
    from llmtrain import __version__

    parser = argparse.ArgumentParser(
        prog="llmtrain",
        description="Fine-tune LLMs on rows streamed from SQL and MongoDB.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"llmtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from llmtrain.config_file import SCALARS, SECTIONS

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

    show = sub.add_parser("show", help="list trainers, models and runs stored in a database")
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
    _db_options(show)

    replay = sub.add_parser("replay", help="fit a stored trainer again with its stored recipe")
    replay.add_argument("name", help="the trainer's identifier")
    replay.add_argument("--version", type=int, help="trainer version (default: the newest)")
    replay.add_argument(
        "--resume", action="store_true", help="continue its newest interrupted run instead"
    )
    replay.add_argument(
        "--allow-changed-data",
        action="store_true",
        help="train even though the selected rows changed since the last fit",
    )
    _db_options(replay)

    merge = sub.add_parser("merge", help="merge a trained adapter into its base model")
    merge.add_argument("name", help="the model's identifier")
    merge.add_argument("--version", type=int, help="model version (default: the newest)")
    merge.add_argument(
        "--out",
        type=Path,
        help="also write the merged model to this new "
        "folder (loadable with transformers' from_pretrained)",
    )
    _db_options(merge)

    export = sub.add_parser(
        "export",
        help="write a model for serving stacks: the adapter (PEFT) and/or the merged model",
        description="Write a trained model to folders that serving stacks load. Nothing is "
        "stored in the database.",
    )
    export.add_argument("name", help="the model's identifier")
    export.add_argument("--version", type=int, help="model version (default: the newest)")
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
    _db_options(export)

    lineage = sub.add_parser(
        "lineage",
        help="the rows that trained a model: key, epoch, step and rank, one line each",
    )
    lineage.add_argument("name", help="the model's identifier")
    lineage.add_argument("--version", type=int, help="model version (default: the newest)")
    _db_options(lineage)

    trained_on = sub.add_parser(
        "trained-on", help="the runs, checkpoints and models that trained on a row"
    )
    trained_on.add_argument("table", help="the table or collection")
    trained_on.add_argument("key", help="the row's key (matched as text and as an integer)")
    _db_options(trained_on)

    forget = sub.add_parser(
        "forget",
        help="forget rows: later runs leave them out; list (and retrain) what trained on them",
    )
    forget.add_argument("table", help="the table or collection")
    forget.add_argument("keys", nargs="+", help="row keys (matched as text and as integers)")
    forget.add_argument(
        "--retrain", action="store_true", help="fit the affected trainers again without them"
    )
    _db_options(forget)

    from llmtrain.demo import DEFAULT_DIR, DEFAULT_STEPS

    demo = sub.add_parser("demo", help="fine-tune a tiny model on a demo SQLite table")
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


def _db_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db", default=os.environ.get(DB_ENV), help=f"database URI (default: ${DB_ENV})"
    )
    parser.add_argument("--artifacts", help="artifact folder, if not the default one")


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
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse's --help, --version and usage errors
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    quiet()
    handler = {
        "show": cmd_show,
        "replay": cmd_replay,
        "merge": cmd_merge,
        "export": cmd_export,
        "demo": cmd_demo,
        "lineage": cmd_lineage,
        "trained-on": cmd_trained_on,
        "forget": cmd_forget,
    }
    try:
        cmd_fit(args, extra) if args.command == "fit" else handler[args.command](args)
    except BrokenPipeError:  # the reader stopped reading (`| head`): not an error
        _drop_stdout()
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


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush into the closed pipe
    cannot print "Exception ignored ... BrokenPipeError" after we exit quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured in tests)
        pass
    finally:
        os.close(devnull)


def _error(exc: Exception, *, one_line: bool = False) -> None:
    """``one_line``: a user mistake is one line, even when the database's own message spans
    several; a failed worker's error keeps its traceback below its first line."""
    text = str(exc) or type(exc).__name__
    if one_line:
        text = " ".join(text.split())
    print(f"llmtrain: error: {text}", file=sys.stderr, flush=True)


def _say(*lines: str) -> None:
    print(*lines, sep="\n", flush=True)


def _connect(args: argparse.Namespace) -> Any:
    from llmtrain.datalayer import connect

    if not args.db:
        raise ConfigError(f"no database: pass --db URI or set {DB_ENV}")
    return connect(args.db, artifacts=args.artifacts)


# -- fit / replay -----------------------------------------------------------------------------
def cmd_fit(args: argparse.Namespace, overrides: Sequence[str]) -> None:
    from llmtrain.config_file import load_job

    job = load_job(args.config, overrides)
    trainer = job.trainer()
    db = job.connect()
    _say(
        f"fitting {trainer.identifier} on {_query_text(job.select.to_dict())} in "
        f"{redact_uri(job.db_uri)}"
    )
    try:
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
    finally:
        db.close()


def cmd_replay(args: argparse.Namespace) -> None:
    db = _connect(args)
    try:
        trainer = db.load("trainer", args.name, args.version)
        fit = trainer.config.fit
        source = _query_text(fit.select) if fit else "?"
        _say(f"replaying {trainer.identifier} v{trainer.version} on {source} in {db.uri}")
        model = trainer.fit(
            resume=args.resume, allow_changed_data=True if args.allow_changed_data else None
        )
        _report_fit(db, trainer, model)
    finally:
        db.close()


def _report_fit(db: Any, trainer: Any, model: Any) -> None:
    if model is None:  # a launcher's worker processes stored the model
        _say(f"done: see `llmtrain show run {trainer.identifier}`")
        return
    run = db.metadata.get_run(model.record.run_id)
    loss = run.info.get("final_loss")
    loss_text = f", final loss {loss:.4f}" if loss is not None else ""
    _say(
        f"run {run.run_id}: {run.status}, {run.info.get('steps')} steps{loss_text}",
        f"stored trainer {trainer.identifier} v{run.version} and model "
        f"{model.identifier} v{model.version} (adapter {model.record.adapter})",
        f"database {db.uri}; artifacts in {_artifact_location(db)}",
    )
    if model.record.merged:
        _say(f"merged model: {model.record.merged}")


def _artifact_location(db: Any) -> str:
    store = db.artifacts
    where = getattr(store, "root", None) or getattr(store, "url", None)
    return str(where) if where is not None else "GridFS"


# -- show ------------------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> None:
    if args.plot is not None and (args.type != "run" or args.name is None):
        raise ConfigError("--plot draws one run: llmtrain show run NAME --plot FILE.png")
    db = _connect(args)
    try:
        if args.type is None:
            _show_all(db)
        elif args.type == "run":
            run = _show_runs(db, args.name)
            if run is not None and args.plot is not None:
                from llmtrain.report import plot_run

                _say("", f"plotted run {run.run_id} into {plot_run(db, run, args.plot)}")
        elif args.name is None:
            _show_identifiers(db, args.type)
        elif args.type == "trainer":
            _show_trainer(db, args.name)
        else:
            _show_model(db, args.name)
    finally:
        db.close()


def _show_all(db: Any) -> None:
    records = db.metadata.list_components()
    if not records:
        _say(f"nothing stored in {db.uri} yet")
        return
    versions: dict[tuple[str, str], list[int]] = {}
    for r in records:
        versions.setdefault((r.type_id, r.identifier), []).append(r.version)
    _say(
        table(
            [(t, i, _versions(v)) for (t, i), v in sorted(versions.items())],
            ["type", "identifier", "versions"],
        ),
        f"{len(db.metadata.list_runs())} run(s): llmtrain show run",
    )


def _show_identifiers(db: Any, type_id: str) -> None:
    records = db.metadata.list_components(type_id)
    if not records:
        _say(f"no {type_id} stored in {db.uri}")
        return
    latest = {r.identifier: r for r in records}  # ordered by version: the newest wins
    versions: dict[str, list[int]] = {}
    for r in records:
        versions.setdefault(r.identifier, []).append(r.version)
    rows = []
    for name, record in sorted(latest.items()):
        runs = db.metadata.list_runs("trainer", name)
        last = runs[-1] if runs else None
        if type_id == "trainer":
            base = _recipe(record.payload).model_args.model_name_or_path
        else:
            base = record.payload["base"]["model_name_or_path"]
        rows.append(
            (
                name,
                _versions(versions[name]),
                len(runs),
                last.status if last else None,
                last.info.get("final_loss") if last else None,
                base,
            )
        )
    _say(table(rows, ["identifier", "versions", "runs", "last run", "final loss", "base model"]))


def _show_trainer(db: Any, name: str) -> None:
    records = db.metadata.list_components("trainer", name)
    if not records:
        raise _not_found(db, "trainer", name)
    rows = []
    for r in records:
        recipe = _recipe(r.payload)
        rows.append(
            (
                r.version,
                _when(r.created_at),
                recipe.model_args.model_name_or_path,
                recipe.method(),
                _selection(r.payload.get("fit")),
            )
        )
    _say(table(rows, ["version", "created", "base model", "adapter", "data"]), "")
    _show_runs(db, name)


def _show_model(db: Any, name: str) -> None:
    records = db.metadata.list_components("model", name)
    if not records:
        raise _not_found(db, "model", name)
    forgotten = {  # rows forgotten since (db.forget): the model still carries them
        r.run_id: len(r.info.get("forgotten_keys") or ()) for r in db.metadata.list_runs()
    }
    rows = []
    for r in records:
        p = r.payload
        history = p.get("history") or []
        rows.append(
            (
                r.version,
                _when(r.created_at),
                p["run_id"],
                p.get("trainer_version"),
                history[-1]["loss"] if history else None,
                p.get("adapter"),
                p.get("merged"),
                forgotten.get(p["run_id"]) or None,
            )
        )
    headers = ["version", "created", "run id", "trainer v", "final loss", "adapter", "merged"]
    _say(table(rows, [*headers, "forgotten rows"]))


def _show_runs(db: Any, name: str | None) -> Any:
    """The runs (of trainer ``name``), then the details of the one run ``name`` names (a run
    id or its prefix) or of the trainer's newest run; returns that run, if any."""
    runs = db.metadata.list_runs()
    if name is not None:
        by_id = [r for r in runs if r.run_id.startswith(name)] if len(name) >= 6 else []
        if len(by_id) == 1:
            _show_run(db, by_id[0])
            return by_id[0]
        runs = [r for r in runs if r.identifier == name]
        if not runs:
            raise _not_found(db, "run", name)
    if not runs:
        _say(f"no runs in {db.uri} yet")
        return None
    _say(
        table(
            [
                (
                    r.run_id,
                    f"{r.identifier} v{r.version}",
                    r.status,
                    r.info.get("steps"),
                    r.info.get("final_loss"),
                    _when(r.created_at),
                )
                for r in runs
            ],
            ["run id", "trainer", "status", "steps", "final loss", "started"],
        )
    )
    if name is None:
        return None
    _say("", f"newest run of {name}:")
    _show_run(db, runs[-1])
    return runs[-1]


def _show_run(db: Any, run: Any) -> None:
    from llmtrain.report import run_summary

    info = run.info
    _say(
        f"run        {run.run_id}",
        f"trainer    {run.identifier} v{run.version}",
        f"status     {run.status}" + (f": {run.error}" if run.error else ""),
        f"data       {info.get('X')} -> {info.get('Y')} from {_query_text(info.get('query'))}",
        f"database   {info.get('db')}",
        f"steps      {info.get('steps')}, {info.get('tokens')} tokens",
        f"adapter    {info.get('artifact')}",
        f"started    {_when(run.created_at)}, updated {_when(run.updated_at)}",
        *run_summary(db, run),
    )
    metrics = db.metadata.get_metrics(run.run_id)
    evals = {m.step: m.values["eval_loss"] for m in metrics if "eval_loss" in m.values}
    train = [m for m in metrics if "loss" in m.values]
    if train:
        _say(
            "",
            table(
                [
                    (
                        m.step,
                        m.values.get("loss"),
                        m.values.get("lr"),
                        m.values.get("tokens_per_s"),
                        evals.get(m.step),
                    )
                    for m in train
                ],
                ["step", "loss", "lr", "tokens/s", "eval loss"],
            ),
        )
    checkpoints = db.metadata.list_checkpoints(run.run_id)
    if checkpoints:
        _say("", table([(c.step, c.artifact_id) for c in checkpoints], ["step", "checkpoint"]))


def _recipe(payload: dict[str, Any]) -> Any:
    """A stored trainer record read through its schema (a bad record: ConfigError, exit 2)."""
    from llmtrain.training.args import TrainerConfig, build

    return build(TrainerConfig, payload, "trainer record")


def _not_found(db: Any, type_id: str, name: str) -> LlmtrainError:
    from llmtrain.errors import ComponentNotFoundError

    known = sorted(
        {
            r.identifier
            for r in db.metadata.list_components("trainer" if type_id == "run" else type_id)
        }
    )
    return ComponentNotFoundError(
        f"no {type_id} {name!r} in {db.uri}; known: {', '.join(known) or 'none'}"
    )


def _selection(fit: dict[str, Any] | None) -> str:
    if not fit:
        return "-"
    return f"{fit['X']} -> {fit['Y']} from {_query_text(fit['select'])}"


def _query_text(query: dict[str, Any] | None) -> str:
    if not query:
        return "-"
    from llmtrain.queries import Query

    q = Query.from_dict(query)
    text = q.source
    where = query.get("where") or (query.get("filter") or None)
    if where:
        text += f" where {where}"
    if query.get("params"):
        text += f" {query['params']}"
    return text


def _versions(versions: list[int]) -> str:
    return ", ".join(str(v) for v in versions)


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if hasattr(value, "strftime") else str(value)


# -- lineage ------------------------------------------------------------------------------------
def _keys(texts: Sequence[str]) -> list[Any]:
    """A key typed on the command line: the text, and the integer when it reads as one."""
    keys: list[Any] = []
    for text in texts:
        keys.append(text)
        if text.lstrip("-").isdigit():
            keys.append(int(text))
    return keys


def cmd_lineage(args: argparse.Namespace) -> None:
    db = _connect(args)
    try:
        if not db.metadata.list_components("model", args.name):
            raise _not_found(db, "model", args.name)
        for row in db.lineage("model", args.name, args.version):
            print(f"{row.key}\t{row.epoch}\t{row.step}\t{row.rank}")
        sys.stdout.flush()
    finally:
        db.close()


def _report_usage(found: Any) -> None:
    if found.uses:
        _say(
            table(
                [
                    (u.run_id, f"{u.trainer} v{u.version}", u.key, u.epoch, u.step)
                    for u in found.uses
                ],
                ["run id", "trainer", "key", "epoch", "step"],
            )
        )
    else:
        _say("no run trained on it")
    if found.checkpoints:
        _say(
            table(
                [(c.run_id, c.step, c.artifact_id) for c in found.checkpoints],
                ["run id", "step", "checkpoint"],
            )
        )
    if found.models:
        _say("models: " + ", ".join(f"{name} v{version}" for name, version in found.models))
    if found.underivable:
        _say(f"unknown (runs without a key snapshot): {', '.join(found.underivable)}")


def cmd_trained_on(args: argparse.Namespace) -> None:
    from llmtrain.lineage import trained_on

    db = _connect(args)
    try:
        _report_usage(trained_on(db, args.table, _keys([args.key])))
    finally:
        db.close()


def cmd_forget(args: argparse.Namespace) -> None:
    db = _connect(args)
    try:
        result = db.forget(args.table, _keys(args.keys))
        _say(f"forgot {len(args.keys)} key(s) of {args.table}: later runs leave them out")
        _report_usage(result.found)
        if args.retrain:
            for model in result.retrain():
                _say(f"retrained {model.identifier} v{model.version} without them")
        elif result.trainers:
            names = ", ".join(f"{name} v{version}" for name, version in result.trainers)
            _say(f"to retrain {names} without them: llmtrain forget ... --retrain")
    finally:
        db.close()


# -- merge / demo ----------------------------------------------------------------------------
def cmd_merge(args: argparse.Namespace) -> None:
    out: Path | None = args.out
    if out is not None and out.exists():
        if not out.is_dir() or any(out.iterdir()):
            raise ConfigError(f"--out {out} already exists and is not an empty folder")
        out.rmdir()  # merge() writes a new folder
    db = _connect(args)
    try:
        model = db.load("model", args.name, args.version)
        bits = model.record.base.bits
        _say(
            f"merging the adapter of {model.identifier} v{model.version} into "
            f"{model.record.base.model_name_or_path}"
            + (f" (its dequantised {bits}-bit weights, as trained)" if bits else "")
        )
        artifact = model.merge(out)
        _say(f"stored merged model {artifact} as {model.identifier} v{model.version}")
        if out is not None:
            _say(f"wrote {out.resolve()} (transformers: AutoModelForCausalLM.from_pretrained)")
    finally:
        db.close()


def cmd_export(args: argparse.Namespace) -> None:
    if args.adapter is None and args.merged is None:
        raise ConfigError("export needs --adapter DIR and/or --merged DIR")
    db = _connect(args)
    try:
        checkpoint = args.checkpoint
        if checkpoint is not None and checkpoint.isdigit():
            checkpoint = int(checkpoint)
        model = db.load("model", args.name, args.version, checkpoint=checkpoint)
        which = f"{model.identifier} v{model.version}" + (
            f" (checkpoint {args.checkpoint})" if checkpoint is not None else ""
        )
        if args.adapter is not None:
            folder = model.export_adapter(args.adapter)
            _say(f"wrote the adapter of {which} to {folder.resolve()} (PEFT layout)")
        if args.merged is not None:
            what = model.export_merged(args.merged, into=args.merge_into)
            _say(
                f"wrote {which} merged into the {what} to {args.merged.resolve()} "
                "(safetensors, with the tokenizer)"
            )
    finally:
        db.close()


def cmd_demo(args: argparse.Namespace) -> None:
    from llmtrain.demo import run

    run(args.dir, args.steps)


if __name__ == "__main__":
    sys.exit(main())
