"""Attacks on the parse-once path (section 3 and Message.parsed, section 14) and on the
outcome classifier (_observe, section 12.1).

Every test here is a GUARD test: it passed when written, because the attack it makes was
held. Each keeps the attack's frame or ending, so that a change that opens it again fails.

Parse once: a host frame whose arguments the strict parser refuses must never have a value
handed on (Message.parsed is NOT_PARSED), and a value handed on must be exactly what
parse_json of the arguments' bytes gives, and what the record (host_arguments) encodes
parses back to it. Checked on named frames, on generated ones (fixed seed, a bounded number
of frames), and end to end: a refused argument never reaches the schema check nor the server.

Outcomes: every way an upstream call (HTTP or stdio) can end after its request may have
reached the server is classed unknown (no_answer or timed_out), never answered / not_sent /
invalid_content; the ways that sent nothing are not_sent.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading

import pytest

from proxy_harness import ProxyHarness, ap
from scripted_server import Scripted, arun, loaded, pin, tool_entry

MAX_DEPTH = ap.MAX_DEPTH

# ---- parse once: named frames ----------------------------------------------------------

# Arguments the strict parser refuses, each a different fault, most of them in a place the
# runtime's scanner or the message's lenient read lets through.
REFUSED = {
    "repeated key": b'{"a":1,"a":2}',
    "repeated key, escaped": b'{"a":1,"\\u0061":2}',
    "repeated key, deep": b'{"x":[{"y":{"a":1,"\\u0061":1}}]}',
    "repeated key, same value": b'{"a":1,"a":1}',
    "lone high surrogate": b'{"a":"\\ud800"}',
    "lone low surrogate": b'{"a":"\\udc00"}',
    "reversed pair": b'{"a":"\\udc00\\ud800"}',
    "lone surrogate in a key": b'{"\\ud800":1}',
    "escaped backslash, then a lone escape": b'{"a":"\\\\\\ud800"}',
    "pair split by an escaped backslash": b'{"a":"\\ud800\\\\udc00"}',
    "invalid UTF-8": b'{"a":"\xff"}',
    "encoded surrogate": b'{"a":"\xed\xa0\x80"}',
    "overlong UTF-8": b'{"a":"\xc0\xaf"}',
    "past U+10FFFF": b'{"a":"\xf4\x90\x80\x80"}',
    "exponent past the bound": b'{"a":1e10001}',
    "exponent with leading zeros": b'{"a":1e000010001}',
    "float overflow in an array": b'{"a":[1e400]}',
    "float overflow in an object": b'{"a":{"b":-1e400}}',
    "long literal": b'{"a":' + b"9" * (ap.MAX_NUMBER_LITERAL + 1) + b"}",
    "depth past the limit": b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    "depth past the limit in an object": b'{"a":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",
}

# Arguments the strict parser accepts, at its edges: each must be handed on as parse_json
# gives it.
ACCEPTED = {
    "escaped backslash before u": b'{"a":"\\\\ud800"}',
    "two escaped backslashes": b'{"a":"\\\\\\\\ud800"}',
    "a pair": b'{"a":"\\ud800\\udc00"}',
    "a pair, upper case": b'{"a":"\\uD83D\\uDE00"}',
    "a NUL escape": b'{"a":"\\u0000","a\\u0000":1}',
    "a BOM escape": b'{"\\ufeff":"\\ufeff"}',
    "keys that differ after escaping": b'{"a":1,"\\u0041":2,"a\\u0000":3}',
    "depth at the limit": b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
    "depth at the limit in an object": b'{"a":' + b"[" * (MAX_DEPTH - 1) +
                                        b"]" * (MAX_DEPTH - 1) + b"}",
    "exponent at the bound, small": b'{"a":1e-10000}',
    "literals kept": b'{"a":[1.50,10,1e1,-0]}',
}


def frame(args: bytes, before: bytes = b"", after: bytes = b"") -> bytes:
    return (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t",' + before +
            b'"arguments":' + args + after + b"}}")


def strict(raw: bytes):
    try:
        return ap.parse_json(raw)
    except ap.JSONError:
        return ap.NOT_PARSED


def same(a, b) -> bool:
    """Equal values, members in the same order (the record keeps the host's order)."""
    return a == b and ap.dump_json(a) == ap.dump_json(b)


def handed_on_problem(line: bytes) -> str | None:
    """Why the value the message hands on for its arguments is not what parse_json of their
    bytes gives, or what the record would hold; None when it is."""
    try:
        msg = ap.parse_message(line)
    except (ap.JSONError, ap.ProtocolError):
        return None
    got = msg.parsed("arguments")
    if got is ap.NOT_PARSED:
        return None
    raw = msg.raw("arguments", in_params=True).strip(ap.JSON_WS)
    want = strict(raw)
    if want is ap.NOT_PARSED:
        return f"refused by parse_json, handed on: {line[:200]!r}"
    if not same(want, got):
        return f"handed on {got!r}, parse_json gives {want!r}: {line[:200]!r}"
    recorded, _, value = ap.host_arguments("t", raw, got)
    if not same(ap.parse_json(recorded), got) or value is not got:
        return f"recorded {recorded[:200]!r} is not the value handed on: {line[:200]!r}"
    return None


@pytest.mark.parametrize("args", REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.parametrize("where", ["alone", "repeated member", "sibling fault"])
def test_refused_arguments_are_never_handed_on(args, where):
    """Guard (held): a refused value has no parse to hand on, wherever it sits in params:
    alone, as the last of two arguments members (the one the message keeps), or beside a
    sibling whose own fault is elsewhere."""
    assert strict(args) is ap.NOT_PARSED, "the fixture must be refused by parse_json"
    line = {"alone": frame(args),
            "repeated member": frame(args, before=b'"arguments":{"a":1},'),
            "sibling fault": frame(args, after=b',"_meta":{"k":"\\ud800"}')}[where]
    msg = ap.parse_message(line)
    assert msg.raw("arguments", in_params=True) == args
    assert msg.parsed("arguments") is ap.NOT_PARSED


@pytest.mark.parametrize("args", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted_arguments_are_handed_on_as_parse_json_reads_them(args):
    """Guard (held): at the strict parser's edges, the value handed on is parse_json's, and
    the record encodes it so that it parses back the same."""
    assert strict(args) is not ap.NOT_PARSED, "the fixture must be accepted by parse_json"
    line = frame(args, after=b',"_meta":{"progressToken":"\\ud800\\udc00"}')
    assert ap.parse_message(line).parsed("arguments") is not ap.NOT_PARSED
    assert handed_on_problem(line) is None


def test_a_fault_elsewhere_in_the_frame_does_not_taint_or_free_the_arguments():
    """Guard (held): a lone surrogate, a bad byte or a repeated key outside the arguments
    (the id, a top-level member, a sibling) neither lets refused arguments through nor
    changes accepted ones."""
    outside = [b'{"jsonrpc":"2.0","id":"\\ud800","method":"tools/call","params":'
               b'{"name":"t","arguments":%s}}',
               b'{"jsonrpc":"2.0","id":1,"x":"\xff","method":"tools/call","params":'
               b'{"name":"t","arguments":%s}}',
               b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":'
               b'{"name":"t","name":"t","arguments":%s}}',
               b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t",'
               b'"arguments":{"a":1}},"params":{"name":"t","arguments":%s}}']
    for shape in outside:
        for args in REFUSED.values():
            msg = ap.parse_message(shape.replace(b"%s", args))
            assert msg.parsed("arguments") is ap.NOT_PARSED, (shape, args[:60])
        for args in ACCEPTED.values():
            assert handed_on_problem(shape.replace(b"%s", args)) is None, (shape, args[:60])


# ---- parse once: generated frames ------------------------------------------------------

STRING_PIECES = [b"a", b"\\u0061", b"\\\\", b"\\\\u0061", b"\\ud800", b"\\udc00",
                 b"\\uD800\\uDC00", b"\\ud800\\udc00", b"\\\\ud800", b"\\\\\\ud800", b"\\u0000",
                 b"\xc3\xa9", b"\xff", b"\xed\xa0\x80", b'\\"', b"\\/", b"\xef\xbb\xbf",
                 b"\\ufeff", b"{", b"[", b"]", b"}", b",", b":", b'\\\\"', b"\\udbff\\udfff",
                 b"\\ud800\\\\udc00", b"\\ud800\\u0061", b"\t", b"\\t", b"\xf4\x90\x80\x80",
                 b"\xc0\xaf"]
KEYS = [b"a", b"\\u0061", b"b", b"a\\u0000", b"\\ud800", b"\\uD800", b"", b"\\\\", b"arguments"]
NUMBERS = [b"1", b"1.0", b"1e400", b"-1e400", b"1e10001", b"1e10000", b"-0", b"1E+5",
           b"0.5e-400", b"1e00000000400", b"123456789012345678901234567890", b"NaN",
           b"Infinity", b"01", b"1.", b"9" * (ap.MAX_NUMBER_LITERAL + 1)]
SPACES = [b"", b" ", b"\n", b"\t", b"\r\n  "]
GENERATED_FRAMES = 20000


def generated(r: random.Random, depth: int) -> bytes:
    kind = r.random()
    if depth > 4 or kind < 0.3:
        leaf = r.random()
        if leaf < 0.4:
            return r.choice(NUMBERS)
        if leaf < 0.8:
            return b'"' + b"".join(r.choice(STRING_PIECES) for _ in range(r.randint(0, 4))) + \
                b'"'
        return r.choice([b"true", b"false", b"null"])
    if kind < 0.6:
        return b"[" + b",".join(generated(r, depth + 1) for _ in range(r.randint(0, 3))) + b"]"
    if kind < 0.65:
        n = r.choice([MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1])
        return b"[" * n + generated(r, 9) + b"]" * n
    return b"{" + b",".join(b'"' + r.choice(KEYS) + b'"' + r.choice(SPACES) + b":" +
                            generated(r, depth + 1) for _ in range(r.randint(0, 3))) + b"}"


def generated_frame(r: random.Random) -> bytes:
    params = [b'"name":"t"', b'"arguments":' + r.choice(SPACES) + generated(r, 0) +
              r.choice(SPACES)]
    if r.random() < 0.4:
        params.append(b'"_meta":' + generated(r, 2))
    if r.random() < 0.2:
        params.append(b'"arguments":' + generated(r, 1))
    if r.random() < 0.2:
        params.append(b'"\\u0061rguments":' + generated(r, 1))
    r.shuffle(params)
    top = [b'"jsonrpc":"2.0"', b'"id":' + r.choice([b"1", b'"\\ud800"', b'"x"']),
           b'"method":"tools/call"', b'"params":{' + b",".join(params) + b"}"]
    if r.random() < 0.3:
        top.append(b'"extra":' + generated(r, 1))
    if r.random() < 0.1:
        top.append(b'"params":{"name":"t","arguments":' + generated(r, 1) + b"}")
    r.shuffle(top)
    return b"{" + b",".join(top) + b"}"


def test_generated_frames_hand_on_only_what_parse_json_gives():
    """Guard (held): on generated frames (fixed seed) mixing repeated and escaped keys,
    surrogate escapes behind backslash runs, bad bytes, numbers at and past the bounds,
    nesting at and past the limit, repeated params and arguments members: the value handed
    on is always parse_json's of the arguments' bytes, and the record's encoding parses back
    to it. Both outcomes occur (a value handed on, a value refused), so the comparison is
    made."""
    r = random.Random(32)
    problems, handed, refused = [], 0, 0
    for _ in range(GENERATED_FRAMES):
        line = generated_frame(r)
        problem = handed_on_problem(line)
        if problem:
            problems.append(problem)
        try:
            msg = ap.parse_message(line)
        except (ap.JSONError, ap.ProtocolError):
            continue
        if msg.parsed("arguments") is ap.NOT_PARSED:
            refused += strict(msg.raw("arguments", in_params=True)) is ap.NOT_PARSED
        else:
            handed += 1
    assert problems == []
    assert handed > 1000 and refused > 1000, (handed, refused)


# ---- parse once: end to end ------------------------------------------------------------

PAY_RULES = {"pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
# Each passes the pay tool's schema (to: string, amount: number, nothing else) once its
# fault is ignored: only the strict parse stands between it and the server.
END_TO_END = {
    "repeated key": b'{"to":"bob","amount":25,"to":"eve"}',
    "repeated key, escaped": b'{"to":"bob","amount":25,"\\u0074o":"eve"}',
    "lone surrogate": b'{"to":"bob\\ud800","amount":25}',
    "escaped backslash, then a lone escape": b'{"to":"bob\\\\\\udc00","amount":25}',
    "invalid UTF-8": b'{"to":"bob\xff","amount":25}',
    "exponent past the bound": b'{"to":"bob","amount":25e10001}',
    # past OFFLOAD_BYTES: the frame is read, and the arguments judged, on a worker thread
    "repeated key, large": b'{"to":"' + b"b" * (2 * ap.OFFLOAD_BYTES) +
                           b'","amount":25,"to":"eve"}',
    "lone surrogate, large": b'{"to":"' + b"b" * (2 * ap.OFFLOAD_BYTES) +
                             b'\\ud800\\\\udc00\\ud800","amount":25}',
}


def test_refused_arguments_never_reach_the_schema_check_or_the_server(tmp_path):
    """Guard (held): through the in-process proxy and the real payment server, arguments
    the strict parser refuses are refused as not usable JSON (the schema check never sees a
    value), and nothing is paid; the same call without its fault pays, once."""
    h = ProxyHarness(tmp_path, rules=PAY_RULES)
    try:
        for name, args in END_TO_END.items():
            result = h.call("bank_pay", raw_args=args)
            assert h.is_error(result) and "not usable JSON" in h.text(result), \
                (name, h.text(result))
            assert h.payments() == 0, name
        fine = h.call("bank_pay", raw_args=b'{"to":"bob","amount":25}')
        assert not h.is_error(fine), h.text(fine)
        assert h.payments() == 1
    finally:
        h.close()


# ---- outcomes over HTTP ------------------------------------------------------------------

SPEC = ap.ToolSpec("bank_pay", "", b'{"type":"object"}', "remote_mutation", 5.0, True)
SERVER_WAIT = 5.0                           # bound on a scripted server's socket reads
ANSWER = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text","text":"paid"}]}}'


def http(status: str, body: bytes, ctype: bytes = b"application/json",
         length: int | None = None):
    """A response to the request whose id is given: ``%ID`` in ``body`` stands for it."""
    def render(ident: bytes) -> bytes:
        sent = body.replace(b"%ID", ident)
        return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: " + ctype +
                b"\r\nContent-Length: %d\r\n\r\n" % (len(sent) if length is None else length) +
                sent)
    return render


class Closing(bytes):
    """Bytes a scripted server sends before it closes the connection."""


class ScriptedHttp:
    """A raw HTTP server on 127.0.0.1: for each request it reads (whole, on any connection),
    the next step of ``steps`` says what it does: bytes to send back, or a response made
    from the request's id (the connection kept), or None to close the connection with
    nothing more sent. ``requests`` counts the
    requests it read: a request read may have taken effect."""

    def __init__(self, steps):
        self.steps = list(steps)
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(SERVER_WAIT)
        self.sock.close()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn):
        conn.settimeout(SERVER_WAIT)
        buf = b""
        with conn:
            while True:
                try:
                    while b"\r\n\r\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    body, buf = buf[:length], buf[length:]
                except OSError:
                    return
                msg = ap.parse_json(body)
                if msg.get("method") != "tools/call":
                    continue            # a notice after the call (its cancel): no answer
                self.requests += 1
                ident = msg.get("id")
                step = self.steps.pop(0) if self.steps else None
                if step is None:
                    return
                ident = ident.text.encode() if isinstance(ident, ap.Num) else b"0"
                sent = step if isinstance(step, bytes) else step(ident)
                conn.sendall(sent)
                if isinstance(sent, Closing):
                    return


def answered(body: bytes = ANSWER.replace(b"%d", b"%ID")):
    return http("200 OK", body)


def http_verdict(steps, calls: int = 1, timeout: float = 5.0):
    """The verdict of the last of ``calls`` calls over one HttpUpstream against a server
    scripted by ``steps``, and how many requests the server read."""
    spec = ap.ToolSpec("bank_pay", "", b'{"type":"object"}', "remote_mutation", timeout, True)
    with ScriptedHttp(steps) as srv:
        async def run():
            conn = ap.HttpUpstream("bank", srv.url)
            tool = ap.UpstreamTool(spec, "bank", "pay",
                                   ap.Rule(side_effect="remote_mutation"), conn)
            try:
                for _ in range(calls):
                    obs = (await ap._call_tool(ap.Tool(spec, tool.call), b"{}")).doc
            finally:
                await conn.close()
            content = obs["content"] if isinstance(obs["content"], dict) else {}
            return (content.get("ending"), ap.unknown_ending(tool, obs),
                    ap._known_outcome(obs))
        verdict = asyncio.run(asyncio.wait_for(run(), 60))
        return verdict, srv.requests


UNKNOWN = ("no_answer", "no_answer", False)

HTTP_ENDINGS = {
    "500 after reading": [http("500 Internal Server Error", b"oops", b"text/plain")],
    "500 with a JSON-RPC result": [http("500 Internal Server Error",
                                        ANSWER.replace(b"%d", b"%ID"))],
    "closed without an answer": [None],
    "closed mid-body": [lambda ident: Closing(http("200 OK", b'{"jsonrpc":"2.0","id":',
                                                   length=200)(ident))],
    "closed mid-headers": [Closing(b"HTTP/1.1 200 OK\r\nContent-Type: appl")],
    "closed mid-answer, its id sent": [lambda ident: Closing(http(
        "200 OK", ANSWER.replace(b"%d", ident)[:-10], length=len(ANSWER) + 10)(ident))],
    "JSON-RPC error, 200": [answered(b'{"jsonrpc":"2.0","id":%ID,"error":'
                                     b'{"code":-32603,"message":"broke"}}')],
    "JSON-RPC error, 400": [http("400 Bad Request", b'{"jsonrpc":"2.0","id":%ID,"error":'
                                 b'{"code":-32600,"message":"no"}}')],
    "202 to a call": [http("202 Accepted", b"")],
    "a redirect": [http("307 Temporary Redirect", b"")],
    "another id": [answered(b'{"jsonrpc":"2.0","id":999,"result":{"content":[]}}')],
    "no id": [answered(b'{"jsonrpc":"2.0","result":{"content":[]}}')],
    "stream ended before the answer": [http("200 OK", b"event: message\ndata: {}\n\n",
                                            b"text/event-stream")],
    "not JSON": [answered(b"<html>")],
}


@pytest.mark.parametrize("steps", HTTP_ENDINGS.values(), ids=HTTP_ENDINGS.keys())
def test_an_http_call_that_reached_the_server_without_an_answer_is_unknown(steps):
    """Guard (held): the server read the request, and what came back is no answer to it:
    the call may have taken effect, and its outcome is unknown."""
    verdict, requests = http_verdict(steps)
    assert requests == 1
    assert verdict == UNKNOWN


def test_a_kept_connection_dropped_after_the_request_was_read_is_unknown():
    """Guard (held): the first call is answered and its connection kept; the server reads
    the second call's request on that connection and closes it. The second request reached
    the server: unknown, never not_sent."""
    verdict, requests = http_verdict([answered(), None], calls=2)
    assert requests == 2
    assert verdict == UNKNOWN


def test_a_server_that_reads_and_never_answers_times_out_unknown():
    """Guard (held): the deadline passes with the request read and no answer: timed_out."""
    verdict, requests = http_verdict([b""], timeout=0.5)
    assert requests == 1
    assert verdict == ("timed_out", "timed_out", False)


def test_nothing_listening_is_not_sent():
    """Guard (held), the other side: a refused connection sent nothing, and is known."""
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    spec = SPEC

    async def run():
        conn = ap.HttpUpstream("bank", f"http://127.0.0.1:{port}/mcp")
        tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"),
                               conn)
        try:
            obs = (await ap._call_tool(ap.Tool(spec, tool.call), b"{}")).doc
        finally:
            await conn.close()
        return obs["content"].get("ending"), ap._known_outcome(obs)
    assert asyncio.run(asyncio.wait_for(run(), 60)) == ("not_sent", True)


def test_an_answer_is_answered():
    """Guard control: the scripted server's plain answer is a result, so the tests above
    fail for the ending, not for the harness."""
    with ScriptedHttp([answered()]) as srv:
        async def run():
            conn = ap.HttpUpstream("bank", srv.url)
            tool = ap.UpstreamTool(SPEC, "bank", "pay", ap.Rule(side_effect="remote_mutation"),
                                   conn)
            try:
                return (await ap._call_tool(ap.Tool(SPEC, tool.call), b"{}")).doc
            finally:
                await conn.close()
        obs = asyncio.run(asyncio.wait_for(run(), 60))
    assert obs["kind"] == ap.TOOL_RESULT and ap._known_outcome(obs)


# ---- outcomes over stdio -------------------------------------------------------------------

STDIO_ENDINGS = {
    "exits after reading": ("exit", UNKNOWN),
    "a line that is not JSON-RPC": ("garbage", UNKNOWN),
    "a JSON-RPC error": ({"error": {"code": -32603, "message": "broke"}}, UNKNOWN),
    "no answer in time": ("never", ("timed_out", "timed_out", False)),
    "an answer": ({"result": {"content": [{"type": "text", "text": "paid"}]}},
                  (None, None, True)),
}


@pytest.mark.parametrize("how, expected", STDIO_ENDINGS.values(), ids=STDIO_ENDINGS.keys())
def test_a_stdio_call_that_reached_the_server_is_classed_from_what_came_back(script, tmp_path,
                                                                            how, expected):
    """Guard (held): the scripted stdio server reads the call, then exits, writes a line
    that is not JSON-RPC, answers a JSON-RPC error or nothing: unknown; a result is known
    (the control: its observation records no ending, a result)."""
    s = Scripted(script, tmp_path, tools=[tool_entry("pay", {"type": "object"})],
                 calls={"pay": how})

    async def one_call():
        pinned = await pin(s.server())
        rules = {"pay": {"side_effect": "remote_mutation", "timeout": "1s"}}
        async with loaded(s.server(rules), pinned) as (tools, _):
            tool = tools["fs_pay"]
            return tool, (await ap._call_tool(ap.Tool(tool.spec, tool.call), b"{}")).doc
    tool, obs = arun(one_call())
    content = obs["content"] if isinstance(obs["content"], dict) else {}
    ending = content.get("ending") if obs["kind"] != ap.TOOL_RESULT else None
    assert (ending, ap.unknown_ending(tool, obs), ap._known_outcome(obs)) == expected
    assert [m["params"]["name"] for m in s.received() if m.get("method") == "tools/call"] \
        == ["pay"]
