"""A DENIED answer from a limit says when the window frees room for this call: the moment
enough of the executions it counts have left it, read from the limit's rows; or that the call
alone is over the max, so no window ever holds it. In-process, through the real host-facing
server, store and fake payment server, with the proxy's clock moved."""

from __future__ import annotations

import math

import pytest

from proxy_harness import ap

PAY = "bank_pay"


def pay_rule(limit):
    return {"pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow",
                    "limits": [dict(limit, per="1h", over="deny")]}}


@pytest.fixture
def make(harnesses):
    return harnesses


def starts(h) -> list[float]:
    return [at for (at,) in h.store._read("SELECT at FROM proxy_limit_uses ORDER BY n", ())]


def frees(at: float) -> str:
    return f"room for this call frees at {ap.fmt_time_s(math.ceil(at + 3600))}"


def paid(h, to, amount):
    r = h.call(PAY, {"to": to, "amount": amount})
    assert not h.is_error(r), h.text(r)


def test_a_calls_limit_says_when_the_oldest_call_leaves_the_window(make):
    h = make(rules=pay_rule({"calls": 2}))
    paid(h, "a", 1)
    h.clock.skew += 600
    paid(h, "b", 1)
    h.clock.skew += 300
    r = h.call(PAY, {"to": "c", "amount": 1})
    assert h.prefix(r) == "DENIED" and "2 of 2" in h.text(r), h.text(r)
    first, _ = starts(h)
    assert frees(first) in h.text(r), h.text(r)


def test_a_sum_limit_says_when_enough_has_left_the_window(make):
    """4 then 5 spent of 10; a call of 6 needs 5 to leave: both payments, so the second's
    start decides; a call of 2 needs only the first to leave."""
    h = make(rules=pay_rule({"sum": "/amount", "max": "10"}))
    paid(h, "z", 3)                          # out of the window by the time it matters
    h.clock.skew += 3700
    paid(h, "a", 4)
    h.clock.skew += 600
    paid(h, "b", 5)
    h.clock.skew += 300
    _, first, second = starts(h)
    r = h.call(PAY, {"to": "c", "amount": 6})
    assert h.prefix(r) == "DENIED" and frees(second) in h.text(r), h.text(r)
    r = h.call(PAY, {"to": "c", "amount": 2})
    assert h.prefix(r) == "DENIED" and frees(first) in h.text(r), h.text(r)


def test_a_call_over_the_max_alone_is_told_it_never_fits(make):
    h = make(rules=pay_rule({"sum": "/amount", "max": "10"}))
    r = h.call(PAY, {"to": "c", "amount": 11})
    assert h.prefix(r) == "DENIED" and "alone is over its max" in h.text(r), h.text(r)
    assert "frees at" not in h.text(r)
    assert h.payments() == 0
