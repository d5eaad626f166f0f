"""``memfit train``: not yet available."""

from __future__ import annotations


def register(subparsers) -> None:
    """Placeholder until the train job lands; registers nothing."""
