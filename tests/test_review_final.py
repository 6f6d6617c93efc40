"""Sequences across calls with the repeat window off ("repeat_window": "0s": rules 4 and 5
off, so only rule 6 protects): an unknown outcome, then an operator's reject, cancel, expiry
or an approved re-run a limit denies at collection. Seed rule 6: the identical call asks
again and never runs on allow alone; the tool is never blocked with nothing to act on."""

from __future__ import annotations

import pytest

from proxy_harness import ap

PAY = "bank_pay"
EIGHT = {"to": "bob", "amount": 8, "mode": "block"}


def pay_rule(**extra):
    return {"pay": {"side_effect": "remote_mutation", "timeout": "1s", "outcome": "allow",
                    "repeat_window": "0s", **extra}}


def timed_out(h):
    r = h.call(PAY, EIGHT)
    h.release()
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    (asked,) = h.pending()
    assert asked.kind == ap.INTERRUPTED_KIND
    return asked


def asks_again(h):
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) in ("INTERRUPTED", "UNKNOWN_OUTCOME"), h.text(r)
    assert h.payments() == 1
    assert [a.kind for a in h.pending()] == [ap.INTERRUPTED_KIND]


def test_window_off_rejection_asks_again(harnesses):
    h = harnesses(rules=pay_rule(), approval_ttl="60s")
    asked = timed_out(h)
    h.decide(asked, approve=False, note="no")
    asks_again(h)


def test_window_off_cancel_asks_again(harnesses):
    h = harnesses(rules=pay_rule(), approval_ttl="60s")
    asked = timed_out(h)
    ap.cancel_run(h.store, asked.run_id, "operator", "leave it", ap.time.time())
    asks_again(h)


def test_window_off_expiry_asks_again(harnesses):
    h = harnesses(rules=pay_rule(), approval_ttl="60s")
    timed_out(h)
    h.clock.skew += 61
    asks_again(h)


def test_window_off_rerun_denied_at_collection_asks_again(harnesses):
    h = harnesses(rules=pay_rule(limits=[{"name": "one-pay", "calls": 1, "per": "120s",
                                          "over": "deny"}]), approval_ttl="60s")
    asked = timed_out(h)
    h.decide(asked, approve=True)
    r = h.call(PAY, EIGHT)
    assert h.prefix(r) == "DENIED" and h.payments() == 1, h.text(r)
    h.clock.skew += 125                               # the limit has room again
    asks_again(h)


def test_window_off_other_key_after_expiry_then_identical(harnesses):
    h = harnesses(rules=pay_rule(), approval_ttl="60s")
    timed_out(h)
    h.clock.skew += 61
    r = h.call(PAY, {"to": "carol", "amount": 1})
    assert h.prefix(r) == "BLOCKED", h.text(r)
    asks_again(h)
