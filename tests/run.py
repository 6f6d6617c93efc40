"""The whole suite, its test files split in halves run at the same time: the README's test
command. Standard library and pytest only; run directly, never collected by pytest.

    python3 tests/run.py                 # two halves at once (one on a single core)
    python3 tests/run.py -j 1            # one pytest process: python3 -m pytest -q tests
    python3 tests/run.py -x              # options after the script's own go to every pytest

Most tests wait on processes and clocks rather than compute, so two halves finish in little
more than half the time on two cores. Each half is ``python3 -m pytest -q`` over its files,
with a temporary directory of its own (--basetemp) and no cache; its output is printed
whole when it ends, the slower half last. Files are shared out by size, largest first, to
whichever half has less. The exit status is the first failing half's, or 0; an interrupt
stops both halves (by the pids started here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def split(files: list[str], parts: int) -> list[list[str]]:
    """The files in ``parts`` groups of about equal size: largest first, to the smallest."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for path in sorted(files, key=lambda p: (-os.path.getsize(p), p)):
        n = sizes.index(min(sizes))
        groups[n].append(path)
        sizes[n] += os.path.getsize(path)
    return [sorted(g) for g in groups if g]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", type=int, default=min(2, os.cpu_count() or 1),
                    help="pytest processes at once (default: 2, or 1 on one core)")
    args, extra = ap.parse_known_args(argv)
    files = [os.path.join("tests", f) for f in os.listdir(HERE)
             if f.startswith("test_") and f.endswith(".py")]
    os.chdir(ROOT)
    if args.j <= 1:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", *extra, "tests"])
    work = tempfile.mkdtemp(prefix="agentrt-proxy-suite-")
    procs: list[tuple[subprocess.Popen, str, float, str]] = []
    try:
        for n, group in enumerate(split(files, args.j)):
            log = os.path.join(work, f"half-{n}.log")
            with open(log, "wb") as out:
                p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p",
                                      "no:cacheprovider", f"--basetemp={work}/tmp-{n}",
                                      *extra, *group],
                                     stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT)
            procs.append((p, log, time.monotonic(), f"half {n + 1}: {len(group)} files, "
                                                    f"{group[0]} to {group[-1]}"))
        status, ended = 0, []
        for p, log, began, label in procs:
            code = p.wait()
            ended.append((time.monotonic() - began, code, log, label))
            status = status or code
        for seconds, code, log, label in sorted(ended):
            print(f"== {label}", flush=True)
            with open(log, "rb") as f:
                sys.stdout.write(f.read().decode("utf-8", "replace"))
            print(f"== {label}: exit {code} after {seconds:.0f} s", flush=True)
        return status
    except KeyboardInterrupt:
        for p, *_ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p, *_ in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
