#!/usr/bin/env python3
"""Runs the tests of a CTest build one at a time (or -j N at a time) and prints, per test, the
CPU seconds it used (user + sys of the test and every process it waited for, from getrusage of
the children) and its wall seconds, slowest first; then the sums and an estimate of the wall time
of the suite on N cores = max(sum(CPU) / N, longest test wall).

CPU seconds do not depend much on what else runs on the machine, so they are the number to
compare on a shared machine; wall seconds do.

Usage: tools/test_times.py <build dir> [-L label] [-R regex] [-j N] [--cores N]
Example: tools/test_times.py build-cpu -L cpu --cores 2
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def tests_of(build, label, regex):
    cmd = ["ctest", "--test-dir", build, "--show-only=json-v1"]
    if label:
        cmd += ["-L", label]
    if regex:
        cmd += ["-R", regex]
    data = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for t in data["tests"]:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        env = dict(os.environ)
        for kv in props.get("ENVIRONMENT", []):
            k, _, v = kv.partition("=")
            env[k] = v
        if "command" not in t:  # its executable is not built
            print(f"# {t['name']}: not built, left out", file=sys.stderr)
            continue
        yield t["name"], t["command"], props.get("WORKING_DIRECTORY", build), env


def run_one(test):
    name, command, cwd, env = test
    # getrusage(RUSAGE_CHILDREN) is per process, so each test runs under /usr/bin/time instead.
    start = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-f", "MT_TIMES %U %S"] + command, cwd=cwd, env=env,
                       capture_output=True, text=True)
    wall = time.monotonic() - start
    cpu = None
    for line in p.stderr.splitlines()[::-1]:
        if line.startswith("MT_TIMES "):
            u, s = line.split()[1:3]
            cpu = float(u) + float(s)
            break
    return name, p.returncode, cpu if cpu is not None else float("nan"), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("-L", dest="label", default=None)
    ap.add_argument("-R", dest="regex", default=None)
    ap.add_argument("-j", dest="jobs", type=int, default=1)
    ap.add_argument("--cores", type=int, default=2)
    a = ap.parse_args()
    tests = list(tests_of(a.build, a.label, a.regex))
    results = []
    with ThreadPoolExecutor(a.jobs) as ex:
        for r in ex.map(run_one, tests):  # as they finish, for a run that is stopped early
            print(f"# {r[0]} cpu {r[2]:.1f} s wall {r[3]:.1f} s rc {r[1]}", file=sys.stderr, flush=True)
            results.append(r)
    results.sort(key=lambda r: -r[2])
    print(f"{'test':40s} {'cpu_s':>8s} {'wall_s':>8s}  rc")
    for name, rc, cpu, wall in results:
        print(f"{name:40s} {cpu:8.1f} {wall:8.1f}  {rc}")
    cpu_sum = sum(r[2] for r in results)
    wall_max = max((r[3] for r in results), default=0.0)
    failed = [r[0] for r in results if r[1] != 0]
    print(f"{len(results)} tests, {len(failed)} failed {failed}; CPU {cpu_sum:.0f} s, wall sum "
          f"{sum(r[3] for r in results):.0f} s; estimate on {a.cores} cores: "
          f"{max(cpu_sum / a.cores, wall_max):.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
