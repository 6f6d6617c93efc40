"""What an operator is told a decision did, and what happens next, in the same words on every
channel: `approve` and `reject`, the inbox, and the webhook (its answer and its log line).
An approval leaves its run WAITING_FOR_APPROVAL until the identical call collects it; saying
that status alone reads as if nothing happened.

The proxy runs in-process (tests/proxy_harness.py) with the real fake payment server; the
channels are driven in-process too: the command and the inbox through ``main``, the webhook
through ``Webhook.answer`` on a request signed by the module's own signer.
"""

import io
import json
import secrets

import pytest

from proxy_harness import ProxyHarness, ap

PAY = "bank_pay"
TIMED_OUT = {"pay": {"side_effect": "remote_mutation", "timeout": "300ms", "outcome": "allow"}}

APPROVED = "approved; the next identical call runs it"
APPROVED_AGAIN = "approved; the next identical call runs it again"
REJECTED = "rejected; nothing runs, the model is told your note"


@pytest.fixture
def h(tmp_path):
    harness = ProxyHarness(tmp_path)
    yield harness
    harness.close()


def cli(h, *argv):
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, *argv], stdin=io.StringIO(), stdout=out,
                   stderr=err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def waiting(h, to):
    r = h.call(PAY, {"to": to, "amount": 3})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    return h.pending()[-1]                     # the newest: the pending of this call


def said_after_the_block(out: str, approval) -> list[str]:
    return out[out.index(f"end of approval {approval.id}"):].splitlines()[1:]


def by_inbox(h, answers: str) -> list[str]:
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, "inbox", "-once", "-tty-not-required", "-by", "op"],
                   stdin=io.StringIO(answers), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return out.getvalue().splitlines()


def by_webhook(h, approval, verb, note):
    secret = secrets.token_bytes(32)
    logged = []
    hook = ap.Webhook(h.cfg.database, secret, logged.append)
    target = f"/runs/{approval.run_id}/approvals/{approval.id}/{verb}"
    body = json.dumps({"run_id": approval.run_id, "approval_id": approval.id,
                       "hash": approval.hash, "by": "op", "note": note}).encode()
    headers = {k.lower(): v for k, v in
               ap.sign_request(secret, "POST", target, body, ap.time.time()).items()}
    status, _, raw = hook.answer(ap.HookRequest("POST", target, headers, body))
    assert status in (200, 202), raw
    return json.loads(raw), logged


def test_approve_says_the_next_identical_call_runs_it(h):
    a = waiting(h, "bob")
    out = cli(h, "approve", a.run_id, "-approval", a.id, "-by", "me")
    said = said_after_the_block(out, a)
    assert said[0] == f"approval {a.id}: approved by me", said
    assert said[1].startswith(f"run {a.run_id}: {APPROVED}"), said
    assert "WAITING_FOR_APPROVAL" not in "\n".join(said), said
    r = h.call(PAY, {"to": "bob", "amount": 3})
    assert not h.is_error(r) and h.payments() == 1, h.text(r)


def test_approve_json_carries_the_same_words(h):
    a = waiting(h, "bob")
    doc = json.loads(cli(h, "-json", "approve", a.run_id, "-approval", a.id))
    assert doc["next"].startswith(APPROVED), doc
    assert doc["run"]["status"] == "WAITING_FOR_APPROVAL", doc        # the status is kept


def test_approve_of_an_interruption_says_it_runs_again(tmp_path):
    h = ProxyHarness(tmp_path, rules=TIMED_OUT)
    try:
        r = h.call(PAY, {"to": "bob", "amount": 1, "mode": "slow"})
        assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
        [a] = h.pending()
        assert a.kind == ap.INTERRUPTED_KIND
        said = said_after_the_block(cli(h, "approve", "-approval", a.id, "-by", "me"), a)
        assert said[1].startswith(f"run {a.run_id}: {APPROVED_AGAIN}"), said
    finally:
        h.close()


def test_reject_says_nothing_runs_and_the_model_is_told_the_note(h):
    a = waiting(h, "bob")
    said = said_after_the_block(cli(h, "reject", "-approval", a.id, "-by", "me", "-note",
                                    "not today"), a)
    assert said == [f"approval {a.id}: rejected by me", f"run {a.run_id}: {REJECTED}"], said
    r = h.call(PAY, {"to": "bob", "amount": 3})
    assert h.prefix(r) == "REJECTED" and "not today" in h.text(r), h.text(r)


def test_every_channel_says_the_same(h):
    for verb, answers, words in (("approve", "a\n", APPROVED), ("reject", "r\nno\n", REJECTED)):
        by_cli, by_box, by_hook = (waiting(h, f"{verb}-{n}") for n in ("cli", "box", "hook"))
        out = cli(h, verb, "-approval", by_cli.id, "-by", "op", "-note", "no")
        line = said_after_the_block(out, by_cli)[1]
        assert line.startswith(f"run {by_cli.run_id}: {words}"), line
        what = line.split(": ", 1)[1]
        shown = by_inbox(h, answers + "s\n")
        assert f"run {by_box.run_id}: {what}" in shown, shown
        doc, logged = by_webhook(h, by_hook, verb, "no")
        assert doc["next"] == what, doc
        assert logged == [f"webhook: approval {by_hook.id} of run {by_hook.run_id} by op: "
                          f"{what}"], logged
