"""The operator's word on a cut-off attempt: `reject -outcome executed|not-executed|unknown`
of an interruption approval (the default: unknown). What the operator says is recorded in the
event chain and in the proxy's own table, never in the runtime's columns (the run stays
CANCELLED, approval_rejected), and `runs`, `show` and their -json carry it. A limit goes on
counting an attempt said to have executed, or whose outcome stays unknown, and stops counting
one said not to have executed: in the window it lay in, never in a later one, and not again
when a proxy starts and catches its limits up from the events.

A payment is cut off as in tests/test_policy_limits.py: a `block` payment that outlives its
300 ms timeout answers UNKNOWN_OUTCOME and waits on an interruption approval. The proxy runs
in-process (tests/proxy_harness.py) with the real fake payment server; the operator's
commands run in-process through ``main``.
"""

import io
import json
import secrets
import sqlite3

import pytest

from proxy_harness import ProxyHarness, ap

PAY = "bank_pay"
WORDS = ("executed", "not-executed", "unknown")
CALLS = {"calls": 2, "per": "1h", "over": "deny"}
# 60: the cut-off 30 and its proposed re-run fit, so the operator is asked about it.
SPEND = {"sum": "/amount", "max": 60, "per": "1h", "over": "deny"}


def rules(*limits):
    return {"balance": {"side_effect": "read_only", "timeout": "10s"},
            "pay": {"side_effect": "remote_mutation", "timeout": "300ms", "outcome": "allow",
                    "limits": list(limits)}}


def cli(h, *argv):
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, *argv], stdin=io.StringIO(), stdout=out,
                   stderr=err)
    return code, out.getvalue(), err.getvalue()


def cut_off(h, to="bob", amount=30):
    """A payment that reaches the server and is cut off: its interruption approval."""
    r = h.call(PAY, {"to": to, "amount": amount, "mode": "block"})
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    [a] = [a for a in h.pending() if a.kind == ap.INTERRUPTED_KIND]
    return a


def reject(h, approval, word, default=False):
    flags = [] if default else ["-outcome", word]
    code, out, err = cli(h, "reject", "-approval", approval.id, "-by", "pat", "-note",
                         "the bank says", *flags)
    assert code == 0, err
    return out


def paid(h, to, amount=1):
    r = h.call(PAY, {"to": to, "amount": amount})
    return "paid" if not h.is_error(r) else h.prefix(r)


def table(h):
    conn = sqlite3.connect(h.cfg.database)
    try:
        return conn.execute("SELECT approval_id, run_id, attempt_run_id, attempt_step_id, "
                            "outcome FROM proxy_operator_outcomes").fetchall()
    finally:
        conn.close()


@pytest.fixture
def make(harnesses):
    return harnesses


# -- recorded, shown, chained --

@pytest.mark.parametrize("word", WORDS)
def test_reject_outcome_is_recorded_shown_and_chained(make, word):
    h = make(rules=rules())
    assert paid(h, "carol") == "paid"                         # a run with no word
    a = cut_off(h)
    attempt = ap.asked_attempt(a, h.store._read)
    out = reject(h, a, word, default=word == "unknown")         # unknown: the default
    assert f"recorded as {word}" in out, out

    run = h.store.get_run(a.run_id)                           # the runtime's meaning is kept
    assert (run.status, run.reason) == ("CANCELLED", "approval_rejected")
    assert table(h) == [(a.id, a.run_id, attempt["run_id"], attempt["step_id"], word)]

    doc = json.loads(cli(h, "-json", "runs")[1])
    words = {r["id"]: r["operator_outcome"] for r in doc["runs"]}
    assert words[a.run_id] == word and list(words.values()).count(None) == 1, words
    shown = json.loads(cli(h, "-json", "show", a.run_id)[1])
    assert shown["run"]["operator_outcome"] == word, shown["run"]
    assert [x["operator_outcome"] for x in shown["approvals"]] == [word], shown["approvals"]
    runs_text = cli(h, "runs")[1]
    assert f"rejected by pat; attempt {word}" in runs_text, runs_text
    show_text = cli(h, "show", a.run_id)[1]
    assert f"outcome {word}: pat said" in show_text, show_text

    said = [json.loads(e[5]) for e in h.store.list_events(a.run_id)
            if e[4] == "approval.outcome"]
    assert said == [{"approval_id": a.id, "attempt": attempt_of(attempt), "by": "pat",
                     "outcome": word}], said
    code, out, _ = cli(h, "verify")
    assert code == 0 and "intact" in out, out
    # The rejection resolves the unknown outcome, whatever was said: the tool is unblocked.
    assert paid(h, "dave") == "paid"


def attempt_of(attempt):
    return {k: attempt[k] for k in ("run_id", "step_id", "started_at")}


def test_outcome_on_an_ordinary_approval_is_refused_and_decides_nothing(make):
    h = make(rules={"pay": {"side_effect": "remote_mutation", "timeout": "10s"}})
    r = h.call(PAY, {"to": "bob", "amount": 3})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    [a] = h.pending()
    events = len(h.store.list_events(a.run_id))
    code, out, err = cli(h, "reject", "-approval", a.id, "-outcome", "executed")
    assert code == 2, (out, err)
    assert "interrupted_side_effect" in err and "nothing was decided" in err, err
    assert "APPROVAL WAITING" not in out, out                 # refused before it is shown
    code, _, err = cli(h, "approve", "-approval", a.id, "-outcome", "executed")
    assert code == 2, err
    code, _, err = cli(h, "reject", "-approval", a.id, "-outcome", "maybe")
    assert code == 2, err
    assert h.store.get_approval(a.id).status == "pending"
    assert h.store.get_run(a.run_id).status == "WAITING_FOR_APPROVAL"
    assert len(h.store.list_events(a.run_id)) == events


# -- limits --

@pytest.mark.parametrize("word", WORDS)
def test_a_calls_limit_stops_counting_a_not_executed_attempt(make, word):
    h = make(rules=rules(CALLS))
    reject(h, cut_off(h), word)
    used = 0 if word == "not-executed" else 1
    assert h.proxy.budgets.lines() == [f"{PAY}: {used} of 2 (calls) in the last 1h"]
    assert paid(h, "carol") == "paid"
    want = "paid" if word == "not-executed" else "DENIED"
    assert paid(h, "dave") == want
    assert h.proxy.budgets.lines() == [f"{PAY}: 2 of 2 (calls) in the last 1h"]


@pytest.mark.parametrize("word", WORDS)
def test_a_sum_limit_stops_counting_a_not_executed_attempt(make, word):
    h = make(rules=rules(SPEND))
    reject(h, cut_off(h, amount=30), word)
    used = 0 if word == "not-executed" else 30
    assert h.proxy.budgets.lines() == [f"{PAY}: {used} of 60 (sum of /amount) in the last 1h"]
    want = "paid" if word == "not-executed" else "DENIED"
    assert paid(h, "carol", 40) == want
    used = 40 if word == "not-executed" else 30
    assert h.proxy.budgets.lines() == [f"{PAY}: {used} of 60 (sum of /amount) in the last 1h"]


@pytest.mark.parametrize("word", WORDS)
def test_a_restart_does_not_count_a_not_executed_attempt_again(tmp_path, word):
    """Counted when it started, uncounted by the word: a proxy started afterwards catches
    up from the events, and must learn of the word there too. The second rule's limit is new
    at the restart, so its count comes from the events alone."""
    d = tmp_path / "h"
    d.mkdir()
    first = ProxyHarness(d, rules=rules(SPEND))
    try:
        reject(first, cut_off(first, amount=30), word)
    finally:
        first.close()
    daily = dict(SPEND, per="24h")                 # another window: another, new counter
    again = ProxyHarness(d, rules=rules(SPEND, daily), pin=False)
    try:
        used = 0 if word == "not-executed" else 30
        assert again.proxy.budgets.lines() == [
            f"{PAY}: {used} of 60 (sum of /amount) in the last 1h",
            f"{PAY}: {used} of 60 (sum of /amount) in the last 24h"]
        want = "paid" if word == "not-executed" else "DENIED"
        assert paid(again, "carol", 40) == want
    finally:
        again.close()


@pytest.mark.parametrize("limit", [CALLS, SPEND], ids=["calls", "sum"])
def test_a_not_executed_attempt_older_than_the_window_never_undercounts(make, limit):
    """The attempt starts half an hour before the operator's word and the payments after it.
    Once the attempt has left the window and they have not, the window holds exactly those
    payments: a correction dated at the word would still be inside it, subtracting the
    attempt from payments it never was among."""
    h = make(rules=rules(limit))
    h.clock.skew = -1800                        # the attempt, half an hour ago
    a = cut_off(h, amount=30)
    h.clock.skew = 0
    reject(h, a, "not-executed")                # the word, now
    amounts = (20, 20) if "sum" in limit else (1, 1)
    assert [paid(h, to, n) for to, n in zip(("carol", "dave"), amounts)] == ["paid", "paid"]
    h.clock.skew = 1900                         # the attempt is out, the payments in
    assert paid(h, "eve", 30 if "sum" in limit else 1) == "DENIED"
    full = "40" if "sum" in limit else "2"
    assert any(f": {full} of " in line for line in h.proxy.budgets.lines()), \
        h.proxy.budgets.lines()


def test_recheck_counts_an_attempt_as_the_word_stood_at_the_decision(make):
    """recorded_use counts from the events for recheck: an attempt said not to have executed
    no longer counts for a decision made after the word, and still counts for one made
    before it, as it did then."""
    h = make(rules=rules(SPEND))
    a = cut_off(h, amount=30)
    before = max(e[0] for e in h.store.list_events(a.run_id)) + 1
    reject(h, a, "not-executed")
    after = max(e[0] for e in h.store.list_events(a.run_id)) + 1
    tools = h.proxy.budgets.tools
    tool = tools[PAY]
    limit = tool.rule.limits[0]
    key = limit.key(tool.server, tool.remote)
    now = h.clock()
    assert ap.recorded_use(h.store, tools, key, limit, before, now) == ap.to_units(ap.Num("30"))
    assert ap.recorded_use(h.store, tools, key, limit, after, now) == 0


# -- the other channels --

def test_the_inbox_asks_what_came_of_the_attempt(make):
    h = make(rules=rules(SPEND))
    cut_off(h, amount=30)
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, "inbox", "-once", "-tty-not-required", "-by", "op"],
                   stdin=io.StringIO("r\nit bounced\nn\n"), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert "recorded as not-executed" in out.getvalue(), out.getvalue()
    assert [row[-1] for row in table(h)] == ["not-executed"]
    assert paid(h, "carol", 40) == "paid"


def test_the_webhook_takes_an_outcome_for_an_interruption_only(make):
    h = make(rules=rules(SPEND))
    r = h.call(PAY, {"to": "bob", "amount": 3, "mode": "block"})
    assert h.prefix(r) == "UNKNOWN_OUTCOME"
    secret = secrets.token_bytes(32)
    hook = ap.Webhook(h.cfg.database, secret, lambda line: None)
    [a] = h.pending()

    def post(approval, outcome):
        target = f"/runs/{approval.run_id}/approvals/{approval.id}/reject"
        body = json.dumps({"run_id": approval.run_id, "approval_id": approval.id,
                           "hash": approval.hash, "by": "op", "outcome": outcome}).encode()
        headers = {k.lower(): v for k, v in
                   ap.sign_request(secret, "POST", target, body, ap.time.time()).items()}
        status, _, raw = hook.answer(ap.HookRequest("POST", target, headers, body))
        return status, json.loads(raw)

    status, doc = post(a, "executed")
    assert status == 200 and "recorded as executed" in doc["next"], doc
    assert [row[-1] for row in table(h)] == ["executed"]
    plain = make("plain", rules={"pay": {"side_effect": "remote_mutation", "timeout": "10s"}})
    assert plain.prefix(plain.call(PAY, {"to": "bob", "amount": 3})) == "PENDING_APPROVAL"
    [ordinary] = plain.pending()
    hook = ap.Webhook(plain.cfg.database, secret, lambda line: None)
    status, doc = post(ordinary, "executed")
    assert status == 400 and doc["code"] == "bad_request", doc
    assert plain.store.get_approval(ordinary.id).status == "pending"


def test_a_proxy_schema_newer_than_this_build_refuses_the_word(make):
    h = make(rules=rules())
    a = cut_off(h)
    conn = sqlite3.connect(h.cfg.database)
    try:
        conn.execute("INSERT INTO proxy_schema_migrations VALUES (99, 0)")
        conn.commit()
    finally:
        conn.close()
    code, out, err = cli(h, "reject", "-approval", a.id, "-outcome", "executed")
    assert code == 1 and "newer" in err, (out, err)
    assert h.store.get_approval(a.id).status == "pending"


def test_every_row_since_the_attempt_stops_counting_it(make):
    """A limit shared by two tools counts a payment of the other tool while the cut-off one
    blocks its own: the word takes the attempt out of every total since, not only its own
    row's, so the next payment is judged on what executed."""
    shared = dict(SPEND, name="spend")
    h = make(rules=rules(shared), names=("bank", "bank2"))
    a = cut_off(h, amount=30)
    assert h.call("bank2_pay", {"to": "carol", "amount": 20}).get("isError") is not True
    reject(h, a, "not-executed")
    assert f'{PAY}: 20 of 60 (sum of /amount, limit "spend") in the last 1h' in \
        h.proxy.budgets.lines(), h.proxy.budgets.lines()
    assert h.call("bank2_pay", {"to": "dave", "amount": 40}).get("isError") is not True
    r = h.call("bank2_pay", {"to": "eve", "amount": 1})
    assert h.prefix(r) == "DENIED", h.text(r)


# ---- The operator's word and the limits, faults found in review ------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

import asyncio  # noqa: E402
import time  # noqa: E402

from proxy_harness import limit_rules  # noqa: E402


LEASE_WAIT = 200                     # looks, 0.1 s apart, for a 3 s lease to run out


@pytest.mark.parametrize("word", ["executed", "unknown"])
def test_a_later_word_that_the_attempt_executed_counts_it_again(harnesses, word):
    """The operator first says a cut-off payment of 30 did not execute; the identical call,
    past the repeat window, asks about the same attempt again, and the operator now says it
    executed (or that it is unknown). Both words print "it still counts toward the tool's
    limits", and the attempt must count again: a payment of 40 in the same hour would make
    70 of a max of 60, which no operator approved."""
    h = harnesses(rules=limit_rules(SPEND))
    args = {"to": "bob", "amount": 30, "mode": "block"}
    assert h.prefix(h.call(PAY, args)) == "UNKNOWN_OUTCOME"
    [first] = h.pending()
    reject(h, first, "not-executed")
    h.clock.skew = 11 * 60                       # past the 10m repeat window, in the hour
    assert h.prefix(h.call(PAY, args)) == "UNKNOWN_OUTCOME"
    [again] = h.pending()
    assert ap._interrupted_attempt(again)["step_id"] == \
        ap._interrupted_attempt(first)["step_id"]              # the same attempt
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
    rl = limit_rules(SPEND, timeout="20s")
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
