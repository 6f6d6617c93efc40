"""The whole suite, its test files in parts run two at a time: the README's test command.
Standard library and pytest only; run directly, never collected by pytest.

    python3 tests/run.py                 # two pytest processes at once (one on one core)
    python3 tests/run.py -j 1            # one pytest process: python3 -m pytest -q tests
    python3 tests/run.py -x              # options after the script's own go to every pytest

Most tests wait on processes and clocks rather than compute, so two processes finish in
little more than half the time on two cores. The files are shared out by size into four
parts a process (largest file first, each to the smallest part), and the parts are taken
largest first, the next as soon as one ends. Each part is ``python3 -m pytest -q`` over its
files, with a temporary directory of its own (--basetemp) and no cache; its output is
printed whole when it ends. The exit status is the first failing part's, or 0; an
interrupt stops the parts running (by the pids started here).
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
PARTS_PER_PROCESS = 4          # the files in 4 parts a process, taken in turn as each ends
POLL = 0.2
ROOT = os.path.dirname(HERE)


def split(files: list[str], parts: int) -> list[list[str]]:
    """The files in ``parts`` groups of about equal size (largest file first, each to the
    smallest group), the largest group first."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for path in sorted(files, key=lambda p: (-os.path.getsize(p), p)):
        n = sizes.index(min(sizes))
        groups[n].append(path)
        sizes[n] += os.path.getsize(path)
    ordered = sorted(range(parts), key=lambda n: -sizes[n])
    return [sorted(groups[n]) for n in ordered if groups[n]]


def ignored(options: list[str]) -> set[str]:
    """The paths of pytest's --ignore options: pytest applies them to what it collects from
    a directory, never to a file named on its command line, as every part's files are."""
    found, it = set(), iter(options)
    for option in it:
        if option.startswith("--ignore="):
            found.add(os.path.normpath(option.split("=", 1)[1]))
        elif option == "--ignore":
            found.add(os.path.normpath(next(it, "")))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", type=int, default=min(2, os.cpu_count() or 1),
                    help="pytest processes at once (default: 2, or 1 on one core)")
    args, extra = ap.parse_known_args(argv)
    files = [os.path.join("tests", f) for f in os.listdir(HERE)
             if f.startswith("test_") and f.endswith(".py")]
    os.chdir(ROOT)
    files = [f for f in files if os.path.normpath(f) not in ignored(extra)]
    if args.j <= 1:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", *extra, "tests"])
    work = tempfile.mkdtemp(prefix="agentrt-proxy-suite-")
    queue = split(files, args.j * PARTS_PER_PROCESS)    # largest first
    running: list[tuple[subprocess.Popen, str, float, str]] = []
    status = 0
    try:
        while queue or running:
            while queue and len(running) < args.j:
                group = queue.pop(0)
                log = os.path.join(work, f"part-{len(queue)}.log")
                with open(log, "wb") as out:
                    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p",
                                          "no:cacheprovider",
                                          f"--basetemp={work}/tmp-{len(queue)}", *extra,
                                          *group], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)
                running.append((p, log, time.monotonic(), f"{len(group)} files, "
                                f"{group[0]} to {group[-1]}"))
            time.sleep(POLL)
            for item in [r for r in running if r[0].poll() is not None]:
                p, log, began, label = item
                running.remove(item)
                print(f"== {label}", flush=True)
                with open(log, "rb") as f:
                    sys.stdout.write(f.read().decode("utf-8", "replace"))
                print(f"== {label}: exit {p.returncode} after "
                      f"{time.monotonic() - began:.0f} s", flush=True)
                status = status or p.returncode
        return status
    except KeyboardInterrupt:
        for p, *_ in running:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p, *_ in running:
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
