"""Start every run on a quiet machine: wait until the other sides' processes stop spinning.

The vLLM peer's engines stay loaded between runs (its plain and DFlash engines, in processes of
their own). After a run, vLLM's CPU worker keeps polling its shared-memory queue with
``sched_yield`` for about a second, and its OpenMP threads spin for their block time. On a machine
with few cores the run that came next, ours or vLLM's other engine, shared its cores with that
spin: measured on the 2-core CI machine, the next run's TTFT grew by ~0.55 s at C = 4-16 (1.31 s
against 0.75 s at C=8), about 5% of its tokens/s, and always against whichever side ran right
after another (docs/peer.md). Each run now starts once those processes are idle.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil

IDLE_CPU = 0.05  # below this share of one core over a window, a process tree counts as idle
WINDOW_S = 0.2


def _tree_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by the processes `pids` and all their descendants."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:  # ended between the listing and the read
                continue
    return total


def wait_until_idle(pids: Iterable[int], max_wait_s: float = 10.0, idle_cpu: float = IDLE_CPU,
                    window_s: float = WINDOW_S) -> tuple[float, bool]:
    """Block until the process trees of `pids` together use less than `idle_cpu` of one core over
    a `window_s` window, or `max_wait_s` passed. Returns (seconds waited, whether they went idle)."""
    pids = list(pids)
    t0 = time.perf_counter()
    if not pids:
        return 0.0, True
    while True:
        before, t = _tree_cpu_s(pids), time.perf_counter()
        time.sleep(window_s)
        used = (_tree_cpu_s(pids) - before) / (time.perf_counter() - t)
        waited = time.perf_counter() - t0
        if used < idle_cpu:
            return waited, True
        if waited >= max_wait_s:
            return waited, False
