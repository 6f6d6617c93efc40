"""The upstream client over stdio (reference/mcp.md 11.3, 11.8 and 11.10): the server's
environment and stderr, frames past asyncio's line limit and past the frame limit, the
handshake in both protocol eras, requests and notifications from a server, the connect
timeout, and the server's processes ended on close. Against the scripted stdio server
(tests/scripted_server.py), the fake payment server and servers written to tmp_path; every
wait has a deadline, and a process a test leaves is killed by its pid.
"""

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import types

import pytest

from process_helpers import PYTHON, eventually_async
from proxy_harness import FAKE_SERVER, HttpProxy, ap
from scripted_server import (BANK_RULES, MIB16, RO, Scripted, arun, call_mapped, loaded, pin,
                             process_gone, results_server, rule, tool_entry, wait_gone)


NEVER = 600.0           # a step of a close no test waits out


# ==== 11.3 Transports: the stdio server's environment and stderr ==============================

def test_child_env_is_minimal_and_explicit(monkeypatch):
    for k in list(os.environ):
        monkeypatch.delenv(k)
    for k, v in {"PATH": "/bin", "HOME": "/home/op", "TMPDIR": "/tmp/op", "LANG": "C",
                 "HTTP_PROXY": "http://proxy", "AWS_SECRET_ACCESS_KEY": "s"}.items():
        monkeypatch.setenv(k, v)
    env = ap.child_env(["LANG", "UNSET"], ["API_KEY=k", "PATH=/opt/bin", "EMPTY="])
    assert list(env.items()) == [("PATH", "/opt/bin"), ("HOME", "/home/op"),
                                 ("TMPDIR", "/tmp/op"), ("LANG", "C"), ("API_KEY", "k"),
                                 ("EMPTY", "")]
    assert ap.child_env([], []) == {"PATH": "/bin", "HOME": "/home/op", "TMPDIR": "/tmp/op"}
    monkeypatch.setenv("HOME", "")                # set but empty still counts as set
    assert ap.child_env([], [])["HOME"] == ""
    for k in ("PATH", "HOME", "TMPDIR"):
        monkeypatch.delenv(k)
    empty = ap.child_env([], [])
    assert empty == {} and empty is not None


@pytest.mark.parametrize("field,value", [
    ("env", ["NOEQUALS"]), ("env", ["=v"]), ("inherit_env", ["A=B"]), ("inherit_env", [""])])
def test_server_rejects_malformed_env(tmp_path, field, value):
    doc = {"database": "runs.db", "session": "t", "servers": [
        {"name": "fs", "command": ["x"], "manifest": "m.json", field: value}]}
    with pytest.raises(ap.ConfigError, match="env"):
        ap.parse_config(json.dumps(doc).encode(), str(tmp_path / "c.json"))
    doc["servers"][0][field] = ["EMPTY="] if field == "env" else ["LANG"]
    ap.parse_config(json.dumps(doc).encode(), str(tmp_path / "c.json"))


def test_stdio_server_gets_only_the_environment_it_is_given(script, tmp_path, monkeypatch):
    envfile = str(tmp_path / "env.json")
    s = Scripted(script, tmp_path, tools=[tool_entry("a")], envfile=envfile)
    monkeypatch.setenv("AGENTRT_TEST_SECRET", "hunter2")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example")
    monkeypatch.setenv("PASSED_THROUGH", "yes")
    # A bare argv[0] is found on this process's PATH even though the child's PATH differs.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep +
                       os.environ.get("PATH", ""))
    server = s.server(inherit=["PASSED_THROUGH", "NOT_SET_ANYWHERE"],
                      env=["GIVEN=1", "PATH=/nonexistent"],
                      command=(os.path.basename(sys.executable), script, s.spec_path))
    arun(pin(server))
    with open(envfile) as f:
        env = json.load(f)
    assert "AGENTRT_TEST_SECRET" not in env and "HTTPS_PROXY" not in env
    assert "hunter2" not in json.dumps(env)
    assert env["PASSED_THROUGH"] == "yes" and env["GIVEN"] == "1"
    assert env["PATH"] == "/nonexistent"
    # Python itself may add LC_CTYPE (PEP 538); nothing else is there.
    assert set(env) - {"LC_CTYPE"} <= {"PATH", "HOME", "TMPDIR", "PASSED_THROUGH", "GIVEN"}


def test_stdio_stderr_tail_is_in_a_failed_connect(script, tmp_path):
    s = Scripted(script, tmp_path, stderr="oops: missing config\n", exit_at_start=True)
    with pytest.raises(ap.MCPError) as info:
        arun(pin(s.server()))
    msg = str(info.value)
    assert msg.startswith('mcp: server "fs": connect: ')
    assert "oops: missing config" in msg and "stderr" in msg
    # Much more stderr: only the tail is kept, and the message stays short.
    noise = "".join(f"noise line {i:05d}\n" for i in range(1300)) + "the last line\n"
    assert len(noise) > 20000
    s.set(stderr=noise, exit_at_start=True)
    with pytest.raises(ap.MCPError) as info:
        arun(pin(s.server()))
    msg = str(info.value)
    assert "the last line" in msg and "connect" in msg
    assert len(msg.encode()) <= 4096 + 500


def test_stdio_stderr_tail_is_in_a_failed_listing(script, tmp_path):
    s = Scripted(script, tmp_path, list_behaviour="exit",
                 list_reason="cannot open /srv/data: permission denied")
    with pytest.raises(ap.MCPError) as info:
        arun(pin(s.server()))
    msg = str(info.value)
    assert msg.startswith('mcp: server "fs": list tools: ')
    assert "cannot open /srv/data: permission denied" in msg


def test_stdio_listing_past_64_kib_works(script, tmp_path):
    """asyncio's default 64 KiB line limit must not apply: a 1.5 MB listing line pins."""
    desc = "d" * 7500
    s = Scripted(script, tmp_path, tools=[tool_entry(f"t{i:03d}", description=desc)
                                          for i in range(200)])
    pinned = arun(pin(s.server()))
    assert len(pinned) == 200 and pinned["t199"].description == desc


def test_stdio_frame_past_16_mib_fails(script, tmp_path):
    s = Scripted(script, tmp_path, list="huge", huge=MIB16 + 4096)
    with pytest.raises(ap.MCPError) as info:
        arun(pin(s.server()))
    assert "list tools" in str(info.value)
    assert str(MIB16) in str(info.value)


# ==== both eras, upstream side ===============================================================

def fake_server(tmp_path, era=None, description=None, rules=None):
    env = [f"FAKE_PAYMENTS_LEDGER={tmp_path}/ledger"]
    if era:
        env.append(f"FAKE_PAYMENTS_ERA={era}")
    if description:
        env.append(f"FAKE_PAYMENTS_DESCRIPTION={description}")
    return ap.ServerConfig(
        name="bank", command=(sys.executable, FAKE_SERVER), env=tuple(env),
        connect_timeout=10.0, manifest=str(tmp_path / "bank.manifest.json"),
        rules=tuple(sorted((k, rule(**v)) for k, v in (rules or {}).items())))


@pytest.mark.parametrize("era,modern,version", [
    ("legacy", False, "2025-11-25"), ("modern", True, "2026-07-28"),
    (None, True, "2026-07-28")])
def test_upstream_stdio_fake_server_in_both_eras(tmp_path, era, modern, version):
    server = fake_server(tmp_path, era, rules=BANK_RULES)

    async def body():
        conn, live, _ = await ap.open_upstream(server)
        try:
            assert (conn.modern, conn.version) == (modern, version)
            assert [t.name for t in live] == ["balance", "pay", "refund"]
            assert live[0].annotations == {"readOnlyHint": True}
            assert live[2].annotations is None
            reply = await conn.call_tool("balance", b'{"account":"A-1"}', 5)
            result = json.loads(reply.raw("result"))
            assert result["content"][0]["text"] == "account A-1 holds 120.00 EUR"
            assert ("resultType" in result) is modern
        finally:
            await conn.close()
        pinned = await pin(server)
        async with loaded(server, pinned) as (tools, report):
            assert [r[1] for r in report.registered] == ["bank_balance", "bank_pay",
                                                         "bank_refund"]
            r = await tools["bank_balance"].call(b'{"account":"A-1"}')
            assert json.loads(r.content) == "account A-1 holds 120.00 EUR"
            r = await tools["bank_pay"].call(
                b'{"to":"jo","amount":9007199254740993,"mode":"structured"}')
            assert r.content == b'{"paid":9007199254740993,"to":"jo"}'
            with pytest.raises(ap.ToolFailure, match="card declined for jo"):
                await tools["bank_pay"].call(b'{"to":"jo","amount":1,"mode":"error"}')
    arun(body())
    with open(tmp_path / "ledger") as f:
        assert len(f.readlines()) == 2


def test_upstream_refuses_server_requests_and_ignores_notifications(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": "asks"})
    r = arun(call_mapped(s, "read_file"))
    asked = json.loads(json.loads(r.content))
    for i in range(3):                     # sampling, elicitation, roots: refused
        assert asked[f"s{i}"]["error"]["code"] == -32601
        assert "result" not in asked[f"s{i}"]
    assert asked["s3"]["result"] == {}     # ping is answered


def test_connect_offers_the_newest_legacy_version_and_refuses_an_unknown_answer(
        script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("a")])
    arun(pin(s.server()))
    sent = s.received()
    assert [m.get("method") for m in sent[:4]] == [
        "server/discover", "initialize", "notifications/initialized", "tools/list"]
    init = sent[1]["params"]
    assert init["protocolVersion"] == "2025-11-25"
    assert "clientInfo" in init and "capabilities" in init
    assert "sampling" not in init["capabilities"] and "elicitation" not in init["capabilities"]
    assert "_meta" not in sent[3]["params"]
    s.change(version="2099-01-01")
    with pytest.raises(ap.MCPError) as info:
        arun(pin(s.server()))
    assert 'connect: unsupported protocol version: "2099-01-01"' in str(info.value)


def test_connect_falls_back_to_initialize_when_discover_never_answers(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("a")], discover="never")
    pinned = arun(pin(s.server(connect_timeout=2.0)))    # within its connect timeout
    assert list(pinned) == ["a"]
    assert "initialize" in s.methods()


def test_connect_modern_stdio_server_gets_no_handshake(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("a")], modern=True)

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server({"a": RO}), pinned) as (tools, _):
            assert tools["fs_a"].conn.modern
            await tools["fs_a"].call(b'{"k":1}')
    arun(body())
    sent = s.received()
    assert "initialize" not in s.methods()
    assert "notifications/initialized" not in s.methods()
    for m in sent:
        meta = m["params"]["_meta"]
        assert meta["io.modelcontextprotocol/protocolVersion"] == "2026-07-28"
        assert isinstance(meta["io.modelcontextprotocol/clientCapabilities"], dict)
    call = [m for m in sent if m["method"] == "tools/call"][0]
    assert call["params"]["arguments"] == {"k": 1}


def test_upstream_garbage_line_ends_the_connection(script, tmp_path):
    s = results_server(script, tmp_path, {"bad": "garbage", "read_file": "echo"})
    rules = {n: {"side_effect": "read_only", "timeout": "5s"} for n in ("bad", "read_file")}

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server(rules), pinned) as (tools, _):
            for name in ("fs_bad", "fs_read_file"):
                with pytest.raises(ap.ToolFailure) as info:     # not the rule's timeout
                    await tools[name].call(b'{"path":"p"}')
                assert '"fs"' in str(info.value)
    arun(body())


# ==== 11.8 Connect timeout =====================================================================

def test_server_connect_timeout_bounds_an_initialize_that_never_answers(script, tmp_path):
    s = Scripted(script, tmp_path, initialize="never")
    with pytest.raises(ap.MCPError) as info:
        arun(pin(s.server(connect_timeout=0.05)))
    msg = str(info.value)
    assert msg.startswith('mcp: server "fs": connect: timed out after 50ms'), msg


def test_server_connect_timeout_bounds_a_listing_that_never_answers(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("a")])
    pinned = arun(pin(s.server()))
    s.change(list_behaviour="never")
    for action in ("pin", "load"):
        with pytest.raises(ap.MCPError) as info:
            if action == "pin":
                arun(pin(s.server(connect_timeout=1.0)))
            else:
                arun(ap.load_server(s.server({"a": RO}, connect_timeout=1.0), pinned))
        assert str(info.value).startswith(
            'mcp: server "fs": list tools: timed out after 1s'), str(info.value)
        assert info.value.report is None
        assert wait_gone(s.pid())


def test_server_connect_timeout_does_not_shorten_the_session(two_tools):
    s = two_tools

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server({"read_file": RO}, connect_timeout=1.0), pinned) as (t, _):
            await asyncio.sleep(1.3)       # the clock must pass the 1 s connect timeout
            r = await t["fs_read_file"].call(b'{"path":"p"}')
            assert json.loads(json.loads(r.content)) == {"path": "p"}
    arun(body())


def test_phase_err_names_the_step_only_when_its_own_deadline_fired(script, tmp_path):
    s = Scripted(script, tmp_path, initialize="never")

    async def body():
        task = asyncio.create_task(ap.pin_server(s.server(connect_timeout=5.0), time.time()))
        await eventually_async(lambda: "initialize" in s.methods(), 5,
                               "initialize to reach the server")
        task.cancel()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            return None
        except ap.MCPError as exc:
            return exc
        raise AssertionError("a cancelled pin returned")
    err = arun(body())
    if err is not None:
        assert "timed out after" not in str(err)
        assert isinstance(err.__cause__, asyncio.CancelledError)
    assert wait_gone(s.pid())


# ==== 11.10 Process containment ================================================================

def test_stdio_close_kills_the_servers_descendants(script, tmp_path):
    gc = str(tmp_path / "grandchild.pid")
    s = Scripted(script, tmp_path, tools=[tool_entry("a")], grandchild=gc)
    try:
        pinned = arun(pin(s.server()))          # pin closes its connection itself
        with open(gc) as f:
            first = int(f.read())
        assert wait_gone(first), "pin left the server's grandchild running"
        os.unlink(gc)

        async def body():
            tools, _ = await ap.load_server(s.server({"a": RO}), pinned)
            with open(gc) as f:
                pid = int(f.read())
            assert not process_gone(pid)
            await tools[0].conn.close()
            return pid
        second = arun(body())
        assert wait_gone(second), "close left the server's grandchild running"
    finally:
        for path in (gc,):
            with contextlib.suppress(Exception):
                with open(path) as f:
                    os.kill(int(f.read()), signal.SIGKILL)


def test_stdio_close_is_prompt_when_the_server_exits_on_eof(script, tmp_path, monkeypatch):
    """Close waits for the server's exit on EOF, never for a step to run out: each step is
    given far longer than the test's own deadline (arun's)."""
    monkeypatch.setattr(ap, "CLOSE_WAIT", NEVER)
    gc = str(tmp_path / "grandchild.pid")
    s = Scripted(script, tmp_path, tools=[tool_entry("a")])
    pinned = arun(pin(s.server()))
    s.change(grandchild=gc)

    async def body():
        tools, _ = await ap.load_server(s.server({"a": RO}), pinned)
        with open(gc) as f:
            pid = int(f.read())
        await tools[0].conn.close()
        return pid
    try:
        pid = arun(body())
        assert wait_gone(pid)
    finally:
        with contextlib.suppress(Exception):
            with open(gc) as f:
                os.kill(int(f.read()), signal.SIGKILL)


# ---- The stdio client, faults found in review ------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

SILENT_SERVER = r'''
import json, sys
for line in sys.stdin:
    with open(sys.argv[1], "a") as f:
        f.write(line)
    msg = json.loads(line)
    if "id" not in msg or msg.get("method") == "tools/call":
        continue                                    # a call is never answered
    if msg["method"] == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
               "serverInfo": {"name": "silent", "version": "1"}}
    elif msg["method"] == "tools/list":
        res = {"tools": [{"name": "pay", "description": "pays",
                          "inputSchema": {"type": "object"}}]}
    else:
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"],
                          "error": {"code": -32601, "message": "no such method"}}), flush=True)
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": res}), flush=True)
'''


def test_call_timed_out_through_the_proxy_is_cancelled_at_the_server(tmp_path):
    """93356a0 (as the proxy uses it): a payment the gate runs under a 1 s rule timeout, on a
    server that never answers, must be cancelled at the server with notifications/cancelled
    naming the request, not only reported as an unknown outcome."""
    script, log = tmp_path / "silent.py", str(tmp_path / "received.log")
    script.write_text(SILENT_SERVER)
    hp = HttpProxy(tmp_path, None, {"pay": {"side_effect": "remote_mutation", "timeout": "1s",
                                            "outcome": "allow"}},
                   server={"command": [PYTHON, str(script), log]})
    try:
        text, _ = hp.call("h_pay", b'{"to":"bob"}')
        assert text.startswith("UNKNOWN_OUTCOME:"), text
        def cancelled() -> bool:
            with open(log) as f:
                return "notifications/cancelled" in f.read()
        hp.run(eventually_async(cancelled, 10, "notifications/cancelled at the server"))
        with open(log) as f:
            received = [json.loads(line) for line in f]
        calls = [m for m in received if m.get("method") == "tools/call"]
        cancels = [m for m in received if m.get("method") == "notifications/cancelled"]
        assert len(calls) == 1 and cancels, [m.get("method") for m in received]
        assert cancels[0]["params"]["requestId"] == calls[0]["id"]
    finally:
        hp.close()


GRANDCHILD_SERVER = r'''
import json, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    if msg["method"] == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
               "serverInfo": {"name": "gc", "version": "1"}}
    elif msg["method"] == "tools/list":
        res = {"tools": [{"name": "look", "description": "reads",
                          "inputSchema": {"type": "object"}}]}
    else:
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"],
                          "error": {"code": -32601, "message": "no such method"}}), flush=True)
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": res}), flush=True)
'''


PIN_WAIT = 30.0         # a pin, its close included


def test_closing_a_stdio_server_does_not_wait_on_a_descendants_pipes(tmp_path, monkeypatch):
    """93356a0: closing a stdio server waited for its pipes to close, not for the process to
    exit, so a server whose child kept stdout open made every close (pin, shutdown) wait
    out each step's 5 s. Close waits for the server process itself. Each step is given far
    longer than the pin's own deadline here: a close that waits a step out fails it."""
    monkeypatch.setattr(ap, "CLOSE_WAIT", NEVER)
    script, pidfile = tmp_path / "server.py", str(tmp_path / "grandchild.pid")
    script.write_text(GRANDCHILD_SERVER)
    doc = {"database": "runs.db", "session": "t", "hold": "0s",
           "servers": [{"name": "gc", "command": [PYTHON, str(script), pidfile],
                        "manifest": "gc.manifest.json",
                        "rules": {"look": {"side_effect": "read_only", "timeout": "2s"}}}]}
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    cfg = ap.load_config(str(path))
    try:
        asyncio.run(asyncio.wait_for(ap.pin_server(cfg.servers[0], time.time()), PIN_WAIT))
    finally:
        with contextlib.suppress(OSError, ValueError):
            with open(pidfile) as f:
                os.kill(int(f.read()), signal.SIGKILL)


STUBBORN = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "open(sys.argv[1], 'w').close()\n"
            "time.sleep(120)\n")
READY_WAIT = 10.0
CLOSE_STEP = 0.5            # CLOSE_WAIT here: what is judged is how many close at once


def test_closing_servers_that_ignore_eof_and_sigterm_is_bounded_overall(tmp_path,
                                                                         monkeypatch):
    # Each stdio server gets CLOSE_WAIT after its stdin closes and CLOSE_WAIT after SIGTERM
    # before SIGKILL; close_tools closed the servers one after another, so at exit the
    # proxy waited 2 * CLOSE_WAIT for each server that ignores both (three: 30 s), where a
    # host may already have given up on it. Closed together, the wait is that of one: all
    # three closes are under way at once.
    """The hardened proxy's review, finding 4: at exit the stdio servers are closed one after
    another, each given 2 * CLOSE_WAIT when it ignores EOF and SIGTERM: the exit waits for the
    sum. Judged by a count, never by a time: the closes under way at once."""
    monkeypatch.setattr(ap, "CLOSE_WAIT", CLOSE_STEP)
    under_way, most = [0], [0]
    close = ap.StdioUpstream.close

    async def counted(self):
        under_way[0] += 1
        most[0] = max(most[0], under_way[0])
        try:
            await close(self)
        finally:
            under_way[0] -= 1
    monkeypatch.setattr(ap.StdioUpstream, "close", counted)

    async def scenario() -> None:
        conns = []
        for i in range(3):
            ready = str(tmp_path / f"ready{i}")
            conn = ap.StdioUpstream(f"s{i}", [sys.executable, "-c", STUBBORN, ready],
                                    {"PATH": os.environ.get("PATH", "")})
            await conn.start()
            conns.append(conn)
        deadline = time.monotonic() + READY_WAIT      # each has installed its handler
        while not all((tmp_path / f"ready{i}").exists() for i in range(3)):
            assert time.monotonic() < deadline, "the servers did not start"
            await asyncio.sleep(0.02)
        holders = [types.SimpleNamespace(conn=c) for c in conns]
        await ap.close_tools(holders)
        for conn in conns:
            assert conn.proc is None

    asyncio.run(scenario())
    assert most[0] == 3, f"at most {most[0]} of the three closes were under way at once"


WAIT = 10.0               # the deadline of every wait that should succeed
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
    """The review of moving parsing and deciding onto worker threads, finding 2: a server's
    answer past OFFLOAD_BYTES is parsed on a worker thread while the request's timeout still
    runs. An answer that arrived in time, but takes longer to parse than is left of the timeout,
    is a timeout: an unknown outcome for a call the server answered. Parsed on the loop
    (before), the answer that arrived won."""
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
