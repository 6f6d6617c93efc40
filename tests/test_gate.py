"""The gate's state machine: every transition a run, a step and an approval can make.

Time is driven through the injected clock; leases through an injected wall clock. Tools are
in-process coroutines that count their calls, so every test can assert how many times a
side effect ran.
"""

import asyncio
import itertools
import os
import sqlite3
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agentrt_proxy as ap  # noqa: E402

T0 = 1_800_000_000.0
PAY_SCHEMA = (b'{"type":"object","properties":{"amount":{"type":"number"},'
              b'"to":{"type":"string"}},"required":["amount","to"],"additionalProperties":false}')
READ_SCHEMA = b'{"type":"object","properties":{"account":{"type":"string"}}}'
LIMITS = ap.Limits(3, 3, 3, 3600.0, 3600.0)


class Crash(BaseException):
    """Stands for the process dying inside a tool: nothing after it runs or is recorded."""


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


class Harness:
    """A store, counted tools and gates over them. ``gate()`` makes another executor."""

    def __init__(self, tmp_path, policy=None, lease_ttl=30.0):
        self.path = str(tmp_path / "runs.db")
        self.store = ap.Store.open(self.path)
        self.clock = Clock()
        self.policy = policy or ap.SideEffectPolicy()
        self.calls = {"pay": [], "read": [], "wipe": []}
        self.behaviour = {}          # tool name -> coroutine function replacing the default
        self.lease_ttl = lease_ttl
        self.gates = []
        self.ids = (f"{i:032x}" for i in itertools.count(1))

    def tools(self):
        def make(name, content):
            async def call(args, value=None):
                self.calls[name].append(args)
                special = self.behaviour.get(name)
                if special:
                    return await special(args)
                return ap.ToolResult(content, f"{name} done")
            return call
        return [
            ap.Tool(ap.ToolSpec("pay", "pays someone", PAY_SCHEMA, "remote_mutation", 5.0, True),
                    make("pay", b'{"paid":true}')),
            ap.Tool(ap.ToolSpec("read", "reads a balance", READ_SCHEMA, "read_only", 5.0, True),
                    make("read", b'{"balance":"120.00"}')),
            ap.Tool(ap.ToolSpec("wipe", "wipes", b'{"type":"object"}', "destructive", 5.0, True),
                    make("wipe", b'{}')),
        ]

    def gate(self, wall=None, **kw):
        g = ap.Gate(self.store, self.tools(), kw.pop("policy", self.policy), now=self.clock,
                    wall=wall or (lambda: self.clock.t), new_id=lambda: next(self.ids),
                    lease_ttl=self.lease_ttl, **kw)
        self.gates.append(g)
        return g

    def events(self, run_id):
        return [e[4] for e in self.store.list_events(run_id)]

    def close(self):
        for g in self.gates:
            g.close()
        self.store.close()


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def propose(session, tool, args, origin="model"):
    assert session.step() is not None
    return session.propose(ap.Decision("tool_call", tool, args, origin=origin))


def pending_pay(h, gate, run_id="run-1", args=b'{"amount": 25.00, "to": "bob"}'):
    s = gate.begin(run_id, "call pay", LIMITS)
    v = propose(s, "pay", args)
    assert v.kind == "pending"
    return v.approval


def approve(h, approval, note="ok"):
    return ap.decide_approval(h.store, approval.run_id, approval.id, True, "operator", note,
                              approval.hash, h.clock.t, view="")


# ---- allowed, denied, invalid -------------------------------------------------------------

def test_allowed_read_executes_once_and_completes(h):
    g = h.gate()
    s = g.begin("run-1", "call read", LIMITS)
    v = propose(s, "read", b'{"account": "A-1"}')
    assert v.kind == "allowed"
    obs = asyncio.run(s.execute())
    assert obs["kind"] == "tool_result" and obs["content"] == {"balance": "120.00"}
    assert h.calls["read"] == [b'{"account": "A-1"}']
    run = h.store.get_run("run-1")
    assert (run.status, run.reason, run.reason_detail) == ("COMPLETED", "goal_completed",
                                                           "terminal tool read")
    assert run.result_json == '{"balance":"120.00"}'
    assert run.lease_owner == "" and run.lease_expires_at == ""
    assert h.events("run-1") == ["run.created", "run.started", "step.started", "step.decided",
                                 "step.policy", "step.tool_started", "step.tool_finished",
                                 "run.finished"]


def test_denied_call_runs_nothing_and_the_run_fails(h):
    g = h.gate()
    s = g.begin("run-1", "call wipe", LIMITS)
    v = propose(s, "wipe", b"{}")
    assert v.kind == "denied"
    assert v.observation["content"]["reason"] == "side effect destructive is deny by policy"
    assert s.fail("the request was denied").status == "FAILED"
    assert h.calls["wipe"] == []
    assert h.events("run-1") == ["run.created", "run.started", "step.started", "step.decided",
                                 "step.policy", "step.failed", "step.started", "step.decided",
                                 "run.finished"]
    steps = h.store.list_steps("run-1")
    assert [s.decision["origin"] for s in steps] == ["model", "operator"]


def test_invalid_arguments_are_recorded_and_run_nothing(h):
    g = h.gate()
    s = g.begin("run-1", "call pay", LIMITS)
    v = propose(s, "pay", b'{"amount": "lots", "to": "bob"}')
    assert v.kind == "denied" and v.observation["kind"] == "invalid_decision"
    assert "arguments do not match schema: at '/amount'" in v.observation["content"]["error"]
    s.fail("the request was invalid")
    assert h.calls["pay"] == []
    assert "step.policy" not in h.events("run-1")


@pytest.mark.parametrize("raw", [b'{"amount":1,"amount":2,"to":"x"}', b'{"amount":1e99999}',
                                 b'{"to":"\\ud800","amount":1}', b"{\"to\":\"\xff\"}", b"[1,]"])
def test_arguments_that_are_not_usable_json_are_kept_verbatim(h, raw):
    g = h.gate()
    s = g.begin("run-1", "call pay", LIMITS)
    v = propose(s, "pay", raw)
    assert v.kind == "denied"
    assert v.observation["content"]["error"].startswith("arguments are not usable JSON: ")
    decision = h.store.list_steps("run-1")[0].decision
    assert "args" not in decision
    kept = decision["invalid_args"]
    if decision.get("invalid_base64"):
        import base64
        kept = base64.b64decode(kept)
    else:
        kept = kept.encode()
    assert kept == raw


def test_unknown_tool_and_bad_decisions_are_invalid(h):
    g = h.gate()
    s = g.begin("run-1", "x", ap.Limits(10, 10, 10))
    s.step()
    assert s.propose(ap.Decision("tool_call", "nope", b"{}")).observation["content"]["error"] \
        == 'unknown tool "nope"'
    s.step()
    assert s.propose(ap.Decision("")).observation["content"]["error"] == "decision has no kind"
    s.step()
    assert "unknown decision origin" in \
        s.propose(ap.Decision("fail", message="x", origin="martian")).observation["content"]["error"]


def test_complete_decision_keeps_the_result_bytes(h):
    g = h.gate()
    s = g.begin("run-1", "x", LIMITS)
    s.step()
    v = s.propose(ap.Decision("complete", result=b' {"b": 1.50, "a": 1} '))
    assert v.kind == "ended" and v.run.status == "COMPLETED"
    assert v.run.result_json == '{"b": 1.50, "a": 1}'


# ---- the approval round trip ----------------------------------------------------------------

def test_pending_approval_then_collected_executes_the_recorded_request_once(h):
    g = h.gate()
    args = b'{ "to" : "bob", "amount" : 25.00 }'
    approval = pending_pay(h, g, args=args)
    assert h.store.get_run("run-1").status == "WAITING_FOR_APPROVAL"
    assert h.calls["pay"] == []
    approve(h, approval)
    assert h.store.get_run("run-1").status == "WAITING_FOR_APPROVAL"   # approving is not running
    s, v = g.attach("run-1")
    assert v.kind == "allowed"
    obs = asyncio.run(s.execute())
    assert obs["kind"] == "tool_result"
    assert h.calls["pay"] == [args]        # the recorded bytes, exactly
    assert h.store.get_run("run-1").status == "COMPLETED"
    assert h.events("run-1") == [
        "run.created", "run.started", "step.started", "step.decided", "step.policy",
        "approval.requested", "approval.decided", "run.resumed", "step.policy",
        "step.tool_started", "step.tool_finished", "run.finished"]
    with pytest.raises(ap.RunStateError):
        g.attach("run-1")
    assert len(h.calls["pay"]) == 1


def test_attach_before_a_decision_executes_nothing(h):
    g = h.gate()
    pending_pay(h, g)
    with pytest.raises(ap.RunStateError, match="pending, not approved"):
        g.attach("run-1")
    assert h.calls["pay"] == []


def test_an_approval_collected_after_the_policy_changed_to_deny_executes_nothing(h):
    g = h.gate()
    approval = pending_pay(h, g)
    approve(h, approval)
    deny = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="deny"))
    s, v = h.gate(policy=deny).attach("run-1")
    assert v.kind == "denied"
    assert v.observation["summary"] == \
        "denied on resume: side effect remote_mutation is deny by policy"
    assert h.calls["pay"] == []
    assert s.fail("the request was denied").status == "FAILED"


class FixedPolicy:
    """Like the proxy's policy: the operator's fixed values are part of the capability."""

    def __init__(self, fixed):
        self.fixed = fixed

    def evaluate(self, request, view):
        cap = b'{"args":' + request.args + b',"fixed":' + self.fixed + b',"tool":"pay"}'
        return ap.PolicyDecision("require_approval", "asks", request.spec.side_effect, cap, cap)


def test_a_changed_fixed_value_asks_for_a_new_approval(h):
    g = h.gate(policy=FixedPolicy(b'{"currency":"EUR"}'))
    first = pending_pay(h, g)
    approve(h, first)
    s, v = h.gate(policy=FixedPolicy(b'{"currency":"USD"}')).attach("run-1")
    assert v.kind == "pending"
    assert v.approval.id != first.id and v.approval.hash != first.hash
    assert h.store.get_run("run-1").status == "WAITING_FOR_APPROVAL"
    assert h.calls["pay"] == []
    # The unchanged value would have executed: the hash binds exactly the capability.
    approve(h, v.approval)
    s, v = h.gate(policy=FixedPolicy(b'{"currency":"USD"}')).attach("run-1")
    assert v.kind == "allowed"


def test_an_expired_approval_executes_nothing(h):
    g = h.gate()
    approval = pending_pay(h, g)
    h.clock.t += 2 * 3600
    s, v = g.attach("run-1")
    assert s is None and v.kind == "ended"
    run = h.store.get_run("run-1")
    assert (run.status, run.reason) == ("CANCELLED", "approval_expired")
    assert h.store.get_approval(approval.id).status == "expired"
    with pytest.raises(ap.RunStateError):
        approve(h, approval)
    assert h.calls["pay"] == []


def test_deciding_an_expired_approval_expires_it(h):
    g = h.gate()
    approval = pending_pay(h, g)
    with pytest.raises(ap.ApprovalExpired):
        ap.decide_approval(h.store, "run-1", approval.id, True, "op", "", approval.hash,
                           T0 + 2 * 3600, view="")
    assert h.store.get_run("run-1").reason == "approval_expired"


def test_a_stale_grant_executes_nothing(h):
    g = h.gate()
    approval = pending_pay(h, g)
    approve(h, approval)
    h.clock.t += 2 * 3600
    s, v = g.attach("run-1")
    assert v.kind == "ended" and v.run.reason == "approval_expired"
    assert h.store.get_approval(approval.id).status == "expired"
    assert h.calls["pay"] == []


def test_a_grant_that_goes_stale_between_attach_and_execute_executes_nothing(h):
    g = h.gate()
    approval = pending_pay(h, g)
    approve(h, approval)
    s, v = g.attach("run-1")
    assert v.kind == "allowed"
    h.clock.t += 2 * 3600
    with pytest.raises(ap.ApprovalExpired):
        asyncio.run(s.execute())
    assert h.calls["pay"] == []
    assert h.store.get_run("run-1").reason == "approval_expired"


def test_a_decision_on_an_approval_that_changed_after_it_was_shown_is_refused(h):
    g = h.gate()
    approval = pending_pay(h, g)
    with pytest.raises(ap.ApprovalChanged):
        ap.decide_approval(h.store, "run-1", approval.id, True, "op", "", "0" * 64, T0, view="")
    with pytest.raises(ap.ApprovalChanged):
        ap.decide_approval(h.store, "run-1", approval.id, True, "op", "", "", T0, view="")
    # Someone rewrites the request under the same hash: the hash no longer verifies.
    raw = sqlite3.connect(h.path)
    raw.execute("UPDATE approvals SET request_json=replace(request_json, 'bob', 'eve')")
    raw.commit()
    raw.close()
    with pytest.raises(ap.ApprovalHashMismatch):
        ap.decide_approval(h.store, "run-1", approval.id, True, "op", "", approval.hash, T0,
                           view="")
    assert h.store.get_approval(approval.id).status == "pending"


def test_a_tampered_grant_is_not_executed(h):
    g = h.gate()
    approval = pending_pay(h, g)
    approve(h, approval)
    raw = sqlite3.connect(h.path)
    raw.execute("UPDATE approvals SET request_json=replace(request_json, '25.00', '2500')")
    raw.commit()
    raw.close()
    with pytest.raises(ap.ApprovalHashMismatch):
        g.attach("run-1")
    assert h.calls["pay"] == []


def test_reject_cancels_the_run_and_nothing_runs(h):
    g = h.gate()
    approval = pending_pay(h, g)
    decided, run = ap.decide_approval(h.store, "run-1", approval.id, False, "op", "not to bob",
                                      approval.hash, T0, view="")
    assert decided.status == "rejected" and decided.note == "not to bob"
    assert (run.status, run.reason, run.reason_detail) == ("CANCELLED", "approval_rejected",
                                                           "not to bob")
    step = h.store.list_steps("run-1")[0]
    assert step.status == "failed" and step.obs_kind == "policy_denied"
    with pytest.raises(ap.RunStateError):
        g.attach("run-1")
    with pytest.raises(ap.RunStateError):
        approve(h, approval)
    assert h.calls["pay"] == []


def test_a_decided_approval_cannot_be_decided_again(h):
    g = h.gate()
    approval = pending_pay(h, g)
    approve(h, approval)
    with pytest.raises(ap.NotPending):
        approve(h, approval)


def test_cancel_ends_a_waiting_run_and_a_running_one(h):
    g = h.gate()
    pending_pay(h, g)
    run = ap.cancel_run(h.store, "run-1", "op", "changed my mind", T0)
    assert (run.status, run.reason) == ("CANCELLED", "operator_cancelled")
    assert h.store.list_steps("run-1")[0].status == "failed"
    s = g.begin("run-2", "x", LIMITS)
    ap.cancel_run(h.store, "run-2", "op", "", T0)
    assert s.step() is None and s.final.status == "CANCELLED"
    with pytest.raises(ap.RunStateError):
        ap.cancel_run(h.store, "run-2", "op", "", T0)


def test_a_cancel_while_the_tool_runs_keeps_the_late_outcome(h):
    g = h.gate()

    async def slow(args):
        ap.cancel_run(h.store, "run-1", "op", "stop", T0)
        return ap.ToolResult(b'{"read":1}', "late")
    h.behaviour["read"] = slow
    s = g.begin("run-1", "call read", LIMITS)
    propose(s, "read", b"{}")
    obs = asyncio.run(s.execute())
    assert obs["kind"] == "tool_result"
    run = h.store.get_run("run-1")
    assert run.status == "CANCELLED"
    last = h.store.list_events("run-1")[-1]
    assert last[4] == "step.tool_finished" and '"late":true' in last[5]


def test_several_approvals_wait_at_once_in_separate_runs(h):
    g = h.gate()
    a1 = pending_pay(h, g, "run-1", b'{"amount":1,"to":"a"}')
    a2 = pending_pay(h, g, "run-2", b'{"amount":2,"to":"b"}')
    approve(h, a2)
    s, v = g.attach("run-2")
    asyncio.run(s.execute())
    assert h.calls["pay"] == [b'{"amount":2,"to":"b"}']
    assert h.store.get_approval(a1.id).status == "pending"


# ---- leases, crashes, take-over -------------------------------------------------------------

def crash_while_executing(h, tool, args, run_id="run-1"):
    """A first executor starts the tool and dies inside it, its lease left behind."""
    allow_pay = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="allow"))
    crashed = h.gate(wall=lambda: T0, policy=allow_pay)

    async def die(_args):
        raise Crash()
    h.behaviour[tool] = die
    s = crashed.begin(run_id, f"call {tool}", LIMITS)
    assert propose(s, tool, args).kind == "allowed"
    with pytest.raises(Crash):
        asyncio.run(s.execute())
    crashed.close()                    # the heartbeat dies with the process
    del h.behaviour[tool]
    run = h.store.get_run(run_id)
    assert run.status == "RUNNING" and run.lease_owner == crashed.owner
    return crashed


def test_a_live_lease_refuses_take_over(h):
    crash_while_executing(h, "pay", b'{"amount":5,"to":"rob"}')
    with pytest.raises(ap.RunLeased):
        h.gate(wall=lambda: T0 + 10).attach("run-1")
    assert len(h.calls["pay"]) == 1


def test_a_mutating_step_cut_off_while_executing_waits_for_an_operator(h):
    crash_while_executing(h, "pay", b'{"amount":5,"to":"rob"}')
    allow_pay = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="allow"))
    g = h.gate(wall=lambda: T0 + 31, policy=allow_pay)
    s, v = g.attach("run-1")
    assert v.kind == "pending"
    assert v.approval.kind == ap.INTERRUPTED_KIND
    assert h.store.get_run("run-1").status == "WAITING_FOR_APPROVAL"
    assert len(h.calls["pay"]) == 1
    # Approved, the same step runs once more, with the recorded bytes.
    approve(h, v.approval)
    s, v = g.attach("run-1")
    assert v.kind == "allowed"
    asyncio.run(s.execute())
    assert h.calls["pay"] == [b'{"amount":5,"to":"rob"}'] * 2
    assert h.store.get_run("run-1").status == "COMPLETED"
    assert h.events("run-1") == [
        "run.created", "run.started", "step.started", "step.decided", "step.policy",
        "step.tool_started", "lease.taken_over", "step.interrupted", "step.policy",
        "approval.requested", "approval.decided", "run.resumed", "step.policy",
        "step.tool_started", "step.tool_finished", "run.finished"]
    assert len(h.store.list_steps("run-1")) == 1


def test_an_approved_interruption_meets_the_policy_again(h):
    crash_while_executing(h, "pay", b'{"amount":5,"to":"rob"}')
    g = h.gate(wall=lambda: T0 + 31)          # remote_mutation requires its own approval
    s, v = g.attach("run-1")
    approve(h, v.approval)
    s, v = g.attach("run-1")
    assert v.kind == "pending" and v.approval.kind == "remote_mutation"
    assert len(h.calls["pay"]) == 1


def test_an_interrupted_side_effect_rejected_runs_nothing_more(h):
    crash_while_executing(h, "pay", b'{"amount":5,"to":"rob"}')
    g = h.gate(wall=lambda: T0 + 31)
    s, v = g.attach("run-1")
    ap.decide_approval(h.store, "run-1", v.approval.id, False, "op", "it went through",
                       v.approval.hash, T0, view="")
    assert h.store.get_run("run-1").reason == "approval_rejected"
    assert len(h.calls["pay"]) == 1


def test_a_read_cut_off_while_executing_simply_ends(h):
    crash_while_executing(h, "read", b'{"account":"A-1"}')
    g = h.gate(wall=lambda: T0 + 31)
    s, v = g.attach("run-1")
    assert v.kind == ""                      # nothing waits: the session is open
    assert h.store.list_steps("run-1")[0].status == "interrupted"
    run = s.fail("the run was taken over after an interruption")
    assert run.status == "FAILED"
    assert h.store.list_approvals("run-1") == []
    assert len(h.calls["read"]) == 1


def test_a_step_cut_off_before_its_tool_ran_asks_nothing(h):
    crashed = h.gate(wall=lambda: T0)
    s = crashed.begin("run-1", "call pay", LIMITS)
    s.step()                                 # the process dies while deciding
    crashed.close()
    s2, v = h.gate(wall=lambda: T0 + 31).attach("run-1")
    assert v.kind == ""
    step = h.store.list_steps("run-1")[0]
    assert step.status == "interrupted" and step.obs_content == {"previous_status": "deciding"}
    assert h.store.list_approvals("run-1") == []


def test_a_reconcile_hook_decides_what_a_takeover_does(h):
    crash_while_executing(h, "pay", b'{"amount":5,"to":"rob"}')
    seen = []

    def reconcile(view):
        seen.append([s.status for s in view.steps])
        return ap.Reconciliation("continue")
    s, v = h.gate(wall=lambda: T0 + 31, reconcile=reconcile).attach("run-1")
    assert v.kind == "" and seen == [["interrupted"]]


def test_execute_refuses_once_the_lease_has_run_out(h):
    wall = Clock(T0)
    g = h.gate(wall=wall)
    s = g.begin("run-1", "call read", LIMITS)
    assert propose(s, "read", b"{}").kind == "allowed"
    wall.t += 60                                  # no renewal happened in between
    with pytest.raises(ap.LeaseLost):
        asyncio.run(s.execute())
    assert h.calls["read"] == []


def test_an_outcome_after_a_take_over_is_recorded_as_a_late_event(h):
    g = h.gate(wall=lambda: T0)
    other = h.gate(wall=lambda: T0 + 31)
    taken = {}

    async def slow(args):
        taken["v"] = other.attach("run-1")
        return ap.ToolResult(b"{}", "done")
    h.behaviour["pay"] = slow
    g.policy = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="allow"))
    s = g.begin("run-1", "call pay", LIMITS)
    assert propose(s, "pay", b'{"amount":1,"to":"x"}').kind == "allowed"
    with pytest.raises(ap.LateOutcome) as late:
        asyncio.run(s.execute())
    assert late.value.observation["kind"] == ap.TOOL_RESULT
    assert taken["v"][1].kind == "pending"       # the new owner asked an operator
    finished = [e for e in h.store.list_events("run-1") if e[4] == "step.tool_finished"]
    assert len(finished) == 1 and '"late":true' in finished[0][5]
    asked = taken["v"][1].approval
    assert ap.late_outcome(h.store, asked).endswith("it succeeded")
    assert not g.leases.holds("run-1")
    # The known late outcome settles the attempt: the question it asked is answered.
    run = h.store.get_run("run-1")
    assert (run.status, run.reason) == ("COMPLETED", "goal_completed"), run
    assert h.store.get_approval(asked.id).status == "settled"
    with pytest.raises(ap.AttemptSettled, match="finished after it was cut off"):
        approve(h, asked)
    assert h.calls["pay"] == [b'{"amount":1,"to":"x"}']


def test_a_failed_pause_after_a_take_over_lets_go_of_the_lease(h, monkeypatch):
    crash_while_executing(h, "pay", b'{"amount":5,"to":"rob"}')
    g = h.gate(wall=lambda: T0 + 31)

    def broken(*args, **kwargs):
        raise ap.StoreError("disk I/O error")
    monkeypatch.setattr(ap._Decider, "_pause", broken)
    with pytest.raises(ap.StoreError):
        g.attach("run-1")
    monkeypatch.undo()
    assert not g.leases.holds("run-1")
    run = h.store.get_run("run-1")
    assert run.lease_owner == "" and run.status == "RUNNING"
    # Nothing hides the run: the next executor takes it over and asks an operator.
    s, v = h.gate(wall=lambda: T0 + 31).attach("run-1")
    assert v.kind == "pending" and v.approval.kind == ap.INTERRUPTED_KIND
    assert len(h.calls["pay"]) == 1


def test_a_second_executor_cannot_begin_an_existing_run(h):
    g = h.gate()
    g.begin("run-1", "x", LIMITS)
    with pytest.raises((ap.RunStateError, ap.RunLeased)):
        h.gate().begin("run-1", "x", LIMITS)


def test_the_heartbeat_renews_the_lease(tmp_path):
    h = Harness(tmp_path, lease_ttl=0.3)
    try:
        g = h.gate(wall=__import__("time").time)
        g.begin("run-1", "x", LIMITS)
        first = h.store.get_run("run-1").lease_expires_at
        import time
        deadline = time.monotonic() + 5
        while h.store.get_run("run-1").lease_expires_at == first:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
        assert g.leases.ok("run-1")
    finally:
        h.close()


# ---- tool outcomes ----------------------------------------------------------------------------

def run_read(h, behaviour):
    h.behaviour["read"] = behaviour
    g = h.gate()
    s = g.begin("run-1", "call read", LIMITS)
    propose(s, "read", b"{}")
    return asyncio.run(s.execute())


def test_a_tool_error_is_recorded_as_its_failure(h):
    async def declined(args):
        raise ap.ToolFailure("card declined")
    obs = run_read(h, declined)
    assert obs["kind"] == "tool_error"
    assert obs["content"] == {"ending": "answered", "error": "card declined", "failure": "error",
                              "tool": "read"}
    assert h.store.get_run("run-1").status == "RUNNING"   # the caller decides what follows


def test_a_tool_timeout_is_recorded_as_a_timeout(h, monkeypatch):
    async def hang(args):
        await asyncio.sleep(30)
    h.tools_timeout = 0.05
    original = h.tools

    def quick():
        return [ap.Tool(dataclasses_replace(t.spec, timeout=0.05), t.call) for t in original()]
    monkeypatch.setattr(h, "tools", quick)
    obs = run_read(h, hang)
    assert obs["content"]["failure"] == "timeout"


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_content_that_is_not_json_is_recorded_as_invalid_content(h):
    async def garbage(args):
        return ap.ToolResult(b'{"a":1,"a":2}', "dup")
    obs = run_read(h, garbage)
    assert obs["content"]["failure"] == "invalid_content"
    assert obs["content"]["content"] == '{"a":1,"a":2}'


def test_a_tool_that_raises_is_recorded_not_lost(h):
    async def bug(args):
        raise RuntimeError("oops")
    obs = run_read(h, bug)
    assert obs["kind"] == "tool_error" and "oops" in obs["content"]["error"]


def test_a_caller_cancelled_during_the_tool_records_an_interruption(h):
    async def hang(args):
        await asyncio.sleep(30)
    h.behaviour["read"] = hang
    g = h.gate()
    s = g.begin("run-1", "call read", LIMITS)
    propose(s, "read", b"{}")

    async def go():
        task = asyncio.create_task(s.execute())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(go())
    step = h.store.list_steps("run-1")[0]
    assert step.obs_kind == "interrupted" and step.obs_content["failure"] == "cancelled"


# ---- run limits --------------------------------------------------------------------------------

def test_the_step_limit_ends_the_run(h):
    g = h.gate()
    s = g.begin("run-1", "x", ap.Limits(2, 10, 10))
    for _ in range(2):
        propose(s, "pay", b'{"amount":"x","to":"y"}')
    assert s.step() is None
    run = h.store.get_run("run-1")
    assert (run.status, run.reason, run.step_count) == ("FAILED", "limit_steps", 2)
    assert h.events("run-1")[-2:] == ["limit.exceeded", "run.finished"]


def test_consecutive_failures_end_the_run(h):
    g = h.gate()
    s = g.begin("run-1", "x", ap.Limits(10, 2, 10))
    propose(s, "pay", b'{"amount":"x","to":"y"}')
    propose(s, "wipe", b"{}")
    assert s.step() is None
    assert h.store.get_run("run-1").reason == "repeated_tool_failures"


def test_a_loop_of_identical_outcomes_ends_the_run(h):
    g = h.gate()
    s = g.begin("run-1", "x", ap.Limits(10, 10, 2))
    for _ in range(2):
        propose(s, "wipe", b"{}")
    assert s.step() is None
    run = h.store.get_run("run-1")
    assert run.reason == "loop_detected"
    assert h.events("run-1")[-2:] == ["loop.detected", "run.finished"]


# ---- records ---------------------------------------------------------------------------------------

def test_ids_and_times_come_from_the_injected_sources(h):
    g = h.gate()
    approval = pending_pay(h, g)
    assert approval.id == f"{3:032x}"             # gate owner, step, approval: in draw order
    assert approval.created_at == ap.fmt_time(T0)
    assert approval.expires_at == ap.fmt_time(T0 + 3600)


def test_the_approval_hash_binds_the_request_and_its_spec(h):
    g = h.gate()
    approval = pending_pay(h, g)
    request = approval.request()
    assert ap.approval_hash(approval.kind, approval.capability, approval.presentation,
                            request) == approval.hash
    for changed in (dataclasses_replace(request, args=b'{"amount":25.0,"to":"bob"}'),
                    dataclasses_replace(request, step_id="other"),
                    dataclasses_replace(request, spec=dataclasses_replace(
                        request.spec, description="pays anyone"))):
        assert ap.approval_hash(approval.kind, approval.capability, approval.presentation,
                                changed) != approval.hash
    # Spelling does not matter, values do.
    respelled = dataclasses_replace(request, args=b'{"to":"b\\u006fb","amount":25.00}')
    assert ap.approval_hash(approval.kind, approval.capability, approval.presentation,
                            respelled) == approval.hash


def test_every_run_leaves_an_intact_chain(h):
    g = h.gate()
    pending_pay(h, g, "run-1")
    s = g.begin("run-2", "call read", LIMITS)
    propose(s, "read", b"{}")
    asyncio.run(s.execute())
    report = ap.verify_events(h.store)
    assert report.broken is None and report.checked == h.store.chain_head()[0] > 10


def test_approval_hash_matches_the_reference_golden_value():
    """core.md 7.2: the hash covers kind, capability, presentation and the whole request,
    over the canonical form (the spec's timeout in integer nanoseconds)."""
    spec = ap.ToolSpec("push", "push <main> & tag", b'{"type":"object"}', "remote_mutation", 30.0)
    request = ap.ToolRequest("r1", "s1", spec, b'{"n":7,"ref":"refs/heads/main"}')
    got = ap.approval_hash("remote_mutation", b'{"tool":"push","args":{"n":7}}',
                           b'{"title":"Publish <PR> & tag","lines":1.0}', request)
    assert got == "175bcfc7a7e3cdab6b98d7b50caf9f2a8e59d5208211b97de39a4b027c7fa0b2"


# ---- Faults found in review ------------------------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from conftest import BALANCE, PAY  # noqa: E402


def _recording_tools(calls: list, pay_impl=None, pay_effect="remote_mutation"):
    """pay (terminal) and balance (read_only), recording the arguments each call ran with."""
    async def pay(args: bytes, value=None):
        calls.append(("pay", args))
        if pay_impl is not None:
            return await pay_impl(args)
        return ap.ToolResult(b'{"paid":true}', "paid")

    async def balance(args: bytes, value=None):
        calls.append(("balance", args))
        return ap.ToolResult(b'{"balance":10}', "balance 10")

    spec = ap.ToolSpec(PAY.name, PAY.description, PAY.input_schema, pay_effect, PAY.timeout,
                       PAY.terminal)
    return [ap.Tool(spec, pay), ap.Tool(BALANCE, balance)]


class _Policy:
    """A policy that asks for approval with whatever capability the test sets."""
    policy_id = ""

    def __init__(self, capability: bytes = b"{}", fixed: str = ""):
        self.capability, self.fixed = capability, fixed

    def evaluate(self, request, view):
        if self.fixed:
            return ap.need_approval("remote_mutation", "ask",
                                    {"fixed": self.fixed, "args": ap.RawJSON(request.args)}, None)
        return ap.PolicyDecision("require_approval", "ask", "remote_mutation", self.capability,
                                 b"")


def _event_types(store, run_id):
    return [e[4] for e in store.list_events(run_id)]


def test_vertical_tab_around_arguments_is_invalid_not_stripped(harness):
    """Review 1, finding t1: arguments b'\\x0c{"b":1}\\x0b' were stripped with bytes.strip()
    (which takes form feed and vertical tab) and executed; JSON has only four whitespace
    bytes, so the request is INVALID and nothing runs."""
    calls: list = []
    gate = ap.Gate(harness.store, _recording_tools(calls), ap.SideEffectPolicy())
    try:
        s = gate.begin("r-ws", "read", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "balance", b'\x0c{"b":1}\x0b', origin="model"))
        assert v.kind != "allowed", "arguments wrapped in \\f and \\v were accepted"
        assert v.observation["kind"] == ap.INVALID_DECISION
        assert calls == []
        assert "step.tool_started" not in _event_types(harness.store, "r-ws")
    finally:
        gate.close()


def test_outcome_that_cannot_be_recorded_lets_go_of_the_lease(harness):
    """Review 1, findings t3/t4/t9: when the tool ran and its outcome could not be written
    (the database refused the write), the heartbeat went on renewing the run's lease for as
    long as the process lived, so the run stayed IN_PROGRESS forever. The lease must be let
    go, so that the next executor takes the run over as cut off while executing."""
    calls: list = []
    tools = _recording_tools(calls, pay_effect="local_mutation")
    gate = ap.Gate(harness.store, tools, ap.SideEffectPolicy())
    other = ap.Gate(harness.store, tools, ap.SideEffectPolicy())
    store = harness.store
    real_tx = store.tx
    try:
        s = gate.begin("r-lease", "pay", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}', origin="model"))
        assert v.kind == "allowed"
        s.start()                                   # the tool's start is committed

        failed = []

        def refusing_tx(**how):                     # the next write fails once, as a
            if not failed:                          # locked or full database does
                failed.append(1)
                raise ap.StoreError(f"{store.path}: write failed: database is locked")
            return real_tx(**how)

        store.tx = refusing_tx
        with pytest.raises(ap.ProxyError):
            asyncio.run(s.run_started())
        store.tx = real_tx
        assert failed and calls == [("pay", b'{"amount":1}')]
        assert not gate.leases.holds("r-lease"), "the heartbeat still renews the lease"
        run = store.get_run("r-lease")
        assert run.status == ap.RUNNING and run.lease_owner == "", \
            f"the run is still leased to {run.lease_owner} until {run.lease_expires_at}"
        # Another executor takes it over at once: a mutation cut off while executing waits
        # for an operator, it is not run again.
        session, verdict = other.attach("r-lease")
        assert verdict.kind == "pending"
        assert verdict.approval.kind == ap.INTERRUPTED_KIND
        assert len(calls) == 1
    finally:
        store.tx = real_tx
        gate.close()
        other.close()


def test_whitespace_capability_is_collected_after_approval(harness):
    """Review 1, finding t5: a policy that answered require_approval with a capability of
    b" " was stored as {} but, when the approval was collected, the blank capability was not
    judged as "no value", so attach raised JSONError and the approved run could never
    execute."""
    calls: list = []
    tools = _recording_tools(calls)
    gate = ap.Gate(harness.store, tools, _Policy(capability=b" "))
    collector = ap.Gate(harness.store, tools, _Policy(capability=b" "))
    try:
        s = gate.begin("r-cap", "pay", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}', origin="model"))
        assert v.kind == "pending" and v.approval.capability == b"{}"
        ap.decide_approval(harness.store, "r-cap", v.approval.id, True, "op", "",
                           v.approval.hash, time.time(), view="")
        session, verdict = collector.attach("r-cap")
        assert verdict.kind == "allowed"
        asyncio.run(session.execute())
        assert calls == [("pay", b'{"amount":1}')]
        assert harness.store.get_run("r-cap").status == ap.COMPLETED
    finally:
        gate.close()
        collector.close()


def test_grant_collected_after_another_gate_asked_again_does_not_execute(harness):
    """Review 1, finding t6: gate A collected an approved grant; gate B (its configuration
    changed, so its policy asked for a new approval on the same step) then paused the run on
    a new approval; A executed its stale grant anyway. Only the step's latest approval is a
    grant: A must not execute."""
    calls: list = []
    tools = _recording_tools(calls)
    gate_a = ap.Gate(harness.store, tools, _Policy(fixed="acct-1"))
    gate_b = ap.Gate(harness.store, tools, _Policy(fixed="acct-2"))
    try:
        s = gate_a.begin("r-grant", "pay", LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}', origin="model"))
        ap.decide_approval(harness.store, "r-grant", v.approval.id, True, "op", "",
                           v.approval.hash, time.time(), view="")
        session_a, verdict_a = gate_a.attach("r-grant")
        assert verdict_a.kind == "allowed"
        session_b, verdict_b = gate_b.attach("r-grant")
        assert verdict_b.kind == "pending" and verdict_b.approval.id != v.approval.id
        with contextlib.suppress(ap.ProxyError):
            asyncio.run(session_a.execute())
        assert calls == [], "a grant superseded by a new approval executed"
        latest = harness.store.list_approvals("r-grant")[-1]
        assert latest.id == verdict_b.approval.id and latest.status == ap.PENDING
        assert harness.store.get_run("r-grant").status == ap.WAITING
    finally:
        gate_a.close()
        gate_b.close()


SLOW_PATTERN = "a[ab]{30}c"


def test_slow_schema_pattern_does_not_hold_the_write_lock(harness, monkeypatch):
    """Review 1, finding t7: Gate.start validated the arguments (and evaluated the policy)
    inside its write transaction, so a schema pattern with catastrophic backtracking held the
    database's write lock, and every other writer (another proxy, the operator) waited for
    it. Proposals are judged first, outside the transaction: every match of the pattern is
    made while the store's connection holds no transaction, however long it takes."""
    spec = ap.ToolSpec("note", "notes", b'{"type":"object","properties":{"s":{"type":'
                       b'"string","pattern":"' + SLOW_PATTERN.encode() + b'"}}}',
                       "read_only", 5.0, True)

    async def note(args, value=None):
        return ap.ToolResult(b"{}", "ok")

    gate = ap.Gate(harness.store, [ap.Tool(spec, note)], ap.SideEffectPolicy())
    matched: list[bool] = []            # per match: whether a transaction was open
    search_costed = ap.Pattern.search_costed

    def watched(self, text, limit):
        matched.append(harness.store.conn.in_transaction)
        return search_costed(self, text, limit)
    monkeypatch.setattr(ap.Pattern, "search_costed", watched)
    try:
        args = b'{"s":"' + b"ab" * 1000 + b'"}'
        asyncio.run(gate.call("r-slow", "note", LIMITS,
                              ap.Decision("tool_call", "note", args, origin="model")))
    finally:
        gate.close()
    assert matched and not any(matched), \
        f"{sum(matched)} of {len(matched)} matches made inside the write transaction"


def test_gate_tool_schema_may_hold_a_number_past_a_float(harness):
    """6f3edf6: after 93356a0 the validator refused, as "not JSON", a tool's input schema
    holding a number beyond a 64-bit float (maximum 1e400), so a gate with such a tool could
    not be built. Float range is judged only for servers' pinned schemas and structured
    content; the validator compares numbers exactly."""
    schema = b'{"type":"object","properties":{"n":{"type":"number","maximum":1e400}}}'
    ap.compile_schema(schema).check(b'{"n":5}')
    calls: list = []

    async def look(args, value=None):
        calls.append(args)
        return ap.ToolResult(b"{}", "ok")

    gate = ap.Gate(harness.store, [ap.Tool(ap.ToolSpec("look", "reads", schema, "read_only",
                                                       5.0, True), look)],
                   ap.SideEffectPolicy())
    try:
        session, verdict, obs = asyncio.run(gate.call(
            "r-float", "look", LIMITS, ap.Decision("tool_call", "look", b'{"n":5}',
                                                   origin="model")))
        assert verdict.kind == "allowed" and calls == [b'{"n":5}']
    finally:
        gate.close()


def test_tool_that_returns_no_tool_result_is_recorded_as_its_failure(harness):
    """Review 1, t2 (d891c0c): an adapter bug, a tool returning a dict instead of a
    ToolResult, raised out of the recording with the step left executing and the lease
    renewed forever. It is recorded as the tool's failure, and the run is let go."""
    calls: list = []

    async def bad(args):
        return {"paid": True}

    gate = ap.Gate(harness.store, _recording_tools(calls, pay_impl=bad,
                                                    pay_effect="local_mutation"),
                   ap.SideEffectPolicy())
    try:
        s = gate.begin("r-bad", "pay", LIMITS)
        s.step()
        assert s.propose(ap.Decision("tool_call", "pay", b'{"amount":1}',
                                     origin="model")).kind == "allowed"
        obs = asyncio.run(s.execute())
        assert obs["kind"] == ap.TOOL_ERROR
        step = harness.store.list_steps("r-bad")[0]
        assert step.status == "failed"
        assert len(calls) == 1
    finally:
        gate.close()


def test_approval_hash_takes_the_spec_timeout_in_integer_nanoseconds():
    """96a5ce2: the approval hash encoded the tool spec's timeout as a duration string
    ("30s"), so it never matched the reference's golden value (core.md 7.2), which hashes
    the timeout in integer nanoseconds."""
    spec = ap.ToolSpec("push", "push <main> & tag", b'{"type":"object"}', "remote_mutation",
                       30.0)
    request = ap.ToolRequest("r1", "s1", spec, b'{"n":7,"ref":"refs/heads/main"}')
    got = ap.approval_hash("remote_mutation", b'{"tool":"push","args":{"n":7}}',
                           b'{"title":"Publish <PR> & tag","lines":1.0}', request)
    assert got == "175bcfc7a7e3cdab6b98d7b50caf9f2a8e59d5208211b97de39a4b027c7fa0b2"
    # A fractional timeout too: 1.5 s is 1500000000 ns in the hashed request.
    spec = ap.ToolSpec("pay", "pays", b'{"type":"object"}', "remote_mutation", 1.5)
    request = ap.ToolRequest("r2", "s2", spec, b'{"n":1}')
    doc = {"capability": {}, "kind": "remote_mutation", "presentation": {},
           "request": {"args": {"n": 1}, "run_id": "r2", "step_id": "s2",
                       "spec": {"description": "pays", "input_schema": {"type": "object"},
                                "name": "pay", "side_effect": "remote_mutation",
                                "timeout": 1500000000}}}
    want = hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert ap.approval_hash("remote_mutation", b"{}", b"{}", request) == want


HASH_PASSES = 50          # passes over the specs on each thread (about 2 s on a busy
                          # 2-core machine); the fault shows within a few
HASH_WAIT = 600.0         # for them: a guard against a hang, never reached


def test_a_spec_hash_asked_on_two_threads_never_fails():
    """The review of moving parsing and deciding onto worker threads, finding 4: ToolSpec.hash
    is not safe on two threads: the cache it fills may be emptied by another thread before it
    reads it back (KeyError).

    ToolSpec.hash fills the cache, then reads it again: another thread that empties the
    full cache in between (SPEC_CACHE_SIZE specs) makes the read a KeyError. Deciding runs on
    worker threads now, and a run's begin hashes every tool's spec."""
    specs = [ap.ToolSpec(f"t{i}", "d", b'{"type":"object"}', "read_only", 1.0)
             for i in range(3 * ap.SPEC_CACHE_SIZE)]
    failures: list[BaseException] = []

    def hash_all(offset: int) -> None:
        try:
            for _ in range(HASH_PASSES):
                if failures:
                    return
                for spec in specs[offset::2]:
                    spec.hash()
        except Exception as exc:            # the fault: a KeyError out of hash()
            failures.append(exc)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=hash_all, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HASH_WAIT)
    finally:
        sys.setswitchinterval(interval)
        ap._SPEC_FORMS.clear()
    assert not any(t.is_alive() for t in threads), f"{HASH_PASSES} passes took {HASH_WAIT} s"
    assert not failures, f"ToolSpec.hash failed: {failures[0]!r}"[:200]
