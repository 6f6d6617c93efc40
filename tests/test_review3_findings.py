"""The third review's findings 2 and 3, and on_pending's slots; finding 1, a late success
paid again, is tests/test_late_outcome.py.

2. `pending` cut the key-sorted one-line arguments at 160 bytes, so a padded field pushed the
   payee out of `pending`, `pending -json`, the on_pending document and the chat recipe,
   right above a line that approves without a prompt. Now every field keeps its key and the
   start of its value, each cut on its own with the bytes it left out, and what does not fit
   is counted and pointed to.
3. Operator commands and the webhook opened a database another user owns. Now every opener
   applies serving's owner check.
And: drift notices can no longer take the slots approval notices need.
"""

import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proxy_harness import ProxyHarness  # noqa: E402

import agentrt_proxy as ap  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PADDED = {"currency": "EUR" + " " * 240, "amount": 25, "to": "mallory"}


@pytest.fixture
def padded(tmp_path):
    """A proxy with a payment waiting whose currency the model padded."""
    h = ProxyHarness(tmp_path)
    try:
        assert h.prefix(h.call("bank_pay", PADDED)) == "PENDING_APPROVAL"
        yield h
    finally:
        h.close()


def operator(h, *argv):
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, *argv], stdin=io.StringIO(), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


# ---- 2. no summary drops a field ----------------------------------------------------------

def test_pending_keeps_the_payee_in_view_when_an_earlier_field_is_padded(padded):
    code, out, err = operator(padded, "pending")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("arguments "))
    assert '"to":"mallory"' in line and '"amount":25' in line, line
    assert '"currency":"EUR[240 x \' \']"' in line, line


def test_a_long_value_is_cut_on_its_own_and_the_full_view_is_named(padded):
    long = {"currency": "EUR" + "-x" * 150, "amount": 3, "to": "mallory"}
    assert padded.prefix(padded.call("bank_pay", long)) == "PENDING_APPROVAL"
    code, out, err = operator(padded, "pending")
    lines = [x for x in out.splitlines() if x.strip().startswith("arguments ")]
    assert len(lines) == 2 and all('"to":"mallory"' in x for x in lines), lines
    assert re.search(r'"currency":"EUR(-x)+\u2026\[\+\d+ bytes\]', lines[1]), lines[1]
    assert out.count("NOT ALL SHOWN") == 1 and " show " in out, out


def test_pending_json_and_on_pending_name_every_field(padded):
    code, out, err = operator(padded, "-json", "pending")
    entry = json.loads(out)["approvals"][0]
    assert '"to":"mallory"' in entry["arguments"], entry
    fields = {f["name"]: f for f in entry["argument_fields"]}
    assert set(fields) == {"amount", "currency", "to"}
    assert fields["to"] == {"name": "to", "value": '"mallory"', "omitted_bytes": 0}
    assert fields["currency"] == {"name": "currency", "value": '"EUR[240 x \' \']"',
                                  "omitted_bytes": 0}
    assert entry["arguments_cut"] is False and entry["fields_not_shown"] == 0
    approval = padded.pending()[0]
    doc = ap.waiting_doc(approval, padded.cfg.database, ap.view_of(padded.store, approval))
    assert doc["argument_fields"] == entry["argument_fields"]
    assert doc["arguments"] == entry["arguments"] and entry["read"] == doc["read"]


def test_many_fields_are_counted_and_pointed_to_never_dropped_silently():
    raw = json.dumps({**{f"a{i:03d}": i for i in range(200)}, "to": "mallory"}).encode()
    fields, more = ap.args_fields(raw)
    assert more > 0 and len(fields) + more == 201
    summary = ap.args_summary(raw)
    assert summary.endswith(f"and {more} more fields not shown here"), summary
    assert len(summary.encode()) <= ap.PENDING_ARGS_BYTES + 64
    long_key = json.dumps({"k" * 500: 1, "to": "mallory"}).encode()
    fields, more = ap.args_fields(long_key)
    assert more == 0 and [f["name"][:3] for f in fields] == ["kkk", "to"]
    assert fields[0]["name_omitted_bytes"] == 500 - ap.PENDING_KEY_BYTES


def test_the_readme_chat_recipe_shows_the_payee(padded, tmp_path):
    """The README's on_pending recipe for a chat webhook, run as written against a local
    stand-in for the chat service, with the padded payment's document on its stdin."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    at = readme.index("notify_chat.py")
    code = readme[readme.index("```python\n", at) + 10:readme.index("```", readme.index(
        "```python\n", at) + 10)]
    got = []

    class Chat(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Chat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        script = tmp_path / "notify_chat.py"
        script.write_text(code)
        url = tmp_path / "chat-webhook-url"
        url.write_text(f"http://127.0.0.1:{server.server_address[1]}/hook\n")
        approval = padded.pending()[0]
        doc = ap.waiting_doc(approval, padded.cfg.database, ap.view_of(padded.store, approval))
        p = subprocess.run([sys.executable, str(script), str(url)], input=ap.dump_json(doc),
                           text=True, capture_output=True, timeout=30)
        assert p.returncode == 0, p.stderr
    finally:
        server.shutdown()
    text = json.loads(got[0])["text"]
    assert '"to":"mallory"' in text and "currency" in text, text


# ---- 3. every opener applies the owner check --------------------------------------------

@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_operator_commands_and_the_webhook_refuse_a_database_another_user_owns(tmp_path):
    from test_webhook import write_secret

    h = ProxyHarness(tmp_path)
    try:
        assert h.prefix(h.call("bank_pay", {"to": "bob", "amount": 1})) == "PENDING_APPROVAL"
        approval = h.pending()[0]
    finally:
        h.close()
    db = h.cfg.database
    for name in (db, db + "-wal", db + "-shm"):
        if os.path.exists(name):
            os.chown(name, 65534, 65534)
    for argv in (["verify"], ["pending"], ["runs"], ["show", approval.run_id],
                 ["approve", approval.run_id, "-approval", approval.id, "-by", "root"]):
        code, out, err = operator(h, *argv)
        assert code == 1 and "owned by uid 65534" in err, (argv, code, out, err)
    secret = write_secret(tmp_path)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "agentrt_proxy.py"), "-db", db,
                        "webhook", "-listen", "127.0.0.1:0", "-secret-file", secret],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "owned by uid 65534" in p.stderr, p.stderr
    for name in (db, db + "-wal", db + "-shm"):
        if os.path.exists(name):
            os.chown(name, 0, 0)
    assert operator(h, "verify")[0] == 0
    assert "approval.decided" not in [e[4] for e in ap.Store.open_existing(
        db, readonly=True).list_events(approval.run_id)]


# ---- on_pending: drift notices have slots of their own ------------------------------------

def test_drift_notices_never_crowd_out_an_approval_notice(tmp_path):
    """A slow hook and a server that keeps changing its tools: drift notices run in slots of
    their own (the rest are skipped, logged), and every approval notice runs, those past the
    running bound queued until a slot frees up."""
    seen = tmp_path / "seen"
    seen.mkdir()
    hook = tmp_path / "hook.py"
    hook.write_text("import json, os, sys, time\n"
                    "doc = json.load(sys.stdin)\n"
                    "name = doc.get('approval_id') or 'drift-%d' % os.getpid()\n"
                    f"open(os.path.join({str(seen)!r}, name), 'w').close()\n"
                    "time.sleep(0.6)\n")
    logged = []
    n = ap.Notifier([sys.executable, str(hook)], logged.append)
    try:
        for i in range(6):
            n.notify(f"drift of server s{i}", lambda: {"kind": "drift"}, drift=True)
        wanted = [f"{i:032x}" for i in range(ap.ON_PENDING_RUNNING + 4)]
        for aid in wanted:
            n.notify(aid, lambda aid=aid: {"approval_id": aid})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and \
                not set(wanted) <= set(os.listdir(seen)):
            time.sleep(0.05)
    finally:
        n.close()
    names = set(os.listdir(seen))
    assert set(wanted) <= names, (sorted(names), logged)
    assert len([x for x in names if x.startswith("drift-")]) == ap.ON_PENDING_DRIFT_RUNNING
    assert sum("drift notices are still running" in line for line in logged) == \
        6 - ap.ON_PENDING_DRIFT_RUNNING, logged
    assert not any("approval" in line and "not started" in line for line in logged), logged


def test_nothing_queued_starts_after_close(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    hook = tmp_path / "hook.py"
    hook.write_text("import json, os, sys, time\n"
                    "doc = json.load(sys.stdin)\n"
                    f"open(os.path.join({str(seen)!r}, doc['approval_id']), 'w').close()\n"
                    "time.sleep(30)\n")
    logged = []
    n = ap.Notifier([sys.executable, str(hook)], logged.append)
    for i in range(ap.ON_PENDING_RUNNING + 3):
        n.notify(f"{i:032x}", lambda i=i: {"approval_id": f"{i:02d}"})
    deadline = time.monotonic() + 20
    while len(os.listdir(seen)) < ap.ON_PENDING_RUNNING and time.monotonic() < deadline:
        time.sleep(0.05)
    n.close()
    started = set(os.listdir(seen))
    time.sleep(1.5)                 # a queued notice would have been started by now
    assert set(os.listdir(seen)) == started and len(started) == ap.ON_PENDING_RUNNING
    assert any("3 queued notice(s) not started" in line for line in logged), logged
    with n._lock:
        assert all(p.poll() is not None for p in n._running.values())
