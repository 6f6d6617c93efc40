"""Start-up: the handshake is answered while the servers load, the servers load at once,
a failure to load still fails start-up, and importing the module does no work a command
may not need.

The servers here are a small stdio MCP server written to tmp_path. Each one notes, in a
file beside it, the time it started and the time it was about to answer its own
``initialize``; a test compares those times with the moments the host got its answers.
Before a proxy starts, a ``<name>.mode`` file makes that server slow ("2" sleeps 2 s before
answering initialize) or fail ("1 fail": sleeps 1 s, writes a reason to stderr, exits 1).
The servers are pinned while they are still quick.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from process_helpers import PROXY, PYTHON, ProxyProcess, eventually

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402

SLOW = 2.0                       # seconds a slow server sleeps before answering initialize

SERVER = r'''
import json, os, sys, time
here, name = os.path.dirname(os.path.abspath(__file__)), sys.argv[1]

def note(what):
    with open(os.path.join(here, name + "." + what), "w") as f:
        f.write(repr(time.time()))

note("started")
delay, fail = 0.0, False
if os.path.exists(os.path.join(here, name + ".mode")):
    with open(os.path.join(here, name + ".mode")) as f:
        words = f.read().split()
    delay, fail = float(words[0]), "fail" in words
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method, answer = msg.get("method"), {"jsonrpc": "2.0", "id": msg["id"]}
    if method == "initialize":
        time.sleep(delay)
        if fail:
            sys.stderr.write(name + " cannot start\n")
            sys.exit(1)
        note("answered")
        answer["result"] = {"protocolVersion": msg["params"]["protocolVersion"],
                            "capabilities": {"tools": {}},
                            "serverInfo": {"name": name, "version": "1"}}
    elif method == "tools/list":
        answer["result"] = {"tools": [{"name": "echo", "description": "says hello",
                                       "inputSchema": {"type": "object"}}]}
    elif method == "tools/call":
        answer["result"] = {"content": [{"type": "text", "text": "hello from " + name}]}
    else:
        answer["error"] = {"code": -32601, "message": "method not found"}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
'''

RULES = {"echo": {"side_effect": "read_only", "timeout": "5s"}}
INITIALIZE = {"protocolVersion": "2025-06-18", "capabilities": {},
              "clientInfo": {"name": "host", "version": "1"}}


class StartupDir:
    """tmp_path with the server script, a configuration of the named servers, their pins."""

    def __init__(self, tmp, names):
        self.tmp = str(tmp)
        self.config = os.path.join(self.tmp, "proxy.json")
        self.procs: list[ProxyProcess] = []
        script = os.path.join(self.tmp, "server.py")
        with open(script, "w") as f:
            f.write(SERVER)
        servers = [{"name": n, "command": [PYTHON, script, n], "manifest": f"{n}.manifest.json",
                    "rules": RULES} for n in names]
        with open(self.config, "w") as f:
            json.dump({"database": "runs.db", "session": "boot", "hold": "0s",
                       "servers": servers}, f)
        os.chmod(self.config, 0o600)
        p = subprocess.run([PYTHON, PROXY, "pin", "-config", self.config], cwd=self.tmp,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, f"pin failed: {p.stdout}\n{p.stderr}"
        for n in names:                  # the pin's own notes are not this start-up's
            for what in ("started", "answered"):
                os.unlink(os.path.join(self.tmp, f"{n}.{what}"))

    def mode(self, name: str, text: str) -> None:
        with open(os.path.join(self.tmp, f"{name}.mode"), "w") as f:
            f.write(text)

    def noted(self, name: str, what: str) -> float | None:
        try:
            with open(os.path.join(self.tmp, f"{name}.{what}")) as f:
                return float(f.read())
        except (OSError, ValueError):
            return None

    def start(self) -> ProxyProcess:
        """The proxy, started; nothing sent to it yet."""
        p = ProxyProcess(self, "proxy")
        self.procs.append(p)
        return p


@pytest.fixture
def boot(tmp_path):
    made: list[StartupDir] = []

    def make(*names: str) -> StartupDir:
        made.append(StartupDir(tmp_path, names))
        return made[-1]
    yield make
    for d in made:
        for p in d.procs:
            p.kill()


def tool_names(answer: dict) -> list[str]:
    assert "result" in answer, answer
    return sorted(t["name"] for t in answer["result"]["tools"])


def test_initialize_is_answered_before_the_server_has_started(boot):
    d = boot("slow")
    d.mode("slow", f"{SLOW}")
    p = d.start()
    init = p.request("initialize", INITIALIZE, timeout=30)
    got_init = time.time()
    assert "result" in init, init
    assert init["result"]["serverInfo"]["name"] == "gated-tools"
    # The server has not yet answered its own initialize when the host has the proxy's.
    eventually(lambda: d.noted("slow", "started"), 30, "the server to start")
    assert d.noted("slow", "answered") is None, "the proxy answered only after its server"
    assert "result" in p.request("ping", timeout=5)
    p.notify("notifications/initialized")
    listed = p.request("tools/list", timeout=30)
    assert tool_names(listed) == ["gate_status", "slow_echo"]
    answered = d.noted("slow", "answered")
    assert answered is not None and got_init < answered
    p.stop()


def test_a_tools_list_sent_while_loading_is_answered_after_loading_with_the_tools(boot):
    """Sent at once, with a call behind it, and stdin closed: both are answered once the
    server is loaded, and the proxy then exits 0 as after any EOF."""
    d = boot("slow")
    d.mode("slow", f"{SLOW}")
    p = d.start()
    p.send("initialize", INITIALIZE, ident=1)
    p.send("tools/list", ident=2)
    p.send("tools/call", {"name": "slow_echo", "arguments": {}}, ident=3)
    p.close_stdin()
    assert "result" in p.answer(1, timeout=30)
    eventually(lambda: d.noted("slow", "started"), 30, "the server to start")
    assert d.noted("slow", "answered") is None, "the proxy answered only after its server"
    listed = p.answer(2, timeout=30)
    assert tool_names(listed) == ["gate_status", "slow_echo"]
    assert d.noted("slow", "answered") is not None
    called = p.answer(3, timeout=30)
    assert "result" in called, called
    assert "hello from slow" in json.dumps(called["result"])
    assert p.wait_exit(30) == 0, p.stderr()


def test_two_slow_servers_connect_at_once(boot):
    d = boot("a", "b")
    d.mode("a", f"{SLOW}")
    d.mode("b", f"{SLOW}")
    p = d.start()
    started = time.monotonic()
    assert "result" in p.request("initialize", INITIALIZE, timeout=30)
    listed = p.request("tools/list", timeout=30)
    took = time.monotonic() - started
    assert tool_names(listed) == ["a_echo", "b_echo", "gate_status"]
    # One after the other, b would start only once a had answered; and the two sleeps
    # alone would take 2 * SLOW.
    assert d.noted("b", "started") < d.noted("a", "answered")
    assert took < 2 * SLOW, f"start-up took {took:.2f} s, the sum of the two servers"
    p.stop()


def test_a_failing_server_fails_start_up_with_its_reason(boot):
    """b fails at once, a after a second: the error is a's, as when the servers loaded one
    after another; a request that waited for loading gets an error answer; exit 1."""
    d = boot("a", "b")
    d.mode("a", "1 fail")
    d.mode("b", "0 fail")
    p = d.start()
    assert "result" in p.request("initialize", INITIALIZE, timeout=30)
    waited = p.request("tools/list", timeout=30)
    assert waited["error"]["message"] == ap.START_FAILED, waited
    assert p.wait_exit(30) == 1
    err = p.stderr()
    assert "a cannot start" in err and "b cannot start" not in err, err
    assert "error: " in err and "server 'a'" in err.replace('"', "'"), err
    assert "serving session" not in err, err


def test_a_signal_while_loading_answers_what_waited_and_exits_0(boot):
    d = boot("slow")
    d.mode("slow", f"{SLOW * 5}")
    p = d.start()
    assert "result" in p.request("initialize", INITIALIZE, timeout=30)
    ident = p.send("tools/list")
    eventually(lambda: d.noted("slow", "started"), 30, "the server to start")
    os.kill(p.pid, signal.SIGTERM)
    stopped = p.answer(ident, timeout=30)
    assert stopped["error"]["message"] == ap.STOPPED_LOADING, stopped
    assert p.wait_exit(30) == 0, p.stderr()
    assert "stopped before serving" in p.stderr()
    assert d.noted("slow", "answered") is None


class _Served:
    """What HostServer needs of a proxy to answer tools/list."""

    def __init__(self):
        self.log = lambda line: None

    def listing(self) -> list:
        return [{"name": "t", "inputSchema": {"type": "object"}}]


def _line(ident, method: str, params=None) -> bytes:
    msg = {"jsonrpc": "2.0", "id": ident, "method": method}
    if params is not None:
        msg["params"] = params
    return json.dumps(msg).encode() + b"\n"


def test_requests_wait_in_order_boundedly_and_a_cancelled_one_is_dropped():
    out: list[bytes] = []
    host = ap.HostServer(None, out.append, lambda line: None)
    host.handle(_line(0, "initialize", INITIALIZE))
    assert [json.loads(o)["id"] for o in out] == [0]          # answered at once
    for i in range(1, ap.MAX_WAITING + 2):
        host.handle(_line(i, "tools/list"))
    refused = [json.loads(o) for o in out[1:]]
    assert [(r["id"], r["error"]["message"]) for r in refused] == \
        [(ap.MAX_WAITING + 1, ap.STILL_LOADING)]
    host.handle(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                            "params": {"requestId": 2}}).encode() + b"\n")
    del out[:]
    host.ready(_Served())
    answered = [json.loads(o) for o in out]
    assert [a["id"] for a in answered] == [1] + list(range(3, ap.MAX_WAITING + 1))
    assert all(a["result"]["tools"][0]["name"] == "t" for a in answered)


def test_requests_held_while_loading_are_bounded_in_bytes():
    out: list[bytes] = []
    host = ap.HostServer(None, out.append, lambda line: None)
    # Each call is a third of the bound: two are held, the third is refused at once.
    filler = "x" * (ap.MAX_WAITING_BYTES // 3)
    for i in range(3):
        host.handle(_line(i, "tools/call", {"name": "t", "arguments": {"note": filler}}))
    assert [(json.loads(o)["id"], json.loads(o)["error"]["message"]) for o in out] == \
        [(2, ap.STILL_LOADING)]
    assert [m.doc["id"] for m in host.waiting] == [ap.Num("0"), ap.Num("1")]


def test_import_leaves_http_client_and_fractions_unimported():
    p = subprocess.run([PYTHON, "-c", "import agentrt_proxy, sys; "
                        "print('http.client' in sys.modules, 'fractions' in sys.modules)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"], p.stdout
