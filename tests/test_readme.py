"""The README's quick start is what CI runs: the two commands stay in sync with .ci/run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README quick start has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_is_two_commands_demo_then_tests() -> None:
    demo, tests = _quick_start()
    assert "python3 examples/demo.py" in demo
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command() -> None:
    _, tests = _quick_start()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f"{tests!r} is not a line of .ci/run"
