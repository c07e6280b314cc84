"""Prompt templates: ``"### Question:\\n{X}\\n### Answer:\\n{Y}"``.

One object renders training text and inference prompts, so the two can never drift apart
(the design llmtrain grew from applied its template only at training time).
"""

from __future__ import annotations

import string

from llmtrain.errors import ConfigError


class PromptTemplate:
    """A template with exactly one ``{X}`` (the input) and one ``{Y}`` (the response) at its end,
    or a document template: ``{X}`` alone, the whole text trained (continued pre-training).

    ``{Y}`` must close the template: the response is the text the model generates after the
    prompt, so anything after it could not be produced at inference. Literal braces are
    written ``{{`` and ``}}``. Everything is checked here, at construction.
    """

    __slots__ = ("_after_x", "_before_x", "_text", "documents")

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise ConfigError(f"template must be a string, got {type(text).__name__}")
        try:
            parts = list(string.Formatter().parse(text))
        except ValueError as exc:  # a lone "{" or "}"
            raise ConfigError(
                f"template {text!r} is malformed ({exc}); write literal braces as '{{{{' and '}}}}'"
            ) from None
        # The literal text before each field, then after the last one ("{{" parses as its own
        # literal-only part, so pieces are joined until the next field).
        literals: list[str] = [""]
        fields: list[str] = []
        for literal, field, spec, conversion in parts:
            literals[-1] += literal
            if field is None:
                continue
            if field not in ("X", "Y"):
                raise ConfigError(
                    f"template {text!r} has an unknown placeholder {{{field}}}; "
                    f"only {{X}} and {{Y}} are allowed (write literal braces as "
                    f"'{{{{' and '}}}}')"
                )
            if spec or conversion:
                raise ConfigError(
                    f"template {text!r}: placeholder {{{field}}} takes no format spec or conversion"
                )
            fields.append(field)
            literals.append("")
        self.documents = "Y" not in fields
        for name in ("X",) if self.documents else ("X", "Y"):
            if fields.count(name) != 1:
                raise ConfigError(
                    f"template {text!r} must contain {{{name}}} exactly once, "
                    f"found it {fields.count(name)} times"
                )
        if not self.documents and fields[-1] != "Y":
            raise ConfigError(
                f"template {text!r}: {{Y}} must be at the very end, but {{X}} "
                f"follows it; the prompt ({{X}}) comes before the response"
            )
        if literals[-1] and not self.documents:
            raise ConfigError(
                f"template {text!r}: {{Y}} must be at the very end, but "
                f"{literals[-1]!r} follows it; the response is what the model "
                f"generates after the prompt, so nothing may come after {{Y}}"
            )
        self._text = text
        self._before_x, self._after_x = literals[0], literals[1]

    @property
    def text(self) -> str:
        return self._text

    @property
    def between(self) -> str:
        """The template's text between ``{X}`` and ``{Y}`` (the end of every prompt)."""
        return self._after_x

    def prompt(self, x: str) -> str:
        """The prompt for input ``x``: everything before ``{Y}``. Use it at inference too."""
        return f"{self._before_x}{x}{self._after_x}"

    def render(self, x: str, y: str) -> tuple[str, str]:
        """``(prompt_text, response_text)``; their concatenation is the full training text."""
        return self.prompt(x), y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PromptTemplate) and other._text == self._text

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        return f"PromptTemplate({self._text!r})"
