"""Faults in the changes that moved parsing and deciding onto worker threads, each reproduced
against the real module: a test here fails while its fault is present.

1. A call whose arguments are past OFFLOAD_BYTES decides on a worker thread under the
   deciding lock. Another call's unknown outcome (its tool timed out) is recorded on the
   event loop meanwhile, and its re-run, which asks the operator, waits for that lock. The
   call deciding sees the timed-out run as RUNNING under a live lease, nothing waiting,
   and runs a second mutating call to the tool while the first one's outcome is unknown:
   it should be BLOCKED.
2. A server's answer past OFFLOAD_BYTES is parsed on a worker thread while the request's
   timeout still runs. An answer that arrived in time, but takes longer to parse than is
   left of the timeout, is a timeout: an unknown outcome for a call the server answered.
   Parsed on the loop (before), the answer that arrived won.
3. The host's input does not wait: HostServer.room holds back the dispatching, but the
   LineReader thread goes on reading the host's lines into an unbounded queue, so a host
   that floods the proxy while it is busy makes it hold what it sent without bound.
   (Tested in tests/test_host_io.py, for the loop's reading and the thread's.)
4. ToolSpec.hash is not safe on two threads: the cache it fills may be emptied by another
   thread before it reads it back (KeyError).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import agentrt_proxy as ap  # noqa: E402
from proxy_harness import ProxyHarness  # noqa: E402

PAY = "bank_pay"
WAIT = 10.0               # the deadline of every wait that should succeed
TIMEOUT_PAY = {
    "balance": {"side_effect": "read_only", "timeout": "10s"},
    "pay": {"side_effect": "remote_mutation", "timeout": "300ms", "outcome": "allow"},
    "refund": {"side_effect": "destructive", "timeout": "10s"},
}


def _params(name: str, args: dict) -> bytes:
    return json.dumps({"name": name, "arguments": args}).encode()


# ==== 1. an unknown outcome is not run past by a call deciding on a worker ====================

def test_a_call_deciding_on_a_worker_does_not_run_past_an_unknown_outcome(tmp_path):
    """No call decides between an unknown outcome being recorded and the operator being
    asked about it: a mutating call deciding there would find the outcome recorded and
    nothing yet asking, and run past it. A large call decides slowly on a worker thread
    while the first call's tool times out; the first call's record must wait for it, and
    then be followed by the question with no decision in between."""
    h = ProxyHarness(tmp_path, rules=TIMEOUT_PAY)
    timeline: list[str] = []
    real_record, real_decide, real_rerun = ap.Session._record, h.proxy.decide, h.proxy.rerun

    def record(self, obs, began):
        timeline.append("record")
        return real_record(self, obs, began)

    def decide(tool, key, args):
        timeline.append("decide")
        if len(args) > ap.OFFLOAD_BYTES:
            time.sleep(0.8)             # a slow decision: past the first call's timeout
        try:
            return real_decide(tool, key, args)
        finally:
            timeline.append("decided")

    def rerun(*args):
        timeline.append("asked")
        return real_rerun(*args)

    ap.Session._record = record
    h.proxy.decide, h.proxy.rerun = decide, rerun
    try:
        first = h.request("tools/call", raw_params=_params(
            PAY, {"to": "amy", "amount": 1, "mode": "slow"}), wait=False)

        async def until_paid():
            while h.payments() < 1:
                await asyncio.sleep(0.01)
        h.run(until_paid(), WAIT)                 # the first call's tool is running
        big = h.request("tools/call", raw_params=_params(
            PAY, {"to": "b" * (ap.OFFLOAD_BYTES + 1), "amount": 2}), wait=False)
        first_text = h.text(h.answer(first, WAIT)["result"])
        h.answer(big, WAIT)
        assert first_text.startswith("UNKNOWN_OUTCOME"), first_text
        at = timeline.index("record")
        assert timeline[at:at + 2] == ["record", "asked"], timeline
    finally:
        ap.Session._record = real_record
        h.close()


# ==== 2. an answer that arrived in time is not a timeout ======================================

# The answer is encoded once, before any request, so that the server answers at once on
# any machine. Its parse is made slower than the request's timeout by the test itself (a
# sleep before it), so that no machine parses it in time, however fast or busy.
BIG_ANSWER_SERVER = r"""
import json, sys
BLOCKS = int(sys.argv[1])
result = json.dumps({"content": [{"type": "text", "text": "x"}] * BLOCKS}).encode()
for line in sys.stdin.buffer:
    msg = json.loads(line)
    if "id" in msg and "method" in msg:
        head = b'{"jsonrpc":"2.0","id":' + json.dumps(msg["id"]).encode() + b',"result":'
        sys.stdout.buffer.write(head + result + b"}\n")
        sys.stdout.buffer.flush()
"""
BLOCKS = 20_000           # about 600 KB: past OFFLOAD_BYTES
REPLY_TIMEOUT = 2.0       # the answer arrives well within it, on a busy machine too
SLOW_PARSE = 1.5          # times REPLY_TIMEOUT, spent before a large answer is parsed


def test_a_large_answer_that_arrived_in_time_is_not_a_timeout(tmp_path, monkeypatch):
    parse_message = ap.parse_message

    def slow(line, *args):
        if len(line) > ap.OFFLOAD_BYTES:
            time.sleep(SLOW_PARSE * REPLY_TIMEOUT)     # past the deadline, on any machine
        return parse_message(line, *args)
    monkeypatch.setattr(ap, "parse_message", slow)
    script = tmp_path / "big_answer_server.py"
    script.write_text(BIG_ANSWER_SERVER)

    async def body():
        conn = ap.StdioUpstream("big", [sys.executable, str(script), str(BLOCKS)],
                                ap.child_env((), ()))
        await conn.start()
        try:
            await conn.request("ping", {}, WAIT)          # the server is up and answering
            got = await conn.request("tools/call", {"name": "t", "arguments": {}},
                                     REPLY_TIMEOUT)
            return len(got.doc["result"]["content"])
        except asyncio.TimeoutError:
            return "timed out"
        finally:
            await conn.close()
    loop = asyncio.new_event_loop()
    try:
        got = loop.run_until_complete(asyncio.wait_for(body(), 60))
    finally:
        loop.close()
    assert got == BLOCKS, "the server answered in time, and the answer was recorded as a " \
        "timeout: it was still being parsed on a worker thread when the timeout ran out"


# ==== 3. the host's input waits: tests/test_host_io.py, read by the loop and by a thread ====


# ==== 4. a tool spec's hash, asked on two threads ==============================================

HASH_PASSES = 50          # passes over the specs on each thread (about 2 s on a busy
                          # 2-core machine); the fault shows within a few
HASH_WAIT = 600.0         # for them: a guard against a hang, never reached


def test_a_spec_hash_asked_on_two_threads_never_fails():
    """ToolSpec.hash fills the cache, then reads it again: another thread that empties the
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
