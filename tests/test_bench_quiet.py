"""bench/quiet.py waits for real busy processes (and their children) to go idle."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from dflash_trt.bench.quiet import wait_until_idle

# a parent that starts a child spinning for `spin` seconds, then both sleep: the wait must see the
# child's CPU (vLLM's busy worker is a grandchild of the process the bench started)
SPIN_IN_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import time\\nt = time.perf_counter()\\nwhile time.perf_counter() - t < %s: pass\\ntime.sleep(60)"])
time.sleep(60)
"""


def _spawn(spin_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN_IN_CHILD % spin_s])


def _kill_tree(proc: subprocess.Popen) -> None:
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.kill()
    proc.wait()


def test_waits_while_a_descendant_spins_then_returns_idle():
    proc = _spawn(1.5)
    try:
        time.sleep(0.3)  # the child is spinning by now
        waited, idle = wait_until_idle([proc.pid], max_wait_s=20)
        assert idle
        assert waited >= 0.6  # the spin had >= ~1.2 s left
        assert waited < 10
    finally:
        _kill_tree(proc)


def test_gives_up_after_max_wait_on_a_process_that_never_idles():
    proc = _spawn(60)
    try:
        time.sleep(0.3)
        waited, idle = wait_until_idle([proc.pid], max_wait_s=0.5)
        assert not idle
        assert 0.5 <= waited < 3
    finally:
        _kill_tree(proc)


def test_no_processes_or_ended_ones_count_as_idle():
    assert wait_until_idle([]) == (0.0, True)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert wait_until_idle([proc.pid], max_wait_s=1)[1]
