"""What an approval would spend (DESIGN.md section 9): every view of an approval, on every
channel, shows each limit of its tool as it stands when it is shown (its use, read from the
index every serving proxy keeps) and what the call adds; where a `deny` limit would refuse
the call at collection, the view says so before the operator approves, and the approve
prompt repeats it. The figures are shown, never bound: an approval decided after they moved
is decided, and the collection judges the limits again.

Payments run through the real host-facing server and the real fake payment server
(tests/proxy_harness.py); the operator's commands run in-process on the same database.
"""

import io
import itertools
import json
import os
import sys
import time

from process_helpers import eventually
from proxy_harness import ap

PAY = "bank_pay"
# Payments of at most 10 need no approval; a larger one is asked by the class.
SMALL = {"if": {"properties": {"amount": {"type": "number", "maximum": 10}},
                "required": ["amount"]}, "outcome": "allow", "why": "small payment"}
DAILY = {"sum": "/amount", "max": "50", "per": "24h", "name": "daily-spend"}
HOURLY = {"calls": 20, "per": "1h"}
RECORDER = ("import os, sys\n"
            "data = sys.stdin.buffer.read()\n"
            "with open(sys.argv[1] + '.tmp', 'wb') as f:\n"
            "    f.write(data)\n"
            "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n")
FIGURES = 'limit "daily-spend" of bank_pay: {} of 50 in the last 24h; this call adds 15'
PAYEES = itertools.count()
DENIED = ": over its max, so collecting it will be DENIED unless room frees first"


def rules(*limits):
    return {"balance": {"side_effect": "read_only", "timeout": "10s"},
            "pay": {"side_effect": "remote_mutation", "timeout": "10s", "when": [SMALL],
                    "limits": list(limits)}}


def pay(h, *amounts):
    """Payments small enough to need no approval, each to a payee of its own (an identical
    call would be a duplicate)."""
    for amount in amounts:
        r = h.call(PAY, {"to": f"p{next(PAYEES)}", "amount": amount})
        assert not h.is_error(r) and h.prefix(r) != "PENDING_APPROVAL", h.text(r)


def operator(h, *argv, stdin=""):
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, *argv], stdin=io.StringIO(stdin), stdout=out,
                   stderr=err)
    return code, out.getvalue(), err.getvalue()


def pending_json(h):
    code, out, err = operator(h, "-json", "pending")
    assert code == 0, err
    entry, = json.loads(out)["approvals"]
    return entry


def webhook_get(h, a, text=False):
    """GET the approval from the webhook, in-process, signed as a client signs it."""
    secret = b"s" * 32
    hook = ap.Webhook(h.cfg.database, secret, lambda line: None)
    target = f"/runs/{a.run_id}/approvals/{a.id}" + ("?format=text" if text else "")
    headers = {k.lower(): v for k, v in
               ap.sign_request(secret, "GET", target, b"", time.time()).items()}
    status, _, body = hook.answer(ap.HookRequest("GET", target, headers, b""))
    assert status == 200, body
    return body.decode() if text else json.loads(body)["approval"]


def webhook_approve(h, a, shown):
    secret = b"s" * 32
    hook = ap.Webhook(h.cfg.database, secret, lambda line: None)
    target = f"/runs/{a.run_id}/approvals/{a.id}/approve"
    body = json.dumps({"run_id": a.run_id, "approval_id": a.id, "hash": shown["hash"],
                       "by": "op", "note": "", "view": shown["view"]}).encode()
    headers = {k.lower(): v for k, v in
               ap.sign_request(secret, "POST", target, body, time.time()).items()}
    status, _, answer = hook.answer(ap.HookRequest("POST", target, headers, body))
    return status, json.loads(answer)


def test_every_view_shows_the_limits_now_and_what_the_call_adds(harnesses, tmp_path):
    got = str(tmp_path / "notified.json")
    recorder = tmp_path / "recorder.py"
    recorder.write_text(RECORDER)
    h = harnesses(rules=rules(dict(DAILY, over="deny"), HOURLY),
                  on_pending=[sys.executable, str(recorder), got])
    pay(h, 10, 10, 10)                                   # 30 of 50
    r = h.call(PAY, {"to": "bob", "amount": 15})         # asked by the class: 45 is under
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    [a] = h.pending()
    # The notice is built as the approval starts to wait: 30 spent then.
    doc = json.loads(eventually(lambda: read(got), 20, "the on_pending command's input"))
    assert doc["asked_by"] == [] and doc["limits"][0]["text"] == FIGURES.format(30)
    assert doc["limits"][0]["would_deny"] is False
    pay(h, 9)                                            # 39 of 50: the 15 would cross it
    now = FIGURES.format(39) + DENIED
    calls = "limits[1] of bank_pay: 4 of 20 calls in the last 1h; this call adds 1"

    code, out, err = operator(h, "pending")
    assert code == 0, err
    assert f"    {now}" in out.splitlines() and f"    {calls}" in out.splitlines(), out
    entry = pending_json(h)
    assert entry["asked_by"] == []                       # what asked stays what asked
    assert entry["limits"] == [
        {"limit": "daily-spend", "what": "sum of /amount", "used": "39", "max": "50",
         "adds": "15", "per": "24h", "over": "deny", "would_deny": True,
         "asks_again": False, "text": now},
        {"limit": "limits[1]", "what": "calls", "used": "4", "max": "20", "adds": "1",
         "per": "1h", "over": "require_approval", "would_deny": False,
         "asks_again": False, "text": calls}]
    # approve and reject print the block before anything is decided
    for verb in ("approve", "reject"):
        code, out, err = operator(h, verb, a.run_id)
        assert code == 2 and f"  {now}" in out.splitlines(), (out, err)
    code, out, err = operator(h, "show", a.run_id)
    assert code == 0 and f"  {now}" in out.splitlines(), out
    code, out, err = operator(h, "inbox", "-once", "-tty-not-required", stdin="s\n")
    assert code == 0 and f"  {now}" in out.splitlines(), out
    assert webhook_get(h, a)["limits"] == entry["limits"]
    assert f"  {now}" in webhook_get(h, a, text=True).splitlines()
    block = ap.approval_block(h.store, a, h.cfg.database)
    assert f"  {now}" in block and f"  {calls}" in block, block

    pay(h, 5)                                            # another payment: read live
    entry = pending_json(h)
    assert (entry["limits"][0]["used"], entry["limits"][1]["used"]) == ("44", "5")
    assert entry["limits"][0]["text"] == FIGURES.format(44) + DENIED
    assert h.store.get_approval(a.id).hash == a.hash     # the record did not move
    # Approved, it is denied at collection, as the view said it would be.
    code, out, err = operator(h, "approve", a.run_id, "-approval", a.id)
    assert code == 0, err
    paid = h.payments()
    r = h.call(PAY, {"to": "bob", "amount": 15})
    assert h.prefix(r) == "DENIED" and "daily-spend" in h.text(r), h.text(r)
    assert h.payments() == paid


def test_the_approve_prompt_repeats_a_denial_at_collection(harnesses, monkeypatch):
    h = harnesses(rules=rules(dict(DAILY, over="deny")))
    pay(h, 10, 10, 10)
    assert h.prefix(h.call(PAY, {"to": "bob", "amount": 15})) == "PENDING_APPROVAL"
    [a] = h.pending()
    monkeypatch.setattr(ap, "_is_terminal", lambda stream: True)
    code, out, err = operator(h, "approve", a.run_id, stdin="n\n")
    assert code == 1 and "declined" in err, err
    assert "DENIED" not in out                           # 45 of 50: nothing to warn of
    pay(h, 9)
    code, out, err = operator(h, "approve", a.run_id, stdin="n\n")
    assert code == 1 and "declined" in err, err
    before, prompt = out.rsplit("\n", 1)
    assert prompt == f"approve approval {a.id} of run {a.run_id}? [y/N] ", out
    assert before.splitlines()[-1] == f"WARNING: {FIGURES.format(39)}{DENIED}", out
    code, out, err = operator(h, "inbox", "-once", "-tty-not-required", stdin="s\n")
    before = out.split(f"approval {a.id}: a approve", 1)[0]
    assert before.splitlines()[-1] == f"WARNING: {FIGURES.format(39)}{DENIED}", out
    assert h.store.get_approval(a.id).status == ap.PENDING


def test_approving_after_the_figures_moved_still_decides_and_collects(harnesses):
    """The figures are read at each showing and bound to nothing: a decision on a view read
    before another payment is decided, the webhook's hash and view too, and the collection
    finds the approval's record as the policy builds it again."""
    h = harnesses(rules=rules(DAILY))
    pay(h, 10)
    r = h.call(PAY, {"to": "bob", "amount": 20})         # 30 of 50: asked by the class
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    r2 = h.call(PAY, {"to": "carol", "amount": 12})
    assert h.prefix(r2) == "PENDING_APPROVAL", h.text(r2)
    first, second = h.pending()
    view = ap.view_of(h.store, first)
    shown = ap.approval_block(h.store, first, h.cfg.database)
    assert '  limit "daily-spend" of bank_pay: 10 of 50 in the last 24h; this call adds 20' \
        in shown, shown
    hooked = webhook_get(h, second)
    pay(h, 5)                                            # 15 of 50 now
    assert pending_json_all(h)[0]["limits"][0]["used"] == "15"
    decided, _ = ap.decide_approval(h.store, first.run_id, first.id, True, "op", "",
                                    first.hash, time.time(), view=view)
    assert decided.status == ap.APPROVED
    status, answer = webhook_approve(h, second, hooked)
    assert status == 202, answer
    paid = h.payments()
    r = h.call(PAY, {"to": "bob", "amount": 20})
    assert h.text(r) == "paid 20.00 to bob", h.text(r)
    r2 = h.call(PAY, {"to": "carol", "amount": 12})
    assert h.text(r2) == "paid 12.00 to carol", h.text(r2)
    assert h.payments() == paid + 2


def test_a_limit_over_that_did_not_ask_says_collecting_asks_again(harnesses):
    h = harnesses(rules=rules(DAILY))
    pay(h, 10)
    assert h.prefix(h.call(PAY, {"to": "bob", "amount": 20})) == "PENDING_APPROVAL"
    pay(h, 10, 10, 10)                                   # 40 of 50: the 20 would cross it
    entry = pending_json(h)
    assert entry["asked_by"] == []
    assert entry["limits"][0]["asks_again"] is True and not entry["limits"][0]["would_deny"]
    assert entry["limits"][0]["text"].endswith(
        ": over its max, so collecting it will ask an operator again unless room frees first")
    [a] = h.pending()
    h.decide(a)
    r = h.call(PAY, {"to": "bob", "amount": 20})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)  # as the view said


def test_the_view_counts_only_the_window_ending_as_it_is_shown(harnesses):
    h = harnesses(rules=rules(DAILY))
    h.clock.skew = -25 * 3600                            # a day and an hour ago
    pay(h, 10, 10)
    h.clock.skew = 0
    pay(h, 5)
    assert h.prefix(h.call(PAY, {"to": "bob", "amount": 15})) == "PENDING_APPROVAL"
    assert pending_json(h)["limits"][0]["text"] == FIGURES.format(5)


def test_an_approval_without_the_record_shows_what_it_showed(harnesses):
    """An approval recorded before its presentation carried the limits, or of a tool
    without any, shows no limit lines and an empty list."""
    h = harnesses(rules=rules())
    assert h.prefix(h.call(PAY, {"to": "bob", "amount": 20})) == "PENDING_APPROVAL"
    [a] = h.pending()
    assert "limits" not in json.loads(a.presentation)
    entry = pending_json(h)
    assert entry["limits"] == []
    code, out, err = operator(h, "pending")
    assert code == 0 and "limits now" not in out and "limit " not in out, out


def read(path):
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def pending_json_all(h):
    code, out, err = operator(h, "-json", "pending")
    assert code == 0, err
    return json.loads(out)["approvals"]


# ---- What an approval binds, faults found in review ------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

from proxy_harness import ProxyHarness, limit_rules, paid  # noqa: E402


def test_a_limit_written_differently_since_the_approval_asks_again(harnesses, tmp_path):
    """A limit asks for a payment of 15 at 40 of 50; the presentation records the limit as
    written (max 50) and the hash binds it. The configuration is then changed to max 20 and
    the proxy restarted; every view still shows the limit of 50, and the operator approves.
    The identical call must ask again (section 20: a limit written differently since the
    approval asks again), never pay under a max of 20 that no one was shown."""
    (tmp_path / "h").mkdir()
    first = ProxyHarness(tmp_path / "h", rules=limit_rules(DAILY, timeout="10s"))
    try:
        for i in range(4):
            assert paid(first, f"p{i}", 10) == "paid"
        r = first.call(PAY, {"to": "bob", "amount": 15})
        assert first.prefix(r) == "PENDING_APPROVAL", first.text(r)
    finally:
        first.close()
    h = harnesses("h", rules=limit_rules(dict(DAILY, max="20"), timeout="10s"), pin=False)
    [a] = h.pending()
    assert json.loads(a.presentation)["limits"][0]["limit"]["max"] == "50"
    code, out, err = operator(h, "pending")
    assert code == 0 and 'limit "daily-spend" of bank_pay: 40 of 50' in out, out
    code, out, err = operator(h, "approve", "-approval", a.id)
    assert code == 0, err
    r = h.call(PAY, {"to": "bob", "amount": 15})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    assert h.payments() == 4
