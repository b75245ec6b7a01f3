#!/usr/bin/env python3
"""usage: scripts/cargo-tests.py [CARGO TEST ARGS...]

`cargo test --workspace` with its test binaries run side by side instead of one after another.

Most of stoker's test binaries wait on something (an API server, a pod start, a timeout), so two
at a time on two cores take about half the time. The binaries that measure CPU or bandwidth
(SOLO below) run alone, before the rest, so nothing else shares the cores while they measure.
Concurrent binaries do not collide: each starts its own control plane on free ports, its node
runtime takes its own network slot (testenv/src/runtime/net.rs), and images unpack through a
staging directory.

Each binary's output is printed whole when it ends, with cargo's "test result:" lines, then a
table of the binaries' times. Longest binaries start first, by the times of the previous run
(kept next to the build). Exit status 1 when any test failed.
  STOKER_TEST_LANES=N   binaries at a time outside SOLO (default: the number of CPUs)
"""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# Test targets that assert a measured share of the machine: a trainer's fed % (story,
# helm_install, sidecar_cpu), a container's CPU share under its limit (runc_runtime), a NIC's
# rate (runtime), a scale-up while starved (autoscale_e2e), a 2 s bound (backpressure).
# sidecar_e2e's stall bounds (timeout + 4 s) leave room for a neighbour.
SOLO = {"story", "helm_install", "sidecar_cpu", "runc_runtime", "runtime", "autoscale_e2e",
        "backpressure"}


def is_solo(name):
    """`name` is "<package>/<target>"."""
    return name.split("/")[1] in SOLO


def test_binaries(cargo_args):
    """(name, executable, package directory) of every test binary, built first."""
    build = subprocess.run(
        ["cargo", "test", "--workspace", "--no-run", "--message-format=json-render-diagnostics",
         *cargo_args],
        stdout=subprocess.PIPE, text=True)
    if build.returncode != 0:
        sys.exit(build.returncode)
    binaries = []
    for line in build.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") \
                and msg["profile"]["test"]:
            package = msg["package_id"].rsplit("#", 1)[-1].split("@")[0]
            name = f"{package}/{msg['target']['name']}"
            binaries.append((name, msg["executable"], os.path.dirname(msg["manifest_path"])))
    return binaries


def main():
    target_dir = os.environ.get("CARGO_TARGET_DIR", "target")
    history_path = os.path.join(target_dir, "stoker-test-times.json")
    try:
        with open(history_path) as f:
            history = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        history = {}
    binaries = test_binaries(sys.argv[1:])
    binaries.sort(key=lambda b: -history.get(b[0], 0))
    solo = [b for b in binaries if is_solo(b[0])]
    shared = [b for b in binaries if not is_solo(b[0])]

    printing = threading.Lock()
    times, failed = {}, []

    def run(binary):
        name, exe, cwd = binary
        started = time.monotonic()
        # As cargo test runs a binary: in its package's directory, which CARGO_MANIFEST_DIR
        # names (stoker_testenv::manifest_dir).
        proc = subprocess.run([exe], cwd=cwd, env={**os.environ, "CARGO_MANIFEST_DIR": cwd},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
        took = time.monotonic() - started
        with printing:
            times[name] = took
            if proc.returncode != 0:
                failed.append(name)
            print(f"\n     Running {name} ({os.path.basename(exe)}), {took:.1f} s", flush=True)
            sys.stdout.buffer.write(proc.stdout)
            sys.stdout.flush()

    for binary in solo:
        run(binary)
    lanes = int(os.environ.get("STOKER_TEST_LANES", os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        list(pool.map(run, shared))

    with open(history_path, "w") as f:
        json.dump(times, f, indent=1)
    print(f"\n{'binary':<44} {'seconds':>8}")
    for name, took in sorted(times.items(), key=lambda t: -t[1]):
        print(f"{name:<44} {took:>8.1f}{'  solo' if is_solo(name) else ''}")
    if failed:
        print(f"\nfailed: {', '.join(failed)}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
