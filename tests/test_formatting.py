"""Templates, rows -> token ids/labels, padding and packing (with exact per-example losses)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmtrain.errors import BadRowError, ConfigError
from llmtrain.formatting import (
    IGNORE_INDEX,
    Example,
    Formatter,
    PackedCollator,
    PromptTemplate,
    pack_examples,
    pad_collate,
)
from llmtrain.testing import tiny_model, train_tokenizer

TEMPLATE = "### Question:\n{X}\n### Answer:\n{Y}"
PACK = 96  # packed row length for the loss tests: 9 examples -> 4 rows, the last padded


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="session")
def tok(llama_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_path)


def trained(example: Example) -> list[int]:
    return [label for label in example.labels if label != IGNORE_INDEX]


# -- templates -------------------------------------------------------------------------------
def test_template_renders_prompt_and_response() -> None:
    t = PromptTemplate("{{json}} Q: {X}\nA: {Y}")
    assert t.prompt("2+2?") == "{json} Q: 2+2?\nA: "
    assert t.prompt("{X}") == "{json} Q: {X}\nA: "  # values are not re-parsed


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("Q: {X}\nA: {Y} {Y}", r"\{Y\} exactly once"),
        ("A: {Y}", r"\{X\} exactly once"),
        ("{X} {X} {Y}", r"\{X\} exactly once"),
        ("{X} {Z} {Y}", r"unknown placeholder \{Z\}"),
        ("{X} {} {Y}", r"unknown placeholder \{\}"),
        ("{X} {Y}\n### End", r"'\\n### End' follows it"),
        ("{X} {Y}}}", r"'\}' follows it"),
        ("{Y} {X}", r"\{X\} follows it"),
        ("{X} {Y!r}", "no format spec"),
        ("{X} { {Y}", "malformed"),
    ],
)
def test_template_errors(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PromptTemplate(text)


# -- rows -> examples ------------------------------------------------------------------------
def test_labels_mask_the_prompt_and_train_response_and_eos(tok: Any) -> None:
    fmt = Formatter(tok, TEMPLATE)
    x, y = "What is the capital of France?", " Paris, on the Seine."
    ex = fmt.format({"X": x, "Y": y}, key=42)
    prompt = fmt.prompt(x).ids
    assert prompt[0] == tok.bos_token_id
    assert prompt == tok(PromptTemplate(TEMPLATE).prompt(x))["input_ids"]  # as served
    n = len(prompt)
    assert ex.key == 42 and not ex.truncated
    assert ex.input_ids[:n] == prompt
    assert ex.labels[:n] == [IGNORE_INDEX] * n
    assert ex.labels[n:] == ex.input_ids[n:]
    assert ex.input_ids[n:] == tok(y, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(trained(ex)) == y + tok.eos_token
    assert ex.num_target_tokens == len(ex) - n


def test_train_on_inputs_trains_everything(tok: Any) -> None:
    ex = Formatter(tok, TEMPLATE, train_on_inputs=True).format({"X": "a", "Y": "b"})
    assert ex.labels == ex.input_ids
    assert ex.num_target_tokens == len(ex) - 1


def test_empty_strings(tok: Any) -> None:
    fmt = Formatter(tok, TEMPLATE)
    ex = fmt.format({"X": "q", "Y": ""})
    assert trained(ex) == [tok.eos_token_id]  # an empty answer still teaches to stop
    ex = fmt.format({"X": "", "Y": "a"})
    assert ex.input_ids[: len(fmt.prompt("").ids)] == fmt.prompt("").ids
    assert tok.decode(trained(ex)) == "a" + tok.eos_token


def test_batch_equals_single_rows(tok: Any) -> None:
    fmt = Formatter(tok, TEMPLATE)
    texts = [("Héllo wörld", " 你好"), ("emoji 🙂?", " yes 🙂"), ("", ""), ("a\tb\nc", " ok")]
    rows = [(i, {"X": x, "Y": y}) for i, (x, y) in enumerate(texts)]
    assert fmt.format_batch(rows) == [fmt.format(row, key=key) for key, row in rows]
    assert fmt.format_batch([]) == []
    with pytest.MonkeyPatch.context() as patch:  # the tokenizer(...) fallback agrees
        patch.setattr("llmtrain.formatting.tokenize._backend_encoder", lambda tokenizer: None)
        slow = Formatter(tok, TEMPLATE)
    assert slow._backend is None
    assert slow.format_batch(rows) == fmt.format_batch(rows)


def test_truncation_cuts_the_prompt_from_the_left(tok: Any) -> None:
    x = "one two three four five six seven eight nine ten eleven twelve"
    y = " done"
    full = Formatter(tok, TEMPLATE).format({"X": x, "Y": y})
    response = trained(full)
    limit = len(full) - 5
    ex = Formatter(tok, TEMPLATE, max_length=limit).format({"X": x, "Y": y})
    assert ex.truncated and len(ex) == limit
    assert ex.input_ids[0] == tok.bos_token_id  # BOS kept
    assert ex.input_ids[1:] == full.input_ids[6:]  # the prompt's end, then the whole response
    assert trained(ex) == response and response[-1] == tok.eos_token_id
    exact = Formatter(tok, TEMPLATE, max_length=len(full)).format({"X": x, "Y": y})
    assert exact == full


def test_truncation_cuts_an_overlong_response_from_the_right_without_eos(tok: Any) -> None:
    y = " one two three four five six seven eight nine ten"
    fmt = Formatter(tok, TEMPLATE, max_length=8, min_prompt_tokens=2)
    ex = fmt.format({"X": "long question text", "Y": y})
    response_ids = tok(y, add_special_tokens=False)["input_ids"]
    prompt = fmt.prompt("long question text").ids
    assert ex.truncated and len(ex) == 8
    assert ex.input_ids[:3] == [tok.bos_token_id, *prompt[-2:]]  # BOS + min_prompt_tokens
    assert ex.input_ids[3:] == response_ids[:5] == trained(ex)
    assert tok.eos_token_id not in ex.input_ids  # the answer was cut: do not teach to stop there
    with pytest.raises(ConfigError, match="no room"):
        Formatter(tok, TEMPLATE, max_length=2, min_prompt_tokens=1)


def test_chat_template_trains_the_reply_and_the_end_of_turn(tok: Any) -> None:
    fmt = Formatter(tok, chat_template=True)
    x, y = "What is two plus two?", "Four."
    ex = fmt.format({"X": x, "Y": y}, key="k")
    prompt = fmt.prompt(x).ids
    assert ex.input_ids[: len(prompt)] == prompt  # training prefix == inference prompt
    assert tok.decode(trained(ex)) == y + tok.eos_token
    assert trained(ex)[-1] == tok.eos_token_id
    assert ex.labels[-1] == IGNORE_INDEX  # the template's newline after the turn is not trained
    empty = fmt.format({"X": x, "Y": ""})
    assert trained(empty) == [tok.eos_token_id]
    everything = Formatter(tok, chat_template=True, train_on_inputs=True).format({"X": x, "Y": y})
    assert everything.labels == everything.input_ids == ex.input_ids
    cut = Formatter(tok, chat_template=True, max_length=12).format({"X": x, "Y": y})
    assert cut.truncated and len(cut) == 12 and cut.input_ids[0] == tok.bos_token_id
    assert trained(cut) == trained(ex)  # the untrained tail and the prompt's start went first


def test_chat_template_problems_are_config_errors(llama_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(llama_path)
    tok.chat_template = tok.chat_template.replace(
        "{{ eos_token }}{% endgeneration %}", "{% endgeneration %}{{ eos_token }}"
    )
    with pytest.raises(ConfigError, match="never learn to stop"):
        Formatter(tok, chat_template=True)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    with pytest.raises(ConfigError, match="generation"):
        Formatter(tok, chat_template=True)
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        Formatter(tok, chat_template=True)
    assert Formatter(tok).documents  # no template: documents (continued pre-training)
    with pytest.raises(ConfigError, match="not both"):
        Formatter(tok, TEMPLATE, chat_template=True)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("field", ["X", "Y"])
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (None, "is null"),
        (5, "is int, not a string"),
        (["a"], "is list, not a string"),
        ("ok \ud800", "is not valid UTF-8"),
        (b"bytes", "is bytes, not a string"),
    ],
)
def test_bad_rows(tok: Any, chat: bool, field: str, value: object, problem: str) -> None:
    fmt = Formatter(tok, chat_template=True) if chat else Formatter(tok, TEMPLATE)
    row = {"X": "fine", "Y": "fine", field: value}
    with pytest.raises(BadRowError, match=problem) as info:
        fmt.format_batch([(1, {"X": "a", "Y": "b"}), (7, row)], source="questions")
    assert (info.value.source, info.value.key, info.value.field) == ("questions", 7, field)
    assert f"key 7: field {field!r}" in str(info.value)


def test_missing_field_is_a_bad_row(tok: Any) -> None:
    with pytest.raises(BadRowError, match="'Y' is missing"):
        Formatter(tok, TEMPLATE).format({"X": "a"}, key=3)


# -- the trained ids are the tokenizer's own for the whole text ------------------------------
STYLE_CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Translate good morning to French: Bonjour, comment allez-vous?",
    "Question two plus two Answer four. The sea folds into foam.",
]
STYLE_ROWS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("two plus two", " four"),
    ("Translate good morning", "Bonjour"),
    ("", "Paris"),
    ("France", ""),
]


def tiny_tokenizer(style: str) -> Any:
    """The tokenizer ``tiny_model`` builds in ``style``, on its own corpus."""
    from llmtrain.testing import _CORPUS

    return train_tokenizer([_CORPUS], style=style)


def _style_tokenizer(style: str) -> Any:
    """A small tokenizer in one of the styles that mark the start of a text differently. The
    corpus has no newline, so no token spans the template's newline before the response."""
    return train_tokenizer(STYLE_CORPUS, style=style, vocab_size=200)


@pytest.mark.parametrize("style", ["bytelevel", "metaspace", "legacy", "wordpiece"])
def test_trained_ids_are_the_joint_tokenization(tok: Any, style: str) -> None:
    tokenizer = tok if style == "bytelevel" else _style_tokenizer(style)
    fmt = Formatter(tokenizer, TEMPLATE)
    rows = [(i, {"X": x, "Y": y}) for i, (x, y) in enumerate(STYLE_ROWS)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean boundary: no warning
        examples = fmt.format_batch(rows)
    split_somewhere = False
    for ex, (x, y) in zip(examples, STYLE_ROWS):
        prompt = PromptTemplate(TEMPLATE).prompt(x)
        joint = tokenizer(prompt + y, return_offsets_mapping=True)
        assert ex.input_ids == joint["input_ids"] + [tokenizer.eos_token_id]
        # the targets: exactly the tokens of the response text, then EOS
        # (BOS has offsets (0, 0): it counts as prompt)
        n = sum(1 for a, b in joint["offset_mapping"] if b <= len(prompt) and a < len(prompt))
        assert ex.labels == [IGNORE_INDEX] * n + ex.input_ids[n:]
        assert trained(ex) == joint["input_ids"][n:] + [tokenizer.eos_token_id]
        # generation is given the very prompt ids training had before the first target
        assert fmt.prompt(x).ids == ex.input_ids[:n]
        alone = tokenizer(y, add_special_tokens=False)["input_ids"]
        split_somewhere |= bool(y) and alone != joint["input_ids"][n:]
    # negative control: tokenizing the response alone (a new text) differs for these styles
    assert split_somewhere == (style in ("metaspace", "legacy"))


@pytest.mark.parametrize("style", ["bytelevel", "metaspace"])
def test_a_token_straddling_the_boundary_is_trained_and_its_text_healed_at_inference(
    tok: Any, style: str
) -> None:
    """The inference prompt is the boundary most responses get (probed with common words:
    the tiny corpus' vocabulary joins the space with them as real vocabularies do)."""
    tokenizer = tok if style == "bytelevel" else tiny_tokenizer(style)
    fmt = Formatter(tokenizer, "Q: {X} A: {Y}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: generation heals it
        examples = fmt.format_batch([(i, {"X": "two", "Y": "the sea"}) for i in range(3)])
    joint = tokenizer("Q: two A: the sea")["input_ids"]
    for ex in examples:
        assert ex.input_ids == joint + [tokenizer.eos_token_id]
        first = next(i for i, label in enumerate(ex.labels) if label != IGNORE_INDEX)
        assert ex.labels[first:] == ex.input_ids[first:]
        # the first target holds the prompt's last space ("▁the"): the prompt ends before it
        assert tokenizer.convert_ids_to_tokens(ex.input_ids[first]) in ("▁the", "Ġthe")
        assert tokenizer.decode(ex.input_ids[:first], skip_special_tokens=True) in (
            "Q: two A:",
            " Q: two A:",
        )
    # inference is given the ids training had before that token, and heals the space
    prompt = fmt.prompt("two")
    assert prompt.ids == examples[0].input_ids[:first] and prompt.heal == " "
    assert tokenizer("Q: two A: ")["input_ids"] != prompt.ids  # alone it tokenizes otherwise


@pytest.mark.parametrize("style", ["bytelevel", "metaspace", "legacy", "wordpiece"])
def test_every_answer_gets_the_inference_prompt_and_its_heal_respells_the_prompts_tail(
    style: str,
) -> None:
    """Whatever the answer's first characters merge with (``":\n"``, ``":" + "\ng"``,
    ``":▁"``), a row trains after exactly the ids generation is given, and its targets spell
    the heal, then the answer: the README's template on a Llama-style tokenizer trained its
    first token from ids generation never had, and answered garbage."""
    from llmtrain.training.generation import token_texts

    tokenizer = tiny_tokenizer(style)
    templates = [
        "### Instruction:\n{X}\n\n### Response:\n{Y}",
        "Q: {X}\nA: {Y}",
        "Q: {X} -> {Y}",
        "<question>{X}</question> {Y}",
        "Q: {X}\nA:{Y}",
    ]
    answers = ["Paris", "green", "four", "a", "The sea", "hello world"]
    answers += ["1984"] if style != "wordpiece" else []  # its tiny vocabulary has no digits
    texts = token_texts(tokenizer)
    for template in templates:
        fmt = Formatter(tokenizer, template)
        prompt = fmt.prompt("What is it?")
        for y in answers:
            ex = fmt.format({"X": "What is it?", "Y": y})
            first = next(i for i, label in enumerate(ex.labels) if label != IGNORE_INDEX)
            assert ex.input_ids[:first] == prompt.ids, (template, y)
            spelled = "".join(texts[t] for t in ex.labels[first:-1])
            if style == "wordpiece":  # WordPiece lowercases, and drops the spaces it splits on
                spelled, heal = spelled.replace(" ", ""), prompt.heal.replace(" ", "")
                assert spelled == (heal + y.replace(" ", "")).lower(), (template, y)
            else:
                assert spelled == prompt.heal + y, (template, y, spelled, prompt.heal)


# -- padding ---------------------------------------------------------------------------------
def test_pad_collate(tok: Any) -> None:
    examples = [Example([5, 6, 7], [IGNORE_INDEX, 6, 7]), Example([8, 9], [IGNORE_INDEX, 9])]
    batch = pad_collate(examples, pad_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 2]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["num_target_tokens"].item() == 3


# -- packing: per-example loss packed == unpacked --------------------------------------------
def _examples(tok: Any) -> list[Example]:
    rows = [
        ("What is the capital of France?", " Paris."),
        ("Translate to French: good morning", " Bonjour, comment allez-vous ?"),
        ("2+2", " 4"),
        ("Write a haiku about the sea.", " Waves fold into foam, salt wind over grey water."),
        ("Hi", ""),
        ("Summarize: the database stores every row with a key.", " Rows have keys."),
    ]
    plain = Formatter(tok, TEMPLATE).format_batch(
        [(i, {"X": x, "Y": y}) for i, (x, y) in enumerate(rows)]
    )
    # Examples trained on their inputs too: their first label is a real token id, which a
    # packed row must ignore (it would be predicted from the previous example's last token).
    inputs = Formatter(tok, TEMPLATE, train_on_inputs=True).format_batch(
        [(10 + i, {"X": x, "Y": y}) for i, (x, y) in enumerate(rows[:3])]
    )
    return plain + inputs


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[batch, seq-1]`` loss of predicting token t+1 at position t (0 where ignored)."""
    return F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(),
        labels[:, 1:],
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )


def _unpacked_losses(model: Any, examples: list[Example], pad_id: int) -> torch.Tensor:
    batch = pad_collate(examples, pad_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    losses = _token_losses(logits, batch["labels"])
    return losses.sum(1) / (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1)


def _packed_losses(
    model: Any, examples: list[Example], collator: PackedCollator, **forward: Any
) -> torch.Tensor:
    """Per-example losses of ``examples`` packed by ``collator``, in input order."""
    batch = collator(examples)
    logits = model(input_ids=batch["input_ids"], **forward).logits
    losses = _token_losses(logits, batch["labels"])
    rows = pack_examples(examples, collator.max_length)
    if collator.flat:
        rows = [[e for row in rows for e in row]]
    out = {}
    for row, packed in enumerate(rows):
        start = 0
        for e in packed:
            end = start + len(e)
            targets = sum(label != IGNORE_INDEX for label in e.labels[1:])
            out[e.key] = losses[row, start : end - 1].sum() / targets
            start = end
    return torch.stack([out[e.key] for e in examples])


@pytest.fixture(scope="session")
def gqa_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama-gqa", num_kv_heads=2)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_packed_loss_equals_unpacked_loss(
    llama_path: Path, gqa_path: Path, tok: Any, attn: str, heads: str
) -> None:
    """Concatenated examples, restarting position ids, no mask: the unpacked losses."""
    path = llama_path if heads == "mha" else gqa_path
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    examples = _examples(tok)
    collator = PackedCollator(PACK, tok.pad_token_id)
    rows = pack_examples(examples, PACK)
    assert len(rows) < len(examples) and max(map(len, rows)) >= 3  # really packed
    assert min(sum(map(len, r)) for r in rows) < max(sum(map(len, r)) for r in rows)  # padded
    with torch.no_grad():
        expected = _unpacked_losses(model, examples, tok.pad_token_id)
        batch = collator(examples)
        assert set(batch) == {"input_ids", "labels", "position_ids", "num_target_tokens"}
        forward = {"position_ids": batch["position_ids"], "use_cache": False}
        got = _packed_losses(model, examples, collator, **forward)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # The model's own loss (mean over every target token) agrees too; this also checks
        # that the first label of each packed example is ignored.
        padded = pad_collate(examples, tok.pad_token_id)
        loss_padded = model(
            **{k: padded[k] for k in ("input_ids", "attention_mask", "labels")}
        ).loss
        loss_packed = model(
            **{k: batch[k] for k in ("input_ids", "position_ids", "labels")}, use_cache=False
        ).loss
        torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)
        assert batch["num_target_tokens"] == padded["num_target_tokens"]
        # the one-row layout (for flash kernels) is right for these kernels as well
        flat = PackedCollator(PACK, tok.pad_token_id, flat=True)
        one_row = flat(examples)
        assert one_row["input_ids"].shape == (1, sum(map(len, examples)))  # no padding
        got = _packed_losses(
            model, examples, flat, position_ids=one_row["position_ids"], use_cache=False
        )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_naive_packing_leaks_across_examples(llama_path: Path, tok: Any, attn: str) -> None:
    """Negative controls: without the boundaries the losses differ, so the test above can fail."""
    model = AutoModelForCausalLM.from_pretrained(llama_path, attn_implementation=attn).eval()
    examples = _examples(tok)
    collator = PackedCollator(PACK, tok.pad_token_id)
    with torch.no_grad():
        expected = _unpacked_losses(model, examples, tok.pad_token_id)
        batch = collator(examples)
        naive = [
            # restarting position_ids alone: transformers skips its packing detection when a
            # cache exists, and config.use_cache=True creates one even for training
            {"position_ids": batch["position_ids"]},
            # a 2D all-ones mask (what a plain padding collator would pass)
            {
                "position_ids": batch["position_ids"],
                "attention_mask": (batch["input_ids"] != tok.pad_token_id).long(),
                "use_cache": False,
            },
        ]
        for forward in naive:
            got = _packed_losses(model, examples, collator, **forward)
            assert (got - expected).abs().max() > 1e-2


# -- packing: structure ----------------------------------------------------------------------
PAD = -1


def _synthetic(lengths: list[int], data: st.DataObject) -> list[Example]:
    examples = []
    for i, n in enumerate(lengths):
        ids = [1000 * i + j for j in range(n)]  # unique per example, never PAD
        trained_mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids, trained_mask)]
        examples.append(Example(ids, labels, key=i))
    return examples


@settings(max_examples=60, deadline=None)
@given(max_length=st.integers(1, 48), flat=st.booleans(), data=st.data())
def test_packed_collator_structure(max_length: int, flat: bool, data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.integers(1, max_length), min_size=1, max_size=12))
    examples = _synthetic(lengths, data)
    batch = PackedCollator(max_length, PAD, flat=flat)(examples)
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    rows, width = ids.shape
    assert "attention_mask" not in batch
    if flat:
        assert rows == 1 and width == sum(lengths)
    else:
        assert width <= max_length
        # best-fit-decreasing: no two rows could have been merged
        fills = sorted(int((ids[r] != PAD).sum()) for r in range(rows))
        assert rows == 1 or fills[0] + fills[1] > max_length
    seen: dict[int, list[int]] = {}
    for r in range(rows):
        starts = [t for t in range(width) if pos[r, t] == 0] + [width]
        for s, e in zip(starts, starts[1:]):
            assert pos[r, s:e].tolist() == list(range(e - s))
            if ids[r, s] == PAD:  # trailing padding: one run of positions, never trained
                assert e == width and (ids[r, s:] == PAD).all()
                assert (labels[r, s:] == IGNORE_INDEX).all()
                continue
            key = ids[r, s].item() // 1000
            assert key not in seen  # every example at most once ...
            seen[key] = ids[r, s:e].tolist()
            original = examples[key]
            # ... and its labels intact, except the boundary one, which is never a target
            assert labels[r, s:e].tolist() == [IGNORE_INDEX, *original.labels[1:]]
        assert flat or sum(1 for t in range(width) if ids[r, t] != PAD) <= max_length
    assert seen == {e.key: e.input_ids for e in examples}  # ... and exactly once
    assert batch["num_target_tokens"].item() == sum(e.num_target_tokens for e in examples)


def test_pack_examples_best_fit_decreasing() -> None:
    examples = [Example([1] * n, [1] * n, key=i) for i, n in enumerate([3, 6, 2, 5, 4, 1])]
    # 6, 5, 4, 3, 2, 1 -> [6, 2], [5, 3], [4, 1]; rows and their examples in input order
    assert [[e.key for e in row] for row in pack_examples(examples, 8)] == [[0, 3], [1, 2], [4, 5]]


def test_packing_rejects_overlong_examples() -> None:
    with pytest.raises(ConfigError, match="key 'k'"):
        pack_examples([Example([1] * 5, [1] * 5, key="k")], 4)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 32), min_size=1, max_size=40),
    rows_per_batch=st.integers(1, 5),
)
def test_token_budget_micro_batches(lengths: list[int], rows_per_batch: int) -> None:
    """Every example once, rows of at most max_length, at most the budget's rows, and under
    3% padding in every micro-batch (rows x its fullest row)."""
    from llmtrain.objectives.sft import FILL, micro_batches

    examples = [Example([1] * n, [1] * n, key=i) for i, n in enumerate(lengths)]
    batches = micro_batches(examples, 32, 32 * rows_per_batch + 7)
    keys = [e.key for batch in batches for row in batch for e in row]
    assert sorted(keys) == list(range(len(lengths)))
    for batch in batches:
        fills = [sum(map(len, row)) for row in batch]
        assert len(batch) <= rows_per_batch and max(fills) <= 32
        assert sum(fills) >= FILL * len(batch) * max(fills)


def test_an_empty_micro_batch_adds_no_loss_and_no_gradient(llama_path: Path) -> None:
    """What a process with fewer micro-batches in a step runs, so collectives stay paired."""
    from llmtrain.objectives.loss import LossFunction
    from llmtrain.training.batches import empty_batch

    model = AutoModelForCausalLM.from_pretrained(llama_path)
    empty = empty_batch(pad_id=5)
    loss = LossFunction(model)(model, empty)
    loss.backward()
    assert loss.item() == 0.0 and empty["num_target_tokens"] == 0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize(("packing", "budget"), [(False, None), (True, None), (True, 64)])
def test_training_batches_carry_their_counts_as_plain_ints(
    tok: Any, packing: bool, budget: int | None
) -> None:
    """The loop reads a step's counts without a torch call (one would hand the GIL to the
    thread making the next batches); the ints equal what the tensors hold."""
    from types import SimpleNamespace

    from llmtrain.config.args import DataArguments
    from llmtrain.db.keys import key_repr
    from llmtrain.training.batches import make_collate

    args = DataArguments(max_length=32, packing=packing, max_tokens_per_batch=budget)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    collate = make_collate(
        Formatter(tok, TEMPLATE, max_length=32),
        tok,
        model,
        args,
        "docs",
        token_budget=budget,
    )
    rows = [(i, {"X": "word " * i, "Y": f"answer {i}"}) for i in range(1, 9)]
    made = collate(rows)
    batches = made if isinstance(made, list) else [made]
    assert len(batches) >= (2 if budget else 1)
    for batch in batches:
        assert type(batch["num_target_tokens"]) is int and type(batch["num_tokens"]) is int
        assert batch["num_target_tokens"] == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        assert batch["num_tokens"] == int((batch["input_ids"] != tok.pad_token_id).sum())
    assert sorted(k for b in batches for k in b["keys"]) == sorted(key_repr(k) for k, _ in rows)


def test_packing_fills_micro_batches_by_default(tok: Any) -> None:
    """packing=True alone packs each step's rows together under a budget of batch_size rows
    of max_length: real tokens >= 0.97 of the positions fed, where packing each batch's rows
    on their own (the old default) fed 16% padding."""
    from types import SimpleNamespace

    from llmtrain.config.args import DataArguments
    from llmtrain.training.batches import make_collate

    batch_size, max_length = 8, 256
    args = DataArguments(max_length=max_length, packing=True)
    assert args.token_budget(batch_size) == batch_size * max_length
    assert DataArguments(max_length=max_length).token_budget(batch_size) is None
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    formatter = Formatter(tok, TEMPLATE, max_length=max_length)
    rows = [(i, {"X": "word " * (i * 37 % 90), "Y": "answer " * (i % 7)}) for i in range(64)]
    collate = make_collate(formatter, tok, model, args, "docs", token_budget=args.token_budget(8))
    alone = make_collate(formatter, tok, model, args, "docs")  # each batch packed on its own

    def fill(batches: list[dict[str, Any]]) -> float:
        return sum(b["num_tokens"] for b in batches) / sum(b["input_ids"].numel() for b in batches)

    steps = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    packed = [b for step in steps for b in collate(step)]
    assert fill(packed) >= 0.97 and fill([alone(step) for step in steps]) < 0.9


# -- what a trained model answers, for every tokenizer style and prompt ending --------------
FRUITS = [("red", "apple"), ("yellow", "banana"), ("green", "lime"), ("purple", "grape")]


@pytest.mark.slow
@pytest.mark.parametrize("style", ["bytelevel", "metaspace", "wordpiece"])
@pytest.mark.parametrize(
    "template", ["Color: {X}\nFruit: {Y}", "Color: {X}\nFruit:\n{Y}", "Color: {X}\nFruit:{Y}"]
)
def test_a_trained_model_answers_as_trained_whatever_the_prompt_ends_with(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, style: str, template: str
) -> None:
    """A prompt ending in a space trains its first response token with the space in it
    ("Ġbanana"): generation must be given the ids training had and heal the space. Given
    the prompt tokenized alone (ending in a lone space token), the same model answers
    garbage: the negative control."""
    import llmtrain as lt
    from llmtrain.formatting import Prompt
    from llmtrain.training.generation import generate_batch
    from tests.conftest import fill

    corpus = [f"Color: {c}\nFruit: {f}" for c, f in FRUITS]
    base = tiny_model(
        tmp_path_factory.getbasetemp() / f"fruit-{style}", tokenizer=style, corpus=corpus
    )
    uri = f"sqlite:///{tmp_path / 'fruit.db'}"
    fill(uri, "fruit", [{"id": i, "color": c, "fruit": f} for i, (c, f) in enumerate(FRUITS * 8)])
    trainer = lt.LLMTrainer(
        "fruit",
        model=base,
        prompt_template=template,
        lora_r=16,
        lora_dropout=0.0,
        learning_rate=1e-2,
        max_steps=40,
        batch_size=8,
        progress_bar=False,
    )
    model = trainer.fit(X="color", Y="fruit", db=lt.connect(uri), select=lt.Table("fruit"))
    assert model.generate([c for c, _ in FRUITS], max_new_tokens=6) == [f for _, f in FRUITS]
    if template.endswith(" {Y}") and style != "wordpiece":  # WordPiece drops the space
        net, tokenizer = model.load()
        alone = [Prompt(tokenizer(f"Color: {c}\nFruit: ")["input_ids"]) for c, _ in FRUITS]
        answers = generate_batch(net, tokenizer, alone, 6)
        assert sum(a.strip() == f for a, (_, f) in zip(answers, FRUITS)) < len(FRUITS)


def test_an_inference_prompt_past_max_tokens_is_cut_from_the_left_keeping_bos(tok: Any) -> None:
    """Eval generation's long prompts: cut as training cuts them, its BOS kept (a cut of the
    last ids alone dropped it) and its end, where the answer follows, whole."""
    fmt = Formatter(tok, TEMPLATE)
    whole = fmt.prompt("word " * 100)
    cut = fmt.prompt("word " * 100, max_tokens=20)
    assert len(whole.ids) > 20 and len(cut.ids) == 20 and cut.heal == whole.heal
    assert cut.ids[0] == whole.ids[0] == tok.bos_token_id and cut.ids[1:] == whole.ids[-19:]
    assert fmt.prompt("short", max_tokens=20) == fmt.prompt("short")
