"""``python -m memfit`` = the ``memfit`` command."""

import sys

from memfit.cli import main

sys.exit(main())
