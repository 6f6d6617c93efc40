"""The webhook: the HTTP approval channel, run as its own process (reference/webhook.md).

Each test starts `python3 agentrt_proxy.py -db DB webhook -listen 127.0.0.1:0 -secret-file F`
as a real process and speaks HTTP to it. Requests are signed here, by the recipe the README
gives, not by the module's own signer, so that the two cannot agree on a mistake. The
round trip runs against a real proxy process (tests/process_helpers.py); the refusals against
a database with waiting runs written through the gate (tests/conftest.py). Every wait has a
deadline; every process a test starts is stopped by its pid in a finally.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from process_helpers import (PROXY, PYTHON, ProcessDir, is_error, patched_command, prefix,
                             proxy_command, text)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import agentrt_proxy as ap  # noqa: E402

LISTENING = re.compile(r"agentrt-proxy: webhook listening on http://127\.0\.0\.1:(\d+)")
START_SECONDS = 30
HTTP_SECONDS = 20
NEVER = 600.0              # a deadline the test gives far longer than any of its waits
CUT_WAIT = 60.0            # for the webhook to cut a slow client off: a wait, never judged


def write_secret(tmp, data=None, mode=0o600, name="webhook.secret") -> str:
    path = os.path.join(str(tmp), name)
    with open(path, "wb") as f:
        f.write(secrets.token_hex(32).encode() + b"\n" if data is None else data)
    os.chmod(path, mode)
    return path


def read_secret(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read().rstrip(b"\r\n")


def sign(secret: bytes, method: str, path: str, body: bytes = b"", ts=None, nonce=None) -> dict:
    """The README's recipe: HMAC-SHA256 of timestamp, nonce, method, path, a line each, then
    the body."""
    ts = str(int(time.time()) if ts is None else ts)
    nonce = nonce or secrets.token_hex(16)
    message = "\n".join([ts, nonce, method, path]).encode() + b"\n" + body
    return {"X-Approval-Timestamp": ts, "X-Approval-Nonce": nonce,
            "X-Approval-Signature": "v1=" + hmac.new(secret, message, hashlib.sha256).hexdigest()}


class Hook:
    """One webhook process and a client for it."""

    def __init__(self, db: str, secret_path: str, *extra: str,
                 listen: str = "127.0.0.1:0", constants: dict | None = None):
        self.secret = read_secret(secret_path)
        command, env = patched_command(constants) if constants else proxy_command()
        self.proc = subprocess.Popen(
            [*command, "-db", db, "webhook", "-listen", listen, "-secret-file",
             secret_path, *extra], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=env)
        self.pid = self.proc.pid
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.wait_line(LISTENING).group(1))

    def _read(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, pattern, timeout: float = START_SECONDS) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line {pattern.pattern} within {timeout} s: "
                                     f"{self.log}") from None
            if line is None:
                raise AssertionError(f"the webhook exited ({self.proc.wait()}): {self.log}")
            match = pattern.search(line)
            if match:
                return match

    def request(self, method: str, path: str, body: bytes = b"", signed: bool = True,
                headers=None, **sign_kw) -> tuple[int, dict, bytes]:
        head = dict(sign(self.secret, method, path, body, **sign_kw)) if signed else {}
        head.update(headers or {})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_SECONDS)
        try:
            conn.request(method, path, body=body if body or method == "POST" else None,
                         headers=head)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def call(self, method: str, path: str, doc=None, **kw) -> tuple[int, dict]:
        """A request whose answer must be JSON with Cache-Control: no-store."""
        body = b"" if doc is None else json.dumps(doc).encode()
        status, headers, data = self.request(method, path, body, **kw)
        assert headers.get("cache-control") == "no-store", headers
        assert headers.get("content-type") == "application/json", headers
        return status, json.loads(data)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc.stderr.close()


@pytest.fixture
def hooks():
    started: list[Hook] = []

    def start(*args, **kw) -> Hook:
        h = Hook(*args, **kw)
        started.append(h)
        return h
    try:
        yield start
    finally:
        for h in started:
            h.stop()


def decision(approval, **change) -> dict:
    doc = {"run_id": approval.run_id, "approval_id": approval.id, "hash": approval.hash,
           "by": "pat", "note": "checked"}
    doc.update(change)
    return doc


def approve_path(run_id: str, approval_id: str, verb: str = "approve") -> str:
    return f"/runs/{run_id}/approvals/{approval_id}/{verb}"


def status_of(harness, approval) -> str:
    return harness.store.get_approval(approval.id).status


# -- sockets a process listens on (Linux /proc) -----------------------------------------

def listening_inodes() -> set:
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        found |= {r.split()[9] for r in rows if r.split()[3] == "0A"}
    return found


def socket_inodes(pid: int) -> set:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


# -- the round trip against a real proxy -------------------------------------------------

@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
def test_webhook_approval_round_trip_executes_the_identical_call_once(tmp_path, hooks):
    d = ProcessDir(tmp_path)
    try:
        p = d.start()
        args = {"to": "nina", "amount": 12}
        r = p.call("bank_pay", args)
        assert prefix(r) == "PENDING_APPROVAL" and not is_error(r), text(r)
        (a,) = d.pending()
        hook = hooks(d.db, write_secret(tmp_path))

        status, doc = hook.call("GET", f"/runs/{a['run_id']}/approvals")
        assert status == 200 and [x["id"] for x in doc["approvals"]] == [a["id"]], doc
        status, doc = hook.call("GET", f"/runs/{a['run_id']}/approvals/{a['id']}")
        assert status == 200, doc
        shown = doc["approval"]
        assert shown["status"] == "pending" and shown["tool"] == "bank_pay", shown
        assert shown["arguments"] == {"to": "nina", "amount": 12}, shown
        status, doc = hook.call("POST", approve_path(a["run_id"], a["id"]), {
            "run_id": a["run_id"], "approval_id": a["id"], "hash": shown["hash"],
            "by": "pat", "note": "ok"})
        assert status == 202, doc
        assert doc["approval"]["status"] == "approved" and doc["approval"]["decided_by"] == "pat"
        assert doc["run"]["status"] == "WAITING_FOR_APPROVAL", doc
        assert d.payments() == 0, "the webhook executes nothing"

        r = p.call("bank_pay", args)
        assert not is_error(r) and text(r) == "paid 12.00 to nina", text(r)
        assert d.payments() == 1
        r = p.call("bank_pay", args)
        assert prefix(r) == "DUPLICATE" and is_error(r), text(r)
        assert d.payments() == 1
        assert [x["status"] for x in d.runs()][0] == "COMPLETED"
        assert any("by pat: approved; the next identical call runs it" in line
                   for line in hook.log), hook.log

        # The serving proxy listens on nothing; the webhook does (so the check can see one).
        listening = listening_inodes()
        assert not socket_inodes(p.pid) & listening
        assert socket_inodes(hook.pid) & listening
        p.stop()
    finally:
        d.cleanup()


def test_webhook_reject_cancels_the_run_and_runs_nothing(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    status, doc = hook.call("POST", approve_path("run-1", a.id, "reject"), decision(a))
    assert status == 200, doc
    assert doc["approval"]["status"] == "rejected" and doc["run"]["status"] == "CANCELLED"
    assert harness.store.get_run("run-1").reason == "approval_rejected"
    assert harness.paid == []


def test_webhook_cancel_then_cancel_again(tmp_path, harness, hooks):
    harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    body = {"run_id": "run-1", "by": "pat", "note": "stop"}
    status, doc = hook.call("POST", "/runs/run-1/cancel", body)
    assert status == 200 and doc["run"]["status"] == "CANCELLED", doc
    status, doc = hook.call("POST", "/runs/run-1/cancel", body)
    assert (status, doc["code"]) == (409, "run_finished"), doc


def test_webhook_a_second_decision_is_not_pending(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    assert hook.call("POST", approve_path("run-1", a.id), decision(a))[0] == 202
    status, doc = hook.call("POST", approve_path("run-1", a.id), decision(a))
    assert (status, doc["code"]) == (409, "not_pending"), doc


def test_webhook_shows_an_approval_as_text(tmp_path, harness, hooks):
    a = harness.waiting("run-1", args=b'{"amount": 25.00, "memo": "\\u001b[2Jhi\\u202e"}')
    hook = hooks(harness.path, write_secret(tmp_path))
    for path, accept in ((f"/runs/run-1/approvals/{a.id}?format=text", None),
                         (f"/runs/run-1/approvals/{a.id}", {"Accept": "text/plain"})):
        status, headers, body = hook.request("GET", path, headers=accept)
        assert status == 200 and headers["content-type"].startswith("text/plain"), body
        assert headers["cache-control"] == "no-store"
        assert b"APPROVAL WAITING  " + a.id.encode() in body
        assert b"\x1b" not in body and "\u202e".encode() not in body, body
    status, _, body = hook.request("GET", f"/runs/run-1/approvals/{a.id}")
    assert status == 200 and json.loads(body)["approval"]["arguments"]["memo"] == \
        "\x1b[2Jhi\u202e", body         # the same value, escaped: nothing raw reaches a terminal
    assert b"\x1b" not in body and "\u202e".encode() not in body, body


def test_webhook_sign_command_signs_a_request_it_accepts(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    secret = write_secret(tmp_path)
    hook = hooks(harness.path, secret)
    body = json.dumps(decision(a)).encode()
    path = approve_path("run-1", a.id)
    done = subprocess.run([PYTHON, PROXY, "sign", "-secret-file", secret, "-method", "POST",
                           "-path", path, "-body", body.decode()],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    headers = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(headers) == ["X-Approval-Nonce", "X-Approval-Signature",
                               "X-Approval-Timestamp"], done.stdout
    status, _, data = hook.request("POST", path, body, signed=False, headers=headers)
    assert status == 202, data
    assert status_of(harness, a) == "approved"


def test_webhook_an_expired_approval_is_gone(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    with harness.store.tx() as tx:           # the expiry is not part of the hash
        tx.exec("UPDATE approvals SET expires_at=? WHERE id=?",
                ("2001-01-01T00:00:00.000000Z", a.id))
    hook = hooks(harness.path, write_secret(tmp_path))
    status, doc = hook.call("GET", f"/runs/run-1/approvals/{a.id}")
    assert (status, doc["code"]) == (410, "expired"), doc
    assert status_of(harness, a) == "pending", "showing it writes nothing"
    status, doc = hook.call("POST", approve_path("run-1", a.id), decision(a))
    assert (status, doc["code"]) == (410, "expired"), doc
    assert status_of(harness, a) == "expired"
    assert harness.store.get_run("run-1").status == "CANCELLED"


# -- attacks -----------------------------------------------------------------------------

def test_webhook_refuses_a_request_without_a_signature(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    status, doc = hook.call("POST", approve_path("run-1", a.id), decision(a), signed=False)
    assert (status, doc["code"]) == (401, "unauthorized"), doc
    status, doc = hook.call("GET", f"/runs/run-1/approvals/{a.id}", signed=False)
    assert (status, doc["code"]) == (401, "unauthorized"), doc
    assert a.hash not in json.dumps(doc), "nothing of the approval is shown"
    assert status_of(harness, a) == "pending"


def test_webhook_refuses_a_wrong_signature(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    path, body = approve_path("run-1", a.id), json.dumps(decision(a)).encode()
    other = read_secret(write_secret(tmp_path, name="other.secret"))
    forged = [sign(other, "POST", path, body),                       # another secret
              sign(hook.secret, "POST", path, b'{"by":"x"}'),         # other bytes
              sign(hook.secret, "GET", path, body),                   # another method
              sign(hook.secret, "POST", approve_path("run-1", a.id, "reject"), body)]
    good = sign(hook.secret, "POST", path, body)
    upper = dict(good, **{"X-Approval-Signature": good["X-Approval-Signature"].upper()})
    for headers in forged + [upper]:
        status, _, data = hook.request("POST", path, body, signed=False, headers=headers)
        assert status == 401 and json.loads(data)["code"] == "unauthorized", data
    assert status_of(harness, a) == "pending"


def test_webhook_refuses_a_replayed_request(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    get = sign(hook.secret, "GET", "/runs/run-1/approvals")
    first = hook.request("GET", "/runs/run-1/approvals", signed=False, headers=get)
    again = hook.request("GET", "/runs/run-1/approvals", signed=False, headers=get)
    assert (first[0], again[0]) == (200, 401), (first, again)

    # A reject replayed after the operator's approve must not turn it around.
    path = approve_path("run-1", a.id, "reject")
    body = json.dumps(decision(a)).encode()
    captured = sign(hook.secret, "POST", path, body)
    status, _, data = hook.request("POST", path, body, signed=False, headers=captured)
    assert status == 200, data
    status, _, data = hook.request("POST", path, body, signed=False, headers=captured)
    assert status == 401 and b"used before" in data, data


def test_webhook_refuses_a_timestamp_outside_the_window(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    path, body = approve_path("run-1", a.id), decision(a)
    now = int(time.time())
    for ts in (now - ap.WEBHOOK_SKEW - 60, now + ap.WEBHOOK_SKEW + 60, 0):
        status, doc = hook.call("POST", path, body, ts=ts)
        assert (status, doc["code"]) == (401, "unauthorized"), (ts, doc)
    assert status_of(harness, a) == "pending"
    status, doc = hook.call("POST", path, body, ts=now - ap.WEBHOOK_SKEW // 2)
    assert status == 202, doc        # inside the window, either way, is accepted


def test_webhook_refuses_a_body_naming_another_run_or_approval(tmp_path, harness, hooks):
    a1, a2 = harness.waiting("run-1"), harness.waiting("run-2")
    hook = hooks(harness.path, write_secret(tmp_path))
    path = approve_path("run-1", a1.id)
    for body in (decision(a1, run_id="run-2"), decision(a1, approval_id=a2.id),
                 decision(a2), decision(a1, hash=""), decision(a1, by=""),
                 dict(decision(a1), extra="x"), {"run_id": "run-1"}):
        status, doc = hook.call("POST", path, body)
        assert (status, doc["code"]) == (400, "bad_request"), (body, doc)
    # The path names run-1 and run-2's approval: no such approval under that run.
    status, doc = hook.call("POST", approve_path("run-1", a2.id),
                            decision(a2, run_id="run-1"))
    assert (status, doc["code"]) == (404, "not_found"), doc
    raw = b'{"run_id":"run-1","approval_id":"%s","hash":"%s","hash":"x","by":"p"}' % (
        a1.id.encode(), a1.hash.encode())
    status, _, data = hook.request("POST", path, raw)
    assert status == 400, data       # a repeated key is refused, never resolved
    assert (status_of(harness, a1), status_of(harness, a2)) == ("pending", "pending")


def test_webhook_refuses_a_stale_hash_after_the_approval_changed(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    status, doc = hook.call("GET", f"/runs/run-1/approvals/{a.id}")
    shown = doc["approval"]["hash"]
    assert status == 200 and shown == a.hash
    presentation = b'{"note":"rewritten after it was shown"}'
    rehashed = ap.approval_hash(a.kind, a.capability, presentation, a.request())
    with harness.store.tx() as tx:
        tx.exec("UPDATE approvals SET presentation_json=?, hash=? WHERE id=?",
                (presentation.decode(), rehashed, a.id))
    status, doc = hook.call("POST", approve_path("run-1", a.id), decision(a, hash=shown))
    assert (status, doc["code"]) == (409, "approval_changed"), doc
    assert status_of(harness, a) == "pending"
    status, doc = hook.call("POST", approve_path("run-1", a.id), decision(a, hash=rehashed))
    assert status == 202, doc        # what is stored now, once shown, can be decided


def test_webhook_refuses_a_row_that_no_longer_matches_its_hash(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    with harness.store.tx() as tx:          # edited behind the proxy's back, hash kept
        tx.exec("UPDATE approvals SET presentation_json=? WHERE id=?", ('{"x":1}', a.id))
    hook = hooks(harness.path, write_secret(tmp_path))
    status, doc = hook.call("GET", f"/runs/run-1/approvals/{a.id}")
    assert (status, doc["code"]) == (409, "approval_hash"), doc
    status, doc = hook.call("POST", approve_path("run-1", a.id), decision(a))
    assert (status, doc["code"]) == (409, "approval_hash"), doc
    assert status_of(harness, a) == "pending"


def raw_exchange(port: int, data: bytes, timeout: float = HTTP_SECONDS) -> bytes:
    """Send bytes, then read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk


def test_webhook_refuses_a_flood_past_the_rate(tmp_path, harness, hooks):
    harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    statuses: list[int] = []
    began = time.monotonic()
    while 429 not in statuses and len(statuses) < 50 * ap.WEBHOOK_BURST:
        statuses.append(hook.request("GET", "/runs/run-1/approvals", signed=False)[0])
    spent = time.monotonic() - began
    assert statuses[-1] == 429, statuses
    answered = len(statuses) - 1          # each one before the first refusal
    assert ap.WEBHOOK_BURST <= answered <= ap.WEBHOOK_BURST + ap.WEBHOOK_RATE * spent + 1, \
        (answered, spent)
    assert set(statuses[:-1]) == {401}, statuses


def http_bytes(method: str, path: str, body: bytes = b"", headers=None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(hook, data: bytes) -> bytes:
    """One connection to an in-process Webhook: the request, then the whole answer."""
    ours, theirs = socket.socketpair()
    with ours:
        ours.settimeout(HTTP_SECONDS)
        ours.sendall(data)
        ours.shutdown(socket.SHUT_WR)
        assert hook.slots.acquire(timeout=HTTP_SECONDS)
        hook.handle_connection(theirs)
        got = b""
        while True:
            chunk = ours.recv(65536)
            if not chunk:
                return got
            got += chunk


def test_webhook_rate_is_judged_before_anything_is_read(tmp_path, harness):
    """With the bucket's clock stopped: past the burst, a good request and a body claimed
    too long are both answered 429, unread; once a token is back the good one is decided."""
    a = harness.waiting("run-1")
    secret = read_secret(write_secret(tmp_path))
    hook = ap.Webhook(harness.path, secret, lambda line: None)
    now = [100.0]
    hook.bucket = ap.TokenBucket(ap.WEBHOOK_RATE, ap.WEBHOOK_BURST, clock=lambda: now[0])
    for _ in range(ap.WEBHOOK_BURST):
        assert exchange(hook, http_bytes("GET", "/runs/run-1/approvals")).startswith(
            b"HTTP/1.1 401 ")
    path, body = approve_path("run-1", a.id), json.dumps(decision(a)).encode()
    limited = exchange(hook, http_bytes("POST", path, body, sign(secret, "POST", path, body)))
    assert limited.startswith(b"HTTP/1.1 429 ") and b'"code":"rate_limited"' in limited, limited
    assert b"Cache-Control: no-store" in limited
    claimed = exchange(hook, b"POST %s HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n" %
                       path.encode())
    assert claimed.startswith(b"HTTP/1.1 429 "), claimed
    assert status_of(harness, a) == "pending"
    now[0] += 1.5 / ap.WEBHOOK_RATE          # one token, and not two
    done = exchange(hook, http_bytes("POST", path, body, sign(secret, "POST", path, body)))
    assert done.startswith(b"HTTP/1.1 202 "), done
    assert status_of(harness, a) == "approved"


def test_webhook_refuses_an_oversized_body(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    path, doc = approve_path("run-1", a.id), json.dumps(decision(a)).encode()
    over = doc + b" " * (ap.WEBHOOK_MAX_BODY + 1 - len(doc))
    status, headers, data = hook.request("POST", path, over)
    assert (status, json.loads(data)["code"]) == (413, "body_too_large"), data
    assert headers["cache-control"] == "no-store"
    # Claimed, never sent: refused on the header, without waiting for the bytes.
    answer = raw_exchange(hook.port, b"POST %s HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (
        path.encode(), ap.WEBHOOK_MAX_BODY + 1))
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    chunked = raw_exchange(hook.port, b"POST %s HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"5\r\nhello\r\n0\r\n\r\n" % path.encode())
    assert chunked.startswith(b"HTTP/1.1 400 "), chunked
    assert status_of(harness, a) == "pending"
    exact = doc + b" " * (ap.WEBHOOK_MAX_BODY - len(doc))
    status, _, data = hook.request("POST", path, exact)
    assert status == 202, data       # at the bound is accepted


def test_webhook_no_path_lists_runs(tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    harness.completed("run-2")
    hook = hooks(harness.path, write_secret(tmp_path))
    for method, path in (("GET", "/runs"), ("GET", "/runs/"), ("GET", "/runs?limit=10"),
                         ("GET", "/"), ("GET", "/approvals"), ("GET", "/runs//approvals"),
                         ("GET", "/runs/run-1"), ("GET", "/runs/run-1/approvals?all=1"),
                         ("DELETE", f"/runs/run-1/approvals/{a.id}"),
                         ("GET", f"/runs/run-1/approvals/{a.id}/approve"),
                         ("POST", "/runs/run-1/approvals")):
        status, doc = hook.call(method, path)
        assert (status, doc["code"]) == (404, "not_found"), (method, path, doc)
        assert "run-1" not in json.dumps(doc) and "run-2" not in json.dumps(doc), doc
    status, doc = hook.call("GET", "/runs/run-9/approvals")
    assert (status, doc["code"]) == (404, "not_found"), doc


def run_webhook(db: str, listen: str, secret: str, *extra: str):
    command, env = proxy_command()
    return subprocess.run([*command, "-db", db, "webhook", "-listen", listen,
                           "-secret-file", secret, *extra],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("listen,why", [
    ("0.0.0.0:0", "not a loopback address"),
    ("192.0.2.7:0", "not a loopback address"),
    ("[::]:0", "not a loopback address"),
    ("example.com:80", "names an IP address"),
    ("127.0.0.1", "ADDRESS:PORT"),
    ("127.0.0.1:70000", "ADDRESS:PORT"),
])
def test_webhook_refuses_a_non_loopback_address_without_public(tmp_path, harness, listen, why):
    done = run_webhook(harness.path, listen, write_secret(tmp_path))
    assert done.returncode == 2 and why in done.stderr, done.stderr
    assert "listening" not in done.stderr, done.stderr


def test_webhook_public_lifts_the_loopback_refusal(tmp_path, harness):
    # This address belongs to no interface here, so nothing listens: the bind fails.
    done = run_webhook(harness.path, "192.0.2.7:0", write_secret(tmp_path), "-public")
    assert done.returncode == 1 and "not a loopback" not in done.stderr, done.stderr
    assert "listening" not in done.stderr, done.stderr


@pytest.mark.parametrize("data,mode,why", [
    (b"x" * 31, 0o600, "holds 31 bytes"),
    (b"x" * 31 + b"\n", 0o600, "holds 31 bytes"),
    (b"", 0o600, "holds 0 bytes"),
    (b"x" * 40, 0o644, "mode 0600"),
    (b"x" * 40, 0o640, "mode 0600"),
])
def test_webhook_refuses_a_weak_secret_file(tmp_path, harness, data, mode, why):
    done = run_webhook(harness.path, "127.0.0.1:0", write_secret(tmp_path, data, mode))
    assert done.returncode == 1 and why in done.stderr, done.stderr
    assert "listening" not in done.stderr, done.stderr


def test_webhook_refuses_a_linked_secret_file(tmp_path, harness):
    link = os.path.join(str(tmp_path), "link.secret")
    os.symlink(write_secret(tmp_path), link)
    done = run_webhook(harness.path, "127.0.0.1:0", link)
    assert done.returncode == 1 and "symbolic link" in done.stderr, done.stderr


def test_webhook_a_slow_client_is_cut_off_and_holds_nobody_else(tmp_path, harness, hooks):
    """A head that never becomes whole is cut off at the head's own deadline: the request's
    is NEVER here, so a cut within CUT_WAIT is the head's."""
    harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path),
                 constants={"WEBHOOK_REQUEST_SECONDS": NEVER})
    with socket.create_connection(("127.0.0.1", hook.port), timeout=HTTP_SECONDS) as slow:
        slow.sendall(b"GET /runs/run-1/approvals HTTP/1.1\r\nHost: x\r\n")
        assert hook.request("GET", "/runs/run-1/approvals")[0] == 200
        slow.settimeout(CUT_WAIT)
        try:
            while slow.recv(4096):
                pass
        except ConnectionResetError:
            pass                        # cut off; a socket.timeout fails the test


def test_webhook_a_slow_body_is_cut_off_at_the_request_deadline(tmp_path, harness, hooks):
    harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path))
    with socket.create_connection(("127.0.0.1", hook.port), timeout=HTTP_SECONDS) as slow:
        slow.sendall(b"POST /runs/run-1/cancel HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        began = time.monotonic()
        slow.settimeout(ap.WEBHOOK_REQUEST_SECONDS + CUT_WAIT)
        try:
            while slow.recv(4096):
                pass
        except ConnectionResetError:
            pass                        # cut off; a socket.timeout fails the test
        waited = time.monotonic() - began
    # Not at the head's deadline (the head was whole): never early, whatever the load.
    assert waited > ap.WEBHOOK_REQUEST_SECONDS - 3, waited


def test_webhook_idle_connections_in_every_slot_do_not_keep_a_signed_request_out(
        tmp_path, harness, hooks):
    """Idle connections never time out here (their head's deadline is NEVER): a signed
    request that waited for one of their slots would get no answer within HTTP_SECONDS.
    Each connection a slot takes spends a token of the rate (judged before a byte is read),
    so the burst is raised here: this test is about the slots, not the rate."""
    harness.waiting("run-1")
    hook = hooks(harness.path, write_secret(tmp_path),
                 constants={"WEBHOOK_HEAD_SECONDS": NEVER, "WEBHOOK_BURST": 1000})
    idle = [socket.create_connection(("127.0.0.1", hook.port), timeout=HTTP_SECONDS)
            for _ in range(ap.WEBHOOK_MAX_CONNECTIONS + 4)]
    try:
        for _ in range(3):             # each answered, however many sit idle
            status, doc = hook.call("GET", "/runs/run-1/approvals")
            assert status == 200 and doc["total"] == 1, doc
            idle.append(socket.create_connection(("127.0.0.1", hook.port),
                                                 timeout=HTTP_SECONDS))
    finally:
        for sock in idle:
            sock.close()


def readme_recipe() -> list[str]:
    """The README's standard-library signing recipe, as printed there."""
    with open(os.path.join(os.path.dirname(HERE), "README.md")) as f:
        lines = f.read().split("\n")
    first = lines.index("    import hashlib, hmac, json, secrets, time, urllib.request")
    end = lines.index("", first)
    return [line[4:] for line in lines[first:end]]


def test_webhook_readme_recipe_is_ten_lines_that_decide(tmp_path, harness, hooks, monkeypatch):
    a = harness.waiting("run-1")
    secret = write_secret(tmp_path)
    hook = hooks(harness.path, secret)
    recipe = readme_recipe()
    assert len(recipe) == 10, recipe
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    scope: dict = {}
    exec("\n".join(recipe), scope)
    scope["URL"], scope["SECRET_FILE"] = f"http://127.0.0.1:{hook.port}", secret
    shown = scope["call"]("GET", f"/runs/run-1/approvals/{a.id}")["approval"]
    assert shown["hash"] == a.hash
    done = scope["call"]("POST", approve_path("run-1", a.id), decision(a, hash=shown["hash"]))
    assert done["approval"]["status"] == "approved", done
    assert status_of(harness, a) == "approved"


# ---- review findings ----

def edit(path: str, sql: str, params: tuple = ()) -> None:
    import sqlite3
    conn = sqlite3.connect(path)
    try:
        conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


def test_webhook_an_expiry_edited_past_reading_is_an_answer_not_a_dropped_connection(
        tmp_path, harness, hooks):
    a = harness.waiting("run-1")
    edit(harness.path, "UPDATE approvals SET expires_at='tomorrow' WHERE id=?", (a.id,))
    hook = hooks(harness.path, write_secret(tmp_path))
    status, doc = hook.call("GET", f"/runs/run-1/approvals/{a.id}")
    assert status == 410 and doc["code"] == "expired", doc       # an unreadable date is past
    body = json.dumps(decision(a)).encode()
    status, doc = hook.call("POST", approve_path("run-1", a.id), json.loads(body))
    assert status in (409, 410), doc
    assert status_of(harness, a) != "approved"


def test_webhook_a_pending_row_of_a_run_that_no_longer_waits_is_not_listed(
        tmp_path, harness, hooks):
    # An older build's cancel, or an edit, leaves the row pending on a cancelled run.
    a = harness.waiting("run-1")
    edit(harness.path, "UPDATE runs SET status='CANCELLED', reason='operator_cancelled' "
                       "WHERE id='run-1'")
    hook = hooks(harness.path, write_secret(tmp_path))
    status, doc = hook.call("GET", "/runs/run-1/approvals")
    assert status == 200 and doc["approvals"] == [] and doc["total"] == 0, doc
    status, doc = hook.call("GET", f"/runs/run-1/approvals/{a.id}")
    assert status == 409 and doc["code"] == "run_finished", doc
