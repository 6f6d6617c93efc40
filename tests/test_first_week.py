"""The first week of a new operator (issue: no dead ends, nothing pasted by hand, the trail
shows every refusal): each friction met, replayed from a host or the command line as the
user met it.
"""

import json

import pytest

from proxy_harness import ProxyHarness, ap

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


class _ClosedAfter:
    """A stdout whose reader goes away after ``n`` bytes, as `runs | head` does."""

    def __init__(self, n: int, fd: int):
        self.n, self.fd, self.written = n, fd, 0

    def write(self, text: str) -> int:
        self.written += len(text)
        if self.written > self.n:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self.fd


def test_a_closed_stdout_ends_the_command_quietly(make, tmp_path):
    import io
    import os
    h = make(rules={"balance": {"side_effect": "read_only", "timeout": "10s"}})
    for i in range(5):
        h.call("bank_balance", {"account": f"a-{i}"})
    r, w = os.pipe()
    try:
        out, err = _ClosedAfter(100, w), io.StringIO()
        code = ap.main(["-db", h.cfg.database, "runs"], stdout=out, stderr=err)
        assert code == 1 and err.getvalue() == "", err.getvalue()
    finally:
        os.close(r)
        os.close(w)


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


def test_a_duplicate_of_a_structured_result_quotes_the_text_the_model_read(make):
    h = make(rules={"pay": {"side_effect": "remote_mutation", "timeout": "10s",
                            "outcome": "allow"}})
    args = {"to": "bob", "amount": 5, "mode": "structured"}
    first = h.call(PAY, args)
    assert h.text(first) == "paid 5.00 to bob" and "structuredContent" in first, first
    r = h.call(PAY, args)
    assert h.prefix(r) == "DUPLICATE", h.text(r)
    assert h.text(r).endswith("The earlier call's outcome: it succeeded: paid 5.00 to bob"), \
        h.text(r)


def _checked(tmp_path, cli, rules, *flags):
    from proxy_harness import write_config
    h = ProxyHarness(tmp_path, rules=rules)          # pins the manifest, then closes
    h.close()
    return cli("check", "-config", write_config(str(tmp_path), rules), *flags)


def test_check_ends_with_a_summary_naming_each_refusal(tmp_path, cli):
    """check hid a refused tool among a hundred lines; -strict fails on one."""
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s",
                     "rename": "bank_balance"},                      # taken: refused
             "refund": {"side_effect": "destructive", "timeout": "10s"}}
    code, out, err = _checked(tmp_path, cli, rules)
    assert code == 0, err
    lines = out.splitlines()
    summary = lines.index(next(l for l in lines if l.startswith("summary: ")))
    assert lines[summary] == ("summary: 2 tool(s) offered (1 of them denied on every call), "
                              "1 classified by a rule but refused, 0 unclassified (no rule)")
    assert lines[summary + 1].startswith('REFUSED bank: pay: the name "bank_balance" is '
                                         'already taken'), lines[summary + 1]
    assert lines[summary + 2] == ("DENIED ON EVERY CALL bank_refund: by its class "
                                  "destructive, which the policy denies")
    code, _, _ = cli("check", "-config", str(tmp_path / "proxy.json"), "-strict")
    assert code == 1


def test_check_strict_passes_when_nothing_is_refused(tmp_path, cli):
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "deny"}}
    code, out, err = _checked(tmp_path, cli, rules, "-strict")
    assert code == 0, err
    assert "DENIED ON EVERY CALL bank_pay: by its rule" in out
    assert "summary: 2 tool(s) offered (1 of them denied on every call), 0 classified by a " \
           "rule but refused, 1 unclassified (no rule)" in out, out


def test_refusals_are_recorded_against_the_run_they_name_and_coalesced(make, cli):
    """A DUPLICATE left no trace; 200 identical ones now move one counter."""
    h = make(rules={"pay": {"side_effect": "remote_mutation", "timeout": "10s",
                            "outcome": "allow"}})
    args = {"to": "bob", "amount": 5}
    assert not h.is_error(h.call(PAY, args))
    (earlier,) = h.runs()
    for _ in range(200):
        assert h.prefix(h.call(PAY, args)) == "DUPLICATE"
    (rows,) = h.store._read("SELECT count(*) FROM proxy_refusals", ())
    assert rows == (1,)
    code, out, err = cli("-db", h.cfg.database, "show", earlier.id)
    assert code == 0, err
    assert "refused 200 time(s) as DUPLICATE, first " in out and ", last " in out, out
    code, out, err = cli("-db", h.cfg.database, "-json", "events", earlier.id)
    (refusal,) = json.loads(out)["refusals"]
    assert refusal["count"] == 200 and refusal["answer"] == "DUPLICATE"
    assert refusal["first_at"] <= refusal["last_at"]
    code, out, err = cli("-db", h.cfg.database, "events", earlier.id)
    assert "calls of this request refused 200 time(s) as DUPLICATE" in out, out


def test_a_repeated_rejection_and_a_block_are_recorded(make, cli):
    h = make(max_pending=1)
    args = {"to": "eve", "amount": 7}
    h.call(PAY, args)
    (asked,) = h.pending()
    r = h.call(PAY, {"to": "fay", "amount": 8})            # one waits already: max_pending
    assert h.prefix(r) == "BLOCKED", h.text(r)
    h.decide(asked, approve=False, note="not this month", by="pat")
    for _ in range(3):
        assert h.prefix(h.call(PAY, args)) == "REJECTED"
    code, out, err = cli("-db", h.cfg.database, "-json", "show", asked.run_id)
    doc = json.loads(out)
    assert doc["run"]["why"] == "rejected by pat", doc["run"]
    assert {(r["answer"], r["count"]) for r in doc["refusals"]} == {("BLOCKED", 1),
                                                                    ("REJECTED", 3)}
    code, out, err = cli("-db", h.cfg.database, "runs")
    assert "rejected by pat" in out, out


def test_runs_say_plainly_why_a_run_ended(make, cli):
    h = make(rules={"balance": {"side_effect": "read_only", "timeout": "10s"},
                    "pay": {"side_effect": "remote_mutation", "timeout": "10s",
                            "outcome": "deny"}})
    assert h.prefix(h.call(PAY, {"to": "bob", "amount": 5})) == "DENIED"
    assert not h.is_error(h.call("bank_balance", {"account": "A"}))
    code, out, err = cli("-db", h.cfg.database, "-json", "runs")
    whys = {r["goal"]: r["why"] for r in json.loads(out)["runs"]}
    assert whys == {"call bank_pay": "denied by policy", "call bank_balance": "completed"}
    code, out, err = cli("-db", h.cfg.database, "show", next(
        r.id for r in h.runs() if r.goal == "call bank_pay"))
    assert "ended   denied by policy" in out, out


# -- the five-server story, end to end --

def test_first_week_five_servers_wrap_check_serve_ask_approve_repeat_audit(tmp_path, cli):
    """The new user's story, replayed: a Claude Desktop file with five servers (stand-ins for
    filesystem, memory, git and everything, and the fake payment server), wrapped with the
    suggested rules, checked, served to a host, read, asked, approved, repeated with `ask`,
    and audited, from the command line as the user met it."""
    import os
    import re
    import subprocess
    import sys
    from conftest import ROOT
    from process_helpers import ProxyProcess, text, prefix
    standin = os.path.join(ROOT, "tests", "standin_server.py")
    ledger = str(tmp_path / "standin.ledger")

    def stand_in(kind):
        return {"command": sys.executable, "args": [standin],
                "env": {"STANDIN_KIND": kind, "STANDIN_LEDGER": ledger}}
    host = tmp_path / "Claude" / "claude_desktop_config.json"
    host.parent.mkdir()
    host.write_text(json.dumps({"mcpServers": {
        "filesystem": stand_in("filesystem"), "memory": stand_in("memory"),
        "git": stand_in("git"), "everything": stand_in("everything"),
        "bank": {"command": sys.executable,
                 "args": [os.path.join(ROOT, "fake_payment_server.py")],
                 "env": {"FAKE_PAYMENTS_LEDGER": str(tmp_path / "bank.ledger")}}}}))
    gate = tmp_path / "gate"
    gate.mkdir()
    config = str(gate / "proxy.json")
    # wrap: a dry run writes nothing; -write -rules suggested writes the printed rules.
    code, out, err = cli("wrap", "-host", "claude", "-host-config", str(host), "-config",
                         config)
    assert code == 0 and os.listdir(gate) == [], err
    code, out, err = cli("wrap", "-host", "claude", "-host-config", str(host), "-config",
                         config, "-write", "-rules", "suggested")
    assert code == 0, err
    with open(config) as f:
        rules = {s["name"]: s["rules"] for s in json.load(f)["servers"]}
    assert rules["git"]["git_commit"] == {"side_effect": "local_mutation", "repeat": "ask",
                                          "rename": "git_commit"}
    assert "refund" not in rules["bank"]         # denied on every call: left out
    assert '"refund": {"side_effect": "destructive", "outcome": "require_approval"}' in out
    # check: every tool named, nothing refused, none offered only to be denied.
    code, out, err = cli("check", "-config", config, "-strict")
    assert code == 0, err
    assert "0 classified by a rule but refused" in out, out
    assert "(0 of them denied on every call)" in out, out

    class Dir:                                   # what ProxyProcess needs of a directory
        tmp, procs = str(gate), []
    Dir.config = config
    p = ProxyProcess(Dir, "host")
    try:
        p.initialize()
        listed = {t["name"] for t in p.request("tools/list", {})["result"]["tools"]}
        assert {"filesystem_read_file", "git_commit", "git_status", "memory_read_graph",
                "everything_echo", "bank_pay", "gate_status"} <= listed, listed
        assert "bank_refund" not in listed
        # read
        assert text(p.call("filesystem_read_file", {"path": "/notes.txt"})) == \
            "read_file done"
        # ask, approve from a shell, collect once
        pay = {"to": "landlord", "amount": 950}
        r = p.call("bank_pay", pay)
        assert prefix(r) == "PENDING_APPROVAL", text(r)
        (aid,) = re.findall(r"approval ([0-9a-f]{32})", text(r))
        code, out, err = cli("-db", str(gate / "proxy.db"), "approve", "-approval", aid,
                             "-by", "pat")
        assert code == 0, err
        assert text(p.call("bank_pay", pay)) == "paid 950.00 to landlord"
        # repeat with ask: a second identical commit asks, naming the first; approved, it runs
        commit = {"repo_path": "/r", "message": "fix typo"}
        assert text(p.call("git_commit", commit)) == "git_commit done"
        r = p.call("git_commit", commit)
        assert prefix(r) == "PENDING_APPROVAL" and "already executed" in text(r), text(r)
        code, out, err = cli("-db", str(gate / "proxy.db"), "pending")
        assert "  repeat  git_commit" in out and "REPEAT: this exact request already " \
            "executed" in out, out
        (aid,) = re.findall(r"approval ([0-9a-f]{32})", text(r))
        code, out, err = cli("-db", str(gate / "proxy.db"), "approve", "-approval", aid,
                             "-by", "pat")
        assert code == 0, err
        assert text(p.call("git_commit", commit)) == "git_commit done"
        with open(ledger) as f:
            commits = [json.loads(line) for line in f if '"git_commit"' in line]
        assert len(commits) == 2
        # a rejected repeat is refused again, and the trail keeps it
        r = p.call("git_commit", commit)
        (aid,) = re.findall(r"approval ([0-9a-f]{32})", text(r))
        code, out, err = cli("-db", str(gate / "proxy.db"), "reject", "-approval", aid,
                             "-by", "pat", "-note", "enough commits")
        assert code == 0, err
        for _ in range(3):
            r = p.call("git_commit", commit)
            assert prefix(r) == "REJECTED" and "enough commits" in text(r), text(r)
        p.stop()
    finally:
        p.kill()
    code, out, err = cli("-db", str(gate / "proxy.db"), "-json", "runs")
    whys = [(r["goal"], r["why"]) for r in json.loads(out)["runs"]]
    assert ("call git_commit", "rejected by pat") in whys, whys
    rejected = next(r["id"] for r in json.loads(out)["runs"] if r["why"] == "rejected by pat")
    code, out, err = cli("-db", str(gate / "proxy.db"), "show", rejected)
    assert "ended   rejected by pat" in out and "refused 3 time(s) as REJECTED" in out, out


def test_an_expired_request_refused_again_is_recorded(make, cli):
    h = make(approval_ttl="1m")
    args = {"to": "gus", "amount": 9}
    assert h.prefix(h.call(PAY, args)) == "PENDING_APPROVAL"
    (asked,) = h.pending()
    h.clock.skew += 120                                   # the approval expires unanswered
    assert h.prefix(h.call(PAY, args)) == "EXPIRED"
    assert h.prefix(h.call(PAY, args)) == "EXPIRED"
    code, out, err = cli("-db", h.cfg.database, "-json", "show", asked.run_id)
    doc = json.loads(out)
    assert doc["run"]["why"] == "its approval expired", doc["run"]
    assert [(r["answer"], r["count"]) for r in doc["refusals"]] == [("EXPIRED", 2)], doc


def test_a_call_blocked_by_an_unknown_outcome_is_recorded_against_the_run_that_blocks(
        make, cli):
    h = make(rules={"pay": {"side_effect": "remote_mutation", "timeout": "1s",
                            "outcome": "allow"}})
    cut = {"to": "hal", "amount": 3, "mode": "block"}
    h.call(PAY, cut)                                       # times out: outcome unknown
    h.release()
    assert h.prefix(h.call(PAY, cut)) == "UNKNOWN_OUTCOME"
    (asked,) = h.pending()
    for amount in (4, 4):
        r = h.call(PAY, {"to": "ivy", "amount": amount})
        assert h.prefix(r) == "BLOCKED", h.text(r)
    code, out, err = cli("-db", h.cfg.database, "show", asked.run_id)
    assert "calls   refused 2 time(s) as BLOCKED" in out, out
