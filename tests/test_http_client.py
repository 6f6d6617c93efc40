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
