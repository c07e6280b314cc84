"""The ``llmtrain`` command and what it prints."""

from llmtrain.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
