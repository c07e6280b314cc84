"""``export --format gguf`` without llama.cpp: where the converters come from, the command lines
they are run with (a stand-in converter records them), the k-quant step through the binding, what
is refused before converting, and the Ollama Modelfile. .ci/serving runs the real converters and
llama.cpp on what this writes."""

from __future__ import annotations

import ctypes
import io
import json
import sys
import tarfile
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import fill
from test_export import ROWS, _fit

import llmtrain as lt
from llmtrain.cli import main
from llmtrain.errors import ConfigError
from llmtrain.formatting import Formatter
from llmtrain.testing import CHAT_TEMPLATE
from llmtrain.training import gguf

#: a stand-in for llama.cpp's converters: its "GGUF" is the command line and the source's files
FAKE = """import json, os, sys
args = sys.argv[1:]
record = [os.path.basename(sys.argv[0]), *args, sorted(os.listdir(args[0]))]
open(args[args.index("--outfile") + 1], "w").write(json.dumps(record))
"""


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("gguf")
    fill(f"sqlite:///{folder / 'data.db'}", "docs", ROWS)
    return lt.connect(f"sqlite:///{folder / 'data.db'}", artifacts=folder / "artifacts")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama.cpp")
    for script in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py"):
        (folder / script).write_text(FAKE)
    return folder


def _written(path: Path) -> list[Any]:
    return list(json.loads(path.read_text()))


def test_merged_and_lora_gguf_command_lines_modelfile_and_refusals(
    tiny: Path, db: Any, fake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _fit(tiny, db, "plain", max_steps=1)
    argv = ["export", "plain", "--db", db.uri, "--artifacts", str(db.artifacts.root)]
    gguf_argv = [*argv, "--format", "gguf", "--llama-cpp", str(fake)]
    assert main([*gguf_argv, "--merged", str(tmp_path / "m"), "--quant", "q8_0"]) == 0
    assert "wrote plain v0 as GGUF q8_0, with an Ollama Modelfile" in capsys.readouterr().out
    script, source, *options, files = _written(tmp_path / "m" / "model.gguf")
    assert script == gguf.HF and options[-2:] == ["--outtype", "q8_0"]
    assert {"model.safetensors", "chat_template.jinja", "tokenizer.json"} <= set(files)
    assert (tmp_path / "m" / "Modelfile").read_text() == (
        "FROM ./model.gguf\n"
        'TEMPLATE """### Instruction:\n{{ .Prompt }}\n\n### Response:\n"""\n'
        'PARAMETER stop "</s>"\nPARAMETER temperature 0\n'
    )
    note = json.loads((tmp_path / "m" / "llmtrain_export.json").read_text())
    assert (note["export"], note["quant"], note["files"]) == ("gguf", "q8_0", ["model.gguf"])

    model.export_gguf(tmp_path / "l", lora=True, llama_cpp=fake)  # base + LoRA, both f16
    script, source, *options = _written(tmp_path / "l" / "base.gguf")[:-1]
    assert (script, source, options[-2:]) == (gguf.HF, str(tiny), ["--outtype", "f16"])
    script, source, *options, files = _written(tmp_path / "l" / "adapter.gguf")
    assert script == gguf.LORA and options[:2] == ["--base", str(tiny)]
    assert options[-2:] == ["--outtype", "f16"]
    assert "adapter_config.json" in files
    modelfile = (tmp_path / "l" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./base.gguf\nADAPTER ./adapter.gguf\nTEMPLATE")

    _fit(tiny, db, "dora", max_steps=1, use_dora=True)
    dora = [gguf_argv[0], "dora", *gguf_argv[2:], "--adapter", str(tmp_path / "d")]
    assert main(dora) == 2 and not (tmp_path / "d").exists()
    assert capsys.readouterr().err == (
        "llmtrain: error: GGUF LoRA refused: llama.cpp refuse a DoRA adapter: export --merged "
        "instead (as GGUF)\n"
    )
    assert main([*gguf_argv, "--merged", str(tmp_path / "x"), "--quant", "q9"]) == 2
    assert "--quant q9: not a GGUF type; name one of f32, f16" in capsys.readouterr().err


def test_k_quants_go_through_the_binding_which_is_named_when_missing(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(ConfigError, match=r"pip install llama-cpp-python==0\.3\.36 \(or --quant"):
        gguf.convert(fake / gguf.HF, tmp_path, tmp_path / "m.gguf", "q4_k_m")

    class Params(ctypes.Structure):
        _fields_ = [("ftype", ctypes.c_int)]

    calls: list[tuple[bytes, bytes, int]] = []

    def quantize(source: bytes, out: bytes, params: Any) -> int:
        calls.append((source, out, params._obj.ftype))
        Path(out.decode()).write_text("quantised")
        return 0

    binding = types.SimpleNamespace(
        LLAMA_FTYPE_MOSTLY_Q4_K_M=15,
        llama_model_quantize_default_params=Params,
        llama_model_quantize=quantize,
    )
    monkeypatch.setitem(sys.modules, "llama_cpp", binding)
    (tmp_path / "hf").mkdir()
    gguf.convert(fake / gguf.HF, tmp_path / "hf", tmp_path / "m.gguf", "q4_k_m")
    f16 = tmp_path / "m.f16.gguf"
    assert calls == [(bytes(f16), bytes(tmp_path / "m.gguf"), 15)] and not f16.exists()


def test_the_converters_are_named_or_fetched_once_from_the_pinned_sdist(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMTRAIN_LLAMA_CPP", str(tmp_path))  # the argument first, then $ENV
    assert gguf.converters(fake) == fake
    with pytest.raises(ConfigError, match=f"llama.cpp folder {tmp_path} has no convert_hf_to"):
        gguf.converters()
    monkeypatch.delenv("LLMTRAIN_LLAMA_CPP")
    monkeypatch.setattr(Path, "home", lambda: tmp_path)
    commands: list[list[str]] = []

    def pip_download(command: list[str], what: str) -> None:  # an sdist of the same layout
        commands.append(command)
        folder = Path(command[command.index("-d") + 1])
        with tarfile.open(folder / "llama_cpp_python-0.3.36.tar.gz", "w:gz") as tar:
            for name in (
                "convert_hf_to_gguf.py",
                "convert_lora_to_gguf.py",
                "conversion/base.py",
                "gguf-py/gguf/__init__.py",
                "ggml/src/ggml.c",
            ):
                data = name.encode()
                info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/vendor/llama.cpp/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    monkeypatch.setattr(gguf, "run", pip_download)
    cache = tmp_path / ".cache" / "llmtrain" / "llama-cpp-python-0.3.36"
    assert gguf.converters() == cache == gguf.converters()  # downloaded once
    assert commands == [
        [
            sys.executable,
            *["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d"],
            commands[0][-2],
            "llama-cpp-python==0.3.36",
        ]
    ]
    found = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    assert found == [
        "conversion/base.py",
        "convert_hf_to_gguf.py",
        "convert_lora_to_gguf.py",
        "gguf-py/gguf/__init__.py",
    ]
    assert (cache / "conversion" / "base.py").read_text() == "conversion/base.py"


@pytest.mark.parametrize(
    ("template", "heal", "expected"),
    [
        ("Q: {X} A: {Y}", " ", "Q: {{ .Prompt }} A:"),
        ("{{{{{X}}}}} ->{Y}", "", '{{ "{{" }}{{ .Prompt }}}} ->'),  # Go's braces escaped
        (None, "", "<|user|>\n{{ .Prompt }}\n<|assistant|>\n"),  # a chat-trained model's own
    ],
)
def test_the_modelfile_template_is_the_served_prompt(
    tiny: Path, template: str | None, heal: str, expected: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = CHAT_TEMPLATE
    formatter = Formatter(tokenizer, template, chat_template=template is None)
    assert formatter.prompt("").heal == heal
    text = gguf.modelfile(formatter, ["model.gguf"])
    assert text == (
        (f"# answers start with {heal!r}, the healed prompt's end: cut it\n" if heal else "")
        + f'FROM ./model.gguf\nTEMPLATE """{expected}"""\n'
        + 'PARAMETER stop "</s>"\nPARAMETER temperature 0\n'
    )
