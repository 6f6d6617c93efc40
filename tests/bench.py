"""Benchmarks (run directly, not collected by pytest):

    python tests/bench.py            # the figures the README reports
    python tests/bench.py --quick    # fewer rounds

1. Request keys: canonical form plus SHA-256 key of a 1 KiB argument object, keys per second,
   for a typical tool call and for a many-membered, escape-heavy object.
2. An allowed read-only call through the gate with an in-process tool, on a file database
   with synchronous=FULL: milliseconds per call at p50 and p90, and commits per call.
3. Start-up, over real pipes: from starting the process to the answer to the first
   tools/list (initialize, notifications/initialized, tools/list), best of N, for the fake
   payment server directly and for the proxy in front of it; and when the proxy's
   initialize was answered. ``--startup`` runs only this.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agentrt_proxy as ap  # noqa: E402


def structured_arguments() -> bytes:
    """About 1 KiB, many members: 50 of them, nested, every string with an escape and
    characters the canonical form escapes. A hard case for a pure-Python parser."""
    items = ", ".join(f'{{"sku": "item-{i:03d}", "qty": {i}, "price": {i}.50, '
                      f'"note": "caf\\u00e9 <{i}> & co"}}' for i in range(12))
    return f'{{"account": "A-1", "items": [{items}], "memo": "pay \\"bob\\" 25.00 today"}}'.encode()


def typical_arguments() -> bytes:
    """About 1 KiB shaped like a common tool call: a few fields and a body of prose with
    newlines and quotes escaped."""
    body = (r'Steps to reproduce:\n1. Open the settings page.\n2. Press \"Save\" twice.\n'
            r'Expected: one request. Actual: two requests, the second one fails with 409. ') * 6
    return (f'{{"repo": "acme/payments", "title": "Double submit on the settings page", '
            f'"body": "{body}", "labels": ["bug", "p1"], "assignees": ["alice"], '
            f'"milestone": 3}}').encode()


def bench_keys(raw: bytes, rounds: int) -> float:
    if not 950 <= len(raw) <= 1100:
        raise SystemExit(f"the benchmark object is {len(raw)} bytes, not about 1 KiB")
    ap.request_key("shop_order", raw)
    start = time.perf_counter()
    for _ in range(rounds):
        ap.request_key("shop_order", raw)
    return rounds / (time.perf_counter() - start)


def bench_calls(rounds: int) -> tuple[float, float, float]:
    async def read(args: bytes) -> ap.ToolResult:
        return ap.ToolResult(b'{"balance":"120.00"}', "account holds 120.00")

    spec = ap.ToolSpec("bank_balance", "reads a balance",
                       b'{"type":"object","properties":{"account":{"type":"string"}}}',
                       "read_only", 5.0, True)
    with tempfile.TemporaryDirectory() as tmp:
        store = ap.Store.open(os.path.join(tmp, "bench.db"))
        commits = [0]
        store.conn.set_trace_callback(
            lambda sql: commits.__setitem__(0, commits[0] + (sql.strip().upper() == "COMMIT")))
        gate = ap.Gate(store, [ap.Tool(spec, read)], ap.SideEffectPolicy())
        limits = ap.Limits(3, 3, 3, 86400.0, 86400.0)
        decision = ap.Decision("tool_call", "bank_balance", b'{"account":"A-1"}', origin="model")
        times = []

        async def loop():
            for i in range(rounds):
                t0 = time.perf_counter()
                session, verdict, obs = await gate.call(f"bench.{i:016x}", "call bank_balance",
                                                        limits, decision)
                times.append(time.perf_counter() - t0)
                if obs is None or obs["kind"] != "tool_result":
                    raise SystemExit(f"call {i} did not run: {verdict}")
        asyncio.run(loop())
        gate.close()
        store.close()
    times.sort()
    return (statistics.median(times) * 1000, times[int(len(times) * 0.9)] * 1000,
            commits[0] / rounds)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "fake_payment_server.py")
PROXY = os.path.join(ROOT, "agentrt_proxy.py")
RULES = {"balance": {"side_effect": "read_only", "timeout": "5s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "20s"},
         "refund": {"side_effect": "destructive", "timeout": "5s"}}
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                         "clientInfo": {"name": "bench", "version": "1"}}}


def first_listing(argv: list[str], cwd: str) -> tuple[float, float]:
    """Milliseconds from starting argv to its initialize answer and to its first tools/list
    answer, as a host sees them."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, cwd=cwd)
    try:
        def send(msg: dict) -> None:
            p.stdin.write(json.dumps(msg).encode() + b"\n")
            p.stdin.flush()
        send(INITIALIZE)
        if b'"result"' not in p.stdout.readline():
            raise SystemExit(f"{argv}: initialize failed")
        t_init = time.perf_counter() - t0
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        if b'"tools"' not in p.stdout.readline():
            raise SystemExit(f"{argv}: tools/list failed")
        t_list = time.perf_counter() - t0
    finally:
        p.stdin.close()
        p.wait(30)
        p.stdout.close()
    return t_init * 1000, t_list * 1000


def bench_startup(rounds: int) -> tuple[float, float, float]:
    """Best of rounds: (the fake server's first tools/list, the proxy's initialize, the
    proxy's first tools/list), in milliseconds."""
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "proxy.json")
        with open(config, "w") as f:
            json.dump({"database": "runs.db", "session": "bench", "hold": "0s", "servers": [
                {"name": "bank", "command": [sys.executable, FAKE],
                 "manifest": "bank.manifest.json", "rules": RULES}]}, f)
        os.chmod(config, 0o600)
        subprocess.run([sys.executable, PROXY, "pin", "-config", config], cwd=tmp,
                       check=True, capture_output=True, timeout=60)
        direct = [first_listing([sys.executable, FAKE], tmp)[1] for _ in range(rounds)]
        proxied = [first_listing([sys.executable, PROXY, "-config", config], tmp)
                   for _ in range(rounds)]
    return min(direct), min(p[0] for p in proxied), min(p[1] for p in proxied)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--startup", action="store_true", help="only the start-up figures")
    args = parser.parse_args()
    direct, init, listed = bench_startup(3 if args.quick else 10)
    print(f"first tools/list, fake server directly: {direct:.0f} ms; through the proxy: "
          f"{listed:.0f} ms (initialize at {init:.0f} ms), {listed - direct:.0f} ms more "
          "(aim: at most 100 ms more)")
    if args.startup:
        return 0
    key_rounds, call_rounds = (2000, 100) if args.quick else (20000, 1000)
    typical = bench_keys(typical_arguments(), key_rounds)
    structured = bench_keys(structured_arguments(), key_rounds)
    p50, p90, commits = bench_calls(call_rounds)
    print(f"request keys, 1 KiB typical call:    {typical:,.0f} keys/s  (aim: at least 10,000)")
    print(f"request keys, 1 KiB, 50 members:     {structured:,.0f} keys/s")
    print(f"allowed read through the gate:       p50 {p50:.2f} ms, p90 {p90:.2f} ms, "
          f"{commits:.1f} commits per call  (aim: at most 2 commits, about 1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
