"""Regressions from the last review, each shown by the reviewer's reproduction before its
fix: an event stream's connection reused, a status answer that called an executed payment
"not executed", a signal during start-up, and a header the modern transport must encode."""

import asyncio
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proxy_harness import ProxyHarness, ap  # noqa: E402
from test_regressions import HttpProxy  # noqa: E402
from process_helpers import ProcessDir, PYTHON, PROXY, eventually  # noqa: E402


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


def test_status_counts_a_payment_cancelled_while_it_executed_as_executed(tmp_path):
    h = ProxyHarness(tmp_path)
    try:
        args = {"to": "bob", "amount": 5, "mode": "block"}
        assert h.prefix(h.call("bank_pay", args)) == "PENDING_APPROVAL"
        approval = h.pending()[0]
        h.decide(approval, approve=True)
        ident = h.request("tools/call", {"name": "bank_pay", "arguments": args}, wait=False)

        async def until_paid():
            while h.payments() < 1:
                await asyncio.sleep(0.02)
        h.run(until_paid(), 20)
        ap.cancel_run(h.store, approval.run_id, "operator", "stop", time.time())
        h.release()
        h.answer(ident, 30)
        text = h.text(h.call("gate_status", {"approval_id": approval.id}))
        assert "APPROVED and executed" in text and "may have taken effect" in text
        assert "not executed" not in text
        assert h.payments() == 1
    finally:
        h.close()


def test_a_signal_while_connecting_exits_zero_and_leaves_no_server(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        (tmp_path / sig.name).mkdir()
        d = ProcessDir(str(tmp_path / sig.name))
        doc = json.load(open(d.config))
        marker = f"never-answers-{sig.name}-{os.getpid()}"
        started = str(tmp_path / sig.name / "server.started")
        # The server never answers initialize (it sleeps on purpose); it says it has started
        # by creating a file, so the signal is sent while the proxy is connecting.
        doc["servers"][0]["command"] = [
            PYTHON, "-c", f"import sys, time; open(sys.argv[1], 'w').close(); time.sleep(40)"
            f"  # {marker}", started]
        doc["servers"][0]["connect_timeout"] = "30s"
        with open(d.config, "w") as f:
            json.dump(doc, f)
        os.chmod(d.config, 0o600)
        proc = subprocess.Popen([PYTHON, PROXY, "-config", d.config], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            eventually(lambda: os.path.exists(started), 20, "the server to start")
            proc.send_signal(sig)
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
        assert leftover.stdout.strip() == ""


def test_a_name_that_is_not_plain_ascii_is_sent_encoded_in_the_header():
    assert ap._header_value("pay") == "pay"
    encoded = ap._header_value("pagar-€")
    assert encoded.startswith("=?base64?") and encoded.endswith("?=")
    assert "\n" not in ap._header_value("a\nb")
