"""``python -m memfit`` = the ``memfit`` command."""

from memfit.cli import run

run()
