"""The operator commands: runs, show, events, approve, reject, cancel, verify, and the usage
rules around them, against databases the tests wrote through the gate.

The trail shows every refusal: a refused call (DUPLICATE, REJECTED, BLOCKED, EXPIRED) is
recorded against the run it names, identical ones coalesced into one counter, and runs say
plainly why a run ended. A command whose stdout's reader goes away (`runs | head`) ends
quietly.

Specification: DESIGN.md sections 2 and 3; reference/core.md 15 (operator commands), 7.3
and 7.5 (decide, cancel), 12 (the chain that verify walks).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import ROOT, Harness, ap
from process_helpers import proxy_command

SCRIPT = os.path.join(ROOT, "agentrt_proxy.py")
PREFIX = "agentrt-proxy: "
USAGE_LINES = set(ap.USAGE.splitlines())
RUN_KEYS = {"id", "goal", "status", "reason", "steps", "created_at", "finished_at",
            "pending_approval_id"}
APPROVAL_KEYS = {"id", "kind", "status", "tool", "hash", "created_at", "expires_at",
                 "decided_by", "note"}
HOSTILE_ARGS = ('{"amount": 1, "memo": "\\u001b[2J wipe \u202e evil", '
                '"\\u001b]0;title\\u0007": 2}').encode()
HOSTILE_GOAL = "pay \x1b[2J bob \u202eevil"


def stderr_lines_prefixed(err: str) -> list[str]:
    """The stderr lines that break DESIGN.md 3 (neither prefixed nor usage text)."""
    return [line for line in err.splitlines()
            if not line.startswith(PREFIX) and line not in USAGE_LINES]


def subprocess_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTRT_DB", "USER")}
    env.update(extra)
    return env


def run_script(*argv: str, env: dict | None = None, stdin=subprocess.DEVNULL,
               timeout: float = 60) -> subprocess.CompletedProcess:
    command, env = proxy_command(env=env or subprocess_env())
    return subprocess.run([*command, *argv], stdin=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout)


def status_of(path: str, approval_id: str) -> str:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT status FROM approvals WHERE id=?", (approval_id,)).fetchone()[0]
    finally:
        conn.close()


def count_events(path: str, typ: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT COUNT(*) FROM events WHERE type=?", (typ,)).fetchone()[0]
    finally:
        conn.close()


def sql(path: str, statement: str, params: tuple = ()) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(statement, params)
    finally:
        conn.close()


@pytest.fixture(autouse=True)
def no_database_from_the_environment(monkeypatch, tmp_path_factory):
    tmp_path_factory.getbasetemp()      # named after the real user, before USER changes
    monkeypatch.delenv("AGENTRT_DB", raising=False)
    monkeypatch.setenv("USER", "operator")


# --------------------------------------------------------------------------------------------
# runs
# --------------------------------------------------------------------------------------------

def test_runs_text(harness, cli):
    harness.completed("run-done")
    approval = harness.waiting("run-wait")
    code, out, err = cli("-db", harness.path, "runs")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "STATUS", "REASON", "STEPS", "CREATED", "APPROVAL", "GOAL",
                                "WHY"]
    assert lines[1].split()[:2] == ["run-wait", "WAITING_FOR_APPROVAL"]      # newest first
    assert approval.id in lines[1]
    assert lines[2].split()[:4] == ["run-done", "COMPLETED", "goal_completed", "2"]
    assert len(lines) == 3


def test_runs_json(harness, cli):
    harness.completed("run-done")
    approval = harness.waiting("run-wait")
    code, out, _ = cli("-db", harness.path, "-json", "runs")
    assert code == 0
    doc = json.loads(out)
    assert doc["total"] == 2
    assert [r["id"] for r in doc["runs"]] == ["run-wait", "run-done"]
    for r in doc["runs"]:
        assert RUN_KEYS <= set(r)
    wait, done = doc["runs"]
    assert wait["status"] == "WAITING_FOR_APPROVAL"
    assert wait["pending_approval_id"] == approval.id
    assert wait["steps"] == 1 and wait["goal"] == "call pay"
    assert done["status"] == "COMPLETED" and done["reason"] == "goal_completed"
    assert done["finished_at"] and done["created_at"]
    assert done["pending_approval_id"] == ""


def test_runs_paging_with_more_line(harness, cli):
    for i in range(3):
        harness.completed(f"run-{i}")
    code, out, _ = cli("-db", harness.path, "runs", "-limit", "2")
    assert code == 0
    lines = out.splitlines()
    assert [l.split()[0] for l in lines[1:3]] == ["run-2", "run-1"]
    assert lines[3].startswith("...")
    assert "1 more" in lines[3] and "-offset 2" in lines[3] and "2 of 3" in lines[3]
    code, out, _ = cli("-db", harness.path, "runs", "-limit", "2", "-offset", "2")
    assert code == 0
    lines = out.splitlines()
    assert [l.split()[0] for l in lines[1:]] == ["run-0"]
    code, out, _ = cli("-db", harness.path, "-json", "runs", "-limit", "1", "-offset", "1")
    doc = json.loads(out)
    assert doc["total"] == 3 and [r["id"] for r in doc["runs"]] == ["run-1"]


def test_runs_on_empty_database(harness, cli):
    code, out, err = cli("-db", harness.path, "runs")
    assert (code, out, err) == (0, "no runs\n", "")
    code, out, _ = cli("-db", harness.path, "-json", "runs")
    assert json.loads(out) == {"runs": [], "total": 0}


def test_runs_negative_limit_is_usage_error(harness, cli):
    code, _, err = cli("-db", harness.path, "runs", "-limit", "-1")
    assert code == 2 and "negative" in err


# --------------------------------------------------------------------------------------------
# show and events
# --------------------------------------------------------------------------------------------

def test_show_text_of_a_waiting_run_prints_the_approval_block(harness, cli):
    approval = harness.waiting("run-1", args=b'{"amount": 25.00, "to": "bob"}')
    code, out, err = cli("-db", harness.path, "show", "run-1")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "run     run-1"
    assert "status  WAITING_FOR_APPROVAL" in out
    assert f"APPROVAL WAITING  {approval.id}" in out
    assert "remote_mutation" in out
    # the arguments field by field, each with its own size
    assert "  amount (5 bytes)" in lines and "    25.00" in lines
    assert '  to (5 bytes)' in lines and '    "bob"' in lines
    decide = [l for l in lines if l.startswith("decide with:")]
    assert len(decide) == 1
    assert f"approve run-1 -approval {approval.id}" in decide[0]
    assert f'-db "{harness.path}"' in decide[0]
    assert any(l.startswith("STEP") and "OBSERVATION" in l for l in lines)


def test_show_text_of_a_finished_run_has_no_approval_block(harness, cli):
    harness.completed("run-1")
    code, out, _ = cli("-db", harness.path, "show", "run-1")
    assert code == 0
    assert "status  COMPLETED (goal_completed)" in out
    assert "APPROVAL WAITING" not in out and "decide with:" not in out


def test_show_json(harness, cli):
    approval = harness.waiting("run-1")
    code, out, _ = cli("-db", harness.path, "-json", "show", "run-1")
    assert code == 0
    doc = json.loads(out)
    assert {"run", "steps", "approvals"} <= set(doc)
    assert RUN_KEYS <= set(doc["run"])
    assert doc["run"]["id"] == "run-1" and doc["run"]["pending_approval_id"] == approval.id
    [step] = doc["steps"]
    assert step["status"] == "awaiting_approval" and step["tool"] == "pay"
    [a] = doc["approvals"]
    assert APPROVAL_KEYS <= set(a)
    assert (a["id"], a["kind"], a["status"], a["tool"], a["hash"]) == \
        (approval.id, "remote_mutation", "pending", "pay", approval.hash)


def test_show_unknown_run_fails(harness, cli):
    code, out, err = cli("-db", harness.path, "show", "nope")
    assert code == 1 and out == ""
    assert err.startswith(PREFIX) and "nope" in err


def test_events_text(harness, cli):
    harness.waiting("run-1")
    code, out, err = cli("-db", harness.path, "events", "run-1")
    assert (code, err) == (0, "")
    types = [line.split()[3] for line in out.splitlines()]
    assert types == ["run.created", "run.started", "step.started", "step.decided",
                     "step.policy", "approval.requested"]


def test_events_json(harness, cli):
    harness.completed("run-1")
    harness.completed("run-2")
    code, out, _ = cli("-db", harness.path, "-json", "events", "run-2")
    assert code == 0
    doc = json.loads(out)
    events = doc["events"]
    assert {e["run_id"] for e in events} == {"run-2"}
    assert events[0]["type"] == "run.created" and events[-1]["type"] == "run.finished"
    assert [e["seq"] for e in events] == list(range(events[0]["seq"], events[0]["seq"] + 10))
    assert all(len(e["hash"]) == 64 for e in events)


def test_events_unknown_run_fails(harness, cli):
    code, out, err = cli("-db", harness.path, "events", "nope")
    assert code == 1 and out == ""
    assert "nope" in err and not stderr_lines_prefixed(err)


# --------------------------------------------------------------------------------------------
# approve and reject
# --------------------------------------------------------------------------------------------

def test_approve_prints_the_approval_in_full_before_deciding(harness, monkeypatch):
    approval = harness.waiting("run-1", args=b'{"amount": 25.00, "to": "bob"}')
    seen = {}
    real = ap.decide_approval

    def spy(store, run_id, approval_id, approve, by, note, shown_hash, now, **rest):
        seen["status"] = status_of(harness.path, approval_id)
        seen["hash"] = shown_hash
        return real(store, run_id, approval_id, approve, by, note, shown_hash, now, **rest)

    monkeypatch.setattr(ap, "decide_approval", spy)
    out = io.StringIO()
    code = ap.main(["-db", harness.path, "approve", "run-1", "-approval", approval.id,
                    "-by", "alice"], stdin=io.StringIO(), stdout=out, stderr=io.StringIO())
    assert code == 0
    text = out.getvalue()
    assert seen == {"status": "pending", "hash": approval.hash}
    block_at = text.index(f"APPROVAL WAITING  {approval.id}")
    decided_at = text.index(f"approval {approval.id}: approved by alice")
    assert block_at < decided_at
    block = text[block_at:decided_at]
    for needle in ("remote_mutation", "tool          pay", "amount (5 bytes)", "25.00",
                   '"bob"', "reason", "expires", "decide with:",
                   f"end of approval {approval.id}"):
        assert needle in block, needle
    assert "[y/N]" not in text                           # -approval is consent: no prompt
    assert status_of(harness.path, approval.id) == "approved"
    assert "run run-1: approved; the next identical call runs it" in text   # not resumed


def test_approve_with_approval_id_needs_no_prompt(harness, cli):
    approval = harness.waiting("run-1")
    code, out, _ = cli("-db", harness.path, "approve", "run-1", "-approval", approval.id)
    assert code == 0 and "[y/N]" not in out
    assert status_of(harness.path, approval.id) == "approved"


def test_approve_with_yes_needs_no_prompt(harness, cli):
    approval = harness.waiting("run-1")
    code, out, _ = cli("-db", harness.path, "approve", "run-1", "-yes")
    assert code == 0 and "[y/N]" not in out
    assert f"approval {approval.id}: approved by operator" in out
    assert status_of(harness.path, approval.id) == "approved"


def test_approved_run_then_executes_once_on_attach(harness, cli):
    approval = harness.waiting("run-1")
    code, _, _ = cli("-db", harness.path, "approve", "run-1", "-yes")
    assert code == 0
    session, verdict = harness.gate.attach("run-1")
    assert verdict.kind == "allowed"
    asyncio.run(session.execute())
    assert harness.paid == [b'{"amount": 25.00}']
    assert harness.store.get_run("run-1").status == ap.COMPLETED
    assert status_of(harness.path, approval.id) == "approved"


def test_approve_without_consent_and_no_terminal_is_usage_error(harness, cli):
    approval = harness.waiting("run-1")
    code, out, err = cli("-db", harness.path, "approve", "run-1", stdin="y\n")
    assert code == 2
    assert "-approval" in err and "-yes" in err and "terminal" in err
    assert f"APPROVAL WAITING  {approval.id}" in out          # shown, but not decided
    assert status_of(harness.path, approval.id) == "pending"
    assert count_events(harness.path, "approval.decided") == 0


def test_approve_with_stdin_dev_null_is_usage_error(harness):
    approval = harness.waiting("run-1")
    harness.close()
    result = run_script("-db", harness.path, "approve", "run-1", "-by", "op",
                        stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert status_of(harness.path, approval.id) == "pending"
    assert not stderr_lines_prefixed(result.stderr)


def _approve_on_a_terminal(path: str, answer: bytes) -> tuple[int, str, str]:
    pty = pytest.importorskip("pty")
    try:
        master, slave = pty.openpty()
    except OSError as exc:
        pytest.skip(f"no pseudo-terminal: {exc}")
    try:
        proc = subprocess.Popen([sys.executable, SCRIPT, "-db", path, "approve", "run-1",
                                 "-by", "op"], stdin=slave, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=subprocess_env())
        os.close(slave)
        slave = None
        os.write(master, answer)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        return proc.returncode, out.decode(), err.decode()
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)


@pytest.mark.parametrize("answer", [b"n\n", b"no\n", b"\n", b"maybe\n", b"yes please\n"])
def test_prompt_answered_other_than_yes_on_a_terminal_declines(harness, answer):
    approval = harness.waiting("run-1")
    harness.close()
    code, out, err = _approve_on_a_terminal(harness.path, answer)
    assert code == 1, err
    assert f"approve approval {approval.id} of run run-1? [y/N]" in out
    assert out.index("APPROVAL WAITING") < out.index("[y/N]")
    assert "declined" in err and not stderr_lines_prefixed(err)
    assert status_of(harness.path, approval.id) == "pending"
    assert count_events(harness.path, "approval.decided") == 0


@pytest.mark.parametrize("answer", [b"y\n", b"Y\n", b" yes \n", b"YES\n"])
def test_prompt_answered_y_on_a_terminal_approves(harness, answer):
    approval = harness.waiting("run-1")
    harness.close()
    code, out, err = _approve_on_a_terminal(harness.path, answer)
    assert code == 0, err
    assert "[y/N]" in out and f"approval {approval.id}: approved by op" in out
    assert status_of(harness.path, approval.id) == "approved"


def test_end_of_input_at_the_prompt_is_the_same_refusal_as_no_terminal(harness):
    approval = harness.waiting("run-1")
    harness.close()
    code, out, err = _approve_on_a_terminal(harness.path, b"\x04")     # ^D: EOF, no answer
    assert code == 2, err
    assert "[y/N]" in out
    assert not stderr_lines_prefixed(err)
    assert status_of(harness.path, approval.id) == "pending"


def test_approve_on_a_run_that_is_no_longer_waiting_is_refused(harness, cli):
    approval = harness.waiting("run-1")
    code, _, _ = cli("-db", harness.path, "cancel", "run-1")
    assert code == 0
    # Cancel resolves what it ends (stricter than the reference, which leaves it pending).
    assert status_of(harness.path, approval.id) == "cancelled"
    assert count_events(harness.path, "approval.decided") == 1
    code, out, err = cli("-db", harness.path, "approve", "run-1", "-approval", approval.id)
    assert code == 1
    assert "already cancelled" in err and not stderr_lines_prefixed(err)
    assert "arguments" not in out + err                  # refused before the approval block
    assert status_of(harness.path, approval.id) == "cancelled"
    assert count_events(harness.path, "approval.decided") == 1


def test_approval_of_another_run_is_refused(harness, cli):
    first = harness.waiting("run-1")
    second = harness.waiting("run-2")
    code, _, err = cli("-db", harness.path, "approve", "run-2", "-approval", first.id)
    assert code == 1
    assert first.id in err and "run-2" in err
    assert status_of(harness.path, first.id) == "pending"
    assert status_of(harness.path, second.id) == "pending"


def test_approve_after_expiry_expires_and_cancels(tmp_path, cli):
    h = Harness(str(tmp_path / "runs.db"))
    try:
        h.gate.clock = lambda: time.time() - 7200       # asked two hours ago, 1h to answer
        approval = h.waiting("run-1")
        code, _, err = cli("-db", h.path, "approve", "run-1", "-approval", approval.id)
        assert code == 1
        assert "expired" in err and not stderr_lines_prefixed(err)
        assert status_of(h.path, approval.id) == "expired"
        run = h.store.get_run("run-1")
        assert (run.status, run.reason) == (ap.CANCELLED, "approval_expired")
        assert h.paid == []
    finally:
        h.close()


def test_by_defaults_to_user(harness, cli, monkeypatch):
    approval = harness.waiting("run-1")
    monkeypatch.setenv("USER", "alice")
    code, out, _ = cli("-db", harness.path, "approve", "run-1", "-approval", approval.id)
    assert code == 0 and "approved by alice" in out
    assert harness.store.get_approval(approval.id).decided_by == "alice"


def test_by_defaults_to_the_account_name_when_user_is_unset(harness, cli, monkeypatch):
    import pwd
    approval = harness.waiting("run-1")
    monkeypatch.delenv("USER", raising=False)
    code, out, err = cli("-db", harness.path, "approve", "run-1", "-approval", approval.id)
    name = pwd.getpwuid(os.getuid()).pw_name
    assert code == 0 and f"approved by {name}" in out, out + err
    assert harness.store.get_approval(approval.id).decided_by == name


@pytest.mark.parametrize("by", [None, ""])
def test_empty_by_with_no_name_to_default_to_is_usage_error(harness, cli, monkeypatch, by):
    import pwd
    approval = harness.waiting("run-1")
    monkeypatch.delenv("USER", raising=False)

    def nameless(uid):
        raise KeyError(uid)
    monkeypatch.setattr(pwd, "getpwuid", nameless)
    argv = ["-db", harness.path, "approve", "run-1", "-approval", approval.id]
    if by is not None:
        argv += ["-by", by]
    code, _, err = cli(*argv)
    assert code == 2
    assert "-by" in err and "USER" in err
    assert status_of(harness.path, approval.id) == "pending"


def test_decision_is_bound_to_the_shown_hash(harness):
    approval = harness.waiting("run-1")
    for shown in ("0" * 64, ""):
        with pytest.raises(ap.ApprovalChanged):
            ap.decide_approval(harness.store, "run-1", approval.id, True, "op", "", shown,
                               time.time(), view="")
    assert harness.store.get_approval(approval.id).status == ap.PENDING
    assert count_events(harness.path, "approval.decided") == 0


def test_approval_changed_between_printing_and_deciding_is_refused(harness, cli, monkeypatch):
    """Another writer replaces the request (with a consistent hash) after the operator was
    shown the approval: the decision must not apply to what was not shown."""
    approval = harness.waiting("run-1")
    real_block = ap.approval_block

    def block_then_tamper(store, a, db_path):
        lines = real_block(store, a, db_path)
        swapped = ap.dataclasses.replace(a.request(), args=b'{"amount": 9999}')
        digest = ap.approval_hash(a.kind, a.capability, a.presentation, swapped)
        sql(harness.path, "UPDATE approvals SET request_json=?, hash=? WHERE id=?",
            (swapped.record(), digest, a.id))
        return lines

    monkeypatch.setattr(ap, "approval_block", block_then_tamper)
    code, out, err = cli("-db", harness.path, "approve", "run-1", "-approval", approval.id)
    assert code == 1
    assert "25.00" in out                                   # what the operator read
    assert "changed after it was shown" in err and "again" in err
    assert status_of(harness.path, approval.id) == "pending"
    assert count_events(harness.path, "approval.decided") == 0


def test_approval_row_with_a_forged_hash_is_refused(harness, cli):
    approval = harness.waiting("run-1")
    sql(harness.path, "UPDATE approvals SET hash=? WHERE id=?", ("ab" * 32, approval.id))
    code, _, err = cli("-db", harness.path, "approve", "run-1", "-approval", approval.id)
    assert code == 1
    assert err.startswith(PREFIX) and approval.id in err
    assert status_of(harness.path, approval.id) == "pending"
    assert harness.store.get_run("run-1").status == ap.WAITING
    assert count_events(harness.path, "approval.decided") == 0


def test_reject_with_note_cancels_the_run(harness, cli):
    approval = harness.waiting("run-1")
    code, out, _ = cli("-db", harness.path, "reject", "run-1", "-approval", approval.id,
                       "-note", "not today")
    assert code == 0
    assert f"APPROVAL WAITING  {approval.id}" in out
    assert f"approval {approval.id}: rejected by operator" in out
    assert "run run-1: rejected; nothing runs, the model is told your note" in out
    run = harness.store.get_run("run-1")
    assert (run.status, run.reason, run.reason_detail) == \
        (ap.CANCELLED, "approval_rejected", "not today")
    a = harness.store.get_approval(approval.id)
    assert (a.status, a.note, a.decided_by) == ("rejected", "not today", "operator")
    assert harness.store.list_steps("run-1")[0].status == "failed"
    assert harness.paid == []


@pytest.mark.parametrize("first,second", [("approve", "approve"), ("approve", "reject"),
                                          ("reject", "approve"), ("reject", "reject")])
def test_deciding_an_already_decided_approval_fails(harness, cli, first, second):
    approval = harness.waiting("run-1")
    code, _, _ = cli("-db", harness.path, first, "run-1", "-approval", approval.id)
    assert code == 0
    before = count_events(harness.path, "approval.decided")
    for argv in (["-approval", approval.id], ["-yes"]):
        code, _, err = cli("-db", harness.path, second, "run-1", *argv)
        assert code == 1, err
        assert "already" in err and not stderr_lines_prefixed(err)
    assert status_of(harness.path, approval.id) == ("approved" if first == "approve"
                                                    else "rejected")
    assert count_events(harness.path, "approval.decided") == before


def test_approve_with_two_pending_approvals_names_both(harness, cli):
    approval = harness.waiting("run-1")
    cols = ("run_id, step_id, kind, capability_json, presentation_json, request_json, hash, "
            "status, created_at, decided_at, decided_by, note, expires_at")
    sql(harness.path, f"INSERT INTO approvals (id, {cols}) SELECT 'second-approval', {cols} "
        "FROM approvals WHERE id=?", (approval.id,))
    code, _, err = cli("-db", harness.path, "approve", "run-1", "-yes")
    assert code == 1                       # an error, not a usage error (core.md 15)
    assert approval.id in err and "second-approval" in err
    assert "-approval" in err
    assert status_of(harness.path, approval.id) == "pending"
    assert status_of(harness.path, "second-approval") == "pending"


# --------------------------------------------------------------------------------------------
# cancel
# --------------------------------------------------------------------------------------------

def test_cancel_waiting_run(harness, cli):
    harness.waiting("run-1")
    code, out, _ = cli("-db", harness.path, "cancel", "run-1", "-note", "enough")
    assert code == 0
    assert "run run-1: CANCELLED (operator_cancelled)" in out
    run = harness.store.get_run("run-1")
    assert (run.status, run.reason, run.reason_detail) == \
        (ap.CANCELLED, "operator_cancelled", "enough")
    assert harness.store.list_steps("run-1")[0].status == "failed"


def test_cancel_running_run(harness, cli):
    harness.gate.begin("run-1", "long", ap.Limits(3, 3, 3, 0, 0)).step()
    code, _, _ = cli("-db", harness.path, "cancel", "run-1")
    assert code == 0
    assert harness.store.get_run("run-1").status == ap.CANCELLED


def test_cancel_finished_run_fails(harness, cli):
    harness.completed("run-1")
    code, _, err = cli("-db", harness.path, "cancel", "run-1")
    assert code == 1
    assert "already" in err and "COMPLETED" in err and not stderr_lines_prefixed(err)
    assert harness.store.get_run("run-1").status == ap.COMPLETED


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------

def test_verify_intact(harness, cli):
    harness.completed("run-1")
    harness.waiting("run-2")
    seq, digest = harness.store.chain_head()
    code, out, err = cli("-db", harness.path, "verify")
    assert (code, err) == (0, "")
    assert f"head: seq {seq} {digest}" in out
    assert f"intact: {seq} event(s)" in out


def test_verify_empty_database(harness, cli):
    code, out, _ = cli("-db", harness.path, "verify")
    assert code == 0
    assert "head: no events" in out and "intact: no events" in out


def test_verify_json(harness, cli):
    harness.completed("run-1")
    seq, digest = harness.store.chain_head()
    code, out, _ = cli("-db", harness.path, "-json", "verify")
    assert code == 0
    doc = json.loads(out)
    assert doc["head"] == {"seq": seq, "hash": digest}
    assert (doc["checked"], doc["intact"], doc["hash"]) == (seq, True, digest)
    assert doc["from"] == 1 and doc["to"] == seq
    assert "break" not in doc


def test_verify_after_editing_an_event(harness, cli):
    harness.completed("run-1")
    harness.close()
    sql(harness.path, "UPDATE events SET payload_json='{\"index\":7}' WHERE seq=3")
    code, out, err = cli("-db", harness.path, "verify")
    assert code == 1
    assert "broken at seq 3" in out
    assert "broken at seq 3" in err and not stderr_lines_prefixed(err)
    code, out, _ = cli("-db", harness.path, "-json", "verify")
    assert code == 1
    doc = json.loads(out)
    assert doc["intact"] is False
    assert doc["break"]["seq"] == 3
    assert {"seq", "expected", "found", "detail"} <= set(doc["break"])


def test_verify_kept_head_matches(harness, cli):
    harness.completed("run-1")
    seq, digest = harness.store.chain_head()
    harness.completed("run-2")                  # the chain grew after the head was kept
    code, out, _ = cli("-db", harness.path, "verify", "-head", f"{seq}:{digest}")
    assert code == 0
    assert f"kept head: seq {seq} matches" in out


def test_verify_kept_head_not_matching(harness, cli):
    harness.completed("run-1")
    seq, _ = harness.store.chain_head()
    code, out, err = cli("-db", harness.path, "verify", "-head", f"{seq}:{'0' * 64}")
    assert code == 1
    assert "matches" not in out
    assert "does not match the head kept" in err
    # a head kept beyond the end of a chain that was cut
    code, _, err = cli("-db", harness.path, "verify", "-head", f"{seq + 5}:{'0' * 64}")
    assert code == 1 and "no event" in err


def test_verify_detects_a_cut_chain_only_with_a_kept_head(harness, cli):
    harness.completed("run-1")
    seq, digest = harness.store.chain_head()
    harness.close()
    sql(harness.path, f"DELETE FROM events WHERE seq={seq}")
    code, _, _ = cli("-db", harness.path, "verify")
    assert code == 0                             # a chain cut at the end still verifies
    code, _, err = cli("-db", harness.path, "verify", "-head", f"{seq}:{digest}")
    assert code == 1 and "head kept" in err


def test_verify_to_beyond_the_head_fails(harness, cli):
    harness.completed("run-1")
    seq, _ = harness.store.chain_head()
    code, _, err = cli("-db", harness.path, "verify", "-to", str(seq + 3))
    assert code == 1
    assert "shorter" in err and str(seq + 3) in err
    code, out, _ = cli("-db", harness.path, "verify", "-from", "2", "-to", str(seq))
    assert code == 0 and f"intact: {seq - 1} event(s)" in out


@pytest.mark.parametrize("argv", [["-from", "5", "-to", "3"], ["-from", "-1"], ["-to", "-2"]])
def test_verify_bad_range_is_usage_error(harness, cli, argv):
    harness.completed("run-1")
    code, _, err = cli("-db", harness.path, "verify", *argv)
    assert code == 2 and not stderr_lines_prefixed(err)


def test_read_commands_write_nothing(harness, cli):
    approval = harness.waiting("run-1")
    harness.completed("run-2")
    harness.close()
    with open(harness.path, "rb") as f:
        before = f.read()
    for argv in (["runs"], ["show", "run-1"], ["events", "run-1"], ["verify"],
                 ["-json", "runs"], ["-json", "show", "run-1"], ["-json", "verify"]):
        code, _, _ = cli("-db", harness.path, *argv)
        assert code == 0, argv
    with open(harness.path, "rb") as f:
        assert f.read() == before
    assert status_of(harness.path, approval.id) == "pending"


@pytest.mark.parametrize("head", ["abc", "5", "0:" + "0" * 64, "-1:" + "0" * 64, "3:xyz",
                                  "3:" + "0" * 63, ":" + "0" * 64])
def test_verify_malformed_head_is_usage_error(harness, cli, head):
    harness.completed("run-1")
    code, out, err = cli("-db", harness.path, "verify", "-head", head)
    assert code == 2, err
    assert out == ""
    assert "SEQ:HASH" in err


def test_verify_malformed_head_is_usage_error_before_the_database_is_opened(tmp_path, cli):
    code, _, err = cli("-db", str(tmp_path / "missing.db"), "verify", "-head", "abc")
    assert code == 2, err


def test_empty_by_is_usage_error_before_the_database_is_opened(tmp_path, cli, monkeypatch):
    monkeypatch.delenv("USER", raising=False)
    code, _, err = cli("-db", str(tmp_path / "missing.db"), "approve", "run-1", "-yes",
                       "-by", "")
    assert code == 2, err


# --------------------------------------------------------------------------------------------
# Usage, the database argument, help, stderr
# --------------------------------------------------------------------------------------------

def test_no_command_is_usage_error(harness, cli):
    code, out, err = cli("-db", harness.path)
    assert code == 2 and out == ""
    assert "usage:" in err and not stderr_lines_prefixed(err)


def test_unknown_command_is_usage_error(harness, cli):
    code, out, err = cli("-db", harness.path, "frobnicate")
    assert code == 2 and out == ""
    assert "frobnicate" in err and not stderr_lines_prefixed(err)


def test_no_database_anywhere_is_usage_error(cli):
    code, out, err = cli("runs")
    assert code == 2 and out == ""
    assert "-db" in err and "AGENTRT_DB" in err and not stderr_lines_prefixed(err)


def test_database_from_agentrt_db(harness, cli, monkeypatch):
    harness.completed("run-env")
    monkeypatch.setenv("AGENTRT_DB", harness.path)
    code, out, _ = cli("runs")
    assert code == 0 and "run-env" in out


def test_db_flag_wins_over_agentrt_db(harness, cli, monkeypatch, tmp_path):
    harness.completed("run-flag")
    monkeypatch.setenv("AGENTRT_DB", str(tmp_path / "missing.db"))
    code, out, _ = cli("-db", harness.path, "runs")
    assert code == 0 and "run-flag" in out


def test_config_database_resolves_against_the_config_directory(tmp_path, cli, monkeypatch):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    h = Harness(str(conf_dir / "proxy.db"))
    try:
        h.completed("run-conf")
    finally:
        h.close()
    config = conf_dir / "proxy.json"
    config.write_text(json.dumps({"database": "proxy.db", "session": "s", "servers": [
        {"name": "x", "command": ["true"], "manifest": "x.manifest.json"}]}))
    os.chmod(config, 0o600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("AGENTRT_DB", str(tmp_path / "missing.db"))     # -config wins
    code, out, err = cli("-config", str(config), "runs")
    assert code == 0, err
    assert "run-conf" in out
    assert not (elsewhere / "proxy.db").exists()


def test_two_dash_flags(harness, cli):
    harness.completed("run-1")
    harness.completed("run-2")
    code, out, _ = cli("--db", harness.path, "--json", "runs", "--limit", "1")
    assert code == 0
    doc = json.loads(out)
    assert doc["total"] == 2 and len(doc["runs"]) == 1


def test_help_starts_with_the_scope_statement(cli):
    for flag in ("-h", "--help"):
        code, out, err = cli(flag)
        assert (code, err) == (0, "")
        first_lines = "\n".join(out.splitlines()[:3])
        assert "The proxy governs only calls that go through it" in first_lines
        assert out.index("governs only calls") < out.index("usage:")


def test_help_as_a_real_process():
    result = run_script("-h")
    assert result.returncode == 0 and result.stderr == ""
    assert "governs only calls that go through it" in result.stdout.split("usage:")[0]


def test_missing_database_fails_and_is_not_created(tmp_path, cli):
    for argv in (["runs"], ["show", "run-1"], ["verify"], ["cancel", "run-1"],
                 ["approve", "run-1", "-yes"]):
        path = str(tmp_path / "missing.db")
        code, out, err = cli("-db", path, *argv)
        assert code == 1, argv
        assert out == ""
        assert "does not exist" in err and not stderr_lines_prefixed(err)
        assert os.listdir(tmp_path) == []


def test_missing_database_as_a_real_process(tmp_path):
    path = str(tmp_path / "missing.db")
    result = run_script("-db", path, "runs")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(PREFIX) and not stderr_lines_prefixed(result.stderr)
    assert os.listdir(tmp_path) == []


def _symlinked(path: str) -> str:
    link = path + ".link"
    os.symlink(path, link)
    return link


def _world_writable(path: str) -> str:
    os.chmod(path, 0o666)
    return path


def _with_trigger(path: str) -> str:
    sql(path, "CREATE TRIGGER sneaky AFTER INSERT ON runs BEGIN SELECT 1; END")
    return path


def _newer(path: str) -> str:
    sql(path, "INSERT INTO schema_migrations (version, applied_at) VALUES (99, 'later')")
    return path


@pytest.mark.parametrize("spoil,words", [
    (_symlinked, ["symbolic link", "name the database file itself"]),
    (_world_writable, ["writable by group or others", "chmod 600"]),
    (_with_trigger, ["trigger", "sneaky", "could run SQL"]),
    (_newer, ["newer", "99"]),
], ids=["symlink", "mode", "trigger", "newer-schema"])
@pytest.mark.parametrize("command", [["runs"], ["cancel", "run-1"]], ids=["read", "write"])
def test_unsafe_database_refused_with_one_sentence(harness, cli, spoil, words, command):
    harness.waiting("run-1")
    harness.close()
    path = spoil(harness.path)
    code, out, err = cli("-db", path, *command)
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(PREFIX + "error: ")
    for word in words:
        assert word in err, (word, err)
    conn = sqlite3.connect(harness.path)
    try:
        assert conn.execute("SELECT status FROM runs").fetchone()[0] == "WAITING_FOR_APPROVAL"
    finally:
        conn.close()


def test_every_stderr_line_is_prefixed(harness, cli, tmp_path):
    approval = harness.waiting("run-1")
    harness.completed("run-2")
    cases = [
        [],
        ["-db", harness.path],
        ["-db", harness.path, "frobnicate"],
        ["runs"],
        ["-db", str(tmp_path / "missing.db"), "runs"],
        ["-db", harness.path, "show", "nope"],
        ["-db", harness.path, "events", "nope"],
        ["-db", harness.path, "approve", "run-1"],
        ["-db", harness.path, "approve", "run-1", "-approval", "nope"],
        ["-db", harness.path, "approve", "run-2", "-yes"],
        ["-db", harness.path, "cancel", "run-2"],
        ["-db", harness.path, "verify", "-head", "junk"],
        ["-db", harness.path, "verify", "-from", "-3"],
        ["-db", harness.path, "runs", "-limit", "x"],
        ["-db", harness.path, "show"],
    ]
    for argv in cases:
        code, _, err = cli(*argv)
        assert code in (1, 2), argv
        assert err, argv
        assert not stderr_lines_prefixed(err), (argv, err)
    assert status_of(harness.path, approval.id) == "pending"


def test_approve_json_keeps_stderr_prefixed(harness, cli):
    approval = harness.waiting("run-1")
    code, out, err = cli("-db", harness.path, "-json", "approve", "run-1", "-approval",
                         approval.id)
    assert code == 0
    assert json.loads(out)["approval"]["status"] == "approved"
    assert not stderr_lines_prefixed(err), err


def test_approve_json_output_is_one_json_document(harness, cli):
    approval = harness.waiting("run-1")
    code, out, _ = cli("-db", harness.path, "-json", "approve", "run-1", "-approval",
                       approval.id)
    assert code == 0
    doc = json.loads(out)
    assert doc["approval"]["id"] == approval.id and doc["approval"]["status"] == "approved"
    assert doc["run"]["id"] == "run-1" and doc["run"]["status"] == "WAITING_FOR_APPROVAL"


def test_real_process_approve_then_verify(harness):
    approval = harness.waiting("run-1")
    harness.close()
    result = run_script("-db", harness.path, "approve", "run-1", "-approval", approval.id,
                        "-by", "op")
    assert result.returncode == 0, result.stderr
    assert f"approval {approval.id}: approved by op" in result.stdout
    result = run_script("-db", harness.path, "verify")
    assert result.returncode == 0 and "intact:" in result.stdout


# --------------------------------------------------------------------------------------------
# Model-chosen text is escaped in text output, left alone in -json output
# --------------------------------------------------------------------------------------------

def assert_inert(text: str) -> None:
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "\r" not in text


def test_text_output_sanitises_model_chosen_text(harness, cli):
    approval = harness.waiting("run-1", args=HOSTILE_ARGS, goal=HOSTILE_GOAL)
    harness.waiting("run-2", args=HOSTILE_ARGS, goal=HOSTILE_GOAL)
    outputs = {}
    for name, argv in {"runs": ["runs"], "show": ["show", "run-1"],
                       "events": ["events", "run-1"],
                       "approve": ["approve", "run-1", "-approval", approval.id],
                       "reject": ["reject", "run-2", "-yes", "-note", "no \x1b[2J\u202e"],
                       "show-rejected": ["show", "run-2"]}.items():
        code, out, err = cli("-db", harness.path, *argv)
        assert code == 0, (name, err)
        assert_inert(out)
        assert_inert(err)
        outputs[name] = out
    assert "\\u{202e}" in outputs["show"]                 # escaped, visibly
    assert "\\x1b[2J" in outputs["runs"]                  # the goal's raw ESC
    assert "\\x1b]0;title\\x07" in outputs["show"]        # a key chosen by the model
    assert "memo (" in outputs["approve"]


def test_real_process_output_has_no_raw_escape_bytes(harness):
    harness.waiting("run-1", args=HOSTILE_ARGS, goal=HOSTILE_GOAL)
    harness.close()
    for argv in (["runs"], ["show", "run-1"], ["events", "run-1"]):
        result = subprocess.run([sys.executable, SCRIPT, "-db", harness.path, *argv],
                                stdin=subprocess.DEVNULL, capture_output=True,
                                env=subprocess_env(), timeout=60)
        assert result.returncode == 0, result.stderr
        assert b"\x1b" not in result.stdout
        assert "\u202e".encode() not in result.stdout


def test_json_output_is_valid_json_and_not_sanitised(harness, cli):
    harness.waiting("run-1", args=HOSTILE_ARGS, goal=HOSTILE_GOAL)
    for argv in (["runs"], ["show", "run-1"], ["events", "run-1"], ["verify"]):
        code, out, _ = cli("-db", harness.path, "-json", *argv)
        assert code == 0
        json.loads(out)
    code, out, _ = cli("-db", harness.path, "-json", "runs")
    assert json.loads(out)["runs"][0]["goal"] == HOSTILE_GOAL
    code, out, _ = cli("-db", harness.path, "-json", "events", "run-1")
    decided = [e for e in json.loads(out)["events"] if e["type"] == "step.decided"][0]
    assert decided["payload"]["args"]["memo"] == "\x1b[2J wipe \u202e evil"


# --------------------------------------------------------------------------------------------
# A database edited behind the proxy's back cannot drive the operator's terminal
# --------------------------------------------------------------------------------------------

EVIL = "\x1b[31m\x1b]0;title\x07\r\x9b\u202e"
FORBIDDEN = ("\x1b", "\x07", "\x9b", "\r", "\u202e")


def assert_no_controls(text: str, where: str) -> None:
    found = [repr(c) for c in FORBIDDEN if c in text]
    assert not found, f"{where}: {found} reached the terminal:\n{text}"


def _rename_run(conn, old: str, new: str) -> None:
    for table, column in (("runs", "id"), ("steps", "run_id"), ("events", "run_id"),
                          ("approvals", "run_id")):
        conn.execute(f"UPDATE {table} SET {column}=? WHERE {column}=?", (new, old))


def _edit_json(conn, table: str, column: str, key: str, row_id: str, **fields) -> None:
    raw = conn.execute(f"SELECT {column} FROM {table} WHERE {key}=?", (row_id,)).fetchone()[0]
    doc = json.loads(raw)
    doc.update(fields)
    conn.execute(f"UPDATE {table} SET {column}=? WHERE {key}=?", (json.dumps(doc), row_id))


def _rewrite_approval(conn, approval_id: str, new_id: str, run_id: str) -> None:
    """Every field an approval prints carries EVIL, and its hash is recomputed, so the
    operator commands read it as a sound approval."""
    a = ap.Approval(*conn.execute(f"SELECT {ap._APPROVAL_COLS} FROM approvals WHERE id=?",
                                  (approval_id,)).fetchone())
    request = a.request()
    spec = ap.dataclasses.replace(request.spec, name="pay" + EVIL)
    request = ap.dataclasses.replace(request, run_id=run_id, spec=spec)
    cap = json.dumps({"server": "bank" + EVIL, "tool": "pay" + EVIL,
                      "side_effect": "remote" + EVIL}).encode()
    pres = json.dumps({"title": "pay" + EVIL, "to" + EVIL: EVIL}).encode()
    digest = ap.approval_hash(a.kind, cap, pres, request)
    conn.execute("UPDATE approvals SET id=?, capability_json=?, presentation_json=?, "
                 "request_json=?, hash=? WHERE id=?",
                 (new_id, cap.decode(), pres.decode(), request.record(), digest, approval_id))


def test_text_output_of_an_edited_database_has_no_terminal_controls(harness, cli):
    """Finding 10: every field the operator commands read from the database is sanitised in
    text output, verify's quotes of stored hashes included; -json stays parseable JSON."""
    harness.completed("run-done")
    first = harness.waiting("run-a")
    second = harness.waiting("run-b")
    harness.waiting("run-c")
    harness.close()
    done, run_a, run_b = "done" + EVIL, "a" + EVIL, "b" + EVIL
    conn = sqlite3.connect(harness.path, isolation_level=None)
    try:
        for old, new in (("run-done", done), ("run-a", run_a), ("run-b", run_b)):
            _rename_run(conn, old, new)
        conn.execute("UPDATE runs SET goal=?", ("goal" + EVIL,))
        conn.execute("UPDATE runs SET reason=?, reason_detail=? WHERE id=?",
                     ("reason" + EVIL, "detail" + EVIL, done))
        conn.execute("UPDATE steps SET status=? WHERE run_id=?", ("DONE" + EVIL, done))
        step0 = conn.execute("SELECT id FROM steps WHERE run_id=? AND idx=0",
                             (done,)).fetchone()[0]
        _edit_json(conn, "steps", "decision_json", "id", step0, tool="balance" + EVIL,
                   kind="tool_call" + EVIL)
        _edit_json(conn, "steps", "observation_json", "id", step0, summary="sum" + EVIL,
                   kind="ok" + EVIL)
        _edit_json(conn, "steps", "policy_json", "id", step0, outcome="allow" + EVIL)
        seqs = [r[0] for r in conn.execute("SELECT seq FROM events ORDER BY seq")]
        conn.execute("UPDATE events SET type=? WHERE run_id=?", ("type" + EVIL, done))
        conn.execute("UPDATE events SET payload_json=? WHERE seq=?", ('{"raw":"' + EVIL + '"}',
                                                                      seqs[1]))
        conn.execute("UPDATE events SET payload_json=? WHERE seq=?",
                     (json.dumps({"escaped": EVIL}), seqs[2]))
        for seq in (seqs[0], seqs[-1]):
            conn.execute("UPDATE events SET hash=? WHERE seq=?", ("hash" + EVIL, seq))
        _rewrite_approval(conn, first.id, "appr-a" + EVIL, run_a)
        _rewrite_approval(conn, second.id, "appr-b" + EVIL, run_b)
        third = conn.execute("SELECT id FROM approvals WHERE run_id='run-c'").fetchone()[0]
        conn.execute("UPDATE approvals SET request_json=? WHERE id=?", ("unread" + EVIL, third))
    finally:
        conn.close()

    head = f"{seqs[-1]}:{'0' * 64}"
    commands = [["runs"], ["show", done], ["show", run_a], ["show", "run-c"], ["events", done],
                ["events", run_a], ["verify"], ["verify", "-head", head],
                ["verify", "-from", str(seqs[1])], ["show", "nope" + EVIL],
                ["approve", run_a, "-yes", "-by", "op" + EVIL, "-note", "ok" + EVIL],
                ["reject", run_b, "-approval", "appr-b" + EVIL, "-note", "no" + EVIL],
                ["cancel", "run-c", "-by", "op" + EVIL, "-note", EVIL], ["show", run_b]]
    outputs = {}
    for argv in commands:
        code, out, err = cli("-db", harness.path, *argv)
        assert_no_controls(out, f"stdout of {argv[0]}")
        assert_no_controls(err, f"stderr of {argv[0]}")
        outputs[" ".join(argv[:2])] = (code, out, err)

    assert "\\x1b[31m" in outputs["runs"][1] and "\\u{202e}" in outputs["runs"][1]
    assert "DONE\\x1b[31m" in outputs["show " + done][1]
    assert "sum\\x1b[31m" in outputs["show " + done][1]
    assert "pay\\x1b[31m" in outputs["show " + run_a][1]         # the approval block
    assert "unread" in outputs["show run-c"][1]
    assert "type\\x1b[31m" in outputs["events " + done][1]
    code, out, err = outputs["verify"]
    assert code == 1 and "broken at seq" in out and "hash\\x1b[31m" in out
    code, out, err = outputs["verify -head"]
    assert code == 1 and "hash\\x1b[31m" in err                  # the stored head, quoted
    assert outputs["show nope" + EVIL][0] == 1
    code, out, err = outputs["approve " + run_a]
    assert code == 0, err
    assert "appr-a\\x1b[31m" in out and "approved by op\\x1b[31m" in out
    code, out, err = outputs["reject " + run_b]
    assert code == 0 and "rejected" in out, err
    assert outputs["cancel run-c"][0] == 0

    # -json output is JSON whatever the rows hold, the controls escaped by the encoder.
    for argv in (["runs"], ["show", done], ["events", done], ["verify"]):
        code, out, _ = cli("-db", harness.path, "-json", *argv)
        json.loads(out)
        assert_no_controls(out, f"-json {argv[0]}")


def test_decide_line_names_an_edited_id_as_one_shell_word(harness, cli):
    """An operator pastes the printed decide line: a run id edited to hold a command stays
    one quoted word of it."""
    harness.waiting("run-1")
    harness.close()
    evil = "run-1; touch pwned 'x'"
    conn = sqlite3.connect(harness.path, isolation_level=None)
    try:
        _rename_run(conn, "run-1", evil)
    finally:
        conn.close()
    code, out, err = cli("-db", harness.path, "show", evil)
    assert code == 0, err
    decide = [line for line in out.splitlines() if line.startswith("decide with:")]
    assert len(decide) == 1
    assert "approve 'run-1; touch pwned '\"'\"'x'\"'\"'' -approval " in decide[0], decide[0]


# --------------------------------------------------------------------------------------------
# verify: what an edit of the chain looks like to the operator (core.md 15, verify)
# --------------------------------------------------------------------------------------------

def _chain(harness) -> list[tuple[int, str]]:
    """Three runs' events, the harness closed: [(seq, hash)] in seq order."""
    harness.completed("run-1")
    harness.completed("run-2")
    harness.waiting("run-3")
    harness.close()
    conn = sqlite3.connect(harness.path)
    try:
        return conn.execute("SELECT seq, hash FROM events ORDER BY seq").fetchall()
    finally:
        conn.close()


def _verify(cli, path: str, *argv: str) -> tuple[int, str, str]:
    code, out, err = cli("-db", path, "verify", *argv)
    assert not stderr_lines_prefixed(err), err
    return code, out, err


@pytest.mark.parametrize("which", ["middle", "first"])
def test_cli_verify_reports_a_missing_event(harness, cli, which):
    chain = _chain(harness)
    gone = chain[len(chain) // 2][0] if which == "middle" else chain[0][0]
    sql(harness.path, "DELETE FROM events WHERE seq=?", (gone,))
    code, out, err = _verify(cli, harness.path)
    assert code == 1
    detail = (f"the first event is seq {gone + 1}: an event is missing" if which == "first"
              else f"seq {gone + 1} follows {gone - 1}: an event is missing")
    assert f"broken at seq {gone + 1}: {detail}" in out, out
    assert f"  found    {chain[gone][1]}" in out                 # the next event's hash
    assert err == f"{PREFIX}error: the event chain is broken at seq {gone + 1}\n"
    assert "intact" not in out
    code, out, _ = cli("-db", harness.path, "-json", "verify")
    doc = json.loads(out)
    assert code == 1 and doc["intact"] is False
    assert doc["break"]["seq"] == gone + 1 and "missing" in doc["break"]["detail"]
    assert doc["checked"] == gone - 1


def test_cli_verify_cannot_see_the_last_events_deleted_without_a_kept_head(harness, cli):
    chain = _chain(harness)
    kept_seq, kept_hash = chain[-1]
    sql(harness.path, "DELETE FROM events WHERE seq>=?", (chain[-3][0],))
    code, out, err = _verify(cli, harness.path)
    new_head_seq, new_head_hash = chain[-4]
    assert (code, err) == (0, "")
    assert f"head: seq {new_head_seq} {new_head_hash}" in out
    assert f"intact: {new_head_seq} event(s), seq 1 to {new_head_seq}" in out
    # The head kept before the cut is past the chain now: no event has that seq.
    code, out, err = _verify(cli, harness.path, "-head", f"{kept_seq}:{kept_hash}")
    assert code == 1
    assert "kept head" not in out
    assert err == (f"{PREFIX}error: the chain does not match the head kept: seq {kept_seq} "
                   f"has no event, kept {kept_hash}\n")
    code, out, _ = cli("-db", harness.path, "-json", "verify", "-head",
                       f"{kept_seq}:{kept_hash}")
    assert code == 1
    assert json.loads(out)["kept_head"] == {"seq": kept_seq, "hash": kept_hash, "found": "",
                                            "matches": False}


def test_cli_verify_kept_head(harness, cli):
    chain = _chain(harness)
    seq, digest = chain[len(chain) // 2]
    code, out, err = _verify(cli, harness.path, "-head", f"{seq}:{digest}")
    assert (code, err) == (0, "")
    assert f"kept head: seq {seq} matches" in out
    assert f"intact: {len(chain)} event(s)" in out

    other = chain[0][1]                          # a real hash, of another seq
    code, out, err = _verify(cli, harness.path, "-head", f"{seq}:{other}")
    assert code == 1
    assert "matches" not in out and f"intact: {len(chain)} event(s)" in out
    assert err == (f"{PREFIX}error: the chain does not match the head kept: seq {seq} has "
                   f"{digest}, kept {other}\n")
    code, out, _ = cli("-db", harness.path, "-json", "verify", "-head", f"{seq}:{other}")
    assert code == 1
    assert json.loads(out)["kept_head"] == {"seq": seq, "hash": other, "found": digest,
                                            "matches": False}


@pytest.mark.parametrize("column", ["hash", "payload_json", "type", "run_id", "at"])
def test_cli_verify_reports_a_changed_event(harness, cli, column):
    chain = _chain(harness)
    seq = chain[len(chain) // 2][0]
    value = {"hash": "f" * 64, "payload_json": '{"index":7}', "type": "run.finished",
             "run_id": "run-9", "at": "2001-01-01T00:00:00Z"}[column]
    sql(harness.path, f"UPDATE events SET {column}=? WHERE seq=?", (value, seq))
    code, out, err = _verify(cli, harness.path)
    assert code == 1
    assert (f"broken at seq {seq}: the stored hash is not the one the event's fields and the "
            "previous event's hash give") in out, out
    found = "f" * 64 if column == "hash" else chain[seq - 1][1]
    assert f"  found    {found}" in out
    assert "  expected -" not in out
    assert err == f"{PREFIX}error: the event chain is broken at seq {seq}\n"
    # A walk that ends before the edit does not see it. The next event is chained to the
    # stored hash, so an edited hash breaks the walk from there too; an edited field not.
    assert _verify(cli, harness.path, "-to", str(seq - 1))[0] == 0
    code, out, _ = _verify(cli, harness.path, "-from", str(seq + 1))
    if column == "hash":
        assert code == 1 and f"broken at seq {seq + 1}" in out
        assert _verify(cli, harness.path, "-from", str(seq + 2))[0] == 0
    else:
        assert code == 0 and f"intact: {len(chain) - seq} event(s)" in out


# --------------------------------------------------------------------------------------------
# Refusals in the trail, and a reader that goes away
# --------------------------------------------------------------------------------------------

PAY = "bank_pay"


@pytest.fixture
def make(harnesses):
    return harnesses


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


# ---- Faults found in review ------------------------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

import re  # noqa: E402

from proxy_harness import ALLOW_PAY, NEWLINE_SERVER, ProxyHarness, operator  # noqa: E402


def test_events_json_keeps_number_literals(harness, cli):
    """Review 1, finding t8: `events -json` re-serialised payloads through Python floats, so
    the recorded 1250.50 was shown as 1250.5 (a different request to the runtime's hash).
    The stored literals are printed as written."""
    harness.waiting("r-lit", args=b'{"amount": 1250.50, "n": 12345678901234567890123}')
    code, out, err = cli("-db", harness.path, "-json", "events", "r-lit")
    assert code == 0, err
    json.loads(out)
    decided = out.split('"step.decided"', 1)[1]
    assert re.search(r'"amount":\s*1250\.50\b', decided), decided[:400]
    assert re.search(r'"n":\s*12345678901234567890123\b', decided)


@pytest.fixture
def erase_harness(tmp_path):
    h = ProxyHarness(tmp_path, command=NEWLINE_SERVER, rules={
        "erase": {"side_effect": "remote_mutation", "timeout": "5s",
                  "allow_hint_mismatch": True},
        "look": {"side_effect": "read_only", "timeout": "5s"}})
    yield h
    h.close()


def _nested_args(depth: int) -> bytes:
    """An arguments object nesting ``depth`` containers in all (the object counts)."""
    inner = "1"
    for _ in range(depth - 1):
        inner = "[" + inner + "]"
    return ('{"x":%s}' % inner).encode()


@pytest.mark.parametrize("depth", [254, 255])
def test_events_json_prints_arguments_nested_to_the_bound(erase_harness, depth):
    """The hardened proxy's review, finding 2: `events -json` cannot print a run whose arguments
    nest 254 or 255 levels: Out.json reads its own output back with the gate's MAX_DEPTH, not
    the record allowance."""
    h = erase_harness
    r = h.call("bank_erase", raw_args=_nested_args(depth))
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    run = h.runs()[-1]
    code, out, err = operator(h, "-json", "events", run.id)
    assert code == 0, f"events -json failed at depth {depth}: {err[:300]}"
    assert json.loads(out)["events"], out[:300]


def test_an_edited_approval_hash_that_is_not_ascii_is_refused_not_fatal(tmp_path, cli):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    edited rows: a hash that is not ASCII. An approval whose hash was edited to one that is not
    ASCII is refused by approve, never fatal, and nothing of it reaches the terminal raw."""
    import sqlite3
    rules = dict(ALLOW_PAY, pay={"side_effect": "remote_mutation", "timeout": "10s"})
    h = ProxyHarness(tmp_path, rules=rules)
    try:
        assert h.prefix(h.call("bank_pay", {"to": "bob", "amount": 3})) == "PENDING_APPROVAL"
        [approval] = h.pending()
        conn = sqlite3.connect(h.cfg.database)
        conn.execute("UPDATE approvals SET hash=? WHERE id=?",
                     ("\u202e" + approval.hash[1:], approval.id))
        conn.commit()
        conn.close()
        code, out, err = cli("-db", h.cfg.database, "approve", approval.run_id,
                             "-approval", approval.id, "-by", "op")
        assert code == 1 and "Traceback" not in err and "\u202e" not in out + err, out + err
        assert h.store.get_approval(approval.id).status == ap.PENDING
    finally:
        h.close()


def test_verify_reports_an_event_whose_fields_are_not_text(tmp_path, cli):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    edited rows: a value that is not text. verify reports an event whose fields are not text
    (bytes, a number), never fatal, and nothing of it reaches the terminal raw."""
    import sqlite3
    h = ProxyHarness(tmp_path)
    try:
        assert not h.is_error(h.call("bank_balance", {"account": "A-1"}))
    finally:
        h.close()
    conn = sqlite3.connect(h.cfg.database)
    conn.execute("UPDATE events SET payload_json=? WHERE seq=2", (b"\x1b[31m{}",))
    conn.execute("UPDATE events SET hash=? WHERE seq=3", (12345,))
    conn.commit()
    conn.close()
    code, out, err = cli("-db", h.cfg.database, "verify")
    assert code == 1 and "Traceback" not in err, out + err
    assert "\x1b" not in out + err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_operator_commands_and_the_webhook_refuse_a_database_another_user_owns(tmp_path):
    """The third review, finding 3: operator commands and the webhook opened a database another
    user owns. Now every opener applies serving's owner check."""
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
