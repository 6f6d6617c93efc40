"""A stdio server's process, as serve starts and ends it: started once, through
asyncio's own subprocesses after the module has imported everything; a server that cannot
be started, or a start refused before any server starts, reported in one error line; a
server that exits while connected reaped at once, and its process group killed in the turn
its exit is seen, never again at close.

- The database, when it exists, is opened on a worker thread while the servers load; one
  that does not exist is created only after they have loaded, so a start whose servers fail
  creates none. A failed load closes a store opened beside it and its error comes first
  (also over a store that failed to open); a stop while loading closes the store; a store
  that fails to open closes the servers loaded beside it.
- A server does not outlive the proxy: killed with SIGKILL, the proxy's servers die with it
  (the parent-death signal, on Linux)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import agentrt_proxy as ap
from process_helpers import PYTHON, ROOT, ProcessDir, eventually, proxy_command


def edit(d: ProcessDir, change) -> None:
    """Rewrite the configuration's one server entry with ``change``."""
    with open(d.config) as f:
        doc = json.load(f)
    change(doc["servers"][0])
    with open(d.config, "w") as f:
        json.dump(doc, f)


def run_program(d: ProcessDir, timeout: float = 60) -> subprocess.CompletedProcess:
    command, env = proxy_command()
    return subprocess.run([*command, "-config", d.config], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, cwd=d.tmp, env=env)


@pytest.mark.parametrize("case", ["missing manifest", "unpinned rule", "reach"])
def test_a_start_refused_before_any_server_starts_says_so_in_one_line(tmp_path, case):
    d = ProcessDir(tmp_path, pin=(case != "missing manifest"))
    if case == "unpinned rule":
        edit(d, lambda server: server["rules"].update(transfer={"side_effect": "read_only"}))
    if case == "reach":
        edit(d, lambda server: server["command"].append(d.db))
    done = run_program(d)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines()
            if line.startswith("agentrt-proxy: error: ")], done.stderr


def test_a_server_that_cannot_be_started_is_reported(tmp_path):
    d = ProcessDir(tmp_path)
    edit(d, lambda server: server.update(command=[str(tmp_path / "no-such-server")]))
    err = io.StringIO()
    code = ap.main(["-config", d.config], stdin=io.BytesIO(b""), stdout=io.BytesIO(),
                   stderr=err)
    assert code == 1
    assert "cannot start" in err.getvalue() and "no-such-server" in err.getvalue()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_program_serves_through_one_server_process(tmp_path):
    d = ProcessDir(tmp_path, allow_pay=True)
    p = d.start()
    try:
        r = p.call("bank_balance", {"account": "alice"})
        assert not r.get("isError"), r
        started = time.monotonic()
        children = []
        while not children and time.monotonic() - started < 10:
            children = _children(p.pid)
            time.sleep(0.05)
        assert len(children) == 1                 # one server: started once
    finally:
        p.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_that_exits_while_connected_is_reaped_before_close(tmp_path):
    async def scenario():
        upstream = ap.StdioUpstream("gone", [sys.executable, "-c", "pass"], {})
        await upstream.start()
        pid = upstream.proc.pid
        try:
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return os.path.exists(f"/proc/{pid}")
        finally:
            await upstream.close()
    assert asyncio.run(scenario()) is False      # no zombie left while still connected


LEAVES_A_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
open(sys.argv[1], "w").write(str(child.pid))
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_that_exits_has_its_group_ended_at_once_and_never_at_close(tmp_path,
                                                                            monkeypatch):
    """A server that exits while connected, leaving a child in its process group (which
    holds no pipe of its): the child is killed before close() is called, and close()
    signals the group no more. The child's pid written only once it runs."""
    signalled, closing = [], []
    real_killpg = os.killpg

    def killpg(pgid, sig):
        signalled.append((pgid, bool(closing)))
        real_killpg(pgid, sig)
    monkeypatch.setattr(os, "killpg", killpg)
    marker = tmp_path / "child.pid"

    async def scenario():
        upstream = ap.StdioUpstream("leaves", [sys.executable, "-c", LEAVES_A_CHILD,
                                               str(marker)], {})
        await upstream.start()
        pid = upstream.proc.pid
        deadline = time.monotonic() + 10
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "the server never started its child"
            await asyncio.sleep(0.02)
        child = int(marker.read_text())
        while _alive(child) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = _alive(child)
        closing.append(True)
        await upstream.close()
        return pid, left
    pid, left = asyncio.run(scenario())
    assert not left                               # the child was killed, before close()
    assert signalled == [(pid, False)]            # once, at the exit; none at close


# A server that outlives its stdin closing: close() waits on it (CLOSE_WAIT) before SIGTERM.
IGNORES_EOF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def test_a_close_cancelled_while_it_waits_still_closes_the_transport():
    """A close cancelled in its wait for the server's exit (a load cancelled as it closes
    its failed server, say) still closes the transport: the server is killed, and no
    transport is left for the garbage collector to find unclosed after its loop is gone."""
    async def scenario():
        upstream = ap.StdioUpstream("stays", [sys.executable, "-c", IGNORES_EOF], {})
        await upstream.start()
        transport, proc = upstream._transport, upstream.proc
        closing = asyncio.create_task(upstream.close())
        await asyncio.sleep(0.2)                   # inside the wait after stdin closes
        assert not closing.done()
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        code = await asyncio.wait_for(proc.wait(), 10)
        return transport.is_closing(), code, upstream.proc
    closed, code, proc_left = asyncio.run(scenario())
    assert closed
    assert code == -9                              # killed by the transport's close
    assert proc_left is None                       # a later close() has nothing to do


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

    async def take_over_gone(self) -> None:
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
        monkeypatch.setattr(ap, "check_database_file", lambda path, writer: None)
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
