"""The proxy as a real process in front of a hostile server and a healthy one.

Two servers are configured: ``hostile`` (tests/hostile_server.py, over stdio or streamable
HTTP with JSON or SSE answers; what each call does is chosen by its ``mode`` argument) and
``bank`` (fake_payment_server.py). For every misbehaviour the test asserts the outcome the
seed prescribes ("Timeouts, crashes, and restarts", "Outcome prefixes"), counts what the
hostile server executed from its log, and then checks that the proxy still answers a bank
balance call and exits once its stdin closes.

The hostile tools are ``hostile_read`` (read_only) and ``hostile_pay`` (remote_mutation,
allowed by its rule, so that it executes), each with a 2 s timeout: the slow cases are bounded
by it. Every wait has a deadline, generous for a busy machine and never what is judged: an
answer, a ping's answer before the call's, an exit; every process started here is killed by
its pid.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time

import pytest

from process_helpers import (FAKE_SERVER, PYTHON, ProcessDir, ProxyProcess, _cmdline,
                             child_pids, eventually, is_error, prefix, text)

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTILE = os.path.join(HERE, "hostile_server.py")

TOOL_TIMEOUT = 2.0                  # the hostile tools' rule timeout
# An answer owed by a timed-out call comes within this: a wait, ten times the rule's timeout
# and short of DEFAULT_TOOL_TIMEOUT (30 s), so that only the rule's deadline ends it.
ANSWER_BOUND = 20.0
PING_WAIT = 30.0                    # for a ping's answer while the upstream misbehaves
EXIT_BOUND = 30.0                   # stdin closed -> the proxy has exited
FLOOD_BOUND = 90.0                  # 10,000 notifications of 1 KiB, then the answer
MAX_RESULT = 64 * 1024
HTTP_START = 10.0

BANK_RULES = {"balance": {"side_effect": "read_only", "timeout": "5s"}}
HOSTILE_RULES = {"read": {"side_effect": "read_only", "timeout": "2s"},
                 "pay": {"side_effect": "remote_mutation", "timeout": "2s", "outcome": "allow"}}
TRANSPORTS = ["stdio", "json", "sse"]


# -- the bench: configuration, the hostile server, its log ---------------------------------------

class HostileDir(ProcessDir):
    """A ProcessDir whose configuration holds the bank first, then the hostile server."""

    def __init__(self, tmp, transport: str = "stdio", env: tuple = (), pin: bool = True):
        self.transport = transport
        self.hostile_env = list(env)
        self.log = os.path.join(str(tmp), "hostile.log")
        self.http: subprocess.Popen | None = None
        self.endpoint = ""
        if transport != "stdio":
            self.start_http(str(tmp))
        super().__init__(tmp, rules=BANK_RULES, pin=pin)

    def start_http(self, tmp: str) -> None:
        argv = [PYTHON, HOSTILE, "--http", "0"] + (["--sse"] if self.transport == "sse" else [])
        env = dict(os.environ, HOSTILE_LOG=self.log)
        env.update(e.split("=", 1) for e in self.hostile_env)
        self.http_err = open(os.path.join(tmp, "hostile-http.stderr"), "wb")
        self.http = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.http_err, env=env)
        port = _read_line(self.http.stdout, HTTP_START)
        assert port.strip().isdigit(), f"the hostile HTTP server did not start: {port!r}"
        self.endpoint = f"http://127.0.0.1:{port.strip()}/mcp"

    def write_config(self, rules, **top) -> None:
        bank = {"name": "bank", "command": [PYTHON, FAKE_SERVER],
                "env": [f"FAKE_PAYMENTS_LEDGER={self.ledger}"],
                "manifest": "bank.manifest.json", "rules": rules}
        hostile: dict = {"name": "hostile", "manifest": "hostile.manifest.json",
                         "rules": HOSTILE_RULES}
        if self.transport == "stdio":
            hostile["command"] = [PYTHON, HOSTILE]
            hostile["env"] = [f"HOSTILE_LOG={self.log}", *self.hostile_env]
        else:
            hostile["endpoint"] = self.endpoint
        doc = {"database": "runs.db", "session": "hostile", "hold": "0s",
               "servers": [bank, hostile]}
        doc.update(top)
        with open(self.config, "w") as f:
            json.dump(doc, f, indent=2)
        os.chmod(self.config, 0o600)

    def set_env(self, *env: str) -> None:
        """Change the stdio hostile server's environment (after the pin)."""
        self.hostile_env = list(env)
        self.write_config(BANK_RULES)

    def events(self) -> list[dict]:
        try:
            with open(self.log, "rb") as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def executions(self, tool: str) -> int:
        return sum(1 for e in self.events() if e["event"] == "call" and e["tool"] == tool)

    def start(self, name: str = "proxy") -> "ProxyProcess":
        p = ProxyProcess(self, name)
        self.procs.append(p)
        p.initialize()
        return p

    def cleanup(self) -> None:
        hostiles = [c for p in self.procs if p.proc.poll() is None
                    for c in child_pids(p.pid) if b"hostile_server" in _cmdline(c)]
        super().cleanup()
        for pid in hostiles:
            if b"hostile_server" in _cmdline(pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        if self.http is not None:
            if self.http.poll() is None:
                self.http.kill()
            self.http.wait(timeout=10)
            self.http.stdout.close()
            self.http_err.close()


def _read_line(stream, timeout: float) -> str:
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: got.put(stream.readline()), daemon=True).start()
    try:
        return got.get(timeout=timeout).decode("utf-8", "replace")
    except queue.Empty:
        return ""


@pytest.fixture
def bench(tmp_path_factory):
    made: list[HostileDir] = []

    def make(transport: str = "stdio", env: tuple = (), pin: bool = True) -> HostileDir:
        d = HostileDir(tmp_path_factory.mktemp(transport), transport, env, pin)
        made.append(d)
        return d
    yield make
    for d in made:
        d.cleanup()


# -- what every case ends with ----------------------------------------------------------------------

def healthy_then_exit(p: ProxyProcess) -> None:
    """The bank still answers through the proxy, and closing stdin ends the proxy."""
    r = p.call("bank_balance", {"account": "main"}, timeout=15)
    assert not is_error(r) and "holds 120.00 EUR" in text(r), f"bank balance: {r}"
    exits_soon(p)


def exits_soon(p: ProxyProcess) -> None:
    p.close_stdin()
    began = time.monotonic()
    code = p.wait_exit(EXIT_BOUND)
    assert code is not None, (f"the proxy did not exit within {EXIT_BOUND} s of stdin closing; "
                              f"stderr tail:\n{p.stderr()[-2000:]}")
    assert code == 0, f"the proxy exited {code} after {time.monotonic() - began:.1f} s; " \
                      f"stderr:\n{p.stderr()[-2000:]}"


def timed_call(p: ProxyProcess, name: str, args: dict, bound: float = ANSWER_BOUND) -> dict:
    """The call's result; none within ``bound`` fails the test."""
    return p.call(name, args, timeout=bound)


def want(r: dict, pfx: str, error: bool) -> str:
    t = text(r)
    assert t.startswith(pfx + ":"), f"want {pfx}, got: {t[:600]}"
    assert is_error(r) is error, f"isError {is_error(r)} for: {t[:600]}"
    return t


def pings_while(p: ProxyProcess, ident: int, bound: float) -> tuple[dict, int]:
    """Ping the proxy until the answer to request ``ident`` arrives; every ping is answered.
    The call's result, and how many pings were answered before it (the answers come in the
    order the proxy wrote them: a proxy busy with the upstream answers none before)."""
    key = json.dumps(ident)
    deadline = time.monotonic() + bound
    before = 0
    while key not in p.answers:
        assert time.monotonic() < deadline, f"no answer to call {ident} within {bound} s"
        msg = p.answer(p.send("ping"), timeout=PING_WAIT)
        assert msg.get("result") == {}, f"ping: {msg}"
        before += key not in p.answers
    return p.result(ident, timeout=0.1), before


def nesting(value) -> int:
    depth = 0
    while isinstance(value, (dict, list)) and value:
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
        depth += 1
    return depth


# -- a mutating call that got no answer: UNKNOWN_OUTCOME, executed once ---------------------------

NO_ANSWER = ["exit", "silent", "trickle", "garbage", "wrong_id", "error"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", NO_ANSWER)
def test_pay_without_an_answer_is_unknown_and_not_run_again(bench, transport, mode):
    # "error" is a JSON-RPC error answer: the seed counts a protocol error among the
    # failures that may have taken effect (an isError result is the known failure).
    d = bench(transport)
    p = d.start()
    args = {"mode": mode, "amount": 5}
    want(timed_call(p, "hostile_pay", args), "UNKNOWN_OUTCOME", False)
    assert d.executions("pay") == 1
    want(timed_call(p, "hostile_pay", args), "UNKNOWN_OUTCOME", False)
    assert d.executions("pay") == 1, d.events()
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["silent", "trickle", "garbage", "exit", "wrong_id"])
def test_read_without_an_answer_is_an_error_never_a_hang(bench, transport, mode):
    d = bench(transport)
    p = d.start()
    r = timed_call(p, "hostile_read", {"mode": mode})
    assert is_error(r), f"want an isError result or UNAVAILABLE, got {r}"
    assert prefix(r) not in ("UNKNOWN_OUTCOME", "INTERRUPTED"), text(r)
    healthy_then_exit(p)


# -- answers: a known failure, content that is or is not recorded --------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_iserror_is_a_known_failure_and_the_repeat_is_duplicate(bench, transport):
    d = bench(transport)
    p = d.start()
    args = {"mode": "iserror", "amount": 5}
    r = timed_call(p, "hostile_pay", args)
    assert is_error(r) and "card declined by the hostile bank" in text(r), r
    assert prefix(r) not in ("UNKNOWN_OUTCOME", "UNRECORDED", "UNAVAILABLE"), text(r)
    t = want(timed_call(p, "hostile_pay", args), "DUPLICATE", True)
    assert "card declined by the hostile bank" in t
    assert d.executions("pay") == 1
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("depth", [255, 256])
def test_structured_content_within_the_depth_bound_is_recorded(bench, transport, depth):
    d = bench(transport)
    p = d.start()
    args = {"mode": f"deep{depth}", "amount": 5}
    r = timed_call(p, "hostile_pay", args)
    assert not is_error(r), f"deep{depth}: {text(r)[:600]}"
    got = r["structuredContent"]            # the server's text travels beside it
    assert nesting(got) == depth, f"the recorded content nests {nesting(got)} levels"
    want(timed_call(p, "hostile_pay", args), "DUPLICATE", True)
    assert d.executions("pay") == 1
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_structured_content_past_the_depth_bound_is_unrecorded(bench, transport):
    d = bench(transport)
    p = d.start()
    args = {"mode": "deep257", "amount": 5}
    t = want(timed_call(p, "hostile_pay", args), "UNRECORDED", False)
    assert "executed" in t
    t = want(timed_call(p, "hostile_pay", args), "DUPLICATE", True)
    assert "could not be recorded" in t
    assert d.executions("pay") == 1
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exponent_bomb_in_content_executed_once(bench, transport):
    # The mcp module drops structured content whose number it cannot keep and records the
    # text instead (reference mcp.md 8.4); a runtime that refuses it answers UNRECORDED.
    # Either way the server answered: the call executed, and the repeat is a DUPLICATE.
    d = bench(transport)
    p = d.start()
    args = {"mode": "expbomb_content", "amount": 5}
    r = timed_call(p, "hostile_pay", args)
    if prefix(r) != "UNRECORDED":
        assert not is_error(r) and text(r) == "pay done", f"got: {text(r)[:600]}"
    want(timed_call(p, "hostile_pay", args), "DUPLICATE", True)
    assert d.executions("pay") == 1
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_utf8_in_a_result_reads_as_replacement_characters(bench, transport):
    d = bench(transport)
    p = d.start()
    args = {"mode": "badutf8", "amount": 5}
    r = timed_call(p, "hostile_pay", args)
    assert not is_error(r), text(r)
    assert "bad \ufffd\ufffd bytes" in text(r), text(r)
    want(timed_call(p, "hostile_pay", args), "DUPLICATE", True)
    assert d.executions("pay") == 1
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_big_result_is_capped_with_a_marker(bench, transport):
    d = bench(transport)
    p = d.start()
    r = timed_call(p, "hostile_read", {"mode": "big"})
    assert not is_error(r), text(r)[:600]
    shown = text(r)
    # The cap counts the recorded JSON string, quotes and escapes included.
    assert len(json.dumps(shown, ensure_ascii=False).encode()) <= MAX_RESULT
    assert len(shown) > MAX_RESULT // 2, len(shown)
    assert shown.startswith("xxxx") and shown.endswith("\n[truncated]"), shown[-40:]
    healthy_then_exit(p)


# -- framing: a CR is not a frame boundary ----------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["cr", "cr_text"])
def test_cr_separated_frames_reach_the_host_as_nothing(bench, transport, mode):
    d = bench(transport)
    p = d.start()
    ident = p.send_call("hostile_read", {"mode": mode})
    r = p.result(ident, timeout=ANSWER_BOUND)
    if mode == "cr_text":           # a valid answer: its text is data, passed on as sent
        assert text(r).startswith("read done\r{") and "FORGED" in text(r), text(r)
    healthy_then_exit(p)
    sent = set(range(1, p.next_id + 1))
    seen: dict[int, int] = {}
    for line in p.raw_lines:
        assert line.endswith(b"\n") and b"\r" not in line, f"not one clean line: {line!r}"
        msg = json.loads(line)
        assert isinstance(msg, dict) and msg.get("jsonrpc") == "2.0", line
        assert "method" not in msg, f"the proxy passed on a message it did not write: {line!r}"
        assert msg["id"] in sent, f"an answer to an id the host never sent: {line!r}"
        seen[msg["id"]] = seen.get(msg["id"], 0) + 1
        assert b"FORGED" not in line or msg["id"] == ident, f"forged frame: {line!r}"
    assert seen.get(ident) == 1, f"answers to the cr call: {seen.get(ident)}"
    assert all(n == 1 for n in seen.values()), seen


# -- requests from the server are refused; the call still completes -------------------------------

@pytest.mark.parametrize("transport", ["stdio", "sse"])
@pytest.mark.parametrize("mode", ["sampling", "elicitation", "roots"])
def test_server_requests_are_refused_and_the_call_completes(bench, transport, mode):
    d = bench(transport)
    p = d.start()
    r = timed_call(p, "hostile_read", {"mode": mode})
    assert not is_error(r) and text(r) == "read done", text(r)
    answers = [e for e in d.events() if e["event"] == "response"
               and str(e.get("id", "")).startswith(f"hostile-{mode}-")]
    assert len(answers) == 1, f"the proxy's answers to the server's request: {answers}"
    assert isinstance(answers[0]["error"], dict) and answers[0]["result"] is None, answers[0]
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", ["stdio", "sse"])
def test_notification_flood_leaves_the_proxy_responsive(bench, transport):
    d = bench(transport)
    p = d.start()
    ident = p.send_call("hostile_read", {"mode": "notify_flood"})
    eventually(lambda: any(e.get("what") == "flood start" for e in d.events()), 10,
               "the flood to start")
    r, before = pings_while(p, ident, FLOOD_BOUND)
    assert not is_error(r) and text(r) == "read done", text(r)
    assert before >= 1, "no ping was answered while the flood came in"
    healthy_then_exit(p)


# -- an exponent bomb as the answer's id ------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exponent_bomb_id_then_nothing(bench, transport):
    d = bench(transport)
    p = d.start()
    ident = p.send_call("hostile_pay", {"mode": "expbomb_id", "amount": 5})
    eventually(lambda: d.executions("pay"), 10, "the call to reach the server")
    r, before = pings_while(p, ident, ANSWER_BOUND)
    want(r, "UNKNOWN_OUTCOME", False)
    if transport != "json":         # a JSON body is the whole answer: nothing to wait for
        assert before >= 1, "no ping was answered while the call waited for its answer"
    assert d.executions("pay") == 1
    healthy_then_exit(p)


@pytest.mark.parametrize("transport", ["stdio", "sse"])
def test_exponent_bomb_id_then_the_answer(bench, transport):
    d = bench(transport)
    p = d.start()
    ident = p.send_call("hostile_pay", {"mode": "expbomb_id_answer", "amount": 5})
    eventually(lambda: d.executions("pay"), 10, "the call to reach the server")
    r, _ = pings_while(p, ident, ANSWER_BOUND)
    if prefix(r) != "UNKNOWN_OUTCOME":
        assert not is_error(r) and text(r) == "pay done", text(r)
    assert d.executions("pay") == 1
    healthy_then_exit(p)


# -- shutdown while a call trickles -----------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stdin_close_during_a_trickle_exits_in_time(bench, transport):
    d = bench(transport)
    p = d.start()
    ident = p.send_call("hostile_read", {"mode": "trickle"})
    eventually(lambda: d.executions("read"), 10, "the call to reach the server")
    exits_soon(p)
    r = p.result(ident, timeout=1)
    assert is_error(r), f"the trickled read: {r}"


# -- listings: too many tools, a repeated cursor, a tool changed since the pin ---------------------

LISTINGS = {"list1001": ("HOSTILE_LIST=1001", "more than 1000 tools"),
            "cursor": ("HOSTILE_CURSOR=repeat", "repeats")}


@pytest.mark.parametrize("case", sorted(LISTINGS))
def test_pin_refuses_a_bad_listing(bench, case):
    env, reason = LISTINGS[case]
    d = bench("stdio", env=(env,), pin=False)
    code, out, err = d.pin()
    assert code != 0, out
    assert 'server "hostile"' in err and reason in err, err
    assert os.path.exists(d.manifest), "the healthy server, listed first, was not pinned"
    assert not os.path.exists(os.path.join(d.tmp, "hostile.manifest.json"))


def test_pin_takes_exactly_1000_tools(bench):
    d = bench("stdio", env=("HOSTILE_LIST=1000",))
    with open(os.path.join(d.tmp, "hostile.manifest.json")) as f:
        assert len(json.load(f)["tools"]) == 1000


@pytest.mark.parametrize("case", sorted(LISTINGS))
def test_check_and_serve_refuse_a_bad_listing_after_the_pin(bench, case):
    env, reason = LISTINGS[case]
    d = bench("stdio")
    d.set_env(env)
    code, out, err = d.check()
    assert code != 0, out
    assert 'server "hostile"' in err and reason in err, err
    assert "bank: registered balance as bank_balance (read_only)" in out, out
    proc = subprocess.run([PYTHON, os.path.join(os.path.dirname(HERE), "agentrt_proxy.py"),
                           "-config", d.config], stdin=subprocess.PIPE, capture_output=True,
                          timeout=60, cwd=d.tmp)
    assert proc.returncode != 0
    assert reason in proc.stderr.decode(), proc.stderr.decode()
    assert proc.stdout == b""


@pytest.mark.parametrize("change,reason", [
    ("description", "the description changed since the pin"),
    ("schema", "the input schema changed since the pin")])
def test_tool_changed_after_the_pin_is_refused_and_the_rest_serve(bench, change, reason):
    d = bench("stdio")
    d.set_env(f"HOSTILE_CHANGED={change}")
    code, out, err = d.check()
    assert code == 0, err
    assert f"hostile: refused pay: {reason}" in out, out
    assert "hostile: registered read as hostile_read (read_only)" in out, out
    p = d.start()
    names = [t["name"] for t in p.request("tools/list")["result"]["tools"]]
    assert "hostile_pay" not in names and {"hostile_read", "bank_balance"} <= set(names), names
    msg = p.answer(p.send_call("hostile_pay", {"amount": 5}))
    assert "error" in msg, msg
    r = timed_call(p, "hostile_read", {})
    assert text(r) == "read done", text(r)
    assert d.executions("pay") == 0
    healthy_then_exit(p)


# ---- Bad input from a server, in-process (reference/mcp.md 11.7) ----------------------------

import sys  # noqa: E402

from proxy_harness import (ProxyHarness, ap, calls, harness_loop,  # noqa: E402
                           host_frames_are_own_encoding, newline_harness)
from scripted_server import (BAD_CALLS, MARKER, RO, Scripted, arun,  # noqa: E402
                             tool_entry, wait_gone)


class ScriptHarness(ProxyHarness):
    """ProxyHarness over a scripted server `fs` instead of the fake payment server."""

    def __init__(self, tmp, scripted: Scripted, rules: dict, **top):
        self.tmp = str(tmp)
        doc = {"database": "runs.db", "session": "test", "hold": "0s", "servers": [{
            "name": scripted.name, "command": [sys.executable, scripted.script,
                                               scripted.spec_path],
            "manifest": scripted.manifest, "rules": rules, "skip_path_check": True}]}
        doc.update(top)
        self.config_path = os.path.join(self.tmp, "proxy.json")
        with open(self.config_path, "w") as f:
            json.dump(doc, f)
        os.chmod(self.config_path, 0o600)
        self.loop = harness_loop()
        from proxy_harness import SkewClock
        self.clock = SkewClock()
        self.log_lines, self.out = [], []
        self.cfg = ap.load_config(self.config_path)
        self.pin()
        self.tools, self.reports = self.run(ap.load_tools(self.cfg))
        self.store = ap.Store.open(self.cfg.database)
        self.proxy = ap.Proxy(self.cfg, self.store, self.tools, self.log_lines.append,
                              clock=self.clock, poll=0.02)
        self.host = ap.HostServer(self.proxy, self.out.append)
        self.next_id = 0

    def steps(self, run) -> list:
        return self.store.list_steps(run.id)


@pytest.fixture
def bad(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry(n, {"type": "object"}) for n in BAD_CALLS],
                 calls={k: v for k, v in BAD_CALLS.items() if k != "fine"})
    rules = {n: {"side_effect": "read_only", "timeout": "300ms" if n == "never" else "5s"}
             for n in BAD_CALLS}
    rules["crash"] = {"side_effect": "remote_mutation", "timeout": "5s", "outcome": "allow"}
    h = ScriptHarness(tmp_path, s, rules)
    yield h, s
    h.close()


def test_proxy_survives_an_upstream_that_never_answers(bad):
    h, _ = bad
    r = h.call("fs_never", {}, timeout=10)
    assert h.is_error(r)
    run = h.runs()[-1]
    assert run.status in ap.TERMINAL
    # The rule's deadline, recorded with the failure: never a default's.
    assert {"failure": "timeout", "error": "no answer within 300ms"}.items() <= \
        h.steps(run)[0].obs_content.items(), h.steps(run)[0].obs_content
    r = h.call("fs_fine", {"x": 1})
    assert not h.is_error(r) and json.loads(h.text(r)) == {"x": 1}


def test_proxy_caps_a_5_mb_answer(bad):
    h, _ = bad
    r = h.call("fs_huge", {})
    assert not h.is_error(r)
    text = h.text(r)
    assert text.endswith(MARKER) and set(text[:-len(MARKER)]) == {"x"}
    assert len(json.dumps(text, ensure_ascii=False).encode()) <= ap.MAX_CONTENT_BYTES
    run = h.runs()[-1]
    assert run.status == ap.COMPLETED
    assert "truncated" in json.dumps(h.steps(run)[0].observation)


def test_proxy_survives_invalid_utf8_from_upstream(bad):
    h, _ = bad
    r = h.call("fs_badutf8", {})
    assert h.text(r)                      # answered, whatever it made of the bytes
    assert h.runs()[-1].status in ap.TERMINAL
    r = h.call("fs_fine", {"y": 2})
    assert json.loads(h.text(r)) == {"y": 2}


def test_proxy_survives_an_upstream_that_exits_mid_call(bad):
    h, s = bad
    r = h.call("fs_crash", {"n": 1}, timeout=15)
    # A mutating call whose server vanished: its outcome is unknown, never "failed".
    assert h.text(r).startswith("UNKNOWN_OUTCOME:"), h.text(r)
    # EOF failed the call, not the rule's 5 s: the recorded failure says so.
    failed = h.steps(h.runs()[-1])[0].obs_content
    assert failed.get("failure") == "error" and "closed its output" in failed["error"], failed
    assert wait_gone(s.pid())
    # The session is gone: later calls are answered at once (nothing is sent, so nothing
    # waits for an answer), naming the server's failure.
    r = h.call("fs_fine", {"z": 3}, timeout=10)
    assert h.is_error(r) and '"fs"' in h.text(r)
    assert "nothing was sent" in h.text(r), h.text(r)
    assert len(h.runs()) == 2
    statuses = [run.status for run in h.runs()]
    assert statuses[1] in ap.TERMINAL and statuses[0] in (ap.WAITING, *ap.TERMINAL)
    assert h.request("ping")["result"] == {}


def test_proxy_records_each_call_of_a_misbehaving_upstream(bad):
    h, _ = bad
    answers = [h.call(n, {}, timeout=15) for n in ("fs_never", "fs_huge", "fs_badutf8",
                                                    "fs_fine")]
    assert [h.is_error(a) for i, a in enumerate(answers) if i != 2] == [True, False, False]
    runs = h.runs()
    assert len(runs) == 4 and all(run.status in ap.TERMINAL for run in runs)
    assert [h.steps(run)[0].decision["tool"] for run in runs] == [
        "fs_never", "fs_huge", "fs_badutf8", "fs_fine"]


def test_proxy_refuses_to_start_on_a_listing_that_never_ends(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("a")])
    h = ScriptHarness(tmp_path, s, {"a": RO})
    h.close()
    s.change(list="endless")
    cfg = ap.load_config(h.config_path)
    with pytest.raises(ap.MCPError) as info:
        arun(ap.load_tools(cfg))
    assert "more than 100 pages" in str(info.value) and '"fs"' in str(info.value)
    assert wait_gone(s.pid())


# ---- A hostile server, faults found in review ------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

def test_server_answer_with_cr_between_tokens_forges_no_frame_to_the_host(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): a
    server's answer with CR between its tokens cannot forge a frame to the host."""
    h = newline_harness(tmp_path)
    try:
        r = h.call("nl_look", {"crafted": "cr"}, timeout=20)
        assert not h.is_error(r), h.text(r)
        assert h.text(r).startswith("ok\r\n")
        host_frames_are_own_encoding(h)
        answers = [json.loads(f) for f in h.out]
        assert [a.get("id") for a in answers] == [h.next_id]      # one answer, ours
        assert not any("method" in a for a in answers)
    finally:
        h.close()


ERASE_ALLOWED = {"look": {"side_effect": "read_only", "timeout": "5s"},
                 "erase": {"side_effect": "destructive", "timeout": "5s", "outcome": "allow"}}


def test_structured_content_nested_256_levels_is_recorded_and_returned(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    finding 3: structured content nested 256 levels is recorded (and returned)."""
    h = newline_harness(tmp_path, rules=ERASE_ALLOWED)
    try:
        r = h.call("nl_erase", {"structured_depth": 256})
        assert not h.is_error(r), h.text(r)
        assert "structuredContent" in r
        [run] = h.runs()
        assert run.status == ap.COMPLETED
        assert h.prefix(h.call("nl_erase", {"structured_depth": 256})) == "DUPLICATE"
        assert calls(tmp_path) == ["erase"]
    finally:
        h.close()


def test_structured_content_past_the_bound_is_unrecorded_and_counts(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    finding 3: any failure after the tool returned is UNRECORDED and counts as executed:
    structured content nested past the bound."""
    h = newline_harness(tmp_path, rules=ERASE_ALLOWED)
    try:
        r = h.call("nl_erase", {"structured_depth": 257})
        assert h.prefix(r) == "UNRECORDED", h.text(r)
        assert h.prefix(h.call("nl_erase", {"structured_depth": 257})) == "DUPLICATE"
        assert calls(tmp_path) == ["erase"]
    finally:
        h.close()


def test_failure_after_the_tool_returned_is_unrecorded_not_unexecuted(tmp_path, monkeypatch):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    finding 3: any failure after the tool returned is UNRECORDED and counts as executed, never
    "Nothing was executed"."""
    h = newline_harness(tmp_path, rules=ERASE_ALLOWED)
    real = ap._obs

    def broken(kind, content, summary, *rest):
        if kind == ap.TOOL_RESULT:
            raise ValueError("the observation would not encode")
        return real(kind, content, summary, *rest)
    try:
        monkeypatch.setattr(ap, "_obs", broken)
        r = h.call("nl_erase", {"n": 1})
        monkeypatch.setattr(ap, "_obs", real)
        assert h.prefix(r) == "UNRECORDED", h.text(r)
        assert "Nothing was executed" not in h.text(r)
        r = h.call("nl_erase", {"n": 1})
        assert h.prefix(r) == "DUPLICATE", h.text(r)
        assert calls(tmp_path) == ["erase"]
    finally:
        h.close()


def test_deep_answer_from_a_server_is_unrecorded_and_keeps_the_connection(tmp_path):
    """c17ac7a: a server's answer whose structuredContent was nested 300 deep was not JSON-RPC
    the proxy could read, so it broke the connection to the server: the payment's outcome
    was lost and every later call failed. The server answered: the call is recorded as
    content the gate refused (UNRECORDED), and the connection keeps serving."""
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
    h = ProxyHarness(tmp_path, rules=rules)
    try:
        r = h.call("bank_pay", {"to": "bob", "amount": 3, "mode": "deep"})
        assert h.prefix(r) == "UNRECORDED", h.text(r)
        assert h.payments() == 1
        r = h.call("bank_balance", {"account": "A-1"})
        assert h.text(r) == "account A-1 holds 120.00 EUR", h.text(r)
        r = h.call("bank_pay", {"to": "carol", "amount": 4})
        assert h.text(r) == "paid 4.00 to carol", h.text(r)
    finally:
        h.close()
