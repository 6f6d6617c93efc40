"""Whether this request executed within the repeat window, and with what outcome, late
outcomes included: one function (Rules.executed_within) answers it for the duplicate rule
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
        h.proxy.resume.attach_and_close(r.id)
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


# ---- Sequences that broke the repeat rules, found in review ----------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

class WakingPair(Pair):
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
def waking_pair(tmp_path):
    p = WakingPair(tmp_path)
    yield p
    p.close()


def test_a_late_success_behind_a_cancelled_reasked_question_is_not_paid_again(waking_pair):
    """The walk's stop (executed_within: "rows close in the order they were opened, so the
    walk stops at the first closed before the window") reached by ordinary steps: the
    question expires, the identical call asks again in a fresh run (closing the first run's
    row), the operator cancels it, and more than the repeat window later the stalled proxy
    records the first attempt's success. The cancelled run records no attempt and is passed
    over; the first run's row closed before the window, so the walk stops there, though its
    outcome was recorded just now. The identical call then runs under allow alone: the
    server is paid twice with no operator approving a second payment. By the seed's rule 5
    (and ab25f33's window, from the recording of the late outcome) it is DUPLICATE."""
    p = waking_pair
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


def test_a_late_success_of_an_attempt_an_approved_rerun_followed_is_not_paid_again(waking_pair):
    """The same run holds two attempts: the first cut off (its proxy stalled), the second an
    approved re-run that paid. More than the repeat window after the re-run, the stalled
    proxy records the first attempt's success. execution_of reads only the run's last
    attempt, so the window runs from the re-run's end, long past, and the identical call
    pays a third time with no operator. ab25f33: the window runs from the later of the
    run's end and the recording of a late outcome; the first attempt's success was recorded
    just now, so the call is DUPLICATE."""
    p = waking_pair
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


def test_a_late_success_of_an_attempt_a_newer_run_ran_again_is_not_paid_again(waking_pair):
    """As above, but the approved re-run is in a newer run: the first attempt's question
    expired, the identical call asked again in a fresh run (closing the first run's row), and
    that re-run paid. More than the window later the first attempt's success is recorded:
    the first run's row closed long before the window, so only the known rows settled
    within it (CallIndex.executions' second part) find it, and the call is DUPLICATE."""
    p = waking_pair
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
