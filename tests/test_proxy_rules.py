"""The proxy's rules across calls, through the real host-facing server, the real store and the
real fake payment server (tests/proxy_harness.py): one test per row 1 to 35 and row 44 of the
table in reference/proxy.md section 17.2, named after it.

Every test that pays counts the ledger (one line per payment that reached the server). The
proxy's clock is moved with ``h.clock.skew``; leases and operator decisions keep the wall clock.
"""

import asyncio
import dataclasses
import json
import os
import re
import time

import pytest

from proxy_harness import ProxyHarness, ap

PAY, BALANCE, REFUND, STATUS = "bank_pay", "bank_balance", "bank_refund", "gate_status"
INTERRUPTED_KIND = "interrupted_side_effect"
ELEVEN_MINUTES = 11 * 60

DEFAULT_RULES = {
    "balance": {"side_effect": "read_only", "timeout": "10s"},
    "pay": {"side_effect": "remote_mutation", "timeout": "10s"},
    "refund": {"side_effect": "destructive", "timeout": "10s"},
}


def rules(**pay):
    """The default rules with pay's rule extended."""
    out = json.loads(json.dumps(DEFAULT_RULES))
    out["pay"].update(pay)
    return out


PAY_ALLOW = rules(outcome="allow")
# "timeoutPay": pay allowed outright, with a 300 ms timeout (unknown-outcome tests).
TIMEOUT_PAY = rules(timeout="300ms", outcome="allow")

SEQ_ALLOWED = ["run.created", "run.started", "step.started", "step.decided", "step.policy",
               "step.tool_started", "step.tool_finished", "run.finished"]
SEQ_DENIED = ["run.created", "run.started", "step.started", "step.decided", "step.policy",
              "step.failed", "step.started", "step.decided", "run.finished"]
SEQ_INVALID = [e for e in SEQ_DENIED if e != "step.policy"]
SEQ_COLLECTED = ["run.created", "run.started", "step.started", "step.decided", "step.policy",
                 "approval.requested", "approval.decided", "run.resumed", "step.policy",
                 "step.tool_started", "step.tool_finished", "run.finished"]
SEQ_TIMED_OUT_THEN_WAITS = ["run.created", "run.started", "step.started", "step.decided",
                            "step.policy", "step.tool_started", "step.tool_finished",
                            "step.failed", "step.started", "step.decided", "step.policy",
                            "approval.requested"]


@pytest.fixture
def make(tmp_path):
    """make(name="h", **harness_kwargs) -> a ProxyHarness in a directory of its own; every
    harness made is closed when the test ends."""
    made = []

    def factory(name="h", **kw):
        d = tmp_path / name
        d.mkdir()
        h = ProxyHarness(d, **kw)
        made.append(h)
        return h
    yield factory
    for h in reversed(made):
        h.close()


def want(h, r, prefix, is_error):
    """The answer starts with ``PREFIX:`` and carries the isError flag the prefix has."""
    text = h.text(r)
    assert text.startswith(prefix + ":"), f"want {prefix}, got: {text}"
    assert h.is_error(r) is is_error, f"isError of {prefix}: {r}"
    return text


def pending_id(h, r):
    """The approval id a PENDING_APPROVAL answer names, checked against the seed's wording."""
    text = want(h, r, "PENDING_APPROVAL", False)
    m = re.search(r"\(approval ([0-9a-f]+)\)", text)
    assert m, text
    assert text == ap.PENDING_TEXT.format(id=m.group(1))
    return m.group(1)


def only_pending(h):
    p = h.pending()
    assert len(p) == 1, [(a.id, a.kind, a.request().args) for a in p]
    return p[0]


def capability(a):
    return json.loads(a.capability)


def unknown_approval(h, ended="timed_out"):
    """The only pending approval is an interruption naming an attempt that ended so."""
    a = only_pending(h)
    assert a.kind == INTERRUPTED_KIND
    assert capability(a)["interrupted"]["ended"] == ended
    return a


def all_ended(h):
    return all(r.status in ap.TERMINAL for r in h.runs())


def status(h, approval_id=None):
    r = h.call(STATUS, {} if approval_id is None else {"approval_id": approval_id})
    return want(h, r, "GATE_STATUS", False)


def eventually(h, predicate, timeout=10.0):
    """Run the harness loop until ``predicate()`` holds (deadline ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        h.run(asyncio.sleep(0.02))


def manual_begin(h, tool, args, run_id=None, gate=None):
    """What a call does up to its proposal, by hand: claim a row, begin the run, open a step
    and propose the call. Returns (session, verdict, run id)."""
    gate = gate or h.proxy.gate
    run_id = run_id or h.proxy.new_run_id()
    t = h.proxy.tools[tool]
    h.proxy.index.claim(ap.request_key(tool, args), tool, t.spec.side_effect, run_id, None,
                        h.clock())
    session = gate.begin(run_id, f"call {tool}", h.proxy.limits)
    assert session.step() is not None
    verdict = session.propose(ap.Decision("tool_call", tool, args, origin="model"))
    return session, verdict, run_id


def rows_of(h, run_id):
    row = h.proxy.index.by_run(run_id)
    assert row is not None
    return row


# -- rows 1 to 20: the proxy -------------------------------------------------------------------

def test_lists_only_classified_tools_and_the_status_tool(make):
    described = "The operator's own words for the balance."
    h = make(rules={
        "balance": {"side_effect": "read_only", "timeout": "10s", "description": described},
        "pay": {"side_effect": "remote_mutation", "timeout": "10s",
                "fixed": {"currency": "EUR"}},
    })
    tools = h.request("tools/list")["result"]["tools"]
    assert [t["name"] for t in tools] == [BALANCE, PAY, STATUS]
    assert all("outputSchema" not in t for t in tools)
    by_name = {t["name"]: t for t in tools}
    assert by_name[BALANCE]["description"] == described
    schema = by_name[PAY]["inputSchema"]
    assert "amount" in schema["properties"]
    assert "currency" not in schema["properties"]
    assert "currency" not in schema.get("required", [])
    report = h.reports[0]
    assert report.unclassified == ["refund"]
    assert "bank: unclassified refund: no rule" in str(report)
    assert all(t[0] != "refund" for t in report.registered)


def test_allowed_read_returns_content(make):
    h = make()
    r = h.call(BALANCE, {"account": "A-1"})
    assert not h.is_error(r)
    assert h.text(r) == "account A-1 holds 120.00 EUR"
    assert len(h.runs()) == 1
    assert [r.status for r in h.runs()] == [ap.COMPLETED]
    assert all_ended(h)


def test_denied_and_invalid_run_nothing(make):
    h = make(rules=rules(outcome="deny"))
    want(h, h.call(REFUND, {"payment": "p-1"}), "DENIED", True)
    text = want(h, h.call(PAY, {"to": "bob", "amount": 25}), "DENIED", True)
    assert "operator's rule" in text
    text = want(h, h.call(BALANCE, {"acount": "A-1"}), "INVALID", True)
    assert "account" in text
    assert h.payments() == 0
    assert len(h.runs()) == 3
    assert [r.status for r in h.runs()] == [ap.FAILED] * 3
    assert all_ended(h)


def test_approval_round_trip(make):
    h = make()
    args = {"to": "bob", "amount": 25}
    first = pending_id(h, h.call(PAY, args))
    assert h.payments() == 0
    a = only_pending(h)
    assert a.id == first
    assert any(f"approve {a.run_id} -approval {a.id}" in line for line in h.log_lines), \
        h.log_lines
    assert pending_id(h, h.call(PAY, args)) == first          # before the decision
    assert h.payments() == 0
    h.decide(a, approve=True)
    r = h.call(PAY, args)
    assert not h.is_error(r)
    assert h.text(r) == "paid 25.00 to bob"
    assert h.payments() == 1
    text = want(h, h.call(PAY, args), "DUPLICATE", True)
    assert "paid 25.00 to bob" in text
    assert h.payments() == 1
    assert len(h.runs()) == 1 and h.runs()[0].status == ap.COMPLETED


def test_repeat_window_zero_asks_again(make):
    h = make(repeat_window="0s")
    args = {"to": "bob", "amount": 25}
    first = pending_id(h, h.call(PAY, args))
    h.decide(only_pending(h), approve=True)
    r = h.call(PAY, args)
    assert not h.is_error(r) and h.text(r) == "paid 25.00 to bob"
    second = pending_id(h, h.call(PAY, args))
    assert second != first
    assert only_pending(h).id == second
    assert h.payments() == 1


def test_approved_within_the_hold_completes_in_one_call(make):
    """The hold is far longer than the answer's wait here: an answer at all is the
    approval's, never the hold's end."""
    h = make(hold="10m")
    params = (b'{"name":"bank_pay","arguments":{"to":"carol","amount":3},'
              b'"_meta":{"progressToken":"tok-1"}}')
    ident = h.request("tools/call", raw_params=params, wait=False)

    async def approve_once_held():
        while not (h.pending() and h.notifications("notifications/progress")):
            await asyncio.sleep(0.02)            # asked, and the call holds: progress sent
        h.decide(only_pending(h), approve=True)
    h.run(approve_once_held(), timeout=60)
    msg = h.answer(ident, timeout=60)
    r = msg["result"]
    assert not h.is_error(r)
    assert h.text(r) == "paid 3.00 to carol"
    assert h.payments() == 1
    progress = h.notifications("notifications/progress")
    assert len(progress) >= 1
    assert all(p["params"]["progressToken"] == "tok-1" for p in progress)
    assert len(h.runs()) == 1 and h.runs()[0].status == ap.COMPLETED


def test_canonical_matching(make):
    h = make()
    first = pending_id(h, h.call(PAY, raw_args=b'{"to":"dan","amount":10}'))
    for spelling in (b'{ "amount" : 10 ,\n  "to" : "dan" }', b'{"to":"\\u0064an","amount":10}'):
        assert pending_id(h, h.call(PAY, raw_args=spelling)) == first
    assert len(h.pending()) == 1
    ids = {first}
    for other in (b'{"to":"Dan","amount":10}', b'{"to":"dan","amount":10.5}',
                  b'{"to":"dan","amount":10.0}', b'{"to":"dan","amount":1e1}'):
        ids.add(pending_id(h, h.call(PAY, raw_args=other)))
    assert len(ids) == 5
    assert len(h.pending()) == 5
    assert {a.id for a in h.pending()} == ids
    assert h.payments() == 0


def test_several_approvals_at_once_and_the_cap(make):
    h = make(max_pending=2)
    a_args, b_args = {"to": "a", "amount": 1}, {"to": "b", "amount": 2}
    a_id = pending_id(h, h.call(PAY, a_args))
    b_id = pending_id(h, h.call(PAY, b_args))
    text = want(h, h.call(PAY, {"to": "c", "amount": 3}), "BLOCKED", True)
    assert "2 requests" in text
    assert len(h.approvals()) == 2
    r = h.call(BALANCE, {"account": "A-1"})
    assert not h.is_error(r) and "holds" in h.text(r)
    by_id = {a.id: a for a in h.pending()}
    h.decide(by_id[b_id], approve=True)
    r = h.call(PAY, b_args)
    assert not h.is_error(r) and h.text(r) == "paid 2.00 to b"
    assert pending_id(h, h.call(PAY, a_args)) == a_id
    h.decide(by_id[a_id], approve=True)
    r = h.call(PAY, a_args)
    assert not h.is_error(r) and h.text(r) == "paid 1.00 to a"
    assert h.payments() == 2


def test_rejected_is_not_asked_again(make):
    h = make()
    args = {"to": "eve", "amount": 5}
    first = pending_id(h, h.call(PAY, args))
    h.decide(only_pending(h), approve=False, note="not to eve")
    for _ in range(2):
        text = want(h, h.call(PAY, args), "REJECTED", True)
        assert "not to eve" in text
        assert first in text
    assert len(h.approvals()) == 1
    assert h.payments() == 0
    h.clock.skew += ELEVEN_MINUTES
    again = pending_id(h, h.call(PAY, args))
    assert again != first
    assert h.payments() == 0


def test_expired_is_not_asked_again(make):
    h = make(approval_ttl="1h")
    args = {"to": "fay", "amount": 6}
    first = pending_id(h, h.call(PAY, args))
    h.clock.skew += 2 * 3600
    for _ in range(2):
        text = want(h, h.call(PAY, args), "EXPIRED", True)
        assert first in text
    assert len(h.approvals()) == 1
    assert h.payments() == 0
    assert all_ended(h)


def test_stale_grant_executes_nothing(make):
    h = make(grant_ttl="1h")
    args = {"to": "gus", "amount": 7}
    pending_id(h, h.call(PAY, args))
    h.decide(only_pending(h), approve=True)
    h.clock.skew += 2 * 3600
    want(h, h.call(PAY, args), "EXPIRED", True)
    assert h.payments() == 0
    assert all_ended(h)


def test_policy_changed_to_deny_before_collection(make):
    h = make()
    args = {"to": "hal", "amount": 8}
    pending_id(h, h.call(PAY, args))
    h.decide(only_pending(h), approve=True)
    # The operator changes the policy (remote_mutation now denied) between the approval and
    # the collection: the decider the proxy's policy reads is swapped in place.
    h.proxy.policy.policy = {**h.proxy.policy.policy, "remote_mutation": "deny"}
    text = want(h, h.call(PAY, args), "DENIED", True)
    assert "remote_mutation" in text
    assert h.payments() == 0
    assert all_ended(h)
    assert [r.status for r in h.runs()] == [ap.FAILED]


def test_changed_fixed_value_asks_again(make):
    h = make(rules=rules(fixed={"currency": "EUR"}))
    args = {"to": "ivy", "amount": 9}
    first = pending_id(h, h.call(PAY, args))
    h.decide(only_pending(h), approve=True)
    # The operator changes the tool's fixed value to USD in the configuration between the
    # approval and the collection: the registered tool is replaced with the new rule.
    tool = h.proxy.tools[PAY]
    changed = dataclasses.replace(tool, rule=dataclasses.replace(
        tool.rule, fixed=(("currency", b'"USD"'),)))
    h.proxy.tools[PAY] = changed
    h.proxy.policy.tools[PAY] = changed
    second = pending_id(h, h.call(PAY, args))
    assert second != first
    a = only_pending(h)
    assert a.id == second
    assert capability(a)["fixed"] == {"currency": "USD"}
    assert h.payments() == 0


def test_upstream_error_and_structured_result(make):
    h = make(rules=PAY_ALLOW)
    err_args = {"to": "jo", "amount": 1, "mode": "error"}
    r = h.call(PAY, err_args)
    assert h.is_error(r)
    assert "card declined for jo" in h.text(r)
    r = h.call(PAY, {"to": "jo", "amount": 2, "mode": "structured"})
    assert not h.is_error(r)
    assert r["structuredContent"] == {"paid": 2, "to": "jo"}
    text = want(h, h.call(PAY, err_args), "DUPLICATE", True)
    assert "card declined" in text
    assert h.payments() == 2
    assert all_ended(h)


def test_host_cancel_lets_the_call_finish(make):
    h = make(rules=PAY_ALLOW)
    args = {"to": "kim", "amount": 7, "mode": "slow"}
    params = b'{"name":"bank_pay","arguments":%s}' % json.dumps(args).encode()
    ident = h.request("tools/call", raw_params=params, wait=False)
    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        h.answer(ident, timeout=0.3)                     # the host gives up after 300 ms
    h.send(b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":%d,'
           b'"reason":"timed out"}}' % ident)
    eventually(h, lambda: any(r.status == ap.COMPLETED for r in h.runs()))
    assert h.payments() == 1
    text = want(h, h.call(PAY, args), "DUPLICATE", True)
    assert "paid 7.00 to kim" in text
    assert h.payments() == 1


def test_runs_record_what_happened(make):
    h = make()
    assert not h.is_error(h.call(BALANCE, {"account": "A-1"}))
    want(h, h.call(REFUND, {"payment": "p-1"}), "DENIED", True)
    pay = {"to": "lia", "amount": 4}
    pending_id(h, h.call(PAY, pay))
    h.decide(only_pending(h), approve=True)
    assert h.text(h.call(PAY, pay)) == "paid 4.00 to lia"
    want(h, h.call(BALANCE, {}), "INVALID", True)
    runs = h.runs()
    assert len(runs) == 4
    assert all(r.id.startswith("test.") for r in runs)
    assert [r.status for r in runs] == [ap.COMPLETED, ap.FAILED, ap.COMPLETED, ap.FAILED]
    assert h.event_types(runs[0].id) == SEQ_ALLOWED
    assert h.event_types(runs[1].id) == SEQ_DENIED
    assert h.event_types(runs[2].id) == SEQ_COLLECTED
    assert h.event_types(runs[3].id) == SEQ_INVALID
    steps = h.store.list_steps(runs[1].id)
    assert len(steps) == 2
    assert steps[0].decision["kind"] == "tool_call"
    assert steps[0].decision["origin"] == "model"
    assert steps[1].decision["kind"] == "fail"
    assert steps[1].decision["origin"] == "operator"
    assert h.payments() == 1


def test_status_tool_reports_and_never_executes(make):
    h = make(approval_ttl="1h")
    assert "no request" in status(h)
    ids = [pending_id(h, h.call(PAY, {"to": f"p{i}", "amount": i + 1})) for i in range(3)]
    assert len(h.runs()) == 3
    text = status(h)
    assert "3 requests" in text
    assert ids[0] in text
    assert "PENDING" in text
    by_id = {a.id: a for a in h.pending()}
    h.decide(by_id[ids[0]], approve=True)
    h.decide(by_id[ids[1]], approve=False, note="wrong account")
    text = status(h, ids[0])
    assert "APPROVED" in text
    assert "call bank_pay again with exactly the same arguments" in text
    text = status(h, ids[1])
    assert "REJECTED" in text and "wrong account" in text
    h.clock.skew += 2 * 3600
    assert "EXPIRED" in status(h, ids[2])
    text = status(h, "no-such-approval")
    assert "no-such-approval" in text
    want(h, h.call(STATUS, {"run": "x"}), "INVALID", True)
    assert h.payments() == 0
    assert len(h.runs()) == 3


def test_status_says_whether_an_approved_request_executed(make):
    h = make()
    args = [{"to": f"q{i}", "amount": i + 1} for i in range(3)]
    ids = [pending_id(h, h.call(PAY, a)) for a in args]
    for a in h.pending():
        h.decide(a, approve=True)
    assert "APPROVED, awaiting collection" in status(h, ids[0])
    assert h.text(h.call(PAY, args[0])) == "paid 1.00 to q0"
    assert "APPROVED and executed" in status(h, ids[0])
    ap.cancel_run(h.store, h.store.get_approval(ids[1]).run_id, "operator", "changed my mind",
                  time.time())
    text = status(h, ids[1])
    assert "APPROVED but not executed" in text
    assert "an operator cancelled it" in text
    # The operator's policy now denies remote_mutation (the decider is swapped in place).
    h.proxy.policy.policy = {**h.proxy.policy.policy, "remote_mutation": "deny"}
    want(h, h.call(PAY, args[2]), "DENIED", True)
    text = status(h, ids[2])
    assert "APPROVED but not executed" in text
    assert "the policy denied it when it was collected" in text
    assert h.payments() == 1


def test_arguments_the_runtime_refuses_never_collect(make):
    h = make()
    real = b'{"to":"bob","amount":25}'
    first = pending_id(h, h.call(PAY, raw_args=real))
    r = h.call(PAY, raw_args=b'{"to":"bob","amount":0.1e-9223372036854775808}')
    want(h, r, "INVALID", True)
    assert only_pending(h).id == first
    h.decide(only_pending(h), approve=True)
    for raw in (b'{"to":"bob","amount":25,"amount":25}',
                b'{"to":"bob","amount":1e9223372036854775807}',
                b'{"to":"bob","amount":1e-10000000}',
                b'{"to":"bob\\ud800","amount":25}'):
        text = want(h, h.call(PAY, raw_args=raw), "INVALID", True)
        assert "paid" not in text
    assert h.payments() == 0
    r = h.call(PAY, raw_args=real)
    assert not h.is_error(r) and h.text(r) == "paid 25.00 to bob"
    assert h.payments() == 1
    assert all_ended(h)
    assert sum(r.status == ap.COMPLETED for r in h.runs()) == 1


def test_server_text_in_prose_is_escaped(make):
    h = make(rules=PAY_ALLOW)
    to = "x\x1b[2J\u202e"
    err_args = {"to": to, "amount": 1, "mode": "error"}
    ok_args = {"to": to, "amount": 2}
    r = h.call(PAY, err_args)
    assert h.is_error(r)
    text = h.text(r)
    assert "card declined" in text
    assert "\x1b" not in text and "\u202e" not in text
    r = h.call(PAY, ok_args)
    assert not h.is_error(r)
    assert h.text(r) == f"paid 2.00 to {to}"              # a result is data: passed through
    for args, quoted in ((err_args, "card declined"), (ok_args, "paid 2.00 to x")):
        text = want(h, h.call(PAY, args), "DUPLICATE", True)
        assert quoted in text
        assert "\x1b" not in text and "\u202e" not in text
    assert h.payments() == 2


# -- rows 21 to 30: unknown outcomes -----------------------------------------------------------

KIM_BLOCK = {"to": "kim", "amount": 7, "mode": "block"}


def test_unknown_timeout_after_the_effect_waits_for_an_operator(make):
    h = make(rules=TIMEOUT_PAY)
    text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    assert "may have" in text and "timed out" in text
    assert h.payments() == 1
    a = unknown_approval(h)
    assert a.id in text
    first_run = a.run_id
    assert len(h.runs()) == 1
    assert h.event_types(first_run) == SEQ_TIMED_OUT_THEN_WAITS
    assert any(f"approve {first_run} -approval {a.id}" in line for line in h.log_lines)
    text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    assert a.id in text
    text = want(h, h.call(PAY, {"to": "lee", "amount": 1}), "BLOCKED", True)
    assert a.id in text
    h.clock.skew += 3600
    text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    assert a.id in text
    assert h.payments() == 1
    h.release()
    h.decide(a, approve=True)
    r = h.call(PAY, KIM_BLOCK)
    assert not h.is_error(r) and h.text(r) == "paid 7.00 to kim"
    assert h.payments() == 2
    want(h, h.call(PAY, KIM_BLOCK), "DUPLICATE", True)
    assert h.payments() == 2
    r = h.call(PAY, {"to": "lee", "amount": 1})
    assert not h.is_error(r) and h.text(r) == "paid 1.00 to lee"
    assert h.payments() == 3
    assert "APPROVED and executed" in status(h, a.id)
    assert h.all_settled_or_waiting()
    assert h.store.get_run(first_run).status == ap.COMPLETED


def test_unknown_rejection_unblocks_and_an_identical_call_asks_again(make):
    h = make(rules=TIMEOUT_PAY)
    want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    a = unknown_approval(h)
    h.decide(a, approve=False, note="it went through")
    text = want(h, h.call(PAY, KIM_BLOCK), "REJECTED", True)
    assert "it went through" in text
    r = h.call(PAY, {"to": "ned", "amount": 1})
    assert not h.is_error(r) and h.text(r) == "paid 1.00 to ned"
    seen = {a.id}
    for _ in range(3):
        h.clock.skew += ELEVEN_MINUTES
        text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
        again = only_pending(h)
        assert again.kind == INTERRUPTED_KIND
        assert again.id not in seen and again.id in text
        seen.add(again.id)
        h.decide(again, approve=False, note="it went through")
    assert h.payments() == 2
    assert h.pending() == []


def test_unknown_server_error_is_a_known_failure(make):
    h = make(rules=TIMEOUT_PAY)
    args = {"to": "oli", "amount": 3, "mode": "error"}
    r = h.call(PAY, args)
    assert h.is_error(r) and "card declined for oli" in h.text(r)
    assert h.approvals() == []
    text = want(h, h.call(PAY, args), "DUPLICATE", True)
    assert "card declined" in text
    h.clock.skew += ELEVEN_MINUTES
    r = h.call(PAY, args)
    assert h.is_error(r) and "card declined for oli" in h.text(r)
    assert h.payments() == 2
    assert h.approvals() == []
    assert all_ended(h)


def test_unknown_classifies_recorded_errors(make):
    """The recorded ending decides (tests/test_outcome_classifier.py makes each one), never
    the error's text: an error recorded without one is unknown."""
    h = make()
    pay, balance = h.proxy.tools[PAY], h.proxy.tools[BALANCE]

    def err(error, ending=None, failure="error", tool=PAY):
        content = {"error": error, "failure": failure, "tool": tool}
        if ending is not None:
            content["ending"] = ending
        return {"kind": "tool_error", "content": content}
    assert ap.unknown_ending(pay, err("no answer within 10s", "timed_out", "timeout")) == \
        "timed_out"
    for error in ('mcp: server "bank": tool "pay": connection closed', "anything else",
                  "bank/payx: 1 bytes, error: x"):
        assert ap.unknown_ending(pay, err(error, "no_answer")) == "no_answer", error
    for error in ("bank/pay: 22 bytes, error: card declined for x",
                  "bank/pay: 70000 bytes, truncated, error: long"):
        assert ap.unknown_ending(pay, err(error, "answered")) is None, error
        assert ap.unknown_ending(pay, err(error)) == "no_answer", error
    for error in ('bank_pay: parameter "currency" is fixed by the operator',
                  "bank_pay: arguments are not a JSON object: x"):
        assert ap.unknown_ending(pay, err(error, "not_sent")) is None, error
    assert ap.unknown_ending(pay, err("content is not usable JSON: too deep",
                                      "invalid_content", "invalid_content")) is None
    assert ap.unknown_ending(balance, err("no answer within 10s", "timed_out", "timeout",
                                          BALANCE)) is None


def test_unknown_status_says_what_came_of_an_approved_request(make):
    h = make("approval")
    oli = {"to": "oli", "amount": 4, "mode": "error"}
    err_id = pending_id(h, h.call(PAY, oli))
    h.decide(only_pending(h), approve=True)
    r = h.call(PAY, oli)
    assert h.is_error(r) and "card declined for oli" in h.text(r)
    text = status(h, err_id)
    assert "APPROVED and executed" in text
    assert "reported a failure" in text
    assert "card declined for oli" in text
    pia = {"to": "pia", "amount": 5}
    ok_id = pending_id(h, h.call(PAY, pia))
    h.decide(only_pending(h), approve=True)
    assert h.text(h.call(PAY, pia)) == "paid 5.00 to pia"
    text = status(h, ok_id)
    assert "APPROVED and executed" in text and "succeeded" in text
    assert h.payments() == 2

    t = make("timeout", rules=TIMEOUT_PAY)
    want(t, t.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    first = unknown_approval(t)
    t.decide(first, approve=True)
    text = want(t, t.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    nxt = unknown_approval(t)
    assert nxt.id != first.id and nxt.id in text
    assert t.payments() == 2
    text = status(t, first.id)
    assert "APPROVED and executed" in text
    assert "timed out before the server answered" in text
    assert "whether it took effect is unknown" in text
    assert f"{nxt.id} now waits" in text


def test_unknown_step_limit_keeps_the_tool_blocked(make):
    h = make(rules=TIMEOUT_PAY)
    want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    a = unknown_approval(h)
    first_run = a.run_id
    for _ in range(2):
        h.decide(a, approve=True)
        text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
        nxt = unknown_approval(h)
        assert nxt.id != a.id and nxt.id in text
        a = nxt
    assert h.payments() == 3
    assert a.run_id != first_run                        # asked again in a fresh run
    assert h.store.get_run(first_run).status in ap.TERMINAL
    text = want(h, h.call(PAY, {"to": "lou", "amount": 2}), "BLOCKED", True)
    assert a.id in text
    text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    assert a.id in text
    assert h.payments() == 3
    h.decide(a, approve=False, note="no more")
    r = h.call(PAY, {"to": "lou", "amount": 2})
    assert not h.is_error(r) and h.text(r) == "paid 2.00 to lou"
    assert h.payments() == 4
    assert h.all_settled_or_waiting()


def test_unknown_crash_before_the_re_run_keeps_the_tool_blocked(make):
    h = make(rules=TIMEOUT_PAY)
    raw = json.dumps(KIM_BLOCK).encode()
    # A call that executed and timed out, whose process stopped before it asked an operator:
    # claim, begin, propose, execute (timeout), then the session is closed with no re-run.
    session, verdict, run_id = manual_begin(h, PAY, raw)
    assert verdict.kind == "allowed"
    obs = h.run(session.execute())
    assert obs["kind"] == "tool_error"
    assert obs["content"]["failure"] == "timeout"
    session.close()
    assert h.payments() == 1
    assert h.approvals() == []
    other = {"to": "lou", "amount": 2}
    text = want(h, h.call(PAY, other), "BLOCKED", True)
    a = unknown_approval(h)
    assert a.id in text
    assert a.run_id != run_id                           # a new interruption in another run
    text = want(h, h.call(PAY, raw_args=raw), "UNKNOWN_OUTCOME", False)
    assert a.id in text
    assert h.payments() == 1
    h.release()
    h.decide(a, approve=True)
    r = h.call(PAY, raw_args=raw)
    assert not h.is_error(r) and h.text(r) == "paid 7.00 to kim"
    r = h.call(PAY, other)
    assert not h.is_error(r) and h.text(r) == "paid 2.00 to lou"
    assert h.payments() == 3
    assert h.all_settled_or_waiting()


def test_unknown_expiry_asks_again_rather_than_unblocks(make):
    h = make(rules=TIMEOUT_PAY, approval_ttl="1m")
    want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    first = unknown_approval(h)
    h.clock.skew += 120
    text = want(h, h.call(PAY, {"to": "lou", "amount": 2}), "BLOCKED", True)
    second = unknown_approval(h)
    assert second.id != first.id and second.id in text
    text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    assert second.id in text
    h.clock.skew += 120
    text = want(h, h.call(PAY, KIM_BLOCK), "UNKNOWN_OUTCOME", False)
    third = unknown_approval(h)
    assert third.id not in (first.id, second.id) and third.id in text
    assert len(h.pending()) == 1
    assert h.payments() == 1


@pytest.mark.parametrize("how", ["session-closed", "another-gate"])
def test_unknown_cut_off_before_executing_is_no_attempt(make, how):
    h = make(rules=PAY_ALLOW, lease_ttl="1h")
    zed = {"to": "zed", "amount": 3}
    raw = json.dumps(zed).encode()
    other_gate = None
    if how == "session-closed":
        # A call allowed by the policy whose process stopped before executing it.
        session, verdict, old_run = manual_begin(h, PAY, raw)
        assert verdict.kind == "allowed"
        session.close()
    else:
        # Another proxy process allowed the call; its lease ran out before it executed.
        other_gate = ap.Gate(h.store, [ap.Tool(t.spec, t.call) for t in h.proxy.tools.values()],
                             h.proxy.policy, now=h.clock, lease_owner="another-proxy",
                             lease_ttl=3600, reconcile=h.proxy.reconcile)
        session, verdict, old_run = manual_begin(h, PAY, raw, gate=other_gate)
        assert verdict.kind == "allowed"
        with h.store.tx() as tx:
            tx.exec("UPDATE runs SET lease_expires_at=? WHERE id=?",
                    (ap.fmt_time(time.time() - 60), old_run))
    try:
        r = h.call(PAY, {"to": "amy", "amount": 1})
        assert not h.is_error(r) and h.text(r) == "paid 1.00 to amy"
        assert h.payments() == 1
        if other_gate is not None:
            with pytest.raises(ap.ProxyError):
                h.run(session.execute())
            assert h.payments() == 1
        r = h.call(PAY, zed)
        assert not h.is_error(r) and h.text(r) == "paid 3.00 to zed"
    finally:
        if other_gate is not None:
            session.close()
            other_gate.close()
    old = h.store.get_run(old_run)
    assert old.status == ap.FAILED
    assert "taken over after an interruption" in old.reason_detail
    assert h.approvals() == []
    assert h.payments() == 2


def test_unknown_unrecorded_result_counts_as_executed(make):
    h = make(rules=TIMEOUT_PAY)
    deep = {"to": "dee", "amount": 4, "mode": "deep"}
    text = want(h, h.call(PAY, deep), "UNRECORDED", False)
    assert "so it executed" in text and "could not be recorded" in text
    assert "failed" not in text
    assert h.payments() == 1
    text = want(h, h.call(PAY, deep), "DUPLICATE", True)
    assert "could not be recorded" in text and "it failed" not in text
    r = h.call(PAY, {"to": "eli", "amount": 5})
    assert not h.is_error(r) and h.text(r) == "paid 5.00 to eli"
    assert h.payments() == 2
    assert h.approvals() == []
    first = h.runs()[0]
    step0 = h.store.list_steps(first.id)[0]
    assert step0.obs_kind == "tool_error"
    assert step0.obs_content["failure"] == "invalid_content"


# -- rows 31 to 35: the index ------------------------------------------------------------------

BOB = b'{"to":"bob","amount":25}'


def test_index_row_without_a_run_is_begun_under_its_id(make):
    h = make()
    key = ap.request_key(PAY, BOB)
    h.proxy.index.claim(key, PAY, "remote_mutation", "test.never-begun", None, h.clock())
    pending_id(h, h.call(PAY, raw_args=BOB))
    assert [r.id for r in h.runs()] == ["test.never-begun"]
    assert only_pending(h).run_id == "test.never-begun"
    open_row, rows = h.proxy.index.for_key(key, h.clock())
    assert open_row is not None and open_row.run_id == "test.never-begun"
    assert len(rows) == 1
    assert h.payments() == 0


def test_index_one_call_begins_a_row(make):
    h = make()
    key = ap.request_key(PAY, BOB)
    h.proxy.index.claim(key, PAY, "remote_mutation", "test.first", None, h.clock())
    session = h.proxy.gate.begin("test.first", f"call {PAY}", h.proxy.limits)   # held
    try:
        with pytest.raises(ap.ProxyError):
            h.proxy.gate.begin("test.first", f"call {PAY}", h.proxy.limits)
        want(h, h.call(PAY, raw_args=BOB), "IN_PROGRESS", False)
        assert [r.id for r in h.runs()] == ["test.first"]
        with pytest.raises(ap.IndexRace):
            h.proxy.index.claim(key, PAY, "remote_mutation", "test.second", None, h.clock())
        open_row, rows = h.proxy.index.for_key(key, h.clock())
        assert open_row.run_id == "test.first" and len(rows) == 1
    finally:
        session.close()
    assert h.payments() == 0


def test_index_a_late_begin_leaves_no_run_behind(make):
    h = make()
    key = ap.request_key(PAY, BOB)
    h.proxy.index.claim(key, PAY, "remote_mutation", "test.stalled", None, h.clock())
    first = pending_id(h, h.call(PAY, raw_args=BOB))
    assert [r.id for r in h.runs()] == ["test.stalled"]
    # The process that claimed the row wakes up and begins its run, late.
    stalled = ap.Gate(h.store, [ap.Tool(t.spec, t.call) for t in h.proxy.tools.values()],
                      h.proxy.policy, now=h.clock, lease_owner="stalled-proxy")
    try:
        with pytest.raises(ap.ProxyError):
            stalled.begin("test.stalled", f"call {PAY}", h.proxy.limits)
    finally:
        stalled.close()
    assert pending_id(h, h.call(PAY, raw_args=BOB)) == first
    assert len(h.runs()) == 1
    assert h.all_settled_or_waiting()
    assert h.payments() == 0


def test_index_row_without_a_run_is_settled_when_found(make):
    h = make()
    ann = b'{"to":"ann","amount":1}'
    ann_key = ap.request_key(PAY, ann)
    h.proxy.index.claim(ann_key, PAY, "remote_mutation", "test.empty", None, h.clock())
    pending_id(h, h.call(PAY, {"to": "ben", "amount": 2}))
    row = rows_of(h, "test.empty")
    assert row.settled_at != 0
    assert row.outcome == 1                              # none: nothing started
    assert all(r.run_id != "test.empty" for r in h.proxy.index.unsettled())
    pending_id(h, h.call(PAY, raw_args=ann))
    assert h.store.find_run("test.empty") is not None
    row = rows_of(h, "test.empty")
    assert row.settled_at == 0 and row.outcome == 0
    assert any(r.run_id == "test.empty" for r in h.proxy.index.unsettled())
    assert len(h.pending()) == 2
    assert h.payments() == 0


def test_abandoned_call_is_ended_and_run_fresh(make):
    h = make()
    raw = b'{"account":"zed"}'
    session, verdict, _ = manual_begin(h, BALANCE, raw, run_id="test.abandoned")
    assert verdict.kind == "allowed"
    session.close()                                    # the call is gone, its run RUNNING
    r = h.call(BALANCE, raw_args=raw)
    assert not h.is_error(r)
    assert "zed" in h.text(r)
    old = h.store.get_run("test.abandoned")
    assert old.status == ap.FAILED
    assert "taken over after an interruption" in old.reason_detail
    assert len(h.runs()) == 2
    assert all_ended(h)


# -- row 44: nothing the model sees names the operator's side ----------------------------------

def test_model_visible_text_names_no_operator_path(make, tmp_path):
    h = make(rules=rules(timeout="300ms"), max_pending=2, approval_ttl="1h")
    texts: list[str] = []                 # from the text builders, called directly

    init = h.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "host", "version": "1"}})
    assert "agentrt" not in init["result"]["serverInfo"]["name"].lower()
    h.request("tools/list")
    h.request("ping")

    def pay(args, approve=None, note=""):
        """Ask; optionally decide as the operator and call again. Returns the last answer."""
        r = h.call(PAY, args)
        if approve is not None:
            pending_id(h, r)
            a = next(a for a in h.pending() if json.loads(a.request().args) == args)
            h.decide(a, approve=approve, note=note)
            r = h.call(PAY, args)
        return r

    assert not h.is_error(h.call(BALANCE, {"account": "A-1"}))
    want(h, h.call(REFUND, {"payment": "p-1"}), "DENIED", True)
    want(h, h.call(BALANCE, {"acount": "A-1"}), "INVALID", True)
    want(h, h.call(PAY, {"to": "x", "amount": "lots"}), "INVALID", True)
    want(h, h.call(PAY, raw_args=b'{"to":"x","amount":1,"amount":1}'), "INVALID", True)
    status(h)
    a_args, b_args = {"to": "a", "amount": 1}, {"to": "b", "amount": 2}
    a_id = pending_id(h, pay(a_args))
    pending_id(h, pay(b_args))
    want(h, pay({"to": "c", "amount": 3}), "BLOCKED", True)
    status(h)
    status(h, a_id)
    h.decide(next(a for a in h.pending() if a.id == a_id), approve=False, note="not a")
    want(h, pay(a_args), "REJECTED", True)
    status(h, a_id)
    b = next(a for a in h.pending())
    h.decide(b, approve=True)
    assert h.text(pay(b_args)) == "paid 2.00 to b"
    want(h, pay(b_args), "DUPLICATE", True)
    status(h, b.id)
    q_args = {"to": "q", "amount": 4}
    q_id = pending_id(h, pay(q_args))
    ap.cancel_run(h.store, h.store.get_approval(q_id).run_id, "operator", "cancelled", time.time())
    want(h, pay(q_args), "REJECTED", True)
    status(h, q_id)
    e_args = {"to": "e", "amount": 5}
    e_id = pending_id(h, pay(e_args))
    h.clock.skew += 2 * 3600
    want(h, pay(e_args), "EXPIRED", True)
    status(h, e_id)
    r = pay({"to": "o", "amount": 7, "mode": "error"}, approve=True)
    assert h.is_error(r) and "card declined" in h.text(r)
    want(h, pay({"to": "o", "amount": 7, "mode": "error"}), "DUPLICATE", True)
    s_args = {"to": "s", "amount": 8, "mode": "structured"}
    assert not h.is_error(pay(s_args, approve=True))
    # a read executing under a live lease elsewhere: IN_PROGRESS
    session, verdict, _ = manual_begin(h, BALANCE, b'{"account":"busy"}')
    assert verdict.kind == "allowed"
    want(h, h.call(BALANCE, {"account": "busy"}), "IN_PROGRESS", False)
    session.close()
    k_args = {"to": "k", "amount": 9, "mode": "block"}
    text = want(h, pay(k_args, approve=True), "UNKNOWN_OUTCOME", False)
    # (q's approval stays pending on its cancelled run: the core leaves it as it is)
    unknown = next(a for a in h.pending() if a.kind == INTERRUPTED_KIND)
    assert capability(unknown)["interrupted"]["ended"] == "timed_out"
    assert unknown.id in text
    want(h, pay(k_args), "UNKNOWN_OUTCOME", False)
    want(h, pay({"to": "z", "amount": 1}), "BLOCKED", True)
    status(h)
    status(h, unknown.id)
    status(h, "unknown-id")
    want(h, h.call(STATUS, {"run": "x"}), "INVALID", True)
    want(h, h.call(STATUS, raw_args=b'{"approval_id":7}'), "INVALID", True)
    h.release()
    h.decide(unknown, approve=True)
    assert not h.is_error(pay(k_args))
    status(h, unknown.id)
    # An answer nested past what the runtime records (UNRECORDED, then DUPLICATE). Its prefix
    # is test_unknown_unrecorded_result_counts_as_executed's business; here only its text
    # counts. Last to reach the server: the code under test loses the connection on it.
    deep = {"to": "d", "amount": 6, "mode": "deep"}
    pay(deep, approve=True)
    pay(deep)
    # a mutating call cut off while executing (its process gone): INTERRUPTED
    h.proxy.policy.policy = {**h.proxy.policy.policy, "remote_mutation": "allow"}
    cut = b'{"to":"cut","amount":1}'
    session, verdict, _ = manual_begin(h, PAY, cut)
    assert verdict.kind == "allowed"
    session.start()                               # committed as executing, never sent
    session.close()
    h.proxy.policy.policy = {**h.proxy.policy.policy, "remote_mutation": "require_approval"}
    want(h, h.call(PAY, raw_args=cut), "INTERRUPTED", False)
    want(h, h.call(PAY, {"to": "y", "amount": 1}), "BLOCKED", True)
    status(h)

    # every text builder, called directly
    texts += [ap.PENDING_TEXT.format(id="0" * 32)]
    for r in (ap.interrupted("a1"), ap.unknown_outcome("timed_out", "boom", "a1"),
              ap.unknown_outcome("no_answer", "", ""), ap.unknown_outcome("cut_off", "", "a1"),
              ap.unrecorded_answer("content is not usable JSON: deep", 600),
              ap.unrecorded_answer("x", 0), ap.in_progress(), ap.denied_answer("because"),
              ap.invalid_answer("arguments do not match schema: at /amount with "
                                "'agentrt://tools/bank_pay.json': want number"),
              ap.rejected("a1", "note", time.time()), ap.cancelled_answer("", time.time()),
              ap.expired("a1", time.time()), ap.duplicate(time.time(), 600, "it succeeded: x"),
              ap.blocked_interrupted(PAY, "a1"), ap.blocked_pending(2),
              ap.unavailable("read its records"), ap.unavailable("record this request"),
              ap.unavailable("read its records", ""),
              ap.result_of({"kind": "interrupted", "content": {}}),
              ap.result_of({"kind": "tool_error", "content": {"error": "e"}})):
        texts.append(json.dumps(r, ensure_ascii=False))
    texts.append(json.dumps(ap.status_tool_entry(STATUS), ensure_ascii=False))

    messages = [json.loads(line) for line in h.out]
    results = [m["result"] for m in messages if "result" in m and "content" in m["result"]]
    assert len(results) >= 15
    seen = [json.dumps(m, ensure_ascii=False) for m in messages] + texts
    run_ids = [r.id for r in h.runs()]
    assert len(run_ids) >= 10
    forbidden = [h.cfg.database, os.path.realpath(h.cfg.database), h.tmp,
                 os.path.realpath(h.tmp), str(tmp_path), h.config_path]
    forbidden += run_ids + [r.split(".", 1)[1] for r in run_ids]
    for text in seen:
        assert "agentrt" not in text.lower(), text
        for word in forbidden:
            assert word not in text, (word, text)


# ---- The rules across calls, faults found in review ------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

from scripted_server import BANK_RULES  # noqa: E402


def test_store_error_while_asking_about_an_unknown_outcome_keeps_the_tool_blocked(tmp_path):
    """Review 2, f_rerun_err.py: a payment timed out (its outcome unknown); asking an operator
    about it then hit a store error. The run was left leased to this process and the tool
    unblocked: a respelled payment executed, and the identical call answered IN_PROGRESS for
    as long as the process lived. The run must be let go of, so the tool stays BLOCKED and
    the identical call asks an operator."""
    rules = {"balance": {"side_effect": "read_only", "timeout": "5s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "1s", "outcome": "allow"},
             "refund": {"side_effect": "destructive", "timeout": "5s"}}
    h = ProxyHarness(tmp_path, rules=rules, lease_ttl="3s")
    try:
        real_rerun, real_steps = h.proxy.executor.rerun, h.store.list_steps
        armed = []

        def rerun(*a, **k):
            armed.append(1)
            return real_rerun(*a, **k)

        def list_steps(run_id):
            if armed:
                armed.clear()
                raise ap.StoreError("database is locked (simulated SQLITE_BUSY)")
            return real_steps(run_id)

        h.proxy.executor.rerun, h.store.list_steps = rerun, list_steps
        h.call("bank_pay", {"to": "bob", "amount": 1, "mode": "block"})
        h.proxy.executor.rerun, h.store.list_steps = real_rerun, real_steps
        h.release()
        run = h.runs()[-1]
        assert run.lease_owner == "", f"the run is still leased to {run.lease_owner}"
        r = h.call("bank_pay", raw_args=b'{"to":"bob","amount":1.0}')
        assert h.prefix(r) == "BLOCKED", h.text(r)
        r = h.call("bank_pay", {"to": "bob", "amount": 1, "mode": "block"})
        assert h.prefix(r) in ("UNKNOWN_OUTCOME", "INTERRUPTED"), h.text(r)
        assert h.payments() == 1
    finally:
        h.release()
        h.close()


def test_operator_cancelled_pending_request_is_not_an_attempt(tmp_path):
    """Review 2, g_cancel.py: a payment waiting for approval that an operator cancelled was
    counted as an attempt cut off with an unknown outcome, so after the repeat window the
    identical request was asked about as interrupted_side_effect. Nothing ever ran: it asks
    for an ordinary approval."""
    h = ProxyHarness(tmp_path)
    try:
        args = {"to": "bob", "amount": 5}
        assert h.prefix(h.call("bank_pay", args)) == "PENDING_APPROVAL"
        ap.cancel_run(h.store, h.runs()[-1].id, "op", "not now", time.time())
        assert h.prefix(h.call("bank_pay", args)) == "REJECTED"
        h.clock.skew += 700                          # past the 600 s repeat window
        r = h.call("bank_pay", args)
        assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
        assert h.pending()[-1].kind != ap.INTERRUPTED_KIND
        assert h.payments() == 0
    finally:
        h.close()


def test_status_counts_a_payment_cancelled_while_it_executed_as_executed(tmp_path):
    """The last review's finding, shown by its reproduction before the fix: a status answer that
    called an executed payment "not executed". The operator cancels the run of an approved
    payment while it executes; gate_status must say it was approved and executed."""
    h = ProxyHarness(tmp_path)
    try:
        args = {"to": "bob", "amount": 5, "mode": "block"}
        assert h.prefix(h.call("bank_pay", args)) == "PENDING_APPROVAL"
        approval = h.pending()[0]
        h.decide(approval, approve=True)
        ident = h.request("tools/call", {"name": "bank_pay", "arguments": args}, wait=False)

        async def until_paid():
            while h.payments() < 1:
                await asyncio.sleep(0.02)
        h.run(until_paid(), 20)
        ap.cancel_run(h.store, approval.run_id, "operator", "stop", time.time())
        h.release()
        h.answer(ident, 30)
        text = h.text(h.call("gate_status", {"approval_id": approval.id}))
        assert "APPROVED and executed" in text and "may have taken effect" in text
        assert "not executed" not in text
        assert h.payments() == 1
    finally:
        h.close()


WAIT = 10.0               # the deadline of every wait that should succeed


def _params(name: str, args: dict) -> bytes:
    return json.dumps({"name": name, "arguments": args}).encode()


def test_a_call_deciding_on_a_worker_does_not_run_past_an_unknown_outcome(tmp_path):
    """The review of moving parsing and deciding onto worker threads, finding 1: a call whose
    arguments are past OFFLOAD_BYTES decides on a worker thread under the deciding lock. Another
    call's unknown outcome (its tool timed out) is recorded on the event loop meanwhile, and its
    re-run, which asks the operator, waits for that lock. The call deciding sees the timed-out
    run as RUNNING under a live lease, nothing waiting, and runs a second mutating call to the
    tool while the first one's outcome is unknown: it should be BLOCKED.

    No call decides between an unknown outcome being recorded and the operator being
    asked about it: a mutating call deciding there would find the outcome recorded and
    nothing yet asking, and run past it. A large call decides slowly on a worker thread
    while the first call's tool times out; the first call's record must wait for it, and
    then be followed by the question with no decision in between."""
    h = ProxyHarness(tmp_path, rules=TIMEOUT_PAY)
    timeline: list[str] = []
    real_record = ap._StepExecution._record
    real_decide, real_rerun = h.proxy.rules.decide, h.proxy.executor.rerun

    def record(self, obs, began):
        timeline.append("record")
        return real_record(self, obs, began)

    def decide(tool, key, args, *rest):
        timeline.append("decide")
        if len(args) > ap.OFFLOAD_BYTES:
            time.sleep(0.8)             # a slow decision: past the first call's timeout
        try:
            return real_decide(tool, key, args, *rest)
        finally:
            timeline.append("decided")

    def rerun(*args):
        timeline.append("asked")
        return real_rerun(*args)

    ap._StepExecution._record = record
    h.proxy.rules.decide, h.proxy.executor.rerun = decide, rerun
    try:
        first = h.request("tools/call", raw_params=_params(
            PAY, {"to": "amy", "amount": 1, "mode": "slow"}), wait=False)

        async def until_paid():
            while h.payments() < 1:
                await asyncio.sleep(0.01)
        h.run(until_paid(), WAIT)                 # the first call's tool is running
        big = h.request("tools/call", raw_params=_params(
            PAY, {"to": "b" * (ap.OFFLOAD_BYTES + 1), "amount": 2}), wait=False)
        first_text = h.text(h.answer(first, WAIT)["result"])
        h.answer(big, WAIT)
        assert first_text.startswith("UNKNOWN_OUTCOME"), first_text
        at = timeline.index("record")
        assert timeline[at:at + 2] == ["record", "asked"], timeline
    finally:
        ap._StepExecution._record = real_record
        h.close()


# -- rows 1, 2 and 14 of reference/proxy.md 17.2 again, as the MCP tests wrote them ------------

def test_proxy_lists_only_classified_tools_and_the_status_tool(make):
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s",
                         "description": "The operator's own words."},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s",
                     "fixed": {"currency": "EUR"}}}
    h = make(rules=rules)
    tools = h.request("tools/list", {})["result"]["tools"]
    assert [t["name"] for t in tools] == ["bank_balance", "bank_pay", "gate_status"]
    assert all("outputSchema" not in t for t in tools)
    assert tools[0]["description"] == "The operator's own words."
    pay = tools[1]["inputSchema"]
    assert "amount" in pay["properties"] and "currency" not in pay["properties"]
    assert "currency" not in pay.get("required", [])
    assert h.reports[0].unclassified == ["refund"]


def test_proxy_allowed_read_returns_content(make):
    h = make()
    r = h.call("bank_balance", {"account": "A-1"})
    assert not h.is_error(r)
    assert h.text(r) == "account A-1 holds 120.00 EUR"
    assert h.runs() and all(run.status in ap.TERMINAL for run in h.runs())


def test_proxy_upstream_error_and_structured_result(make):
    rules = {**json.loads(json.dumps(BANK_RULES)),
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
    h = make(rules=rules)
    r = h.call("bank_pay", {"to": "jo", "amount": 1, "mode": "error"})
    assert h.is_error(r) and "card declined for jo" in h.text(r)
    r = h.call("bank_pay", {"to": "jo", "amount": 2, "mode": "structured"})
    assert not h.is_error(r)
    assert r["structuredContent"] == {"paid": 2, "to": "jo"}
    r = h.call("bank_pay", {"to": "jo", "amount": 1, "mode": "error"})
    assert h.text(r).startswith("DUPLICATE:") and "card declined" in h.text(r)
    assert h.payments() == 2
    assert all(run.status in ap.TERMINAL for run in h.runs())
