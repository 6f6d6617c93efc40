"""The allowed call's own path, made shorter without changing what it records or answers.

- An observation keeps the exact bytes of its content member, as the record holds them
  (line breaks written again by the encoder), so that a terminal tool's result is never
  parsed out of the record just built; one read back from a record is parsed as before.
- A transaction inside a batch joins the batch only on the batch's own thread: another
  thread's transaction waits for the batch to end and is never part of it.
- A deadline on an upstream call (in_time) raises asyncio.TimeoutError and cancels what it
  waited for, as asyncio.wait_for does. An answer set in the very turn its deadline falls
  due is taken, on every version (3.12's wait_for loses it).
- A call's arguments are parsed once: the host's arguments, parsed strictly for their
  request key, travel with the call as the strict parse of the proxy's own encoding of
  them, which every later reader reads (the schema check, the policy's copy, the record,
  the request sent). A fixed parameter is written into a copy, never into that value.
- A DUPLICATE reads the earlier run once: the run the request's open row names, read and
  found ended, is the run the duplicate rule judges.
"""

import asyncio
import os
import time

import pytest

from proxy_harness import ProxyHarness, ap
from test_rules_cost import InstantServer, instant_proxy


CONTENTS = [
    b'{"a":1}',
    b'{"a": 1,\n  "b": "x\xe2\x80\xa8y"}',          # a line end of every reader, twice
    b'[1,\r\n2.50, "\xc2\x85"]',
    b'"text"',
    {"error": "no answer", "tool": "bank_pay"},
]


@pytest.mark.parametrize("content", CONTENTS, ids=range(len(CONTENTS)))
def test_an_observations_kept_content_is_its_records_own_bytes(content):
    obs = ap._obs(ap.TOOL_RESULT, content, "a summary")
    recorded = ap.member_spans(obs.json_text.encode())["content"]
    assert ap._content_bytes(obs) == recorded
    read_back = obs._replace(content=None)                    # read back: parsed, as before
    assert ap._content_bytes(read_back) == recorded
    for brk in (b"\n", b"\r", b"\xc2\x85", b"\xe2\x80\xa8"):
        assert brk not in recorded
    assert obs.doc == ap.read_own(obs.json_text) and obs.content_hash == obs.doc["content_hash"]


def test_a_terminal_tools_result_is_its_recorded_content(tmp_path):
    rules = dict(RULES, balance=dict(RULES["balance"], terminal=True))
    h = ProxyHarness(tmp_path, rules=rules)
    proxy = instant_proxy(h, InstantServer())
    try:
        result = h.run(proxy.call("bank_balance", b'{"account":"A-1"}'))
        assert not result.get("isError"), result
        run = h.store.list_runs(1)[0][0]
        step = h.store.list_steps(run.id)[0]
        raw = h.store._read("SELECT observation_json FROM steps WHERE id=?", (step.id,))[0][0]
        assert run.status == ap.COMPLETED
        assert run.result_json.encode() == ap.member_spans(raw.encode())["content"]
    finally:
        proxy.close()
        h.close()


def test_a_deadline_past_raises_timeout_and_cancels_what_it_waited_for():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await ap.in_time(slow(), 0.05)
        fut = asyncio.get_running_loop().create_future()
        with pytest.raises(asyncio.TimeoutError):
            await ap.in_time(fut, 0.05)
        assert fut.done()                 # ended: an answer after it is dropped
        assert await ap.in_time(asyncio.sleep(0, "done"), 5) == "done"
    asyncio.run(main())
    assert cancelled == [True]


def test_an_answer_set_in_the_turn_its_deadline_falls_due_is_taken():
    async def trial():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        deadline = 0.05
        loop.call_at(loop.time() + deadline - 0.001, lambda: fut.set_result("answer"))
        loop.call_soon(time.sleep, deadline + 0.02)     # the loop busy past both
        return await ap.in_time(fut, deadline)
    assert asyncio.run(trial()) == "answer"


def test_an_answer_read_in_the_turn_its_deadline_falls_due_is_taken():
    """As an upstream's answer comes: read from a pipe by a reading task that sets the
    future. The pipe turns readable in the same turn as the deadline's timer is due; the
    reading task runs the turn after, and its answer is still taken."""
    async def trial():
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", 0))
        fut = loop.create_future()

        async def read():
            line = await reader.readuntil(b"\n")
            if not fut.done():
                fut.set_result(line)
        task = asyncio.create_task(read())
        await asyncio.sleep(0)
        deadline = 0.05

        def answer_then_stall():
            os.write(w, b"answer\n")
            time.sleep(deadline + 0.02)           # the loop busy past the deadline
        loop.call_soon(answer_then_stall)
        try:
            return await ap.in_time(fut, deadline)
        finally:
            task.cancel()
            transport.close()
            os.close(w)
    assert asyncio.run(trial()) == b"answer\n"


def test_a_cancel_in_the_turn_the_deadline_is_judged_is_a_cancel():
    """Another part of the proxy cancels the waiting task (closing, say) in the very turn
    in which the deadline ends the future: the task is cancelled, never handed a timeout it
    would take for the deadline and go on from."""
    async def trial():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        went_on = []

        async def waiter():
            try:
                return await ap.in_time(fut, 0.05)
            except asyncio.TimeoutError:
                went_on.append(True)
                await asyncio.sleep(0.01)
                return "went on"
        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        loop.call_later(0.05, loop.call_soon, task.cancel)
        time.sleep(0.1)                           # the loop busy past both timers
        try:
            await task
        except asyncio.CancelledError:
            return went_on
        return ["returned"] + went_on
    assert asyncio.run(trial()) == []


def test_an_outside_cancel_cancels_the_answer_awaited():
    async def trial():
        fut = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(ap.in_time(fut, 10))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return fut.cancelled()
    assert asyncio.run(trial())
