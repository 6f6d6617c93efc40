"""A stand-in payment server for the demo and the tests: an MCP server, standard library only.

    python fake_payment_server.py        # serves MCP over stdio until stdin closes

It offers three tools and moves no money. Each payment that reaches it is written to a
ledger file first, so a test can count what the server really did (one line per payment).

Tools
-----
- ``balance {account}``: read-only hint; answers ``account <account> holds 120.00 EUR``.
- ``pay {to, amount, currency?, mode?}``: annotations ``{"destructiveHint": false}``. When
  ``FAKE_PAYMENTS_LEDGER`` names a file, the raw ``arguments`` JSON as received plus ``\\n``
  is appended to it (created 0600, one process-wide lock, flushed and fsynced) *before* the
  answer, in every mode. Then, by ``mode``:

  - (none, or any other value): text ``paid <amount, 2 decimals> to <to>``;
  - ``slow``: waits 2 s, or until the request is cancelled, then answers as above;
  - ``block``: polls every 20 ms until ``<ledger>.release`` exists, then answers as above;
    cancelled first, it answers a JSON-RPC error (-32000 ``request cancelled``). Without a
    ledger it waits for the cancellation;
  - ``error``: an ``isError`` result, text ``card declined for <to>``;
  - ``structured``: the text above plus structuredContent ``{"paid": amount, "to": to}``;
  - ``deep``: text ``deep`` plus structuredContent ``{"nested": V}``, V being
    ``{"paid": amount}`` inside 300 nested one-element arrays.

  A ``to`` that is not a string or an ``amount`` that is not a number is a protocol error
  (-32602), and nothing is recorded.
- ``refund {payment}``: no annotations at all; answers ``refunded``.

``FAKE_PAYMENTS_DESCRIPTION``, when set, replaces ``balance``'s description (a server that
changed since it was pinned).

Protocol eras
-------------
Legacy (``initialize``, versions 2024-11-05 .. 2025-11-25): the requested version is echoed
when supported, else ``2025-11-25``; ``ping`` answers ``{}``; results carry no ``resultType``.

Modern (2026-07-28): every request carries ``_meta`` with
``io.modelcontextprotocol/protocolVersion`` and ``io.modelcontextprotocol/clientCapabilities``
(either missing: -32602); another version gets -32022 with ``data: {supported, requested}``.
``server/discover`` lists only ``["2026-07-28"]`` in ``supportedVersions``, as the Python
SDK's dual-era server does (a legacy version cannot be used in ``_meta``, so listing one
would invite a request that fails). Results carry ``resultType: "complete"``; ``tools/list``
and ``server/discover`` also carry ``ttlMs: 0`` and ``cacheScope: "private"``; the discover
result names the server both as ``serverInfo`` and in ``_meta``. ``ping`` is -32601.

On stdio the era of a connection is fixed by its first request that shows one, as the Python
SDK does: ``initialize`` makes it legacy; an accepted request carrying the ``_meta`` version
(``server/discover`` included) makes it modern. A request refused for its ``_meta``
(-32022, -32602) fixes nothing, so a client may still fall back to ``initialize``. Before
either, other requests are served leniently as legacy. Once modern, ``initialize`` gets
-32022 ("connection is serving the 2026-07-28 protocol"). Once legacy, the connection
behaves as a legacy-only server: ``server/discover`` gets -32601 and ``_meta`` versions on
other requests are ignored.
``FAKE_PAYMENTS_ERA=legacy|modern`` fixes the era from the start (a single-era server).

Everywhere: a line that is not JSON gets -32700 (id null) and serving goes on; an unknown
method gets -32601; notifications are ignored except ``notifications/cancelled``, which
cancels the named in-flight call. Each ``tools/call`` runs in its own thread, so a blocked
payment holds up nothing else; answers may come in any order, each written as one line.
When stdin closes, calls still running are cancelled (``slow`` answers at once, ``block``
answers the cancellation error), given up to 2 s to answer, and the process exits 0.

For reuse (tests/mcp_http_server.py serves the same tools over HTTP)::

    server = FakePayments(ledger=None, description=None)   # or FakePayments.from_env()
    server.handle(method, params, era="legacy"|"modern", raw_args=None, cancelled=None) -> dict
        # raises RPCError(code, message, data); raw_args: the bytes of params.arguments
    raw_arguments(message: bytes) -> bytes | None         # that span, taken from a message
    check_modern_meta(params) -> None                      # raises -32602 / -32022
"""

import json
import os
import re
import sys
import threading
import time

PROGRAM = "fake_payment_server.py"
# The Python agentrt_proxy needs, checked first: an older one stops with one line saying what to
# use (the same line as agentrt_proxy.py's), not with a traceback.
if sys.version_info < (3, 9):
    sys.exit("%s needs Python 3.9 or newer; this is Python %s (%s). Get one: on macOS, "
             "/usr/bin/python3 from the Command Line Tools (xcode-select --install; update them "
             "if it is older than 3.9), Homebrew's python (brew install python), or the "
             "installer from https://www.python.org/downloads/"
             % (PROGRAM, sys.version.split()[0], sys.executable))

SERVER_INFO = {"name": "fake-payments", "version": "1.0.0"}
LEGACY_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MODERN_VERSION = "2026-07-28"
MODERN_VERSIONS = (MODERN_VERSION,)
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT = "io.modelcontextprotocol/clientInfo"
META_SERVER = "io.modelcontextprotocol/serverInfo"

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
CANCELLED = -32000
HEADER_MISMATCH, UNSUPPORTED_VERSION = -32020, -32022

SLOW_SECONDS = 2.0
POLL_SECONDS = 0.02
DEEP_LEVELS = 300
PAY_MODES = ["slow", "block", "error", "structured", "deep"]

LEDGER_LOCK = threading.Lock()  # one per process: every ledger append goes through it


class RPCError(Exception):
    """A JSON-RPC error answer."""

    def __init__(self, code: int, message: str, data=None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def error(self) -> dict:
        e = {"code": self.code, "message": self.message}
        if self.data is not None:
            e["data"] = self.data
        return e


def modern_version(params):
    """The ``_meta`` protocol version a request carries, or None."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.get(META_VERSION) if isinstance(meta, dict) else None


def check_modern_meta(params) -> None:
    """Refuse a 2026-07-28 request whose ``_meta`` lacks a required key or names a version
    this server does not speak."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get(META_VERSION), str):
        raise RPCError(INVALID_PARAMS, f"missing _meta {META_VERSION}")
    version = meta[META_VERSION]
    if version not in MODERN_VERSIONS:
        raise RPCError(UNSUPPORTED_VERSION, f"unsupported protocol version {version}",
                       {"supported": list(MODERN_VERSIONS), "requested": version})
    if not isinstance(meta.get(META_CAPABILITIES), dict):
        raise RPCError(INVALID_PARAMS, f"missing _meta {META_CAPABILITIES}")


# --- the raw bytes of params.arguments -------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _span(text: str, i: int, path: tuple):
    """(span of the value at ``path`` inside the value starting at text[i], end of that value).
    The span is None when the path is absent; the last duplicate key wins, as in json.loads."""
    if not path:
        end = _DECODER.raw_decode(text, i)[1]
        return (i, end), end
    if text[i] != "{":
        return None, _DECODER.raw_decode(text, i)[1]
    found = None
    i = _WS.match(text, i + 1).end()
    if text[i] == "}":
        return None, i + 1
    while True:
        key, i = json.decoder.scanstring(text, i + 1)
        i = _WS.match(text, _WS.match(text, i).end() + 1).end()  # past ':'
        if key == path[0]:
            found, i = _span(text, i, path[1:])
        else:
            i = _DECODER.raw_decode(text, i)[1]
        i = _WS.match(text, i).end()
        if text[i] == "}":
            return found, i + 1
        i = _WS.match(text, i + 1).end()  # past ','


def raw_arguments(message: bytes):
    """The exact bytes of ``params.arguments`` in a JSON-RPC message (valid UTF-8 JSON), or None."""
    text = message.decode("utf-8")
    start = _WS.match(text).end()
    span = _span(text, start, ("params", "arguments"))[0]
    return text[span[0]:span[1]].encode("utf-8") if span else None


# --- the tools --------------------------------------------------------------------------------

def _text(text: str, is_error: bool = False) -> dict:
    result = {"content": [{"type": "text", "text": text}]}
    if is_error:
        result["isError"] = True
    return result


class FakePayments:
    """The tools and the method table, independent of any transport."""

    def __init__(self, ledger=None, description=None):
        self.ledger = ledger or None
        self.description = description

    @classmethod
    def from_env(cls, env=None):
        env = os.environ if env is None else env
        return cls(env.get("FAKE_PAYMENTS_LEDGER"), env.get("FAKE_PAYMENTS_DESCRIPTION"))

    def tools(self) -> list:
        return [
            {"name": "balance",
             "description": self.description if self.description is not None
             else "Reports the balance of an account.",
             "inputSchema": {"type": "object", "properties": {"account": {"type": "string"}},
                             "required": ["account"], "additionalProperties": False},
             "annotations": {"readOnlyHint": True}},
            {"name": "pay",
             "description": "Sends a payment to a recipient.",
             "inputSchema": {"type": "object",
                             "properties": {"to": {"type": "string"},
                                            "amount": {"type": "number"},
                                            "currency": {"type": "string"},
                                            "mode": {"type": "string", "enum": PAY_MODES}},
                             "required": ["to", "amount"], "additionalProperties": False},
             "annotations": {"destructiveHint": False}},
            {"name": "refund",
             "description": "Refunds a payment.",
             "inputSchema": {"type": "object", "properties": {"payment": {"type": "string"}},
                             "required": ["payment"], "additionalProperties": False}},
        ]

    def handle(self, method: str, params=None, era: str = "legacy", raw_args=None,
               cancelled=None) -> dict:
        """Answer one request in the given era: the result, or RPCError raised.
        ``raw_args`` are the received bytes of params.arguments (else they are re-encoded);
        ``cancelled`` is a threading.Event set when the request is cancelled."""
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise RPCError(INVALID_PARAMS, "params must be an object")
        if era == "modern":
            if method == "initialize":
                requested = params.get("protocolVersion")
                raise RPCError(UNSUPPORTED_VERSION,
                               f"connection is serving the {MODERN_VERSION} protocol",
                               {"supported": list(MODERN_VERSIONS),
                                "requested": requested if isinstance(requested, str) else ""})
            if method not in ("server/discover", "tools/list", "tools/call"):
                raise RPCError(METHOD_NOT_FOUND, f"method not found: {method}")
            check_modern_meta(params)
            if method == "server/discover":
                result = {"supportedVersions": list(MODERN_VERSIONS),
                          "capabilities": {"tools": {}}, "serverInfo": dict(SERVER_INFO),
                          "_meta": {META_SERVER: dict(SERVER_INFO)},
                          "ttlMs": 0, "cacheScope": "private"}
            elif method == "tools/list":
                result = {"tools": self.tools(), "ttlMs": 0, "cacheScope": "private"}
            else:
                result = self.call(params, raw_args, cancelled)
            result["resultType"] = "complete"
            return result
        if method == "initialize":
            requested = params.get("protocolVersion")
            return {"protocolVersion": requested if requested in LEGACY_VERSIONS
                    else LEGACY_VERSIONS[-1],
                    "capabilities": {"tools": {}}, "serverInfo": dict(SERVER_INFO)}
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": self.tools()}
        if method == "tools/call":
            return self.call(params, raw_args, cancelled)
        raise RPCError(METHOD_NOT_FOUND, f"method not found: {method}")

    def call(self, params: dict, raw_args=None, cancelled=None) -> dict:
        """tools/call: dispatch on params.name."""
        name, args = params.get("name"), params.get("arguments")
        args = {} if args is None else args
        if not isinstance(args, dict):
            raise RPCError(INVALID_PARAMS, "arguments must be an object")
        if name == "balance":
            account = args.get("account")
            if not isinstance(account, str):
                raise RPCError(INVALID_PARAMS, "balance: account must be a string")
            return _text(f"account {account} holds 120.00 EUR")
        if name == "refund":
            if not isinstance(args.get("payment"), str):
                raise RPCError(INVALID_PARAMS, "refund: payment must be a string")
            return _text("refunded")
        if name == "pay":
            if raw_args is None:
                raw_args = json.dumps(args, separators=(",", ":")).encode()
            return self.pay(args, raw_args, cancelled or threading.Event())
        raise RPCError(INVALID_PARAMS, f"unknown tool: {name}")

    def pay(self, args: dict, raw_args: bytes, cancelled: threading.Event) -> dict:
        to, amount, mode = args.get("to"), args.get("amount"), args.get("mode")
        if not isinstance(to, str):
            raise RPCError(INVALID_PARAMS, "pay: to must be a string")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise RPCError(INVALID_PARAMS, "pay: amount must be a number")
        try:
            shown = "%.2f" % float(amount)
        except OverflowError:
            raise RPCError(INVALID_PARAMS, "pay: amount is out of range") from None
        if mode is not None and not isinstance(mode, str):
            raise RPCError(INVALID_PARAMS, "pay: mode must be a string")
        if self.ledger:
            try:
                self.record(raw_args)
            except OSError as e:
                raise RPCError(-32603, f"ledger: {e}") from None
        paid = f"paid {shown} to {to}"
        if mode == "slow":
            cancelled.wait(SLOW_SECONDS)
        elif mode == "block":
            release = self.ledger + ".release" if self.ledger else None
            while not (release and os.path.exists(release)):
                if cancelled.wait(POLL_SECONDS):
                    raise RPCError(CANCELLED, "request cancelled")
        elif mode == "error":
            return _text(f"card declined for {to}", is_error=True)
        elif mode == "structured":
            result = _text(paid)
            result["structuredContent"] = {"paid": amount, "to": to}
            return result
        elif mode == "deep":
            nested = {"paid": amount}
            for _ in range(DEEP_LEVELS):
                nested = [nested]
            result = _text("deep")
            result["structuredContent"] = {"nested": nested}
            return result
        return _text(paid)

    def record(self, raw_args: bytes) -> None:
        """Append one ledger line, on disk before this returns."""
        with LEDGER_LOCK:
            fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                data = raw_args + b"\n"
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)


# --- stdio ------------------------------------------------------------------------------------

def _reject_constant(name):
    raise ValueError(f"not JSON: {name}")


def _request_key(request_id) -> str:
    return json.dumps(request_id, sort_keys=True)


class StdioServer:
    """One stdio connection: reads requests line by line, answers each as one line."""

    def __init__(self, server: FakePayments, out, era=None):
        self.server, self.out = server, out
        self.era = era if era in ("legacy", "modern") else None
        self.write_lock = threading.Lock()
        self.inflight = {}  # request key -> threading.Event
        self.inflight_lock = threading.Lock()  # guards inflight and threads
        self.threads = set()

    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self.write_lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, ValueError, OSError):
                os._exit(0)  # the client is gone

    def answer(self, request_id, fn) -> None:
        try:
            message = {"jsonrpc": "2.0", "id": request_id, "result": fn()}
        except RPCError as e:
            message = {"jsonrpc": "2.0", "id": request_id, "error": e.error()}
        except Exception as e:  # a bug here must not end the connection
            message = {"jsonrpc": "2.0", "id": request_id,
                       "error": {"code": -32603, "message": f"internal error: {e}"}}
        self.send(message)

    def serve(self, infile) -> None:
        for line in iter(infile.readline, b""):
            if line.strip():
                self.on_line(line)

    def on_line(self, line: bytes) -> None:
        try:
            msg = json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as e:
            self.send({"jsonrpc": "2.0", "id": None,
                       "error": {"code": PARSE_ERROR, "message": f"parse error: {e}"}})
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("method"), str):
            if isinstance(msg, dict) and "method" not in msg and ("result" in msg
                                                                  or "error" in msg):
                return  # a response from the client: this server sends no requests
            request_id = msg.get("id") if isinstance(msg, dict) else None
            self.send({"jsonrpc": "2.0", "id": request_id,
                       "error": {"code": INVALID_REQUEST, "message": "invalid request"}})
            return
        method, params = msg["method"], msg.get("params")
        if "id" not in msg:
            self.on_notification(method, params)
            return
        request_id = msg["id"]
        era = self.era
        if era is None:
            if method == "initialize":
                era = self.era = "legacy"
            elif method == "server/discover" or modern_version(params) is not None:
                try:
                    check_modern_meta(params)
                except RPCError as e:  # refused: the era stays open
                    self.send({"jsonrpc": "2.0", "id": request_id, "error": e.error()})
                    return
                era = self.era = "modern"
            else:
                era = "legacy"
        if method == "tools/call":
            try:
                raw = raw_arguments(line)
            except (ValueError, IndexError):
                raw = None
            key, cancelled = _request_key(request_id), threading.Event()
            with self.inflight_lock:
                self.inflight[key] = cancelled

            def run():
                try:
                    self.answer(request_id,
                                lambda: self.server.handle(method, params, era, raw, cancelled))
                finally:
                    with self.inflight_lock:
                        if self.inflight.get(key) is cancelled:
                            del self.inflight[key]
                        self.threads.discard(threading.current_thread())

            thread = threading.Thread(target=run, daemon=True)
            with self.inflight_lock:
                self.threads.add(thread)
            thread.start()
        else:
            self.answer(request_id, lambda: self.server.handle(method, params, era))

    def on_notification(self, method: str, params) -> None:
        if method == "notifications/cancelled" and isinstance(params, dict):
            with self.inflight_lock:
                event = self.inflight.get(_request_key(params.get("requestId")))
            if event is not None:
                event.set()

    def close(self, deadline: float = 2.0) -> None:
        """Cancel every call still running and give them ``deadline`` seconds to answer."""
        with self.inflight_lock:
            calls = list(self.inflight.values())
        for cancelled in calls:
            cancelled.set()
        end = time.monotonic() + deadline
        with self.inflight_lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        self.write_lock.acquire(timeout=1)  # never exit in the middle of a line


def main() -> int:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stdout carries protocol messages only
    conn = StdioServer(FakePayments.from_env(), out, os.environ.get("FAKE_PAYMENTS_ERA"))
    try:
        conn.serve(sys.stdin.buffer)
    except KeyboardInterrupt:
        pass
    conn.close()
    os._exit(0)  # threads still waiting (slow, block) end with the process


if __name__ == "__main__":
    sys.exit(main())
