#!/usr/bin/env bash
# One command: install memfit with its test dependencies and run the test suite.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_memfit "[test,ray]"  # ray: CI runs tests/ray/test_ray.py on a local 2-CPU cluster
# /docs in a real browser (tests/serve/test_serve_docs_browser.py): in CI (or with MEMFIT_INSTALL_BROWSER=1) install
# Debian's headless Chromium when it is missing; elsewhere, or if that fails, the test skips and says why
if [ -n "${CI:-}${MEMFIT_INSTALL_BROWSER:-}" ] && ! command -v chromedriver > /dev/null; then
    bash scripts/install-browser.sh > /dev/null || echo "scripts/install-browser.sh failed: the /docs browser test will skip"
fi
python -m ruff check src tests benchmarks          # the project's lint rules (pyproject.toml)
python -m ruff format --check src tests benchmarks  # and its formatting
# bytecode written once and read by each of the suite's ~250 Python processes: where the environment sets
# PYTHONDONTWRITEBYTECODE (the containers memfit is developed in do), each process compiled the memfit modules it
# imports again (0.08 of 3.7 CPU-s for the CLI, encoder, OpenVINO backend and server: ~20 CPU-s a suite, measured on
# the Intel Xeon with AMX), and each pytest worker rewrote the tests' asserts again
unset PYTHONDONTWRITEBYTECODE
# two pytest-xdist workers, one PyTorch thread each (tests/conftest.py), tests handed out as each worker frees up:
# 12 min 17 s against 16 min 18 s in one process (docs/benchmarks.md, "The test suite's time"); -n 0 runs serially
python -m pytest -q -n 2 --dist worksteal "$@"
