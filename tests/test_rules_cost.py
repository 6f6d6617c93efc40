"""The rules across calls read a bounded number of rows per call, whatever the history.

- 10,000 identical read calls through the rules in-process: a call late in the history runs
  no more SQLite statements, and no more of SQLite's virtual machine instructions (each row
  read or written costs some), than one early in it. A scan of a key's past would add
  instructions with every call of that key. Counted, not timed, so a busy machine judges it
  as an idle one does (the speed itself is tests/bench.py's row "same request, first/last").
- Every query of the call index is a search of an index, never a scan of proxy_calls
  (EXPLAIN QUERY PLAN).
- A new run's first step reads no steps (a run with no step counted has none), and the
  rules read the call index once, before the call's transaction.
- A DUPLICATE reads the earlier run once: the run the request's open row names, read and
  found ended, is the run the duplicate rule judges.
"""

import os
import sqlite3
import statistics
import time

import pytest

from proxy_harness import ProxyHarness, ap

CALLS = int(os.environ.get("RULES_COST_CALLS", "10000"))
BLOCK = CALLS // 10
WARM_CALLS = 20                 # the key's history then fills every query's LIMIT (RULE_ROWS)
COUNTED = 11                    # calls counted at each end; their medians are compared
SCAN_SHOWN = 2                  # a block's counted call past this many times the first
                                # calls' instructions: a scan, and the run stops there
ANSWER = (b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text",'
          b'"text":"account A-1 holds 120.00 EUR"}]}}')


class InstantServer:
    """An upstream connection that answers every call at once, so that what is timed is the
    proxy: its rules, its records and its commits."""

    name = "bank"
    closed = False

    def __init__(self):
        self.calls = 0

    def offers_tasks(self, support):
        return False

    async def call_tool(self, remote, args, timeout, on_task=None):
        self.calls += 1
        return ap.parse_message(ANSWER)

    async def close(self):
        pass


def instant_proxy(h: ProxyHarness, server: InstantServer) -> ap.Proxy:
    import dataclasses
    tools = [dataclasses.replace(t, conn=server) for t in h.tools]
    return ap.Proxy(h.cfg, h.store, tools, h.log_lines.append, clock=h.clock)


def counted_call(h: ProxyHarness, proxy: ap.Proxy, args: bytes) -> tuple[int, int]:
    """One call: the SQLite statements the store's connection ran for it, and the virtual
    machine instructions they took (a progress handler called at every one)."""
    statements, steps = [0], [0]

    def statement(_sql: str) -> None:
        statements[0] += 1

    def step() -> int:
        steps[0] += 1
        return 0                    # go on
    h.store.conn.set_trace_callback(statement)
    h.store.conn.set_progress_handler(step, 1)
    try:
        r = h.run(proxy.call("bank_balance", args))
    finally:
        h.store.conn.set_progress_handler(None, 0)
        h.store.conn.set_trace_callback(None)
    assert not r["isError"], r
    return statements[0], steps[0]


def test_identical_read_calls_cost_the_same_after_ten_thousand(tmp_path):
    h = ProxyHarness(tmp_path)
    server = InstantServer()
    proxy = instant_proxy(h, server)
    args = b'{"account":"A-1"}'
    try:
        for _ in range(WARM_CALLS):
            assert not h.run(proxy.call("bank_balance", args))["isError"]
        first = [counted_call(h, proxy, args) for _ in range(COUNTED)]
        steps = statistics.median(n for _, n in first)
        for n in range(WARM_CALLS + COUNTED, CALLS - COUNTED):
            if n % BLOCK:
                assert not h.run(proxy.call("bank_balance", args))["isError"]
                continue
            # One call a block counted, so that a build that scans fails early, not after
            # hours of calls that each read more than the one before.
            now = counted_call(h, proxy, args)
            assert now[1] <= SCAN_SHOWN * steps, (f"call {n + 1}: {now[0]} statements, {now[1]} "
                                         f"instructions; the first {COUNTED}: {first}")
        last = [counted_call(h, proxy, args) for _ in range(COUNTED)]
        assert server.calls == CALLS
        found = (f"statements and instructions a call, calls {WARM_CALLS + 1} to "
                 f"{WARM_CALLS + COUNTED}: {first}; the last {COUNTED}: {last}")
        assert statistics.median(s for s, _ in last) <= \
            statistics.median(s for s, _ in first), found
        assert statistics.median(n for _, n in last) <= steps, found
        print(found)
    finally:
        proxy.close()
        h.close()


# Every statement the call index runs, with parameters of the right types.
INDEX_QUERIES = [
    ("open row", "SELECT * FROM proxy_calls WHERE session=? AND request_key=? AND open=1",
     ("s", "k")),
    ("newest closed rows", "SELECT * FROM proxy_calls WHERE session=? AND request_key=? AND "
     "open=0 ORDER BY id DESC LIMIT ?", ("s", "k", 8)),
    ("attempts", "SELECT * FROM proxy_calls WHERE session=? AND request_key=? AND outcome!=? "
     "AND id<? ORDER BY id DESC LIMIT ?", ("s", "k", 1, 2 ** 62, 8)),
    ("unsettled", "SELECT * FROM proxy_calls WHERE session=? AND settled_at=0 ORDER BY id",
     ("s",)),
    ("recent unsettled", "SELECT * FROM proxy_calls WHERE session=? AND settled_at=0 "
     "ORDER BY id DESC LIMIT ?", ("s", 200)),
    ("recent settled", "SELECT * FROM proxy_calls WHERE session=? AND settled_at>=? "
     "ORDER BY settled_at DESC LIMIT ?", ("s", 1.0, 200)),
    ("by run", "SELECT * FROM proxy_calls WHERE run_id=?", ("r",)),
    ("settle by run", "UPDATE proxy_calls SET settled_at=?, outcome=? WHERE run_id=? AND "
     "outcome=?", (1.0, 2, "r", 0)),
    ("settle a row", "UPDATE proxy_calls SET settled_at=CASE WHEN settled_at=0 THEN ? ELSE "
     "settled_at END, outcome=? WHERE id=? AND outcome=?", (1.0, 2, 5, 0)),
    ("the key's rows, open and newest closed, in one statement", ap._FOR_KEY_SQL,
     ("s", "k", "s", "k", 8)),
    ("close a row", "UPDATE proxy_calls SET open=0, closed_at=? WHERE id=? AND open=1",
     (1.0, 5)),
    ("unknown for a tool", "SELECT * FROM proxy_calls WHERE session=? AND tool=? AND "
     "request_key!=? AND outcome IN (?,?) AND id=(SELECT MAX(q.id) FROM proxy_calls q WHERE "
     "q.session=proxy_calls.session AND q.request_key=proxy_calls.request_key AND "
     "q.outcome!=?) ORDER BY id", ("s", "t", "k", 0, 3, 1)),
]


@pytest.fixture(scope="module")
def index_db(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plans") / "runs.db")
    store = ap.Store.open(path)
    ap.CallIndex(store, "s").migrate(time.time())
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("ANALYZE")
    yield conn
    conn.close()


@pytest.mark.parametrize("what,sql,params", INDEX_QUERIES, ids=[q[0] for q in INDEX_QUERIES])
def test_call_index_queries_search_an_index(index_db, what, sql, params):
    plan = [row[-1] for row in index_db.execute("EXPLAIN QUERY PLAN " + sql, params)]
    scans = [step for step in plan if step.startswith("SCAN") and "proxy_calls" in step
             and "USING" not in step]
    assert not scans, f"{what}: {plan}"
    # A search on the session alone walks the session's whole history.
    session_only = [step for step in plan if step.endswith("(session=?)")]
    assert not session_only, f"{what} walks the session: {plan}"


def test_the_index_queries_are_the_ones_the_module_runs():
    """The statements above are the module's own: a changed query must be added here."""
    import inspect
    source = inspect.getsource(ap.CallIndex)
    assert "_FOR_KEY_SQL" in source
    for fragment in ("open=1\"", "id<? \"",
                     "settled_at=0 ORDER BY id\"", "settled_at=0 ORDER BY id DESC LIMIT ?",
                     "settled_at>=? ORDER BY settled_at DESC LIMIT ?", "\"run_id=?\"",
                     "q.outcome!=?) ORDER BY id\"", "WHERE run_id=? AND \"",
                     "outcome=? WHERE id=? AND outcome=?\"", "\"id=? AND open=1\""):
        assert fragment in source, fragment


# -- the statements of one call ----------------------------------------------------------------

RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}


def second_call(h: ProxyHarness, upstream: InstantServer, tool: str, first: bytes,
                second: bytes) -> tuple[dict, dict, list[str]]:
    """Two calls through an in-process proxy: both answers, and the SQLite statements the
    store's connection ran for the second."""
    proxy = instant_proxy(h, upstream)
    statements: list[str] = []
    try:
        before = h.run(proxy.call(tool, first))
        h.store.conn.set_trace_callback(statements.append)
        after = h.run(proxy.call(tool, second))
        h.store.conn.set_trace_callback(None)
    finally:
        proxy.close()
        h.close()
    return before, after, statements


def test_a_new_run_reads_no_steps_and_the_rules_read_the_index_once(tmp_path):
    _, result, statements = second_call(ProxyHarness(tmp_path, rules=RULES), InstantServer(),
                                        "bank_balance", b'{"account":"A-0"}',
                                        b'{"account":"A-1"}')
    assert not result["isError"], result
    begin = statements.index("BEGIN IMMEDIATE")
    step_reads = [s for s in statements if s.startswith("SELECT") and " FROM steps " in s]
    index_reads = [s for s in statements if s.startswith("SELECT") and "proxy_calls" in s]
    assert step_reads == [], step_reads
    assert len(index_reads) == 1 and statements.index(index_reads[0]) < begin
    assert len(statements) <= 31, "\n".join(statements)   # 2 of them set the sync level


PAY_ALLOW = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
             "refund": {"side_effect": "destructive", "timeout": "10s"}}


def test_a_duplicate_reads_the_earlier_run_once(tmp_path):
    h, upstream, pay = ProxyHarness(tmp_path, rules=PAY_ALLOW), InstantServer(), \
        b'{"to":"bob","amount":1}'
    first, again, statements = second_call(h, upstream, "bank_pay", pay, pay)
    assert not first["isError"], first
    assert h.prefix(again) == "DUPLICATE" and upstream.calls == 1, again
    reads = [s for s in statements if s.startswith("SELECT") and " FROM runs " in s]
    assert len(reads) == 1, reads
