"""The "python test runner" action: run a test file with pytest, sharded over N worker processes.

This file runs *inside* the sandbox (as `python -c SOURCE`), with only the standard library and
pytest, so it must not import Libra. It makes a test run elastic the honest way: collect the test
ids once, deal them round-robin to N pytest processes (N = the cores the scheduler granted; the
processes inherit the action's CPU affinity), and merge their JUnit reports. The last line of
stdout is a JSON summary the service returns as the action's result.

    python -c SOURCE TESTPATH --workers N [-- extra pytest args]
"""

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

USAGE = "usage: TESTPATH --workers N [-- pytest args]"


def parse(argv):
    if len(argv) < 3 or argv[1] != "--workers":
        raise SystemExit(USAGE)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    return argv[0], max(1, int(argv[2])), extra


def collect(path, extra):
    """Test ids, or None with pytest's output when collection itself fails."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if r.returncode not in (0, 5):
        return None, r.stdout + r.stderr
    return ids, ""


def run_shards(ids, workers, extra):
    shards = [ids[i::workers] for i in range(min(workers, len(ids)))]
    procs = []
    for i, shard in enumerate(shards):
        xml = os.path.join("/tmp" if os.path.isdir("/tmp") else ".", f"libra-shard-{os.getpid()}-{i}.xml")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            *extra,
            *shard,
        ]
        procs.append(
            (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), xml)
        )
    results = []
    for proc, xml in procs:
        out, _ = proc.communicate()
        results.append((proc.returncode, out, xml))
    return results


def merge(results):
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for _, _, xml in results:
        try:
            root = ET.parse(xml).getroot()
        except (OSError, ET.ParseError):
            total["errors"] += 1
            continue
        for suite in root.iter("testsuite"):
            for k in total:
                total[k] += int(suite.get(k, 0))
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    total["failed_tests"] = failed[:100]
    return total


def main(argv):
    path, workers, extra = parse(argv)
    t0 = time.monotonic()
    ids, err = collect(path, extra)
    if ids is None:
        sys.stdout.write(err)
        summary = {"tests": 0, "passed": 0, "failures": 0, "errors": 1, "skipped": 0, "collect_error": True}
    elif not ids:
        summary = {"tests": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0}
    else:
        results = run_shards(ids, workers, extra)
        for _, out, _ in results:
            sys.stdout.write(out)
        summary = merge(results)
    summary.update({"workers": workers, "duration_s": round(time.monotonic() - t0, 3)})
    sys.stdout.write("\n" + json.dumps(summary) + "\n")
    ok = summary["tests"] > 0 and summary["failures"] == 0 and summary["errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
