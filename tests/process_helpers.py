"""A host and an operator for tests that run the proxy as a real process (test_process.py).

    d = ProcessDir(tmp_path, allow_pay=True, lease_ttl="3s")   # writes proxy.json (0600), pins
    p = d.start()                       # the proxy on -config proxy.json (proxy_command), initialized
    r = p.call("bank_pay", {"to": "bob", "amount": 5})          # the CallToolResult dict
    ident = p.send_call(...); r = p.result(ident)               # a call left in flight
    p.stop()                            # close stdin; exit 0 within 30 s
    p.crash()                           # SIGKILL of that pid only
    d.payments(); d.release(); d.operator("-json", "runs")

Every read has a deadline. Processes are killed only by the pid this module started them
under (and, after a crash, the fake server the dead proxy left behind, by its own pid).
Not a test module: pytest collects nothing here.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import queue
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROXY = os.path.join(ROOT, "agentrt_proxy.py")
FAKE_SERVER = os.path.join(ROOT, "fake_payment_server.py")
PYTHON = sys.executable or "python3"

# The proxy runs as the README's module form, ``python3 -P -m agentrt_proxy`` with the
# checkout on PYTHONPATH, so that its compiled form is cached (under a directory of this
# test process, never in the checkout) instead of compiled again at each of the suite's
# many starts. Before Python 3.11 (no -P), and for a test that runs a copy of the file, it
# is the script form, as wrap writes it; tests/test_versions.py starts both forms itself.
MODULE_RUN = sys.version_info >= (3, 11)
_COMPILED = tempfile.mkdtemp(prefix="agentrt-proxy-pycache-")
atexit.register(shutil.rmtree, _COMPILED, True)


def proxy_command(program: str = PROXY, env: dict | None = None
                  ) -> tuple[list[str], dict | None]:
    """The argv that starts the proxy, and the environment to start it in: ``env`` (None:
    this process's own) with what the module form needs."""
    if not MODULE_RUN or program != PROXY:
        return [PYTHON, program], env
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=ROOT, PYTHONPYCACHEPREFIX=_COMPILED)
    return [PYTHON, "-S", "-P", "-m", "agentrt_proxy"], env


def patched_command(constants: dict, env: dict | None = None
                    ) -> tuple[list[str], dict | None]:
    """proxy_command's, with module constants set before main() runs (numbers, by name):
    a test that must tell one deadline from another gives the other far longer than any of
    its own waits, and judges an outcome instead of a time."""
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import agentrt_proxy as ap; "
            f"[setattr(ap, k, v) for k, v in {dict(constants)!r}.items()]; sys.exit(ap.main())")
    return [PYTHON, "-c", code, ROOT], env

# The CLI harness's rules (reference/proxy.md §17.1).
RULES = {
    "balance": {"side_effect": "read_only", "timeout": "5s"},
    "pay": {"side_effect": "remote_mutation", "timeout": "20s"},
    "refund": {"side_effect": "destructive", "timeout": "5s"},
}

# reference/proxy.md §16.3
EVENTS_ALLOWED = ["run.created", "run.started", "step.started", "step.decided", "step.policy",
                  "step.tool_started", "step.tool_finished", "run.finished"]
EVENTS_CRASH_INTERRUPTED_APPROVED = [
    "run.created", "run.started", "step.started", "step.decided", "step.policy",
    "step.tool_started", "lease.taken_over", "step.interrupted", "step.policy",
    "approval.requested", "approval.decided", "run.resumed", "step.policy",
    "step.tool_started", "step.tool_finished", "run.finished"]


def eventually(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll until predicate() is truthy; its value, or an AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def eventually_async(predicate, timeout: float, what: str, interval: float = 0.02):
    """eventually() inside an event loop: the loop keeps running while it waits."""
    import asyncio
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


def text(result: dict) -> str:
    return "".join(b.get("text", "") for b in result.get("content", []))


def is_error(result: dict) -> bool:
    return bool(result.get("isError"))


def prefix(result: dict) -> str:
    return text(result).split(":", 1)[0]


def parse_time(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def child_pids(pid: int) -> list[int]:
    """The direct children of pid (Linux /proc), [] when unknown."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class ProcessDir:
    """One temporary directory: the configuration, the manifest, the database, the ledger."""

    def __init__(self, tmp, allow_pay=False, rules=None, pin=True, server_env=(), **top):
        self.tmp = str(tmp)
        self.config = os.path.join(self.tmp, "proxy.json")
        self.db = os.path.join(self.tmp, "runs.db")
        self.ledger = os.path.join(self.tmp, "ledger")
        self.manifest = os.path.join(self.tmp, "bank.manifest.json")
        rules = json.loads(json.dumps(RULES if rules is None else rules))
        if allow_pay:
            rules["pay"]["outcome"] = "allow"
        self.server_env = list(server_env)       # more of the fake server's environment
        self.write_config(rules, **top)
        self.procs: list["ProxyProcess"] = []
        if pin:
            code, out, err = self.pin()
            assert code == 0, f"pin failed: {code}\n{out}\n{err}"

    def write_config(self, rules, **top) -> None:
        server = {"name": "bank", "command": [PYTHON, FAKE_SERVER],
                  "env": [f"FAKE_PAYMENTS_LEDGER={self.ledger}", *self.server_env],
                  "manifest": "bank.manifest.json", "rules": rules}
        doc = {"database": "runs.db", "session": "laptop", "hold": "0s", "servers": [server]}
        doc.update(top)
        with open(self.config, "w") as f:
            json.dump(doc, f, indent=2)
        os.chmod(self.config, 0o600)

    def run(self, *argv: str, timeout: float = 60) -> tuple[int, str, str]:
        """Run agentrt_proxy.py with argv to completion, stdin closed."""
        command, env = proxy_command()
        p = subprocess.run([*command, *argv], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout, cwd=self.tmp, env=env)
        return p.returncode, p.stdout, p.stderr

    def pin(self):
        return self.run("pin", "-config", self.config)

    def check(self):
        return self.run("check", "-config", self.config)

    def operator(self, *argv: str) -> tuple[int, str, str]:
        return self.run("-db", self.db, *argv)

    def operator_json(self, *argv: str):
        code, out, err = self.operator("-json", *argv)
        assert code == 0, f"operator {argv}: exit {code}\n{out}\n{err}"
        return json.loads(out)

    def runs(self) -> list[dict]:
        """Every run, oldest first."""
        return list(reversed(self.operator_json("runs", "-limit", "1000")["runs"]))

    def show(self, run_id: str) -> dict:
        return self.operator_json("show", run_id)

    def event_types(self, run_id: str) -> list[str]:
        doc = self.operator_json("events", run_id, "-limit", "1000")
        events = doc["events"] if isinstance(doc, dict) else doc
        return [e["type"] for e in events]

    def approve(self, run_id: str, approval_id: str) -> None:
        code, out, err = self.operator("approve", run_id, "-approval", approval_id,
                                       "-by", "operator")
        assert code == 0, f"approve: exit {code}\n{out}\n{err}"

    def reject(self, run_id: str, approval_id: str, note: str) -> None:
        code, out, err = self.operator("reject", run_id, "-approval", approval_id,
                                       "-by", "operator", "-note", note)
        assert code == 0, f"reject: exit {code}\n{out}\n{err}"

    # -- reading the database directly, read-only, for what the operator command does not
    #    print (a run's lease, an approval's capability) --

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def lease(self, run_id: str) -> tuple[str, str, float | None]:
        """(status, lease owner, lease expiry as a Unix time or None)."""
        status, owner, until = self.query(
            "SELECT status, lease_owner, lease_expires_at FROM runs WHERE id=?", (run_id,))[0]
        return status, owner, parse_time(until) if until else None

    def approvals(self) -> list[dict]:
        rows = self.query("SELECT id, run_id, step_id, kind, capability_json, status, note "
                          "FROM approvals ORDER BY created_at, rowid")
        return [{"id": r[0], "run_id": r[1], "step_id": r[2], "kind": r[3],
                 "capability": json.loads(r[4]) if r[4] else None, "status": r[5],
                 "note": r[6]} for r in rows]

    def pending(self) -> list[dict]:
        return [a for a in self.approvals() if a["status"] == "pending"]

    # -- the fake server's ledger --

    def payments(self) -> int:
        try:
            with open(self.ledger, "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def release(self) -> None:
        open(self.ledger + ".release", "w").close()

    # -- proxies --

    def start(self, name: str = "proxy") -> "ProxyProcess":
        p = ProxyProcess(self, name)
        self.procs.append(p)
        p.initialize()
        return p

    def cleanup(self) -> None:
        for p in self.procs:
            p.kill()


class ProxyProcess:
    """The proxy on -config <file> (proxy_command), spoken to as a host over its pipes."""

    def __init__(self, d: ProcessDir, name: str):
        self.d = d
        self.stderr_path = os.path.join(d.tmp, f"{name}-{len(d.procs)}.stderr")
        self.err_file = open(self.stderr_path, "wb")
        command, env = proxy_command(getattr(d, "program", PROXY))   # a test may run a copy
        self.proc = subprocess.Popen([*command, "-config", d.config],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err_file, cwd=d.tmp, env=env)
        self.pid = self.proc.pid
        self.messages: queue.Queue = queue.Queue()
        self.answers: dict = {}
        self.others: list[dict] = []
        self.raw_lines: list[bytes] = []
        self.next_id = 0
        self.lock = threading.Lock()
        self.orphans: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.raw_lines.append(line)
            try:
                msg = json.loads(line)
            except ValueError:
                msg = {"unparsable": line}
            self.messages.put(msg)
        self.messages.put(None)

    def _pump(self, deadline: float) -> bool:
        """Move one message from the reader into answers/others; False at EOF or deadline."""
        try:
            msg = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return False
        if msg is None:
            self.messages.put(None)
            return False
        if "id" in msg and "method" not in msg:
            self.answers[json.dumps(msg["id"])] = msg
        else:
            self.others.append(msg)
        return True

    def answer(self, ident, timeout: float = 30) -> dict:
        """The JSON-RPC answer to request ident, within timeout seconds."""
        key = json.dumps(ident)
        deadline = time.monotonic() + timeout
        while key not in self.answers:
            if not self._pump(deadline):
                if key in self.answers:
                    break
                raise AssertionError(
                    f"no answer to request {ident} within {timeout} s (exit code "
                    f"{self.proc.poll()}); stderr:\n{self.stderr()}")
        return self.answers.pop(key)

    def send_line(self, line: bytes) -> None:
        self.proc.stdin.write(line.rstrip(b"\n") + b"\n")
        self.proc.stdin.flush()

    def send(self, method: str, params=None, ident=None) -> int:
        with self.lock:
            if ident is None:
                self.next_id += 1
                ident = self.next_id
        msg = {"jsonrpc": "2.0", "id": ident, "method": method}
        if params is not None:
            msg["params"] = params
        self.send_line(json.dumps(msg).encode())
        return ident

    def request(self, method: str, params=None, timeout: float = 30) -> dict:
        return self.answer(self.send(method, params), timeout)

    def notify(self, method: str, params=None) -> None:
        msg = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self.send_line(json.dumps(msg).encode())

    def initialize(self, timeout: float = 60) -> dict:
        msg = self.request("initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "host", "version": "1"}}, timeout=timeout)
        assert "result" in msg, f"initialize failed: {msg}\n{self.stderr()}"
        self.notify("notifications/initialized")
        return msg["result"]

    def send_call(self, name: str, args) -> int:
        return self.send("tools/call", {"name": name, "arguments": args})

    def result(self, ident, timeout: float = 30) -> dict:
        msg = self.answer(ident, timeout)
        assert "error" not in msg, f"protocol error: {msg['error']}"
        return msg["result"]

    def call(self, name: str, args, timeout: float = 30) -> dict:
        return self.result(self.send_call(name, args), timeout)

    def stderr(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def stop(self, timeout: float = 30) -> None:
        """Close stdin; the proxy must exit 0 within timeout seconds."""
        self.close_stdin()
        code = self.wait_exit(timeout)
        assert code is not None, f"proxy {self.pid} did not exit within {timeout} s"
        assert code == 0, f"proxy exited {code}; stderr:\n{self.stderr()}"

    def crash(self) -> None:
        """SIGKILL of this pid only. The fake server it started is remembered, by pid, so
        that cleanup can end it if it outlives its parent's pipes."""
        self.orphans = [c for c in child_pids(self.pid) if b"fake_payment_server" in
                        _cmdline(c)]
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def kill(self) -> None:
        """Cleanup: end this process (by pid) if it still runs, and any fake server it left."""
        if self.proc.poll() is None:
            self.orphans += [c for c in child_pids(self.pid) if b"fake_payment_server" in
                             _cmdline(c)]
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.orphans:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and b"fake_payment_server" in _cmdline(pid):
                time.sleep(0.05)
            if b"fake_payment_server" in _cmdline(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.orphans = []
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.err_file.close()
