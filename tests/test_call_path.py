"""The allowed call's own path, made shorter without changing what it records or answers.

- An observation keeps the exact bytes of its content member, as the record holds them
  (line breaks written again by the encoder), so that a terminal tool's result is never
  parsed out of the record just built; one read back from a record is parsed as before.
- A strict parse is kept for the few readers that parse the same small document in turn
  (the arguments' schema check, the policy's copy, the record's check; a result's check
  and its hash): the same value as a fresh parse, a refusal refused every time, at most
  STRICT_KEPT_COUNT documents of at most STRICT_KEPT_BYTES each.
- A deadline on an upstream call (in_time) raises asyncio.TimeoutError and cancels what it
  waited for, as asyncio.wait_for does; from Python 3.11 on the upstream call runs in the
  caller's own task (no task of its own, two turns of the event loop fewer each call).
"""

import asyncio
import sys

import pytest

from proxy_harness import ProxyHarness, ap
from test_rules_cost import InstantServer, instant_proxy

RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
         "refund": {"side_effect": "destructive", "timeout": "10s"}}

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
    recorded = ap.member_spans(obs[1].encode())["content"]
    assert ap._content_bytes(obs) == recorded
    assert ap._content_bytes(tuple(obs)) == recorded          # read back: parsed, as before
    for brk in (b"\n", b"\r", b"\xc2\x85", b"\xe2\x80\xa8"):
        assert brk not in recorded
    doc, text, digest = obs
    assert doc == ap.read_own(text) and digest == doc["content_hash"]


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
        assert fut.cancelled()
        assert await ap.in_time(asyncio.sleep(0, "done"), 5) == "done"
    asyncio.run(main())
    assert cancelled == [True]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is new in 3.11")
def test_an_upstream_call_runs_in_the_callers_task(tmp_path):
    class Watched(InstantServer):
        async def call_tool(self, remote, args, timeout):
            tasks.append(asyncio.current_task())
            return await super().call_tool(remote, args, timeout)

    tasks: list = []
    h = ProxyHarness(tmp_path, rules=RULES)
    proxy = instant_proxy(h, Watched())

    async def call():
        caller = asyncio.current_task()
        result = await proxy.call("bank_balance", b'{"account":"A-1"}')
        return caller, result
    try:
        caller, result = h.run(call())
        assert not result.get("isError"), result
        assert tasks == [caller]
    finally:
        proxy.close()
        h.close()


DOCS = [b'{"to":"payee-1","amount":1}', b'{"b":"\\u00e9","a":[2]}',
        b'[1.50,"x",{"a":[null,true]}]', b'"\\u00e9"', b'{"n":123456789012345678901234567890}',
        b'0']


def test_a_kept_strict_parse_is_a_fresh_parse_of_the_same_bytes():
    for raw in DOCS:
        assert ap.parse_strict(raw) == ap.parse_json(raw)
        assert ap.parse_strict(raw) == ap.parse_json(raw)       # the kept one
    for bad in (b'{"a":1,"a":2}', b'"\\ud800"', b'[1,]'):
        for _ in range(2):
            with pytest.raises(ap.JSONError):
                ap.parse_strict(bad)
            with pytest.raises(ap.JSONError):
                ap.check_json(bad)
        assert bad not in ap._STRICT_KEPT
    big = b'{"a":"' + b"x" * ap.STRICT_KEPT_BYTES + b'"}'
    ap.parse_strict(big)
    assert big not in ap._STRICT_KEPT
    for i in range(3 * ap.STRICT_KEPT_COUNT):
        ap.parse_strict(b'{"i":%d}' % i)
        assert len(ap._STRICT_KEPT) <= ap.STRICT_KEPT_COUNT


def test_a_kept_value_hashes_as_the_lenient_read_does():
    for raw in DOCS:
        ap._STRICT_KEPT.clear()
        lenient = ap.content_hash(raw)
        ap.parse_strict(raw)
        assert raw in ap._STRICT_KEPT
        assert ap.content_hash(raw) == lenient
