"""Warnings for the person running ktflow: one line on stderr, each at most once per process
(a damaged cache file, a cache dir that cannot be written). Errors are exceptions
(`ktflow.errors`); these are for work that goes on."""

from __future__ import annotations

import sys

_said: set[str] = set()


def warn(message: str, key: str | None = None) -> None:
    """Print `ktflow: warning: message` once per `key` (default: the message)."""
    key = message if key is None else key
    if key in _said:
        return
    _said.add(key)
    print(f"ktflow: warning: {message}", file=sys.stderr, flush=True)
