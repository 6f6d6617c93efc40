"""A stdio server's process, as serve starts and ends it: started once, through
asyncio's own subprocesses after the module has imported everything; a server that cannot
be started, or a start refused before any server starts, reported in one error line; a
server that exits while connected reaped at once, and its process group killed in the turn
its exit is seen, never again at close."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time

import pytest

import agentrt_proxy as ap
from process_helpers import ProcessDir, proxy_command


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
