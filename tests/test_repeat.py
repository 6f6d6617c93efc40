"""A repeat the operator allows (DESIGN.md section 10): `repeat: "ask"` in a rule, or at the
top level as every rule's default. An identical call within the window asks the operator
with an approval of kind `repeat` naming the earlier execution, instead of answering
DUPLICATE; approving runs it once more, rejecting answers REJECTED with the note. Through
the real host-facing server, the real store and the fake payment server.
"""

from __future__ import annotations

import json

import pytest

from proxy_harness import ProxyHarness, ap

PAY = "bank_pay"
ARGS = {"to": "landlord", "amount": 950}


def rules(**pay):
    return {"balance": {"side_effect": "read_only", "timeout": "10s"},
            "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow",
                    **pay}}


@pytest.fixture
def make(harnesses):
    return harnesses


def test_repeat_refuse_is_the_default(make):
    h = make(rules=rules())
    assert not h.is_error(h.call(PAY, ARGS))
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "DUPLICATE" and h.payments() == 1 and h.pending() == []


def test_repeat_ask_asks_naming_the_earlier_execution(make):
    h = make(rules=rules(repeat="ask"))
    first = h.call(PAY, ARGS)
    assert h.text(first) == "paid 950.00 to landlord"
    earlier = h.runs()[0]
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 1, h.text(r)
    (asked,) = h.pending()
    assert asked.kind == "repeat"
    cap = json.loads(asked.capability)
    assert cap["repeat_of"]["run_id"] == earlier.id
    assert cap["repeat_of"]["at"] == earlier.finished_at
    shown = json.loads(asked.presentation)
    assert "paid 950.00 to landlord" in shown["notice"], shown
    assert earlier.id in shown["notice"] and "already executed" in shown["notice"]
    assert asked.id in h.text(r) and "already executed, at " in h.text(r), h.text(r)
    assert "approve running it once more" in h.text(r)
    assert h.prefix(h.call(PAY, ARGS)) == "PENDING_APPROVAL" and h.payments() == 1   # waits


def paid_then_asked(h, approve: bool | None = None, note: str = ""):
    """Pay once, repeat the identical call, and (when told) decide the repeat approval."""
    assert not h.is_error(h.call(PAY, ARGS))
    h.call(PAY, ARGS)
    (asked,) = h.pending()
    if approve is not None:
        h.decide(asked, approve=approve, note=note)
    return asked


def test_repeat_approved_runs_once_more_and_then_asks_again(make):
    h = make(rules=rules(repeat="ask"))
    asked = paid_then_asked(h, approve=True)
    r = h.call(PAY, ARGS)
    assert h.text(r) == "paid 950.00 to landlord" and h.payments() == 2
    second = next(run for run in h.runs() if run.id == asked.run_id)
    assert second.status == "COMPLETED"
    r = h.call(PAY, ARGS)                      # the second execution is now the earlier one
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 2
    (again,) = h.pending()
    assert json.loads(again.capability)["repeat_of"]["run_id"] == second.id


def test_repeat_rejected_answers_rejected_with_the_note(make):
    h = make(rules=rules(repeat="ask"))
    paid_then_asked(h, approve=False, note="paid already")
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "REJECTED" and "paid already" in h.text(r), h.text(r)
    assert h.payments() == 1


def test_repeat_top_level_default_and_a_rule_overrides_it(make):
    h = make(rules=rules(repeat="refuse"), repeat="ask")
    assert not h.is_error(h.call(PAY, ARGS))
    assert h.prefix(h.call(PAY, ARGS)) == "DUPLICATE"
    g = make("g", rules=rules(), repeat="ask")
    assert not g.is_error(g.call(PAY, ARGS))
    assert g.prefix(g.call(PAY, ARGS)) == "PENDING_APPROVAL"
    assert [a.kind for a in g.pending()] == ["repeat"]


def test_repeat_outside_the_window_needs_no_approval(make):
    h = make(rules=rules(repeat="ask"))
    assert not h.is_error(h.call(PAY, ARGS))
    h.clock.skew += ap.DEFAULT_REPEAT_WINDOW + 5
    assert not h.is_error(h.call(PAY, ARGS)) and h.payments() == 2 and h.pending() == []


def test_repeat_a_policy_deny_still_denies(make, tmp_path):
    (tmp_path / "h").mkdir()
    h = ProxyHarness(tmp_path / "h", rules=rules(repeat="ask"))
    try:
        assert not h.is_error(h.call(PAY, ARGS))
    finally:
        h.close()
    g = make("h", rules=rules(repeat="ask", outcome="deny"), pin=False)
    r = g.call(PAY, ARGS)
    assert g.prefix(r) == "DENIED" and g.pending() == [] and g.payments() == 1, g.text(r)


def test_repeat_an_unknown_outcome_stays_an_interruption(make):
    h = make(rules=rules(repeat="ask", timeout="1s"))
    r = h.call(PAY, dict(ARGS, mode="block"))
    assert h.prefix(r) != "PENDING_APPROVAL", h.text(r)     # timed out: unknown outcome
    h.release()
    r = h.call(PAY, dict(ARGS, mode="block"))
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    assert [a.kind for a in h.pending()] == [ap.INTERRUPTED_KIND]


def test_repeat_config_errors(tmp_path):
    from proxy_harness import write_config
    for i, (where, value) in enumerate((("rule", "maybe"), ("top", "always"), ("rule", 1))):
        d = tmp_path / f"c{i}"
        d.mkdir()
        if where == "rule":
            path = write_config(str(d), rules(repeat=value))
        else:
            path = write_config(str(d), rules(), repeat=value)
        with pytest.raises(ap.ConfigError) as exc:
            ap.load_config(path)
        assert "repeat" in str(exc.value) and "refuse" in str(exc.value), str(exc.value)


def test_repeat_recheck_finds_the_repeat_decided_as_recorded(make):
    h = make(rules=rules(repeat="ask"))
    asked = paid_then_asked(h, approve=True)
    assert not h.is_error(h.call(PAY, ARGS))
    import subprocess
    import sys
    p = subprocess.run([sys.executable, ap.__file__, "recheck", "-config", h.config_path,
                        "-run", asked.run_id], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "DIFFERENT" not in p.stdout, p.stdout + p.stderr
    assert "same" in p.stdout, p.stdout


def test_repeat_gate_status_says_the_request_already_executed(make):
    h = make(rules=rules(repeat="ask"))
    asked = paid_then_asked(h)
    said = h.text(h.call("gate_status", {}))
    assert asked.id in said and "this exact request already executed" in said, said
    assert "runs once more" in said, said


def test_repeat_a_denied_repeat_does_not_hide_the_earlier_execution(make):
    """Found in review: under ask, a repeat denied by a limit ended without executing, and
    the next identical call within the window then ran unasked."""
    once = [{"calls": 1, "per": "60s", "over": "deny"}]
    h = make(rules=rules(repeat="ask", limits=once))
    assert not h.is_error(h.call(PAY, ARGS))
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "DENIED", h.text(r)                 # the limit refuses the repeat
    h.clock.skew += 70                                        # the limit frees; window not
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 1, h.text(r)
    assert [a.kind for a in h.pending()] == ["repeat"]


def test_repeat_approvals_count_toward_max_pending(make):
    h = make(rules=rules(repeat="ask"), max_pending=1)
    for to in ("a", "b"):
        assert not h.is_error(h.call(PAY, {"to": to, "amount": 1}))
    assert h.prefix(h.call(PAY, {"to": "a", "amount": 1})) == "PENDING_APPROVAL"
    r = h.call(PAY, {"to": "b", "amount": 1})
    assert h.prefix(r) == "BLOCKED" and len(h.pending()) == 1, h.text(r)


def test_a_refusal_count_waits_briefly_for_another_writer(make):
    """While another process holds the write lock, the refusal is answered and its count
    skipped: every write the call tries waits at most REFUSAL_WAIT_MS for the lock (read
    from the busy timeout set before each, never timed)."""
    import sqlite3
    h = make(rules=rules())
    assert not h.is_error(h.call(PAY, ARGS))
    other = sqlite3.connect(h.cfg.database, isolation_level=None)
    statements: list[str] = []
    try:
        other.execute("BEGIN IMMEDIATE")                       # another process writes long
        h.store.conn.set_trace_callback(statements.append)
        assert h.prefix(h.call(PAY, ARGS)) == "DUPLICATE"
        h.store.conn.set_trace_callback(None)
        assert any("refusal of it was not counted" in line for line in h.log_lines)
    finally:
        other.execute("ROLLBACK")
        other.close()
    waits, busy = [], ap.BUSY_TIMEOUT_MS
    for sql in statements:
        if sql.startswith("PRAGMA busy_timeout="):
            busy = int(sql.split("=", 1)[1])
        elif sql.startswith("BEGIN IMMEDIATE"):
            waits.append(busy)
    assert waits and all(ms <= ap.REFUSAL_WAIT_MS for ms in waits), (waits, statements)
