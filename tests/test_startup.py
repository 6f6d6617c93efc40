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
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from process_helpers import PYTHON, eventually

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402


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
