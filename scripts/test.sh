#!/usr/bin/env bash
# One command: install memfit with its test dependencies and run the test suite.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_memfit "[test,ray]"  # ray: CI runs tests/test_ray.py on a local 2-CPU cluster
python -m ruff check src tests benchmarks          # the project's lint rules (pyproject.toml)
python -m ruff format --check src tests benchmarks  # and its formatting
python -m pytest -q "$@"
