"""Mistakes a new user makes, each answered at once in one clear line: a model folder
without a model, a hub id with no hub to ask, wrong argument types for connect() and
fit(); and a fit that keeps third-party noise out of its output unless asked."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import llmtrain as lt
from llmtrain.config.args import ModelArguments
from llmtrain.console import quieted
from llmtrain.errors import ConfigError
from llmtrain.training import modeling

REPO = Path(__file__).resolve().parents[1]


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter importing this checkout, stdout/stderr captured."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


# -- model sources -----------------------------------------------------------------------------
def test_a_folder_without_a_model_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"folder '.*empty' has no model \(no config.json"):
        modeling.load_tokenizer(ModelArguments(model_name_or_path=str(empty)))
    with pytest.raises(ConfigError, match="has no model"):
        modeling.load_model(ModelArguments(model_name_or_path=str(empty)), torch.device("cpu"))

    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"'.*weights-only' has no tokenizer"):
        modeling.load_tokenizer(ModelArguments(model_name_or_path=str(weights_only)))

    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"'.*tokenizer-only' has no model \(no config.json\)"):
        modeling.load_model(
            ModelArguments(model_name_or_path=str(tokenizer_only)), torch.device("cpu")
        )


def test_a_missing_local_path_is_not_sent_to_the_hub(tmp_path: Path) -> None:
    for name in (str(tmp_path / "nope"), "./nope", "models/org/nope"):
        with pytest.raises(ConfigError, match=f"no model folder at '{name}'"):
            modeling.load_tokenizer(ModelArguments(model_name_or_path=name))


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """HF_HUB_OFFLINE unset, and no remembered reachability from an earlier test."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    modeling._reachable.cache_clear()
    yield
    modeling._reachable.cache_clear()


def _timed_refusal(name: str) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        modeling.load_tokenizer(ModelArguments(model_name_or_path=name))
    return str(info.value), time.monotonic() - start


def _connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The address of every socket connection this process tries."""
    tried: list[Any] = []
    connect = socket.socket.connect

    def counted(self: socket.socket, address: Any) -> Any:
        tried.append(address)
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    return tried


def test_a_hub_id_with_the_hub_refusing_connections_fails_at_once(
    online: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    with socket.socket() as sock:  # a port that nothing listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    tried = _connections(monkeypatch)
    message, _ = _timed_refusal("some-org/no-such-model")
    assert tried == [("127.0.0.1", port)]  # one probe: none of the hub client's retries (48 s)
    assert message == (
        "model_args.model_name_or_path: 'some-org/no-such-model' is not a local folder and "
        f"the hub http://127.0.0.1:{port} is unreachable (no answer within 3 s), so it "
        "cannot be downloaded (and it is not in the Hugging Face cache)"
    )


def test_a_hub_id_with_a_silent_hub_fails_within_the_check_timeout(
    online: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    with socket.socket() as server:  # accepts connections (kernel backlog), never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(modeling, "HUB_CHECK_TIMEOUT_S", 1.0)
        message, seconds = _timed_refusal("some-org/no-such-model")
        server.setblocking(False)
        attempts = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                server.accept()[0].close()
                attempts += 1
    assert attempts == 1  # one probe: no hub client call and none of its retries
    assert seconds < 1.0 + 10, seconds  # one timeout, not the hub client's 48 s of retries
    assert f"the hub {endpoint} is unreachable (no answer within 1 s)" in message


def test_hf_hub_offline_refuses_an_uncached_hub_id_at_once_and_uses_the_cache(
    tiny: Path, tmp_path: Path
) -> None:
    # a Hugging Face cache holding the tiny model as the hub id lt-test/tiny
    repo = tmp_path / "hub" / "models--lt-test--tiny"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny, repo / "snapshots" / commit)
    result = _run_python(
        """
        import socket
        from llmtrain.errors import ConfigError
        from llmtrain.config.args import ModelArguments
        from llmtrain.training.modeling import load_tokenizer

        tried, connect = [], socket.socket.connect
        socket.socket.connect = lambda self, a: tried.append(a) or connect(self, a)
        try:
            load_tokenizer(ModelArguments(model_name_or_path="some-org/no-such-model"))
        except ConfigError as exc:
            print("refused:", exc)
        print("connections:", len(tried))
        tok = load_tokenizer(ModelArguments(model_name_or_path="lt-test/tiny"))
        print("cached:", type(tok).__name__, len(tok))
        """,
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp_path / "hub"),
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["refused"] == (
        "model_args.model_name_or_path: 'some-org/no-such-model' is not a local folder and "
        "the hub is offline (HF_HUB_OFFLINE is set), so it cannot be downloaded (and it is "
        "not in the Hugging Face cache)"
    )
    assert lines["connections"] == "0"  # nothing asked: no retries (they took 48 s)
    assert lines["cached"].split()[1] == str(len(modeling.load_tokenizer(_args(tiny))))


def _args(path: Path) -> ModelArguments:
    return ModelArguments(model_name_or_path=str(path))


# -- argument types ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((123,), {}, "connect() needs a database URI like sqlite:///data.db, got int 123"),
        (("data.db",), {}, "connect() needs a database URI like sqlite:///data.db, got 'data.db'"),
        (
            ("foo://host/db",),
            {},
            "connect(): no database backend serves 'foo' URIs (foo://host/db)",
        ),
        (
            ("postgresql+nodriver://u:pw@host/db",),
            {},
            "no database backend serves 'postgresql' URIs (postgresql+nodriver://u:***@host/db)",
        ),
        (
            ("sqlite:///x.db",),
            {"metadata_uri": 5},
            "connect(metadata_uri=) needs a database URI like sqlite:///data.db, got int 5",
        ),
        (
            ("sqlite:///x.db",),
            {"metadata_uri": "meta.db"},
            "connect(metadata_uri=) needs a database URI like sqlite:///data.db, got 'meta.db'",
        ),
        (
            ("sqlite:///x.db",),
            {"artifacts": 5},
            "connect(artifacts=) must be a folder, an fsspec URL or an ArtifactStore, got int 5",
        ),
        (("sqlite:///x.db",), {"retry": 3}, "connect(retry=) must be a RetryPolicy, got int 3"),
    ],
)
def test_connect_refuses_wrong_arguments_in_one_line(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        lt.connect(*args, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_connect_accepts_every_backend_it_serves(tmp_path: Path) -> None:
    for uri in (
        f"sqlite:///{tmp_path / 'x.db'}",
        "sqlite://",
        "postgresql://u@127.0.0.1/db",
        "mysql://root@127.0.0.1/db",
        "mariadb://root@127.0.0.1/db",
        "mongodb://127.0.0.1/db",
        "mongomock://localhost/db",
    ):
        assert lt.connect(uri, metadata_uri="mongomock://localhost/meta").uri == uri


def test_fit_refuses_a_uri_string_or_an_engine_for_db(tiny: Path, tmp_path: Path) -> None:
    import sqlalchemy as sa

    uri = f"sqlite:///{tmp_path / 'data.db'}"
    trainer = lt.LLMTrainer("t", model=tiny, prompt_template="{X} {Y}")
    with pytest.raises(ConfigError) as info:
        trainer.fit("q", "a", uri, lt.Table("qa"))
    assert str(info.value) == (
        "fit(db=) needs a database opened with llmtrain.connect(), got the string "
        f"{uri!r}: pass llmtrain.connect({uri!r})"
    )
    engine = sa.create_engine("postgresql+psycopg://u:secret@127.0.0.1/db")
    with pytest.raises(ConfigError, match="got Engine: pass llmtrain.connect") as info:
        trainer.fit("q", "a", db=engine, select=lt.Table("qa"))
    assert "secret" not in str(info.value)
    engine.dispose()


# -- third-party noise ---------------------------------------------------------------------------
NOISE = (
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes on a CPU without `kernels`
    "Setting accelerator to CPU",  # DeepSpeed's accelerator probe
    "Loading weights",  # transformers' loading bar
    "FutureWarning",
    "Skipping publisher trust check",  # bitsandbytes' kernels with HF_HUB_OFFLINE=1
    "lr_scheduler.step()",  # PyTorch, on a step whose rows were all skipped
)

FIT = """
import sqlite3, sys
import llmtrain as lt

folder, verbose = sys.argv[1], sys.argv[2] == "verbose"
con = sqlite3.connect(f"{folder}/data.db")
con.execute("CREATE TABLE qa (id INTEGER PRIMARY KEY, q TEXT, a TEXT)")
con.executemany("INSERT INTO qa VALUES (?, ?, ?)", [(i, f"q{i}", f"a{i}") for i in range(8)])
con.commit()
con.close()
db = lt.connect(f"sqlite:///{folder}/data.db")
ray = sys.argv[4] == "ray"
trainer = lt.LLMTrainer(
    "noise", model=sys.argv[3], prompt_template="Q: {X} A: {Y}", bits=4, max_steps=2,
    batch_size=2, progress_bar=ray, logging_steps=1, gradient_checkpointing=True,
    launcher=lt.Launcher(kind="torchrun", num_processes=1) if sys.argv[4] == "torchrun" else None,
    ray_config=lt.RayConfig(num_workers=2, storage=f"{folder}/ray") if ray else None,
)
model = trainer.fit("q", "a", db, lt.Table("qa"), verbose=verbose)
db.load("model", "noise").generate("q1", max_new_tokens=2)  # quiet whatever the fit was
print("stored", model.identifier, model.version)
"""

AFTER = """
import sqlite3, sys
import llmtrain as lt

folder, verbose = sys.argv[1], sys.argv[2] == "verbose"
db = lt.connect(f"sqlite:///{folder}/data.db")
db.load("model", "noise").export_merged(f"{folder}/merged")  # a fresh process: its own imports
con = sqlite3.connect(f"{folder}/data.db")
con.execute("UPDATE qa SET a = NULL")
con.commit()
con.close()
skipping = lt.LLMTrainer("skips", model=sys.argv[3], prompt_template="Q: {X} A: {Y}",
                         max_steps=1, batch_size=2, on_bad_row="skip", progress_bar=False)
try:
    skipping.fit("q", "a", db, lt.Table("qa"), verbose=verbose)
except lt.DataError as exc:
    print("every row skipped:", "no example was trained" in str(exc))
"""


@pytest.mark.parametrize(
    ("verbose", "launcher"), [(False, "-"), (True, "-"), (False, "torchrun"), (False, "ray")]
)
def test_a_fit_keeps_third_party_noise_out_unless_verbose(
    tiny: Path, tmp_path: Path, verbose: bool, launcher: str
) -> None:
    """In this process, and in the worker processes a launched fit (or Ray) starts; on Ray,
    piped, rank 0's progress lines come once each through the driver, and nothing of Ray's."""
    mode, output = "verbose" if verbose else "quiet", ""
    for script in (FIT, AFTER) if launcher == "-" else (FIT,):  # then an export, a skipped fit
        result = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path), mode, str(tiny), launcher],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        output += result.stdout + result.stderr
    assert "stored noise 0" in output and output.count("every row skipped: True") == (
        launcher == "-"
    )
    heard = [line for line in NOISE if line in output]
    if verbose:
        assert len(heard) >= 4, output  # the noise is real: verbose lets it through
    else:
        assert heard == [], output
    if launcher == "ray":
        lines = result.stderr.splitlines()
        assert [line.split(" loss ")[0] for line in lines] == [
            "fit noise: step 1/2",
            "fit noise: step 2/2",
        ], result.stderr


def test_quiet_is_scoped_to_the_call_and_respects_the_callers_settings() -> None:
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    def state() -> tuple[Any, ...]:
        return (
            list(warnings.filters),
            hf_logging.get_verbosity(),
            hf_logging.is_progress_bar_enabled(),
            hub_utils.are_progress_bars_disabled(),
            list(logging.getLogger("DeepSpeed").filters),
            os.environ.get("TRANSFORMERS_VERBOSITY"),
        )

    os.environ.pop("TRANSFORMERS_VERBOSITY", None)
    hf_logging.set_verbosity_warning()
    # a known start: an earlier in-process CLI call may have switched the bars off for good
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    before = state()
    with quieted():
        assert hf_logging.get_verbosity() == logging.ERROR
        assert not hf_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
            warnings.warn_explicit(
                "`x` is deprecated and will be removed in v6",
                FutureWarning,
                "modeling_utils.py",
                1,
                module="transformers.modeling_utils",
            )
            warnings.warn("a warning of the caller's own", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == ["a warning of the caller's own"]
    assert state() == before

    hf_logging.set_verbosity_info()  # asked for: a fit leaves it alone
    try:
        with quieted():
            assert hf_logging.get_verbosity() == logging.INFO
        with quieted(enabled=False):
            assert hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.set_verbosity_warning()
        if not bars_were_on:
            hf_logging.disable_progress_bar()
