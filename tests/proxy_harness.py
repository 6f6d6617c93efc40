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
import json
import os
import sys

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
