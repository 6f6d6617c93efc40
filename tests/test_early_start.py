"""serve, run as the program, spawns its stdio servers before it imports asyncio and what
else serving needs (EarlyStart), so that the two overlap. Only a start that loading would
make anyway is made early, a server spawned early is the one loading connects, one it never
takes is killed, and a signal before the event loop runs ends the start cleanly.

The in-process tests run main() as the program does (RUN_AS_PROGRAM) with spawn_server and
_import_late recorded; the process tests run the real module form and read its stderr."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import agentrt_proxy as ap
from process_helpers import PROXY, ProcessDir, proxy_command


@pytest.fixture
def program(monkeypatch):
    """main() as run as the program: what was spawned and when the late imports came. The
    signal handlers EarlyStart installs are put back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    events: list[tuple] = []
    procs: list[subprocess.Popen] = []
    real_spawn, real_late = ap.spawn_server, ap._import_late

    def spawn(argv, env, cwd):
        events.append(("spawn", os.path.basename(argv[-1])))
        procs.append(real_spawn(argv, env, cwd))
        return procs[-1]

    def late():
        events.append(("late",))
        real_late()

    monkeypatch.setattr(ap, "RUN_AS_PROGRAM", True)
    monkeypatch.setattr(ap, "spawn_server", spawn)
    monkeypatch.setattr(ap, "_import_late", late)
    yield events, procs
    for proc in procs:                  # anything still running was started by this test
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def serve(config: str) -> tuple[int, str]:
    """main() on -config with the host's input already at its end: it starts, then stops."""
    err = io.StringIO()
    code = ap.main(["-config", config], stdin=io.BytesIO(b""), stdout=io.BytesIO(),
                   stderr=err)
    return code, err.getvalue()


def test_serve_spawns_its_servers_before_it_imports_asyncio(tmp_path, program):
    events, procs = program
    d = ProcessDir(tmp_path, allow_pay=True)
    code, err = serve(d.config)
    assert code == 0, err
    assert "serving session laptop" in err
    # spawned once, before the late imports: loading connected the server spawned early
    assert events == [("spawn", "fake_payment_server.py"), ("late",)]
    assert procs[0].poll() is not None          # and closed it when serving ended


def test_every_other_command_imports_at_once(tmp_path, program):
    events, _ = program
    d = ProcessDir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    assert ap.main(["check", "-config", d.config], stdout=out, stderr=err) == 0, err.getvalue()
    assert events[0] == ("late",)
    assert ap.main(["-db", d.db, "runs"], stdout=out, stderr=err) == 0, err.getvalue()
    assert events[-1] == ("late",)


def test_a_missing_manifest_spawns_nothing(tmp_path, program):
    events, _ = program
    d = ProcessDir(tmp_path, pin=False)
    code, err = serve(d.config)
    assert code == 1
    assert "bank.manifest.json does not exist" in err
    assert events == [("late",)]


def edit(d: ProcessDir, change) -> None:
    """Rewrite the configuration's one server entry with ``change``."""
    with open(d.config) as f:
        doc = json.load(f)
    change(doc["servers"][0])
    with open(d.config, "w") as f:
        json.dump(doc, f)


def test_rules_naming_an_unpinned_tool_spawn_nothing(tmp_path, program):
    events, _ = program
    d = ProcessDir(tmp_path)
    edit(d, lambda server: server["rules"].update(transfer={"side_effect": "read_only"}))
    code, err = serve(d.config)
    assert code == 1
    assert "rules name tools the manifest does not pin: transfer" in err
    assert events == [("late",)]


def test_a_server_reaching_the_database_spawns_nothing(tmp_path, program):
    events, _ = program
    d = ProcessDir(tmp_path)
    edit(d, lambda server: server["command"].append(d.db))
    code, err = serve(d.config)
    assert code == 1
    assert "runs.db" in err
    assert events == [("late",)]


def test_a_signal_before_the_event_loop_ends_the_start_cleanly(tmp_path, program,
                                                               monkeypatch):
    events, procs = program
    d = ProcessDir(tmp_path)
    noted = []
    # Were EarlyStart not to take SIGTERM, this handler would note it, and the start go on.
    signal.signal(signal.SIGTERM, lambda signum, frame: noted.append(signum))
    recorded_late = ap._import_late

    def late():
        os.kill(os.getpid(), signal.SIGTERM)       # while asyncio would be imported
        recorded_late()
    monkeypatch.setattr(ap, "_import_late", late)
    code, err = serve(d.config)
    assert noted == []
    assert code == 0, err
    assert "stopped before serving" in err
    assert "serving session" not in err
    assert [e[0] for e in events] == ["spawn", "late"]
    assert procs[0].poll() is not None          # the server spawned early was closed


def test_servers_loading_never_took_are_ended_and_reaped(tmp_path, program):
    _, procs = program
    d = ProcessDir(tmp_path)
    cfg = ap.load_config(d.config)
    early = ap.EarlyStart.begin(cfg)
    assert list(early.spawned) == ["bank"] and procs[0].poll() is None
    early.close_rest()
    assert early.spawned == {}
    # ended as a loaded server is: its input closed first, which this server exits on
    assert procs[0].returncode == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(procs[0].pid, 0)              # its process group is gone


def two_servers(d: ProcessDir, **second) -> ap.Config:
    """The configuration with a second server like the first (the same manifest)."""
    cfg = ap.load_config(d.config)
    with open(cfg.servers[0].manifest) as f:
        manifest = dict(json.load(f), server="bank2")
    path = os.path.join(d.tmp, "bank2.manifest.json")
    with open(path, "w") as f:
        json.dump(manifest, f)
    other = dataclasses.replace(cfg.servers[0], name="bank2", manifest=path, **second)
    return dataclasses.replace(cfg, servers=(*cfg.servers, other))


def test_a_server_that_cannot_even_be_tried_leaves_none_running(tmp_path, program):
    """A NUL in a server's environment fails the spawn before any process exists (not an
    UpstreamError): the servers spawned before it are ended, the handlers put back."""
    _, procs = program
    d = ProcessDir(tmp_path)
    cfg = two_servers(d, env=("X=a\x00b",))
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError):
        ap.EarlyStart.begin(cfg)
    assert len(procs) == 1 and procs[0].returncode is not None
    assert signal.getsignal(signal.SIGTERM) is handler


def test_a_signal_while_spawning_spawns_no_more(tmp_path, program, monkeypatch):
    events, procs = program
    d = ProcessDir(tmp_path)
    cfg = two_servers(d)
    recorded_spawn = ap.spawn_server

    def spawn(argv, env, cwd):
        proc = recorded_spawn(argv, env, cwd)
        os.kill(os.getpid(), signal.SIGTERM)
        return proc
    monkeypatch.setattr(ap, "spawn_server", spawn)
    early = ap.EarlyStart.begin(cfg)
    try:
        assert early.signalled and list(early.spawned) == ["bank"]
        assert events == [("spawn", "fake_payment_server.py")]
    finally:
        early.close_rest()


def test_a_server_that_cannot_be_spawned_is_reported_as_before(tmp_path, program):
    events, _ = program
    d = ProcessDir(tmp_path)
    edit(d, lambda server: server.update(command=[str(tmp_path / "no-such-server")]))
    code, err = serve(d.config)
    assert code == 1
    assert "cannot start" in err and "no-such-server" in err
    # tried early (and failed, leaving it to loading), then by loading, which reports it
    assert events == [("spawn", "no-such-server"), ("late",), ("spawn", "no-such-server")]


# -- the real program --

def run_program(d: ProcessDir, timeout: float = 60) -> subprocess.CompletedProcess:
    command, env = proxy_command()
    return subprocess.run([*command, "-config", d.config], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, cwd=d.tmp, env=env)


@pytest.mark.parametrize("case", ["missing manifest", "unpinned rule", "reach"])
def test_a_start_refused_before_the_spawn_says_so_in_one_line(tmp_path, case):
    """The module run refuses before asyncio is imported: one error line, no traceback."""
    d = ProcessDir(tmp_path, pin=(case != "missing manifest"))
    if case == "unpinned rule":
        edit(d, lambda server: server["rules"].update(transfer={"side_effect": "read_only"}))
    if case == "reach":
        edit(d, lambda server: server["command"].append(d.db))
    done = run_program(d)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("agentrt-proxy: error: ")], done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_program_serves_through_the_server_it_spawned_early(tmp_path):
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
        assert len(children) == 1                 # one server: spawned once
    finally:
        p.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_that_exits_while_connected_is_reaped_before_close(tmp_path):
    """The proxy adopts a Popen, so no child watcher reaps it: the reader does, at EOF."""
    import asyncio

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
    ap._import_late()
    assert asyncio.run(scenario()) is False      # no zombie left while still connected


LEAVES_A_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
open(sys.argv[1], "w").write(str(child.pid))
"""


@pytest.mark.skipif(not hasattr(os, "waitid"), reason="no waitid: reaped at close only")
def test_a_server_that_exits_has_its_group_ended_while_its_id_is_its_own(tmp_path,
                                                                        monkeypatch):
    """A server that exits while connected: what it left in its process group is killed at
    once, before it is reaped (its pid, the group's id, could be another's after that), and
    close() signals nothing afterwards."""
    import asyncio
    signalled, made = [], []
    real_killpg = os.killpg

    def killpg(pgid, sig):
        proc = made[0].proc
        signalled.append((pgid, proc.returncode if proc else "closed"))
        real_killpg(pgid, sig)
    monkeypatch.setattr(os, "killpg", killpg)
    marker = tmp_path / "child.pid"

    async def scenario():                        # made in the loop (Python 3.9's locks)
        upstream = ap.StdioUpstream("leaves", [sys.executable, "-c", LEAVES_A_CHILD,
                                               str(marker)], {})
        made.append(upstream)
        await upstream.start()
        pid = upstream.proc.pid
        deadline = time.monotonic() + 10
        while upstream.proc.returncode is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        child = int(marker.read_text())
        while _alive(child) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = _alive(child)
        await upstream.close()
        return pid, left
    ap._import_late()
    pid, left = asyncio.run(scenario())
    assert not left                               # the child was killed, before close()
    assert signalled == [(pid, None)]             # once, while unreaped; none at close


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


IGNORES_EOF = "import signal, time\nwhile True:\n    time.sleep(1)\n"


class RecordedInput:
    """A server's stdin whose close() is recorded in ``events``."""

    def __init__(self, stream, events: list, index: int):
        self.stream, self.events, self.index = stream, events, index

    def close(self) -> None:
        self.events.append(("eof", self.index))
        self.stream.close()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_servers_loading_never_took_are_ended_all_at_once(tmp_path, monkeypatch):
    """Four servers that go on after their input closes: each waits CLOSE_WAIT for it, then
    takes SIGTERM; together, not one after another. Judged by the order of what close_rest
    does, never by its time: the four inputs closed, then the waits, then the four SIGTERMs,
    with no wait between two closes nor between two signals."""
    monkeypatch.setattr(ap, "CLOSE_WAIT", 1.0)
    early = ap.EarlyStart()
    for i in range(4):
        early.spawned[f"s{i}"] = ap.spawn_server([sys.executable, "-c", IGNORES_EOF],
                                                 dict(os.environ), None)
    procs = list(early.spawned.values())
    events: list = []
    for i, p in enumerate(procs):
        p.stdin = RecordedInput(p.stdin, events, i)
    pids = {p.pid: i for i, p in enumerate(procs)}
    kill, sleep = os.kill, time.sleep

    def recorded_kill(pid, sig):
        if pid in pids:
            events.append((signal.Signals(sig).name, pids[pid]))
        kill(pid, sig)

    def recorded_sleep(seconds):
        if not events or events[-1] != ("wait",):
            events.append(("wait",))
        sleep(seconds)
    monkeypatch.setattr(os, "kill", recorded_kill)
    monkeypatch.setattr(time, "sleep", recorded_sleep)
    early.close_rest()
    monkeypatch.undo()
    assert [p.returncode for p in procs] == [-signal.SIGTERM] * 4
    together = [("eof", i) for i in range(4)] + [("wait",)] + \
        [("SIGTERM", i) for i in range(4)]
    assert events[:len(together)] == together, events


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



# -- the command line every host configuration gives, read without argparse --

SERVE_LINES = [["-config", "proxy.json"], ["--config", "proxy.json"],
               ["serve", "-config", "proxy.json"], ["serve", "--config", "p.json"],
               ["-config", "serve"]]
OTHER_LINES = [["-config", "-db"], ["-config", ""], ["-config=proxy.json"],
               ["-config", "p.json", "-json"], ["pin", "-config", "p.json"],
               ["serve", "-config"], ["-db", "runs.db", "runs"], ["serve"], [],
               ["-json", "-config", "p.json"], ["serve", "serve", "-config", "p.json"],
               ["--config", "p.json", "serve"]]


@pytest.mark.parametrize("argv", SERVE_LINES, ids=" ".join)
def test_the_serve_line_is_read_as_argparse_reads_it(argv):
    fast = ap._serve_args(argv)
    full = ap.build_parser().parse_args(argv)
    if not full.command and full.config and not full.db:
        full.command = "serve"                  # main's default command
    assert fast is not None
    assert vars(fast) == vars(full)


@pytest.mark.parametrize("argv", OTHER_LINES, ids=lambda a: " ".join(a) or "(none)")
def test_every_other_line_is_left_to_argparse(argv):
    assert ap._serve_args(argv) is None


def test_serve_spawns_before_argparse_or_typing_is_imported(tmp_path):
    """The real module run, its imports traced: the server starts before either."""
    d = ProcessDir(tmp_path)
    command, env = proxy_command()
    env = dict(os.environ if env is None else env, PYTHONPROFILEIMPORTTIME="1")
    done = subprocess.run([*command, "-config", d.config],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60, cwd=d.tmp, env=env)
    assert done.returncode == 0, done.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")]
    # asyncio is imported after the spawn (EarlyStart); argparse never, and typing, if at
    # all, inside asyncio's import (listed among its modules, which come before it)
    assert "argparse" not in imported and "asyncio" in imported
    first_late = next(i for i, name in enumerate(imported) if name.startswith("asyncio"))
    assert "typing" not in imported[:first_late], imported[:first_late]


TRACE = '''
import os, runpy, sys
seen, done = {}, []
def watch(frame, event, arg):
    if event == "call" and not done:
        if frame.f_code.co_name == "_import_late":
            done.append(1)
        elif frame.f_code.co_filename.endswith("agentrt_proxy.py"):
            seen[frame.f_code.co_name, frame.f_code.co_firstlineno] = frame.f_code
sys.setprofile(watch)
sys.argv = [os.environ["PROXY"], *sys.argv[1:]]
try:
    runpy.run_path(os.environ["PROXY"], run_name="__main__")
except SystemExit:
    pass
sys.setprofile(None)
late = set(os.environ["LATE_NAMES"].split(","))
for (name, line), code in seen.items():
    used = (set(code.co_names) & late) - set(code.co_varnames)
    if used:
        print(f"{name}:{line}:{','.join(sorted(used))}")
'''
# Names bound only by _import_late (or only for type checkers), and the functions that use
# one right after calling it.
LATE_NAMES = ("asyncio base64 copy ipaddress queue secrets select socket sqlite3 tempfile "
              "urllib _TIMEOUT SOCKET_TIMEOUTS argparse Any AsyncIterator Awaitable Callable "
              "Iterable").split()
CALLS_IT_FIRST = {"<module>", "run_proxy_command", "_serve"}


def test_nothing_run_before_the_late_imports_uses_them(tmp_path):
    """The real program's start, every function of the module traced until _import_late:
    none of them names what it imports. The configuration reaches the branches that import
    on their own (a $ref with an escape, a file: URL among a server's arguments)."""
    d = ProcessDir(tmp_path, allow_pay=True)

    def change(server):
        server["rules"]["pay"]["when"] = [{
            "if": {"$defs": {"big": {"type": "number", "minimum": 8}},
                   "properties": {"amount": {"$ref": "#/$defs/bi%67"}}, "required": ["amount"]},
            "outcome": "require_approval", "why": "a large payment"}]
        server["command"] += ["file:///nonexistent/data", "--name=host:1"]
    edit(d, change)
    script = tmp_path / "trace.py"
    script.write_text(TRACE)
    env = dict(os.environ, LATE_NAMES=",".join(LATE_NAMES), PROXY=PROXY)
    done = subprocess.run([sys.executable, "-S", str(script), "-config", d.config],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60, cwd=d.tmp, env=env)
    assert "serving session" in done.stderr, done.stderr
    found = [line for line in done.stdout.splitlines()
             if line.split(":")[0] not in CALLS_IT_FIRST]
    assert found == [], found
