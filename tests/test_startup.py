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

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from process_helpers import PROXY, PYTHON, ProxyProcess, eventually

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402

# A held server answers initialize only once the test releases it (<name>.release), so that
# what is judged is an order, never a time.
HOLD = "hold"

SERVER = r'''
import json, os, sys, time
here, name = os.path.dirname(os.path.abspath(__file__)), sys.argv[1]

def note(what):
    with open(os.path.join(here, name + "." + what), "w") as f:
        f.write(repr(time.time()))

note("started")
delay, fail, hold = 0.0, False, False
if os.path.exists(os.path.join(here, name + ".mode")):
    with open(os.path.join(here, name + ".mode")) as f:
        words = f.read().split()
    hold = words[0] == "hold"
    delay, fail = 0.0 if hold else float(words[0]), "fail" in words
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method, answer = msg.get("method"), {"jsonrpc": "2.0", "id": msg["id"]}
    if method == "initialize":
        time.sleep(delay)
        while hold and not os.path.exists(os.path.join(here, name + ".release")):
            time.sleep(0.02)
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

    def release(self, name: str) -> None:
        """Let a held server answer initialize."""
        open(os.path.join(self.tmp, f"{name}.release"), "w").close()

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
    d.mode("slow", HOLD)
    p = d.start()
    init = p.request("initialize", INITIALIZE, timeout=30)
    got_init = time.time()
    assert "result" in init, init
    assert init["result"]["serverInfo"]["name"] == "gated-tools"
    # The server has not yet answered its own initialize when the host has the proxy's.
    eventually(lambda: d.noted("slow", "started"), 30, "the server to start")
    assert d.noted("slow", "answered") is None, "the proxy answered only after its server"
    assert "result" in p.request("ping", timeout=30)
    p.notify("notifications/initialized")
    d.release("slow")
    listed = p.request("tools/list", timeout=30)
    assert tool_names(listed) == ["gate_status", "slow_echo"]
    answered = d.noted("slow", "answered")
    assert answered is not None and got_init < answered
    p.stop()


def test_a_tools_list_sent_while_loading_is_answered_after_loading_with_the_tools(boot):
    """Sent at once, with a call behind it, and stdin closed: both are answered once the
    server is loaded, and the proxy then exits 0 as after any EOF."""
    d = boot("slow")
    d.mode("slow", HOLD)
    p = d.start()
    p.send("initialize", INITIALIZE, ident=1)
    p.send("tools/list", ident=2)
    p.send("tools/call", {"name": "slow_echo", "arguments": {}}, ident=3)
    p.close_stdin()
    assert "result" in p.answer(1, timeout=30)
    eventually(lambda: d.noted("slow", "started"), 30, "the server to start")
    assert d.noted("slow", "answered") is None, "the proxy answered only after its server"
    d.release("slow")
    listed = p.answer(2, timeout=30)
    assert tool_names(listed) == ["gate_status", "slow_echo"]
    assert d.noted("slow", "answered") is not None
    called = p.answer(3, timeout=30)
    assert "result" in called, called
    assert "hello from slow" in json.dumps(called["result"])
    assert p.wait_exit(30) == 0, p.stderr()


def test_two_slow_servers_connect_at_once(boot):
    d = boot("a", "b")
    d.mode("a", HOLD)
    d.mode("b", HOLD)
    p = d.start()
    assert "result" in p.request("initialize", INITIALIZE, timeout=30)
    eventually(lambda: d.noted("a", "started") and d.noted("b", "started"), 30,
               "both servers to start while a is held")
    d.release("a")
    d.release("b")
    listed = p.request("tools/list", timeout=30)
    assert tool_names(listed) == ["a_echo", "b_echo", "gate_status"]
    # One after the other, b would start only once a had answered.
    assert d.noted("b", "started") < d.noted("a", "answered")
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
    d.mode("slow", HOLD)
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


def test_import_leaves_http_client_and_fractions_unimported():
    p = subprocess.run([PYTHON, "-c", "import agentrt_proxy, sys; "
                        "print('http.client' in sys.modules, 'fractions' in sys.modules)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"], p.stdout


# -- the store opened while the servers load --

_REAL_OPEN = ap.Store.open


class _FakeStore:
    def __init__(self, path: str):
        self.path, self.closed = path, False

    def close(self) -> None:
        self.closed = True


class _FakeProxy:
    """The Proxy a start builds: the store it was given, and its start-up take-over."""

    def __init__(self, store):
        self.store, self.took_over = store, 0

    def take_over_gone(self) -> None:
        self.took_over += 1


class _Start:
    """_start_serving with load_tools, Store.open, close_tools and Proxy replaced: what
    each was asked, on which thread, and in what order."""

    def __init__(self, monkeypatch, tmp_path, exists=True, load=None, store_fails=None):
        self.database = str(tmp_path / "runs.db")
        if exists:
            ap.Store.open(self.database).close()
        self.opened = threading.Event()
        self.stores: list[_FakeStore] = []
        self.open_threads: list[int] = []
        self.closed_tools: list = []
        self.loaded_after_open: bool | None = None

        def store_open(path):
            self.open_threads.append(threading.get_ident())
            if store_fails:
                self.opened.set()
                raise store_fails
            self.stores.append(_FakeStore(path))
            self.opened.set()
            return self.stores[-1]

        async def default_load(cfg, emit, early=None):
            self.loaded_after_open = await self.until_opened()
            return ["tool"], []

        async def close_tools(tools):
            self.closed_tools.append(tools)

        monkeypatch.setattr(ap.Store, "open", staticmethod(store_open))
        monkeypatch.setattr(ap, "load_tools", load or default_load)
        monkeypatch.setattr(ap, "close_tools", close_tools)
        monkeypatch.setattr(ap, "Proxy", lambda cfg, store, tools, log: _FakeProxy(store))
        monkeypatch.setattr(ap, "check_database_owner", lambda path: None)
        self.cfg = type("Cfg", (), {"database": self.database})()
        self.out = type("Out", (), {"log": staticmethod(lambda line: None)})()

    async def until_opened(self, seconds=5.0) -> bool:
        """Whether Store.open was called within ``seconds`` (while the caller waits)."""
        deadline = time.monotonic() + seconds
        while not self.opened.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.opened.is_set()

    def run(self, stop_at_once=False):
        async def go():
            stop = asyncio.Event()
            if stop_at_once:
                stop.set()
            return await ap._start_serving(self.cfg, self.out, stop)
        return asyncio.run(go())


def test_an_existing_database_is_opened_on_a_worker_while_the_servers_load(monkeypatch,
                                                                           tmp_path):
    s = _Start(monkeypatch, tmp_path)
    tools, store, proxy = s.run()
    assert s.loaded_after_open is True, "the store was opened only after the servers loaded"
    assert s.open_threads != [threading.get_ident()]
    assert tools == ["tool"] and store is s.stores[0] and proxy.store is store
    assert proxy.took_over == 1
    assert not store.closed and s.closed_tools == []


def test_a_database_that_does_not_exist_is_created_only_after_the_servers_load(
        monkeypatch, tmp_path):
    order: list[str] = []

    async def load(cfg, emit, early=None):
        await asyncio.sleep(0.3)             # room for an open beside it, were there one
        order.append("loaded")
        return ["tool"], []
    s = _Start(monkeypatch, tmp_path, exists=False, load=load)
    monkeypatch.setattr(ap.Store, "open", staticmethod(
        lambda path: (order.append("opened"), _REAL_OPEN(path))[1]))
    s.run()
    assert order == ["loaded", "opened"]


def test_a_start_whose_servers_fail_creates_no_database(monkeypatch, tmp_path):
    async def load(cfg, emit, early=None):
        raise ap.MCPError("mcp: server 'a': cannot start")
    s = _Start(monkeypatch, tmp_path, exists=False, load=load)
    monkeypatch.setattr(ap.Store, "open", staticmethod(_REAL_OPEN))
    with pytest.raises(ap.MCPError, match="cannot start"):
        s.run()
    assert not os.path.lexists(s.database)


def test_a_failed_load_closes_the_store_opened_beside_it_and_its_error_comes_first(
        monkeypatch, tmp_path):
    async def load(cfg, emit, early=None):
        assert await s.until_opened()
        raise ap.MCPError("mcp: server 'a': cannot start")
    s = _Start(monkeypatch, tmp_path, load=load)
    with pytest.raises(ap.MCPError, match="cannot start"):
        s.run()
    assert [st.closed for st in s.stores] == [True]


def test_a_failed_load_is_reported_over_a_store_that_failed_to_open(monkeypatch, tmp_path):
    async def load(cfg, emit, early=None):
        assert await s.until_opened()
        raise ap.MCPError("mcp: server 'a': cannot start")
    s = _Start(monkeypatch, tmp_path, load=load,
               store_fails=ap.StoreError("runs.db: cannot open the database"))
    with pytest.raises(ap.MCPError, match="cannot start"):
        s.run()


def test_a_stop_while_loading_closes_the_store_opened_beside_it(monkeypatch, tmp_path):
    async def load(cfg, emit, early=None):
        await asyncio.sleep(30)
    s = _Start(monkeypatch, tmp_path, load=load)
    assert s.run(stop_at_once=True) is None
    assert [st.closed for st in s.stores] == [True]


def test_a_store_that_fails_to_open_closes_the_servers_loaded_beside_it(monkeypatch,
                                                                       tmp_path):
    s = _Start(monkeypatch, tmp_path,
               store_fails=ap.StoreError("runs.db: cannot open the database"))
    with pytest.raises(ap.StoreError, match="cannot open"):
        s.run()
    assert s.closed_tools == [["tool"]]


# -- a server does not outlive the proxy --

CHILD_OF_A_KILLED_PROXY = r'''
import asyncio, sys
sys.path.insert(0, sys.argv[1])
import agentrt_proxy as ap

async def main():
    up = ap.StdioUpstream("s", [sys.executable, "-c", "import time; time.sleep(120)"], {})
    await up.start()
    print(up.proc.pid, flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
'''


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_is_killed_when_the_proxy_is_killed(tmp_path):
    """The process that started the server is killed with SIGKILL (nothing of it runs to
    close anything): the server dies with it, by the parent-death signal set in the child
    between fork and exec."""
    script = tmp_path / "proxy_stand_in.py"
    script.write_text(CHILD_OF_A_KILLED_PROXY)
    parent = subprocess.Popen([PYTHON, str(script), ROOT], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL)
    child = 0
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child)
        parent.kill()
        parent.wait(timeout=30)
        eventually(lambda: _gone(child), 10, "the server to die with the proxy")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if child and not _gone(child):       # the server this test started, by its pid
            os.kill(child, signal.SIGKILL)
