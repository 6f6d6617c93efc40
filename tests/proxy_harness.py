"""An in-process proxy for tests: the real fake payment server over stdio, the real store,
the real host-facing server fed with raw JSON-RPC lines, and a clock the test can move.

    h = ProxyHarness(tmp_path)                 # pins and loads; hold 0s
    h = ProxyHarness(tmp_path, names=("bank", "bank2"))    # two servers, one ledger
    h = ProxyHarness(tmp_path, hold="20s", rules={"pay": {"side_effect": "remote_mutation",
                                                          "timeout": "10s", "outcome": "allow"}})
    r = h.call("bank_pay", {"to": "bob", "amount": 25})     # the CallToolResult dict
    h.text(r), h.is_error(r), h.prefix(r)
    h.payments()                                # lines in the fake server's ledger
    h.pending()                                 # pending approvals, oldest run first
    h.decide(approval, approve=True, note="")   # as the operator, bound to the hash read
    h.clock.skew += 660                         # move the proxy's clock
    h.close()

Not a test module: pytest collects nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import agentrt_proxy as ap  # noqa: E402

FAKE_SERVER = os.path.join(ROOT, "fake_payment_server.py")
DEFAULT_RULES = {
    "balance": {"side_effect": "read_only", "timeout": "10s"},
    "pay": {"side_effect": "remote_mutation", "timeout": "10s"},
    "refund": {"side_effect": "destructive", "timeout": "10s"},
}


class SkewClock:
    """The wall clock plus an offset the test moves; leases keep the real wall clock."""

    def __init__(self):
        self.skew = 0.0

    def __call__(self):
        return ap.time.time() + self.skew


def write_config(tmp, rules=None, server_env=None, names=("bank",), command=None,
                 **top) -> str:
    """A configuration file (0600) for servers named ``names`` (one, `bank`, unless told),
    each the fake payment server (or the stdio server ``command``) with the same rules, all
    writing one ledger."""
    env = [f"FAKE_PAYMENTS_LEDGER={tmp}/ledger"] + list(server_env or [])
    servers = [{"name": name, "command": command or [sys.executable, FAKE_SERVER], "env": env,
                "manifest": f"{name}.manifest.json",
                "rules": DEFAULT_RULES if rules is None else rules} for name in names]
    doc = {"database": "runs.db", "session": "test", "hold": "0s", "servers": servers}
    doc.update(top)
    path = os.path.join(str(tmp), "proxy.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    os.chmod(path, 0o600)
    return path


def harness_loop() -> asyncio.AbstractEventLoop:
    """A new event loop, made the current one: on Python 3.9 an asyncio Event or Lock made
    outside a running loop (the Proxy's, built in a harness's __init__) binds to the current
    loop, and there is none once an earlier test's asyncio.run has ended."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop


class ProxyHarness:
    def __init__(self, tmp, rules=None, server_env=None, pin=True, poll=0.02, names=("bank",),
                 command=None, **top):
        self.tmp = str(tmp)
        self.config_path = write_config(self.tmp, rules, server_env, names, command, **top)
        self.loop = harness_loop()
        self.clock = SkewClock()
        self.log_lines: list[str] = []
        self.out: list[bytes] = []
        self.cfg = ap.load_config(self.config_path)
        if pin:
            self.pin()
        self.tools, self.reports = self.run(ap.load_tools(self.cfg))
        self.store = ap.Store.open(self.cfg.database)
        self.proxy = ap.Proxy(self.cfg, self.store, self.tools, self.log_lines.append,
                              clock=self.clock, poll=poll)
        self.host = ap.HostServer(self.proxy, self.out.append)
        self.next_id = 0

    def run(self, coro, timeout=60):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def pin(self):
        for server in self.cfg.servers:
            manifest = self.run(ap.pin_server(server, ap.time.time()))
            ap.write_manifest(server.manifest, manifest)

    # -- the host side --

    def send(self, line: bytes) -> None:
        """Hand the host-facing server one raw line (it answers into self.out)."""
        async def handle():
            self.host.handle(line)
        self.run(handle())

    def request(self, method: str, params=None, raw_params: bytes | None = None,
                wait=True, timeout=60):
        """Send a request; with ``wait`` run the loop until its answer is written."""
        self.next_id += 1
        ident = self.next_id
        params_text = raw_params if raw_params is not None else \
            json.dumps(params if params is not None else {}).encode()
        line = b'{"jsonrpc":"2.0","id":%d,"method":%s,"params":%s}' % (
            ident, json.dumps(method).encode(), params_text)
        self.send(line)
        if not wait:
            return ident
        return self.answer(ident, timeout)

    def answer(self, ident, timeout=60):
        async def until():
            while True:
                for raw in self.out:
                    msg = json.loads(raw)
                    if msg.get("id") == ident and "method" not in msg:
                        return msg
                await asyncio.sleep(0.005)
        return self.run(until(), timeout)

    def call(self, name: str, args=None, raw_args: bytes | None = None, meta=None,
             timeout=60) -> dict:
        """tools/call; returns the CallToolResult (fails the test on a protocol error)."""
        if raw_args is None:
            raw_args = json.dumps({} if args is None else args).encode()
        params = b'{"name":%s,"arguments":%s%s}' % (
            json.dumps(name).encode(), raw_args,
            b',"_meta":' + json.dumps(meta).encode() if meta is not None else b"")
        msg = self.request("tools/call", raw_params=params, timeout=timeout)
        if "error" in msg:
            raise AssertionError(f"protocol error: {msg['error']}")
        return msg["result"]

    def notifications(self, method: str) -> list[dict]:
        return [m for m in map(json.loads, self.out) if m.get("method") == method]

    @staticmethod
    def text(result: dict) -> str:
        return "".join(b.get("text", "") for b in result.get("content", []))

    @staticmethod
    def is_error(result: dict) -> bool:
        return bool(result.get("isError"))

    def prefix(self, result: dict) -> str:
        return self.text(result).split(":", 1)[0]

    # -- the operator side and the record --

    def payments(self) -> int:
        try:
            with open(os.path.join(self.tmp, "ledger"), "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def release(self) -> None:
        """Let a `block` payment inside the server answer."""
        open(os.path.join(self.tmp, "ledger.release"), "w").close()

    def runs(self) -> list:
        runs, _ = self.store.list_runs(0)
        return list(reversed(runs))

    def pending(self) -> list:
        return [a for r in self.runs() for a in self.store.list_approvals(r.id)
                if a.status == ap.PENDING]

    def approvals(self) -> list:
        return [a for r in self.runs() for a in self.store.list_approvals(r.id)]

    def decide(self, approval, approve=True, note="", by="operator"):
        current = self.store.get_approval(approval.id)
        return ap.decide_approval(self.store, current.run_id, current.id, approve, by, note,
                                  current.hash, ap.time.time(), view="")

    def event_types(self, run_id: str) -> list[str]:
        return [e[4] for e in self.store.list_events(run_id)]

    def all_settled_or_waiting(self) -> bool:
        return all(r.status in ap.TERMINAL or r.status == ap.WAITING for r in self.runs())

    def close(self):
        try:
            self.run(self.host.shutdown())
            self.run(ap.close_tools(self.tools))
        finally:
            self.proxy.close()
            self.store.close()
            self.loop.close()
            asyncio.set_event_loop(None)


# -- an in-process proxy over one server of any transport ---------------------------------

def one_server_config(tmp, endpoint, rules, connect_timeout="5s", server=None):
    """The configuration (written 0600, then loaded) of one server named ``h``: at the HTTP
    ``endpoint``, or the ``server`` entry given."""
    server = server or {"endpoint": endpoint, "connect_timeout": connect_timeout}
    doc = {"database": "runs.db", "session": "t", "hold": "0s",
           "servers": [{"name": "h", "manifest": "h.manifest.json", "rules": rules, **server}]}
    path = os.path.join(str(tmp), "proxy.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)
    return ap.load_config(path)


class HttpProxy:
    """An in-process proxy over one server named ``h`` (HTTP unless ``server`` is given):
    pinned, loaded, ready."""

    def __init__(self, tmp, endpoint, rules, connect_timeout="5s", server=None):
        self.loop = harness_loop()
        self.log: list[str] = []
        self.tools, self.store, self.proxy = [], None, None
        self.cfg = one_server_config(tmp, endpoint, rules, connect_timeout, server)
        server = self.cfg.servers[0]
        ap.write_manifest(server.manifest, self.run(ap.pin_server(server, time.time())))
        self.tools, _ = self.run(ap.load_tools(self.cfg))
        self.store = ap.Store.open(self.cfg.database)
        self.proxy = ap.Proxy(self.cfg, self.store, self.tools, self.log.append)

    def run(self, coro, timeout=30):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def call(self, name, args: bytes, timeout=30) -> tuple[str, float]:
        """The answer's text and how long it took."""
        t = time.monotonic()
        r = self.run(self.proxy.call(name, args), timeout)
        return "".join(b.get("text", "") for b in r["content"]), time.monotonic() - t

    def close(self):
        with contextlib.suppress(Exception):
            self.run(ap.close_tools(self.tools), 10)
        if self.proxy is not None:
            self.proxy.close()
        if self.store is not None:
            self.store.close()
        self.loop.close()
        asyncio.set_event_loop(None)


# -- the newline server (tests/newline_server.py): what a server that reads with
# universal newlines received, and the frames the proxy wrote to the host -------------

NEWLINE_SERVER = [sys.executable, os.path.join(ROOT, "tests", "newline_server.py")]
NEWLINE_RULES = {"look": {"side_effect": "read_only", "timeout": "5s"},
                 "erase": {"side_effect": "destructive", "timeout": "5s"}}
# Payments allowed outright, the repeat window off: every call reaches the server.
ALLOW_PAY = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow",
                     "repeat_window": "0s"},
             "refund": {"side_effect": "destructive", "timeout": "10s"}}


def newline_harness(tmp_path, rules=None, **top) -> ProxyHarness:
    return ProxyHarness(tmp_path, rules=rules or NEWLINE_RULES, command=NEWLINE_SERVER,
                        names=("nl",), server_env=[f"NEWLINE_LOG={tmp_path}/received"], **top)


def received(tmp_path) -> list[dict]:
    """What the newline server read, message by message."""
    try:
        with open(os.path.join(str(tmp_path), "received"), encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def calls(tmp_path) -> list[str]:
    return [m["name"] for m in received(tmp_path) if m["method"] == "tools/call"]


def compact_outside_strings(frame: bytes) -> bool:
    """No whitespace byte outside strings, and no raw line end of any reader anywhere."""
    if any(brk in frame for brk in (b"\r", b"\n", "\u2028".encode(), "\u2029".encode(),
                                    "\u0085".encode())):
        return False
    in_string = escaped = False
    for byte in frame:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b" \t":
            return False
    return True


def host_frames_are_own_encoding(h: ProxyHarness) -> None:
    for frame in h.out:
        assert frame.endswith(b"\n") and compact_outside_strings(frame[:-1]), frame[:200]
        assert isinstance(json.loads(frame), dict)


# -- operator commands in-process, and what the limits tests pay -------------------------

def operator(h, *argv, stdin=""):
    """Run an operator command on the harness's database in-process:
    (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["-db", h.cfg.database, *argv], stdin=io.StringIO(stdin), stdout=out,
                   stderr=err)
    return code, out.getvalue(), err.getvalue()


def limit_rules(*limits, timeout="300ms"):
    """balance read-only, and pay allowed outright under these limits."""
    return {"balance": {"side_effect": "read_only", "timeout": "10s"},
            "pay": {"side_effect": "remote_mutation", "timeout": timeout, "outcome": "allow",
                    "limits": list(limits)}}


def paid(h, to, amount):
    r = h.call("bank_pay", {"to": to, "amount": amount})
    return "paid" if not h.is_error(r) else h.prefix(r)
