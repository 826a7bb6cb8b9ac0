"""benchmarks/live_cpu.py's CPU accounting on a real process tree: the actions service's tool
processes exit between two samples, and their CPU must still be counted (`tools_reaped`)."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "live_cpu", Path(__file__).parents[1] / "benchmarks" / "live_cpu.py"
)
live_cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(live_cpu)

# A stand-in for the actions service (its cmdline names `serve actions`, as the real one's does):
# it starts a child in a session of its own that burns CPU for 0.4 s and exits, waits for it,
# then idles, as the service does with a tool call's sandbox.
SERVICE = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass"],
               start_new_session=True, check=True)
print("reaped", flush=True)
time.sleep(30)
"""


def test_the_tools_cpu_is_counted_after_they_exit():
    proc = subprocess.Popen([sys.executable, "-c", SERVICE, "serve", "actions"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        acc = live_cpu.Accounting()
        acc.sample(proc.pid, time.time())
        assert proc.stdout.readline().strip() == "reaped"
        acc.sample(proc.pid, time.time())
        assert acc.total["tools_reaped"] >= 0.35  # the child's 0.4 s, never seen alive by a sample
        assert acc.total.get("actions", 0.0) < 0.35  # and not the service's own
        assert len(acc.others) == len(acc.tools) == 2 and all(n >= 0 for _, n in acc.tools)
    finally:
        proc.kill()
        proc.wait()


# A process whose grandchild burns CPU and is never waited for by its parent (it is reparented
# and reaped elsewhere, as a sandbox's processes are inside its PID namespace): its CPU reaches
# no one's `cutime`, only the run's cpuacct group.
ORPHAN = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:
        t = time.process_time()
        while time.process_time() - t < 0.4: pass
        os.write(w, b"x")
    os._exit(0)
os.wait()
os.read(r, 1)  # the orphan is done; its CPU is no one's child's
"""


def test_the_run_group_counts_the_cpu_no_parent_reaps():
    group = live_cpu.RunGroup.make()
    if group is None:
        pytest.skip("no writable cgroup-v1 cpuacct hierarchy here (live_cpu.py then goes without `all`)")
    try:
        proc = subprocess.Popen([sys.executable, "-c", ORPHAN], preexec_fn=group.join)
        acc = live_cpu.Accounting()
        acc.group = group
        acc.sample(proc.pid, time.time())
        proc.wait(timeout=60)
        acc.sample(proc.pid, time.time())
        assert acc.total["all"] >= 0.35  # the orphan's 0.4 s, and whatever Python took to start
    finally:
        time.sleep(0.5)  # the orphan's exit
        group.remove()
    assert not group.path.exists()
