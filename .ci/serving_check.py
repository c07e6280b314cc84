"""The serving lane's second half, in the stacks' own virtualenv: each export of
.ci/serving_exports.py, served by vLLM (adapter through LoRARequest, merged) and llama.cpp
(the GGUFs of `llmtrain export --format gguf`: merged f16, q8_0, q5_k_m, q4_k_m, base + LoRA
f16), answers its training prompts as generate() did, through the completion and the chat
interfaces; Ollama's Modelfile beside each GGUF sends those prompts; and what the stacks refuse
was said at export.

    LLAMA_CPP_CONVERTERS=DIR python .ci/serving_check.py OUT [vllm] [llama.cpp]

DIR: the llama-cpp-python sdist's vendor/llama.cpp (convert_hf_to_gguf.py, conversion/).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

MAX_TOKENS = 6  # as generate(max_new_tokens=6) in serving_exports.py
results: list[tuple[str, bool]] = []


def same(what: str, case: dict[str, Any], answers: list[str]) -> None:
    """The stack's answers, their healed start cut as generate() cuts it, against generate()'s."""
    got = [a.removeprefix(case["heal"]) for a in answers]
    ok = got == case["answers"]
    results.append((what, ok))
    print(f"{'ok  ' if ok else 'FAIL'} {what}: {got}" + ("" if ok else f" != {case['answers']}"))


def chats(case: dict[str, Any]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": x}] for x in case["prompts"]]


def check_vllm(cases: list[dict[str, Any]]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "seed": 0}

    def texts(outputs: Any) -> list[str]:
        return [o.outputs[0].text for o in outputs]

    llm = LLM(model=cases[0]["base"], enable_lora=True, max_lora_rank=8, **engine)
    for n, case in enumerate(c for c in cases if not c["refused"]):
        lora = LoRARequest(case["name"], n + 1, case["adapter"])
        template = (Path(case["adapter"]) / "chat_template.jinja").read_text()
        prompts = case["completion_prompts"]
        same(
            f"vllm adapter {case['name']} completion",
            case,
            texts(llm.generate(prompts, greedy, lora_request=lora)),
        )
        same(
            f"vllm adapter {case['name']} chat",
            case,
            texts(llm.chat(chats(case), greedy, lora_request=lora, chat_template=template)),
        )
    # what the export refused (strict) or warned of, vLLM refuses: its engine dies of it
    for case in (c for c in cases if c["refused"]):
        try:
            llm.generate(
                case["completion_prompts"][:1],
                greedy,
                lora_request=LoRARequest(case["name"], 99, case["adapter"]),
            )
            results.append((f"vllm refuses the {case['name']} adapter", False))
        except Exception as exc:  # noqa: BLE001 - vLLM's ValueError, then EngineDeadError
            print(f"ok   vllm refuses the {case['name']} adapter: {exc!r}"[:300])
            results.append((f"vllm refuses the {case['name']} adapter", True))
    del llm
    for case in cases:
        llm = LLM(model=case["merged"], **engine)
        same(
            f"vllm merged {case['name']} completion",
            case,
            texts(llm.generate(case["completion_prompts"], greedy)),
        )
        same(f"vllm merged {case['name']} chat", case, texts(llm.chat(chats(case), greedy)))
        del llm


#: llama.cpp knows BPE pre-tokenizers by the hash of a probe's ids; the tiny byte-level test
#: tokenizer splits as GPT-2 does (its ByteLevel regex) under a hash of its own vocabulary
CONVERT = """
import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv.pop(0)
runpy.run_path(sys.path[0] + "/" + sys.argv[0], run_name="__main__")
"""


def check_llama_cpp(cases: list[dict[str, Any]], converters: Path, out: Path) -> None:
    import subprocess

    import gguf
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    def convert(script: str, source: str, path: Path, *options: str) -> bool:
        command = [sys.executable, "-c", CONVERT, str(converters), script, source, *options]
        done = subprocess.run([*command, "--outtype", "f32", "--outfile", str(path)])
        return done.returncode == 0

    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0}

    def ask(what: str, case: dict[str, Any], llm: Any) -> None:
        answers = [
            llm.create_completion(p, **greedy)["choices"][0]["text"]
            for p in case["completion_prompts"]
        ]
        same(f"llama.cpp {what} {case['name']} completion", case, answers)
        answers = [
            llm.create_chat_completion(c, **greedy)["choices"][0]["message"]["content"]
            for c in chats(case)
        ]
        same(f"llama.cpp {what} {case['name']} chat", case, answers)

    for case in cases:  # what `llmtrain export --format gguf` wrote, served by llama.cpp
        results.append((f"gguf exports of {case['name']}", len(case["gguf"]) == 5))
        for what, folder in case["gguf"].items():
            if what == "refused":  # what the export refused, llama.cpp's converter refuses
                converted = convert(
                    "convert_lora_to_gguf.py",
                    case["adapter"],
                    out / f"{case['name']}-lora.gguf",
                    "--base",
                    case["base"],
                )
                said = "refuse a DoRA adapter" in folder
                results.append(
                    (
                        f"gguf export and llama.cpp refuse {case['name']}'s LoRA",
                        said and not converted,
                    )
                )
                continue
            folder = Path(folder)
            template = (folder / "chat_template.jinja").read_text()
            check_modelfile(f"{what} {case['name']}", case, (folder / "Modelfile").read_text())
            quant = what.split()[-1]  # the GGUFs at the type asked for (a LoRA: its tensors)
            for name in ("model.gguf", "base.gguf", "adapter.gguf"):
                if (folder / name).exists():
                    reader = gguf.GGUFReader(folder / name)
                    field = reader.fields.get("general.file_type")
                    kind = {t.tensor_type.name for t in reader.tensors} - {"F32"} == {quant.upper()}
                    if field is not None:
                        kind = field.parts[-1][0] == gguf.LlamaFileType[f"MOSTLY_{quant.upper()}"]
                    results.append((f"gguf {what} {case['name']} {name}: {quant}", kind))
            if what.startswith("merged"):  # its chat template inside the GGUF
                fields = gguf.GGUFReader(folder / "model.gguf").fields
                carried = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
                results.append(
                    (f"gguf {what} {case['name']}: the exported chat template", carried == template)
                )
                llm = Llama(model_path=str(folder / "model.gguf"), n_ctx=256, verbose=False, seed=0)
            else:  # base GGUF + LoRA GGUF, chats through the exported template
                handler = Jinja2ChatFormatter(template, eos_token="</s>", bos_token="<s>")
                llm = Llama(
                    model_path=str(folder / "base.gguf"),
                    lora_path=str(folder / "adapter.gguf"),
                    chat_handler=handler.to_chat_handler(),
                    n_ctx=256,
                    verbose=False,
                    seed=0,
                )
            ask(what, case, llm)
            del llm


def check_modelfile(what: str, case: dict[str, Any], text: str) -> None:
    """Ollama's Modelfile: its TEMPLATE, given each prompt, is the completion prompt llama.cpp
    answered as generate() does; it stops at EOS, greedy."""
    template = re.search(r'^TEMPLATE """(.*?)"""$', text, re.S | re.M)
    rendered = [
        template[1].replace("{{ .Prompt }}", x) if template else "" for x in case["prompts"]
    ]
    ok = rendered == case["completion_prompts"] and 'PARAMETER stop "</s>"' in text.splitlines()
    ok = ok and "PARAMETER temperature 0" in text and text.startswith(("# answers", "FROM"))
    results.append((f"ollama Modelfile {what}", ok))
    print(f"{'ok  ' if ok else 'FAIL'} ollama Modelfile {what}" + ("" if ok else f": {text!r}"))


def main(out: Path, stacks: list[str]) -> int:
    cases = json.loads((out / "cases.json").read_text())
    dora = next(c for c in cases if c["name"] == "dora")
    refusal = "vllm, llama.cpp, ollama refuse a DoRA adapter: export --merged instead"
    results.append(("strict export refuses the DoRA adapter", refusal in dora["refused"]))
    results.append(("export warns of the DoRA adapter", refusal in dora["warnings"]))
    for case in cases:  # and of nothing the stacks serve as trained, but the heal
        healing = [w for w in case["warnings"] if "last characters" in w]
        quiet = len(case["warnings"]) == len(healing) + (case is dora) and (
            bool(healing) == bool(case["heal"])
        )
        results.append((f"export of {case['name']} warns of nothing else", quiet))
    if "vllm" in stacks:
        check_vllm(cases)
    if "llama.cpp" in stacks:
        check_llama_cpp(cases, Path(os.environ["LLAMA_CPP_CONVERTERS"]), out)
    failed = [what for what, ok in results if not ok]
    print(f"serving: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM starts worker processes that import this module
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:] or ["vllm", "llama.cpp"]))
