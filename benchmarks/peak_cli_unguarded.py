"""``peak_cli.py`` with memfit's closed-loop guard switched off: the benchmarks' "without" side.

    python benchmarks/peak_cli_unguarded.py REPORT.json embed in.jsonl -o out/ --memory-budget 1GiB ...

The jobs build their guard with ``resident_guard`` (``memfit/memory/guard.py``); here it returns None, so
``run_windows`` runs the open-loop plan alone. Only for measuring what the guard costs and saves.
"""

import sys

import memfit.jobs.classify
import memfit.jobs.encoder
import peak_cli


def no_guard(*args, **kwargs):
    return None


memfit.jobs.encoder.resident_guard = no_guard
memfit.jobs.classify.resident_guard = no_guard

if __name__ == "__main__":
    sys.exit(peak_cli.main())
