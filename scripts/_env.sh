# Sourced by the set-up scripts: use the active virtualenv, else create/use .venv at the repo root,
# and install torch pinned first (see constraints.txt) so nothing pulls a different build later.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
python -m pip install --quiet --disable-pip-version-check --upgrade pip
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
install_memfit() {  # $1: extras, e.g. "" or "[test]"
    python -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" -e ".$1"
}
