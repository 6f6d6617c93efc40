"""The upstream client against hostile servers: envelope numbers that are costly to convert,
HTTP servers that trickle, answers that belong to another request.

Servers are started here on 127.0.0.1 and stopped at the end of each test: a raw-socket
server that sends the start of an answer and then one byte at a time without ever ending the
line, a small http.server that answers each POST as a test says, and stdio servers written
to tmp_path. The upstream classes are driven directly, on a fresh event loop per test.
"""

import asyncio
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ap

DRIP_INTERVAL = 0.1       # seconds between the bytes a trickling server sends
# A trickling connection never ends while a test runs (each test's loop has a deadline of
# its own, so old code fails rather than hangs): a call that returned was ended by its own
# deadline or by close(), however slow the machine.
TRICKLE_CAP = 600.0
POLL = 0.05               # how often server threads look at their stop flag
WAIT = 5.0                # bound on waiting for a server to see a request
NEVER = 600.0             # a call's timeout that no test waits for
# The default executor's size on this machine: the number of trickling calls that filled
# it, and starved every other server, before each server had workers of its own.
DEFAULT_WORKERS = min(32, (os.cpu_count() or 1) + 4)

_HEAD = b"HTTP/1.1 200 OK\r\n"
# Where the line that never ends sits: the status line, a header, a JSON body's chunk size
# (http.client reads it with readline), an SSE data line.
NEVER_ENDING = {
    "status": (b"HTTP/1.1 200 O", b"K"),
    "header": (_HEAD + b"X-Slow: ", b"a"),
    "chunk": (_HEAD + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
              b"\r\n", b"0"),
    "sse": (_HEAD + b"Content-Type: text/event-stream\r\n\r\ndata: ", b" "),
}


def arun(coro, timeout=60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate, timeout=WAIT):
    """Wait for an observable condition, under a deadline."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "the condition never came true"
        await asyncio.sleep(0.01)


async def outcome_of(coro, conn=None):
    """(the exception or result, and, for an HttpUpstream conn, how many cancellations it
    was still sending to the server at that moment)."""
    try:
        out = await coro
    except Exception as exc:          # the outcome under test
        out = exc
    return out, len(conn._notices) if conn is not None else 0


def call(conn, timeout):
    return conn.request("tools/call", {"name": "pay", "arguments": {}}, timeout, tool="pay")


class TrickleServer:
    """Reads each request, sends ``head`` at once, then ``drip`` every DRIP_INTERVAL until
    the client goes, the server stops, or TRICKLE_CAP passes. ``requests`` counts the
    requests it has read whole."""

    def __init__(self, head: bytes, drip: bytes):
        self.head, self.drip = head, drip
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests = 0
        self.threads = [threading.Thread(target=self._accept, daemon=True)]

    def __enter__(self):
        self.threads[0].start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.sock.close()
        for t in list(self.threads):
            t.join(WAIT)

    def _accept(self):
        self.sock.settimeout(POLL)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _read_request(self, conn) -> bool:
        buf = b""
        while b"\r\n\r\n" not in buf or len(buf) < self._length(buf):
            if self.stop.is_set():
                return False
            try:
                chunk = conn.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                return False
            buf += chunk
        return True

    @staticmethod
    def _length(buf: bytes) -> int:
        head, _, _ = buf.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                return len(head) + 4 + int(value)
        return len(head) + 4

    def _serve(self, conn):
        with conn:
            conn.settimeout(POLL)
            if not self._read_request(conn):
                return
            with self.lock:
                self.requests += 1
            end = time.monotonic() + TRICKLE_CAP
            try:
                conn.sendall(self.head)
                while not self.stop.wait(DRIP_INTERVAL) and time.monotonic() < end:
                    conn.sendall(self.drip)
            except OSError:            # the client went away
                return


class AnswerServer:
    """Answers each POST with ``answer(request_id) -> (status, body)``; a notification gets
    202. Keeps connections alive (HTTP/1.1)."""

    def __init__(self, answer):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                msg = json.loads(body)
                if "id" not in msg:
                    status, out = 202, b""
                else:
                    status, out = outer.answer(msg["id"])
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.answer = answer
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/mcp"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(POLL,),
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(WAIT)


def right_answer(ident):
    return 200, json.dumps({"jsonrpc": "2.0", "id": ident, "result": {"ok": True}}).encode()


# ==== envelope numbers ========================================================================

BOMB = "1e20000000"

STDIO_SERVER = r'''
import json, sys
BOMB = "1e20000000"
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    ident, method = msg["id"], msg["method"]
    lines = []
    if method == "tools/list":
        # Answers that are no answer to this request: only the plain digits match.
        for wrong in (BOMB, "%d.0" % ident, "%de0" % ident, '"%d"' % ident, "-%d" % ident):
            lines.append('{"jsonrpc":"2.0","id":%s,"result":{"which":"wrong"}}' % wrong)
        lines.append('{"jsonrpc":"2.0","id":%d,"result":{"which":"right"}}' % ident)
    else:
        code = {"code/bomb": BOMB, "code/long": "7" * 5000, "code/fraction": "-32001.0",
                "code/plain": "-32001"}[method]
        lines.append('{"jsonrpc":"2.0","id":%d,"error":{"code":%s,"message":"no"}}'
                     % (ident, code))
    sys.stdout.write("".join(l + "\n" for l in lines))
    sys.stdout.flush()
'''


def test_upstream_exponent_bomb_id_is_no_match(tmp_path, exact_numbers):
    """No number of the envelope is converted exactly (1e20000000 as an integer freezes the
    event loop for minutes): exact_numbers counts every such conversion, and fails it."""
    script = tmp_path / "bomb_server.py"
    script.write_text(STDIO_SERVER)

    async def body():
        conn = ap.StdioUpstream("bomb", [sys.executable, str(script)], ap.child_env((), ()))
        await conn.start()
        try:
            reply = await conn.request("tools/list", {}, 5.0)
            codes = {}
            for method in ("code/bomb", "code/long", "code/fraction", "code/plain"):
                with pytest.raises(ap.ProtocolError) as info:
                    await conn.request(method, {}, 5.0)
                codes[method] = info.value.code
        finally:
            await conn.close()
        return json.loads(reply.raw("result")), codes
    result, codes = arun(body())
    assert exact_numbers == []
    assert result == {"which": "right"}      # 1e20000000, 1.0, 1e0, "1", -1: none is id 1
    assert codes == {"code/bomb": ap.INTERNAL_ERROR, "code/long": ap.INTERNAL_ERROR,
                     "code/fraction": ap.INTERNAL_ERROR, "code/plain": -32001}


# ==== HTTP deadlines and workers ==============================================================

def test_http_trickle_does_not_starve_other_servers():
    deadline = 2.0
    with TrickleServer(*NEVER_ENDING["status"]) as slow, AnswerServer(right_answer) as ok:
        async def body():
            slow_conn = ap.HttpUpstream("slow", slow.url)
            ok_conn = ap.HttpUpstream("ok", ok.url)
            try:
                stuck = [asyncio.create_task(outcome_of(call(slow_conn, deadline)))
                         for _ in range(DEFAULT_WORKERS)]
                await until(lambda: slow.requests >= min(DEFAULT_WORKERS, ap.HTTP_CONCURRENCY))
                for _ in range(3):
                    reply = await call(ok_conn, 1.0)
                    assert json.loads(reply.raw("result")) == {"ok": True}
                return await asyncio.gather(*stuck)
            finally:
                await slow_conn.close()
                await ok_conn.close()
        outcomes = arun(body())
    sent = [o for o, _ in outcomes if not isinstance(o, ap.NotSent)]
    assert len(sent) == min(DEFAULT_WORKERS, ap.HTTP_CONCURRENCY)
    for outcome, _ in outcomes:
        # Sent: timed out, outcome unknown. Still queued for a worker: never sent.
        assert isinstance(outcome, (asyncio.TimeoutError, ap.NotSent)), outcome
    assert all(isinstance(o, asyncio.TimeoutError) for o in sent)


@pytest.mark.parametrize("where", sorted(NEVER_ENDING))
def test_http_deadline_inside_a_line(where):
    """The line never ends: the call ends at its own deadline, never early, and the
    caller has its timeout before the server is told (the cancellation is still being sent:
    a legacy server's slow answer to it does not hold the caller)."""
    deadline = 1.0
    with TrickleServer(*NEVER_ENDING[where]) as slow:
        async def body():
            conn = ap.HttpUpstream("slow", slow.url)
            try:
                began = time.monotonic()
                outcome, cancelling = await outcome_of(call(conn, deadline), conn)
                return outcome, time.monotonic() - began, cancelling
            finally:
                await conn.close()
        outcome, took, cancelling = arun(body())
    assert isinstance(outcome, asyncio.TimeoutError), outcome
    assert took >= deadline - DRIP_INTERVAL, took          # a deadline never comes early
    assert cancelling == 1, "the caller's timeout waited for the server to be told"


def test_http_queued_request_is_not_sent():
    with TrickleServer(*NEVER_ENDING["sse"]) as slow:
        async def body():
            conn = ap.HttpUpstream("slow", slow.url)
            try:
                busy = [asyncio.create_task(outcome_of(call(conn, NEVER)))
                        for _ in range(ap.HTTP_CONCURRENCY)]
                await until(lambda: slow.requests == ap.HTTP_CONCURRENCY)
                extra, _ = await outcome_of(call(conn, 0.5))
                seen, freed = slow.requests, sum(b.done() for b in busy)
            finally:
                await conn.close()
            await asyncio.gather(*busy)
            return extra, seen, freed
        outcome, seen, freed = arun(body())
    assert isinstance(outcome, ap.NotSent), outcome
    assert freed == 0                   # at its own deadline: no worker had been freed for it
    assert seen == ap.HTTP_CONCURRENCY          # the extra request never reached the server


def test_http_close_is_bounded():
    with TrickleServer(*NEVER_ENDING["status"]) as slow:
        async def body():
            conn = ap.HttpUpstream("slow", slow.url)
            conn.session_id = "s-1"        # a legacy session: close() also sends DELETE
            calls = [asyncio.create_task(outcome_of(call(conn, NEVER)))
                     for _ in range(ap.HTTP_CONCURRENCY + 2)]
            await until(lambda: slow.requests >= ap.HTTP_CONCURRENCY)
            await conn.close()          # its DELETE trickles too: the loop's deadline bounds it
            _, pending = await asyncio.wait(calls, timeout=WAIT)
            after = await outcome_of(call(conn, 5.0))
            return pending, [c.result() for c in calls if c.done()], after
        pending, outcomes, after = arun(body())
    assert not pending, f"{len(pending)} calls still running {WAIT} s after close()"
    kinds = sorted(type(o).__name__ for o, _ in outcomes)
    # In flight: sent, so their outcome is unknown. Still queued: never sent.
    assert kinds == ["NotSent"] * 2 + ["UpstreamError"] * ap.HTTP_CONCURRENCY, kinds
    assert isinstance(after[0], ap.NotSent)


# ==== answers are matched by id ===============================================================

WRONG_ANSWERS = {
    "another id": lambda i: (200, b'{"jsonrpc":"2.0","id":%d,"result":{}}' % (i + 1)),
    "no id": lambda i: (200, b'{"jsonrpc":"2.0","result":{}}'),
    "null id": lambda i: (200, b'{"jsonrpc":"2.0","id":null,"result":{}}'),
    "the id as a string": lambda i: (200, b'{"jsonrpc":"2.0","id":"%d","result":{}}' % i),
    "the id as 1.0": lambda i: (200, b'{"jsonrpc":"2.0","id":%d.0,"result":{}}' % i),
    "an error with another id, 500": lambda i: (
        500, b'{"jsonrpc":"2.0","id":%d,"error":{"code":-32000,"message":"no"}}' % (i + 7)),
    "an error with no id, 400": lambda i: (
        400, b'{"jsonrpc":"2.0","error":{"code":-32000,"message":"no"}}'),
}


@pytest.mark.parametrize("case", sorted(WRONG_ANSWERS))
def test_http_answer_id_must_match(case):
    with AnswerServer(WRONG_ANSWERS[case]) as srv:
        async def body():
            conn = ap.HttpUpstream("srv", srv.url)
            try:
                return await outcome_of(call(conn, 2.0))
            finally:
                await conn.close()
        outcome, _ = arun(body())
    assert isinstance(outcome, ap.UpstreamError), outcome
    assert not isinstance(outcome, ap.NotSent)       # it was sent: the outcome is unknown
    assert "id" in str(outcome)


def test_http_answer_with_the_right_id_is_taken():
    answers = iter([right_answer,
                    lambda i: (500, b'{"jsonrpc":"2.0","id":%d,"error":{"code":-32001,'
                                    b'"message":"declined"}}' % i)])
    current = {"answer": next(answers)}
    with AnswerServer(lambda i: current["answer"](i)) as srv:
        async def body():
            conn = ap.HttpUpstream("srv", srv.url)
            try:
                reply = await call(conn, 2.0)
                current["answer"] = next(answers)
                with pytest.raises(ap.ProtocolError) as info:
                    await call(conn, 2.0)
                return reply, info.value
            finally:
                await conn.close()
        reply, err = arun(body())
    assert json.loads(reply.raw("result")) == {"ok": True}
    assert (err.code, str(err)) == (-32001, "declined")


# ---- The streamable-HTTP client in both eras, against tests/mcp_http_server.py --------------

import http.server  # noqa: E402

from mcp_http_server import MCPHTTPServer, TinyMCP  # noqa: E402
from process_helpers import eventually_async  # noqa: E402
from proxy_harness import HttpProxy, one_server_config  # noqa: E402
from scripted_server import BANK_RULES, CANCEL_WAIT, MIB16, loaded, pin, rule  # noqa: E402


def http_server(**kw):
    return ap.ServerConfig(name="bank", endpoint=kw.pop("url"), connect_timeout=5.0,
                           default_timeout=5.0, **kw)


@pytest.mark.parametrize("mode", ["json", "sse"])
def test_pin_oversized_http_response_fails(mode):
    with MCPHTTPServer(mode=mode, era="legacy", huge_body=MIB16 + 100) as srv:
        server = http_server(url=srv.url, manifest="/nonexistent/never-written.json")
        with pytest.raises(ap.MCPError) as info:
            arun(ap.pin_server(server, time.time()))
    msg = str(info.value)
    assert "list tools" in msg
    assert "exceeds 16777216" in msg
    if mode == "sse":                        # no Content-Length: the read itself fails
        assert "exceeds 16777216 bytes" in msg


def test_http_body_at_the_limit_is_read_whole():
    with MCPHTTPServer(mode="json", era="legacy", huge_body=MIB16) as srv:
        manifest = arun(ap.pin_server(http_server(url=srv.url, manifest=""), time.time()))
    assert sorted(manifest["tools"]) == ["balance", "pay", "refund"]


@pytest.mark.parametrize("mode", ["json", "sse"])
def test_upstream_http_legacy_sessions_and_delete(tmp_path, mode):
    with MCPHTTPServer(mode=mode, era="legacy", ledger=str(tmp_path / "ledger"),
                       ping_comment=(mode == "sse")) as srv:
        server = http_server(url=srv.url, manifest=str(tmp_path / "bank.manifest.json"),
                             rules=tuple((k, rule(**v)) for k, v in sorted(BANK_RULES.items())))

        async def body():
            pinned = await pin(server)
            pin_requests = list(srv.requests)
            async with loaded(server, pinned) as (tools, _):
                assert not tools["bank_balance"].conn.modern
                r = await tools["bank_balance"].call(b'{"account":"A-1"}')
                assert json.loads(r.content) == "account A-1 holds 120.00 EUR"
                r = await tools["bank_pay"].call(
                    b'{"to":"jo","amount":9007199254740993,"mode":"structured"}')
                assert r.content == b'{"paid":9007199254740993,"to":"jo"}'
            return pin_requests
        pin_requests = arun(body())
        requests = list(srv.requests)

    methods = [r.rpc_method or r.method for r in pin_requests]
    # The era probe comes first, then the legacy handshake; DELETE ends the session.
    assert methods[:4] == ["server/discover", "initialize", "notifications/initialized",
                           "tools/list"]
    assert methods[-1] == "DELETE"
    # One connection per probe: the pin's and the load's, each with its own session.
    starts = [i for i, r in enumerate(requests) if r.rpc_method == "server/discover"]
    assert len(starts) == 2
    sessions = []
    for begin, end in zip(starts, starts[1:] + [len(requests)]):
        conn = requests[begin:end]
        init = [r.rpc_method for r in conn].index("initialize")
        assert all("mcp-session-id" not in r.headers for r in conn[:init + 1])
        sid = {r.headers.get("mcp-session-id") for r in conn[init + 1:]}
        assert len(sid) == 1 and None not in sid, sid
        sessions += sid
        for r in conn[init + 1:]:
            if r.method == "POST":
                assert r.headers.get("mcp-protocol-version") == "2025-11-25"
                assert "mcp-method" not in r.headers
        assert conn[-1].method == "DELETE"
        assert [r.method for r in conn].count("DELETE") == 1
    assert sessions[0] != sessions[1]
    assert not any(r.method == "GET" for r in requests)      # no standalone stream
    for r in requests:
        if r.method == "POST":
            assert r.headers["accept"] == "application/json, text/event-stream"
            assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_upstream_http_sse_priming_event_is_skipped(era):
    with MCPHTTPServer(mode="sse", era=era, priming=True) as srv:
        manifest = arun(ap.pin_server(http_server(url=srv.url, manifest=""), time.time()))
    assert sorted(manifest["tools"]) == ["balance", "pay", "refund"]


def test_upstream_http_legacy_without_sessions_sends_no_delete(tmp_path):
    with MCPHTTPServer(mode="json", era="legacy", session=False) as srv:
        server = http_server(url=srv.url, manifest="")
        manifest = arun(ap.pin_server(server, time.time()))
        assert len(manifest["tools"]) == 3
        assert not any(r.method == "DELETE" for r in srv.requests)
        assert not any("mcp-session-id" in r.headers for r in srv.requests)
        assert "initialize" in srv.rpc_methods()


@pytest.mark.parametrize("mode", ["json", "sse"])
def test_upstream_http_modern_headers(tmp_path, mode):
    with MCPHTTPServer(mode=mode, era="modern", ledger=str(tmp_path / "ledger"),
                       ping_comment=(mode == "sse")) as srv:
        server = http_server(url=srv.url, manifest=str(tmp_path / "bank.manifest.json"),
                             rules=tuple((k, rule(**v)) for k, v in sorted(BANK_RULES.items())))

        async def body():
            pinned = await pin(server)
            async with loaded(server, pinned) as (tools, _):
                assert tools["bank_pay"].conn.modern
                r = await tools["bank_pay"].call(b'{"to":"bob","amount":25}')
                assert json.loads(r.content) == "paid 25.00 to bob"
                with pytest.raises(ap.ToolFailure, match="card declined for jo"):
                    await tools["bank_pay"].call(b'{"to":"jo","amount":1,"mode":"error"}')
        arun(body())
        requests = list(srv.requests)
    assert [r.method for r in requests] == ["POST"] * len(requests)   # no DELETE, no GET
    methods = [r.rpc_method for r in requests]
    assert "initialize" not in methods
    assert methods[:2] == ["server/discover", "tools/list"]
    assert methods.count("tools/call") == 2
    for r in requests:
        msg = r.message
        assert r.headers.get("mcp-protocol-version") == "2026-07-28"
        assert r.headers.get("mcp-method") == msg["method"]
        assert "mcp-session-id" not in r.headers
        assert msg["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] == "2026-07-28"
        if msg["method"] == "tools/call":
            assert r.headers.get("mcp-name") == "pay"
        else:
            assert "mcp-name" not in r.headers
    with open(tmp_path / "ledger") as f:
        assert len(f.readlines()) == 2


def test_upstream_http_session_gone_is_a_dropped_connection(tmp_path):
    with MCPHTTPServer(mode="json", era="legacy") as srv:
        server = http_server(url=srv.url, manifest=str(tmp_path / "bank.manifest.json"),
                             rules=(("balance", rule(side_effect="read_only", timeout="5s")),))

        async def body():
            pinned = await pin(server)
            async with loaded(server, pinned) as (tools, _):
                with srv.lock:
                    srv.sessions.clear()          # the server forgets the session
                for _ in range(2):
                    with pytest.raises(ap.ToolFailure) as info:     # not the rule's timeout
                        await tools["bank_balance"].call(b'{"account":"A-1"}')
                    assert '"bank"' in str(info.value)
                assert tools["bank_balance"].conn.closed
            return len(srv.requests)
        before_close = arun(body())
        calls = [r for r in srv.requests if r.rpc_method == "tools/call"]
    assert len(calls) == 1                # no reconnect, no second attempt
    # The session is gone: no DELETE for it.
    assert [r.method for r in srv.requests[before_close - 1:]].count("DELETE") == 0


def test_upstream_http_legacy_timeout_sends_cancelled(tmp_path):
    with MCPHTTPServer(mode="json", era="legacy") as srv:
        server = http_server(url=srv.url, manifest="")

        async def body():
            conn, _, _ = await ap.open_upstream(server)
            try:
                # block: the server answers only once the call is cancelled
                with pytest.raises(asyncio.TimeoutError):
                    await conn.call_tool("pay", b'{"to":"a","amount":1,"mode":"block"}', 0.3)
                await eventually_async(lambda: any(
                    r.rpc_method == "notifications/cancelled" for r in list(srv.requests)),
                    5, "notifications/cancelled at the server")
            finally:
                await conn.close()
        arun(body())
        call = [r for r in srv.requests if r.rpc_method == "tools/call"][0]
        cancels = [r.message for r in srv.requests
                   if r.rpc_method == "notifications/cancelled"]
    assert cancels and cancels[0]["params"]["requestId"] == call.message["id"]


def test_upstream_http_modern_timeout_closes_the_stream(tmp_path):
    with MCPHTTPServer(mode="sse", era="modern") as srv:
        server = http_server(url=srv.url, manifest="")

        async def body():
            conn, _, _ = await ap.open_upstream(server)
            try:
                # block: the server's call ends only when it is cancelled
                with pytest.raises(asyncio.TimeoutError):
                    await conn.call_tool("pay", b'{"to":"a","amount":1,"mode":"block"}', 0.3)
                # Closing the stream is the cancellation: the blocked call ends.
                end = time.monotonic() + CANCEL_WAIT
                while srv.inflight and time.monotonic() < end:
                    await asyncio.sleep(0.02)
                assert not srv.inflight
            finally:
                await conn.close()
        arun(body())
        assert "notifications/cancelled" not in srv.rpc_methods()


def test_http_redirect_is_not_followed():
    with MCPHTTPServer(mode="json", era="legacy") as target:
        with MCPHTTPServer(mode="json", era="legacy", redirect_to=target.url) as srv:
            with pytest.raises(ap.MCPError) as info:
                arun(ap.pin_server(http_server(url=srv.url, manifest=""), time.time()))
            assert srv.requests, "the redirecting server was never asked"
        assert target.requests == [], "the redirect was followed"
    assert "connect" in str(info.value) and "redirect" in str(info.value)


# ---- The HTTP client, faults found in review -------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

GONE_WAIT = 30.0        # for a stream the proxy gave up on to be closed: generous, never timed
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
        cfg = one_server_config(tmp_path, srv.url, {})

        async def body():
            conn, _, _ = await ap.open_upstream(cfg.servers[0])
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


class KeptAliveSSE(http.server.BaseHTTPRequestHandler):
    """A legacy server that answers tools/call as an event stream over a kept-alive,
    chunked connection, as common web frameworks do. It counts what it paid."""
    protocol_version = "HTTP/1.1"
    paid: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        msg = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if "id" not in msg:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        method = msg["method"]
        if method == "initialize":
            res = {"result": {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                              "serverInfo": {"name": "s", "version": "1"}}}
        elif method == "tools/list":
            res = {"result": {"tools": [{"name": "pay", "description": "pays",
                                         "inputSchema": {"type": "object"}}]}}
        elif method == "tools/call":
            self.paid.append(msg["params"]["arguments"])
            res = {"result": {"content": [{"type": "text", "text": "paid"}]}}
        else:
            res = {"error": {"code": -32601, "message": "no such method"}}
        doc = json.dumps({"jsonrpc": "2.0", "id": msg["id"], **res}).encode()
        if method != "tools/call":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(doc)))
            self.end_headers()
            self.wfile.write(doc)
            return
        event = b"event: message\ndata: " + doc + b"\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
        self.wfile.flush()


def test_event_stream_connections_are_not_reused_for_the_next_call(tmp_path):
    """The last review's finding, shown by its reproduction before the fix: an event stream's
    connection reused. A legacy server answers tools/call as an event stream over a kept-alive,
    chunked connection, as common web frameworks do: each of three payments is answered, none
    unknown, each paid once."""
    KeptAliveSSE.paid = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeptAliveSSE)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = HttpProxy(str(tmp_path), f"http://127.0.0.1:{server.server_address[1]}/mcp",
                      {"pay": {"side_effect": "remote_mutation", "timeout": "5s",
                               "outcome": "allow"}})
    try:
        answers = [proxy.call("h_pay", json.dumps({"to": to}).encode())[0]
                   for to in ("bob", "carol", "dave")]
    finally:
        proxy.close()
        server.shutdown()
    assert answers == ["paid", "paid", "paid"]        # each one answered, none unknown
    assert [p["to"] for p in KeptAliveSSE.paid] == ["bob", "carol", "dave"]


def test_a_name_that_is_not_plain_ascii_is_sent_encoded_in_the_header():
    """The last review's finding, shown by its reproduction before the fix: a header the modern
    transport must encode: a tool name that is not plain ASCII."""
    assert ap._header_value("pay") == "pay"
    encoded = ap._header_value("pagar-€")
    assert encoded.startswith("=?base64?") and encoded.endswith("?=")
    assert "\n" not in ap._header_value("a\nb")


# A server that refuses the connection was sent nothing: the request is NotSent (a known
# outcome), named as a failed connect, whatever the request.

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_is_not_sent():
    async def body():
        conn = ap.HttpUpstream("refusing", f"http://127.0.0.1:{closed_port()}/mcp")
        try:
            await conn._post(ap.rpc_request(1, "tools/list", {}), "tools/list", 2.0, 1)
        except ap.ProxyError as exc:
            return exc
        finally:
            await conn.close()
    outcome = asyncio.run(body())
    assert isinstance(outcome, ap.NotSent), outcome
    assert "cannot connect to the server" in str(outcome), outcome
