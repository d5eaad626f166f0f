"""``memfit classify``: not yet available."""

from __future__ import annotations


def register(subparsers) -> None:
    """Placeholder until the classify job lands; registers nothing."""
