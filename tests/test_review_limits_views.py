"""Limits against the operator's word on a cut-off attempt, and the limits an approval shows.

DESIGN.md section 9: a limit counts every execution, an attempt whose request left the proxy
or may have, whatever its outcome; within any window the counted sum never exceeds `max`
except by calls an operator approved over it. `reject -outcome not-executed` stops a limit
counting an attempt (uncount_attempt); nothing may make the limit forget an attempt the
record or the operator's latest word says executed. An approval's presentation records each
limit's definition and is bound by its hash: a limit written differently since asks again
(as a changed fixed value does in the seed), never collects under a definition nobody saw.

Payments run through the real host-facing server and the real fake payment server
(tests/proxy_harness.py); the operator's commands run in-process through ``main``.
"""

import asyncio
import io
import json
import time

import pytest

from proxy_harness import ProxyHarness, ap

PAY = "bank_pay"
SPEND = {"sum": "/amount", "max": 60, "per": "1h", "over": "deny"}
DAILY = {"sum": "/amount", "max": "50", "per": "24h", "name": "daily-spend"}
LEASE_WAIT = 200                     # looks, 0.1 s apart, for a 3 s lease to run out


def rules(*limits, timeout="300ms"):
    return {"balance": {"side_effect": "read_only", "timeout": "10s"},
            "pay": {"side_effect": "remote_mutation", "timeout": timeout, "outcome": "allow",
                    "limits": list(limits)}}


def cli(h, *argv):
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, *argv], stdin=io.StringIO(), stdout=out,
                   stderr=err)
    return code, out.getvalue(), err.getvalue()


def reject(h, approval, word):
    code, out, err = cli(h, "reject", "-approval", approval.id, "-by", "pat", "-note",
                         "the bank says", "-outcome", word)
    assert code == 0, err
    return out


def paid(h, to, amount):
    r = h.call(PAY, {"to": to, "amount": amount})
    return "paid" if not h.is_error(r) else h.prefix(r)


# -- 1. the operator's word and the limits --

@pytest.mark.parametrize("word", ["executed", "unknown"])
def test_a_later_word_that_the_attempt_executed_counts_it_again(harnesses, word):
    """The operator first says a cut-off payment of 30 did not execute; the identical call,
    past the repeat window, asks about the same attempt again, and the operator now says it
    executed (or that it is unknown). Both words print "it still counts toward the tool's
    limits", and the attempt must count again: a payment of 40 in the same hour would make
    70 of a max of 60, which no operator approved."""
    h = harnesses(rules=rules(SPEND))
    args = {"to": "bob", "amount": 30, "mode": "block"}
    assert h.prefix(h.call(PAY, args)) == "UNKNOWN_OUTCOME"
    [first] = h.pending()
    reject(h, first, "not-executed")
    h.clock.skew = 11 * 60                       # past the 10m repeat window, in the hour
    assert h.prefix(h.call(PAY, args)) == "UNKNOWN_OUTCOME"
    [again] = h.pending()
    assert ap.attempt_in(again.capability)["step_id"] == \
        ap.attempt_in(first.capability)["step_id"]              # the same attempt
    assert "still counts toward the tool's limits" in reject(h, again, word)
    assert paid(h, "carol", 40) == "DENIED"
    assert h.payments() == 1
    assert h.proxy.budgets.lines() == [f"{PAY}: 30 of 60 (sum of /amount) in the last 1h"]


def test_a_late_success_after_a_not_executed_word_counts_the_payment(harnesses):
    """Two proxies on one database. The first's payment of 30 is inside the server when it
    stops renewing its lease (as a stopped process does); the second takes the run over and
    asks; the operator says the attempt did not execute. Then the first wakes and records the
    payment's success: the store now knows it executed (gate_status says "it did take
    effect"), and the limit must count it again, here and in a proxy started afterwards; a
    payment of 40 in the same hour must be DENIED."""
    rl = rules(SPEND, timeout="20s")
    stalled = harnesses("h", rules=rl, lease_ttl="3s")
    args = {"to": "bob", "amount": 30, "mode": "block"}
    params = json.dumps({"name": PAY, "arguments": args}).encode()
    ident = stalled.request("tools/call", raw_params=params, wait=False)

    async def in_the_server():
        while stalled.payments() < 1:
            await asyncio.sleep(0.01)
    stalled.run(in_the_server())
    stalled.proxy.gate.leases.renew = lambda conn: None        # it stops, its lease runs out
    survivor = harnesses("h", rules=rl, lease_ttl="3s", pin=False)
    for _ in range(LEASE_WAIT):
        r = survivor.call(PAY, args)
        if survivor.prefix(r) != "IN_PROGRESS":
            break
        time.sleep(0.1)
    assert survivor.prefix(r) == "INTERRUPTED", survivor.text(r)
    [asked] = survivor.pending()
    reject(survivor, asked, "not-executed")
    stalled.release()
    assert stalled.text(stalled.answer(ident)["result"]) == "paid 30.00 to bob"
    status = survivor.text(survivor.call("gate_status", {"approval_id": asked.id}))
    assert "did take effect" in status, status
    assert survivor.proxy.budgets.lines() == [
        f"{PAY}: 30 of 60 (sum of /amount) in the last 1h"]
    restarted = harnesses("h", rules=rl, lease_ttl="3s", pin=False)   # catches up
    assert restarted.proxy.budgets.lines() == survivor.proxy.budgets.lines()
    assert paid(survivor, "carol", 40) == "DENIED"
    assert survivor.payments() == 1


# -- 2. what an approval shows, and what it binds --

def test_a_limit_written_differently_since_the_approval_asks_again(harnesses, tmp_path):
    """A limit asks for a payment of 15 at 40 of 50; the presentation records the limit as
    written (max 50) and the hash binds it. The configuration is then changed to max 20 and
    the proxy restarted; every view still shows the limit of 50, and the operator approves.
    The identical call must ask again (section 20: a limit written differently since the
    approval asks again), never pay under a max of 20 that no one was shown."""
    (tmp_path / "h").mkdir()
    first = ProxyHarness(tmp_path / "h", rules=rules(DAILY, timeout="10s"))
    try:
        for i in range(4):
            assert paid(first, f"p{i}", 10) == "paid"
        r = first.call(PAY, {"to": "bob", "amount": 15})
        assert first.prefix(r) == "PENDING_APPROVAL", first.text(r)
    finally:
        first.close()
    h = harnesses("h", rules=rules(dict(DAILY, max="20"), timeout="10s"), pin=False)
    [a] = h.pending()
    assert json.loads(a.presentation)["limits"][0]["limit"]["max"] == "50"
    code, out, err = cli(h, "pending")
    assert code == 0 and 'limit "daily-spend" of bank_pay: 40 of 50' in out, out
    code, out, err = cli(h, "approve", "-approval", a.id)
    assert code == 0, err
    r = h.call(PAY, {"to": "bob", "amount": 15})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    assert h.payments() == 4
