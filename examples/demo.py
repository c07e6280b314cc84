"""The quick start: fine-tune a tiny model on a SQLite table, load it back, ask it questions.

    python examples/demo.py [--dir llmtrain-demo] [--steps 60]

About half a minute on a laptop CPU, no download: it writes a SQLite file with a ``docs`` table
(id, instruction, output, lang) and builds a tiny local model, both in ./llmtrain-demo/. With
your own data, connect to your database and name a real model (``model="Qwen/Qwen2.5-0.5B"``).
The other examples reuse its table (``rows``, ``write_table``).
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import textwrap
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import llmtrain as lt
from llmtrain.cli.report import query_text
from llmtrain.console import quiet, say, table
from llmtrain.errors import ConfigError
from llmtrain.testing import tiny_model
from llmtrain.uri import redact_uri

DEFAULT_DIR = Path("llmtrain-demo")
DEFAULT_STEPS = 60
_MARKER = ".llmtrain-demo"
_DB_FILE = "demo.db"

# (English phrasings, French phrasings, [(English, answer, French, French answer)]): three
# English and two French rows per fact, so the `lang = 'en'` selection visibly matters.
_KINDS: list[tuple[list[str], list[str], list[tuple[Any, str, Any, str]]]] = [
    (
        ["What is the capital of {}?", "Name the capital of {}.", "{}: which city is the capital?"],
        ["Quelle est la capitale de {} ?", "Capitale de {} ?"],
        [
            ("France", "Paris", "la France", "Paris"),
            ("Japan", "Tokyo", "le Japon", "Tokyo"),
            ("Italy", "Rome", "l'Italie", "Rome"),
            ("Egypt", "Cairo", "l'Egypte", "Le Caire"),
            ("Peru", "Lima", "le Pérou", "Lima"),
        ],
    ),
    (
        ["What is the opposite of {}?", "Give the opposite of {}.", "Opposite of {}?"],
        ["Quel est le contraire de {} ?", "Contraire de {} ?"],
        [
            ("hot", "cold", "chaud", "froid"),
            ("up", "down", "haut", "bas"),
            ("day", "night", "jour", "nuit"),
            ("fast", "slow", "rapide", "lent"),
        ],
    ),
    (
        ["What sound does a {} make?", "What does a {} say?", "A {} makes which sound?"],
        ["Quel bruit fait {} ?", "Que dit {} ?"],
        [
            ("cat", "meow", "le chat", "miaou"),
            ("dog", "woof", "le chien", "ouaf"),
            ("cow", "moo", "la vache", "meuh"),
            ("duck", "quack", "le canard", "coin-coin"),
        ],
    ),
    (
        ["What is {} plus {}?", "Compute {} + {}.", "{} + {} = ?"],
        ["Combien font {} plus {} ?", "Calcule {} + {}."],
        [((a, b), str(a + b), (a, b), str(a + b)) for a, b in [(2, 2), (3, 4), (5, 5)]],
    ),
]


def facts() -> list[tuple[list[str], str, list[str], str]]:
    """The demo's 16 facts, each with its English and French phrasings."""

    def fill(forms: list[str], what: Any) -> list[str]:
        return [f.format(*what) if isinstance(what, tuple) else f.format(what) for f in forms]

    return [
        (fill(en_forms, en), answer, fill(fr_forms, fr), answer_fr)
        for en_forms, fr_forms, items in _KINDS
        for en, answer, fr, answer_fr in items
    ]


def rows() -> list[dict[str, Any]]:
    """The ``docs`` table: 80 rows of ``id, instruction, output, lang``."""
    out: list[dict[str, Any]] = []
    for en, answer, fr, answer_fr in facts():
        out += [{"instruction": q, "output": answer, "lang": "en"} for q in en]
        out += [{"instruction": q, "output": answer_fr, "lang": "fr"} for q in fr]
    return [{"id": i, **row} for i, row in enumerate(out)]


def write_table(db_file: Path) -> None:
    """Plain ``sqlite3``: the data is any table you already have; llmtrain only reads it."""
    with closing(sqlite3.connect(db_file)) as conn, conn:  # closed, after a commit
        conn.execute("DROP TABLE IF EXISTS docs")
        conn.execute(
            "CREATE TABLE docs (id INTEGER PRIMARY KEY, instruction TEXT NOT NULL, "
            "output TEXT NOT NULL, lang TEXT NOT NULL)"
        )
        conn.executemany("INSERT INTO docs VALUES (:id, :instruction, :output, :lang)", rows())


def prepare(workdir: str | Path = DEFAULT_DIR) -> tuple[str, Path]:
    """A fresh demo database in ``workdir`` and a tiny local base model: ``(uri, model)``.
    The model (the same bytes every time) is reused; a folder not the demo's is refused."""
    workdir = Path(workdir).resolve()
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / _MARKER).exists():
        raise ConfigError(
            f"{workdir} is not empty and is not a demo folder; pick another with --dir"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / _MARKER).write_text("Written by examples/demo.py; safe to delete.\n")
    db_file = workdir / _DB_FILE
    for stale in (db_file, Path(f"{db_file}-wal"), Path(f"{db_file}-shm")):
        stale.unlink(missing_ok=True)
    shutil.rmtree(Path(f"{db_file}.artifacts"), ignore_errors=True)
    write_table(db_file)
    corpus = [f"{r['instruction']} {r['output']}" for r in rows()]  # a tokenizer that fits
    return f"sqlite:///{db_file}", tiny_model(workdir / "tiny-llama", corpus=corpus)


def run(workdir: str | Path = DEFAULT_DIR, steps: int = DEFAULT_STEPS) -> None:
    started = time.perf_counter()
    quiet()
    say(f"llmtrain demo: LoRA fine-tuning of a tiny model on a SQLite table ({steps} steps)\n")
    if (Path(workdir) / _DB_FILE).exists():
        say("(the demo ran here before: starting over with a fresh database)\n")
    uri, base_model = prepare(workdir)
    data = rows()
    english = sum(r["lang"] == "en" for r in data)
    say(f"1. Data: table 'docs' in {redact_uri(uri)}: {len(data)} rows, {english} in English")
    header = ["id", "instruction", "output", "lang"]
    say(_table([tuple(r[k] for k in header) for r in data[:5]], header) + "\n   ...\n")
    trainer = lt.LLMTrainer(
        "demo-qa",
        model=base_model,
        prompt_template="### Question:\n{X}\n\n### Answer:\n{Y}",
        max_steps=steps,
        batch_size=16,
        learning_rate=2e-2,
        lora_r=16,
        lora_dropout=0.0,
    )
    with closing(lt.connect(uri)) as db:
        say(
            "2. Fine-tune: trainer.fit(X='instruction', Y='output', db=db, "
            "select=Table('docs').where('lang = :l', l='en'))"
        )
        model = trainer.fit(
            X="instruction", Y="output", db=db, select=lt.Table("docs").where("lang = :l", l="en")
        )
        history = model.record.history
        say(
            f"   loss fell from {history[0]['loss']:.3f} (step 1) to {history[-1]['loss']:.3f} "
            f"(step {history[-1]['step']:.0f})"
        )
        marks = {1, len(history), *range(10, len(history), 10)}
        say(
            "   by step: "
            + "  ".join(f"{h['step']:.0f}: {h['loss']:.2f}" for h in history if h["step"] in marks)
            + "\n"
        )

        loaded = db.load("trainer", "demo-qa")
        fit = loaded.config.fit
        say(f"3. Stored: db.load('trainer', 'demo-qa') -> {loaded!r}")
        say(
            f"   equal to the trainer that ran: {loaded == trainer}; it keeps its recipe: "
            f"X={fit.X!r}, Y={fit.Y!r}, rows {query_text(fit.select)}, data fingerprint "
            f"{(fit.data_fingerprint or '')[:12]}\n"
        )

        model = db.load("model", "demo-qa")
        say("4. Generate: db.load('model', 'demo-qa').generate(question)")
        probes = [(en[0], answer) for en, answer, _, _ in facts()][::3]
        answers = [model.generate(question, max_new_tokens=8).strip() for question, _ in probes]
        matches = [got == want for (_, want), got in zip(probes, answers)]
        checked = [
            (q, want, got, "yes" if ok else "no")
            for (q, want), got, ok in zip(probes, answers, matches)
        ]
        say(_table(checked, ["question", "trained answer", "generated", "match"]))
        say(f"   {sum(matches)}/{len(probes)} answers match the table\n")

        say("5. Replay: db.load('trainer', 'demo-qa').fit() runs the stored recipe again")
        replayed = db.load("trainer", "demo-qa").fit()
        first, again = history[-1]["loss"], replayed.record.history[-1]["loss"]
        say(
            f"   final loss {again:.4f} (first fit: {first:.4f}, "
            f"{'identical' if again == first else 'not identical'})\n"
        )

        say("6. Where everything went")
        say(
            f"   database    {uri.split(':///', 1)[1]}  (the docs table, trainers, models, "
            "runs, metrics)"
        )
        say(f"   artifacts   {db.artifacts.location}  (adapters and checkpoints)")
        say(f"   base model  {base_model}")
        runs = [
            (r.run_id, r.status, r.info.get("steps"), r.info.get("final_loss"))
            + (f"v{r.info.get('model_version')}", r.info.get("artifact"))
            for r in db.metadata.list_runs("trainer", "demo-qa")
        ]
        say(_table(runs, ["run id", "status", "steps", "final loss", "model", "adapter artifact"]))
    say(f"\nDone in {time.perf_counter() - started:.0f} s. Try: llmtrain show run --db {uri}")
    say(f"     or: llmtrain export demo-qa --db {uri} --merged merged-demo-qa")


def _table(rows: list[tuple[Any, ...]], header: list[str]) -> str:
    return textwrap.indent(table(rows, header), "   ")  # under its step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fine-tune a tiny model on a demo SQLite table")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="database and model folder")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    args = parser.parse_args(argv)
    try:
        run(args.dir, max(1, args.steps))
    except ConfigError as exc:
        raise SystemExit(f"demo: {exc}") from None


if __name__ == "__main__":
    main()
