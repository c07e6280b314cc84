"""Tiny, deterministic causal LMs for tests and examples, with no hub or network: saved with
``save_pretrained`` so they load through the real auto classes, like a hub checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from llmtrain.errors import ConfigError

#: Bump when the build recipe changes, so stale cached models are rebuilt.
_RECIPE_VERSION = 2
_MARKER = "llmtrain_tiny.json"
_MAX_POSITIONS = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]
ARCHES = ("llama", "opt", "qwen2")
TOKENIZER_STYLES = ("bytelevel", "metaspace", "legacy", "wordpiece")

#: A plain user/assistant template; ``{% generation %}`` marks what an assistant-only loss
#: trains, and it includes the EOS so a fine-tuned model learns to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model learns from a small corpus.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many legs does a spider have? Answer: A spider has eight legs.
Translate to French: Good morning, how are you today? Bonjour, comment allez-vous ?
Summarize the following text in one sentence. The database stores every row with a key.
SELECT id, question, answer FROM examples WHERE score > 0.5 ORDER BY id LIMIT 100;
db.examples.find({"split": "train"}).sort({"_id": 1}).limit(1000)
def add(a: int, b: int) -> int:
    return a + b
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000 2024 3.14 -7 1e-5 50%.
The weather is sunny in the morning and rainy in the evening, so bring an umbrella.
Instruction: Write a haiku about the sea. Response: Waves fold into foam, salt wind over
grey water, the gulls call and go.
User: Can you help me fix this bug? Assistant: Of course. Please share the error message.
Training a language model means predicting the next token given all previous tokens.
Fine-tuning adapts a pretrained model to a new task with a smaller learning rate.
Low-rank adapters add two thin matrices next to a frozen weight and train only those.
Every example has a prompt and a response; the loss is computed on the response only.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
It was the best of times, it was the worst of times, it was the age of wisdom.
Hello, world! Hello again. Goodbye for now; see you tomorrow at 10:30 a.m.
Alice asked Bob whether the report was ready. Bob said it would be ready on Friday.
Mathematics: two plus two equals four; the square root of nine is three.
The library reads rows from SQL databases and MongoDB collections in key order.
"""


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def train_tokenizer(corpus: list[str], *, style: str = "bytelevel", vocab_size: int = 512) -> Any:
    """A fast tokenizer trained on ``corpus`` (``tokenizer(text)`` prepends ``<s>``), styled
    as ``bytelevel`` (GPT-2, Llama-3: ``Ġword``), ``metaspace`` (Llama/Mistral: ``▁word``),
    ``legacy`` (Llama-2: a normaliser prepends ``▁`` to every text) or ``wordpiece`` (BERT:
    ``##`` continuations, lowercased)."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    trainer: Any
    options: dict[str, Any] = dict(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    if style == "wordpiece":
        tok = tokenizers.Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(**options)
    else:
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
        alphabet = ["\n", "#", ":", "▁"]
        if style == "bytelevel":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            alphabet = pre_tokenizers.ByteLevel.alphabet()
        elif style == "metaspace":
            tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
            tok.decoder = decoders.Metaspace(prepend_scheme="first")
        else:
            prepend = [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            tok.normalizer = normalizers.Sequence(prepend)
            # as Llama-2's: the tokens fused before the first space is stripped, not each one's
            fuse = [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
            tok.decoder = decoders.Sequence(fuse)
        trainer = trainers.BpeTrainer(initial_alphabet=alphabet, **options)
    tok.train_from_iterator(corpus, trainer=trainer)
    # The post-processor is what makes ``tokenizer(text)`` add BOS, as Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=_MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build(path: Path, args: dict[str, Any], corpus: list[str], style: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, Qwen2Config

    tokenizer = train_tokenizer([_CORPUS, *corpus], style=style, vocab_size=args["vocab_size"])
    hidden = args["hidden_size"]
    config: dict[str, Any] = {  # sized to the tokenizer, agreeing with its special ids
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "hidden_size": hidden,
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_heads"],
        "max_position_embeddings": _MAX_POSITIONS,
        # Wider than real checkpoints' 0.02: a tiny model initialised that narrowly barely
        # reacts to a LoRA update, so tests and the demo could not show it learn in a few steps.
        "initializer_range": 0.2,
    }
    if args["arch"] == "opt":
        config.update(ffn_dim=2 * hidden, word_embed_proj_dim=hidden)
    else:
        config.update(
            intermediate_size=2 * hidden,
            num_key_value_heads=args["num_kv_heads"],
            tie_word_embeddings=False,
        )
    config_class = {"llama": LlamaConfig, "opt": OPTConfig, "qwen2": Qwen2Config}[args["arch"]]
    with torch.random.fork_rng(devices=[]):  # deterministic, and leaves the caller's RNG alone
        torch.manual_seed(args["seed"])
        model = AutoModelForCausalLM.from_config(config_class(**config), dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # Written last: a directory with the marker is complete.
    (path / _MARKER).write_text(json.dumps(args, indent=2, sort_keys=True), encoding="utf-8")


def tiny_model(
    path: str | os.PathLike[str],
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    seed: int = 0,
    corpus: list[str] | None = None,
    tokenizer: str = "bytelevel",
) -> Path:
    """Build a tiny ``arch`` causal LM + tokenizer (``<pad>`` is never EOS) in ``path``; return it.
    The same arguments leave it untouched, another tiny model there is replaced, any other non-empty
    directory is refused. ``num_kv_heads`` (grouped-query attention) defaults to ``num_heads``."""
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    problem = ""
    if arch not in ARCHES:
        problem = f"arch must be one of {ARCHES}, got {arch!r}"
    elif hidden_size % num_heads:
        problem = f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}"
    elif tokenizer not in TOKENIZER_STYLES:
        problem = f"tokenizer must be one of {TOKENIZER_STYLES}, got {tokenizer!r}"
    elif num_heads % kv_heads:
        problem = f"num_heads {num_heads} is not divisible by num_kv_heads {kv_heads}"
    if problem:
        raise ConfigError(f"tiny_model: {problem}")
    args = {
        "recipe": _RECIPE_VERSION,
        "arch": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": kv_heads,
        "seed": seed,
        "corpus_sha256": hashlib.sha256(json.dumps(corpus or []).encode()).hexdigest(),
    }
    if tokenizer != "bytelevel":  # the marker of a byte-level model stays as it was
        args["tokenizer"] = tokenizer
    path = Path(path)
    if _read_marker(path) == args:
        return path
    if path.exists():
        if _read_marker(path) is None and any(path.iterdir()):
            raise ConfigError(
                f"tiny_model: {path} is a non-empty directory that does not hold "
                f"a tiny model; refusing to overwrite it"
            )
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so a concurrent reader never sees a partial model.
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _build(staging, args, list(corpus or []), tokenizer)
        try:
            staging.rename(path)
        except OSError:  # another process finished first
            if _read_marker(path) != args:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
