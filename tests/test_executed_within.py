"""Whether this request executed within the repeat window, and with what outcome, late
outcomes included: one function (Proxy.executed_within) answers it for the duplicate rule
and for a rule that asks about a repeat. The window runs from the later of the run's end and
the recording of its outcome.

Two in-process proxies on one database: the first's payment is inside the server when its
event loop stops running (a stall: nothing it holds moves), its lease runs out, and the
second takes the run over. The first wakes later and records the payment's success as a
late outcome. Every order is tried: the late outcome recorded before the rules judge, after
a re-run a limit refused, after an expired question, after a rejected one, after a re-run
the operator approved and the limit then denied at collection. In every one the identical
call within the window runs nothing more, and the server is paid once."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from proxy_harness import ProxyHarness, ap

PAY = "bank_pay"
ARGS = {"to": "rob", "amount": 8, "mode": "block"}
LIMIT_PER = 120                  # the limit's window, seconds of the proxies' clock
WINDOW = 600                     # the repeat window


def rules(repeat="refuse"):
    return {"pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow",
                    "repeat": repeat,
                    "limits": [{"name": "one-pay", "calls": 1, "per": f"{LIMIT_PER}s",
                                "over": "deny"}]}}


class Pair:
    """The stalled proxy and the survivor, on one directory, one database, one ledger."""

    def __init__(self, tmp, repeat: str):
        top = dict(rules=rules(repeat), lease_ttl="3s", approval_ttl="60s",
                   repeat_window=f"{WINDOW}s")
        self.stalled = ProxyHarness(tmp, **top)
        self.survivor = ProxyHarness(tmp, pin=False, **top)
        self.ident = None

    def pay_inside_the_server(self) -> str:
        s = self.stalled
        self.ident = s.request("tools/call", {"name": PAY, "arguments": ARGS}, wait=False)

        async def inside():
            while s.payments() < 1:
                await asyncio.sleep(0.01)
        s.run(inside(), 30)
        (run,) = s.runs()
        # Its loop stops here: a stall. Its lease runs out as a stall's would.
        conn = sqlite3.connect(s.cfg.database)
        with conn:
            conn.execute("UPDATE runs SET lease_expires_at=? WHERE id=?",
                         (ap.fmt_time(ap.time.time() - 1), run.id))
        conn.close()
        return run.id

    def wake(self) -> dict:
        """The server answers; the stalled proxy runs again and records the outcome late."""
        self.stalled.release()
        msg = self.stalled.answer(self.ident, 30)
        assert self.stalled.text(msg["result"]) == "paid 8.00 to rob", msg
        late = [e for r in self.survivor.runs() for e in self.survivor.store.list_events(r.id)
                if e[4] == "step.tool_finished"]
        assert late, "the late outcome was recorded"
        return msg

    def call(self) -> dict:
        return self.survivor.call(PAY, ARGS)

    def close(self):
        for h in (self.stalled, self.survivor):
            try:
                h.close()
            except Exception:
                pass


@pytest.fixture
def pair(tmp_path):
    made = []

    def make(repeat="refuse"):
        p = Pair(tmp_path, repeat)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


def judged_again(p: Pair, repeat: str) -> None:
    """Past the limit's window, inside the repeat window: nothing runs unasked."""
    p.survivor.clock.skew += LIMIT_PER + 5
    r = p.call()
    h = p.survivor
    if repeat == "refuse":
        assert h.prefix(r) == "DUPLICATE" and "paid 8.00 to rob" in h.text(r), h.text(r)
    else:
        assert h.prefix(r) == "PENDING_APPROVAL" and "already executed" in h.text(r), h.text(r)
        assert [a.kind for a in h.pending()] == ["repeat"]
    assert h.payments() == 1


@pytest.mark.parametrize("repeat", ["refuse", "ask"])
def test_a_late_success_behind_a_refused_rerun_is_not_paid_again(pair, repeat):
    """The review's sequence: the question expires unanswered, the next identical call
    begins a re-run, the limit (the first attempt counts) refuses or questions it, and then
    the stalled proxy records the first attempt's success."""
    p = pair(repeat)
    p.pay_inside_the_server()
    h = p.survivor
    assert h.prefix(p.call()) == "INTERRUPTED"
    h.clock.skew += 61                                   # the question expires unanswered
    r = p.call()
    assert h.prefix(r) in ("DENIED", "INTERRUPTED", "UNKNOWN_OUTCOME"), h.text(r)
    p.wake()
    judged_again(p, repeat)


@pytest.mark.parametrize("repeat", ["refuse", "ask"])
def test_a_late_success_recorded_before_the_rules_judge(pair, repeat):
    p = pair(repeat)
    p.pay_inside_the_server()
    assert p.survivor.prefix(p.call()) == "INTERRUPTED"
    p.wake()                                             # settles the question it answers
    assert p.survivor.pending() == []
    judged_again(p, repeat)


@pytest.mark.parametrize("repeat", ["refuse", "ask"])
def test_a_late_success_after_an_expired_question(pair, repeat):
    p = pair(repeat)
    p.pay_inside_the_server()
    h = p.survivor
    assert h.prefix(p.call()) == "INTERRUPTED"
    h.clock.skew += 61
    for r in h.runs():                                   # the expiry recorded, nothing re-run
        h.proxy._attach_and_close(r.id)
    p.wake()
    judged_again(p, repeat)


@pytest.mark.parametrize("repeat", ["refuse", "ask"])
def test_a_late_success_after_a_rejected_question(pair, repeat):
    p = pair(repeat)
    p.pay_inside_the_server()
    h = p.survivor
    assert h.prefix(p.call()) == "INTERRUPTED"
    h.decide(h.pending()[0], approve=False, note="not sure")
    p.wake()
    judged_again(p, repeat)


@pytest.mark.parametrize("repeat", ["refuse", "ask"])
def test_a_late_success_after_a_rerun_denied_at_collection(pair, repeat):
    """The operator approves the re-run; at collection the limit (the first attempt counts)
    denies it: nothing runs. Then the first attempt's success is recorded."""
    p = pair(repeat)
    p.pay_inside_the_server()
    h = p.survivor
    assert h.prefix(p.call()) == "INTERRUPTED"
    h.decide(h.pending()[0], approve=True)
    r = p.call()
    assert h.prefix(r) == "DENIED" and h.payments() == 1, h.text(r)
    p.wake()
    judged_again(p, repeat)


def test_the_window_runs_from_the_recording_of_a_late_outcome(pair):
    """A late outcome recorded long after its run ended: the window runs from the record."""
    p = pair("refuse")
    p.pay_inside_the_server()
    h = p.survivor
    assert h.prefix(p.call()) == "INTERRUPTED"
    h.decide(h.pending()[0], approve=False, note="wait")
    p.stalled.clock.skew += WINDOW - 60                  # recorded 9 minutes after the end
    p.wake()
    h.clock.skew += WINDOW + 30                          # past the end's window, not the record's
    r = p.call()
    assert h.prefix(r) == "DUPLICATE" and h.payments() == 1, h.text(r)
