"""Regression tests for faults found by a review of the hardened proxy, each reproduced
against the real module: a test here fails while its fault is present.

1. Matching a schema pattern is not charged to the call's evaluation budget. Each string may
   spend MAX_PATTERN_WORK instruction visits (seconds), and the per-pattern memo empties
   after PATTERN_MEMO_STATES held instructions, so an array of short strings against one
   small pinned pattern keeps the event loop busy for many seconds.
2. `events -json` cannot print a run whose arguments nest 254 or 255 levels: Out.json reads
   its own output back with the gate's MAX_DEPTH, not the record allowance.
3. One host message of under 1 MB (an array of small values) keeps the event loop busy for
   seconds: the arguments are parsed about seven times, at microseconds a value. A server's
   answer costs the same way.
4. At exit the stdio servers are closed one after another, each given 2 * CLOSE_WAIT when
   it ignores EOF and SIGTERM: the exit waits for the sum.

Each is judged by a count or an order, never by a time, so that a busy machine judges it as
an idle one does: the instruction visits the patterns were allowed, the answers written
before a ping's, the strict parses of an answer, the closes under way at once.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import agentrt_proxy as ap  # noqa: E402
from proxy_harness import ProxyHarness  # noqa: E402

NEWLINE_SERVER = os.path.join(HERE, "newline_server.py")


def _nested_args(depth: int) -> bytes:
    """An arguments object nesting ``depth`` containers in all (the object counts)."""
    inner = "1"
    for _ in range(depth - 1):
        inner = "[" + inner + "]"
    return ('{"x":%s}' % inner).encode()


# ---- 1. pattern work is outside the call's budget -------------------------------------------

def test_pattern_work_is_bounded_per_call_not_only_per_string(monkeypatch):
    # A 27-character pattern, a pinned schema of 120 bytes, 40 KB of arguments. Unanchored,
    # {1,1000} keeps up to a thousand threads alive; the states are too big for the memo to
    # keep, so every string pays again. The whole check may spend what the call's budget
    # allows, in instruction visits: the faulty code let each string spend MAX_PATTERN_WORK
    # (about 8 s for the call on an idle core).
    schema = {"type": "object", "properties": {"s": {"type": "array", "items": {
        "type": "string", "pattern": "[a-z]{1,1000}$"}}}}
    compiled = ap.compile_schema(json.dumps(schema).encode())
    args = json.dumps({"s": ["a" * 1000 + "!"] * 40}).encode()
    assert len(args) < 50_000
    allowed = []                    # per string: the visits it spent, or all it was allowed
    search_costed = ap.Pattern.search_costed

    def counted(self, text, limit):
        allowed.append(limit)
        found, work = search_costed(self, text, limit)
        allowed[-1] = work
        return found, work
    monkeypatch.setattr(ap.Pattern, "search_costed", counted)
    with pytest.raises(ap.SchemaError):
        compiled.check(args)
    budget = ap.MAX_SCHEMA_EVALUATIONS * ap.PATTERN_VISITS_PER_EVALUATION
    assert allowed and sum(allowed) <= budget, f"{sum(allowed)} visits over {len(allowed)} " \
        f"strings, the call's budget {budget}"


# ---- 2. operator output of deep records -----------------------------------------------------

@pytest.fixture
def erase_harness(tmp_path):
    h = ProxyHarness(tmp_path, command=[sys.executable, NEWLINE_SERVER], rules={
        "erase": {"side_effect": "remote_mutation", "timeout": "5s",
                  "allow_hint_mismatch": True},
        "look": {"side_effect": "read_only", "timeout": "5s"}})
    yield h
    h.close()


def _cli(h: ProxyHarness, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, *argv], stdin=io.StringIO(""), stdout=out,
                   stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("depth", [254, 255])
def test_events_json_prints_arguments_nested_to_the_bound(erase_harness, depth):
    h = erase_harness
    r = h.call("bank_erase", raw_args=_nested_args(depth))
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    run = h.runs()[-1]
    code, out, err = _cli(h, "-json", "events", run.id)
    assert code == 0, f"events -json failed at depth {depth}: {err[:300]}"
    assert json.loads(out)["events"], out[:300]


# ---- 3. a large host message keeps the event loop busy --------------------------------------

# Under 1 MB of arguments: an array of 450,000 zeros. The proxy parses the arguments about
# seven times (parse_message and its spans, host_arguments, request_key, the gate's check,
# the decision record), at a few microseconds a value each: the faulty code did it on the
# event loop, before it could answer anything else (4 to 9 s here). A ping sent after the
# call is answered before it.


def _parses(monkeypatch, at_least: int) -> list[int]:
    """The lengths of the texts of at least ``at_least`` characters parsed from now on."""
    found: list[int] = []
    init = ap._Parser.__init__

    def counted(self, raw, text, strict):
        if len(text) >= at_least:
            found.append(len(text))
        init(self, raw, text, strict)
    monkeypatch.setattr(ap._Parser, "__init__", counted)
    return found


def test_a_large_call_does_not_stop_the_proxy_answering(tmp_path):
    h = ProxyHarness(tmp_path)
    try:
        args = b'{"account":"A","x":[' + b",".join([b"0"] * 450_000) + b"]}"
        assert len(args) < 1_000_000
        ident = h.request("tools/call", raw_params=b'{"name":"bank_balance","arguments":' +
                          args + b"}", wait=False)
        h.request("ping", timeout=120)
        before = [json.loads(raw).get("id") for raw in h.out]
        assert h.prefix(h.answer(ident, timeout=120)["result"]) == "INVALID"
        assert ident not in before, "the ping was answered only after the call"
    finally:
        h.close()


def test_a_large_server_answer_is_read_in_bounded_time(monkeypatch):
    # The same cost from the other side: a server's answer with 600,000 zeros in its
    # structuredContent (1.2 MB; a frame may hold 16 MiB). It is read (parse_message, its
    # spans), mapped (map_result parses the result, its spans, then the structured content
    # again and encodes it, to drop it for being past the 64 KiB cap) and observed, all on
    # the event loop. The faulty code spends about six parses of it (5.7 measured), the
    # fixed one about one; a 16 MiB answer cost the faulty code a minute or more.
    structured = b'{"v":[' + b",".join([b"0"] * 600_000) + b"]}"
    line = (b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"paid"}],'
            b'"structuredContent":' + structured + b"}}\n")
    assert len(line) < ap.MAX_FRAME
    spec = ap.ToolSpec("bank_pay", "pays", b'{"type":"object"}', "remote_mutation", 5.0, True)
    tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"), None)
    # Counted in parses of it or of its structured content: the fixed code reads the
    # answer in one pass; the faulty code parsed it, or its structured content, three times
    # or more.
    parses = _parses(monkeypatch, len(structured))
    msg = ap.parse_message(line, ap.UPSTREAM_DEPTH)
    obs = ap._observe("bank_pay", 5.0, ap.map_result(tool, msg))
    assert obs[0]["kind"] == ap.TOOL_RESULT
    assert len(parses) == 1, f"the answer or its structured content parsed {len(parses)} times"


# ---- 4. closing stubborn servers one after another ------------------------------------------

STUBBORN = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "open(sys.argv[1], 'w').close()\n"
            "time.sleep(120)\n")
READY_WAIT = 10.0
CLOSE_STEP = 0.5            # CLOSE_WAIT here: what is judged is how many close at once


def test_closing_servers_that_ignore_eof_and_sigterm_is_bounded_overall(tmp_path,
                                                                         monkeypatch):
    # Each stdio server gets CLOSE_WAIT after its stdin closes and CLOSE_WAIT after SIGTERM
    # before SIGKILL; close_tools closed the servers one after another, so at exit the
    # proxy waited 2 * CLOSE_WAIT for each server that ignores both (three: 30 s), where a
    # host may already have given up on it. Closed together, the wait is that of one: all
    # three closes are under way at once.
    monkeypatch.setattr(ap, "CLOSE_WAIT", CLOSE_STEP)
    under_way, most = [0], [0]
    close = ap.StdioUpstream.close

    async def counted(self):
        under_way[0] += 1
        most[0] = max(most[0], under_way[0])
        try:
            await close(self)
        finally:
            under_way[0] -= 1
    monkeypatch.setattr(ap.StdioUpstream, "close", counted)

    async def scenario() -> None:
        conns = []
        for i in range(3):
            ready = str(tmp_path / f"ready{i}")
            conn = ap.StdioUpstream(f"s{i}", [sys.executable, "-c", STUBBORN, ready],
                                    {"PATH": os.environ.get("PATH", "")})
            await conn.start()
            conns.append(conn)
        deadline = time.monotonic() + READY_WAIT      # each has installed its handler
        while not all((tmp_path / f"ready{i}").exists() for i in range(3)):
            assert time.monotonic() < deadline, "the servers did not start"
            await asyncio.sleep(ap.EXIT_POLL)
        holders = [types.SimpleNamespace(conn=c) for c in conns]
        await ap.close_tools(holders)
        for conn in conns:
            assert conn.proc is None

    asyncio.run(scenario())
    assert most[0] == 3, f"at most {most[0]} of the three closes were under way at once"
