"""What waits for an operator, and how the operator is told: the `pending` command (text and
-json) against a real proxy process and its database, the query it runs (an index search,
never a scan of every run), and `on_pending`, the notification command the proxy starts when
an approval starts to wait.

The model is told of an approved request not yet collected (gate_status); the commands
printed for the operator carry absolute paths, so that they work from any directory.

Every wait has a deadline; every process a test starts is ended by its pid.
"""

import json
import os
import shlex
import sqlite3
import subprocess
import sys
import time

import pytest

from process_helpers import PROXY, PYTHON, ProcessDir, eventually, is_error, prefix, text
from proxy_harness import ProxyHarness, ap

LEASE = "3s"
# Copies its stdin to the file named by its argument, whole or not at all.
RECORDER = ("import os, sys\n"
            "data = sys.stdin.buffer.read()\n"
            "tmp = sys.argv[1] + '.tmp'\n"
            "with open(tmp, 'wb') as f:\n"
            "    f.write(data)\n"
            "os.replace(tmp, sys.argv[1])\n")
# Writes its pid, then never ends by itself.
NEVER = 600.0          # the command's time when the test must tell it from the call's
HANGER = ("import os, sys, time\n"
          "with open(sys.argv[1] + '.tmp', 'w') as f:\n"
          "    f.write(str(os.getpid()))\n"
          "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
          "time.sleep(600)\n")




def pending_doc(d: ProcessDir) -> list[dict]:
    return d.operator_json("pending")["approvals"]


def decide_lines(out: str) -> list[str]:
    """The commands `pending` prints, without the '(or reject)' after them."""
    return [line.split("decide with: ", 1)[1].rsplit("   (or reject)", 1)[0]
            for line in out.splitlines() if "decide with: " in line]


def script(tmp, name: str, source: str) -> str:
    path = os.path.join(str(tmp), name)
    with open(path, "w") as f:
        f.write(source)
    return path


def read_json_file(path: str):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return json.loads(f.read())


# -- pending --------------------------------------------------------------------------------

def test_pending_lists_what_waits_oldest_first_and_its_command_decides_it(tmp_path, procs):
    d = procs(tmp_path)
    p = d.start()
    first, second = {"to": "ada", "amount": 5}, {"to": "bo", "amount": 7, "mode": "slow"}
    assert prefix(p.call("bank_pay", first)) == "PENDING_APPROVAL"
    assert prefix(p.call("bank_pay", second)) == "PENDING_APPROVAL"
    asked = d.pending()
    assert len(asked) == 2

    entries = pending_doc(d)
    assert [e["approval_id"] for e in entries] == [a["id"] for a in asked]   # oldest first
    e = entries[0]
    assert (e["run_id"], e["kind"], e["tool"], e["server"], e["upstream_tool"],
            e["side_effect"], e["status"], e["blocks_tool"]) == \
        (asked[0]["run_id"], "remote_mutation", "bank_pay", "bank", "pay", "remote_mutation",
         "pending", False)
    assert json.loads(e["arguments"]) == first
    assert e["expires_at"] and e["age_seconds"] >= 0
    assert e["decide"] == (f'{PYTHON} {PROXY} -db "{d.db}" approve {e["run_id"]} '
                           f'-approval {e["approval_id"]}')
    assert f'-db "{d.db}" approve {e["run_id"]} -approval {e["approval_id"]}' in e["decide"]

    assert f"decide with: {e['decide']}   (or reject)" in p.stderr()     # the hint's own
    code, out, err = d.operator("pending")
    assert code == 0, err
    assert out.index(asked[0]["id"]) < out.index(asked[1]["id"])
    assert '{"amount":7,"mode":"slow","to":"bo"}' in out      # in canonical order
    commands = decide_lines(out)
    assert len(commands) == 2

    # The printed command decides it (the operator adds only who decides).
    r = subprocess.run(shlex.split(commands[0]) + ["-by", "operator"], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert f"approval {asked[0]['id']}: approved by operator" in r.stdout
    r = p.call("bank_pay", first)
    assert not is_error(r) and text(r) == "paid 5.00 to ada", text(r)

    assert [x["approval_id"] for x in pending_doc(d)] == [asked[1]["id"]]
    d.reject(asked[1]["run_id"], asked[1]["id"], "no")
    assert pending_doc(d) == []
    code, out, _ = d.operator("pending")
    assert code == 0 and out.strip() == "no approval waits for an operator", out
    p.stop()
    assert d.payments() == 1


def test_pending_leaves_out_an_expired_approval(tmp_path, procs):
    d = procs(tmp_path, approval_ttl="1s")
    p = d.start()
    assert prefix(p.call("bank_pay", {"to": "cy", "amount": 1})) == "PENDING_APPROVAL"
    assert len(pending_doc(d)) == 1
    eventually(lambda: pending_doc(d) == [], 15, "the approval to expire")
    assert d.pending() != []        # still pending in the database: nobody expired it yet
    p.stop()


def test_pending_sanitises_what_the_model_chose(tmp_path, procs):
    d = procs(tmp_path)
    p = d.start()
    hostile = {"to": "eve\x1b]0;owned\x07\u202e\r\nrm -rf ~", "amount": 2}
    assert prefix(p.call("bank_pay", hostile)) == "PENDING_APPROVAL"
    code, out, _ = d.operator("pending")
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out and "\r" not in out
    assert "\\u001b]0;owned\\u0007" in out     # written as JSON escapes
    assert len([line for line in out.splitlines() if "rm -rf" in line]) == 1   # one line
    code, raw, _ = d.operator("-json", "pending")
    assert "\x1b" not in raw and "\u202e" not in raw
    p.stop()


def test_pending_lists_an_approved_uncollected_interruption_grant_as_blocking(tmp_path, procs):
    """After the operator approves the re-run of an unknown outcome, other mutating calls to
    the tool stay BLOCKED until the identical call collects the grant: pending says so."""
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "dan", "amount": 4, "mode": "block"}
    survivor, victim = d.start("survivor"), d.start("victim")
    victim.send_call("bank_pay", args)
    eventually(lambda: d.payments() == 1, 15, "the payment to reach the server")
    run_id = d.runs()[0]["id"]
    victim.crash()
    _, _, until = d.lease(run_id)
    time.sleep(max(0.0, until - time.time()) + 0.2)       # the lease must run out by the clock
    assert prefix(survivor.call("bank_pay", args)) == "INTERRUPTED"
    asked = d.pending()[0]
    assert asked["kind"] == "interrupted_side_effect"

    e, = pending_doc(d)
    assert (e["approval_id"], e["status"], e["blocks_tool"]) == (asked["id"], "pending", True)
    d.approve(run_id, asked["id"])

    e, = pending_doc(d)
    assert (e["approval_id"], e["status"], e["blocks_tool"], e["tool"]) == \
        (asked["id"], "approved", True, "bank_pay")
    assert e["decided_by"] == "operator" and e["decide"] == ""
    assert e["cancel"].endswith(f'-db "{d.db}" cancel {run_id}')
    code, out, _ = d.operator("pending")
    assert code == 0
    assert f"APPROVED  {asked['id']}" in out
    assert "BLOCKS every other call to bank_pay that changes anything, until the identical " \
           "call collects this grant" in out
    r = survivor.call("bank_pay", {"to": "eli", "amount": 1})
    assert prefix(r) == "BLOCKED" and asked["id"] in text(r), text(r)

    d.release()
    r = survivor.call("bank_pay", args)
    assert not is_error(r) and text(r) == "paid 4.00 to dan", text(r)
    assert pending_doc(d) == []
    survivor.stop()
    assert d.payments() == 2


def test_the_waiting_query_searches_indexes_and_reads_no_other_run(tmp_path):
    path = str(tmp_path / "runs.db")
    ap.Store.open(path).close()
    conn = sqlite3.connect(path)
    try:
        conn.execute("ANALYZE")
        plan = [row[-1] for row in conn.execute("EXPLAIN QUERY PLAN " + ap._WAITING_SQL)]
    finally:
        conn.close()
    scans = [step for step in plan if step.startswith("SCAN") and "USING" not in step]
    assert not scans, plan
    assert "SCAN r USING INDEX runs_waiting" in plan, plan      # holds only waiting runs
    assert any(step.startswith("SEARCH a USING INDEX approvals_run") for step in plan), plan


def test_waiting_approvals_come_from_waiting_runs_only(tmp_path):
    """Many finished runs and one waiting: the query returns the waiting one's approval, and
    reading it touches the waiting run only (the partial index holds no finished run)."""
    h = ProxyHarness(tmp_path)
    try:
        for i in range(5):
            r = h.call("bank_pay", {"to": f"p{i}", "amount": 1})
            assert h.prefix(r) == "PENDING_APPROVAL"
            h.decide(h.pending()[-1], approve=False, note="no")
        assert h.prefix(h.call("bank_pay", {"to": "last", "amount": 2})) == "PENDING_APPROVAL"
        waiting = h.store.waiting_approvals()
        assert [a.id for a in waiting] == [a.id for a in h.pending()]
        indexed = h.store._read("SELECT COUNT(*) FROM runs INDEXED BY runs_waiting "
                                f"WHERE status='{ap.WAITING}'")[0][0]
        assert indexed == 1
    finally:
        h.close()


# -- on_pending -----------------------------------------------------------------------------

def test_on_pending_receives_the_json_of_a_waiting_approval(tmp_path, procs):
    got = str(tmp_path / "notified.json")
    recorder = script(tmp_path, "recorder.py", RECORDER)
    d = procs(tmp_path, on_pending=[PYTHON, recorder, got])
    p = d.start()
    args = {"to": "fay", "amount": 3}
    assert prefix(p.call("bank_pay", args)) == "PENDING_APPROVAL"
    doc = eventually(lambda: read_json_file(got), 20, "the notification command's input")
    asked = d.pending()[0]
    assert set(doc) == {"approval_id", "run_id", "kind", "tool", "server", "upstream_tool",
                        "side_effect", "arguments", "argument_fields", "fields_not_shown",
                        "arguments_cut", "asked_by", "figures", "limits", "repeat_of",
                        "late_outcome", "late_outcome_known", "created_at", "expires_at",
                        "read", "decide"}
    assert (doc["asked_by"], doc["figures"]) == ([], [])     # asked by the class alone
    assert doc["limits"] == []                               # the tool has none
    assert doc["argument_fields"] == [{"name": "amount", "value": "3", "omitted_bytes": 0},
                                      {"name": "to", "value": '"fay"', "omitted_bytes": 0}]
    assert (doc["fields_not_shown"], doc["arguments_cut"], doc["late_outcome"]) == (0, False, "")
    assert (doc["approval_id"], doc["run_id"], doc["kind"], doc["tool"], doc["server"],
            doc["upstream_tool"], doc["side_effect"]) == \
        (asked["id"], asked["run_id"], "remote_mutation", "bank_pay", "bank", "pay",
         "remote_mutation")
    assert json.loads(doc["arguments"]) == args
    entry, = pending_doc(d)
    assert doc["decide"] == entry["decide"] and doc["expires_at"] == entry["expires_at"]

    r = subprocess.run(shlex.split(doc["decide"]) + ["-by", "operator"], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    r = p.call("bank_pay", args)
    assert text(r) == "paid 3.00 to fay", text(r)
    p.stop()


def test_on_pending_failing_is_logged_and_changes_nothing(tmp_path, procs):
    d = procs(tmp_path, on_pending=[PYTHON, "-c", "import sys; sys.exit(3)"])
    p = d.start()
    args = {"to": "gus", "amount": 6}
    r = p.call("bank_pay", args)
    assert prefix(r) == "PENDING_APPROVAL" and not is_error(r)
    eventually(lambda: "on_pending: exited with status 3" in p.stderr(), 20,
               "the failure to be logged")
    asked = d.pending()[0]
    d.approve(asked["run_id"], asked["id"])
    assert text(p.call("bank_pay", args)) == "paid 6.00 to gus"
    p.stop()
    assert all(line.startswith("agentrt-proxy: ") for line in p.stderr().splitlines())


def test_on_pending_never_holds_the_call(tmp_path, monkeypatch):
    """The command may run ON_PENDING_TIMEOUT, far longer than the call's own deadline here
    (the harness's): the call is answered while the command still runs."""
    monkeypatch.setattr(ap, "ON_PENDING_TIMEOUT", NEVER)
    pid_file = str(tmp_path / "hanger.pid")
    hanger = script(tmp_path, "hanger.py", HANGER)
    h = ProxyHarness(tmp_path, on_pending=[sys.executable, hanger, pid_file])
    try:
        r = h.call("bank_pay", {"to": "hal", "amount": 1})
        assert h.prefix(r) == "PENDING_APPROVAL"
        pid = int(eventually(lambda: read_text(pid_file), 20, "the command to start"))
        assert alive(pid), "the command ended before the call was answered"
    finally:
        h.close()
        if read_text(pid_file) and alive(int(read_text(pid_file))):
            os.kill(int(read_text(pid_file)), 9)


def test_on_pending_is_killed_after_its_time(tmp_path, monkeypatch):
    monkeypatch.setattr(ap, "ON_PENDING_TIMEOUT", 0.5)
    pid_file = str(tmp_path / "hanger.pid")
    hanger = script(tmp_path, "hanger.py", HANGER)
    h = ProxyHarness(tmp_path, on_pending=[sys.executable, hanger, pid_file])
    try:
        r = h.call("bank_pay", {"to": "hal", "amount": 1})
        assert h.prefix(r) == "PENDING_APPROVAL"
        pid = int(eventually(lambda: read_text(pid_file), 20, "the command to start"))
        eventually(lambda: not alive(pid), 20, "the command to be killed")
        eventually(lambda: any("on_pending: killed after 500ms" in line
                               for line in h.log_lines), 20, "the kill to be logged")
    finally:
        h.close()
        if read_text(pid_file) and alive(int(read_text(pid_file))):
            os.kill(int(read_text(pid_file)), 9)


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


BAD_ON_PENDING = [
    ([], "on_pending must be a non-empty array of non-empty strings"),
    ("notify-send hello", "on_pending must be a non-empty array of non-empty strings"),
    ([1], "on_pending must be a non-empty array of non-empty strings"),
    ([""], "on_pending must be a non-empty array of non-empty strings"),
    (["bin/notify"], 'on_pending: "bin/notify" is a relative path'),
    (["no-such-program-here-7f3a"], 'on_pending: the program "no-such-program-here-7f3a" '
                                    "is not found on PATH"),
    (["/nonexistent/notify"], 'on_pending: "/nonexistent/notify" is not an executable file'),
]


@pytest.mark.parametrize("value,reason", BAD_ON_PENDING, ids=[r for _, r in BAD_ON_PENDING])
def test_on_pending_is_refused_unless_it_is_a_program_and_its_arguments(tmp_path, value,
                                                                       reason):
    doc = {"database": "runs.db", "session": "s", "on_pending": value,
           "servers": [{"name": "bank", "command": ["x"], "manifest": "m.json"}]}
    with pytest.raises(ap.ConfigError) as exc:
        ap.parse_config(json.dumps(doc).encode(), str(tmp_path / "proxy.json"))
    assert reason in str(exc.value)


def test_on_pending_names_a_program_on_path_by_where_it_was_found(tmp_path):
    doc = {"database": "runs.db", "session": "s", "on_pending": ["sh", "-c", "true"],
           "servers": [{"name": "bank", "command": ["x"], "manifest": "m.json"}]}
    cfg = ap.parse_config(json.dumps(doc).encode(), str(tmp_path / "proxy.json"))
    assert os.path.isabs(cfg.on_pending[0]) and cfg.on_pending[1:] == ("-c", "true")


def test_a_database_from_before_the_index_is_migrated_and_refused_until_then(tmp_path):
    """Version 1 had no runs_waiting: the proxy's open adds it; an operator command, which
    never migrates, says to start the proxy first."""
    path = str(tmp_path / "runs.db")
    ap.Store.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX runs_waiting")
    conn.execute("DELETE FROM schema_migrations WHERE version=2")
    conn.commit()
    conn.close()
    with pytest.raises(ap.SchemaVersionError) as exc:
        ap.Store.open_existing(path, readonly=True)
    assert "start the proxy that owns it once to migrate it" in str(exc.value)
    ap.Store.open(path).close()
    conn = sqlite3.connect(path)
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    finally:
        conn.close()
    assert "runs_waiting" in names
    store = ap.Store.open_existing(path, readonly=True)
    try:
        assert store.waiting_approvals() == []
    finally:
        store.close()


def test_pending_summary_is_in_canonical_order_so_padding_hides_no_field():
    # The model orders its members: padding a first field must not push the amount past
    # the cut of the one-line summary.
    raw = json.dumps({"zz_memo": "x" * 400, "amount": 9999, "to": "mallory"}).encode()
    summary = ap.args_summary(*ap.args_fields(raw))
    assert summary.startswith('{"amount":9999,"to":"mallory","zz_memo":"xxx'), summary
    assert len(summary.encode()) <= ap.PENDING_ARGS_BYTES + 16


# -- what waits for the model, and the commands printed -------------------------------------

PAY, STATUS = "bank_pay", "gate_status"


@pytest.fixture
def make(harnesses):
    return harnesses


def test_gate_status_lists_an_approved_grant_not_yet_collected(make):
    """The model was told "nothing waits" while its approved call waited for it."""
    h = make()
    args = {"to": "landlord", "amount": 950}
    r = h.call(PAY, args)
    assert h.prefix(r) == "PENDING_APPROVAL"
    (asked,) = h.pending()
    h.decide(asked, approve=True)
    said = h.text(h.call(STATUS, {}))
    assert "no request in this session is waiting" in said, said
    assert "1 approved request waits for you to collect it" in said, said
    assert asked.id in said and "exactly the same arguments" in said, said
    assert h.payments() == 0
    assert h.text(h.call(PAY, args)) == "paid 950.00 to landlord"
    said = h.text(h.call(STATUS, {}))
    assert "approved request" not in said and asked.id not in said, said


def test_printed_commands_carry_absolute_paths(make, tmp_path, monkeypatch):
    """`pending -db proxy.db` printed a relative -db, which worked only from there."""
    h = make()
    h.call(PAY, {"to": "bob", "amount": 5})
    monkeypatch.chdir(h.tmp)
    import io
    out, err = io.StringIO(), io.StringIO()
    assert ap.main(["-db", "runs.db", "pending"], stdout=out, stderr=err) == 0, err.getvalue()
    decide = next(line for line in out.getvalue().splitlines() if "decide with:" in line)
    assert f'-db "{h.cfg.database}"' in decide, decide
    out = io.StringIO()
    assert ap.main(["-db", "runs.db", "-json", "pending"], stdout=out, stderr=err) == 0
    doc = json.loads(out.getvalue())["approvals"][0]
    assert f'-db \\"{h.cfg.database}\\"' in json.dumps(doc["decide"]) and \
        f'-db \\"{h.cfg.database}\\"' in json.dumps(doc["read"]), doc


# ---- What waits, faults found in review ------------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

import http.server  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402

from proxy_harness import operator  # noqa: E402


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


def test_pending_keeps_the_payee_in_view_when_an_earlier_field_is_padded(padded):
    """The third review, finding 2: `pending` cut the key-sorted one-line arguments at 160
    bytes, so a padded field pushed the payee out of `pending`, `pending -json`, the on_pending
    document and the chat recipe, right above a line that approves without a prompt. Now every
    field keeps its key and the start of its value."""
    code, out, err = operator(padded, "pending")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("arguments "))
    assert '"to":"mallory"' in line and '"amount":25' in line, line
    assert '"currency":"EUR[240 x \' \']"' in line, line


def test_a_long_value_is_cut_on_its_own_and_the_full_view_is_named(padded):
    """The third review, finding 2: `pending` cut the key-sorted one-line arguments at 160
    bytes, so a padded field pushed the payee out of `pending`, `pending -json`, the on_pending
    document and the chat recipe, right above a line that approves without a prompt. Now each
    field is cut on its own with the bytes it left out, and the full view is named."""
    long = {"currency": "EUR" + "-x" * 150, "amount": 3, "to": "mallory"}
    assert padded.prefix(padded.call("bank_pay", long)) == "PENDING_APPROVAL"
    code, out, err = operator(padded, "pending")
    lines = [x for x in out.splitlines() if x.strip().startswith("arguments ")]
    assert len(lines) == 2 and all('"to":"mallory"' in x for x in lines), lines
    assert re.search(r'"currency":"EUR(-x)+\u2026\[\+\d+ bytes\]', lines[1]), lines[1]
    assert out.count("NOT ALL SHOWN") == 1 and " show " in out, out


def test_pending_json_and_on_pending_name_every_field(padded):
    """The third review, finding 2: `pending` cut the key-sorted one-line arguments at 160
    bytes, so a padded field pushed the payee out of `pending`, `pending -json`, the on_pending
    document and the chat recipe, right above a line that approves without a prompt. Now
    `pending -json` and the on_pending document name every field, as `pending` shows it."""
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
    """The third review, finding 2: `pending` cut the key-sorted one-line arguments at 160
    bytes, so a padded field pushed the payee out of `pending`, `pending -json`, the on_pending
    document and the chat recipe, right above a line that approves without a prompt. Now what
    does not fit is counted and pointed to."""
    raw = json.dumps({**{f"a{i:03d}": i for i in range(200)}, "to": "mallory"}).encode()
    fields, more = ap.args_fields(raw)
    assert more > 0 and len(fields) + more == 201
    summary = ap.args_summary(*ap.args_fields(raw))
    assert summary.endswith(f"and {more} more fields not shown here"), summary
    assert len(summary.encode()) <= ap.PENDING_ARGS_BYTES + 64
    long_key = json.dumps({"k" * 500: 1, "to": "mallory"}).encode()
    fields, more = ap.args_fields(long_key)
    assert more == 0 and [f["name"][:3] for f in fields] == ["kkk", "to"]
    assert fields[0]["name_omitted_bytes"] == 500 - ap.PENDING_KEY_BYTES


def test_the_readme_chat_recipe_shows_the_payee(padded, tmp_path):
    """The third review, finding 2: `pending` cut the key-sorted one-line arguments at 160
    bytes, so a padded field pushed the payee out of `pending`, `pending -json`, the on_pending
    document and the chat recipe, right above a line that approves without a prompt.

    The README's on_pending recipe for a chat webhook, run as written against a local
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


def test_drift_notices_never_crowd_out_an_approval_notice(tmp_path):
    """The third review, on_pending's slots: drift notices can no longer take the slots approval
    notices need.

    A slow hook and a server that keeps changing its tools: drift notices run in slots of
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
    """The third review, on_pending's slots: a notice still queued when the notifier closes
    never starts, and is logged as not started."""
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
