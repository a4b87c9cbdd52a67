"""Errors raised while reading model checkpoints.

`CheckpointError` is the one exception a loader raises for a file it cannot use (missing, truncated,
corrupt, or of an unsupported kind). Its message is always a single line that names the file, so the
CLI and the server can print it as is.
"""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: `str(err)` is '<path>: <what is wrong>' on one line."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = os.fspath(path)
        # Reader libraries put newlines in their messages; the one-line promise matters to log parsers.
        self.problem = " ".join(str(problem).split())
        super().__init__(f"{self.path}: {self.problem}")


class ConfigError(ValueError):
    """A model config is unsupported or inconsistent. str() names the field."""


def read_json_object(path: str) -> dict:
    """The JSON object in `path`, or a one-line CheckpointError naming the file."""
    import json

    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, "expected a JSON object")
    return value
