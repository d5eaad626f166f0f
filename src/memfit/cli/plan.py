"""``memfit plan``: not yet available."""

from __future__ import annotations


def register(subparsers) -> None:
    """Placeholder until the plan job lands; registers nothing."""
