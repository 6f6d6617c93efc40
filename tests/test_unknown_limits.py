"""An unknown outcome is asked about whatever the policy says short of a deny by the class or
the rule (seed rule 6): a deny by a condition or a limit does not stop the question, because
the operator must learn that the call may have taken effect (DESIGN section 9). At
collection the policy is evaluated again: an approved re-run that a condition or limit then
denies runs nothing, and resolves the unknown outcome as a rejection would. The tool is never
left blocked with nothing for an operator to act on. In-process, through the real
host-facing server, store and fake payment server."""

from __future__ import annotations

import json

import pytest

from proxy_harness import ProxyHarness, ap

PAY = "bank_pay"
EIGHT = {"to": "bob", "amount": 8, "mode": "block"}
DAILY = {"name": "daily", "sum": "/amount", "max": "10", "per": "24h", "over": "deny"}


def pay_rule(**extra):
    return {"pay": {"side_effect": "remote_mutation", "timeout": "1s", "outcome": "allow",
                    **extra}}


@pytest.fixture
def make(harnesses):
    return harnesses


def timed_out_payment(h, per="24h") -> ap.Approval:
    """A payment of 8 inside the server past its timeout: its outcome is unknown, and the
    operator is asked at once, with the limit's figures, though a re-run would go over."""
    r = h.call(PAY, EIGHT)
    h.release()
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    (asked,) = h.pending()
    assert asked.kind == ap.INTERRUPTED_KIND
    assert asked.id in h.text(r), h.text(r)          # the model is told which question waits
    shown = json.loads(asked.presentation)
    said = " ".join(shown.get("figures", [])) + " " + shown["notice"]
    assert f'limit "daily" of bank_pay: 8 of 10 in the last {per}' in said, shown
    assert "this call adds 8" in said, shown
    assert "runs nothing" in shown["notice"], shown
    return asked


def first_attempt_rejected(tmp_path) -> None:
    """In tmp_path/h: a payment of 8 timed out, and the operator rejected its re-run (the
    repeat window off, so that the identical call asks again at once under a new rule)."""
    (tmp_path / "h").mkdir(exist_ok=True)
    h = ProxyHarness(tmp_path / "h", rules=pay_rule(), repeat_window="0s")
    try:
        r = h.call(PAY, EIGHT)
        h.release()
        assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
        for a in h.pending():
            h.decide(a, approve=False)
    finally:
        h.close()


def test_a_deny_limit_does_not_stop_the_question_about_an_unknown_outcome(make):
    """The review's story: every other payment was UNAVAILABLE, and no operator was told."""
    h = make(rules=pay_rule(limits=[DAILY]))
    asked = timed_out_payment(h)
    r = h.call(PAY, {"to": "carol", "amount": 1})
    assert h.prefix(r) == "BLOCKED" and asked.id in h.text(r), h.text(r)
    assert h.payments() == 1


def test_an_approved_rerun_a_limit_denies_at_collection_runs_nothing_and_frees_the_tool(make):
    h = make(rules=pay_rule(limits=[DAILY]))
    asked = timed_out_payment(h)
    h.decide(asked, approve=True)
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) == "DENIED", h.text(r)
    assert "nothing was run" in h.text(r) and "8 of 10" in h.text(r), h.text(r)
    assert h.payments() == 1
    # Resolved as a rejection resolves it: the tool is free for another payment ...
    r = h.call(PAY, {"to": "carol", "amount": 1})
    assert not h.is_error(r) and h.text(r) == "paid 1.00 to carol", h.text(r)
    # ... the identical call is refused within the window, as a rejected one is ...
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) == "DENIED" and "refused until" in h.text(r), h.text(r)
    assert h.pending() == []
    # ... and after it asks again, never running on allow alone.
    h.clock.skew += 600 + 5
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) in ("UNKNOWN_OUTCOME", "INTERRUPTED"), h.text(r)
    assert [a.kind for a in h.pending()] == [ap.INTERRUPTED_KIND]
    assert h.payments() == 2


def test_an_approved_rerun_with_room_again_runs_once(make):
    """Approved, and the limit's window has room again at collection: it runs, once."""
    h = make(rules=pay_rule(limits=[dict(DAILY, per="1h")]))
    asked = timed_out_payment(h, "1h")
    h.decide(asked, approve=True)
    h.clock.skew += 3600 + 60
    r = h.call(PAY, EIGHT)
    assert not h.is_error(r) and h.text(r) == "paid 8.00 to bob", h.text(r)
    assert h.payments() == 2


def test_a_condition_that_denies_the_rerun_still_asks(make, tmp_path):
    """A condition added since the attempt denies its arguments: the question is asked all
    the same, naming the condition; approved, it runs nothing."""
    first_attempt_rejected(tmp_path)
    big = {"if": {"properties": {"amount": {"type": "number", "minimum": 5}},
                  "required": ["amount"]}, "outcome": "deny", "why": "too much"}
    g = make("h", rules=pay_rule(when=[big]), pin=False, repeat_window="0s")
    r = g.call(PAY, EIGHT)
    assert g.prefix(r) in ("UNKNOWN_OUTCOME", "INTERRUPTED"), g.text(r)
    (asked,) = g.pending()
    shown = json.dumps(json.loads(asked.presentation))
    assert "when[0]" in shown and "too much" in shown, shown
    g.decide(asked, approve=True)
    r = g.call(PAY, EIGHT)
    assert g.prefix(r) == "DENIED" and "nothing was run" in g.text(r), g.text(r)
    assert g.payments() == 1


def test_a_deny_by_the_rule_still_denies_the_rerun(make, tmp_path):
    """Short of deny: the rule's own outcome deny is a deny, as the seed says."""
    first_attempt_rejected(tmp_path)
    g = make("h", rules={"pay": dict(pay_rule()["pay"], outcome="deny")}, pin=False,
             repeat_window="0s")
    r = g.call(PAY, EIGHT)
    assert g.prefix(r) == "DENIED" and g.pending() == [], g.text(r)


def test_a_rejected_question_about_an_attempt_never_says_it_was_not_executed(make):
    """The operator rejected running it again; the attempt itself may have taken effect
    (the operator may even have recorded that it did): the model is not told otherwise."""
    h = make(rules=pay_rule())
    r = h.call(PAY, EIGHT)
    h.release()
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    (asked,) = h.pending()
    h.decide(asked, approve=False, note="it went through")
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) == "REJECTED" and "it went through" in h.text(r), h.text(r)
    assert "running this exact request again" in h.text(r), h.text(r)
    assert "not executed" not in h.text(r), h.text(r)
