"""What a decision is bound to is in its arguments: the hash the operator was shown and the
view it was shown from, each named by the caller (decide_approval's ``view``), never carried
by the type of a string. Each channel that shows a view (approve and reject, the inbox, the
webhook given the GET's view) binds its decision to it: a change to the view that leaves the
hash as it was is refused there, while a decision that names only the hash goes through.
"""

import json
import os
import sqlite3
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import agentrt_proxy as ap  # noqa: E402

LATER = "2099-01-01T00:00:00Z"          # an expiry that changes the view, never the hash


def decided_events(path: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT COUNT(*) FROM events WHERE type='approval.decided'"
                            ).fetchone()[0]
    finally:
        conn.close()


def move_expiry(path: str, approval: ap.Approval) -> None:
    """Change what the view holds, not what the hash binds: the approval stays verifiable."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("UPDATE approvals SET expires_at=? WHERE id=?", (LATER, approval.id))
        conn.commit()
    finally:
        conn.close()


def still_waiting(harness, approval: ap.Approval) -> bool:
    return harness.store.get_approval(approval.id).status == ap.PENDING and \
        decided_events(harness.path) == 0


def test_a_decision_that_names_no_view_is_refused(harness):
    approval = harness.waiting("run-1")
    with pytest.raises(TypeError):
        ap.decide_approval(harness.store, "run-1", approval.id, True, "op", "", approval.hash,
                           time.time())
    assert still_waiting(harness, approval)


def test_the_view_bound_is_the_one_named_not_one_a_string_carries(harness):
    approval = harness.waiting("run-1")
    stale = ap.view_of(harness.store, approval)
    move_expiry(harness.path, approval)

    class Carrying(str):
        view = stale

    with pytest.raises(ap.ApprovalChanged, match="expires_at"):
        ap.decide_approval(harness.store, "run-1", approval.id, True, "op", "",
                           Carrying(approval.hash), time.time(), view=stale)
    assert still_waiting(harness, approval)
    decided, _ = ap.decide_approval(harness.store, "run-1", approval.id, True, "op", "",
                                    Carrying(approval.hash), time.time(), view="")
    assert decided.status == ap.APPROVED


def test_a_decision_on_the_hash_alone_is_not_refused_by_a_changed_view(harness):
    """The reference the channel tests below stand on: the change they make is caught only
    by the view, so a channel that dropped its view would decide."""
    approval = harness.waiting("run-1")
    move_expiry(harness.path, approval)
    decided, _ = ap.decide_approval(harness.store, "run-1", approval.id, False, "op", "",
                                    approval.hash, time.time(), view="")
    assert decided.status == ap.REJECTED


def _tamper_after_showing(monkeypatch, harness):
    real_block = ap.approval_block

    def block_then_move(store, approval, db_path):
        lines = real_block(store, approval, db_path)
        move_expiry(harness.path, approval)
        return lines
    monkeypatch.setattr(ap, "approval_block", block_then_move)


@pytest.mark.parametrize("verb", ["approve", "reject"])
def test_approve_and_reject_bind_the_view_they_printed(harness, cli, monkeypatch, verb):
    approval = harness.waiting("run-1")
    _tamper_after_showing(monkeypatch, harness)
    code, _, err = cli("-db", harness.path, verb, "run-1", "-approval", approval.id)
    assert code == 1, err
    assert "changed after it was shown" in err and "expires_at" in err, err
    assert still_waiting(harness, approval)


@pytest.mark.parametrize("answers", ["a\n", "r\nno\n"])
def test_the_inbox_binds_the_view_it_showed(harness, cli, monkeypatch, answers):
    approval = harness.waiting("run-1")
    _tamper_after_showing(monkeypatch, harness)
    code, out, err = cli("-db", harness.path, "inbox", "-once", "-by", "op",
                         "-tty-not-required", stdin=answers)
    assert code == 0, err
    assert f"approval {approval.id} changed after it was shown: nothing was decided" in out
    assert "expires_at" in out, out
    assert still_waiting(harness, approval)


@pytest.mark.parametrize("action", ["approve", "reject"])
def test_the_webhook_binds_the_view_it_was_sent(harness, action):
    approval = harness.waiting("run-1")
    view = ap.view_of(harness.store, approval).digest       # what the GET gives as "view"
    move_expiry(harness.path, approval)
    hook = ap.Webhook(harness.path, b"s" * 32, lambda line: None)
    route = ap.HookRoute(action, "run-1", approval.id)
    body = json.dumps({"run_id": "run-1", "approval_id": approval.id, "hash": approval.hash,
                       "by": "op", "view": view}).encode()
    target = f"/runs/run-1/approvals/{approval.id}/{action}"
    with pytest.raises(ap.ApprovalChanged, match="its record changed"):   # a digest says no more
        hook._do_approve(harness.store, route, ap.HookRequest("POST", target, {}, body))
    assert still_waiting(harness, approval)
