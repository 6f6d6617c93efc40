"""Sequences that break the repeat rules (executed_within), the question about an unknown
outcome asked through a condition's or a limit's deny (seed rule 6, DESIGN section 9), and a
limit's "room frees at" (Budgets.frees_at). Each test states what the seed or DESIGN
requires; in-process, through the real host-facing server, store and fake payment server."""

from __future__ import annotations

import io
import json
import sqlite3

import pytest

from proxy_harness import ProxyHarness, ap
from test_executed_within import LIMIT_PER, WINDOW, Pair as SharedPair

PAY = "bank_pay"
EIGHT = {"to": "bob", "amount": 8, "mode": "block"}
ARGS = {"to": "rob", "amount": 8, "mode": "block"}


@pytest.fixture
def make(harnesses):
    return harnesses


def pay_rule(**extra):
    return {"pay": {"side_effect": "remote_mutation", "timeout": "1s", "outcome": "allow",
                    **extra}}


def timed_out(h, args=None) -> ap.Approval:
    """A payment inside the server past its timeout: its outcome is unknown, and an
    interruption approval asks about it."""
    r = h.call(PAY, args or EIGHT)
    h.release()
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    (asked,) = h.pending()
    assert asked.kind == ap.INTERRUPTED_KIND
    return asked


# ---- a cancelled question asked again in a fresh run ----

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


class Pair(SharedPair):
    """A stalled proxy and a survivor on one database (tests/test_executed_within.py): the
    first's payment is inside the server when its loop stops; its lease runs out; the
    survivor takes the run over. The first wakes later and records the success late, at
    the survivor's time (one machine: one clock)."""

    def __init__(self, tmp):
        super().__init__(tmp, "refuse")

    def wake(self) -> dict:
        self.stalled.clock.skew = self.survivor.clock.skew
        return super().wake()


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path)
    yield p
    p.close()


def test_a_late_success_behind_a_cancelled_reasked_question_is_not_paid_again(pair):
    """The walk's stop (executed_within: "rows close in the order they were opened, so the
    walk stops at the first closed before the window") reached by ordinary steps: the
    question expires, the identical call asks again in a fresh run (closing the first run's
    row), the operator cancels it, and more than the repeat window later the stalled proxy
    records the first attempt's success. The cancelled run records no attempt and is passed
    over; the first run's row closed before the window, so the walk stops there, though its
    outcome was recorded just now. The identical call then runs under allow alone: the
    server is paid twice with no operator approving a second payment. By the seed's rule 5
    (and ab25f33's window, from the recording of the late outcome) it is DUPLICATE."""
    p = pair
    h = p.survivor
    p.pay_inside_the_server()
    assert h.prefix(h.call(PAY, ARGS)) == "INTERRUPTED"
    h.clock.skew += 61                               # the question expires unanswered
    r = h.call(PAY, ARGS)                            # asked again, in a fresh run
    assert h.prefix(r) in ("INTERRUPTED", "UNKNOWN_OUTCOME"), h.text(r)
    (asked,) = h.pending()
    ap.cancel_run(h.store, asked.run_id, "operator", "leave it", ap.time.time())
    h.clock.skew += WINDOW + 30
    p.wake()                                         # the first attempt paid: recorded now
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "DUPLICATE" and "paid 8.00 to rob" in h.text(r), h.text(r)
    assert h.payments() == 1


# ---- re-check of a question asked through a limit's deny ----

DAILY = {"name": "daily", "sum": "/amount", "max": "10", "per": "24h", "over": "deny"}


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


# ---- "room for this call frees at" ----

def test_room_frees_at_is_no_earlier_than_every_deny_limit_allows(make):
    """Two limits that deny: at most 2 calls per hour, and a sum of 10 per 24h. The call is
    over both; judge stops at the first, and the model is told "room for this call frees
    at" the hour limit's time. At that time the call is DENIED by the daily sum: the model
    was told to retry too early (eb29c13: the answer says when the window has room for the
    call). Whatever it names, a call made at the time it names must not be DENIED by a
    limit that was already over when it was named."""
    rules = {"pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow",
                     "limits": [{"calls": 2, "per": "1h", "over": "deny"},
                                {"name": "daily", "sum": "/amount", "max": "10", "per": "24h",
                                 "over": "deny"}]}}
    h = make(rules=rules)
    for to in ("a", "b"):
        r = h.call(PAY, {"to": to, "amount": 5})
        assert not h.is_error(r), h.text(r)
    r = h.call(PAY, {"to": "c", "amount": 1})
    text = h.text(r)
    assert h.prefix(r) == "DENIED" and "frees at " in text, text
    named = text.split("frees at ", 1)[1][:20]
    h.clock.skew = ap.parse_time(named) - ap.time.time() + 1         # a second after it
    r = h.call(PAY, {"to": "c", "amount": 1})
    assert not h.is_error(r), h.text(r)


def test_a_limit_row_far_in_the_future_still_denies_by_the_limit(make):
    """A row of proxy_limit_uses whose time is far ahead (an edited database, or a clock
    that once jumped): _use counts it and the limit denies, but frees_at's time does not
    convert (fmt_time_s: "year 318857 is out of range"), the policy fails, and the model is
    told Python's exception instead of the limit (DESIGN section 9: a deny by a limit names
    the limit, with its use and its max). On the re-run of an unknown outcome the same
    failure means the operator is never asked (nothing pending, every payment DENIED)."""
    rules = {"pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow",
                     "limits": [{"calls": 1, "per": "1h", "over": "deny"}]}}
    h = make(rules=rules)
    r = h.call(PAY, {"to": "a", "amount": 1})
    assert not h.is_error(r), h.text(r)
    conn = sqlite3.connect(h.cfg.database)
    with conn:
        conn.execute("UPDATE proxy_limit_uses SET at=at+1e13")
    conn.close()
    r = h.call(PAY, {"to": "b", "amount": 1})
    assert h.prefix(r) == "DENIED" and "limits[0] of bank_pay: 1 of 1 calls" in h.text(r), \
        h.text(r)


# ---- an unknown outcome under a rule that now denies, with a condition that allows ----

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
        first.proxy._attach_and_close(asked.run_id)      # the expiry is recorded
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


def test_a_late_success_of_an_attempt_an_approved_rerun_followed_is_not_paid_again(pair):
    """The same run holds two attempts: the first cut off (its proxy stalled), the second an
    approved re-run that paid. More than the repeat window after the re-run, the stalled
    proxy records the first attempt's success. execution_of reads only the run's last
    attempt, so the window runs from the re-run's end, long past, and the identical call
    pays a third time with no operator. ab25f33: the window runs from the later of the
    run's end and the recording of a late outcome; the first attempt's success was recorded
    just now, so the call is DUPLICATE."""
    p = pair
    h = p.survivor
    p.pay_inside_the_server()
    assert h.prefix(h.call(PAY, ARGS)) == "INTERRUPTED"
    h.decide(h.pending()[0], approve=True)
    h.clock.skew += LIMIT_PER + 5                    # the limit has room for the re-run
    h.release()
    r = h.call(PAY, ARGS)
    assert h.text(r) == "paid 8.00 to rob" and h.payments() == 2, h.text(r)
    h.clock.skew += WINDOW + 30
    p.stalled.clock.skew = h.clock.skew              # one machine: one clock
    p.wake()                                         # the first attempt: recorded now
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "DUPLICATE", h.text(r)
    assert h.payments() == 2


def test_a_late_success_of_an_attempt_a_newer_run_ran_again_is_not_paid_again(pair):
    """As above, but the approved re-run is in a newer run: the first attempt's question
    expired, the identical call asked again in a fresh run (closing the first run's row), and
    that re-run paid. More than the window later the first attempt's success is recorded:
    the first run's row closed long before the window, so only the known rows settled
    within it (CallIndex.executions' second part) find it, and the call is DUPLICATE."""
    p = pair
    h = p.survivor
    p.pay_inside_the_server()
    assert h.prefix(h.call(PAY, ARGS)) == "INTERRUPTED"
    h.clock.skew += LIMIT_PER + 5                    # the question expires; the limit has room
    r = h.call(PAY, ARGS)
    assert h.prefix(r) in ("INTERRUPTED", "UNKNOWN_OUTCOME"), h.text(r)
    (asked,) = h.pending()
    first = p.stalled.runs()[0].id
    assert asked.run_id != first, "asked again in a fresh run"
    h.decide(asked, approve=True)
    h.release()
    r = h.call(PAY, ARGS)
    assert h.text(r) == "paid 8.00 to rob" and h.payments() == 2, h.text(r)
    h.clock.skew += WINDOW + 30
    p.stalled.clock.skew = h.clock.skew              # one machine: one clock
    p.wake()                                         # the first attempt: recorded now
    r = h.call(PAY, ARGS)
    assert h.prefix(r) == "DUPLICATE", h.text(r)
    assert h.payments() == 2
