"""What a limit covers comes from the configuration, never from what loaded: a tool first
offered while serving (drift: withheld at start, pinned again, offered) is counted by its
limits from its first call; every limit the configuration declares is caught up at start and
listed by the status tool, whether its tool loaded or not (DESIGN sections 9 and 12). Real
proxy processes in front of tests/drift_server.py."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from process_helpers import RULES, eventually, is_error, prefix, text  # noqa: E402
from test_drift import WAIT, DriftDir, listing  # noqa: E402

PAY = "bank_pay"
PAY_CALLS = {"name": "pay-calls", "calls": 2, "per": "1h", "over": "deny"}


def rules_with(limits=None) -> dict:
    rules = json.loads(json.dumps(RULES))
    rules["pay"]["outcome"] = "allow"
    if limits is not None:
        rules["pay"]["limits"] = limits
    return rules


def status(p) -> str:
    return text(p.call("gate_status", {}))


def pay(p, amount) -> dict:
    return p.call(PAY, {"to": "bob", "amount": amount, "memo": "m"})


def offered_after_pin(p, d) -> None:
    code, out, err = d.pin()
    assert code == 0, out + err
    eventually(lambda: PAY in listing(p, d), WAIT, "pay offered again after the pin")


def test_a_tool_first_offered_while_serving_is_counted_by_its_limits(tmp_path):
    """The server rewords pay before the proxy starts, so pay is withheld at start; the
    operator pins again and drift offers it. Its limit of 2 calls counts it from its first
    call: the third payment is DENIED, and only two reach the server."""
    d = DriftDir(tmp_path, "legacy", rules=rules_with([PAY_CALLS]))
    try:
        d.drift()                                # changed before the proxy starts
        p = d.start()
        assert PAY not in listing(p, d)
        said = status(p)                         # listed from the first moment
        assert 'bank_pay: 0 of 2 (calls, limit "pay-calls") in the last 1h' in said, said
        offered_after_pin(p, d)
        for amount in (1, 2):
            r = pay(p, amount)
            assert not is_error(r), r
        r = pay(p, 3)
        assert is_error(r) and prefix(r) == "DENIED", r
        assert "pay-calls" in text(r) and "2 of 2" in text(r), r
        assert d.payments() == 2
        assert 'bank_pay: 2 of 2 (calls, limit "pay-calls")' in status(p)
        p.stop()
    finally:
        d.cleanup()


def test_a_limit_whose_tool_did_not_load_is_caught_up_at_start(tmp_path):
    """Two payments made with no limit configured; then a limit of 2 is added while pay's
    server has changed, so pay does not load. The limit is caught up all the same: the
    status tool says 2 of 2 before pay is offered, and once it is, a payment is DENIED."""
    d = DriftDir(tmp_path, "legacy", rules=rules_with())
    try:
        p = d.start()
        for amount in (1, 2):
            r = p.call(PAY, {"to": "bob", "amount": amount})
            assert not is_error(r), r
        p.stop()
        d.write_config(rules_with([PAY_CALLS]))
        d.drift()
        p = d.start()
        assert PAY not in listing(p, d)
        said = status(p)
        assert 'bank_pay: 2 of 2 (calls, limit "pay-calls") in the last 1h' in said, said
        offered_after_pin(p, d)
        r = pay(p, 3)
        assert is_error(r) and prefix(r) == "DENIED", r
        assert d.payments() == 2
        p.stop()
    finally:
        d.cleanup()
