"""A late outcome: a tool call cut off (its run taken over after its lease ran out) that
returns after all. What it came to is recorded, and the store then knows the attempt's
outcome: no interruption approval asks about it, none asking already can be approved by any
channel, a re-run never executes, the identical call is answered with the recorded result
within the window, and every view shows it.

The gate's tests drive two executors in one process, and write a late event as the cut-off
executor writes it where a test must place it between two steps of another executor. The
process test stops a real proxy with SIGSTOP while its payment is inside the server, the
third review's reproduction, and tries every channel an operator decides by.

A payment the operator cancels while it executes, whose tool then times out: what the
call came to is recorded as a late event (the run is the operator's, cancelled), so the run
holds no failed attempt of its own to propose again. Executor.rerun answers UNKNOWN_OUTCOME
with no approval named, and the next identical call is held for an operator.

A late outcome matches the attempt it ends one way everywhere: an operator's decision
(late_record) and the settling of the approvals asking about it (settle_attempt) agree when
the attempt's start is not text.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proxy_harness import ProxyHarness  # noqa: E402
from test_gate import LIMITS, T0, Harness, approve, crash_while_executing  # noqa: E402

import agentrt_proxy as ap  # noqa: E402

PAID = b'{"amount":5,"to":"rob"}'


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def write_late(h, run_id, step, obs_doc, known=True):
    """The late event exactly as _StepExecution._late writes it, for a step cut off while executing,
    but without what _late settles with it: as an older build, or a race a test arranges,
    would leave the store."""
    obs = ap._obs(obs_doc["kind"], obs_doc["content"], obs_doc["summary"])
    payload = {"duration_ms": 5, "known": known, "late": True,
               "observation": ap.RawJSON(obs.json_text.encode()),
               "started_at": step.started_at, "tool": "pay", "content_hash": obs.content_hash,
               "summary": obs_doc["summary"]}
    with h.store.tx() as tx:
        tx.event(run_id, step.id, ap.fmt_time(h.clock.t), "step.tool_finished", payload)


SUCCESS = {"kind": ap.TOOL_RESULT, "content": {"paid": True}, "summary": "paid 5.00 to rob"}
TIMEOUT = {"kind": ap.TOOL_ERROR, "summary": "pay timeout",
           "content": {"error": "no answer within 5s", "failure": "timeout", "tool": "pay"}}


def interrupted_step(h):
    return next(s for s in h.store.list_steps("run-1") if s.idx == 0)


# ---- the gate ------------------------------------------------------------------------------

def test_late_outcome_settles_the_interruption_it_answers(h):
    """The reproduction, in one process: the run is taken over while the payment runs, the
    new owner asks an operator, then the payment returns. The question is answered by the
    record: the approval is settled with an event naming the late result, the run completes
    with it, and no decision can be made on it afterwards."""
    g = h.gate(wall=lambda: T0)
    other = h.gate(wall=lambda: T0 + 31)
    asked = {}

    async def slow(args):
        asked["v"] = other.attach("run-1")
        return ap.ToolResult(b'{"paid":true}', "paid 5.00 to rob")
    h.behaviour["pay"] = slow
    g.policy = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="allow"))
    s = g.begin("run-1", "call pay", LIMITS)
    s.step()
    assert s.propose(ap.Decision("tool_call", "pay", PAID, origin="model")).kind == "allowed"
    with pytest.raises(ap.LateOutcome):
        asyncio.run(s.execute())
    approval = asked["v"][1].approval
    assert approval.kind == ap.INTERRUPTED_KIND
    run = h.store.get_run("run-1")
    assert (run.status, run.reason) == ("COMPLETED", "goal_completed")
    settled = h.store.get_approval(approval.id)
    assert (settled.status, settled.decided_by) == ("settled", ap.SETTLED_BY)
    assert "finished after it was cut off" in settled.note and "it succeeded" in settled.note
    decided = [json.loads(e[5]) for e in h.store.list_events("run-1")
               if e[4] == "approval.decided"]
    assert [(d["status"], d["approval_id"]) for d in decided] == [("settled", approval.id)]
    assert decided[0]["late_outcome"]["step_id"] == approval.step_id
    step = interrupted_step(h)
    assert (step.status, step.obs_kind, step.obs_content) == ("done", ap.TOOL_RESULT,
                                                              {"paid": True})
    for verb in (True, False):
        with pytest.raises(ap.AttemptSettled, match="it succeeded"):
            ap.decide_approval(h.store, "run-1", approval.id, verb, "op", "", approval.hash,
                               h.clock.t, view="")
    with pytest.raises(ap.RunStateError):
        h.gate(wall=lambda: T0 + 62).attach("run-1")
    assert h.calls["pay"] == [PAID]


def test_no_interruption_approval_is_asked_once_the_late_outcome_is_recorded(h):
    """The torture's order: the late success is recorded after the take-over marked the
    step interrupted and before it asked. The pause finds it in its own transaction and asks
    nothing: the run ends with the recorded outcome."""
    crash_while_executing(h, "pay", PAID)

    def reconcile(view):
        step = next(s for s in view.steps if s.status == "interrupted")
        write_late(h, "run-1", step, SUCCESS)          # the stalled executor wakes now
        cap = {"args": ap.RawJSON(PAID), "tool": "pay"}
        return ap.Reconciliation("waiting", ap.need_approval(
            ap.INTERRUPTED_KIND, ap.INTERRUPTED_REASON, cap, cap))
    s, v = h.gate(wall=lambda: T0 + 31, reconcile=reconcile).attach("run-1")
    assert v.kind == "settled" and v.run.status == "COMPLETED", v
    assert h.store.list_approvals("run-1") == []
    assert "approval.requested" not in h.events("run-1")
    assert len(h.calls["pay"]) == 1


def test_collection_never_reruns_an_attempt_whose_outcome_is_recorded(h):
    """The approved re-run is collected after a late outcome that settled nothing (written
    as an older build writes it): the transaction that would start it refuses, the grant is
    settled, and the tool is not called again."""
    crash_while_executing(h, "pay", PAID)
    allow = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="allow"))
    g = h.gate(wall=lambda: T0 + 31, policy=allow)
    _, v = g.attach("run-1")
    approve(h, v.approval)
    write_late(h, "run-1", interrupted_step(h), SUCCESS)
    s, v2 = g.attach("run-1")
    assert v2.kind == "allowed"                      # the policy and the grant both say yes
    with pytest.raises(ap.AttemptSettled, match="it succeeded"):
        asyncio.run(s.execute())
    assert len(h.calls["pay"]) == 1
    assert h.store.get_approval(v.approval.id).status == "settled"
    assert h.store.get_run("run-1").status == "COMPLETED"
    assert "step.tool_started" not in h.events("run-1")[7:]


def test_a_decision_on_an_approval_whose_attempt_finished_is_refused(h):
    """An approval still pending beside a known late outcome (an older build's record): the
    decision settles it instead, and says why."""
    crash_while_executing(h, "pay", PAID)
    _, v = h.gate(wall=lambda: T0 + 31).attach("run-1")
    write_late(h, "run-1", interrupted_step(h), SUCCESS)
    with pytest.raises(ap.AttemptSettled, match="finished after it was cut off.*it succeeded"):
        approve(h, v.approval)
    assert h.store.get_approval(v.approval.id).status == "settled"
    assert h.store.get_run("run-1").status == "COMPLETED"


def test_a_late_unknown_outcome_leaves_the_question_open_and_changes_the_view(h):
    """A late timeout says nothing of whether the payment took effect: the question stays
    open, every view shows the late event, and a decision on the view read before it is
    refused, naming what changed."""
    crash_while_executing(h, "pay", PAID)
    _, v = h.gate(wall=lambda: T0 + 31).attach("run-1")
    before = ap.view_of(h.store, v.approval)
    assert before.late is None
    write_late(h, "run-1", interrupted_step(h), TIMEOUT, known=False)
    after = ap.view_of(h.store, v.approval)
    assert after.late is not None and not after.late.known
    assert "no answer within 5s" in after.late_text() and after.digest != before.digest
    with pytest.raises(ap.ApprovalChanged, match="no answer within 5s"):
        ap.decide_approval(h.store, "run-1", v.approval.id, True, "op", "",
                           v.approval.hash, h.clock.t, view=before)
    assert h.store.get_approval(v.approval.id).status == "pending"
    block = "\n".join(ap.approval_block(h.store, v.approval, h.path))
    assert "LATE OUTCOME" in block and "still unknown" in block
    ap.decide_approval(h.store, "run-1", v.approval.id, True, "op", "",
                       v.approval.hash, h.clock.t, view=after)
    assert h.store.get_approval(v.approval.id).status == "approved"


def test_a_view_digest_changes_with_each_part_it_binds(h):
    approval = h.gate().begin("run-1", "call pay", LIMITS)
    approval.step()
    pending = approval.propose(ap.Decision("tool_call", "pay", PAID)).approval
    view = ap.view_of(h.store, pending)
    assert view.digest == ap.view_of(h.store, pending).digest          # stable when nothing moves
    h.store.conn.execute("UPDATE approvals SET expires_at=? WHERE id=?",
                         ("2099-01-01T00:00:00.000000Z", pending.id))
    edited = ap.view_of(h.store, h.store.get_approval(pending.id))
    assert edited.digest != view.digest
    assert any("expires_at" in c for c in view.changes(edited))


# ---- real proxies: every channel an operator decides by ---------------------------------

def payment_in_the_server(d, args):
    """Two proxies; the first's payment is inside the server (its ledger line written)."""
    from process_helpers import eventually
    stalled, survivor = d.start("stalled"), d.start("survivor")
    ident = stalled.send_call("bank_pay", args)
    eventually(lambda: d.payments() == 1, 15, "the payment to reach the server")
    return stalled, survivor, ident, d.runs()[0]["id"]


def lease_runs_out(d, run_id):
    from process_helpers import eventually
    eventually(lambda: (d.lease(run_id)[2] or time.time() + 1) < time.time(), 15,
               "the stopped proxy's lease to run out")


def test_a_late_success_is_never_paid_again_by_any_channel(tmp_path, procs):
    """The third review's reproduction. Two proxies share a database; the first stops
    (SIGSTOP) with a payment inside the server, past its lease; the second's identical call
    takes the run over and asks an operator. The operator reads the approval in the inbox,
    the webhook and `pending`. Then the first proxy wakes and records the payment's success.
    Approving afterwards, by the inbox, by the webhook with the hash it showed, or by the
    command `pending` printed, decides nothing; the identical call is a DUPLICATE with the
    recorded result; every view shows the late outcome; the server is paid once. Past the
    window the identical call is a new request under the policy (which allows it here)."""
    from process_helpers import PROXY, PYTHON, eventually, parse_time, prefix, text
    from test_webhook import Hook, write_secret, approve_path

    d = procs(tmp_path, allow_pay=True, lease_ttl="3s", repeat_window="8s")
    args = {"to": "rob", "amount": 25, "mode": "block"}
    stalled, survivor, ident, run_id = payment_in_the_server(d, args)
    hook = inbox = None
    try:
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            lease_runs_out(d, run_id)
            r = survivor.call("bank_pay", args)
            assert prefix(r) == "INTERRUPTED", text(r)
            asked = d.pending()[0]
            # Shown on every channel while it waits.
            inbox = subprocess.Popen([PYTHON, PROXY, "-db", d.db, "inbox", "-tty-not-required",
                                      "-by", "inboxer"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            shown = b""
            while b"a approve, r reject" not in shown:
                chunk = inbox.stdout.read1(65536)
                assert chunk, shown
                shown += chunk
            hook = Hook(d.db, write_secret(tmp_path))
            status, got = hook.call("GET", f"/runs/{run_id}/approvals/{asked['id']}")
            assert status == 200 and got["approval"].get("late_outcome", "") == "", got
            code, listed, err = d.operator("pending")
            decide_line = next(line for line in listed.splitlines() if "decide with:" in line)
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        d.release()
        assert text(stalled.result(ident)) == "paid 25.00 to rob"
        eventually(lambda: d.approvals()[0]["status"] != "pending" or
                   "finished after it was cut off" in d.operator("pending")[1], 15,
                   "the late outcome to be recorded and shown")
        for p_ in (survivor, stalled):         # within the window: the recorded result
            r = p_.call("bank_pay", args)
            assert prefix(r) == "DUPLICATE" and "paid 25.00 to rob" in text(r), text(r)

        # The inbox's answer, typed after the late outcome: nothing decided, the outcome named.
        out, _ = inbox.communicate(b"a\n", timeout=30)
        assert b"finished after it was cut off" in out and b"it succeeded" in out, out
        assert b"approved by inboxer" not in out, out
        # The webhook, with the hash it showed: 409 late_outcome.
        body = {"run_id": run_id, "approval_id": asked["id"], "hash": got["approval"]["hash"],
                "by": "pat", "note": ""}
        status, answer = hook.call("POST", approve_path(run_id, asked["id"]), body)
        assert (status, answer["code"]) == (409, "late_outcome"), answer
        assert "it succeeded" in answer["error"], answer
        status, got = hook.call("GET", f"/runs/{run_id}/approvals/{asked['id']}")
        assert got["approval"]["status"] == "settled" and "it succeeded" in \
            got["approval"]["late_outcome"], got
        hook.stop()
        # The command pending printed, pasted: refused, naming the late result.
        command = decide_line.split("decide with: ", 1)[1].split("   (or reject)")[0]
        p = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and "it succeeded" in p.stderr, p.stdout + p.stderr

        # Every view: nothing waits; show, the status tool and the identical call say what
        # came of it.
        code, listed, _ = d.operator("pending")
        assert "no approval waits" in listed, listed
        code, shown_run, _ = d.operator("show", run_id)
        assert "APPROVAL SETTLED" in shown_run and "LATE OUTCOME" in shown_run, shown_run
        status_text = text(survivor.call("gate_status", {"approval_id": asked["id"]}))
        assert "SETTLED" in status_text and "it succeeded" in status_text, status_text
        assert d.payments() == 1
        assert d.query("SELECT outcome FROM proxy_calls WHERE run_id=?", (run_id,)) == [(2,)]
        ended = d.show(run_id)["run"]["finished_at"]
        time.sleep(max(0.0, parse_time(ended) + 8.5 - time.time()))
        r = survivor.call("bank_pay", args)                        # past the window: a new one
        assert text(r) == "paid 25.00 to rob", text(r)
        assert d.payments() == 2
        stalled.stop()
        survivor.stop()
    finally:                      # what the test started, ended by its pid
        if hook is not None:
            hook.stop()
        if inbox is not None and inbox.poll() is None:
            os.kill(inbox.pid, signal.SIGKILL)
            inbox.wait(10)


# ---- the adversarial review of the change --------------------------------------------------

def test_a_late_outcome_is_kept_when_its_step_has_moved_on(h):
    """The attempt's step was re-run after an approval and failed, and the run asks again in
    a new step; then the first attempt returns. Its late event is recorded (settling nothing
    whose step no longer waits), and its caller is given the result, not UNAVAILABLE."""
    allow = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="allow"))
    a = h.gate(wall=lambda: T0, policy=allow)
    b = h.gate(wall=lambda: T0 + 31, policy=allow)
    asked = {}

    async def pay(args):
        if len(h.calls["pay"]) > 1:
            raise ap.ToolFailure("pay: 50 bytes, error: declined")
        sb, v = b.attach("run-1")                    # B takes over and asks
        asked["first"] = v.approval
        approve(h, v.approval)
        sb, v = b.attach("run-1")
        assert v.kind == "allowed"
        assert (await sb.execute())["kind"] == ap.TOOL_ERROR     # the re-run fails
        b.policy = ap.SideEffectPolicy()
        sb.step()
        v = sb.propose(ap.Decision("tool_call", "pay", PAID, origin="operator"))
        assert v.kind == "pending"
        return ap.ToolResult(b'{"paid":true}', "paid 5.00 to rob")   # the first, late
    h.behaviour["pay"] = pay
    s = a.begin("run-1", "call pay", LIMITS)
    s.step()
    assert s.propose(ap.Decision("tool_call", "pay", PAID)).kind == "allowed"
    with pytest.raises(ap.LateOutcome) as late:
        asyncio.run(s.execute())
    assert late.value.observation["kind"] == ap.TOOL_RESULT
    events = [json.loads(e[5]) for e in h.store.list_events("run-1")
              if e[4] == "step.tool_finished"]
    assert [e.get("late", False) for e in events] == [False, True], events
    assert h.store.get_approval(asked["first"].id).status == "approved"


def test_a_gates_own_question_is_settled_only_by_the_attempt_it_asks_about(h):
    """A gate without a reconcile hook names no attempt in its interruption approval: the
    attempt is the step's latest. A late outcome of an earlier attempt of the same step does
    not answer the question about a later one."""
    allow = ap.SideEffectPolicy(dict(ap.DEFAULT_POLICY, remote_mutation="allow"))
    a = h.gate(wall=lambda: T0, policy=allow)
    b = h.gate(wall=lambda: T0 + 31, policy=allow)

    async def pay(args):
        sb, v = b.attach("run-1")                  # B takes over, asks about the first
        approve(h, v.approval)
        sb, v = b.attach("run-1")
        h.clock.t += 1                             # the re-run starts a second later
        sb.start()                                 # B's re-run leaves, and B dies
        b.close()
        return ap.ToolResult(b'{"paid":true}', "paid 5.00 to rob")   # the first, late
    h.behaviour["pay"] = pay
    s = a.begin("run-1", "call pay", LIMITS)
    s.step()
    assert s.propose(ap.Decision("tool_call", "pay", PAID)).kind == "allowed"
    with pytest.raises(ap.LateOutcome):
        asyncio.run(s.execute())
    _, v = h.gate(wall=lambda: T0 + 62).attach("run-1")
    assert v.kind == "pending" and v.approval.kind == ap.INTERRUPTED_KIND, v
    assert ap.view_of(h.store, v.approval).late is None


def test_a_refused_question_whose_attempt_finished_is_never_told_not_executed(tmp_path, procs):
    """The operator rejected the re-run before the late success arrived: the identical call
    is answered with the recorded payment (a DUPLICATE), and the status tool says it took
    effect, never "it was not executed"."""
    from process_helpers import prefix, text

    d = procs(tmp_path, allow_pay=True, lease_ttl="3s", repeat_window="10m")
    args = {"to": "rob", "amount": 25, "mode": "block"}
    stalled, survivor, ident, run_id = payment_in_the_server(d, args)
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        lease_runs_out(d, run_id)
        assert prefix(survivor.call("bank_pay", args)) == "INTERRUPTED"
        asked = d.pending()[0]
        d.reject(run_id, asked["id"], "not sure")
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    d.release()
    assert text(stalled.result(ident)) == "paid 25.00 to rob"
    r = survivor.call("bank_pay", args)
    assert prefix(r) == "DUPLICATE" and "paid 25.00 to rob" in text(r), text(r)
    status = text(survivor.call("gate_status", {"approval_id": asked["id"]}))
    assert "REJECTED" in status and "did take effect" in status, status
    assert "not executed" not in status, status
    assert d.payments() == 1
    stalled.stop()
    survivor.stop()


CANCELLED_PAY = "bank_pay"
SLOW_TIMEOUT_PAY = {"pay": {"side_effect": "remote_mutation", "timeout": "2s", "outcome": "allow"}}


def test_a_cancel_while_executing_then_a_timeout_asks_no_rerun_in_the_cancelled_run(tmp_path):
    h = ProxyHarness(tmp_path, rules=SLOW_TIMEOUT_PAY)
    try:
        args = {"to": "bob", "amount": 5, "mode": "block"}
        ident = h.request("tools/call", {"name": CANCELLED_PAY, "arguments": args}, wait=False)

        async def until_paid():
            while h.payments() < 1:
                await asyncio.sleep(0.02)
        h.run(until_paid(), 20)
        (run,) = h.runs()
        ap.cancel_run(h.store, run.id, "operator", "stop", time.time())
        answer = h.answer(ident, 30)["result"]  # the tool times out after the cancel
        text = h.text(answer)
        assert h.prefix(answer) == "UNKNOWN_OUTCOME", text
        assert "An identical call will wait for an operator" in text
        assert h.pending() == []                # the cancelled run asks nothing
        h.release()
        assert h.payments() == 1
    finally:
        h.close()


LATE_START = "2026-01-01T00:00:00.000000Z"


def late_query(started_at):
    payload = json.dumps({"late": True, "known": True, "started_at": started_at,
                          "observation": {"kind": ap.TOOL_RESULT, "content": {}}})
    return lambda sql, params: [(7, "2026-01-01T00:00:05.000000Z", payload)]


def test_attempt_whose_start_is_not_text_is_not_the_attempt_an_event_names():
    for odd in (None, 5, {"at": LATE_START}):
        attempt = {"run_id": "r1", "step_id": "s1", "started_at": odd}
        assert ap.late_record(late_query(LATE_START), attempt, known=True) is None
        named = dict(attempt, started_at=LATE_START)
        late = ap.late_record(late_query(LATE_START), named, known=True)
        assert late is not None and late.answers(named)
        assert not late.answers(attempt)


def test_event_naming_no_start_answers_every_attempt_of_its_step():
    attempt = {"run_id": "r1", "step_id": "s1", "started_at": None}
    late = ap.late_record(late_query(""), attempt, known=True)
    assert late is not None and late.seq == 7
