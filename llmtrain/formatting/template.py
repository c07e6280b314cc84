"""Prompt templates (``"Q: {X}\\nA: {Y}"``): training text and inference prompts from one object."""

from __future__ import annotations

import string

from llmtrain.errors import ConfigError


class PromptTemplate:
    """Exactly one ``{X}`` (the input) and one ``{Y}`` (the response) closing it (nothing after it
    could be generated), or ``{X}`` alone for documents. Literal braces: ``{{`` and ``}}``."""

    __slots__ = ("before", "between", "documents", "text")

    def __init__(self, text: str) -> None:
        try:
            parts = list(string.Formatter().parse(text))
        except ValueError as exc:  # a lone "{" or "}"
            raise ConfigError(
                f"template {text!r} is malformed ({exc}); write literal braces as '{{{{' and '}}}}'"
            ) from None
        # the literal text before each field, then after the last ("{{" is a part of its own)
        literals: list[str] = [""]
        fields: list[str] = []
        for literal, field, spec, conversion in parts:
            literals[-1] += literal
            if field is None:
                continue
            if field not in ("X", "Y"):
                raise ConfigError(
                    f"template {text!r} has an unknown placeholder {{{field}}}; only {{X}} and "
                    f"{{Y}} are allowed (write literal braces as '{{{{' and '}}}}')"
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
        self.text = text
        #: the text before ``{X}``, and between ``{X}`` and ``{Y}``: the end of every prompt
        self.before, self.between = literals[0], literals[1]

    def prompt(self, x: str) -> str:
        """The prompt for input ``x``: everything before ``{Y}``. Use it at inference too."""
        return f"{self.before}{x}{self.between}"

    def __repr__(self) -> str:
        return f"PromptTemplate({self.text!r})"
