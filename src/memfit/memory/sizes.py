"""Memory sizes as people write them ("4GiB", "500MB", "80%"), and how much memory this machine has.

Kept free of torch so the command line can check ``--memory-budget`` before loading anything.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil

from memfit.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_size(text: str, total_bytes: int | None = None) -> int:
    """Parse "4GiB", "500MB", "1.5G", "123456" or (with ``total_bytes``) "80%" into bytes."""
    raw = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(%|[a-zA-Z]*)", raw)
    if not match:
        raise ConfigError(f"cannot read memory size {text!r}; use e.g. 4GiB, 500MB or 80%")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if total_bytes is None:
            raise ConfigError(f"a percentage budget ({text}) needs a known device memory size")
        if not 0 < number <= 100:
            raise ConfigError(f"a percentage budget must be in (0, 100], got {text}")
        return int(total_bytes * number / 100)
    if unit not in _UNITS:
        raise ConfigError(f"unknown size unit {match.group(2)!r} in {text!r}; use B, KB, MB, GB, KiB, MiB, GiB")
    return int(number * _UNITS[unit])


def cgroup_memory_limit() -> int | None:
    """The container's memory limit (cgroup v2 ``memory.max`` or v1 ``limit_in_bytes``), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 2**60:
            return int(value)
    return None


def host_memory_bytes() -> int:
    """This machine's RAM, or the container's memory limit where that is lower."""
    total = psutil.virtual_memory().total
    limit = cgroup_memory_limit()
    return total if limit is None else min(total, limit)


def check_budget_fits_device(budget_bytes: int, asked: str | int, device_total_bytes: int) -> int:
    """Refuse a budget larger than the device's whole memory: memfit would plan batches that can never fit."""
    if budget_bytes > device_total_bytes:
        total_gib = device_total_bytes / 2**30
        raise ConfigError(
            f"--memory-budget {asked} is more than this device's memory ({total_gib:.1f} GiB); give at most "
            f"{int(total_gib * 0.9)}GiB or a percentage such as 80%, or leave it out (90% of free memory)"
        )
    return budget_bytes
