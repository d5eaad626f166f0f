"""``peak_cli.py`` with memfit's closed-loop guard switched off: the benchmarks' "without" side.

    python benchmarks/peak_cli_unguarded.py REPORT.json embed in.jsonl -o out/ --memory-budget 1GiB ...

The runtime builds its guard with ``resident_guard`` (``memfit/memory/guard.py``); here it returns None, so
``run_windows`` runs the open-loop plan alone. Only for measuring what the guard costs and saves.
"""

import sys

import memfit.engine.precision
import memfit.engine.runtime
import peak_cli


def no_guard(*args, **kwargs):
    return None


# every place that builds a guard (Runtime.adaptive_budget, the quality check's two passes); a name that moved
# fails here instead of leaving the guard on unnoticed
for module in (memfit.engine.runtime, memfit.engine.precision):
    if not hasattr(module, "resident_guard"):
        raise SystemExit(f"{module.__name__} no longer builds the guard: update peak_cli_unguarded.py")
    module.resident_guard = no_guard

if __name__ == "__main__":
    sys.exit(peak_cli.main())
