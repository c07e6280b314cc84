"""GGUF exports by llama.cpp's converters (only in the llama-cpp-python sdist: fetched once, as
pinned here), k-quants by its binding, and an Ollama Modelfile that answers as generate()."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from llmtrain.errors import ConfigError, LlmtrainError

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the one pin: converters, binding, .ci/serving
HF, LORA = "convert_hf_to_gguf.py", "convert_lora_to_gguf.py"
CONVERTED = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py's own; others: the binding
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
QUANTS = (*CONVERTED, "q4_0", "q4_1", "q5_0", "q5_1", *K_QUANTS)
_PROMPT = {"add_generation_prompt": True}
_WANTED = [f"*/vendor/llama.cpp/{part}" for part in ("convert_*.py", "conversion/*", "gguf-py/*")]


def converters(folder: str | Path | None = None) -> Path:
    """llama.cpp's converters: ``folder``, $LLMTRAIN_LLAMA_CPP, or the sdist's, kept in ~/.cache."""
    if folder := folder or os.environ.get("LLMTRAIN_LLAMA_CPP"):
        if not (Path(folder) / HF).is_file():
            raise ConfigError(f"llama.cpp folder {folder} has no {HF}")
        return Path(folder)
    cache = Path.home() / ".cache" / "llmtrain" / LLAMA_CPP_PYTHON.replace("==", "-")
    if not (cache / HF).is_file():
        with tempfile.TemporaryDirectory(prefix="llmtrain-sdist-") as scratch:
            pip = ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", scratch]
            run([sys.executable, *pip, LLAMA_CPP_PYTHON], "pip download")
            with tarfile.open(next(Path(scratch).glob("*.tar.gz"))) as tar:
                kept = [m for m in tar if m.isfile() and any(fnmatch(m.name, w) for w in _WANTED)]
                tar.extractall(scratch, members=kept, filter="data")
            cache.parent.mkdir(parents=True, exist_ok=True)
            os.replace(next(Path(scratch).glob("*/vendor/llama.cpp")), cache)
    return cache


def binding(quant: str) -> Any:  # llama_cpp for a quant the converter does not write
    if quant not in QUANTS:
        raise ConfigError(f"--quant {quant}: not a GGUF type; name one of {', '.join(QUANTS)}")
    try:
        return None if quant in CONVERTED else __import__("llama_cpp")
    except ImportError:
        raise ConfigError(
            f"--quant {quant} quantises with llama.cpp's binding: pip install "
            f"{LLAMA_CPP_PYTHON} (or --quant f16 or q8_0, which need none)"
        ) from None


def run(command: list[str], what: str) -> None:
    if (done := subprocess.run(command, capture_output=True, text=True)).returncode:
        raise LlmtrainError(f"{what} failed: {' | '.join(done.stderr.splitlines()[-3:])}")


def convert(script: Path, source: Path, out: Path, quant: str, *extra: str) -> None:
    """A converter run by this Python; to a quant it does not write through f16 and the binding."""
    llama_cpp = binding(quant)
    to = out if llama_cpp is None else out.with_suffix(".f16.gguf")
    command = [sys.executable, str(script), str(source), *extra, "--outfile", str(to)]
    run([*command, "--outtype", "f16" if llama_cpp else quant], script.name)
    if llama_cpp is not None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
        if llama_cpp.llama_model_quantize(bytes(to), bytes(out), ctypes.byref(params)):
            raise LlmtrainError(f"llama_model_quantize of {to} to {quant} failed")
        to.unlink()


def modelfile(formatter: Any, files: list[str]) -> str:
    """FROM (ADAPTER) ``files``, TEMPLATE the served prompt (without BOS), EOS stops, greedy."""
    tokenizer, heal = formatter.tokenizer, formatter.prompt("").heal
    chat, template = [{"role": "user", "content": "\0"}], formatter.served_chat_template()
    text = tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False, **_PROMPT)
    text = str(text).removeprefix(tokenizer.bos_token or "").replace("{{", '{{ "{{" }}')
    lines = [f"# answers start with {heal!r}, the healed prompt's end: cut it"] if heal else []
    lines += [f"{key} ./{name}" for key, name in zip(("FROM", "ADAPTER"), files)]
    lines += [f'TEMPLATE """{text.replace(chr(0), "{{ .Prompt }}")}"""']
    lines += [f"PARAMETER stop {json.dumps(tokenizer.eos_token)}", "PARAMETER temperature 0"]
    return "\n".join(lines) + "\n"
