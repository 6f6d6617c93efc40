"""Calling a loaded upstream tool (reference/mcp.md 11.2 and 11.7): a rule's deny and fixed,
taken out of the schema the host is offered and enforced at the call; the arguments sent; the
rule's timeout, never a default, with the server told the proxy stopped waiting; a session
that died; a connection closed under a call. Against the scripted stdio server
(tests/scripted_server.py); every wait has a deadline.

A deadline on an upstream call (in_time) raises asyncio.TimeoutError and cancels what it
waited for, as asyncio.wait_for does. An answer set in the very turn its deadline falls due
is taken, on every version (3.12's wait_for loses it).
"""

import asyncio
import hashlib
import json
import os
import signal
import time

import pytest

from process_helpers import eventually_async
from proxy_harness import ap
from scripted_server import (CANCEL_WAIT, RO, WRITE_SCHEMA, Scripted, arun, loaded, pin,
                             results_server, tool_entry, wait_gone)


ROOT_SCHEMA = {"type": "object", "required": ["path", "root"],
               "properties": {"path": {"type": "string"}, "root": {"type": "string"}}}


def deadlines(conn) -> list:
    """(method, timeout) of each request ``conn`` sends from now on: which deadline a
    request was given, read instead of timed."""
    seen: list = []
    exchange = conn._exchange

    async def recorded(msg_id, method, payload, timeout, *rest):
        seen.append((method, timeout))
        return await exchange(msg_id, method, payload, timeout, *rest)
    conn._exchange = recorded
    return seen


# ==== 11.2 Deny, fixed and calls =============================================================

def test_deny_removed_from_the_schema_and_refused_at_call(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("write_file", WRITE_SCHEMA)])
    rules = {"write_file": {"side_effect": "local_mutation", "timeout": "2s",
                            "deny": ["force"]}}

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server(rules), pinned) as (tools, _):
            wr = tools["fs_write_file"]
            offered = json.loads(wr.spec.input_schema)
            assert "force" not in offered["properties"]
            assert offered["required"] == ["path", "text"]
            r = await wr.call(b'{"path":"a","text":"b"}')
            assert json.loads(json.loads(r.content)) == {"path": "a", "text": "b"}
            before = len(s.received())
            with pytest.raises(ap.ToolFailure, match='"force" is denied'):
                await wr.call(b'{"path":"a","text":"b","force":true}')
            assert len(s.received()) == before, "a denied call reached the server"
    arun(body())


def test_fixed_removed_from_the_schema_and_injected_at_call(script, tmp_path):
    schema = {"type": "object", "required": ["path", "root"],
              "properties": {"path": {"type": "string"}, "root": {"type": "string"},
                             "n": {"type": "number"}}}
    s = Scripted(script, tmp_path, tools=[tool_entry("read_file", schema)])
    rules = {"read_file": {**RO, "fixed": {"root": "/srv/sandbox"}}}

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server(rules), pinned) as (tools, _):
            rd = tools["fs_read_file"]
            assert rd.spec.input_schema == (b'{"properties":{"n":{"type":"number"},"path":'
                                            b'{"type":"string"}},"required":["path"],'
                                            b'"type":"object"}')
            await rd.call(b'{"path": "a", "n": 0.1000000000000000000001}')
            call = s.received()[-1]
            assert call["method"] == "tools/call"
            assert call["params"]["name"] == "read_file"
            assert call["params"]["arguments"]["root"] == "/srv/sandbox"
            assert call["params"]["arguments"]["path"] == "a"
            # The model's number literal is sent as written, not through a float.
            assert b"0.1000000000000000000001" in s.received_raw()[-1]
    arun(body())


def test_fixed_a_call_that_sets_a_fixed_parameter_fails(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("read_file", ROOT_SCHEMA)])
    rules = {"read_file": {**RO, "fixed": {"root": "/srv/sandbox"}}}

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server(rules), pinned) as (tools, _):
            before = len(s.received())
            for root in ('"/srv/sandbox"', '"/"'):
                with pytest.raises(ap.ToolFailure, match='"root" is fixed'):
                    await tools["fs_read_file"].call(b'{"path":"a","root":%s}' % root.encode())
            assert len(s.received()) == before
    arun(body())


def test_call_arguments_empty_null_and_not_an_object(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("echo")])

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server({"echo": RO}), pinned) as (tools, _):
            echo = tools["fs_echo"]
            for args in (b"", b"  "):
                r = await echo.call(args)
                assert json.loads(json.loads(r.content)) == {}
                assert s.received()[-1]["params"]["arguments"] == {}
            before = len(s.received())
            for args in (b"[1]", b'"x"', b"{"):
                with pytest.raises(ap.ToolFailure,
                                   match="^fs_echo: arguments are not a JSON object"):
                    await echo.call(args)
            assert len(s.received()) == before
    arun(body())


def test_call_null_arguments_are_sent_as_an_empty_object(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("echo")])

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server({"echo": RO}), pinned) as (tools, _):
            await tools["fs_echo"].call(b"null")
            assert s.received()[-1]["params"]["arguments"] == {}
    arun(body())


def test_call_timeout_is_honoured(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": "never"})
    rules = {"read_file": {"side_effect": "read_only", "timeout": "50ms"}}

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server(rules), pinned) as (tools, _):
            given = deadlines(tools["fs_read_file"].conn)
            with pytest.raises(asyncio.TimeoutError):
                await tools["fs_read_file"].call(b'{"path":"p"}')
            assert given == [("tools/call", 0.05)]          # the rule's, never a default
            # The server is told the proxy stopped waiting.
            end = time.monotonic() + CANCEL_WAIT
            while time.monotonic() < end:
                cancels = [m for m in s.received()
                           if m.get("method") == "notifications/cancelled"]
                if cancels:
                    break
                await asyncio.sleep(0.02)
            call_id = [m for m in s.received() if m.get("method") == "tools/call"][-1]["id"]
            assert cancels and cancels[0]["params"]["requestId"] == call_id
    arun(body())


# ==== 11.7 Call robustness =====================================================================

def test_call_dead_session_fails_fast_naming_the_server(two_tools):
    s = two_tools
    rules = {"read_file": {"side_effect": "read_only", "timeout": "5s"}}

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server(rules), pinned) as (tools, _):
            os.kill(s.pid(), signal.SIGKILL)
            conn = tools["fs_read_file"].conn
            await eventually_async(lambda: conn.closed, 5, "the connection to see the server die")
            for _ in range(2):
                with pytest.raises(ap.ToolFailure) as info:     # not the rule's timeout
                    await tools["fs_read_file"].call(b'{"path":"p"}')
                assert '"fs"' in str(info.value)
    arun(body())


def test_call_returns_when_the_rule_timeout_passes_even_if_the_server_never_answers(
        script, tmp_path):
    raw_schema = b'{ "type": "object", "properties": { "path": { "type": "string" } } }'
    s = Scripted(script, tmp_path, list="pages", calls={"slow": "never"}, pages=[
        '{"tools":[{"name":"slow","description":"Never answers.","inputSchema":%s}]}'
        % raw_schema.decode()])
    canonical = ap.canonical_schema(raw_schema)
    manifest = {"server": "fs", "pinned_at": "2026-01-01T00:00:00Z", "tools": {"slow": {
        "name": "slow", "description": "Never answers.",
        "input_schema": json.loads(canonical),
        "schema_hash": hashlib.sha256(canonical).hexdigest(),
        "description_hash": ap.hash_string("Never answers.")}}}
    with open(s.manifest, "w") as f:
        json.dump(manifest, f, indent=2)
    os.chmod(s.manifest, 0o600)
    pinned = ap.read_manifest(s.manifest, "fs")

    async def body():
        rules = {"slow": {"side_effect": "read_only", "timeout": "100ms"}}
        async with loaded(s.server(rules), pinned) as (tools, _):
            given = deadlines(tools["fs_slow"].conn)
            with pytest.raises(asyncio.TimeoutError):
                await tools["fs_slow"].call(b"{}")
            assert given == [("tools/call", 0.1)]           # the rule's, never a default
    arun(body())


def test_connection_close_is_safe_twice_and_concurrent_with_a_call(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": "never"})

    async def body():
        pinned = await pin(s.server())
        tools, _ = await ap.load_server(s.server({"read_file": {"side_effect": "read_only",
                                                                  "timeout": "20s"}}), pinned)
        conn = tools[0].conn
        call = asyncio.create_task(tools[0].call(b'{"path":"p"}'))
        await eventually_async(lambda: "tools/call" in s.methods(), 5,
                               "the call to reach the server")
        await asyncio.gather(conn.close(), conn.close())
        await conn.close()
        with pytest.raises((ap.ToolFailure, asyncio.TimeoutError)):
            await asyncio.wait_for(call, 5)
        assert conn.closed
    arun(body())
    assert wait_gone(s.pid())


# ==== A call's deadline (in_time) =============================================================

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


# ---- Calls, faults found in review -----------------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

def test_null_arguments_are_sent_as_an_empty_object():
    """93356a0: arguments given as JSON null were taken as {} for the checks but sent to the
    server as null; mcp.md 8.1 has null sent as {}."""
    sent: list[bytes] = []

    class Conn:
        def offers_tasks(self, support):
            return False

        async def call_tool(self, remote, args, timeout, on_task=None):
            sent.append(bytes(args))
            return ap.parse_message(b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}')

    spec = ap.ToolSpec("h_look", "", b'{"type":"object"}', "read_only", 5.0)
    tool = ap.UpstreamTool(spec, "h", "look", ap.Rule(side_effect="read_only"), Conn())
    asyncio.run(tool.call(b"null"))
    assert sent == [b"{}"]


def test_the_arguments_sent_are_wire_arguments_of_the_record(script, tmp_path):
    """Promise 7: what a server receives as a call's arguments is wire_arguments of the
    recorded arguments and the rule's fixed values, byte for byte, and making it changes
    neither; without fixed values the recorded bytes go as they are."""
    s = Scripted(script, tmp_path, tools=[tool_entry("read_file", ROOT_SCHEMA)])
    rules = {"read_file": {**RO, "fixed": {"root": "/srv/sandbox"}}}
    recorded = b'{"path":"a","n":1.50}'
    value = ap.parse_json(recorded)

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server(rules), pinned) as (tools, _):
            rd = tools["fs_read_file"]
            await rd.call(recorded, value)
            wire = ap.wire_arguments(recorded, value, rd.rule.fixed)
            assert wire == b'{"path":"a","n":1.50,"root":"/srv/sandbox"}'
            assert b'"arguments":' + wire in s.received_raw()[-1]
            assert value == ap.parse_json(recorded)          # the parse is left as it was
    arun(body())
    assert ap.wire_arguments(recorded, value, ()) is recorded
