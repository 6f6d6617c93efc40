"""Where an allowed call's time goes, in-process: run directly, never collected by pytest.

    python3 tests/profile_call.py                       # 2,000 allowed reads
    python3 tests/profile_call.py -tool bank_pay        # allowed mutating calls
    python3 tests/profile_call.py -dir /dev/shm -top 25 # the sync not counted; 25 rows

The fake payment server's tools are loaded as the tests load them (tests/proxy_harness.py),
but each call is answered at once by tests/test_rules_cost.py's instant upstream, so what is
timed is the proxy: its rules, its records and its commits. Prints the time a call without
the profiler, the SQLite statements a call by kind, and cProfile's top functions by their
own time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pathlib
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proxy_harness import ProxyHarness  # noqa: E402
from test_rules_cost import InstantServer, instant_proxy  # noqa: E402

RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
         "refund": {"side_effect": "destructive", "timeout": "10s"}}
WARM = 50
TRACED = 100


def arguments(tool: str, i: int) -> bytes:
    """Distinct arguments each call, so that no rule across calls refuses one."""
    if tool == "bank_balance":
        return b'{"account":"A-%d"}' % i
    return b'{"to":"payee-%d","amount":1}' % i


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-tool", default="bank_balance", choices=("bank_balance", "bank_pay"))
    ap.add_argument("-calls", type=int, default=2000)
    ap.add_argument("-dir", default=None, help="where the database goes (default: a temp dir)")
    ap.add_argument("-top", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        h = ProxyHarness(pathlib.Path(tmp), rules=RULES)
        proxy = instant_proxy(h, InstantServer())
        n = 0

        def calls(count: int) -> None:
            nonlocal n
            for _ in range(count):
                result = h.run(proxy.call(args.tool, arguments(args.tool, n)))
                n += 1
                if result.get("isError"):
                    raise SystemExit(f"call {n} answered an error: {result}")
        try:
            calls(WARM)
            began = time.perf_counter()
            calls(args.calls)
            per_call = (time.perf_counter() - began) / args.calls * 1000
            kinds: collections.Counter = collections.Counter()
            h.store.conn.set_trace_callback(lambda sql: kinds.update([sql.split()[0].upper()]))
            calls(TRACED)
            h.store.conn.set_trace_callback(None)
            profile = cProfile.Profile()
            profile.enable()
            calls(args.calls)
            profile.disable()
        finally:
            proxy.close()
            h.close()
    print(f"{args.tool}: {per_call:.3f} ms a call without the profiler")
    print(f"statements a call: {sum(kinds.values()) / TRACED:g} "
          + ", ".join(f"{k} {v / TRACED:g}" for k, v in sorted(kinds.items())))
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
