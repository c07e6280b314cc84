"""The tiny-model builder: loads through the real auto classes, consistent ids, idempotent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmtrain.errors import ConfigError
from llmtrain.testing import tiny_model


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A fixed name under the session's base temp: test_formatting.py's fixture reuses the build.
    return tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


def test_loads_through_auto_classes_with_consistent_special_tokens(llama_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_path)
    tok = AutoTokenizer.from_pretrained(llama_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tok.is_fast
    assert {tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token} == {
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    }
    assert tok.pad_token_id != tok.eos_token_id
    cfg = model.config
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert model.get_input_embeddings().num_embeddings == len(tok) == cfg.vocab_size
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert tok("Hello world")["input_ids"][0] == tok.bos_token_id
    assert tok.decode(tok("Hello world")["input_ids"], skip_special_tokens=True) == "Hello world"
    assert "{% generation %}" in tok.chat_template


def test_forward_on_a_padded_batch(llama_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_path)
    tok = AutoTokenizer.from_pretrained(llama_path)
    batch = tok(["The quick brown fox", "Hi"], return_tensors="pt", padding=True)
    assert (batch["input_ids"] == tok.pad_token_id).any()
    out = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
    assert out.logits.shape == (*batch["input_ids"].shape, len(tok))
    assert torch.isfinite(out.loss)


def test_idempotent_and_deterministic(llama_path: Path, tmp_path: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in llama_path.iterdir()}
    assert tiny_model(llama_path) == llama_path
    assert {p.name: p.stat().st_mtime_ns for p in llama_path.iterdir()} == before

    rng = torch.random.get_rng_state()
    other = tiny_model(tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's RNG is left alone
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (llama_path / name).read_bytes(), name


def test_different_arguments_rebuild(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "m", vocab_size=320, seed=0)
    first = (path / "model.safetensors").read_bytes()
    tiny_model(path, vocab_size=320, seed=1, corpus=["zyxwvut " * 50])
    assert (path / "model.safetensors").read_bytes() != first
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok("zyxwvut", add_special_tokens=False)["input_ids"]) == 1  # learned from corpus


@pytest.mark.parametrize("arch", ["opt", "qwen2"])
def test_other_architectures(arch: str, tmp_path: Path) -> None:
    path = tiny_model(tmp_path / arch, arch, vocab_size=320, hidden_size=32, num_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    out = model(**tok(["a b c", "d"], return_tensors="pt", padding=True))
    assert out.logits.shape[-1] == len(tok)


def test_grouped_query_attention(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "gqa", num_kv_heads=2)
    assert AutoModelForCausalLM.from_pretrained(path).config.num_key_value_heads == 2


def test_refuses_bad_arguments_and_foreign_directories(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="arch"):
        tiny_model(tmp_path / "x", "gpt9")
    with pytest.raises(ConfigError, match="divisible"):
        tiny_model(tmp_path / "x", hidden_size=30, num_heads=4)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "important.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="refusing"):
        tiny_model(foreign)
    assert (foreign / "important.txt").read_text() == "keep me"


def test_in_ci_every_skip_fails(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """One session-level rule (tests/conftest.py): a test that would skip in CI (a server, a
    package or a tool missing there) fails instead, whatever made it skip and wherever: in the
    test, in a fixture's setup (a missing server) or at collection (``importorskip``)."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(
        test_skips="""
        import pytest
        @pytest.fixture
        def server():
            pytest.skip("server not reachable")
        def test_needs_a_server():
            pytest.skip("server not reachable")
        def test_needs_a_fixture(server):
            pass
        def test_runs():
            pass
        """,
        test_module="""
        import pytest
        pytest.importorskip("no_such_package_here")
        def test_never_collected():
            pass
        """,
    )
    monkeypatch.delenv("CI", raising=False)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1, skipped=3)
    monkeypatch.setenv("CI", "1")
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "--continue-on-collection-errors"
    )
    result.assert_outcomes(passed=1, failed=1, errors=2)
    assert result.stdout.str().count("skipped in CI, which must run every test") >= 3


def test_ci_waits_for_a_login_that_runs_a_query() -> None:
    """.ci/run waits for each server until the tests' own login runs a query: a login the
    server turns away fails it, where pg_isready and mariadb-admin ping answer yes."""
    script = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    logins = "\n".join(line for line in script.splitlines() if "_login() {" in line)

    def run(command: str, **env: str) -> int:
        job = subprocess.run(["bash", "-c", f"{logins}\n{command}"], env={**os.environ, **env})
        return job.returncode

    assert run("pg_login") == 0 and run("mariadb_login") == 0
    assert run("pg_login", PGDATABASE="no_such_database") != 0
    assert run("pg_isready -q -h 127.0.0.1", PGDATABASE="no_such_database") == 0
    assert run("mariadb_login", MYSQL_PWD="wrong") != 0
    ping = "mariadb-admin --protocol=tcp -h 127.0.0.1 -u root ping >/dev/null 2>&1"
    assert run(ping, MYSQL_PWD="wrong") == 0


def test_property_tests_are_seeded() -> None:
    """Every hypothesis test draws the same examples each run (tests/conftest.py), so a failing
    one reproduces, whatever its own @settings say."""
    from hypothesis import settings
    from test_forget import test_no_model_fitted_after_a_forget_holds_the_row as forget_property

    assert settings().derandomize
    assert forget_property._hypothesis_internal_use_settings.derandomize  # type: ignore[attr-defined]
