#!/usr/bin/env bash
# The test suite as an AVX2-only CPU (AMD Zen 3: no AVX-512, no VNNI, no bf16) would run it, on a CPU with AVX-512:
#   - /proc/cpuinfo without its AVX-512, AVX-VNNI and AMX flags (what memfit reads to pick bf16 and name the CPU),
#     bind-mounted in a mount namespace of its own (`unshare -m` as root, `unshare -rm` otherwise);
#   - oneDNN and PyTorch's own kernels held to AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), MKL too;
#   - OpenVINO computing a bf16 hint in f32, as its CPU plugin does without AVX-512 (scripts/avx2/sitecustomize.py).
# Its times are not an AVX2 CPU's: the cores are still this CPU's. Arguments go to pytest, as in scripts/test.sh:
#   bash scripts/test-as-avx2.sh                            # the whole suite (run scripts/test.sh once first)
#   bash scripts/test-as-avx2.sh tests/engine/test_precision.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# in a mount namespace of its own, so that the bind mount below never covers the machine's /proc/cpuinfo
HERE_NS="$(readlink /proc/self/ns/mnt)"
if [ "${MEMFIT_AVX2_OUTER_NS:-$HERE_NS}" = "$HERE_NS" ]; then
    if [ "$(id -u)" = 0 ]; then NAMESPACE=(-m); else NAMESPACE=(-rm); fi
    exec env MEMFIT_AVX2_OUTER_NS="$HERE_NS" unshare "${NAMESPACE[@]}" bash "${BASH_SOURCE[0]}" "$@"
fi
CPUINFO="$(mktemp)"
trap 'rm -f "$CPUINFO"' EXIT
sed -E '/^flags/ s/ (avx512[a-z_0-9]*|avx_vnni[a-z_0-9]*|amx[a-z_0-9]*)//g' /proc/cpuinfo > "$CPUINFO"
mount --bind "$CPUINFO" /proc/cpuinfo
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
export PYTHONPATH="$ROOT/scripts/avx2${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
source .venv/bin/activate
unset PYTHONDONTWRITEBYTECODE
echo "flags as the suite sees them: $(grep -m1 -o -w -E 'avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
python -m pytest -q -n 2 --dist worksteal "$@"
