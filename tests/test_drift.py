"""Tools that change while the proxy serves (drift), against a real proxy process and a
server that changes balance's description, pay's schema and adds a tool while serving
(tests/drift_server.py), in both eras: the changed tools are refused, the others still run,
the host and the operator are told, a pin brings them back, and a flood of notices is
listed again at a bounded rate. Nothing is ever offered that is not pinned as offered."""

import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402
from process_helpers import (PYTHON, RULES, ProcessDir, ProxyProcess, eventually, is_error,  # noqa: E402
                             prefix, text)

DRIFT_SERVER = os.path.join(HERE, "drift_server.py")
MODERN_META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
               "io.modelcontextprotocol/clientCapabilities": {},
               "io.modelcontextprotocol/clientInfo": {"name": "host", "version": "1"}}
SUBSCRIPTION = "io.modelcontextprotocol/subscriptionId"
WAIT = 20.0
# What the on_pending command does: append its stdin (one JSON object) to the file named.
ON_PENDING_SCRIPT = "import sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(sys.stdin.read())\n"


class DriftDir(ProcessDir):
    """ProcessDir with the drifting server, in one era, and an on_pending that keeps what
    it is given."""

    def __init__(self, tmp, era: str, **kw):
        self.era = era
        self.state = os.path.join(str(tmp), "drift.state")
        self.told_path = os.path.join(str(tmp), "on_pending.jsonl")
        script = os.path.join(str(tmp), "on_pending.py")
        with open(script, "w") as f:
            f.write(ON_PENDING_SCRIPT)
        kw.setdefault("on_pending", [PYTHON, script, self.told_path])
        super().__init__(tmp, **kw)

    def write_config(self, rules, **top) -> None:
        server = {"name": "bank", "command": [PYTHON, DRIFT_SERVER],
                  "env": [f"FAKE_PAYMENTS_LEDGER={self.ledger}", f"DRIFT_STATE={self.state}",
                          f"FAKE_PAYMENTS_ERA={self.era}"],
                  "manifest": "bank.manifest.json", "rules": rules}
        doc = {"database": "runs.db", "session": "laptop", "hold": "0s", "servers": [server]}
        doc.update(top)
        with open(self.config, "w") as f:
            json.dump(doc, f, indent=2)
        os.chmod(self.config, 0o600)

    def drift(self, state: str = "changed") -> None:
        with open(self.state, "w") as f:
            f.write(state)

    def told(self) -> list:
        try:
            with open(self.told_path) as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    def log(self) -> list:
        try:
            with open(self.state + ".log") as f:
                return [line.split() for line in f if line.strip()]
        except OSError:
            return []

    def pinned(self) -> dict:
        with open(self.manifest) as f:
            return json.load(f)["tools"]


def modern(params=None) -> dict:
    return {**(params or {}), "_meta": MODERN_META}


def listing(p: ProxyProcess, d: DriftDir, era: str = "legacy") -> dict:
    """The host's tools/list, each tool checked against the manifest on disk: what is
    offered is exactly what is pinned (the rules here set no description and hide nothing)."""
    msg = p.request("tools/list", modern() if era == "modern" else None)
    tools = {t["name"]: t for t in msg["result"]["tools"]}
    pinned = d.pinned()
    for name, tool in tools.items():
        if name == "gate_status":
            continue
        upstream = name[len("bank_"):]
        assert upstream in pinned, f"{name} is offered but not pinned"
        assert tool["description"] == pinned[upstream]["description"]
        assert tool["inputSchema"] == pinned[upstream]["input_schema"]
    return tools


def list_changed(p: ProxyProcess, subscription=None) -> list:
    return [m for m in p.others if m.get("method") == "notifications/tools/list_changed" and
            (subscription is None or
             (m.get("params") or {}).get("_meta", {}).get(SUBSCRIPTION) == subscription)]


def pump(p: ProxyProcess) -> None:
    """Move whatever the proxy wrote so far into p.answers / p.others."""
    while p._pump(time.monotonic()):
        pass


def wait_notices(p: ProxyProcess, count: int, subscription=None) -> None:
    def seen():
        pump(p)
        return len(list_changed(p, subscription)) >= count
    eventually(seen, WAIT, f"{count} notifications/tools/list_changed to the host")


def call(p: ProxyProcess, name: str, args: dict, era: str = "legacy") -> dict:
    params = {"name": name, "arguments": args}
    msg = p.request("tools/call", modern(params) if era == "modern" else params)
    assert "error" not in msg, f"protocol error: {msg['error']}"
    return msg["result"]


@pytest.fixture
def dirs(tmp_path):
    made = []

    def make(era, **kw):
        rules = json.loads(json.dumps(RULES))
        rules["refund"]["outcome"] = "allow"
        d = DriftDir(tmp_path / era, era, allow_pay=True, rules=rules, **kw)
        made.append(d)
        return d
    (tmp_path / "legacy").mkdir()
    (tmp_path / "modern").mkdir()
    yield make
    for d in made:
        d.cleanup()


def check_withheld(p, d, era):
    """After the drift: the changed tools refused, the unchanged one runs, the new one is
    never offered; the operator was told on stderr and through on_pending."""
    tools = listing(p, d, era)
    assert "bank_balance" not in tools and "bank_pay" not in tools
    assert "bank_refund" in tools and "bank_transfer" not in tools
    for name, args in (("bank_balance", {"account": "a"}),
                       ("bank_pay", {"to": "bob", "amount": 5})):
        r = call(p, name, args, era)
        assert is_error(r) and prefix(r) == "DENIED", r
        assert "withheld" in text(r) and "changed since the pin" in text(r), r
    assert d.payments() == 0                       # the refused pay never reached the server
    r = call(p, "bank_refund", {"payment": "p1"}, era)
    assert not is_error(r) and text(r) == "refunded"
    msg = p.request("tools/call", {"name": "bank_transfer", "arguments": {}})
    assert msg["error"]["code"] == -32602          # never offered: an unknown tool
    err = eventually(lambda: "changed its tools since the pin" in p.stderr() and p.stderr(),
                     WAIT, "the drift line on stderr")
    assert "balance: the description changed since the pin" in err
    assert "pay: the input schema changed since the pin" in err
    assert "transfer: a new tool, not in the manifest" in err
    assert "pin -config" in err
    told = eventually(lambda: [t for t in d.told() if t.get("kind") == "drift"], WAIT,
                      "on_pending's drift object")
    assert len(told) == 1
    doc = told[0]
    assert doc["server"] == "bank" and doc["pin"].endswith(f"pin -config {d.config}")
    why = {e["tool"]: (e["name"], e["why"]) for e in doc["withheld"]}
    assert why == {"balance": ("bank_balance", "the description changed since the pin"),
                   "pay": ("bank_pay", "the input schema changed since the pin"),
                   "transfer": ("", "a new tool, not in the manifest")}


def check_repinned(p, d, era):
    """A pin (the server still changed) brings the changed tools back, as now pinned; the
    new tool stays unoffered: it has no rule."""
    code, out, err = d.pin()
    assert code == 0, out + err
    assert "memo" in d.pinned()["pay"]["input_schema"]["properties"]

    def back():
        tools = listing(p, d, era)
        return "bank_balance" in tools and "bank_pay" in tools and tools
    tools = eventually(back, WAIT, "the re-pinned tools offered again")
    assert "bank_transfer" not in tools
    assert "memo" in tools["bank_pay"]["inputSchema"]["properties"]
    r = call(p, "bank_balance", {"account": "a"}, era)
    assert not is_error(r) and text(r) == "account a holds 120.00 EUR"
    r = call(p, "bank_pay", {"to": "bob", "amount": 5, "memo": "rent"}, era)
    assert not is_error(r) and text(r) == "paid 5.00 to bob", r
    assert d.payments() == 1
    assert "tools match the manifest again" in p.stderr()


def test_legacy_server_drift_is_withheld_until_pinned_again(dirs):
    d = dirs("legacy")
    p = d.start()
    tools = listing(p, d)
    assert {"bank_balance", "bank_pay", "bank_refund"} <= set(tools)
    # A pay in flight when the server changes finishes and is recorded.
    inflight = p.send_call("bank_pay", {"to": "carol", "amount": 7, "mode": "block"})
    eventually(lambda: d.payments() == 1, WAIT, "the blocked pay inside the server")
    d.drift()
    wait_notices(p, 1)
    d.release()
    r = p.result(inflight)
    assert not is_error(r) and text(r) == "paid 7.00 to carol"
    os.unlink(d.ledger + ".release")
    os.unlink(d.ledger)
    check_withheld(p, d, "legacy")
    check_repinned(p, d, "legacy")
    assert len(list_changed(p)) >= 2              # withheld, then offered again
    # Recorded: the pay in flight, refund, then balance and pay once pinned again; the
    # refused calls were answered at the door, nothing recorded or run.
    assert [r["status"] for r in d.runs()] == ["COMPLETED"] * 4
    p.stop()


def test_modern_server_drift_through_subscriptions_listen(dirs):
    """A 2026-07-28 server sends its notices only on a subscriptions/listen: the proxy opens
    one. The host is modern too and subscribes to the proxy the same way."""
    d = dirs("modern")
    p = ProxyProcess(d, "proxy")
    d.procs.append(p)
    found = p.request("server/discover", modern(), timeout=60)["result"]
    assert found["capabilities"]["tools"]["listChanged"] is True
    p.send("subscriptions/listen", modern({"notifications": {"toolsListChanged": True}}),
           ident="sub-1")

    def acknowledged():
        pump(p)
        return [m for m in p.others
                if m.get("method") == "notifications/subscriptions/acknowledged" and
                m["params"]["_meta"][SUBSCRIPTION] == "sub-1"]
    eventually(acknowledged, WAIT, "the host's subscription acknowledged")
    tools = listing(p, d, "modern")
    assert {"bank_balance", "bank_pay", "bank_refund"} <= set(tools)
    d.drift()
    wait_notices(p, 1, "sub-1")
    check_withheld(p, d, "modern")
    check_repinned(p, d, "modern")
    wait_notices(p, 2, "sub-1")
    assert "sub-1" not in p.answers and json.dumps("sub-1") not in p.answers  # never answered
    p.notify("notifications/cancelled", {"requestId": "sub-1"})
    p.stop()


def test_a_flood_of_notices_is_listed_again_at_a_bounded_rate(dirs):
    d = dirs("legacy")
    p = d.start()
    assert "bank_balance" in listing(p, d)
    d.drift("changed 400")                   # 400 notices, one every 5 ms

    def done():
        ends = [float(w[1]) for w in d.log() if w[0] == "flood-done"]
        return ends and ends[0]
    end = eventually(done, 60, "the flood sent")
    server_pid = [w[1] for w in d.log() if w[0] == "list"][1]   # after the set-up pin's
    # One listing follows the last notice, however the notices fell.
    eventually(lambda: [w for w in d.log() if w[0] == "list" and w[1] == server_pid and
                        float(w[2]) > end], WAIT, "the listing after the flood")
    times = [float(w[2]) for w in d.log() if w[0] == "list" and w[1] == server_pid]
    relists = times[1:]                       # the first is loading's
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= ap.DRIFT_RELIST_INTERVAL * 0.9, gaps
    span = relists[-1] - relists[0]
    assert len(relists) <= span / ap.DRIFT_RELIST_INTERVAL + 2, times
    assert len(relists) < 40                  # 400 notices, nowhere near one listing each
    # One change, one notice to the operator, whatever the flood.
    eventually(lambda: d.told(), WAIT, "on_pending's drift object")
    assert p.stderr().count("changed its tools since the pin") == 1
    assert len(d.told()) == 1
    tools = listing(p, d)
    assert "bank_balance" not in tools and "bank_transfer" not in tools
    p.stop()


def test_a_host_subscription_is_acknowledged_told_and_bounded():
    """The host side in-process: each subscriptions/listen is acknowledged and never
    answered, a change is sent on each, a cancelled one hears no more, and a host cannot
    open more than MAX_HOST_LISTENS."""
    out = []
    host = ap.HostServer(None, out.append, lambda line: None)

    def listen(ident):
        host.handle(json.dumps({"jsonrpc": "2.0", "id": ident, "method": "subscriptions/listen",
                                "params": modern({"notifications": {"toolsListChanged": True}})
                                }).encode())
    for i in range(ap.MAX_HOST_LISTENS + 1):
        listen(i)
    sent = [json.loads(line) for line in out]
    acks = [m for m in sent if m.get("method") == "notifications/subscriptions/acknowledged"]
    assert [m["params"]["_meta"][SUBSCRIPTION] for m in acks] == \
        list(range(ap.MAX_HOST_LISTENS))
    assert [m["id"] for m in sent if "error" in m] == [ap.MAX_HOST_LISTENS]
    assert not [m for m in sent if "result" in m]
    host.handle(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                            "params": {"requestId": 3}}).encode())
    out.clear()
    host.tools_changed()
    told = [json.loads(line)["params"]["_meta"][SUBSCRIPTION] for line in out]
    assert sorted(told) == [i for i in range(ap.MAX_HOST_LISTENS) if i != 3]


def test_closing_the_watches_is_bounded_when_one_takes_its_cancel_for_something_else(
        monkeypatch):
    """A watch that catches a cancel and goes on (as one did when its wait read the cancel
    as a timeout): close() cancels it again, and returns within CLOSE_WAIT either way: while
    that watch still runs (it never ends by itself), so a close that waited for it would
    never return."""
    import asyncio
    monkeypatch.setattr(ap, "CLOSE_WAIT", 0.5)

    stop = []

    async def stubborn():
        while not stop:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass                            # taken for something else: goes on

    async def once():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)           # the first cancel swallowed, then it ends
            raise RuntimeError("ended")

    async def trial():
        watch = ap.DriftWatch.__new__(ap.DriftWatch)
        watch.tasks = [asyncio.create_task(stubborn()), asyncio.create_task(once())]
        await asyncio.sleep(0)
        closing = asyncio.create_task(watch.close())
        await asyncio.wait({closing}, timeout=WAIT)     # a close that hangs fails here
        returned = closing.done() and not watch.tasks[0].done()
        ended = watch.tasks[1].done()
        stop.append(True)
        watch.tasks[0].cancel()
        await asyncio.wait([*watch.tasks, closing], timeout=WAIT)
        return returned, ended
    returned, ended = asyncio.run(trial())
    assert returned, "close() did not return while the stubborn watch went on"
    assert ended
