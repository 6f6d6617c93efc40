"""Regression tests for what two code reviews found, one test per fix.

First review (/tmp/review/t, fixed in d891c0c): JSON whitespace only around arguments (t1),
an unrecordable outcome lets go of the lease (t3/t4/t9), a whitespace capability (t5), a grant
must still be the step's latest (t6), proposals judged outside the write transaction (t7),
literal-preserving -json output (t8). Second review (/tmp/review2/exp, fixed in 6e5e37a):
see each test's docstring. The other commits (96a5ce2, c17ac7a, 9e92090, 0a2b80f, 93356a0,
6f3edf6) each fixed something their own tests found; each has a test here too.

Every test fails on the code before its fix (checked by running this file against
``git show <commit>^:agentrt_proxy.py``). The last one found a bug since fixed: a call that
timed out through the gate was not cancelled at the server (the gate's bound now falls just
past the tool's own timeout).
Every wait has a deadline; processes are ended only by the pid this file started them under.
"""

import asyncio
import contextlib
import hashlib
import http.server
import io
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import threading
import time

import pytest

from conftest import BALANCE, LIMITS, PAY, ap
from process_helpers import (PROXY, PYTHON, ProcessDir, child_pids, _cmdline, eventually,
                             eventually_async)
from proxy_harness import DEFAULT_RULES, ProxyHarness, harness_loop, write_config
from mcp_http_server import MCPHTTPServer

GONE_WAIT = 30.0        # for a stream the proxy gave up on to be closed: generous, never timed
NEVER = 600.0           # a step of a close no test waits out
PIN_WAIT = 30.0         # a pin, its close included


# -- small helpers -------------------------------------------------------------------------------

def _recording_tools(calls: list, pay_impl=None, pay_effect="remote_mutation"):
    """pay (terminal) and balance (read_only), recording the arguments each call ran with."""
    async def pay(args: bytes):
        calls.append(("pay", args))
        if pay_impl is not None:
            return await pay_impl(args)
        return ap.ToolResult(b'{"paid":true}', "paid")

    async def balance(args: bytes):
        calls.append(("balance", args))
        return ap.ToolResult(b'{"balance":10}', "balance 10")

    spec = ap.ToolSpec(PAY.name, PAY.description, PAY.input_schema, pay_effect, PAY.timeout,
                       PAY.terminal)
    return [ap.Tool(spec, pay), ap.Tool(BALANCE, balance)]


class _Policy:
    """A policy that asks for approval with whatever capability the test sets."""
    policy_id = ""

    def __init__(self, capability: bytes = b"{}", fixed: str = ""):
        self.capability, self.fixed = capability, fixed

    def evaluate(self, request, view):
        if self.fixed:
            return ap.need_approval("remote_mutation", "ask",
                                    {"fixed": self.fixed, "args": ap.Raw(request.args)}, None)
        return ap.PolicyDecision("require_approval", "ask", "remote_mutation", self.capability,
                                 b"")


def _event_types(store, run_id):
    return [e[4] for e in store.list_events(run_id)]


# == First review (d891c0c) =======================================================================

def test_vertical_tab_around_arguments_is_invalid_not_stripped(harness):
    """Review 1, finding t1: arguments b'\\x0c{"b":1}\\x0b' were stripped with bytes.strip()
    (which takes form feed and vertical tab) and executed; JSON has only four whitespace
    bytes, so the request is INVALID and nothing runs."""
    calls: list = []
    gate = ap.Gate(harness.store, _recording_tools(calls), ap.SideEffectPolicy())
    try:
        s = gate.begin("r-ws", "read", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "balance", b'\x0c{"b":1}\x0b', origin="model"))
        assert v.kind != "allowed", "arguments wrapped in \\f and \\v were accepted"
        assert v.observation["kind"] == ap.INVALID_DECISION
        assert calls == []
        assert "step.tool_started" not in _event_types(harness.store, "r-ws")
    finally:
        gate.close()


def test_outcome_that_cannot_be_recorded_lets_go_of_the_lease(harness):
    """Review 1, findings t3/t4/t9: when the tool ran and its outcome could not be written
    (the database refused the write), the heartbeat went on renewing the run's lease for as
    long as the process lived, so the run stayed IN_PROGRESS forever. The lease must be let
    go, so that the next executor takes the run over as cut off while executing."""
    calls: list = []
    tools = _recording_tools(calls, pay_effect="local_mutation")
    gate = ap.Gate(harness.store, tools, ap.SideEffectPolicy())
    other = ap.Gate(harness.store, tools, ap.SideEffectPolicy())
    store = harness.store
    real_tx = store.tx
    try:
        s = gate.begin("r-lease", "pay", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}', origin="model"))
        assert v.kind == "allowed"
        s.start()                                   # the tool's start is committed

        failed = []

        def refusing_tx():                          # the next write fails once, as a
            if not failed:                          # locked or full database does
                failed.append(1)
                raise ap.StoreError(f"{store.path}: write failed: database is locked")
            return real_tx()

        store.tx = refusing_tx
        with pytest.raises(ap.ProxyError):
            asyncio.run(s.run_started())
        store.tx = real_tx
        assert failed and calls == [("pay", b'{"amount":1}')]
        assert not gate.leases.holds("r-lease"), "the heartbeat still renews the lease"
        run = store.get_run("r-lease")
        assert run.status == ap.RUNNING and run.lease_owner == "", \
            f"the run is still leased to {run.lease_owner} until {run.lease_expires_at}"
        # Another executor takes it over at once: a mutation cut off while executing waits
        # for an operator, it is not run again.
        session, verdict = other.attach("r-lease")
        assert verdict.kind == "pending"
        assert verdict.approval.kind == ap.INTERRUPTED_KIND
        assert len(calls) == 1
    finally:
        store.tx = real_tx
        gate.close()
        other.close()


def test_whitespace_capability_is_collected_after_approval(harness):
    """Review 1, finding t5: a policy that answered require_approval with a capability of
    b" " was stored as {} but, when the approval was collected, the blank capability was not
    judged as "no value", so attach raised JSONError and the approved run could never
    execute."""
    calls: list = []
    tools = _recording_tools(calls)
    gate = ap.Gate(harness.store, tools, _Policy(capability=b" "))
    collector = ap.Gate(harness.store, tools, _Policy(capability=b" "))
    try:
        s = gate.begin("r-cap", "pay", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}', origin="model"))
        assert v.kind == "pending" and v.approval.capability == b"{}"
        ap.decide_approval(harness.store, "r-cap", v.approval.id, True, "op", "",
                           v.approval.hash, time.time())
        session, verdict = collector.attach("r-cap")
        assert verdict.kind == "allowed"
        asyncio.run(session.execute())
        assert calls == [("pay", b'{"amount":1}')]
        assert harness.store.get_run("r-cap").status == ap.COMPLETED
    finally:
        gate.close()
        collector.close()


def test_grant_collected_after_another_gate_asked_again_does_not_execute(harness):
    """Review 1, finding t6: gate A collected an approved grant; gate B (its configuration
    changed, so its policy asked for a new approval on the same step) then paused the run on
    a new approval; A executed its stale grant anyway. Only the step's latest approval is a
    grant: A must not execute."""
    calls: list = []
    tools = _recording_tools(calls)
    gate_a = ap.Gate(harness.store, tools, _Policy(fixed="acct-1"))
    gate_b = ap.Gate(harness.store, tools, _Policy(fixed="acct-2"))
    try:
        s = gate_a.begin("r-grant", "pay", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}', origin="model"))
        ap.decide_approval(harness.store, "r-grant", v.approval.id, True, "op", "",
                           v.approval.hash, time.time())
        session_a, verdict_a = gate_a.attach("r-grant")
        assert verdict_a.kind == "allowed"
        session_b, verdict_b = gate_b.attach("r-grant")
        assert verdict_b.kind == "pending" and verdict_b.approval.id != v.approval.id
        with contextlib.suppress(ap.ProxyError):
            asyncio.run(session_a.execute())
        assert calls == [], "a grant superseded by a new approval executed"
        latest = harness.store.list_approvals("r-grant")[-1]
        assert latest.id == verdict_b.approval.id and latest.status == ap.PENDING
        assert harness.store.get_run("r-grant").status == ap.WAITING
    finally:
        gate_a.close()
        gate_b.close()


SLOW_PATTERN = "a[ab]{30}c"


def test_slow_schema_pattern_does_not_hold_the_write_lock(harness, monkeypatch):
    """Review 1, finding t7: Gate.start validated the arguments (and evaluated the policy)
    inside its write transaction, so a schema pattern with catastrophic backtracking held the
    database's write lock, and every other writer (another proxy, the operator) waited for
    it. Proposals are judged first, outside the transaction: every match of the pattern is
    made while the store's connection holds no transaction, however long it takes."""
    spec = ap.ToolSpec("note", "notes", b'{"type":"object","properties":{"s":{"type":'
                       b'"string","pattern":"' + SLOW_PATTERN.encode() + b'"}}}',
                       "read_only", 5.0, True)

    async def note(args):
        return ap.ToolResult(b"{}", "ok")

    gate = ap.Gate(harness.store, [ap.Tool(spec, note)], ap.SideEffectPolicy())
    matched: list[bool] = []            # per match: whether a transaction was open
    search_costed = ap.Pattern.search_costed

    def watched(self, text, limit):
        matched.append(harness.store.conn.in_transaction)
        return search_costed(self, text, limit)
    monkeypatch.setattr(ap.Pattern, "search_costed", watched)
    try:
        args = b'{"s":"' + b"ab" * 1000 + b'"}'
        asyncio.run(gate.call("r-slow", "note", LIMITS,
                              ap.Decision("tool_call", "note", args, origin="model")))
    finally:
        gate.close()
    assert matched and not any(matched), \
        f"{sum(matched)} of {len(matched)} matches made inside the write transaction"


def test_events_json_keeps_number_literals(harness, cli):
    """Review 1, finding t8: `events -json` re-serialised payloads through Python floats, so
    the recorded 1250.50 was shown as 1250.5 (a different request to the runtime's hash).
    The stored literals are printed as written."""
    harness.waiting("r-lit", args=b'{"amount": 1250.50, "n": 12345678901234567890123}')
    code, out, err = cli("-db", harness.path, "-json", "events", "r-lit")
    assert code == 0, err
    json.loads(out)
    decided = out.split('"step.decided"', 1)[1]
    assert re.search(r'"amount":\s*1250\.50\b', decided), decided[:400]
    assert re.search(r'"n":\s*12345678901234567890123\b', decided)


# == Second review (6e5e37a) ======================================================================

def test_store_error_while_asking_about_an_unknown_outcome_keeps_the_tool_blocked(tmp_path):
    """Review 2, f_rerun_err.py: a payment timed out (its outcome unknown); asking an operator
    about it then hit a store error. The run was left leased to this process and the tool
    unblocked: a respelled payment executed, and the identical call answered IN_PROGRESS for
    as long as the process lived. The run must be let go of, so the tool stays BLOCKED and
    the identical call asks an operator."""
    rules = {"balance": {"side_effect": "read_only", "timeout": "5s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "1s", "outcome": "allow"},
             "refund": {"side_effect": "destructive", "timeout": "5s"}}
    h = ProxyHarness(tmp_path, rules=rules, lease_ttl="3s")
    try:
        real_rerun, real_steps = h.proxy.rerun, h.store.list_steps
        armed = []

        def rerun(*a, **k):
            armed.append(1)
            return real_rerun(*a, **k)

        def list_steps(run_id):
            if armed:
                armed.clear()
                raise ap.StoreError("database is locked (simulated SQLITE_BUSY)")
            return real_steps(run_id)

        h.proxy.rerun, h.store.list_steps = rerun, list_steps
        h.call("bank_pay", {"to": "bob", "amount": 1, "mode": "block"})
        h.proxy.rerun, h.store.list_steps = real_rerun, real_steps
        h.release()
        run = h.runs()[-1]
        assert run.lease_owner == "", f"the run is still leased to {run.lease_owner}"
        r = h.call("bank_pay", raw_args=b'{"to":"bob","amount":1.0}')
        assert h.prefix(r) == "BLOCKED", h.text(r)
        r = h.call("bank_pay", {"to": "bob", "amount": 1, "mode": "block"})
        assert h.prefix(r) in ("UNKNOWN_OUTCOME", "INTERRUPTED"), h.text(r)
        assert h.payments() == 1
    finally:
        h.release()
        h.close()


def test_operator_cancelled_pending_request_is_not_an_attempt(tmp_path):
    """Review 2, g_cancel.py: a payment waiting for approval that an operator cancelled was
    counted as an attempt cut off with an unknown outcome, so after the repeat window the
    identical request was asked about as interrupted_side_effect. Nothing ever ran: it asks
    for an ordinary approval."""
    h = ProxyHarness(tmp_path)
    try:
        args = {"to": "bob", "amount": 5}
        assert h.prefix(h.call("bank_pay", args)) == "PENDING_APPROVAL"
        ap.cancel_run(h.store, h.runs()[-1].id, "op", "not now", time.time())
        assert h.prefix(h.call("bank_pay", args)) == "REJECTED"
        h.clock.skew += 700                          # past the 600 s repeat window
        r = h.call("bank_pay", args)
        assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
        assert h.pending()[-1].kind != ap.INTERRUPTED_KIND
        assert h.payments() == 0
    finally:
        h.close()


def test_arguments_nested_300_deep_are_recorded_invalid(tmp_path):
    """Review 2, a_deep.py: arguments nested past the envelope's depth (300 levels) were
    refused as a parse error (-32700) with nothing recorded; they are arguments the runtime
    refuses, so the gate records the call as INVALID."""
    h = ProxyHarness(tmp_path)
    try:
        deep = b"[" * 300 + b"]" * 300
        h.send(b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"bank_pay",'
               b'"arguments":{"to":"bob","amount":1,"x":' + deep + b"}}}")

        async def answered():
            while not h.out:
                await asyncio.sleep(0.005)
        h.run(answered(), timeout=30)
        msg = json.loads(h.out[-1])
        assert "result" in msg, f"refused as a message, nothing recorded: {msg}"
        r = msg["result"]
        assert msg["id"] == 7 and h.prefix(r) == "INVALID" and h.is_error(r), h.text(r)
        runs = h.runs()
        assert len(runs) == 1 and runs[0].status == ap.FAILED
        assert h.payments() == 0
    finally:
        h.close()


def test_is_error_answer_with_deep_structured_content_is_a_known_failure():
    """Review 2, j_maperr.py: an isError answer whose structuredContent is nested past 256
    levels made map_result raise JSONError, recorded as a panic: an unknown outcome
    (no_answer) that blocks the tool. The server answered that it failed: a known failure."""
    spec = ap.ToolSpec("bank_pay", "", b'{"type":"object"}', "remote_mutation", 5.0, True)
    tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"), None)
    deep = b"[" * 300 + b"1" + b"]" * 300
    line = (b'{"jsonrpc":"2.0","id":1,"result":{"isError":true,"content":[{"type":"text",'
            b'"text":"declined"}],"structuredContent":{"x":' + deep + b"}}}")
    msg = ap.parse_message(line, ap.UPSTREAM_DEPTH)

    async def answer(args):
        return ap.map_result(tool, msg)

    obs = asyncio.run(ap._call_tool(ap.Tool(spec, answer), b"{}"))[0]
    assert obs["kind"] == ap.TOOL_ERROR
    assert "panic" not in json.dumps(obs["content"]), obs["content"]
    assert ap.unknown_ending(tool, obs) is None


def _fake_server_children() -> set[int]:
    return {pid for pid in child_pids(os.getpid()) if b"fake_payment_server" in _cmdline(pid)}


def test_load_server_closes_the_server_when_building_a_tool_raises(tmp_path, monkeypatch):
    """Review 2, i_leak.py: building a tool that raised out of load_server (then: a manifest
    entry of the wrong type, schema_hash 5, which is now simply a hash that does not match)
    left the server's process running; it is closed on the way out."""
    cfg = ap.load_config(write_config(str(tmp_path)))
    loop = asyncio.new_event_loop()
    before = _fake_server_children()
    left: set[int] = set()
    try:
        manifest = loop.run_until_complete(ap.pin_server(cfg.servers[0], time.time()))
        ap.write_manifest(cfg.servers[0].manifest, manifest)

        def broken(*args, **kwargs):
            raise RuntimeError("building the tool failed")
        monkeypatch.setattr(ap, "_build", broken)
        with pytest.raises(Exception):
            loop.run_until_complete(asyncio.wait_for(ap.load_tools(cfg), 30))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            left = _fake_server_children() - before
            if not left:
                break
            loop.run_until_complete(asyncio.sleep(0.05))
        assert not left, f"the server (pids {sorted(left)}) still runs after the failed load"
    finally:
        for pid in left:                              # a server this test's load started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        loop.close()


class TinyMCP:
    """A legacy streamable-HTTP MCP server in a thread, with one tool, ``pay``.

    ``delay``: seconds tools/call takes before answering; ``trickle``: tools/call answers an
    event stream that sends a keep-alive comment every 0.1 s and never the answer (``gone``
    is set when the client has closed it); ``idle``: seconds a kept-alive connection may sit
    idle before the server closes it. ``paid`` lists the arguments of every tools/call
    received. ``listing``: the raw bytes of the tools/list result, when given."""

    def __init__(self, delay=0.0, trickle=False, idle=None, listing=None):
        self.delay, self.trickle, self.listing = delay, trickle, listing
        self.paid: list[bytes] = []
        self.gone = threading.Event()
        self.stop_event = threading.Event()
        self.connections: list = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                owner.connections.append(self.connection)

            def send_json(self, doc):
                out = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_POST(self):
                msg = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                method, ident = msg.get("method"), msg.get("id")
                if ident is None:
                    self.send_response(202)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if method == "initialize":
                    result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                              "serverInfo": {"name": "tiny", "version": "1"}}
                elif method == "tools/list" and owner.listing is not None:
                    self.send_json(b'{"jsonrpc":"2.0","id":%s,"result":%s}' % (
                        json.dumps(ident).encode(), owner.listing))
                    return
                elif method == "tools/list":
                    result = {"tools": [{"name": "pay", "description": "pays",
                                         "inputSchema": {"type": "object"}}]}
                elif method == "tools/call":
                    owner.paid.append(json.dumps(msg["params"].get("arguments")).encode())
                    if owner.trickle:
                        self.stream()
                        return
                    owner.stop_event.wait(owner.delay)
                    result = {"content": [{"type": "text", "text": "paid"}]}
                else:
                    self.send_json({"jsonrpc": "2.0", "id": ident,
                                    "error": {"code": -32601, "message": "no such method"}})
                    return
                self.send_json({"jsonrpc": "2.0", "id": ident, "result": result})

            def stream(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.close_connection = True
                try:
                    while not owner.stop_event.is_set():
                        self.wfile.write(b": keepalive\n\n")
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    owner.gone.set()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self):
        """Stop listening and close every connection, kept-alive ones included."""
        if self.httpd is not None:
            self.stop_event.set()
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join(5)
            self.httpd = None
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _tiny_config(tmp, endpoint, rules, connect_timeout="5s", server=None):
    """The configuration (written 0600, then loaded) of one server named ``h``: at the HTTP
    ``endpoint``, or the ``server`` entry given."""
    server = server or {"endpoint": endpoint, "connect_timeout": connect_timeout}
    doc = {"database": "runs.db", "session": "t", "hold": "0s",
           "servers": [{"name": "h", "manifest": "h.manifest.json", "rules": rules, **server}]}
    path = os.path.join(str(tmp), "proxy.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)
    return ap.load_config(path)


class HttpProxy:
    """An in-process proxy over one server named ``h`` (HTTP unless ``server`` is given):
    pinned, loaded, ready."""

    def __init__(self, tmp, endpoint, rules, connect_timeout="5s", server=None):
        self.loop = harness_loop()
        self.log: list[str] = []
        self.tools, self.store, self.proxy = [], None, None
        self.cfg = _tiny_config(tmp, endpoint, rules, connect_timeout, server)
        server = self.cfg.servers[0]
        ap.write_manifest(server.manifest, self.run(ap.pin_server(server, time.time())))
        self.tools, _ = self.run(ap.load_tools(self.cfg))
        self.store = ap.Store.open(self.cfg.database)
        self.proxy = ap.Proxy(self.cfg, self.store, self.tools, self.log.append)

    def run(self, coro, timeout=30):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def call(self, name, args: bytes, timeout=30) -> tuple[str, float]:
        """The answer's text and how long it took."""
        t = time.monotonic()
        r = self.run(self.proxy.call(name, args), timeout)
        return "".join(b.get("text", "") for b in r["content"]), time.monotonic() - t

    def close(self):
        with contextlib.suppress(Exception):
            self.run(ap.close_tools(self.tools), 10)
        if self.proxy is not None:
            self.proxy.close()
        if self.store is not None:
            self.store.close()
        self.loop.close()
        asyncio.set_event_loop(None)


PAY_ALLOWED = {"pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}


def test_pooled_http_connection_honours_the_calls_timeout(tmp_path):
    """Review 2, h2.py: a kept-alive connection from the pool kept the socket timeout of the
    request that opened it (the era probe's, at most 5 s), so a payment the rule allowed 10 s
    for timed out early and was reported as an unknown outcome. The socket gets the call's
    timeout."""
    srv = TinyMCP(delay=1.5)
    hp = None
    try:
        # connect_timeout 1s: the era probe, which opens the pooled connection, gets 0.5 s.
        hp = HttpProxy(tmp_path, f"http://127.0.0.1:{srv.port}/mcp", PAY_ALLOWED,
                       connect_timeout="1s")
        text, _ = hp.call("h_pay", b'{"to":"bob"}')     # answered after the server's 1.5 s
        assert text == "paid", text
        assert len(srv.paid) == 1
    finally:
        if hp is not None:
            hp.close()
        srv.stop()


def test_idle_connection_the_server_closed_is_not_reused(tmp_path):
    """Review 2, l_idle.py: the server closed an idle kept-alive connection; the proxy sent
    the next payment on it, the request never reached the server, and the failure was
    recorded as an unknown outcome that blocked the tool. A closed idle connection is not
    reused: the payment is delivered on a new one."""
    srv = TinyMCP(idle=0.3)
    hp = None
    try:
        hp = HttpProxy(tmp_path, f"http://127.0.0.1:{srv.port}/mcp", PAY_ALLOWED)
        # A clock that must pass: longer idle than the server's 0.3 s keep-alive allows.
        time.sleep(0.8)
        text, _ = hp.call("h_pay", b'{"to":"bob"}')
        assert text == "paid", text
        text, _ = hp.call("h_pay", b'{"to":"carol"}')
        assert text == "paid", text
        assert srv.paid == [b'{"to": "bob"}', b'{"to": "carol"}']
    finally:
        if hp is not None:
            hp.close()
        srv.stop()


def test_endpoint_url_never_reaches_the_model(tmp_path):
    """Review 2, d_leak.py: when an HTTP server could not be reached, the error the model was
    shown quoted the endpoint, credentials in its query string included. The endpoint is
    configuration; the model is told only the server's name."""
    srv = TinyMCP()
    hp = None
    try:
        endpoint = f"http://127.0.0.1:{srv.port}/mcp?api_key=SECRET123"
        hp = HttpProxy(tmp_path, endpoint,
                       {"pay": {"side_effect": "local_mutation", "timeout": "2s"}})
        srv.stop()                          # the server is gone
        for args in (b'{"to":"bob"}', b'{"to":"carol"}'):
            text, _ = hp.call("h_pay", args)
            assert "SECRET123" not in text and f"127.0.0.1:{srv.port}" not in text, text
    finally:
        if hp is not None:
            hp.close()
        srv.stop()


def test_sse_stream_that_trickles_keepalives_is_bounded(tmp_path):
    """Review 2, c_trickle.py: a server that answers a call with an event stream of
    keep-alive comments and never the answer kept the proxy's reader thread blocked forever
    (each byte reset the socket timeout), so the process could not exit. The whole answer
    has the call's deadline: the stream is closed when it passes."""
    srv = TinyMCP(trickle=True)
    hp = None
    try:
        hp = HttpProxy(tmp_path, f"http://127.0.0.1:{srv.port}/mcp",
                       {"pay": {"side_effect": "local_mutation", "timeout": "1s"}})
        text, _ = hp.call("h_pay", b'{"to":"bob"}')       # the call's own deadline bounds it
        assert srv.gone.wait(GONE_WAIT), "the proxy still reads the trickling stream"
        assert srv.paid == [b'{"to": "bob"}']
    finally:
        srv.stop()                          # ends the stream, so a stuck reader ends too
        if hp is not None:
            hp.close()


def _read_line(stream, timeout: float) -> bytes:
    """One line from a pipe, or b'' at the deadline."""
    box: list = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else b""


def _end(proc: subprocess.Popen) -> None:
    """End a proxy this test started, and the fake server it started, by their pids."""
    if proc.poll() is None:
        servers = [c for c in child_pids(proc.pid) if b"fake_payment_server" in _cmdline(c)]
        for pid in [proc.pid] + servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    for f in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError, ValueError):
            if f is not None:
                f.close()


INITIALIZE = (b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":'
              b'"2025-06-18","capabilities":{},"clientInfo":{"name":"host","version":"1"}}}\n')


def test_host_that_stops_reading_does_not_hang_the_proxy_after_stdin_eof(tmp_path):
    """Review 2, b_pipe.py: a host that closed its end of the proxy's stdout (stopped
    reading) and then closed stdin left the proxy running forever. A closed host pipe ends
    serving: the proxy exits once stdin is closed."""
    d = ProcessDir(tmp_path)
    with open(os.path.join(d.tmp, "proxy.stderr"), "wb") as err:
        proc = subprocess.Popen([PYTHON, PROXY, "-config", d.config], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, cwd=d.tmp)
    try:
        proc.stdin.write(INITIALIZE)
        proc.stdin.flush()
        assert b'"result"' in _read_line(proc.stdout, 30)
        proc.stdout.close()                          # the host stops reading
        proc.stdin.write(b'{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{}}\n')
        proc.stdin.flush()
        # Its answer meets the closed pipe; the proxy may end there (a host that is gone).
        # Nothing else shows that it tried, so wait, bounded, for that exit, then close.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)
        with contextlib.suppress(OSError):
            proc.stdin.close()                       # and ends the session
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        assert code is not None, "the proxy still runs 10 s after stdin closed"
    finally:
        _end(proc)


def test_sigterm_mid_call_exits_zero_after_the_call_is_recorded(tmp_path):
    """9e92090: the host's input was read through a buffered reader on a thread; SIGTERM
    while a call ran ended serving, but the thread blocked in that reader held its lock at
    interpreter shutdown, so the proxy died with a fatal error instead of exiting 0 after
    recording the call. The input is read from the descriptor."""
    d = ProcessDir(tmp_path, allow_pay=True)
    p = d.start()
    try:
        p.send_call("bank_pay", {"to": "yan", "amount": 4, "mode": "block"})
        deadline = time.monotonic() + 15
        while d.payments() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.payments() == 1
        os.kill(p.pid, signal.SIGTERM)
        # The proxy shows nothing when the signal is handled; this pause lets it land before
        # the release. Were it short, the signal would come after the call and the test would
        # check less, never fail wrongly.
        time.sleep(0.2)
        d.release()
        code = p.wait_exit(30)
        assert code == 0, f"exit {code} after SIGTERM; stderr:\n{p.stderr()[-2000:]}"
        run = d.runs()[-1]
        assert run["status"] == "COMPLETED", run
    finally:
        d.release()
        d.cleanup()


# == 96a5ce2: the spec's timeout in the approval hash ==============================================

def test_approval_hash_takes_the_spec_timeout_in_integer_nanoseconds():
    """96a5ce2: the approval hash encoded the tool spec's timeout as a duration string
    ("30s"), so it never matched the reference's golden value (core.md 7.2), which hashes
    the timeout in integer nanoseconds."""
    spec = ap.ToolSpec("push", "push <main> & tag", b'{"type":"object"}', "remote_mutation",
                       30.0)
    request = ap.ToolRequest("r1", "s1", spec, b'{"n":7,"ref":"refs/heads/main"}')
    got = ap.approval_hash("remote_mutation", b'{"tool":"push","args":{"n":7}}',
                           b'{"title":"Publish <PR> & tag","lines":1.0}', request)
    assert got == "175bcfc7a7e3cdab6b98d7b50caf9f2a8e59d5208211b97de39a4b027c7fa0b2"
    # A fractional timeout too: 1.5 s is 1500000000 ns in the hashed request.
    spec = ap.ToolSpec("pay", "pays", b'{"type":"object"}', "remote_mutation", 1.5)
    request = ap.ToolRequest("r2", "s2", spec, b'{"n":1}')
    doc = {"capability": {}, "kind": "remote_mutation", "presentation": {},
           "request": {"args": {"n": 1}, "run_id": "r2", "step_id": "s2",
                       "spec": {"description": "pays", "input_schema": {"type": "object"},
                                "name": "pay", "side_effect": "remote_mutation",
                                "timeout": 1500000000}}}
    want = hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert ap.approval_hash("remote_mutation", b"{}", b"{}", request) == want


# == c17ac7a: a deep answer from a server ==========================================================

def test_deep_answer_from_a_server_is_unrecorded_and_keeps_the_connection(tmp_path):
    """c17ac7a: a server's answer whose structuredContent was nested 300 deep was not JSON-RPC
    the proxy could read, so it broke the connection to the server: the payment's outcome
    was lost and every later call failed. The server answered: the call is recorded as
    content the gate refused (UNRECORDED), and the connection keeps serving."""
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
    h = ProxyHarness(tmp_path, rules=rules)
    try:
        r = h.call("bank_pay", {"to": "bob", "amount": 3, "mode": "deep"})
        assert h.prefix(r) == "UNRECORDED", h.text(r)
        assert h.payments() == 1
        r = h.call("bank_balance", {"account": "A-1"})
        assert h.text(r) == "account A-1 holds 120.00 EUR", h.text(r)
        r = h.call("bank_pay", {"to": "carol", "amount": 4})
        assert h.text(r) == "paid 4.00 to carol", h.text(r)
    finally:
        h.close()


# == 0a2b80f: durations; recheck and the database's mode ===========================================

def test_duration_with_non_ascii_digits_is_refused(tmp_path):
    """0a2b80f: durations were matched with \\d, which takes any Unicode digit, so a rule's
    timeout of "\\uff11\\uff10s" (full-width digits) was read as 10 s. Durations take ASCII
    digits only."""
    for text in ("\uff11\uff10s", "\u0661\u0660s", "1\u0660m"):
        with pytest.raises(ValueError):
            ap.parse_duration(text)
    path = write_config(str(tmp_path), {"balance": {"side_effect": "read_only",
                                                    "timeout": "\uff11\uff10s"}})
    with pytest.raises(ap.ConfigError):
        ap.load_config(path)


def test_recheck_does_not_change_the_database_mode(tmp_path):
    """0a2b80f: recheck, which only reads, checked the database as a writer does and
    tightened a 0644 database to 0600. It opens the database without touching its mode."""
    h = ProxyHarness(tmp_path)
    try:
        h.call("bank_balance", {"account": "A-1"})
    finally:
        h.close()
    os.chmod(h.cfg.database, 0o644)
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["recheck", "-config", h.config_path], stdin=io.StringIO(""), stdout=out,
                   stderr=err)
    assert code == 0, err.getvalue()
    assert oct(os.stat(h.cfg.database).st_mode & 0o777) == "0o644"


# == 93356a0: MCP fixes its tests found ============================================================

def _mapped(result: bytes) -> dict:
    """The observation the gate records for an upstream answer with this result."""
    spec = ap.ToolSpec("bank_pay", "", b'{"type":"object"}', "remote_mutation", 5.0, True)
    tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"), None)
    msg = ap.parse_message(b'{"jsonrpc":"2.0","id":1,"result":' + result + b"}",
                           ap.UPSTREAM_DEPTH)

    async def answer(args):
        return ap.map_result(tool, msg)

    return asyncio.run(ap._call_tool(ap.Tool(spec, answer), b"{}"))[0]


def test_sse_priming_event_before_the_answer_is_skipped(tmp_path):
    """93356a0: a server that opens its event stream with a priming event (an id and empty
    data, as resumable servers do) had that event parsed as a message, which failed, so
    the server could not be pinned or called. Events without data are skipped."""
    with MCPHTTPServer(mode="sse", era="legacy", priming=True) as srv:
        hp = HttpProxy(tmp_path, srv.url, {"balance": {"side_effect": "read_only",
                                                       "timeout": "5s"}})
        try:
            text, _ = hp.call("h_balance", b'{"account":"A-1"}')
            assert text == "account A-1 holds 120.00 EUR", text
        finally:
            hp.close()


def test_timed_out_legacy_http_request_is_cancelled_at_the_server(tmp_path):
    """93356a0: when a request to a legacy HTTP server timed out, the client dropped it
    without telling the server, which does not read a dropped stream as a cancellation
    (mcp-protocol.md 4), so the payment could still complete later. On its deadline the
    client sends notifications/cancelled naming the request (mcp.md 4.5)."""
    with MCPHTTPServer(mode="json", era="legacy", ledger=str(tmp_path / "ledger")) as srv:
        cfg = _tiny_config(tmp_path, srv.url, {})

        async def body():
            conn = await ap.open_upstream(cfg.servers[0], time.monotonic() + 5)
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await conn.call_tool("pay", b'{"to":"bob","amount":1,"mode":"block"}', 0.5)
                await eventually_async(lambda: any(
                    r.rpc_method == "notifications/cancelled" for r in list(srv.requests)),
                    5, "notifications/cancelled at the server")
            finally:
                await conn.close()
        asyncio.run(asyncio.wait_for(body(), 20))
        calls = [r.message for r in srv.requests if r.rpc_method == "tools/call"]
        cancels = [r.message for r in srv.requests if r.rpc_method == "notifications/cancelled"]
    assert len(calls) == 1 and cancels, [r.rpc_method for r in srv.requests]
    assert cancels[0]["params"]["requestId"] == calls[0]["id"]


SILENT_SERVER = r'''
import json, sys
for line in sys.stdin:
    with open(sys.argv[1], "a") as f:
        f.write(line)
    msg = json.loads(line)
    if "id" not in msg or msg.get("method") == "tools/call":
        continue                                    # a call is never answered
    if msg["method"] == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
               "serverInfo": {"name": "silent", "version": "1"}}
    elif msg["method"] == "tools/list":
        res = {"tools": [{"name": "pay", "description": "pays",
                          "inputSchema": {"type": "object"}}]}
    else:
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"],
                          "error": {"code": -32601, "message": "no such method"}}), flush=True)
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": res}), flush=True)
'''


def test_call_timed_out_through_the_proxy_is_cancelled_at_the_server(tmp_path):
    """93356a0 (as the proxy uses it): a payment the gate runs under a 1 s rule timeout, on a
    server that never answers, must be cancelled at the server with notifications/cancelled
    naming the request, not only reported as an unknown outcome."""
    script, log = tmp_path / "silent.py", str(tmp_path / "received.log")
    script.write_text(SILENT_SERVER)
    hp = HttpProxy(tmp_path, None, {"pay": {"side_effect": "remote_mutation", "timeout": "1s",
                                            "outcome": "allow"}},
                   server={"command": [PYTHON, str(script), log]})
    try:
        text, _ = hp.call("h_pay", b'{"to":"bob"}')
        assert text.startswith("UNKNOWN_OUTCOME:"), text
        def cancelled() -> bool:
            with open(log) as f:
                return "notifications/cancelled" in f.read()
        hp.run(eventually_async(cancelled, 10, "notifications/cancelled at the server"))
        with open(log) as f:
            received = [json.loads(line) for line in f]
        calls = [m for m in received if m.get("method") == "tools/call"]
        cancels = [m for m in received if m.get("method") == "notifications/cancelled"]
        assert len(calls) == 1 and cancels, [m.get("method") for m in received]
        assert cancels[0]["params"]["requestId"] == calls[0]["id"]
    finally:
        hp.close()


def test_schema_number_past_a_float_fails_the_listing(tmp_path):
    """93356a0: a tool whose input schema held a number beyond a 64-bit float (1e400) was
    pinned; mcp.md 5 has canonicalising such a schema fail the whole listing."""
    srv = TinyMCP(listing=b'{"tools":[{"name":"pay","description":"pays","inputSchema":'
                          b'{"type":"object","properties":{"n":{"maximum":1e400}}}}]}')
    try:
        cfg = _tiny_config(tmp_path, f"http://127.0.0.1:{srv.port}/mcp",
                           {"pay": {"side_effect": "local_mutation", "timeout": "2s"}})
        with pytest.raises(ap.ProxyError, match="1e400"):
            asyncio.run(asyncio.wait_for(ap.pin_server(cfg.servers[0], time.time()), 20))
    finally:
        srv.stop()


def test_structured_content_past_a_float_is_ignored_for_the_text():
    """93356a0: structuredContent holding a number beyond a 64-bit float was handed on, so the
    gate refused it as content it cannot record and the payment was UNRECORDED. mcp.md 8.4:
    structured content that will not encode is ignored and the text stands."""
    obs = _mapped(b'{"content":[{"type":"text","text":"paid"}],"structuredContent":'
                  b'{"x":1e400}}')
    assert obs["kind"] == ap.TOOL_RESULT, obs
    assert obs["content"] == "paid"


def test_bad_bytes_in_a_result_read_as_replacement_characters():
    """93356a0: a byte that is not UTF-8 inside a server's result made the whole result
    "not JSON", a failure without an answer (an unknown outcome). The server answered: the
    bad byte reads as U+FFFD."""
    obs = _mapped(b'{"content":[{"type":"text","text":"paid \xff to bob"}]}')
    assert obs["kind"] == ap.TOOL_RESULT, obs
    assert obs["content"] == "paid \ufffd to bob"


GRANDCHILD_SERVER = r'''
import json, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    if msg["method"] == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
               "serverInfo": {"name": "gc", "version": "1"}}
    elif msg["method"] == "tools/list":
        res = {"tools": [{"name": "look", "description": "reads",
                          "inputSchema": {"type": "object"}}]}
    else:
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"],
                          "error": {"code": -32601, "message": "no such method"}}), flush=True)
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": res}), flush=True)
'''


def test_closing_a_stdio_server_does_not_wait_on_a_descendants_pipes(tmp_path, monkeypatch):
    """93356a0: closing a stdio server waited for its pipes to close, not for the process to
    exit, so a server whose child kept stdout open made every close (pin, shutdown) wait
    out each step's 5 s. Close waits for the server process itself. Each step is given far
    longer than the pin's own deadline here: a close that waits a step out fails it."""
    monkeypatch.setattr(ap, "CLOSE_WAIT", NEVER)
    script, pidfile = tmp_path / "server.py", str(tmp_path / "grandchild.pid")
    script.write_text(GRANDCHILD_SERVER)
    doc = {"database": "runs.db", "session": "t", "hold": "0s",
           "servers": [{"name": "gc", "command": [PYTHON, str(script), pidfile],
                        "manifest": "gc.manifest.json",
                        "rules": {"look": {"side_effect": "read_only", "timeout": "2s"}}}]}
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    cfg = ap.load_config(str(path))
    try:
        asyncio.run(asyncio.wait_for(ap.pin_server(cfg.servers[0], time.time()), PIN_WAIT))
    finally:
        with contextlib.suppress(OSError, ValueError):
            with open(pidfile) as f:
                os.kill(int(f.read()), signal.SIGKILL)


def test_manifest_with_a_bad_pinned_at_is_refused(tmp_path):
    """93356a0: a manifest's pinned_at was never read, so one that is not a time (a hand
    edit, a corrupted file) loaded as if pinned. It must be an RFC 3339 time."""
    srv = TinyMCP()
    try:
        cfg = _tiny_config(tmp_path, f"http://127.0.0.1:{srv.port}/mcp",
                           {"pay": {"side_effect": "local_mutation", "timeout": "2s"}})
        server = cfg.servers[0]
        manifest = asyncio.run(asyncio.wait_for(ap.pin_server(server, time.time()), 20))
        ap.write_manifest(server.manifest, manifest)
        assert ap.read_manifest(server.manifest, "h")          # as pinned: fine
        with open(server.manifest) as f:
            doc = json.load(f)
        doc["pinned_at"] = "yesterday"
        with open(server.manifest, "w") as f:
            json.dump(doc, f)
        with pytest.raises(ap.ConfigError, match="pinned_at"):
            ap.read_manifest(server.manifest, "h")
    finally:
        srv.stop()


def test_null_arguments_are_sent_as_an_empty_object():
    """93356a0: arguments given as JSON null were taken as {} for the checks but sent to the
    server as null; mcp.md 8.1 has null sent as {}."""
    sent: list[bytes] = []

    class Conn:
        async def call_tool(self, remote, args, timeout):
            sent.append(bytes(args))
            return ap.parse_message(b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}')

    spec = ap.ToolSpec("h_look", "", b'{"type":"object"}', "read_only", 5.0)
    tool = ap.UpstreamTool(spec, "h", "look", ap.Rule(side_effect="read_only"), Conn())
    asyncio.run(tool.call(b"null"))
    assert sent == [b"{}"]


def test_json_that_is_not_a_message_gets_invalid_request(tmp_path):
    """93356a0: a host line that is JSON but not an object ([1]) was answered as a parse
    error (-32700); it is valid JSON that is not a request: -32600."""
    h = ProxyHarness(tmp_path)
    try:
        for line in (b"[1]", b"1", b'"x"'):
            h.out.clear()
            h.send(line)
            assert h.out, f"no answer to {line!r}"
            msg = json.loads(h.out[-1])
            assert msg["id"] is None and msg["error"]["code"] == -32600, (line, msg)
    finally:
        h.close()


# == 6f3edf6: float range ==========================================================================

def test_gate_tool_schema_may_hold_a_number_past_a_float(harness):
    """6f3edf6: after 93356a0 the validator refused, as "not JSON", a tool's input schema
    holding a number beyond a 64-bit float (maximum 1e400), so a gate with such a tool could
    not be built. Float range is judged only for servers' pinned schemas and structured
    content; the validator compares numbers exactly."""
    schema = b'{"type":"object","properties":{"n":{"type":"number","maximum":1e400}}}'
    ap.compile_schema(schema).check(b'{"n":5}')
    calls: list = []

    async def look(args):
        calls.append(args)
        return ap.ToolResult(b"{}", "ok")

    gate = ap.Gate(harness.store, [ap.Tool(ap.ToolSpec("look", "reads", schema, "read_only",
                                                       5.0, True), look)],
                   ap.SideEffectPolicy())
    try:
        session, verdict, obs = asyncio.run(gate.call(
            "r-float", "look", LIMITS, ap.Decision("tool_call", "look", b'{"n":5}',
                                                   origin="model")))
        assert verdict.kind == "allowed" and calls == [b'{"n":5}']
    finally:
        gate.close()


# == d891c0c: the rest of what the first review's fix covered =====================================

def test_tool_that_returns_no_tool_result_is_recorded_as_its_failure(harness):
    """Review 1, t2 (d891c0c): an adapter bug, a tool returning a dict instead of a
    ToolResult, raised out of the recording with the step left executing and the lease
    renewed forever. It is recorded as the tool's failure, and the run is let go."""
    calls: list = []

    async def bad(args):
        return {"paid": True}

    gate = ap.Gate(harness.store, _recording_tools(calls, pay_impl=bad,
                                                    pay_effect="local_mutation"),
                   ap.SideEffectPolicy())
    try:
        s = gate.begin("r-bad", "pay", LIMITS)
        s.step()
        assert s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}',
                                     origin="model")).kind == "allowed"
        obs = asyncio.run(s.execute())
        assert obs["kind"] == ap.TOOL_ERROR
        step = harness.store.list_steps("r-bad")[0]
        assert step.status == "failed"
        assert len(calls) == 1
    finally:
        gate.close()


def _command(*argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, err.getvalue()


def test_stdio_server_whose_arguments_reach_the_database_is_refused(tmp_path):
    """d891c0c (reach check): a stdio server started with an argument naming the directory
    that holds the configuration, the manifest and the database could rewrite the policy
    or forge an approval; serving and checking refuse such a configuration (proxy-seed.md,
    "What it is and is not")."""
    path = write_config(str(tmp_path))
    assert _command("pin", "-config", path)[0] == 0
    assert _command("check", "-config", path)[0] == 0
    with open(path) as f:
        doc = json.load(f)
    doc["servers"][0]["command"].append(f"--root={tmp_path}")
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)
    code, err = _command("check", "-config", path)
    assert code != 0 and "reaches" in err, (code, err)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the database to another user")
def test_database_owned_by_another_user_is_refused(tmp_path):
    """d891c0c (database owner check): a database another user owns (who could forge
    approvals in it) was served from; check and serve refuse it."""
    path = write_config(str(tmp_path))
    assert _command("pin", "-config", path)[0] == 0
    assert _command("check", "-config", path)[0] == 0
    os.chown(tmp_path / "runs.db", 65534, 65534)
    code, err = _command("check", "-config", path)
    assert code != 0 and "owned by uid 65534" in err, (code, err)


def test_policy_decisions_record_the_configurations_policy_identity(tmp_path):
    """d891c0c (policy identity): the proxy's decisions recorded no identity of the policy
    that made them. Each records agentrt-proxy/sha256:<hex> of what the policy decides from
    (proxy-seed.md, "The policy's identity"): a rule's timeout leaves it unchanged, a rule's
    side effect changes it."""
    h = ProxyHarness(tmp_path)
    try:
        h.call("bank_balance", {"account": "A-1"})
        run = h.runs()[-1]
        policy = [json.loads(e[5]) for e in h.store.list_events(run.id)
                  if e[4] == "step.policy"]
    finally:
        h.close()
    assert policy and all(re.fullmatch(r"agentrt-proxy/sha256:[0-9a-f]{64}",
                                       p.get("policy_id", "")) for p in policy), policy
    recorded = policy[0]["policy_id"]

    def identity(change):
        rules = json.loads(json.dumps(DEFAULT_RULES))
        change(rules)
        sub = tmp_path / f"v{len(os.listdir(tmp_path))}"
        sub.mkdir()
        return ap.load_config(write_config(str(sub), rules)).policy_id()

    assert identity(lambda r: None) == recorded
    assert identity(lambda r: r["pay"].update(timeout="99s")) == recorded
    assert identity(lambda r: r["pay"].update(side_effect="destructive")) != recorded


# == 6e5e37a: the rest of what the second review's fix covered ===================================

def test_modern_request_without_client_capabilities_is_invalid_params(tmp_path):
    """Review 2, m_proto.py (6e5e37a): a 2026-07-28 request whose _meta named the protocol
    version but lacked io.modelcontextprotocol/clientCapabilities was served; that field is
    required, and its absence gets -32602 (mcp-protocol.md 5)."""
    h = ProxyHarness(tmp_path)
    try:
        msg = h.request("tools/list", {"_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28"}}, timeout=10)
        assert "error" in msg and msg["error"]["code"] == -32602, msg
    finally:
        h.close()


def test_log_lines_are_sanitised():
    """6e5e37a: text in the proxy's log lines (server names, errors a server wrote) reached
    the operator's terminal raw, escape sequences and line breaks included (mcp.md 9.5)."""
    out, err = io.StringIO(), io.StringIO()
    ap.Out(out, err).log('server "x\x1b]0;pwned\x07": error: a\nagentrt-proxy: forged line')
    text = err.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert text.count("\n") == 1 and text.endswith("\n"), repr(text)
