"""A streamable-HTTP MCP server for tests, serving fake_payment_server's tools (not a test file).

    with MCPHTTPServer(era="modern", mode="sse", ledger=str(tmp_path / "ledger")) as srv:
        ...  # point a client at srv.url; srv.requests lists what it received

Options:
- ``mode``: ``"json"`` answers a request POST with one application/json body; ``"sse"``
  with text/event-stream: an optional priming event (``priming=True``), an optional
  ``: ping`` comment (``ping_comment=True``), a ``notifications/progress`` event when the
  request carries ``_meta.progressToken``, then the response event; the stream then closes.
- ``era``:
  ``"legacy"``: ``initialize`` mints an ``Mcp-Session-Id`` when ``session`` is true; every
  later POST must carry it (400 without, 404 once unknown or ended by DELETE). A present
  ``MCP-Protocol-Version`` that is not a legacy version gets 400. Notifications and responses
  get 202 (``notifications/cancelled`` cancels the named call). An unknown method (so
  ``server/discover`` too) is a JSON-RPC -32601 in a 200 answer, or, with sessions, a 400
  "Server not initialized" when no session id came. GET gets 405; DELETE without sessions 405.
  ``"modern"`` (2026-07-28): ``MCP-Protocol-Version`` (equal to the ``_meta`` version),
  ``Mcp-Method`` (equal to the method) and, for ``tools/call``, ``Mcp-Name`` (equal to
  params.name) are required: missing or different -> 400 with -32020. A missing ``_meta`` key
  -> 400 -32602, an unsupported version -> 400 -32022, ``initialize`` -> 400 -32022, an
  unknown method -> 404 -32601. ``Mcp-Session-Id`` is ignored and never minted. GET and
  DELETE get 405.
- ``redirect_to``: every POST is answered 307 with that Location (clients must not follow).
- ``huge_body``: ``tools/list`` is answered with a JSON body of exactly that many bytes
  (padded; in SSE mode the event carries that body).
- ``ledger``, ``description``: as FAKE_PAYMENTS_LEDGER / FAKE_PAYMENTS_DESCRIPTION.
A client closing the connection while a ``tools/call`` runs cancels it (modern HTTP's
cancellation): ``slow`` then answers at once, ``block`` gives up. ``stop()`` cancels all.

Every request is recorded, before anything is checked, as ``Received(method, path, headers,
body)`` in ``srv.requests`` (headers with lower-case names). ``post()`` and ``sse_messages()``
are small client helpers.
"""

import contextlib
import http.client
import http.server
import importlib.util
import json
import os
import secrets
import select
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_fake():
    """Import /work/main/fake_payment_server.py by path (once)."""
    name = "fake_payment_server"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fps = _load_fake()

NAMED_METHODS = ("tools/call", "resources/read", "prompts/get")  # these need Mcp-Name
MODERN_METHODS = ("server/discover", "tools/list", "tools/call")


@dataclass
class Received:
    method: str        # the HTTP method
    path: str
    headers: dict      # lower-case name -> value
    body: bytes

    @property
    def message(self):
        """The JSON-RPC message in the body, or None."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def rpc_method(self):
        m = self.message
        return m.get("method") if isinstance(m, dict) else None


class _Answer(Exception):
    """An HTTP answer carrying a JSON-RPC error, raised from the checks."""

    def __init__(self, status: int, request_id, code: int, message: str, data=None):
        super().__init__(message)
        self.status = status
        self.body = {"jsonrpc": "2.0", "id": request_id,
                     "error": fps.RPCError(code, message, data).error()}


class MCPHTTPServer:
    def __init__(self, mode="json", era="legacy", session=True, redirect_to=None,
                 huge_body=None, ledger=None, description=None, ping_comment=False,
                 priming=False, path="/mcp"):
        assert mode in ("json", "sse") and era in ("legacy", "modern")
        self.mode, self.era, self.session = mode, era, session
        self.redirect_to, self.huge_body = redirect_to, huge_body
        self.ping_comment, self.priming, self.path = ping_comment, priming, path
        self.fake = fps.FakePayments(ledger, description)
        self.requests = []            # Received, in arrival order
        self.sessions = set()         # live legacy session ids
        self.ended = set()            # session ids ended by DELETE
        self.lock = threading.Lock()  # guards requests, sessions, inflight
        self.inflight = {}            # request id key -> threading.Event
        self.httpd = None
        self.thread = None
        self.url = None

    # --- life --------------------------------------------------------------------------------

    def start(self) -> str:
        owner = self

        class Handler(_Handler):
            server_owner = owner

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{self.path}"
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self.url

    def stop(self) -> None:
        if self.httpd is None:
            return
        with self.lock:
            for cancelled in self.inflight.values():
                cancelled.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
        self.httpd = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def rpc_methods(self) -> list:
        """The JSON-RPC methods of the POSTs received so far, in order."""
        with self.lock:
            return [r.rpc_method for r in self.requests if r.method == "POST"]

    # --- JSON-RPC ----------------------------------------------------------------------------

    def check_legacy(self, headers: dict, msg: dict) -> None:
        request_id = msg.get("id")
        if self.session:
            sid = headers.get("mcp-session-id")
            if sid is None:
                raise _Answer(400, request_id, -32000, "Bad Request: Server not initialized"
                              " (no Mcp-Session-Id)")
            with self.lock:
                if sid not in self.sessions:
                    raise _Answer(404, request_id, -32001, "Session not found")
        version = headers.get("mcp-protocol-version")
        if version is not None and version not in fps.LEGACY_VERSIONS:
            raise _Answer(400, request_id, -32000,
                          f"Bad Request: unsupported protocol version {version} (supported"
                          f" versions: {', '.join(fps.LEGACY_VERSIONS)})")

    def check_modern(self, headers: dict, msg: dict) -> None:
        request_id, method = msg.get("id"), msg["method"]
        params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
        if method == "initialize":
            requested = params.get("protocolVersion")
            raise _Answer(400, request_id, fps.UNSUPPORTED_VERSION,
                          f"this server speaks the {fps.MODERN_VERSION} protocol",
                          {"supported": list(fps.MODERN_VERSIONS),
                           "requested": requested if isinstance(requested, str) else ""})
        version = headers.get("mcp-protocol-version")
        if version is None:
            raise _Answer(400, request_id, fps.HEADER_MISMATCH,
                          "missing MCP-Protocol-Version header")
        if headers.get("mcp-method") != method:
            raise _Answer(400, request_id, fps.HEADER_MISMATCH,
                          "Mcp-Method header does not match the method")
        if method in NAMED_METHODS and headers.get("mcp-name") != params.get("name"):
            raise _Answer(400, request_id, fps.HEADER_MISMATCH,
                          "Mcp-Name header does not match params.name")
        meta_version = fps.modern_version(params)
        if isinstance(meta_version, str) and meta_version != version:
            raise _Answer(400, request_id, fps.HEADER_MISMATCH,
                          "MCP-Protocol-Version header does not match _meta")
        if method not in MODERN_METHODS:
            raise _Answer(404, request_id, fps.METHOD_NOT_FOUND, f"method not found: {method}")
        try:
            fps.check_modern_meta(params)
        except fps.RPCError as e:
            raise _Answer(400, request_id, e.code, e.message, e.data) from None

    def respond(self, msg: dict, body: bytes, cancelled) -> dict:
        """The JSON-RPC response to a request that passed the checks."""
        raw = None
        if msg["method"] == "tools/call":
            try:
                raw = fps.raw_arguments(body)
            except (ValueError, IndexError):
                pass
        try:
            result = self.fake.handle(msg["method"], msg.get("params"), self.era, raw, cancelled)
            return {"jsonrpc": "2.0", "id": msg["id"], "result": result}
        except fps.RPCError as e:
            return {"jsonrpc": "2.0", "id": msg["id"], "error": e.error()}


def _key(request_id) -> str:
    return json.dumps(request_id, sort_keys=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_owner: MCPHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def record(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                body += self.rfile.read(size + 2)[:size]  # the chunk and its CRLF
        else:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length > 0 else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        srv = self.server_owner
        with srv.lock:
            srv.requests.append(Received(self.command, self.path, headers, body))
        return body

    def send_plain(self, status: int, body: bytes = b"", content_type="application/json",
                   extra=None) -> None:
        self.send_response(status)
        if body:
            self.send_header("Content-Type", content_type)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def send_json(self, status: int, message: dict, extra=None) -> None:
        self.send_plain(status, json.dumps(message).encode(), extra=extra)

    # --- methods -------------------------------------------------------------------------------

    def do_GET(self):
        self.record()
        self.send_plain(405, extra={"Allow": "POST" if self.server_owner.era == "modern"
                                    or not self.server_owner.session else "POST, DELETE"})

    def do_DELETE(self):
        self.record()
        srv = self.server_owner
        if srv.era == "modern" or not srv.session:
            self.send_plain(405, extra={"Allow": "POST"})
            return
        sid = self.headers.get("Mcp-Session-Id")
        with srv.lock:
            known = sid in srv.sessions
            if known:
                srv.sessions.discard(sid)
                srv.ended.add(sid)
        self.send_plain(200 if known else (400 if sid is None else 404))

    def do_POST(self):
        body = self.record()
        srv = self.server_owner
        if srv.redirect_to:
            self.send_plain(307, extra={"Location": srv.redirect_to})
            return
        try:
            msg = json.loads(body)
        except ValueError as e:
            self.send_json(400, {"jsonrpc": "2.0", "id": None, "error": {
                "code": fps.PARSE_ERROR, "message": f"parse error: {e}"}})
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("method"), str):
            if isinstance(msg, dict) and ("result" in msg or "error" in msg):
                self.send_plain(202)
                return
            self.send_json(400, {"jsonrpc": "2.0", "id": None, "error": {
                "code": fps.INVALID_REQUEST, "message": "invalid request"}})
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        extra = {}
        try:
            if srv.era == "modern":
                if "id" not in msg:
                    self.send_plain(202)
                    return
                srv.check_modern(headers, msg)
            elif msg["method"] == "initialize" and "id" in msg:
                if srv.session:
                    sid = secrets.token_hex(16)
                    with srv.lock:
                        srv.sessions.add(sid)
                    extra["Mcp-Session-Id"] = sid
            else:
                srv.check_legacy(headers, msg)
                if "id" not in msg:
                    self.notification(msg)
                    self.send_plain(202)
                    return
        except _Answer as a:
            self.send_json(a.status, a.body)
            return
        self.answer(msg, body, extra)

    def notification(self, msg: dict) -> None:
        params = msg.get("params")
        if msg["method"] == "notifications/cancelled" and isinstance(params, dict):
            srv = self.server_owner
            with srv.lock:
                cancelled = srv.inflight.get(_key(params.get("requestId")))
            if cancelled is not None:
                cancelled.set()

    # --- answering a request ----------------------------------------------------------------------

    def answer(self, msg: dict, body: bytes, extra: dict) -> None:
        srv = self.server_owner
        sse = srv.mode == "sse"
        if sse:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("X-Accel-Buffering", "no")
            self.send_header("Connection", "close")
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            self.close_connection = True
            if srv.priming:
                self.emit(b"id: 0\ndata: \n\n")
            if srv.ping_comment:
                self.emit(b": ping\n\n")
            params = msg.get("params")
            meta = params.get("_meta") if isinstance(params, dict) else None
            if isinstance(meta, dict) and "progressToken" in meta:
                self.emit(_event({"jsonrpc": "2.0", "method": "notifications/progress",
                                  "params": {"progressToken": meta["progressToken"],
                                             "progress": 0, "total": 1,
                                             "message": "working"}}))
        response = self.run(msg, body)
        if response is None:  # the client went away
            return
        data = json.dumps(response).encode()
        if srv.huge_body and msg["method"] == "tools/list" and "result" in response:
            data = _padded(response, srv.huge_body)
        if sse:
            self.emit(b"event: message\ndata: " + data + b"\n\n")
        else:
            self.send_plain(200, data, extra=extra)

    def emit(self, chunk: bytes) -> None:
        try:
            for i in range(0, len(chunk), 1 << 20):
                self.wfile.write(chunk[i:i + (1 << 20)])
            self.wfile.flush()
        except OSError:
            pass

    def run(self, msg: dict, body: bytes):
        """Run the request in a thread; a client that closes the connection cancels it."""
        srv = self.server_owner
        key, cancelled, box = _key(msg["id"]), threading.Event(), {}
        with srv.lock:
            srv.inflight[key] = cancelled
        worker = threading.Thread(target=lambda: box.update(r=srv.respond(msg, body, cancelled)),
                                  daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.05)
                if worker.is_alive() and not cancelled.is_set() and self.client_gone():
                    cancelled.set()
        finally:
            with srv.lock:
                if srv.inflight.get(key) is cancelled:
                    del srv.inflight[key]
        return box.get("r")

    def client_gone(self) -> bool:
        try:
            readable = select.select([self.connection], [], [], 0)[0]
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def _event(message: dict) -> bytes:
    return b"event: message\ndata: " + json.dumps(message).encode() + b"\n\n"


def _padded(response: dict, size: int) -> bytes:
    """``response`` with a padding field in its result, serialised to ``size`` bytes (or
    to its natural size when that is larger)."""
    response = dict(response, result=dict(response["result"], padding=""))
    data = json.dumps(response).encode()
    if size <= len(data):
        return data
    marker = b'"padding": ""'
    head, tail = data.split(marker, 1)
    return head + b'"padding": "' + b"x" * (size - len(data)) + b'"' + tail


# --- client helpers for tests -------------------------------------------------------------------

def post(url: str, message, headers=None, timeout: float = 10.0):
    """POST one JSON-RPC message (dict, or raw bytes). Returns (status, headers, body) with
    lower-case header names. Redirects are not followed."""
    parts = urllib.parse.urlsplit(url)
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    all_headers = {"Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream"}
    all_headers.update(headers or {})
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path or "/", body=body, headers=all_headers)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def sse_messages(body: bytes) -> list:
    """The JSON messages in an event-stream body (events with empty data skipped)."""
    messages = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if data and b"".join(data).strip():
            messages.append(json.loads(b"\n".join(data)))
    return messages


def modern_headers(method: str, name=None, version: str = "2026-07-28") -> dict:
    """The headers a 2026-07-28 client sends with a POST."""
    headers = {"MCP-Protocol-Version": version, "Mcp-Method": method}
    if name is not None:
        headers["Mcp-Name"] = name
    return headers


def modern_meta(version: str = "2026-07-28") -> dict:
    """A request's ``_meta`` in the 2026-07-28 era."""
    return {fps.META_VERSION: version, fps.META_CAPABILITIES: {},
            fps.META_CLIENT: {"name": "tests", "version": "1"}}


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
