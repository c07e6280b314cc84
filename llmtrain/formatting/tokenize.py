"""Rows to token ids and labels (:class:`Example`).

Prompt and response are tokenized as one text (the response alone would get a spurious ``▁``
from Llama-2 style tokenizers), split by character offsets. A prompt ending in text a response's
first token can absorb (``"Fruit: "`` + ``"banana"`` is ``Ġbanana``) is cut before it, found once
by probing; generation re-spells it (:class:`Prompt`, token healing), as the model was trained.
Preference answers are not healed: scored from where their ids leave the prompt's, as TRL does.

Prompt tokens are ignored unless ``train_on_inputs``; the response and its EOS are trained. Past
``max_length``, in order: drop a chat template's untrained tail; cut the prompt from the LEFT
(keeping BOS and ``min_prompt_tokens``); cut the response from the RIGHT, EOS too (teaching a
model to stop mid-answer would be wrong). Such examples have ``truncated=True``."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from tokenizers import Tokenizer

from llmtrain.data.rows import bad_row, check_on_bad_row, check_row
from llmtrain.errors import ConfigError
from llmtrain.formatting.template import PromptTemplate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The label that the causal-LM loss ignores (``torch.nn.CrossEntropyLoss`` default).
IGNORE_INDEX = -100
KeyedRows = Sequence[tuple[object, Mapping[str, object]]]  # (key, row) pairs


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenized row. ``labels[i]`` is the target for position ``i`` before the usual
    causal shift (the model's logits at ``i - 1`` predict it), as transformers expects."""

    input_ids: list[int]
    labels: list[int]
    key: object = None
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens the loss trains: labels after the first position that are not ignored."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


@dataclass(frozen=True, slots=True)
class Prompt:
    """What generation is given: the ids before the first target, and ``heal``, the prompt's
    tail the first trained token carried (generated again, then cut from the answer)."""

    ids: list[int]
    heal: str = ""


#: responses a template's prompt is tokenized in front of, to find how much of it they absorb
_PROBES = ("the", "The", "a", "A", "I", "it", "is", "yes", "No", "to", "1", "2024")


def _first_response_token(offsets: Sequence[tuple[int, int]], end: int) -> int:
    """The index of the first token that reaches past character ``end`` (the prompt's)."""
    return next((i for i, (a, b) in enumerate(offsets) if b > end or a >= end), len(offsets))


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens (BOS) the tokenizer puts before a text."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    starts = range(len(full) - len(plain) + 1)
    return next((list(full[:s]) for s in starts if full[s : s + len(plain)] == plain), [])


def _backend_encoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """A private copy of the Rust tokenizer (half the cost of ``tokenizer(...)``), truncation and
    padding off (some tokenizer.json files enable them); None when it disagrees on a probe."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    probe = ["Hello world", " two  spaces\n", "ünïcode ✓ 你好 🙂", "text </s> <s>"]
    expected = tokenizer(probe, add_special_tokens=False)["input_ids"]
    got = [e.ids for e in backend.encode_batch(probe, add_special_tokens=False)]
    return backend if got == expected else None


class Formatter:
    """Rows to :class:`Example` objects through a prompt template or the chat template."""

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
        conversations: bool = False,
        assistant_turns: str = "all",
        on_bad_row: str = "raise",
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
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.template = PromptTemplate(template) if isinstance(template, str) else template
        self.max_length, self.stride = max_length, stride
        self.train_on_inputs, self.min_prompt_tokens = train_on_inputs, min_prompt_tokens
        self.x_field, self.y_field = x_field, y_field or "Y"
        #: documents (no template, or one with {X} alone): every token trained, in windows
        self.documents = not chat_template and (self.template is None or self.template.documents)
        #: conversations (with the chat template): X holds a list of messages
        self.conversations = conversations
        self.assistant_turns, self.on_bad_row = assistant_turns, check_on_bad_row(on_bad_row)
        self.skipped_keys: set[str] = set()  # rows skipped here (conversations): logged once
        if self.documents and max_length is not None and not 0 <= stride < max_length - 1:
            raise ConfigError(
                f"stride={stride}: a window of max_length={max_length} must bring new tokens"
            )
        self.eos_id: int = tokenizer.eos_token_id
        self._special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        self._backend = None if chat_template else _backend_encoder(tokenizer)
        self._prefix = self._check_chat_template() if chat_template else _special_prefix(tokenizer)
        self._absorbed = 0 if chat_template or self.documents else self._absorbable()
        # a document starts after BOS, else after EOS (the separator): its first token is trained
        self._head = self._prefix or [self.eos_id]
        if max_length is not None and max_length < len(self._prefix) + min_prompt_tokens + 1:
            raise ConfigError(
                f"max_length {max_length} leaves no room for a response after {len(self._prefix)} "
                f"leading special token(s) and min_prompt_tokens={min_prompt_tokens}"
            )

    def format(
        self, row: Mapping[str, object], *, key: object = None, source: str = "rows"
    ) -> Example:
        """One row to one example; ``BadRowError`` names ``source``, ``key`` and the field."""
        made = self.format_batch([(key, row)], source=source)
        if len(made) != 1:  # a long document: format_batch gives every window
            raise ConfigError(
                f"format(): row {key!r} makes {len(made)} windows of max_length={self.max_length}, "
                "not one example; format_batch() gives them all"
            )
        return made[0]

    def format_batch(self, rows: KeyedRows, *, source: str = "rows") -> list[Example]:
        """``(key, row)`` pairs to examples, in order, in batched tokenizer calls."""
        if self.documents:
            return self._documents(rows, source)
        if self.conversations:
            return self._conversations(rows, source)
        for key, row in rows:  # with a chat template, a prompt may be its messages
            x = row.get(self.x_field) if isinstance(row, Mapping) else None
            listed = (
                self.chat_template and isinstance(x, list) and all(isinstance(m, dict) for m in x)
            )
            check_row(source, key, row, (self.x_field, self.y_field)[listed:])
        texts = [cast("tuple[str, str]", (row[self.x_field], row[self.y_field])) for _, row in rows]
        if not texts:
            return []
        if self.chat_template:
            chats = self._split_chats(texts)
            return [self._assemble(key, *parts) for (key, _), parts in zip(rows, chats)]
        assert self.template is not None
        prompts = [self.template.prompt(x) for x, _ in texts]
        encoded = self._encode_offsets([p + y for p, (_, y) in zip(prompts, texts)])
        examples = []
        for (key, _), prompt, (ids, offsets) in zip(rows, prompts, encoded):
            cut = _first_response_token(offsets, len(prompt) - self._absorbed)
            response = ids[cut:] + [self.eos_id]
            examples.append(self._assemble(key, self._prefix, ids[:cut], response, response, []))
        return examples

    def format_pairs(
        self, rows: KeyedRows, others: KeyedRows, *, mismatched: bool = False, source: str = "rows"
    ) -> list[Example]:
        """Preference sequences, ``rows``' then ``others``' (row ``i``'s other answer), scored as
        TRL 1.16's preference trainers do: from where the ids of prompt + answer leave those of
        the prompt alone (no token healing: log p(answer | prompt)), a pair from the earlier of its
        two; ``mismatched`` (feedback's KL pairs): the other answer's ids after row i's prompt."""
        if self.chat_template or self.documents or self.conversations:
            return self.format_batch(rows, source=source) + self.format_batch(others, source=source)
        assert self.template is not None
        keyed, n = [*rows, *others], len(rows)
        for key, row in keyed:
            check_row(source, key, row, (self.x_field, self.y_field))
        prompts = [self.template.prompt(cast("str", row[self.x_field])) for _, row in keyed]
        answers = [cast("str", row[self.y_field]) for _, row in keyed]
        encoded = self._encode(prompts + [p + y for p, y in zip(prompts, answers)]) if keyed else []
        full = [ids + [self.eos_id] for ids in encoded[2 * n :]]
        cut = [_common_prefix(a, b) for a, b in zip(encoded, full)]
        if mismatched:  # TRL's KL completions: row i's prompt ids, then the other's answer ids
            full[n:] = [full[i][: cut[i]] + full[n + i][cut[n + i] :] for i in range(n)]
            cut[n:] = cut[:n]
        else:  # both answers after one prompt
            cut = [min(cut[i % n], cut[n + i % n]) for i in range(2 * n)]
        return [
            self._assemble(key, self._prefix, ids[:c], ids[c:], ids[c:], [])
            for (key, _), ids, c in zip(keyed, full, cut)
        ]

    def prompt(self, x: str, max_tokens: int | None = None) -> Prompt:
        """What a model is given at inference: the ids a training example has before its
        response, and the characters to heal (documents: the start of one, to continue); past
        ``max_tokens``, cut from the left as training cuts a prompt, its leading BOS kept."""
        if self.documents:
            text = self.template.prompt(x) if self.template else x
            made = Prompt(self._head + self._encode([text])[0])
        elif self.chat_template:
            out = self._chat([[{"role": "user", "content": x}]], generation_prompt=True)
            made = Prompt(list(out["input_ids"][0]))
        else:
            assert self.template is not None
            text = self.template.prompt(x)
            end = len(text) - self._absorbed
            ((ids, offsets),) = self._encode_offsets([text + _PROBES[0]])
            made = Prompt(self._prefix + ids[: _first_response_token(offsets, end)], text[end:])
        if max_tokens is None or len(made.ids) <= max_tokens:
            return made  # also while __init__ checks a chat template, before _prefix is set
        head = self._head if self.documents else self._prefix
        keep = max(max_tokens - len(head), 1)
        return Prompt(head + made.ids[len(head) :][-keep:], made.heal)

    def served_chat_template(self) -> str:
        """A chat template that renders, for one user message, the text whose ids are exactly
        :meth:`prompt`'s (so the healed prompt: chat endpoints then answer as generation does);
        an assistant message follows with EOS. A chat-trained model keeps its own. After BOS a
        space is written where the tokenizer spells a text's start so (``"▁Q"``)."""
        if self.chat_template:
            return str(self.tokenizer.chat_template)
        template = self.template or PromptTemplate("{X}")
        before, between = template.before, template.between
        healed = between[: len(between) - self._absorbed]
        head = str(self.tokenizer.decode(self._head if self.documents else self._prefix))
        for space in ("", " "):
            served = (
                f"{_literal(head + space)}{{% for message in messages %}}{{% if message['role'] "
                f"== 'user' %}}{_literal(before)}{{{{ message['content'] }}}}{{% if loop.last %}}"
                f"{_literal(healed)}{{% else %}}{_literal(between)}{{% endif %}}{{% elif message"
                "['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}"
                "{% endfor %}"
            )
            probe = [{"role": "user", "content": "probe question"}]
            ids = self.tokenizer.apply_chat_template(
                probe, chat_template=served, add_generation_prompt=True, return_dict=False
            )
            if list(ids) == self.prompt("probe question").ids:
                break
        return served

    def _documents(self, rows: KeyedRows, source: str) -> list[Example]:
        """Each document (through an {X}-only template, if any) between BOS and EOS, in windows."""
        for key, row in rows:
            check_row(source, key, row, (self.x_field,))
        texts = [cast("str", row[self.x_field]) for _, row in rows]
        texts = [self.template.prompt(text) for text in texts] if self.template else texts
        return [
            window
            for (key, _), ids in zip(rows, self._encode(texts) if texts else [])
            for window in self._windows(key, [*self._head, *ids, self.eos_id])
        ]

    def _conversations(self, rows: KeyedRows, source: str) -> list[Example]:
        """Each conversation whole, its assistant tokens the targets; one too long loses its first
        exchanges until it fits, else is a bad row (skipped: an empty example)."""
        for key, row in rows:
            check_row(source, key, row, (self.x_field,), shape="conversation")
        chats = [cast("list[dict[str, str]]", row[self.x_field]) for _, row in rows]
        out = self._chat(chats) if chats else {"input_ids": [], "assistant_masks": []}
        examples = []
        rendered = zip(out["input_ids"], out["assistant_masks"])
        for (key, _), whole, (ids, mask) in zip(rows, chats, rendered):
            chat, ids, mask = whole, list(ids), list(mask)
            while self.max_length is not None and len(ids) > self.max_length and chat:
                chat = _without_first_exchange(chat)
                if chat:
                    again = self._chat([chat])
                    ids, mask = list(again["input_ids"][0]), list(again["assistant_masks"][0])
            if not chat:
                problem = f"is longer than max_length={self.max_length} from its last user turn on"
                bad_row(source, key, self.x_field, problem, self.on_bad_row, self.skipped_keys)
                examples.append(Example([], [], key, True))
                continue
            if self.assistant_turns == "last":
                mask = _last_span(mask)
            labels = list(ids) if self.train_on_inputs else _masked(ids, mask)
            examples.append(Example(ids, labels, key, chat is not whole))
        return examples

    def _windows(self, key: object, ids: list[int]) -> list[Example]:
        """Windows of ``max_length`` tokens, each starting ``1 + stride`` tokens (context) before
        the previous one ended, so every token after the head is a target once."""
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
        """How many of the prompt's last characters a response's first token may absorb: a fixed
        point, so the token that reaches past the cut starts at it for every probe (``":\n"``
        reaching back past ``"\n"``): a row's prompt ids, and the heal, are then the same for any
        answer."""
        assert self.template is not None
        text = self.template.prompt("x")
        encoded = self._encode_offsets([text + probe for probe in _PROBES])
        end, limit = len(text), len(text) - len(self.template.between)
        while end > limit:
            cuts = [(_first_response_token(offsets, end), offsets) for _, offsets in encoded]
            start = min([end, *(offsets[c][0] for c, offsets in cuts if c < len(offsets))])
            if start == end:
                break
            end = max(start, limit)
        return len(text) - end

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` without offsets (a third of the encoder's time)."""
        if self._backend is None or not hasattr(self._backend, "encode_batch_fast"):
            return [ids for ids, _ in self._encode_offsets(texts)]
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def _encode_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(token ids, character spans) of ``texts`` without special tokens."""
        if self._backend is not None:
            encoded = self._backend.encode_batch(texts, add_special_tokens=False)
            return [(e.ids, e.offsets) for e in encoded]
        out = self.tokenizer(
            texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
        return list(zip(out["input_ids"], out["offset_mapping"]))

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
        """(head, prompt, response, response_labels, tail) of each ``[user: x, assistant: y]``
        (``x`` a list: the prompt's messages)."""
        out = self._chat(
            [
                [*(x if isinstance(x, list) else [{"role": "user", "content": x}]), answer]
                for x, y in texts
                for answer in [{"role": "assistant", "content": y}]
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
            head = next((i for i in range(first) if ids[i] not in self._special_ids), first)
            response = ids[first : last + 1]
            labels = _masked(response, mask[first : last + 1])
            parts.append((ids[:head], ids[head:first], response, labels, ids[last + 1 :]))
        return parts

    def _check_chat_template(self) -> list[int]:
        """Probe the chat template once; return its leading special tokens (BOS)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("chat_template=True but the tokenizer has no chat template")
        user = "probe question"
        head, prompt, _, labels, _ = self._split_chats([(user, "probe answer")])[0]
        if labels[-1] not in self._special_ids:
            raise ConfigError(
                "the chat template's {% generation %} block ends with "
                f"{self.tokenizer.convert_ids_to_tokens(labels[-1])!r}, not an EOS/end-of-turn "
                "special token, so the model would never learn to stop; put the end-of-turn token "
                "inside the generation block"
            )
        if head + prompt != self.prompt(user).ids:
            warnings.warn(
                "the chat template renders the prompt differently with add_generation_prompt=True "
                "than before an assistant reply; inference prompts will not match training prompts",
                stacklevel=3,
            )
        return head

    def _assemble(
        self,
        key: object,
        head: list[int],
        prompt: list[int],
        response: list[int],
        labels: list[int],
        tail: list[int],
    ) -> Example:
        """Truncate as the module docstring says, then build the labels."""
        ids, limit = head + prompt + response + tail, self.max_length
        if truncated := limit is not None and len(ids) > limit:
            room = limit - len(head) - len(response)
            keep = min(len(prompt), max(room, self.min_prompt_tokens))
            prompt = prompt[len(prompt) - keep :]
            response = response[: limit - len(head) - len(prompt)]
            labels, tail = labels[: len(response)], []
            ids = head + prompt + response
        if self.train_on_inputs:
            return Example(ids, list(ids), key, truncated)
        ignored = [IGNORE_INDEX] * (len(head) + len(prompt))
        return Example(ids, ignored + labels + [IGNORE_INDEX] * len(tail), key, truncated)


def _literal(text: str) -> str:
    """``text`` as a Jinja expression (a JSON string is a valid Jinja string literal)."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share (TRL's ``common_prefix_length``)."""
    return next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))


def _masked(ids: list[int], mask: list[int]) -> list[int]:
    return [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def _last_span(mask: list[int]) -> list[int]:
    """Only the last run of ones in ``mask``: the last assistant reply."""
    last = len(mask) - 1 - mask[::-1].index(1)
    first = next((i + 1 for i in range(last, -1, -1) if not mask[i]), 0)
    return [int(first <= i <= last) for i in range(len(mask))]


def _without_first_exchange(chat: list[dict[str, str]]) -> list[dict[str, str]]:
    """From the second user turn on (a system message kept); [] when no assistant reply is left."""
    start = int(chat[0]["role"] == "system")
    for turn in range(start + 1, len(chat)):
        if chat[turn]["role"] == "user":
            rest = chat[turn:]
            return chat[:start] + rest if any(m["role"] == "assistant" for m in rest) else []
    return []
