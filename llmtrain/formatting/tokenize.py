"""Rows to token ids and labels.

A row ``{X: input, Y: response}`` becomes an :class:`Example`. The whole text (prompt +
response) is tokenized at once, so the trained ids are the very ones the tokenizer produces for
it (tokenizing the response on its own would put a spurious ``▁`` before every response with
tokenizers that mark the start of a text, Llama-2 style). Character offsets then split the
tokens: those that reach past the end of the prompt text are the response.

Where the prompt ends in text that the response's first token can absorb (a trailing space:
``"Fruit: "`` + ``"banana"`` is ``Ġbanana``), the boundary would depend on each response, and
a model trained on such rows, given the prompt tokenized alone (ending in a lone ``Ġ`` it never
saw there), answers garbage. So the formatter finds once, by tokenizing the template's prompt in
front of a few common words, how many of its last characters a response may absorb, and every
example is cut there: tokens reaching into those characters are trained as the response (a
lone ``Ġ`` too, when a response's first word does not absorb it). Generation is given the same
ids and re-spells those characters as its first tokens, then drops them from the answer
(:class:`Prompt`, token healing), so a model answers as it was trained whatever its template
ends with.

Labels: ``IGNORE_INDEX`` (-100) on prompt tokens (unless ``train_on_inputs``); the response
and the EOS after it are trained, so the model learns to stop. An empty response therefore
still trains the EOS; an empty input is fine (the prompt is then the template text alone).

Truncation (``max_length``), in order until the example fits:

1. (chat templates only) untrained template text after the assistant turn is dropped;
2. the prompt is cut from the LEFT, keeping its end (the part next to the response) and any
   leading special tokens such as BOS, but never below ``min_prompt_tokens`` tokens;
3. the response is cut from the RIGHT. Its EOS / end-of-turn token is then lost on purpose:
   the answer was cut, and teaching the model to stop mid-answer would be wrong.

Every truncated example has ``truncated=True``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from tokenizers import Tokenizer

from llmtrain.data.rows import check_row
from llmtrain.errors import ConfigError
from llmtrain.formatting.template import PromptTemplate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The label that the causal-LM loss ignores (``torch.nn.CrossEntropyLoss`` default).
IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenized row. ``labels[i]`` is the target for position ``i`` before the usual
    causal shift (the model's logits at ``i - 1`` predict it), as transformers expects."""

    input_ids: list[int]
    labels: list[int]
    key: object = None
    truncated: bool = False

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(
                f"example {self.key!r}: {len(self.input_ids)} input ids but "
                f"{len(self.labels)} labels"
            )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens the loss trains: labels after the first position that are not ignored."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


@dataclass(frozen=True, slots=True)
class Prompt:
    """What generation is given for one input: the token ids training had before the first
    target, and ``heal``, the prompt's tail that the first trained token carried (generated
    again, then cut from the answer; empty at a clean boundary)."""

    ids: list[int]
    heal: str = ""


#: responses a template's prompt is tokenized in front of, to find how much of it they absorb
_PROBES = ("the", "The", "a", "A", "I", "it", "is", "yes", "No", "to", "1", "2024")


def _first_response_token(offsets: Sequence[tuple[int, int]], end: int) -> int:
    """The index of the first token that reaches past character ``end`` (the prompt's)."""
    return next((i for i, (a, b) in enumerate(offsets) if b > end or a >= end), len(offsets))


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens (BOS) the tokenizer puts before a text; trailing ones are ignored."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def _backend_encoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer, whose batch encoders cost half of ``tokenizer(...)`` (that converts
    every encoding in Python), or None when the two disagree on a probe (a tokenizer class
    that preprocesses text in Python). A private copy with truncation and padding off: some
    tokenizer.json files enable them, and transformers only resets them per call."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    probe = ["Hello world", " two  spaces\n", "ünïcode ✓ 你好 🙂", "text </s> <s>"]
    expected = tokenizer(probe, add_special_tokens=False)["input_ids"]
    got = [e.ids for e in backend.encode_batch(probe, add_special_tokens=False)]
    return backend if got == expected else None


class Formatter:
    """Turns rows into :class:`Example` objects with a prompt template or the chat template.

    ``Formatter(tok, "Q: {X}\\nA: {Y}")`` renders the template; ``Formatter(tok,
    chat_template=True)`` renders ``[user: X, assistant: Y]`` with the tokenizer's chat template,
    which must mark the assistant reply with ``{% generation %}`` tags that include the
    EOS/end-of-turn token (checked here, so a model is never trained that cannot stop).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: PromptTemplate | str | None = None,
        *,
        chat_template: bool = False,
        max_length: int | None = None,
        train_on_inputs: bool = False,
        min_prompt_tokens: int = 1,
        x_field: str = "X",
        y_field: str | None = None,
        stride: int = 0,
    ) -> None:
        if chat_template and template is not None:
            raise ConfigError("Formatter takes a prompt template or chat_template=True, not both")
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(
                "Formatter needs a fast (Rust) tokenizer: it relies on its batch "
                "encoding and character offsets"
            )
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no EOS token; the model could not learn to stop")
        if min_prompt_tokens < 0:
            raise ConfigError(f"min_prompt_tokens must be >= 0, got {min_prompt_tokens}")
        self.tokenizer = tokenizer
        self.template = PromptTemplate(template) if isinstance(template, str) else template
        self.chat_template = chat_template
        self.max_length = max_length
        self.train_on_inputs = train_on_inputs
        self.min_prompt_tokens = min_prompt_tokens
        self.x_field = x_field
        #: documents (no template, or one with {X} alone): every token trained, in windows
        self.documents = not chat_template and (self.template is None or self.template.documents)
        if self.documents and y_field is not None:
            raise ConfigError(
                f"Formatter: documents (no template, or {{X}} alone) take no y_field, got "
                f"{y_field!r}: give a template with {{Y}} to train responses"
            )
        self.y_field: str = y_field or "Y"
        if self.documents and max_length is not None and not 0 <= stride < max_length - 1:
            raise ConfigError(
                f"stride={stride}: a window of max_length={max_length} must bring new tokens"
            )
        self.stride = stride
        self.eos_id: int = tokenizer.eos_token_id
        self._special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        self._backend = None if chat_template else _backend_encoder(tokenizer)
        self._prefix = self._check_chat_template() if chat_template else _special_prefix(tokenizer)
        self._absorbed = 0 if chat_template or self.documents else self._absorbable()
        # a document starts after BOS, or after EOS (the separator) where there is no BOS,
        # so that its first token is a target too
        self._head = self._prefix or [self.eos_id]
        if max_length is not None and max_length < len(self._prefix) + min_prompt_tokens + 1:
            raise ConfigError(
                f"max_length {max_length} leaves no room for a response after "
                f"{len(self._prefix)} leading special token(s) and "
                f"min_prompt_tokens={min_prompt_tokens}"
            )

    # -- public API ------------------------------------------------------------------------
    def format(
        self, row: Mapping[str, object], *, key: object = None, source: str = "rows"
    ) -> Example:
        """One row to one example; ``BadRowError`` names ``source``, ``key`` and the field."""
        return self.format_batch([(key, row)], source=source)[0]

    def format_batch(
        self, rows: Sequence[tuple[object, Mapping[str, object]]], *, source: str = "rows"
    ) -> list[Example]:
        """``(key, row)`` pairs (as the data backends return them) to examples, in order,
        with one batched call into the fast tokenizer per part."""
        x_field, y_field = self.x_field, self.y_field
        if self.documents:
            return self._documents(rows, source)
        for key, row in rows:  # BadRowError by the rule the datasets apply
            check_row(source, key, row, (x_field, y_field))
        texts = [cast("tuple[str, str]", (row[x_field], row[y_field])) for _, row in rows]
        if not texts:
            return []
        if self.chat_template:
            return [
                self._assemble(key, *parts)
                for (key, _), parts in zip(rows, self._split_chats(texts))
            ]
        assert self.template is not None
        prompts = [self.template.prompt(x) for x, _ in texts]
        examples = []
        for (key, _), prompt, (ids, offsets) in zip(
            rows, prompts, self._encode_offsets([p + y for p, (_, y) in zip(prompts, texts)])
        ):
            cut = _first_response_token(offsets, len(prompt) - self._absorbed)
            examples.append(
                self._assemble(key, self._prefix, ids[:cut], ids[cut:] + [self.eos_id], None, [])
            )
        return examples

    def prompt(self, x: str) -> Prompt:
        """What a model is given at inference for input ``x``: the ids a training example
        with this input has before its response, and the characters to heal (documents:
        the start of a document, to continue)."""
        if self.documents:
            text = self.template.prompt(x) if self.template else x
            return Prompt(self._head + self._encode([text])[0])
        if self.chat_template:
            out = self._chat([[{"role": "user", "content": x}]], generation_prompt=True)
            return Prompt(list(out["input_ids"][0]))
        assert self.template is not None
        text = self.template.prompt(x)
        end = len(text) - self._absorbed
        ((ids, offsets),) = self._encode_offsets([text + _PROBES[0]])
        return Prompt(self._prefix + ids[: _first_response_token(offsets, end)], text[end:])

    def _documents(
        self, rows: Sequence[tuple[object, Mapping[str, object]]], source: str
    ) -> list[Example]:
        """Each document's text (through a template with {X} alone, if any), BOS and EOS
        around it, cut into windows of ``max_length`` (:meth:`_windows`)."""
        for key, row in rows:
            check_row(source, key, row, (self.x_field,))
        texts = [cast("str", row[self.x_field]) for _, row in rows]
        if self.template is not None:
            texts = [self.template.prompt(text) for text in texts]
        return [
            window
            for (key, _), ids in zip(rows, self._encode(texts) if texts else [])
            for window in self._windows(key, [*self._head, *ids, self.eos_id])
        ]

    def _windows(self, key: object, ids: list[int]) -> list[Example]:
        """Consecutive windows of ``max_length`` tokens, each starting ``1 + stride`` tokens
        before the previous one ended: those are context, already trained (the first token
        of a window predicts nothing), so every token after the head is a target once."""
        limit = self.max_length or len(ids)
        windows, start, trained = [], 0, 1  # ids[:trained]: targets already (or the head)
        while True:
            window = ids[start : start + limit]
            context = trained - start
            windows.append(Example(window, [IGNORE_INDEX] * context + window[context:], key))
            if start + limit >= len(ids):
                return windows
            trained = start + limit
            start = trained - 1 - self.stride

    def _absorbable(self) -> int:
        """How many of the prompt's last characters a response's first token may absorb:
        the most any probe absorbs, within the template's text after ``{X}``."""
        assert self.template is not None
        text = self.template.prompt("x")
        starts = [len(text)]
        for ids, offsets in self._encode_offsets([text + probe for probe in _PROBES]):
            cut = _first_response_token(offsets, len(text))
            starts += [offsets[cut][0]] if cut < len(ids) else []
        return min(len(text) - min(starts), len(self.template.between))

    def prompt_ids(self, x: str) -> list[int]:
        """The ids of :meth:`prompt` (identical to the untrained part of a training example
        with input ``x``, before truncation)."""
        return self.prompt(x).ids

    # -- internals -------------------------------------------------------------------------
    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` without special tokens, batched, without the character
        offsets (documents need none: a third of the encoder's time)."""
        if self._backend is None or not hasattr(self._backend, "encode_batch_fast"):
            return [ids for ids, _ in self._encode_offsets(texts)]
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def _encode_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(token ids, character spans) of ``texts`` without special tokens, batched."""
        if self._backend is None:
            out = self.tokenizer(
                texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False
            )
            return list(zip(out["input_ids"], out["offset_mapping"]))
        return [
            (e.ids, e.offsets) for e in self._backend.encode_batch(texts, add_special_tokens=False)
        ]

    def _chat(
        self, conversations: list[list[dict[str, str]]], *, generation_prompt: bool = False
    ) -> Any:
        return self.tokenizer.apply_chat_template(
            conversations,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=generation_prompt,
            return_assistant_tokens_mask=not generation_prompt,
        )

    def _split_chats(
        self, texts: list[tuple[str, str]]
    ) -> list[tuple[list[int], list[int], list[int], list[int], list[int]]]:
        """(head, prompt, response, response_labels, tail) of each conversation
        ``[user: x, assistant: y]`` as the chat template renders it."""
        out = self._chat(
            [
                [{"role": "user", "content": x}, {"role": "assistant", "content": y}]
                for x, y in texts
            ]
        )
        parts = []
        for rendered, assistant in zip(out["input_ids"], out["assistant_masks"]):
            ids, mask = list(rendered), list(assistant)
            trained = [i for i, m in enumerate(mask) if m]
            if not trained:
                raise ConfigError(
                    "the chat template marks no assistant token with "
                    "{% generation %} tags, so there is nothing to train"
                )
            first, last = trained[0], trained[-1]
            head = 0
            while head < first and ids[head] in self._special_ids:
                head += 1
            response = ids[first : last + 1]
            labels = [t if m else IGNORE_INDEX for t, m in zip(response, mask[first : last + 1])]
            parts.append((ids[:head], ids[head:first], response, labels, ids[last + 1 :]))
        return parts

    def _check_chat_template(self) -> list[int]:
        """Probe the chat template once; return its leading special tokens (BOS)."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ConfigError("chat_template=True but the tokenizer has no chat template")
        user = "probe question"
        head, prompt, _, labels, _ = self._split_chats([(user, "probe answer")])[0]
        if labels[-1] not in self._special_ids:
            raise ConfigError(
                f"the chat template's {{% generation %}} block ends with "
                f"{tok.convert_ids_to_tokens(labels[-1])!r}, not an EOS/end-of-turn special "
                f"token, so the model would never learn to stop; put the end-of-turn token "
                f"inside the generation block"
            )
        if head + prompt != self.prompt_ids(user):
            warnings.warn(
                "the chat template renders the prompt differently with "
                "add_generation_prompt=True than before an assistant reply; "
                "inference prompts will not match training prompts",
                stacklevel=3,
            )
        return head

    def _assemble(
        self,
        key: object,
        head: list[int],
        prompt: list[int],
        response: list[int],
        response_labels: list[int] | None,
        tail: list[int],
    ) -> Example:
        """Apply the truncation policy of the module docstring, then build the labels."""
        labels = response if response_labels is None else response_labels
        limit = self.max_length
        truncated = (
            limit is not None and len(head) + len(prompt) + len(response) + len(tail) > limit
        )
        if truncated:
            assert limit is not None
            tail = []
            room = limit - len(head) - len(response)
            keep = min(len(prompt), max(room, self.min_prompt_tokens))
            prompt = prompt[len(prompt) - keep :]
            cut = max(0, len(head) + len(prompt) + len(response) - limit)
            response = response[: len(response) - cut]
            labels = labels[: len(response)]
        ids = head + prompt + response + tail
        if self.train_on_inputs:
            return Example(ids, list(ids), key, truncated)
        ignored = [IGNORE_INDEX] * (len(head) + len(prompt))
        return Example(ids, ignored + labels + [IGNORE_INDEX] * len(tail), key, truncated)
