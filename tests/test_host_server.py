"""The host-facing server (reference/mcp.md, the host side): both protocol eras, ping,
unknown methods and tools, the listing the host is offered, lines that are not requests,
and lines that come while calls are in flight. In-process (tests/proxy_harness.py), with the
fake payment server behind the proxy; every wait has a deadline.

The host's pipes: read by a thread and written by a thread, so that the event loop never
waits on the host, with every line whole and in order.

- LineReader on a pipe and on a stream without a descriptor cuts the same lines: a long line
  cut at MAX_FRAME and the rest of it skipped, a last line without its line end, and EOF.
- Either way the host's input is read ahead by a bounded amount while nothing is taken.
- LineWriter writes messages of every size in the order written, without blocking its
  caller.
- A write to a host that is gone calls ``gone`` and drops what follows.
- A read that waits for the host does not block the loop; a pipe filled by another writer,
  or a socket whose send buffer has no room for an
  answer, does not block it either, and the answer still arrives whole and in order.
- A flood of empty lines is read ahead by a bounded amount too (each line counts
  READ_AHEAD_LINE_COST beyond its bytes).

Requests that come while the servers load wait in order, bounded in number and in bytes; a
cancelled one is dropped.
"""

import asyncio
import contextlib
import json
import os
import threading
import time

import pytest

from proxy_harness import ProxyHarness, ap
from scripted_server import BANK_RULES


# ==== the host side: both eras =================================================================

@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = ProxyHarness(tmp_path_factory.mktemp("host"))
    yield h
    h.close()


META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "1"}}


def test_host_modern_era(host):
    r = host.request("server/discover", {"_meta": META})
    res = r["result"]
    assert "2026-07-28" in res["supportedVersions"]
    assert res["resultType"] == "complete"
    assert "tools" in res["capabilities"]
    assert "agentrt" not in json.dumps(res).lower()
    r = host.request("tools/list", {"_meta": META})["result"]
    assert r["resultType"] == "complete" and "ttlMs" in r and "cacheScope" in r
    assert [t["name"] for t in r["tools"]] == ["bank_balance", "bank_pay", "bank_refund",
                                              "gate_status"]
    r = host.request("tools/call", {"name": "bank_balance", "arguments": {"account": "A-9"},
                                    "_meta": META})["result"]
    assert r["resultType"] == "complete" and r["isError"] is False
    assert r["content"][0]["text"] == "account A-9 holds 120.00 EUR"
    # ping is gone from the 2026-07-28 era.
    assert host.request("ping", {"_meta": META})["error"]["code"] == -32601
    for version in ("2099-01-01", "2025-06-18"):
        err = host.request("tools/list", {"_meta": {**META,
                           "io.modelcontextprotocol/protocolVersion": version}})["error"]
        assert err["code"] == -32022
        assert "2026-07-28" in err["data"]["supported"]
        assert err["data"]["requested"] == version


@pytest.mark.parametrize("asked,answered", [
    ("2024-11-05", "2024-11-05"), ("2025-03-26", "2025-03-26"),
    ("2025-06-18", "2025-06-18"), ("2025-11-25", "2025-11-25"),
    ("2026-07-28", "2025-11-25"), ("1999-01-01", "2025-11-25")])
def test_host_legacy_initialize_each_version(host, asked, answered):
    r = host.request("initialize", {"protocolVersion": asked, "capabilities": {},
                                    "clientInfo": {"name": "host", "version": "1"}})["result"]
    assert r["protocolVersion"] == answered
    assert "tools" in r["capabilities"]
    assert "agentrt" not in r["serverInfo"]["name"].lower()
    assert "agentrt" not in json.dumps(r).lower()
    host.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
    r = host.request("tools/list", {})["result"]
    assert "resultType" not in r
    assert r["tools"][-1]["name"] == "gate_status"


def test_host_ping_unknown_method_and_unknown_tool(host):
    assert host.request("ping")["result"] == {}
    err = host.request("resources/list", {})["error"]
    assert err["code"] == -32601
    err = host.request("tools/call", {"name": "nope", "arguments": {}})["error"]
    assert err["code"] == -32602 and "nope" in err["message"]


def test_host_tools_list_has_no_output_schema(host):
    tools = host.request("tools/list", {})["result"]["tools"]
    for t in tools:
        assert "outputSchema" not in t
        # annotations from the operator's class (DESIGN 4), never the server's hints
        assert t["annotations"] in list(ap.CLASS_ANNOTATIONS.values()), t
        assert t["inputSchema"]["type"] == "object"
        assert "agentrt" not in json.dumps(t).lower()


def test_host_garbage_lines_get_parse_errors_and_serving_goes_on(host):
    garbage = [b"this is not json", b"{\"jsonrpc\":", b"\xff\xfe\x00garbage", b"{]",
               b'{"jsonrpc":"2.0","id":1,"method":"ping"} trailing']
    for line in garbage:
        before = len(host.out)
        host.send(line)
        answers = [json.loads(a) for a in host.out[before:]]
        assert len(answers) == 1, (line, answers)
        assert answers[0]["id"] is None and answers[0]["error"]["code"] == -32700
    # Valid JSON that is not a request object: answered with an error, never a crash.
    for line in (b"[]", b"42", b'"text"'):
        before = len(host.out)
        host.send(line)
        answers = [json.loads(a) for a in host.out[before:]]
        assert len(answers) == 1 and "error" in answers[0] and answers[0]["id"] is None
    r = host.call("bank_balance", {"account": "A-1"})
    assert host.text(r) == "account A-1 holds 120.00 EUR"


def test_host_garbage_between_calls_in_flight(harnesses):
    """Garbage lines while a call is held upstream: each gets its parse error, the call
    still answers, and its run is recorded."""
    rules = {**json.loads(json.dumps(BANK_RULES)),
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
    h = harnesses(rules=rules)
    ident = h.request("tools/call", {"name": "bank_pay",
                                     "arguments": {"to": "kim", "amount": 7, "mode": "slow"}},
                      wait=False)
    for line in (b"garbage", b"\xc3\x28", b"{"):
        h.send(line)
    # Each call is its own task: a read answers while the slow payment is still running.
    r = h.call("bank_balance", {"account": "A-2"})
    assert h.text(r) == "account A-2 holds 120.00 EUR"
    assert ident not in [json.loads(line).get("id") for line in h.out]
    msg = h.answer(ident, timeout=15)
    assert msg["result"]["content"][0]["text"] == "paid 7.00 to kim"
    errors = [json.loads(a) for a in h.out if b'"error"' in a]
    assert [e["error"]["code"] for e in errors] == [-32700] * 3
    assert h.payments() == 1 and h.runs()[0].status == ap.COMPLETED


# ---- The host-facing server, faults found in review ------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

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


def test_a_fault_while_routing_a_message_is_answered_not_fatal(tmp_path, monkeypatch):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    host's input: nothing in a line stops serving. A fault while routing a message is answered
    with an internal error, never fatal."""
    h = ProxyHarness(tmp_path)
    try:
        def broken():
            raise RuntimeError("listing failed")
        monkeypatch.setattr(h.proxy, "listing", broken)
        msg = h.request("tools/list")
        assert msg["error"]["code"] == ap.INTERNAL_ERROR
        monkeypatch.undo()
        assert "tools" in h.request("tools/list")["result"]
    finally:
        h.close()


def test_the_host_input_waits_while_answers_are_not_read(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    host's input waits while answers are not read: room() comes back only once the backlog past
    MAX_OUTPUT_BACKLOG is drained."""
    h = ProxyHarness(tmp_path)
    backlog = [ap.MAX_OUTPUT_BACKLOG + 1]
    try:
        async def drain_later():
            await ap.asyncio.sleep(0.2)
            backlog[0] = 0
        async def scenario():
            drainer = ap.asyncio.ensure_future(drain_later())
            await h.host.room(lambda: backlog[0])
            drained = drainer.done()            # room() came back only once it was drained
            await drainer
            return drained
        assert h.run(scenario())
    finally:
        h.close()


def test_a_large_call_does_not_stop_the_proxy_answering(tmp_path):
    """The hardened proxy's review, finding 3: one host message of under 1 MB (an array of small
    values) keeps the event loop busy for seconds: the arguments are parsed about seven times,
    at microseconds a value, before the proxy can answer anything else. A ping sent after the
    call is answered before it. Judged by an order, never by a time: the answers written before
    a ping's."""
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


# ---- The host's pipes: read by a thread and written by a thread ------------------------------

WAIT = 10.0
LINE_BYTES = 16 * 1024
FLOOD_BYTES = 64 * 1024 * 1024      # four times MAX_FRAME, sent while nothing is taken
STALL = 1.0                         # no progress for this long: the reader holds back
BEATS, BEAT = 5, 0.01               # turns of the event loop, seconds each, while a read waits


class NoDescriptor:
    """A stream the loop cannot watch: only readline, as a file object without fileno."""

    def __init__(self, fd: int):
        self.file = os.fdopen(fd, "rb")

    def readline(self, size: int) -> bytes:
        return self.file.readline(size)

    def close(self) -> None:
        self.file.close()


def _read_all(stream_of, data: bytes) -> list:
    """Every line a LineReader gives for ``data`` written to a pipe."""
    r, w = os.pipe()

    def feed() -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view[:65536]):]
        os.close(w)

    async def body():
        stream = stream_of(r)
        reader = ap.LineReader(stream, asyncio.get_running_loop())
        writer = threading.Thread(target=feed)
        writer.start()
        lines = []
        while True:
            line = await asyncio.wait_for(reader.next(), WAIT)
            lines.append(line)
            if line is None:
                break
        writer.join(WAIT)
        stream.close()
        return lines
    return asyncio.run(body())


STREAMS = {"pipe": lambda fd: os.fdopen(fd, "rb", buffering=0), "no descriptor": NoDescriptor}


@pytest.mark.parametrize("kind", list(STREAMS))
def test_the_reader_cuts_the_same_lines_either_way(kind):
    # Longer than MAX_FRAME by more than a read: it is passed on cut at MAX_FRAME + 1 bytes
    # (and then refused unparsed), the rest of it skipped up to its line end.
    long_line = b"x" * (ap.MAX_FRAME + 3 * ap.READ_CHUNK) + b"\n"
    data = b'{"a":1}\n\n' + long_line + b'{"b":2}\n' + b'{"c":3}'
    lines = _read_all(STREAMS[kind], data)
    assert lines[0] == b'{"a":1}\n'
    assert lines[1] == b"\n"
    assert len(lines[2]) == ap.MAX_FRAME + 1 and lines[2] == b"x" * (ap.MAX_FRAME + 1)
    assert lines[3:] == [b'{"b":2}\n', b'{"c":3}', None]


@pytest.mark.parametrize("kind", list(STREAMS))
@pytest.mark.parametrize("size", ["long lines", "empty lines"])
def test_the_reader_reads_ahead_a_bounded_amount_either_way(kind, size):
    r, w = os.pipe()
    os.set_blocking(w, False)
    line = b'{"jsonrpc":"2.0","method":"notifications/x","params":{"p":"' + \
        b"a" * (LINE_BYTES - 64) + b'"}}\n' if size == "long lines" else b"\n" * 4096
    # What the reader may hold: READ_AHEAD_BYTES counted with each line's cost, a read
    # past it, and the pipe's own buffer.
    bound = (FLOOD_BYTES if size == "long lines" else
             4 * ap.READ_AHEAD_BYTES // ap.READ_AHEAD_LINE_COST)

    def flood() -> int:
        sent, view, pos, last = 0, memoryview(line), 0, time.monotonic()
        while sent < FLOOD_BYTES and time.monotonic() - last < STALL:
            try:
                n = os.write(w, view[pos:])
            except BlockingIOError:
                time.sleep(0.005)
                continue
            sent, pos, last = sent + n, (pos + n) % len(line), time.monotonic()
        return sent

    async def body():
        stream = STREAMS[kind](r)
        reader = ap.LineReader(stream, asyncio.get_running_loop())
        try:
            sent = await asyncio.to_thread(flood)
        finally:
            os.close(w)
        taken = 0
        while (got := await reader.next()) is not None:     # body() has a deadline
            taken += len(got)             # read to its end: taking more reads more
        stream.close()
        return sent, taken
    sent, taken = asyncio.run(asyncio.wait_for(body(), 120))
    assert sent < bound, f"the reader took {sent} bytes while nothing was taken"
    assert taken == sent


def _writer(fd: int, gone=lambda: None) -> ap.LineWriter:
    return ap.LineWriter(os.fdopen(fd, "wb"), gone)


def _blocks(write) -> bool:
    """Whether ``write`` is still blocked after WAIT, run on a daemon thread so that a test
    of a write that blocks fails instead of hanging."""
    writing = threading.Thread(target=write, daemon=True)
    writing.start()
    writing.join(WAIT)
    return writing.is_alive()


def _read_pipe(fd: int, want: int) -> bytes:
    got = b""
    deadline = time.monotonic() + WAIT
    while len(got) < want and time.monotonic() < deadline:
        got += os.read(fd, 1 << 20)
    return got


def test_messages_of_every_size_are_written_in_order_without_blocking_the_caller():
    r, w = os.pipe()
    writer = _writer(w)
    size = 64 * 1024                      # more than the pipe holds: the thread blocks
    big = b"B" * (size - 1) + b"\n"
    small = [b'{"id":%d}\n' % i for i in range(50)]

    def write() -> None:
        writer.write(b"first\n")
        writer.write(big)
        for msg in small:
            writer.write(msg)
    blocked = _blocks(write)
    want = b"first\n" + big + b"".join(small)
    got = _read_pipe(r, len(want))
    assert not blocked, "a write while the thread was writing blocked its caller"
    assert got == want
    assert writer.drain(WAIT)
    os.close(r)


def test_a_write_to_a_host_that_is_gone_calls_gone_once_and_drops_the_rest():
    r, w = os.pipe()
    os.close(r)
    calls = []
    writer = _writer(w, lambda: calls.append(1))
    writer.write(b"one\n")
    writer.write(b"two\n")
    assert writer.drain(WAIT)
    assert calls == [1] and writer.broken


def test_a_writer_on_a_stream_without_a_descriptor_uses_its_thread():
    import io

    class Sink(io.BytesIO):
        def fileno(self):
            raise io.UnsupportedOperation("no descriptor")
    sink = Sink()
    writer = ap.LineWriter(sink, lambda: None)
    for i in range(20):
        writer.write(b"%d\n" % i)
    assert writer.drain(WAIT)
    assert sink.getvalue() == b"".join(b"%d\n" % i for i in range(20))


def test_a_read_that_waits_does_not_block_the_loop():
    """The reader waits for the host's next line: the line is written only once the loop has
    turned BEATS times more, so a reader that blocked the loop on its read would hold it
    until WAIT, when the line is written anyway."""
    r, w = os.pipe()
    went_on, in_time = threading.Event(), []

    def write_once_the_loop_goes_on() -> None:
        in_time.append(went_on.wait(WAIT))
        os.write(w, b'{"id":2}\n')

    async def beat() -> None:
        for _ in range(BEATS):
            await asyncio.sleep(BEAT)
        went_on.set()

    async def work():
        loop = asyncio.get_running_loop()
        reader = ap.LineReader(os.fdopen(r, "rb", buffering=0), loop)
        await asyncio.sleep(0.05)
        threading.Thread(target=write_once_the_loop_goes_on, daemon=True).start()
        beating = asyncio.create_task(beat())
        line = await reader.next()
        await beating
        return line
    line = asyncio.run(asyncio.wait_for(work(), 2 * WAIT))
    os.close(w)
    assert line == b'{"id":2}\n'
    assert in_time == [True], f"the event loop did not turn {BEATS} times while a read waited"


def test_a_pipe_filled_by_another_writer_does_not_block_the_loop():
    r, w = os.pipe()
    # Another process's hold on the pipe, filling it (a description of its own, so that
    # O_NONBLOCK is on it alone).
    other = os.open(f"/proc/self/fd/{w}", os.O_WRONLY | os.O_NONBLOCK)
    filled = 0
    try:
        while True:
            filled += os.write(other, b"o" * 4096)
    except BlockingIOError:
        pass
    writer = _writer(w)
    message = b'{"id":1,"result":{}}\n'
    blocked = _blocks(lambda: writer.write(message))      # nothing reads the pipe meanwhile
    got = _read_pipe(r, filled + len(message))
    assert not blocked
    assert got == b"o" * filled + message
    assert writer.drain(WAIT)
    os.close(other)
    os.close(r)


def test_a_socket_with_no_room_for_an_answer_does_not_block_nor_tear_it():
    """The host's socket with the smallest send buffer, nearly full: an answer of 4 KiB
    has no room. write() returns at once; the answer arrives whole, in order, once the
    host reads, and the host is not taken for gone."""
    import socket
    proxy_end, host_end = socket.socketpair()
    proxy_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)   # the kernel's minimum
    backlog = b""
    try:
        while True:
            sent = proxy_end.send(b"x" * 63 + b"\n", socket.MSG_DONTWAIT)
            backlog += (b"x" * 63 + b"\n")[:sent]
    except BlockingIOError:
        pass
    gone = []
    writer = ap.LineWriter(os.fdopen(os.dup(proxy_end.fileno()), "wb"),
                           lambda: gone.append(True))
    answers = [b'{"id":%d,"result":"' % i + b"y" * 4000 + b'"}\n' for i in range(3)]
    blocked = _blocks(lambda: [writer.write(a) for a in answers])
    host_end.settimeout(WAIT)
    want = backlog + b"".join(answers)
    got = b""
    while len(got) < len(want):
        chunk = host_end.recv(65536)
        if not chunk:
            break
        got += chunk
    assert not blocked, "a write to a socket with no room blocked its caller"
    assert got == want and not gone and not writer.broken
    assert writer.drain(WAIT)
    proxy_end.close()
    host_end.close()


def test_an_output_made_non_blocking_by_its_holder_gets_every_answer_whole():
    """The host (or another holder of the pipe) set O_NONBLOCK on the output's description:
    what the writer's thread writes waits for room, never counting the host as gone."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    gone = []
    writer = _writer(w, lambda: gone.append(True))
    answers = [b'{"id":%d,"result":"' % i + b"z" * 50_000 + b'"}\n' for i in range(4)]
    for answer in answers:
        writer.write(answer)
    want = b"".join(answers)
    got = b""
    os.set_blocking(r, False)
    deadline = time.monotonic() + WAIT
    while len(got) < len(want) and time.monotonic() < deadline:
        time.sleep(0.01)                          # a slow host
        with contextlib.suppress(BlockingIOError):
            got += os.read(r, 8192)
    assert got == want and not gone and not writer.broken
    assert writer.drain(WAIT)
    os.close(r)


# ---- Requests that come while the servers load -----------------------------------------------

INITIALIZE = {"protocolVersion": "2025-06-18", "capabilities": {},
              "clientInfo": {"name": "host", "version": "1"}}


class _Served:
    """What HostServer needs of a proxy to answer tools/list."""

    def __init__(self):
        self.log = lambda line: None

    def listing(self) -> list:
        return [{"name": "t", "inputSchema": {"type": "object"}}]


def _line(ident, method: str, params=None) -> bytes:
    msg = {"jsonrpc": "2.0", "id": ident, "method": method}
    if params is not None:
        msg["params"] = params
    return json.dumps(msg).encode() + b"\n"


def test_requests_wait_in_order_boundedly_and_a_cancelled_one_is_dropped():
    out: list[bytes] = []
    host = ap.HostServer(None, out.append, lambda line: None)
    host.handle(_line(0, "initialize", INITIALIZE))
    assert [json.loads(o)["id"] for o in out] == [0]          # answered at once
    for i in range(1, ap.MAX_WAITING + 2):
        host.handle(_line(i, "tools/list"))
    refused = [json.loads(o) for o in out[1:]]
    assert [(r["id"], r["error"]["message"]) for r in refused] == \
        [(ap.MAX_WAITING + 1, ap.STILL_LOADING)]
    host.handle(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                            "params": {"requestId": 2}}).encode() + b"\n")
    del out[:]
    host.ready(_Served())
    answered = [json.loads(o) for o in out]
    assert [a["id"] for a in answered] == [1] + list(range(3, ap.MAX_WAITING + 1))
    assert all(a["result"]["tools"][0]["name"] == "t" for a in answered)


def test_requests_held_while_loading_are_bounded_in_bytes():
    out: list[bytes] = []
    host = ap.HostServer(None, out.append, lambda line: None)
    # Each call is a third of the bound: two are held, the third is refused at once.
    filler = "x" * (ap.MAX_WAITING_BYTES // 3)
    for i in range(3):
        host.handle(_line(i, "tools/call", {"name": "t", "arguments": {"note": filler}}))
    assert [(json.loads(o)["id"], json.loads(o)["error"]["message"]) for o in out] == \
        [(2, ap.STILL_LOADING)]
    assert [m.doc["id"] for m in host.waiting] == [ap.Num("0"), ap.Num("1")]
