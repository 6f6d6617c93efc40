"""The operator decides by what they have, against a real proxy process and its database.

- `approve -approval ID` alone decides (the approval names its run), and a call the proxy
  still holds completes in place; `approve`'s output says so.
- An approval id given where a run id belongs is recognised and its run named.
- Approving from a shell where $USER is unset works without -by.
- Cancel resolves what it ends: `show -json` and `gate_status` agree nothing waits, the
  session's max_pending no longer counts it, and `approve` refuses before printing a block.
- After an operator approves the re-run of an unknown outcome, another mutating call to the
  tool is BLOCKED with a text naming what it now waits for: the identical call.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess

import pytest

from process_helpers import PROXY, PYTHON, ProcessDir, eventually
from proxy_harness import ProxyHarness

STATUS = "gate_status"


@pytest.fixture
def pdir(tmp_path):
    d = ProcessDir(tmp_path, hold="30s")
    yield d
    d.cleanup()


def operator(d: ProcessDir, *argv: str, env: dict | None = None):
    p = subprocess.run([PYTHON, PROXY, "-db", d.db, *argv], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60, cwd=d.tmp, env=env)
    return p.returncode, p.stdout, p.stderr


def waiting(d: ProcessDir) -> dict:
    """The one approval that waits, once the proxy has recorded it."""
    def found():
        try:
            return os.path.exists(d.db) and d.pending()
        except sqlite3.Error:            # the proxy is still creating its schema
            return False
    return eventually(found, 30, "the approval to wait")[0]


def text_of(result: dict) -> str:
    return result["content"][0]["text"]


def test_approve_with_the_approval_id_alone_completes_the_held_call(pdir):
    p = pdir.start()
    ident = p.send_call("bank_pay", {"to": "bob", "amount": 5})
    approval = waiting(pdir)
    code, out, err = operator(pdir, "approve", "-approval", approval["id"], "-by", "ann")
    assert code == 0, err
    assert f"approval {approval['id']}: approved by ann" in out
    assert "the next identical call runs it" in out and "still holds runs it now" in out
    result = p.result(ident, timeout=30)
    assert not result.get("isError"), result
    assert text_of(result) == "paid 5.00 to bob"
    assert pdir.payments() == 1
    again = p.call("bank_pay", {"to": "bob", "amount": 5})
    assert text_of(again).startswith("DUPLICATE:")
    assert pdir.payments() == 1


def test_an_approval_id_given_as_the_run_is_recognised(pdir):
    p = pdir.start()
    p.send_call("bank_pay", {"to": "cy", "amount": 2})
    approval = waiting(pdir)
    for command in (("show",), ("events",), ("cancel",)):
        code, out, err = operator(pdir, *command, approval["id"], "-by", "ann") \
            if command == ("cancel",) else operator(pdir, *command, approval["id"])
        assert code == 1, (command, out, err)
        assert f"{approval['id']} is an approval id" in err, err
        assert f"approval of run {approval['run_id']}" in err, err
    assert pdir.pending()[0]["status"] == "pending"      # the refused cancel changed nothing
    # approve takes it as the approval; without -approval or -yes it still asks for consent
    code, out, err = operator(pdir, "approve", approval["id"], "-by", "ann")
    assert code == 2 and "-yes" in err, err
    code, out, err = operator(pdir, "approve", approval["id"], "-by", "ann", "-yes")
    assert code == 0, err
    assert f"run {approval['run_id']}" in out
    eventually(lambda: pdir.payments() == 1, 30, "the held call to complete")


def test_approve_and_reject_need_a_run_or_an_approval(pdir):
    for verb in ("approve", "reject"):
        code, out, err = operator(pdir, verb, "-by", "ann")
        assert code == 2 and "-approval ID" in err, err


def test_approving_where_user_is_unset_works_without_by(pdir):
    p = pdir.start()
    ident = p.send_call("bank_pay", {"to": "dee", "amount": 3})
    approval = waiting(pdir)
    env = {k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME")}
    code, out, err = operator(pdir, "approve", "-approval", approval["id"], env=env)
    assert code == 0, err
    import pwd
    name = pwd.getpwuid(os.getuid()).pw_name
    assert f"approved by {name}" in out
    assert text_of(p.result(ident, timeout=30)) == "paid 3.00 to dee"


def test_cancel_resolves_the_approval_it_ends(tmp_path):
    d = ProcessDir(tmp_path, hold="0s", max_pending=1)
    try:
        p = d.start()
        first = p.call("bank_pay", {"to": "eve", "amount": 4})
        assert text_of(first).startswith("PENDING_APPROVAL:")
        approval = d.pending()[0]
        blocked = p.call("bank_pay", {"to": "fay", "amount": 1})
        assert text_of(blocked).startswith("BLOCKED:") and "1 requests" in text_of(blocked)
        code, out, err = operator(d, "cancel", approval["run_id"], "-by", "ann", "-note", "no")
        assert code == 0, err
        shown = d.show(approval["run_id"])
        assert shown["run"]["status"] == "CANCELLED"
        assert shown["run"]["pending_approval_id"] == ""
        assert [a["status"] for a in shown["approvals"]] == ["cancelled"]
        assert d.pending() == []
        assert d.operator_json("pending")["approvals"] == []
        status = text_of(p.call(STATUS, {"approval_id": approval["id"]}))
        assert "CANCELLED" in status and "PENDING" not in status, status
        overall = text_of(p.call(STATUS, {}))
        assert "PENDING" not in overall, overall
        # max_pending no longer counts it: another request may now wait
        again = p.call("bank_pay", {"to": "fay", "amount": 1})
        assert text_of(again).startswith("PENDING_APPROVAL:"), text_of(again)
        code, out, err = operator(d, "approve", "-approval", approval["id"], "-by", "ann")
        assert code == 1 and "already cancelled" in err, err
        assert "arguments" not in out + err                 # no approval block was printed
        assert d.payments() == 0
        events = d.event_types(approval["run_id"])
        assert events.count("approval.decided") == 1
        assert d.operator_json("verify")["intact"] is True
    finally:
        d.cleanup()


TIMEOUT_PAY = {"balance": {"side_effect": "read_only", "timeout": "10s"},
               "pay": {"side_effect": "remote_mutation", "timeout": "300ms", "outcome": "allow"},
               "refund": {"side_effect": "destructive", "timeout": "10s"}}
KIM_BLOCK = {"to": "kim", "amount": 7, "mode": "block"}


def test_blocked_after_an_approved_rerun_says_it_waits_for_the_identical_call(tmp_path):
    h = ProxyHarness(tmp_path, rules=TIMEOUT_PAY)
    try:
        first = h.text(h.call("bank_pay", KIM_BLOCK))
        assert first.startswith("UNKNOWN_OUTCOME:"), first
        [approval] = h.pending()
        before = h.text(h.call("bank_pay", {"to": "lee", "amount": 1}))
        assert before.startswith("BLOCKED:") and "until an operator decides it" in before
        h.decide(approval, approve=True)
        after = h.text(h.call("bank_pay", {"to": "lee", "amount": 1}))
        assert after.startswith("BLOCKED:"), after
        assert "until an operator decides" not in after
        assert "approved running it again" in after and "exactly the same arguments" in after
        assert approval.id in after
        assert h.payments() == 1
        h.release()
        done = h.call("bank_pay", KIM_BLOCK)
        assert h.text(done) == "paid 7.00 to kim"
        ok = h.call("bank_pay", {"to": "lee", "amount": 1})
        assert h.text(ok) == "paid 1.00 to lee"
        assert h.payments() == 3
    finally:
        h.close()


# ---- check shows what each tool will get ----

def check_output(tmp_path, rules, **top):
    tmp_path.mkdir()
    d = ProcessDir(tmp_path, rules=rules, pin=False, **top)
    code, out, err = d.pin()
    assert code == 0, err
    code, out, err = d.check()
    assert code == 0, err
    return {line.split()[0]: line for line in out.splitlines() if line.startswith("bank_")}


def test_check_prints_each_tool_with_its_class_and_decision(tmp_path):
    rules = {"balance": {"side_effect": "read_only", "timeout": "5s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "5s"},
             "refund": {"side_effect": "local_mutation", "timeout": "5s"}}
    lines = check_output(tmp_path / "a", rules)
    assert re.fullmatch(r"bank_balance\s+read_only\s+-> allow\s+by the default policy",
                        lines["bank_balance"]), lines
    assert re.fullmatch(r"bank_pay\s+remote_mutation\s+-> require_approval\s+by the default "
                        r"policy", lines["bank_pay"]), lines
    assert "local_mutation" in lines["bank_refund"] and "-> allow" in lines["bank_refund"]
    assert "allowed by default" in lines["bank_refund"]          # a default nobody chose
    assert "allowed by default" not in lines["bank_balance"]     # reading changes nothing
    # the same tool allowed by an explicit policy, or by its rule, is not marked
    lines = check_output(tmp_path / "b", rules, policy={"local_mutation": "allow"})
    assert "by the policy" in lines["bank_refund"] and "default" not in lines["bank_refund"]
    rules["refund"]["outcome"] = "deny"
    lines = check_output(tmp_path / "c", rules)
    assert re.search(r"-> deny\s+by its rule$", lines["bank_refund"]), lines


@pytest.mark.parametrize("side_effect", ["dangerous", "Read_Only", "read-only"])
def test_a_class_that_is_not_one_of_the_four_is_a_configuration_error(tmp_path, side_effect):
    rules = {"balance": {"side_effect": "read_only", "timeout": "5s"},
             "refund": {"side_effect": side_effect, "timeout": "5s"}}
    d = ProcessDir(tmp_path, rules=rules, pin=False)
    code, out, err = d.check()
    assert code == 1, (out, err)
    assert '"refund"' in err
    for cls in ("read_only", "local_mutation", "remote_mutation", "destructive"):
        assert cls in err, err
    assert "registered" not in out


def test_offered_tools_carry_the_annotations_of_their_class_not_the_servers_hints(pdir):
    p = pdir.start()
    listed = {t["name"]: t for t in p.request("tools/list", {})["result"]["tools"]}
    # the fake server hints balance read-only, pay not destructive, refund nothing at all
    assert listed["bank_balance"]["annotations"] == {
        "readOnlyHint": True, "destructiveHint": False}     # says nothing of an open world
    assert listed["bank_pay"]["annotations"] == {
        "readOnlyHint": False, "destructiveHint": False, "openWorldHint": True}
    assert listed["bank_refund"]["annotations"] == {
        "readOnlyHint": False, "destructiveHint": True}
    assert listed[STATUS]["annotations"]["readOnlyHint"] is True


def test_gate_status_never_reads_a_pending_row_of_a_cancelled_run_as_waiting(tmp_path):
    # What an older build's cancel left behind: the run cancelled, its approval pending.
    h = ProxyHarness(tmp_path)
    try:
        first = h.text(h.call("bank_pay", {"to": "gil", "amount": 2}))
        assert first.startswith("PENDING_APPROVAL:")
        [approval] = h.pending()
        with h.store.tx() as tx:
            tx.exec("UPDATE runs SET status='CANCELLED', reason='operator_cancelled', "
                    "lease_owner='', lease_expires_at='' WHERE id=?", (approval.run_id,))
        one = h.text(h.call(STATUS, {"approval_id": approval.id}))
        assert "CANCELLED" in one and "PENDING" not in one, one
        overall = h.text(h.call(STATUS, {}))
        assert "no request in this session is waiting" in overall, overall
    finally:
        h.close()
