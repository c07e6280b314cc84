"""Every example runs as written (``python examples/X.py``) and prints what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 300  # each example takes well under a minute; a busy 2-core runner is slower


def run_example(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LLMTRAIN_DB_URI"}
    result = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env={**environ, **env}
    )
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
    return result


def test_every_example_is_covered() -> None:
    tested = {
        "demo.py",
        "postgres_example.py",
        "mongo_example.py",
        "qlora_dora.py",
        "config.yaml",
        "README.md",
    }
    assert {p.name for p in EXAMPLES.iterdir() if not p.name.startswith((".", "__"))} == tested


def test_demo_learns_then_reruns_in_the_same_folder(tmp_path: Path) -> None:
    """The quick start: the model visibly learns the table; a second run starts over."""
    demo = [sys.executable, str(EXAMPLES / "demo.py"), "--dir", str(tmp_path / "d")]
    out = run_example(demo, tmp_path).stdout
    first, last = map(
        float, re.search(r"loss fell from ([\d.]+) \(step 1\) to ([\d.]+)", out).groups()
    )
    assert last < 0.3 * first, out
    matched, probed = map(int, re.search(r"(\d+)/(\d+) answers match the table", out).groups())
    assert probed == 6 and matched >= 3, out
    result = run_example([*demo, "--steps", "6"], tmp_path)
    for part in (
        "(the demo ran here before: starting over with a fresh database)",
        "1. Data: table 'docs'",
        "80 rows, 48 in English",
        "3. Stored",
        "equal to the trainer that ran: True",
        "5. Replay",
        "6. Where everything went",
        "Done in",
    ):
        assert part in result.stdout, part
    assert len(re.findall(r"[0-9a-f]{32}\s+completed\s+6\s", result.stdout)) == 2  # fit, replay
    assert "fit demo-qa" in result.stderr  # the progress bar, with its loss/lr/tok_s postfix
    assert {p.name for p in (tmp_path / "d").iterdir()} == {
        ".llmtrain-demo",
        "demo.db",
        "demo.db.artifacts",
        "tiny-llama",
    }


def test_demo_refuses_a_folder_that_is_not_its_own(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    argv = [sys.executable, str(EXAMPLES / "demo.py"), "--dir", str(tmp_path)]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 1 and "not a demo folder" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_config_yaml_fits_with_the_cli(tmp_path: Path) -> None:
    import demo

    demo.prepare(tmp_path / "llmtrain-demo")  # what examples/demo.py leaves behind
    command = [sys.executable, "-m", "llmtrain.cli"]
    result = run_example(
        [*command, "fit", str(EXAMPLES / "config.yaml"), "--training_args.max_steps", "3"], tmp_path
    )
    assert "fitting demo-qa-yaml on table docs" in result.stdout
    assert re.search(r"run [0-9a-f]{32}: completed, 3 steps, final loss", result.stdout)
    assert "fit demo-qa-yaml" in result.stderr  # the progress bar
    shown = run_example(
        [*command, "show", "run", "demo-qa-yaml"],
        tmp_path,
        LLMTRAIN_DB_URI="sqlite:///llmtrain-demo/demo.db",
    ).stdout
    assert re.search(r"demo-qa-yaml v0\s+completed\s+3", shown)


def test_postgres_example(tmp_path: Path) -> None:
    import sqlalchemy as sa
    from conftest import PG_ADMIN, _server_or_skip

    engine = _server_or_skip("postgresql", PG_ADMIN)
    uri = f"{PG_ADMIN}/postgres"
    out = run_example(
        [sys.executable, str(EXAMPLES / "postgres_example.py")], tmp_path, LLMTRAIN_PG_URI=uri
    ).stdout
    assert "trained pg-qa on llmtrain_example_docs: loss" in out
    assert re.search(r"run [0-9a-f]{32}: completed, rows lang = :l \{'l': 'en'\}", out)
    assert "stored trainer reloads equal: True" in out and "dropped llmtrain_example_docs" in out
    with engine.connect() as conn:  # cleaned up after itself
        assert not sa.inspect(conn).has_table("llmtrain_example_docs")
    engine.dispose()


def test_mongo_example(tmp_path: Path) -> None:
    out = run_example([sys.executable, str(EXAMPLES / "mongo_example.py")], tmp_path).stdout
    assert "MongoDB: mongomock://localhost/example" in out
    assert "(X=meta.prompt, Y=answer): loss" in out
    assert "stored selection: {'lang': 'en'}, reloads equal: True" in out


def test_qlora_dora_example(tmp_path: Path) -> None:
    out = run_example([sys.executable, str(EXAMPLES / "qlora_dora.py")], tmp_path).stdout
    assert "trained qdora for 3 steps" in out
    layers, dora = map(
        int,
        re.search(
            r"base layers in 4-bit: (\d+) \(nf4\); DoRA magnitude "
            r"vectors: (\d+)",
            out,
        ).groups(),
    )
    assert layers > 0 and dora == layers, out
    assert list(tmp_path.iterdir()) == []  # everything went to a temporary folder
