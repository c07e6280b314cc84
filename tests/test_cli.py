"""The ``llmtrain`` command: config files and overrides, fit/show/replay/export on a
real SQLite database with the tiny model, clean exit-2 errors naming the option."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.config.file import (
    apply_overrides,
    build_job,
    build_query,
    check_path,
    load_job,
    parse_overrides,
    parse_value,
)
from llmtrain.db.queries import Collection, RawSQL, Table
from llmtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "config.yaml"
FAST = [
    "--name",
    "cli-test",
    "--training_args.max_steps",
    "4",
    "--training_args.save_steps",
    "2",
    "--training_args.progress_bar",
    "false",
]


def llmtrain_command() -> list[str]:
    """The installed console script, else the module (same code)."""
    script = shutil.which("llmtrain")
    return [script] if script else [sys.executable, "-m", "llmtrain.cli"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- config files, without training ------------------------------------------------------------
def test_override_values_are_yaml() -> None:
    assert parse_value("1e-4") == pytest.approx(1e-4)
    assert parse_value("3") == 3 and parse_value("false") is False
    assert parse_value("null") is None and parse_value("[q_proj, v_proj]") == ["q_proj", "v_proj"]
    assert parse_value("lang = :l") == "lang = :l"
    assert parse_overrides(
        [
            "--training_args.learning_rate",
            "1e-4",
            "--lora_args=null",
            "--data.select.params.l",
            "fr",
        ]
    ) == [
        ("training_args.learning_rate", pytest.approx(1e-4)),
        ("lora_args", None),
        ("data.select.params.l", "fr"),
    ]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("training_args.learnin_rate", "TrainingArguments has no 'learnin_rate'"),
        ("trainig_args.learning_rate", "the config file has no 'trainig_args'"),
        ("lora_args.r.x", "has no sub-options"),
        ("data.select.bogus", "data.select has no 'bogus'"),
        ("name.first", "single value"),
    ],
)
def test_unknown_override_paths_are_named(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"--{re.escape(path)}.*{message}"):
        check_path(path)


def test_overrides_create_missing_sections_and_leave_the_input_alone() -> None:
    config = {"name": "a", "lora_args": None, "data": {"select": {"table": "docs"}}}
    out = apply_overrides(config, [("lora_args.r", 4), ("data.select.params.l", "en")])
    assert out["lora_args"] == {"r": 4} and out["data"]["select"]["params"] == {"l": "en"}
    assert config["lora_args"] is None and "params" not in config["data"]["select"]


def test_selection_forms() -> None:
    assert build_query({"table": "docs", "where": "lang = :l", "params": {"l": "en"}}) == Table(
        "docs"
    ).where("lang = :l", l="en")
    assert build_query(Table("docs").to_dict()) == Table("docs")
    assert build_query({"collection": "docs", "filter": {"lang": "en"}}) == Collection("docs").find(
        {"lang": "en"}
    )
    assert build_query({"sql": "SELECT id, q FROM t", "key": "id"}) == RawSQL(
        "SELECT id, q FROM t", key="id"
    )
    with pytest.raises(ConfigError, match="exactly one of"):
        build_query({"table": "docs", "collection": "docs"})
    with pytest.raises(ConfigError, match=r"collection: does not take \['where'\]"):
        build_query({"collection": "docs", "where": "x"})
    with pytest.raises(ConfigError, match="needs key"):
        build_query({"sql": "SELECT 1"})


def test_config_validation_names_the_field(tmp_path: Path) -> None:
    job = load_job(CONFIG, ["--db", "sqlite:///x.db", "--lora_args", "null"])
    trainer = lt.LLMTrainer(job.config.name, **job.options)
    assert trainer.config.lora_args is None  # null: full fine-tuning
    assert job.select == Table("docs").where("lang = :l", l="en")
    with pytest.raises(ConfigError, match="config.data.X"):
        build_job(
            {
                "name": "a",
                "db": "sqlite://",
                "model_args": {"model_name_or_path": "m"},
                "data": {"Y": "b", "select": {"table": "t"}},
            }
        )
    with pytest.raises(ConfigError, match="config.epochs: unknown option"):
        build_job({"name": "a", "epochs": 3})
    with pytest.raises(ConfigError, match="LLMTRAIN_DB_URI"):
        build_job(
            {
                "name": "a",
                "model_args": {"model_name_or_path": "m"},
                "data": {"X": "a", "Y": "b", "select": {"table": "t"}},
            },
            env={},
        )
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_job(bad)


# -- the command, end to end -------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/config.yaml's working directory: ./llmtrain-demo/ with the demo table."""
    import demo

    root = tmp_path_factory.mktemp("cli")
    demo.prepare(root / "llmtrain-demo")
    return root


@pytest.fixture(scope="module")
def fitted(workdir: Path) -> str:
    """Run ``llmtrain fit examples/config.yaml`` once; returns the database URI."""
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        assert main(["fit", str(CONFIG), *FAST]) == 0
    finally:
        os.chdir(cwd)
    return f"sqlite:///{workdir / 'llmtrain-demo' / 'demo.db'}"


def test_fit_from_yaml_with_overrides(fitted: str, capsys: pytest.CaptureFixture[str]) -> None:
    import llmtrain as lt

    db = lt.connect(fitted)
    trainer = db.load("trainer", "cli-test")
    assert trainer.config.training_args.max_steps == 4
    assert trainer.config.training_args.learning_rate == pytest.approx(2e-2)  # "2e-2" in YAML
    assert trainer.config.lora_args.r == 16
    (run,) = db.metadata.list_runs("trainer", "cli-test")
    assert run.status == "completed" and run.info["steps"] == 4
    assert run.info["query"] == Table("docs").where("lang = :l", l="en").to_dict()
    assert [c.step for c in db.metadata.list_checkpoints(run.run_id)] == [2, 4]
    db.close()


def test_show_tables(fitted: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "show", "--db", fitted)
    assert code == 0 and re.search(r"trainer\s+cli-test\s+0", out)
    code, out, _ = run_cli(capsys, "show", "trainer", "--db", fitted)
    assert code == 0 and re.search(r"cli-test\s+0\s+\d+\s+completed", out)
    code, out, _ = run_cli(capsys, "show", "trainer", "cli-test", "--db", fitted)
    assert "LoRA r=16" in out and "from table docs where lang = :l {'l': 'en'}" in out
    assert re.search(r"[0-9a-f]{32}\s+cli-test v0\s+completed\s+4\s", out)
    code, out, _ = run_cli(capsys, "show", "model", "cli-test", "--db", fitted)
    assert code == 0 and re.search(r"^0\s+\S+ \S+\s+[0-9a-f]{32}\s+0\s+[\d.]+\s+tree:", out, re.M)
    run_id = re.search(r"[0-9a-f]{32}", out).group(0)
    code, out, _ = run_cli(capsys, "show", "run", run_id[:8], "--db", fitted)
    assert code == 0 and f"run        {run_id}" in out
    assert re.search(r"STEP\s+LOSS\s+LR", out) and "CHECKPOINT" in out


def test_replay_and_export(fitted: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmtrain as lt

    code, out, _ = run_cli(capsys, "replay", "cli-test", "--db", fitted)
    assert code == 0 and "replaying cli-test v0 on table docs" in out
    assert re.search(r"completed, 4 steps, final loss", out)
    db = lt.connect(fitted)
    runs = db.metadata.list_runs("trainer", "cli-test")
    assert [r.status for r in runs[-2:]] == ["completed", "completed"]
    assert runs[-1].info["data_fingerprint"] == runs[-2].info["data_fingerprint"]

    out_dir = tmp_path / "merged"
    code, out, _ = run_cli(capsys, "export", "cli-test", "--db", fitted, "--merged", str(out_dir))
    assert code == 0 and "wrote cli-test v1 merged into the full-precision base" in out
    merged = AutoModelForCausalLM.from_pretrained(out_dir)
    ids = AutoTokenizer.from_pretrained(out_dir)(["What is 2 plus 2?"], return_tensors="pt")
    with torch.no_grad():
        assert merged(**ids).logits.shape[-1] == merged.config.vocab_size
    code, _, err = run_cli(capsys, "export", "cli-test", "--db", fitted, "--merged", str(out_dir))
    assert code == 2 and "already exists" in err
    db.close()


def test_missing_components_and_databases_fail_cleanly(
    fitted: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run_cli(capsys, "replay", "nope", "--db", fitted)
    assert code == 2 and "'nope'" in err and "Traceback" not in err  # a user's mistake: 2
    code, _, err = run_cli(capsys, "show", "trainer", "nope", "--db", fitted)
    assert code == 2 and "known: cli-test" in err
    monkeypatch.delenv("LLMTRAIN_DB_URI", raising=False)
    code, _, err = run_cli(capsys, "show")
    assert code == 2 and "--db" in err
    code, _, err = run_cli(capsys, "show", "--bogus")
    assert code == 2 and "unrecognized arguments: --bogus" in err
    # a key no integer column holds: one short line, the user's mistake (a ValueError: exit 1)
    for key, said in (("9" * 5000, "a key of 5000 characters"), ("9" * 100, "is not a key of")):
        code, _, err = run_cli(capsys, "trained-on", "docs", key, "--db", fitted)
        assert code == 2 and said in err and err.count("\n") == 1 and len(err) < 300


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--training_args.learnin_rate", "1e-4"],
            "unknown option --training_args.learnin_rate: TrainingArguments has no 'learnin_rate'",
        ),
        (["--training_args.learning_rate", "-1"], "LLMTrainer.training_args.learning_rate"),
        (["--lora_args.r", "0"], "LLMTrainer.lora_args.r"),
        (["--data.select", "{table: docs, filter: {}}"], "data.select: table: does not take"),
        (["--training_args.learning_rate"], "needs a value"),
        (["--resum"], "unknown option --resum: the config file has no 'resum'"),
    ],
)
def test_bad_overrides_exit_2_naming_the_option(
    workdir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "fit", str(CONFIG), "--db", "sqlite://", *args)
    assert code == 2 and message in err and "Traceback" not in err + out


def test_each_command_reports_its_own_mistakes_and_describes_itself(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, expected in [
        (
            ["replay", "X", "--verison", "0"],
            "llmtrain replay: error: unrecognized arguments: --verison 0",
        ),
        # a prefix is a typo too, not the option it starts (`--resum` must not resume)
        (["replay", "X", "--resum"], "unrecognized arguments: --resum"),
        (["forgt", "docs", "1"], "invalid choice: 'forgt' (choose from 'fit', "),
    ]:
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and expected in err and err.count("\n") == 1, err
    from llmtrain.cli import build_parser

    for command in (
        "fit",
        "show",
        "replay",
        "export",
        "lineage",
        "trained-on",
        "forget",
    ):
        code, out, _ = run_cli(capsys, command, "--help")
        paragraphs = out.split("\n\n")
        assert code == 0 and paragraphs[0].startswith(f"usage: llmtrain {command}")
        assert paragraphs[1].strip() and not paragraphs[1].startswith(("positional", "options"))
    assert build_parser().prog == "llmtrain"


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_a_server_database_that_does_not_exist_is_the_users_mistake(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2, one line naming the database, as for a SQLite file that is not there."""
    from conftest import MY_ADMIN, PG_ADMIN

    uri = f"{PG_ADMIN if kind == 'postgresql' else MY_ADMIN}/lt_no_such_database"
    for argv in (["show"], ["trained-on", "docs", "1"], ["replay", "x"]):
        code, out, err = run_cli(capsys, *argv, "--db", uri)
        assert code == 2 and err.count("\n") == 1, err
        assert "lt_no_such_database" in err and "Traceback" not in out + err


def test_subprocess_errors_are_clean_and_never_show_passwords(workdir: Path) -> None:
    secret_db = "postgresql+psycopg://user:s3cret-pw@127.0.0.1:9/db"
    result = subprocess.run(
        [*llmtrain_command(), "fit", str(CONFIG), "--db", secret_db, "--trainig_args.seed", "1"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "has no 'trainig_args'" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run(
        [*llmtrain_command(), "fit", str(CONFIG), "--db", secret_db, "--data.X", "null"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "config.data.X" in result.stderr
    assert "s3cret" not in result.stdout + result.stderr


@pytest.mark.parametrize("password", ["s3cret-pw", "s3cret/pw", "s3cret#pw", "s3cret?pw"])
def test_show_redacts_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], password: str
) -> None:
    """Also a password with ``/``, ``#`` or ``?`` in it, which the driver reads up to the ``@``."""
    from conftest import fresh_database

    databases = fresh_database("postgresql", tmp_path)
    uri = next(databases)
    try:
        with_password = uri.replace("://postgres@", f"://postgres:{password}@")
        assert with_password != uri  # trust auth: the server ignores the password
        code, out, err = run_cli(capsys, "show", "--db", with_password)
        assert code == 0 and "postgres:***@" in out
        assert "s3cret" not in out + err
    finally:
        from llmtrain.db.engines import dispose_sql_engine

        dispose_sql_engine(with_password)
        next(databases, None)


def test_an_unreachable_server_and_a_bad_uri_are_one_line_without_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unreachable = "postgresql+psycopg://u:s3cret@127.0.0.1:1/db"
    code, out, err = run_cli(capsys, "show", "--db", unreachable)
    assert code == 1 and err.count("\n") == 1 and err.startswith("llmtrain: error: ")
    for bad in ("postgresql+psycopg://u:s3cret@127.0.0.1:noport/db", "{postgresql://u:s3cret@h/db"):
        code, out, err = run_cli(capsys, "show", "--db", bad)
        assert code == 2 and "not a valid database URI" in err and "u:***@" in err
        assert "s3cret" not in out + err and err.count("\n") == 1
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    code, _, err = run_cli(capsys, "fit", str(tmp_path / "latin1.yaml"))
    assert code == 2 and "not UTF-8 text (byte 0xe9 at position 9)" in err


def _cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*llmtrain_command(), *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["fit", str(CONFIG), "--data.X", "nope", *FAST],
            "llmtrain: error: table docs has no column 'nope'; "
            "columns: ['id', 'instruction', 'lang', 'output']",
        ),
        (
            ["show", "--db", "sqlite:///typo.db"],
            "llmtrain: error: no SQLite database at typo.db (sqlite:///typo.db): check the path",
        ),
        (
            ["replay", "no-such-trainer", "--db", "sqlite:///llmtrain-demo/demo.db"],
            "llmtrain: error: no trainer 'no-such-trainer' (any version) in "
            "sqlite:///llmtrain-demo/demo.db",
        ),
        (
            ["fit", str(CONFIG), "--model_args.model_name_or_path", "./no-model-here"],
            "llmtrain: error: model_args.model_name_or_path: no model folder at",
        ),
    ],
)
def test_user_mistakes_exit_2_with_one_line(workdir: Path, argv: list[str], message: str) -> None:
    result = _cli(workdir, *argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert not (workdir / "typo.db").exists()


def test_output_cut_short_by_its_reader_ends_quietly(fitted: str, workdir: Path) -> None:
    """`llmtrain show run X | head`: the reader is gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader at all: the first write fails with EPIPE
    try:
        result = subprocess.run(
            [*llmtrain_command(), "show", "run", "cli-test", "--db", fitted],
            cwd=workdir,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (0, "")
    # and with a reader, the same command writes the runs
    shown = _cli(workdir, "show", "run", "cli-test", "--db", fitted)
    assert shown.returncode == 0 and "completed" in shown.stdout
