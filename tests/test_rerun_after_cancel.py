"""A payment the operator cancels while it executes, whose tool then times out: what the
call came to is recorded as a late event (the run is the operator's, cancelled), so the run
holds no failed attempt of its own to propose again. Executor.rerun answers UNKNOWN_OUTCOME
with no approval named, and the next identical call is held for an operator."""
import asyncio
import time

from proxy_harness import ProxyHarness, ap

PAY = "bank_pay"
SLOW_TIMEOUT_PAY = {"pay": {"side_effect": "remote_mutation", "timeout": "2s", "outcome": "allow"}}


def test_a_cancel_while_executing_then_a_timeout_asks_no_rerun_in_the_cancelled_run(tmp_path):
    h = ProxyHarness(tmp_path, rules=SLOW_TIMEOUT_PAY)
    try:
        args = {"to": "bob", "amount": 5, "mode": "block"}
        ident = h.request("tools/call", {"name": PAY, "arguments": args}, wait=False)

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
