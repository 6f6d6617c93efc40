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


# ---- Unknown outcomes, faults found in review ------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

import io  # noqa: E402


def timed_out(h, args=None) -> ap.Approval:
    """A payment inside the server past its timeout: its outcome is unknown, and an
    interruption approval asks about it."""
    r = h.call(PAY, args or EIGHT)
    h.release()
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    (asked,) = h.pending()
    assert asked.kind == ap.INTERRUPTED_KIND
    return asked


def window_off_rule(**extra):
    return {"pay": {"side_effect": "remote_mutation", "timeout": "1s", "outcome": "allow",
                    "repeat_window": "0s", **extra}}


def asks_again(h):
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) in ("INTERRUPTED", "UNKNOWN_OUTCOME"), h.text(r)
    assert h.payments() == 1
    assert [a.kind for a in h.pending()] == [ap.INTERRUPTED_KIND]


def test_window_off_rejection_asks_again(harnesses):
    """The final review's sequences with the repeat window off ("repeat_window": "0s": rules 4
    and 5 off, so only rule 6 protects): an unknown outcome, then the operator's reject. Seed
    rule 6: the identical call asks again and never runs on allow alone."""
    h = harnesses(rules=window_off_rule(), approval_ttl="60s")
    asked = timed_out(h)
    h.decide(asked, approve=False, note="no")
    asks_again(h)


def test_window_off_cancel_asks_again(harnesses):
    """The final review's sequences with the repeat window off ("repeat_window": "0s": rules 4
    and 5 off, so only rule 6 protects): an unknown outcome, then the operator's cancel. Seed
    rule 6: the identical call asks again and never runs on allow alone."""
    h = harnesses(rules=window_off_rule(), approval_ttl="60s")
    asked = timed_out(h)
    ap.cancel_run(h.store, asked.run_id, "operator", "leave it", ap.time.time())
    asks_again(h)


def test_window_off_expiry_asks_again(harnesses):
    """The final review's sequences with the repeat window off ("repeat_window": "0s": rules 4
    and 5 off, so only rule 6 protects): an unknown outcome, then the question's expiry. Seed
    rule 6: the identical call asks again and never runs on allow alone."""
    h = harnesses(rules=window_off_rule(), approval_ttl="60s")
    timed_out(h)
    h.clock.skew += 61
    asks_again(h)


def test_window_off_rerun_denied_at_collection_asks_again(harnesses):
    """The final review's sequences with the repeat window off ("repeat_window": "0s": rules 4
    and 5 off, so only rule 6 protects): an unknown outcome, then an approved re-run a limit
    denies at collection. Seed rule 6: the identical call asks again and never runs on allow
    alone."""
    h = harnesses(rules=window_off_rule(limits=[{"name": "one-pay", "calls": 1, "per": "120s",
                                                 "over": "deny"}]), approval_ttl="60s")
    asked = timed_out(h)
    h.decide(asked, approve=True)
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) == "DENIED" and h.payments() == 1, h.text(r)
    h.clock.skew += 125                               # the limit has room again
    asks_again(h)


def test_window_off_other_key_after_expiry_then_identical(harnesses):
    """The final review's sequences with the repeat window off ("repeat_window": "0s": rules 4
    and 5 off, so only rule 6 protects): an unknown outcome, then the question's expiry, and
    another payment, BLOCKED. Seed rule 6: the identical call asks again; the tool is never
    blocked with nothing to act on."""
    h = harnesses(rules=window_off_rule(), approval_ttl="60s")
    timed_out(h)
    h.clock.skew += 61
    r = h.call(PAY, {"to": "carol", "amount": 1})
    assert h.prefix(r) == "BLOCKED", h.text(r)
    asks_again(h)


def reasked_then_cancelled(h) -> str:
    """A payment timed out; its question expired unanswered; the identical call asks again in
    a fresh run; the operator cancels that run (seed: a cancel resolves the unknown
    outcome). Returns the cancelled run's id."""
    timed_out(h)
    h.clock.skew += 61                               # approval_ttl 60s: it expires
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) in ("INTERRUPTED", "UNKNOWN_OUTCOME"), h.text(r)
    (asked,) = h.pending()
    ap.cancel_run(h.store, asked.run_id, "operator", "leave it", ap.time.time())
    return asked.run_id


def test_cancelling_the_reasked_question_resolves_the_unknown_outcome(make):
    """Seed, "The rules across calls": an unknown outcome is resolved, and the tool
    unblocked, when an operator rejects the re-run or cancels its run. The operator cancelled
    the run that asks; every other payment is free. Here the next payment is BLOCKED on a
    new question about the same attempt: the cancelled fresh run records no attempt
    (_last_attempt skips its cut-off step before looking at its interruption approval), so
    the expired run behind it decides (unknown_for_tool, resolved_by_operator), and an expiry
    resolves nothing. A cancel of the first question, in the run holding the attempt, does
    resolve it."""
    h = make(rules=pay_rule(), approval_ttl="60s")
    reasked_then_cancelled(h)
    for to in ("carol", "dave"):
        r = h.call(PAY, {"to": to, "amount": 1})
        assert not h.is_error(r) and h.text(r) == f"paid 1.00 to {to}", (to, h.text(r))
    assert h.pending() == []


def recheck_json(config: str) -> tuple[int, list]:
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["recheck", "-config", config, "-json"], stdin=io.StringIO(""), stdout=out,
                   stderr=err)
    return code, json.loads(out.getvalue())


def test_recheck_of_a_question_asked_through_a_limit_is_the_same(tmp_path):
    """Seed, "Re-checking recorded calls": the same configuration re-checks a re-run of an
    unknown outcome the same (TestRecheck_ReRunOfAnUnknownOutcomeIsTheSame); DESIGN section
    9: recheck re-evaluates conditions and limits. The interruption approval asked through
    the limit's deny (dadeca6) shows the deny's reason, and that reason now ends with "room
    for this call frees at ..." (eb29c13), read from the live clock and rows; re-check's
    policy has no Budgets (frees None), so its presentation, and so its approval hash,
    differ: recheck reports "asks for another approval" under the unchanged configuration
    and exits 1."""
    h = ProxyHarness(tmp_path, rules=pay_rule(limits=[DAILY]))
    try:
        asked = timed_out(h)
        shown = json.loads(asked.presentation)         # the figures, and no clock in them
        assert "8 of 10" in " ".join(shown.get("figures", [])), shown
        assert "frees at" not in json.dumps(shown), shown
    finally:
        h.close()
    code, reports = recheck_json(h.config_path)
    found = [(e["tool"], e["result"], e.get("detail", "")) for r in reports
             for e in r["evaluations"] if e["result"] == "different"]
    assert found == [] and code == 0, found


def test_an_unknown_outcome_under_a_denying_rule_leaves_something_to_act_on(make, tmp_path):
    """A payment of 8 timed out and its question expired unanswered (an expiry resolves
    nothing). The operator then makes the rule deny, with a condition allowing payments of at
    most 5. A payment of 1 is allowed by the policy, but the unknown outcome blocks it;
    unknown_block asks again in a fresh run of the payment of 8 (reopen), whose re-run the
    rule's deny denies outright ("a deny by the class or the rule's outcome still denies"),
    so no question opens: the payment of 1 is answered UNAVAILABLE, and so is every later
    payment, with nothing pending. Seed: "The tool is never blocked with nothing for an
    operator to act on." Either the payment of 1 runs, or it is BLOCKED naming an approval
    that waits."""
    (tmp_path / "h").mkdir()
    first = ProxyHarness(tmp_path / "h", rules=pay_rule(), approval_ttl="60s")
    try:
        asked = timed_out(first)
        first.clock.skew += 61
        first.proxy.resume.attach_and_close(asked.run_id)  # the expiry is recorded
        assert first.pending() == []
    finally:
        first.close()
    small = {"if": {"properties": {"amount": {"type": "number", "maximum": 5}},
                    "required": ["amount"]}, "outcome": "allow", "why": "small"}
    h = make("h", rules={"pay": dict(pay_rule()["pay"], outcome="deny", when=[small])},
             pin=False, approval_ttl="60s")
    for to in ("carol", "dave"):
        r = h.call(PAY, {"to": to, "amount": 1})
        waiting = [a.id for a in h.pending()]
        ok = not h.is_error(r) and h.text(r) == f"paid 1.00 to {to}"
        asks = h.prefix(r) == "BLOCKED" and any(a in h.text(r) for a in waiting)
        assert ok or asks, (h.text(r), waiting)
