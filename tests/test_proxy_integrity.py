"""What binds a call to its record, through the real host-facing server, store and fake payment
server (tests/proxy_harness.py): a request's key names its tool, and an approval executes only
while its stored hash is the hash of its stored contents and of what the operator was shown.

Specification: proxy-seed.md "Request keys" and "Approvals"; reference/proxy.md 5.1 and 17.2
rows 4, 42 and 43; reference/core.md 7.3 (deciding binds to the hash shown).
"""

import dataclasses
import io
import json
import sqlite3

import pytest

from proxy_harness import ProxyHarness, ap

ALLOW_PAY = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
             "refund": {"side_effect": "destructive", "timeout": "10s"}}
BOB = {"to": "bob", "amount": 25}
STOLEN = b'{"amount":9999,"to":"mallory"}'


@pytest.fixture
def make(tmp_path):
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


def only_pending(h):
    pending = h.pending()
    assert len(pending) == 1, [a.id for a in pending]
    return pending[0]


def update(h, statement: str, params: tuple) -> None:
    """Another writer of the database, behind the proxy's back."""
    conn = sqlite3.connect(h.cfg.database, isolation_level=None)
    try:
        conn.execute(statement, params)
    finally:
        conn.close()


# -- a request's key names its tool ------------------------------------------------------------

def test_request_key_no_collisions_across_tools(make):
    """The same arguments to two tools are two requests: the second executes, it is not a
    DUPLICATE of the first (TestRequestKey_NoCollisions, TestRequestKey_CanonicalByLiteral:
    another tool name is another key)."""
    for args in (b"{}", b'{"to":"bob","amount":25}', b"[]", b"null"):
        assert ap.request_key("bank_pay", args) != ap.request_key("bank2_pay", args)
        assert ap.request_key("a", args) != ap.request_key("b", args)

    h = make(rules=ALLOW_PAY, names=("bank", "bank2"))
    first = h.call("bank_pay", BOB)
    assert h.text(first) == "paid 25.00 to bob" and not h.is_error(first)
    second = h.call("bank2_pay", BOB)
    assert h.text(second) == "paid 25.00 to bob" and not h.is_error(second), h.text(second)
    assert h.payments() == 2
    # The key still makes one tool's repeat a duplicate: the two calls differ by tool alone.
    assert h.text(h.call("bank_pay", BOB)).startswith("DUPLICATE:")
    assert h.payments() == 2
    assert len(h.runs()) == 2 and all(r.status == ap.COMPLETED for r in h.runs())


# -- an approval executes only as it was hashed --------------------------------------------------

def _tampered(a: ap.Approval, field: str) -> tuple[str, str]:
    """(column, value): one of the approval's hashed contents changed, its hash kept."""
    if field == "args":
        return "request_json", dataclasses.replace(a.request(), args=STOLEN).record()
    if field == "capability":
        cap = json.loads(a.capability)
        cap["side_effect"] = "read_only"
        return "capability_json", json.dumps(cap)
    if field == "presentation":
        return "presentation_json", json.dumps({"summary": "a harmless balance read"})
    return "kind", "interrupted_side_effect"


HASHED = ["args", "capability", "presentation", "kind"]


@pytest.mark.parametrize("field", HASHED)
def test_approval_whose_hash_no_longer_matches_is_never_collected(make, field):
    """Approved, then its row edited (the hash left alone): the model's identical call
    executes nothing, neither the edited request nor the approved one."""
    h = make()
    assert h.text(h.call("bank_pay", BOB)).startswith("PENDING_APPROVAL:")
    a = only_pending(h)
    h.decide(a, approve=True)
    column, value = _tampered(a, field)
    update(h, f"UPDATE approvals SET {column}=? WHERE id=?", (value, a.id))
    for _ in range(2):
        r = h.call("bank_pay", BOB)
        assert h.is_error(r) and h.text(r).startswith("UNAVAILABLE:"), h.text(r)
        assert "Nothing was executed" in h.text(r)
    assert h.payments() == 0
    assert any("stored hash does not match" in line for line in h.log_lines), h.log_lines
    assert not any(r.status == ap.COMPLETED for r in h.runs())


@pytest.mark.parametrize("field", HASHED)
def test_approval_whose_hash_no_longer_matches_cannot_be_approved(make, field):
    """Edited before the operator decides: neither the operator command nor a decision with
    the stored hash approves it, and the model's call stays unexecuted."""
    h = make()
    assert h.text(h.call("bank_pay", BOB)).startswith("PENDING_APPROVAL:")
    a = only_pending(h)
    column, value = _tampered(a, field)
    update(h, f"UPDATE approvals SET {column}=? WHERE id=?", (value, a.id))
    err = io.StringIO()
    code = ap.main(["-db", h.cfg.database, "approve", a.run_id, "-approval", a.id, "-by", "op"],
                   stdin=io.StringIO(), stdout=io.StringIO(), stderr=err)
    assert code == 1 and "stored hash does not match" in err.getvalue(), err.getvalue()
    with pytest.raises(ap.ApprovalHashMismatch):
        h.decide(a, approve=True)                     # bound to the hash as stored
    assert h.store.get_approval(a.id).status == ap.PENDING
    assert "approval.decided" not in h.event_types(a.run_id)
    r = h.call("bank_pay", BOB)
    # Still waiting (an edited kind reads as an interruption): nothing ran.
    assert h.prefix(r) in ("PENDING_APPROVAL", "INTERRUPTED"), h.text(r)
    assert h.payments() == 0


def test_approval_changed_after_it_was_shown_is_not_decided(make):
    """The operator read the approval (and its hash); another writer then replaced the
    request with a consistent hash. The decision, bound to what was shown, is refused, and
    neither request executes."""
    h = make()
    assert h.text(h.call("bank_pay", BOB)).startswith("PENDING_APPROVAL:")
    shown = only_pending(h)
    swapped = dataclasses.replace(shown.request(), args=STOLEN)
    digest = ap.approval_hash(shown.kind, shown.capability, shown.presentation, swapped)
    update(h, "UPDATE approvals SET request_json=?, hash=? WHERE id=?",
           (swapped.record(), digest, shown.id))
    with pytest.raises(ap.ApprovalChanged):
        ap.decide_approval(h.store, shown.run_id, shown.id, True, "op", "", shown.hash,
                           ap.time.time(), view="")
    assert h.store.get_approval(shown.id).status == ap.PENDING
    assert "approval.decided" not in h.event_types(shown.run_id)
    r = h.call("bank_pay", BOB)
    assert h.text(r).startswith("PENDING_APPROVAL:"), h.text(r)
    assert h.payments() == 0

