"""A walkthrough of agentrt_proxy with no model, no key and no network: a scripted host drives
the proxy in front of a fake payment server, and an operator decides from a second process.

    python demo.py           # about 10 seconds; exits non-zero if any step misbehaves
    python demo.py -keep     # keep the temporary directory to look at it afterwards

It shows: a read that runs; a payment that waits, is approved from another process and is
collected once; the same wait as an MCP task, which completes once the operator approves;
the proxy killed while a payment is inside the server, after which the same
call through the proxy started next reports the outcome unknown at once (the killed proxy's
lock on its holder file went with it) and waits for the operator, who rejects it; and a
host that lost a response and retries, which pays once through the proxy and twice without
it.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PROGRAM = "demo.py"
# The Python agentrt_proxy needs, checked first: an older one stops with one line saying what to
# use (the same line as agentrt_proxy.py's), not with a traceback.
if sys.version_info < (3, 9):
    sys.exit("%s needs Python 3.9 or newer; this is Python %s (%s). Get one: on macOS, "
             "/usr/bin/python3 from the Command Line Tools (xcode-select --install; update them "
             "if it is older than 3.9), Homebrew's python (brew install python), or the "
             "installer from https://www.python.org/downloads/"
             % (PROGRAM, sys.version.split()[0], sys.executable))

HERE = os.path.dirname(os.path.abspath(__file__))
PROXY = os.path.join(HERE, "agentrt_proxy.py")
SERVER = os.path.join(HERE, "fake_payment_server.py")
CALL_TIMEOUT = 60.0
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


class DemoFailure(Exception):
    """A step did not behave as the walkthrough says it does."""


class Host:
    """A scripted MCP host: starts a proxy, speaks newline-delimited JSON-RPC to it."""

    started: list[subprocess.Popen] = []

    def __init__(self, argv: list[str], env: dict | None = None, version: str = "2025-06-18"):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        Host.started.append(self.proc)
        self.next_id, self.buffer = 0, b""
        self.request("initialize", {"protocolVersion": version, "capabilities": {},
                                    "clientInfo": {"name": "scripted-host", "version": "1"}},
                     START_TIMEOUT)
        self.notify("notifications/initialized", {})

    def notify(self, method: str, params: dict) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": params})

    def send_request(self, method: str, params: dict) -> int:
        self.next_id += 1
        self._send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        return self.next_id

    def request(self, method: str, params: dict, timeout: float = CALL_TIMEOUT) -> dict:
        return self.answer(self.send_request(method, params), timeout)

    def _send(self, msg: dict) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def answer(self, ident: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("id") == ident and "method" not in msg:
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoFailure(f"no answer to request {ident} within {timeout:.0f}s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise DemoFailure("the proxy closed its output")
                self.buffer += chunk

    def call(self, tool: str, args: dict) -> tuple[str, bool]:
        print(f"  model calls {tool} {json.dumps(args)}")
        msg = self.request("tools/call", {"name": tool, "arguments": args})
        if "error" in msg:
            raise DemoFailure(f"protocol error: {msg['error']}")
        result = msg["result"]
        text = "".join(b.get("text", "") for b in result.get("content", []))
        error = bool(result.get("isError"))
        print(f"  model sees{' (isError)' if error else ''}: {text}")
        return text, error

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def crash(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def expect(text: str, *prefixes: str) -> None:
    if not any(text.startswith(p) for p in prefixes):
        raise DemoFailure(f"expected {' or '.join(prefixes)}, got: {text[:200]}")


class Demo:
    def __init__(self, tmp: str):
        self.tmp = tmp
        self.db = os.path.join(tmp, "runs.db")
        self.ledger = os.path.join(tmp, "ledger")
        self.config = os.path.join(tmp, "proxy.json")

    def payments(self) -> int:
        try:
            with open(self.ledger, "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def proxy(self, version: str = "2025-06-18") -> Host:
        return Host([sys.executable, PROXY, "-config", self.config], version=version)

    def operator(self, verb: str, note: str = "", *more: str) -> None:
        """A second process decides the one waiting approval, as the operator would: it
        lists what waits, then decides by the approval id (the one the model was shown)."""
        waiting = [a for a in json.loads(self.cli("-json", "pending"))["approvals"]
                   if a["status"] == "pending"]
        if not waiting:
            raise DemoFailure("nothing is waiting for an approval")
        print("  operator runs: python agentrt_proxy.py -db runs.db pending")
        first = self.cli("pending").strip().splitlines()[1]
        print("  operator sees: " + first)
        args = [verb, "-approval", waiting[0]["approval_id"], "-by", "demo-operator"]
        if note:
            args += ["-note", note]
        args += more
        print(f"  operator runs: python agentrt_proxy.py -db runs.db {shlex.join(args)}")
        out = self.cli(*args)
        print("  operator sees: " + out.strip().splitlines()[-1])

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, PROXY, "-db", self.db, *args],
                              capture_output=True, text=True, timeout=CALL_TIMEOUT)
        if done.returncode != 0:
            raise DemoFailure(f"operator command failed: {done.stderr.strip()}")
        return done.stdout

    def configure(self) -> None:
        print("0. Configure the proxy in front of a fake payment server, and pin its tools")
        doc = {"database": "runs.db", "session": "demo", "hold": "0s",
               "servers": [{"name": "bank", "command": [sys.executable, SERVER],
                            "env": [f"FAKE_PAYMENTS_LEDGER={self.ledger}"],
                            "manifest": "bank.manifest.json",
                            "rules": {"balance": {"side_effect": "read_only", "timeout": "5s"},
                                      "pay": {"side_effect": "remote_mutation",
                                              "timeout": "30s"}}}]}
        fd = os.open(self.config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"  {self.config}:")
        print("    " + json.dumps(doc, indent=2).replace("\n", "\n    "))
        done = subprocess.run([sys.executable, PROXY, "pin", "-config", self.config],
                              capture_output=True, text=True, timeout=CALL_TIMEOUT)
        if done.returncode != 0:
            raise DemoFailure(f"pin failed: {done.stderr.strip()}")
        print("  $ python agentrt_proxy.py pin -config proxy.json")
        print("    " + done.stdout.strip().replace("\n", "\n    "))

    def read(self) -> None:
        print("\n1. A read the policy allows runs and answers")
        host = self.proxy()
        text, _ = host.call("bank_balance", {"account": "household"})
        expect(text, "account household holds")
        host.stop()

    def approval(self) -> None:
        print("\n2. A payment waits for an operator, is approved from a second process, "
              "and is collected once")
        host = self.proxy()
        pay = {"to": "landlord", "amount": 950}
        text, _ = host.call("bank_pay", pay)
        expect(text, "PENDING_APPROVAL")
        print(f"  payments the server has made: {self.payments()}")
        self.operator("approve", "rent for October")
        text, _ = host.call("bank_pay", pay)
        expect(text, "paid 950.00 to landlord")
        print(f"  payments the server has made: {self.payments()}")
        host.stop()

    def task(self) -> None:
        print("\n3. A host that speaks MCP tasks (2025-11-25): the payment waits as a task, "
              "the operator approves from a second process, and the task completes")
        host = self.proxy("2025-11-25")
        pay = {"to": "electrician", "amount": 310}
        print(f"  host calls bank_pay {json.dumps(pay)} as a task")
        msg = host.request("tools/call", {"name": "bank_pay", "arguments": pay, "task": {}})
        if "error" in msg:
            raise DemoFailure(f"protocol error: {msg['error']}")
        task = msg["result"]["task"]
        print(f"  host is answered at once: task {task['taskId'][:12]}... {task['status']}")
        deadline = time.monotonic() + CALL_TIMEOUT
        while True:
            got = host.request("tasks/get", {"taskId": task["taskId"]})["result"]
            if "operator" in got.get("statusMessage", ""):
                break
            if time.monotonic() > deadline:
                raise DemoFailure(f"the task never waited for an operator: {got}")
            time.sleep(0.05)
        print(f"  host polls tasks/get: {got['status']}, {got['statusMessage']}")
        print(f"  payments the server has made: {self.payments()}")
        self.operator("approve", "the electrician's invoice")
        result = host.request("tasks/result", {"taskId": task["taskId"]})["result"]
        text = "".join(b.get("text", "") for b in result.get("content", []))
        print(f"  host's tasks/result: {text}")
        expect(text, "paid 310.00 to electrician")
        got = host.request("tasks/get", {"taskId": task["taskId"]})["result"]
        print(f"  host polls tasks/get: {got['status']}; payments the server has made: "
              f"{self.payments()}")
        if got["status"] != "completed":
            raise DemoFailure(f"the task did not complete: {got}")
        host.stop()

    def crash(self) -> None:
        print("\n4. The proxy is killed while a payment is inside the server; the outcome "
              "is unknown, and the operator decides")
        victim = self.proxy()
        pay = {"to": "plumber", "amount": 180, "mode": "block"}
        text, _ = victim.call("bank_pay", pay)
        expect(text, "PENDING_APPROVAL")
        self.operator("approve")
        before = self.payments()
        print(f"  model calls bank_pay {json.dumps(pay)}  (the server takes the payment and "
              "holds its answer)")
        victim.send_request("tools/call", {"name": "bank_pay", "arguments": pay})
        deadline = time.monotonic() + CALL_TIMEOUT
        while self.payments() == before:
            if time.monotonic() > deadline:
                raise DemoFailure("the payment never reached the server")
            time.sleep(0.02)
        print("  the server recorded the payment and has not answered; the proxy is killed "
              "with SIGKILL")
        victim.crash()
        print("  the host starts the proxy again; the killed proxy's lease has most of its 30s "
              "left, but its lock went with it, so the call is taken over at once")
        host = self.proxy()
        text, _ = host.call("bank_pay", pay)
        expect(text, "INTERRUPTED")
        host.call("gate_status", {})
        self.operator("reject", "the bank shows it went through", "-outcome", "executed")
        text, _ = host.call("bank_pay", pay)
        expect(text, "REJECTED")
        print(f"  payments the server has made: {self.payments()} (the cut-off one ran once; "
              "nothing ran again)")
        host.stop()

    def retry(self) -> tuple[int, int]:
        print("\n5. A host lost a response and retries the identical call")
        host = self.proxy()
        pay = {"to": "grocer", "amount": 42}
        text, _ = host.call("bank_pay", pay)
        expect(text, "PENDING_APPROVAL")
        self.operator("approve")
        before = self.payments()
        text, _ = host.call("bank_pay", pay)
        expect(text, "paid 42.00 to grocer")
        print("  the host never received that answer, and retries the same call")
        text, _ = host.call("bank_pay", pay)
        expect(text, "DUPLICATE")
        through = self.payments() - before
        host.stop()
        print(f"  payments through the proxy: {through}")
        print("  the same two calls straight to the server, without the proxy:")
        direct = Host([sys.executable, SERVER],
                      env={**os.environ, "FAKE_PAYMENTS_LEDGER": self.ledger})
        before = self.payments()
        for _ in range(2):
            direct.call("pay", pay)
        without = self.payments() - before
        direct.stop()
        print(f"  payments without the proxy: {without}")
        if (through, without) != (1, 2):
            raise DemoFailure(f"expected one payment through the proxy and two without it, "
                              f"got {through} and {without}")
        return through, without

    def run(self) -> None:
        self.configure()
        self.read()
        self.approval()
        self.task()
        self.crash()
        through, without = self.retry()
        print(f"\nDone: {through} payment through the proxy and {without} without it for the "
              "same retried call.")


def stop_everything() -> bool:
    for proc in Host.started:
        if proc.poll() is None:
            with_stdin = proc.stdin and not proc.stdin.closed
            if with_stdin:
                proc.stdin.close()
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return all(proc.poll() is not None for proc in Host.started)


def main(argv: list[str]) -> int:
    keep = "-keep" in argv or "--keep" in argv
    tmp = tempfile.mkdtemp(prefix="agentrt-proxy-demo-")
    status = 0
    try:
        Demo(tmp).run()
    except (DemoFailure, OSError, subprocess.SubprocessError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = 1
    finally:
        if stop_everything():
            print("Every process the demo started has exited.")
        else:
            print("error: a process the demo started is still running", file=sys.stderr)
            status = 1
        if keep:
            print(f"The demo's files are in {tmp}; read its record with:\n"
                  f"  python {PROXY} -db {os.path.join(tmp, 'runs.db')} runs")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
