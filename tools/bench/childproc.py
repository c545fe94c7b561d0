"""Benchmarks that measure peak memory run each configuration in a child process: a fresh
process has a clean high-water mark, and an out-of-memory probe cannot take the bench down.

CPU peak = the child's peak resident set size (getrusage ru_maxrss) minus its resident size
just before the measured call; its address space is capped (RLIMIT_AS) at its size then + the
budget, so a configuration over the budget fails with an allocation error instead of swapping.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

GiB = 1024**3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cap_address_space(budget_gib: float) -> int:
    """Cap this process at its current size + budget; -> the resident bytes now (the baseline)."""
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = int(budget_gib * GiB) + vm
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return rss_bytes()


def peak_since(base: int) -> float:
    """GiB of peak resident memory above `base`."""
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / GiB


def run_child(module: str, argv: list[str], timeout: float) -> dict:
    """`python -m module argv` -> the last JSON line it printed, or {"ok": False, "why": ...}."""
    cmd = [sys.executable, "-m", module, *argv]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"timeout > {timeout:.0f}s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    oom = "memory" in err.lower() or "alloc" in err.lower() or r.returncode in (-9, 137)
    return {"ok": False, "why": "OOM (over budget)" if oom else err[:120]}
