"""The benchmark of record for the proxy's speed: run directly, never collected by pytest.

    python3 tests/bench.py                    # the full run, a few minutes
    python3 tests/bench.py -quick             # fewer calls, under a minute
    python3 tests/bench.py --fastmcp-python /tmp/fmvenv/bin/python   # with FastMCP's proxy
    python3 tests/bench.py -quick --json figures.json                # the figures as JSON
    python3 tests/bench.py --dir /dev/shm     # databases and ledgers on another file system

Standard library only. Every figure is measured side by side in one run: the arms run as
processes at the same time and take turns in rounds (the order rotates each round), so the
machine's noise falls on all of them alike. Every arm is driven by the same raw JSON-RPC
client (class Client: pipes, the legacy initialize, then tools/call lines read back by id):

    direct    the upstream server process itself: tests/echo_server.py (a trivial echo),
              fake_payment_server.py (its ``pay`` appends to a ledger file and fsyncs it)
              and tests/files_server.py (large arguments and answers)
    proxy     python3 -S -P -m agentrt_proxy -config <tmp>/<arm>/proxy.json (PYTHONPATH the
              checkout, its compiled form cached under the temporary directory; a plain
              script run before Python 3.11), pinned first, in front of the same servers
              (echo classified read_only, ``pay`` remote_mutation with outcome allow,
              write_file local_mutation with outcome allow, read_file and list_entries
              read_only), its database in the same temporary directory
    FastMCP   fastmcp's create_proxy over a stdio client to the same servers, one small script
              per upstream, run by --fastmcp-python (default: this interpreter) when
              ``import fastmcp`` works there; otherwise its columns say "skipped"

The rows (p50 / p95 / p99 in milliseconds, from all rounds; overhead is proxy p50 minus
direct p50):

    allowed read-only call     echo with distinct arguments per call; with FastMCP measured,
                               met when the overhead is at most 0.9x FastMCP's
    allowed mutating call      pay with distinct arguments per call (so no rule refuses it),
                               its attempt's commit synced before the request leaves; with
                               FastMCP measured, met when the overhead is at most FastMCP's
    bare Python relay          tests/bare_relay.py in front of the echo server, in the read
                               row's rounds: lines passed both ways on one event loop,
                               nothing parsed, checked or recorded; the plumbing any Python
                               proxy on stdio pays, added to the records below as a floor
    records alone              the floor under the two rows above: the SQLite statements
                               of 1,000 allowed reads and 1,000 allowed pays (-quick: 200),
                               captured with their parameters in-process (profile_call.py's
                               instant upstream), replayed by sqlite3 on a copy of the
                               database, on this disk, with the syncs of the WAL the proxy
                               makes for them (one a read, two a pay) and none of the proxy's
                               Python; beside FastMCP's overhead from the rows above
    DUPLICATE refusal          right after each timed pay, the identical pay again, timed: the
                               proxy must refuse it (DUPLICATE), within 1 ms, and its ledger
                               must not grow; direct and FastMCP pay a second time, as the
                               ledger shows
    same request, first/last   one identical read-only request through the proxy 10,000 times
                               (-quick: 2,000) in blocks of 100, each followed by a block of
                               the same call direct; calls 1-100 against the last 100.
                               Past a deadline (90 s, -quick 12 s) it stops after the
                               block under way, compares that block, and reports MISSED
    recorded runs, empty/full  allowed reads through a proxy on an empty database and through
                               one whose database holds 1,000,000 recorded runs (-quick:
                               100,000), built by plain SQL from a run the proxy recorded;
                               met within 1.2x
    16 in flight               read-only calls with distinct arguments, 16 requests kept
                               outstanding on one connection; calls per second over the
                               rounds; met at 1.5x FastMCP's rate (without FastMCP, at
                               1,500 calls a second)
    large payloads             tests/files_server.py direct, behind the proxy and behind
                               FastMCP: write_file with a 1 MB argument (met at 3x FastMCP's
                               overhead); read_file of 100 KB, 1 MB and 4 MB files of plain
                               text and of JSON text (its quotes escaped in the frame), and
                               list_entries' 20,000-entry structured result (met at 1x
                               FastMCP's overhead). Fewer calls for larger payloads: a round
                               carries 8 MB an arm (-quick: 2 MB), one call at least
    peak memory                after each large-payload row, each arm's VmHWM growth over its
                               calls (lowered to VmRSS before them through clear_refs); on
                               the 4 MB JSON text, met at 4x the answer's frame
    strict parse               in-process: agentrt_proxy.parse_json against json.loads on
                               the 1 MB argument's frame, the 4 MB JSON text's answer and
                               the 20,000-entry answer; met at 3x json.loads
    start-up                   process start to the first tools/list answer, fake payment
                               server alone against a proxy in front of it started as wrap
                               writes it into a host's configuration (agentrt_proxy's
                               host_entry; met at +300 ms), beside FastMCP's start; and, as
                               the README's faster forms, a module run (-S -P -m) and one
                               with site (-P -m)
    memory, 64 held            64 calls to a require_approval tool held (hold 30s,
                               max_pending 100), then VmRSS of the proxy from /proc

It prints the machine, one table (direct, proxy, overhead, FastMCP, target, met or MISSED,
with a note under it for rows that need one), then the ratios. It exits 0 when every row was
measured, met or missed, and 1 when a row could not be measured (its note says why).

The recorded-runs database keeps the shape the proxy writes (runs, steps, the eight events
of an allowed call, proxy_calls rows, all settled) but not a valid event hash chain: the
copied events carry the template's hashes, so `verify` would report the first copy. What is
measured is the cost of an allowed read as the tables grow, not verification.

Where the time of an allowed call goes
--------------------------------------
cProfile of 2,000 allowed read-only calls in-process (``python3 tests/profile_call.py -dir
/dev/shm``: tests/test_rules_cost.py's instant upstream, the database on /dev/shm so that
the sync is not counted; Python 3.11, 2-core VM, 2026-12-03): 0.9 to 1.4 ms a call without
the profiler, of which 38 SQLite statements (11 SELECT, 11 INSERT, 6 UPDATE, 2 BEGIN and 2
COMMIT, and 6 PRAGMA: the level switched around the two unsynced commits, data_version read
at the sync and at the answer) take about 0.37 ms; the event chain (8 events, each encoded
and hashed) 0.3 ms under the profiler; parsing (6 parses) and encoding (11 records) the
rest, with asyncio's hand-offs (8 turns of the loop a call). Through the real process add
reading and answering the host's frame and the upstream's, and the one sync of the WAL (0.3
to 0.5 ms on this VM's disk), which calls in flight together share (group commit:
Store.durable). At start-up, a script run (the form wrap writes into a host's
configuration) compiles the whole file first (about 0.2 s that day), which CPython never
caches for a script; the other proxy arms here run as ``python3 -S -P -m agentrt_proxy``,
which loads the cached compiled form without running site, and the start-up rows time it
and a module run with site beside the script run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import selectors
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROXY = os.path.join(ROOT, "agentrt_proxy.py")
FAKE_SERVER = os.path.join(ROOT, "fake_payment_server.py")
ECHO_SERVER = os.path.join(HERE, "echo_server.py")
FILES_SERVER = os.path.join(HERE, "files_server.py")
BARE_RELAY = os.path.join(HERE, "bare_relay.py")
PYTHON = sys.executable or "python3"
MODULE_RUN = sys.version_info >= (3, 11)     # python3 -P -m agentrt_proxy needs -P

# -- targets (this machine, p50) --
READ_OVERHEAD_MS = 0.8         # used when FastMCP is not measured; else the ratios below
MUTATING_OVERHEAD_MS = 1.2
READ_VS_FASTMCP = 0.9          # an allowed read's overhead against FastMCP's
MUTATING_VS_FASTMCP = 1.0
DUPLICATE_TOTAL_MS = 1.0
SAME_REQUEST_RATIO = 1.10
FULL_DATABASE_RATIO = 1.20
LIMIT_EXTRA_MS = 0.3          # what a sum limit may add to an allowed mutating call
LIMIT_ROWS_FULL, LIMIT_ROWS_QUICK = 1_000_000, 100_000
INFLIGHT_MIN_RATE = 1500.0    # used when FastMCP is not measured; else the ratio below
INFLIGHT_VS_FASTMCP = 1.5
STARTUP_BEYOND_MS = 300.0     # started as wrap writes it into a host's configuration
HELD_RSS_MB = 60.0
ARGUMENT_VS_FASTMCP = 3.0     # a 1 MB argument's overhead against FastMCP's
LARGE_READ_VS_FASTMCP = 1.0   # reads of 100 KB to 4 MB, plain and JSON text, likewise
LISTING_VS_FASTMCP = 1.0      # the 20,000-entry structured result, likewise
STRICT_PARSE_VS_JSON = 3.0    # the proxy's strict parse against json.loads, in-process
PEAK_VS_FRAME = 4.0           # peak memory growth reading the 4 MB JSON text, per frame byte

# -- shape of the run --
IN_FLIGHT = 16
HELD_CALLS = 64
HELD_MAX_PENDING = 100
HOLD = "30s"
KB, MB = 1024, 1024 * 1024
ARGUMENT_BYTES = MB              # the large argument's text
READ_SIZES = (("100 KB", 100 * KB), ("1 MB", MB), ("4 MB", 4 * MB))
LISTING_ENTRIES = 20_000
JUDGED_PEAK = ("4 MB", "JSON text")   # the read whose peak memory has a target
WRAP_HOST = "claude"             # the host whose configuration entry starts the proxy
BLOCK = 100                      # the same-request row compares blocks of this many calls
WARMUP_CALLS = 5
PROTOCOL_VERSION = "2025-06-18"
SESSION = "bench"


@dataclasses.dataclass(frozen=True)
class Plan:
    rounds: int                  # rounds of the read and mutating rows
    per_round: int               # calls per arm per round
    same_calls: int              # the same-request row
    same_deadline: float         # seconds; the row stops early past it (and says so)
    db_runs: int                 # recorded runs in the full database
    db_rounds: int
    db_per_round: int
    flight_rounds: int
    flight_calls: int            # calls per arm per round, IN_FLIGHT outstanding
    startup_rounds: int
    records_calls: int           # calls captured and replayed by the records-alone rows
    large_rounds: int            # rounds of each large-payload row
    large_bytes: int             # payload bytes per arm per round (at least one call)
    parse_rounds: int            # timings of each parse in the strict-parse rows


QUICK = Plan(rounds=5, per_round=20, same_calls=2000, same_deadline=12.0, db_runs=100_000,
             db_rounds=4, db_per_round=20, flight_rounds=3, flight_calls=120, startup_rounds=3,
             records_calls=200, large_rounds=3, large_bytes=2 * MB, parse_rounds=3)
FULL = Plan(rounds=20, per_round=50, same_calls=10_000, same_deadline=90.0,
            db_runs=1_000_000, db_rounds=10, db_per_round=50, flight_rounds=5,
            flight_calls=400, startup_rounds=10, records_calls=1000, large_rounds=5,
            large_bytes=8 * MB, parse_rounds=7)

# -- waits: every one bounded --
CALL_TIMEOUT = 60.0
START_TIMEOUT = 60.0
PIN_TIMEOUT = 60.0
STOP_WAIT = 10.0
CHILD_WAIT = 5.0
HELD_WAIT = 60.0
POLL = 0.02
READ_CHUNK = 1 << 20
KIB = 1024.0
MS = 1000.0

PAY_RULES = {"side_effect": "remote_mutation", "timeout": "20s", "outcome": "allow"}
BANK_RULES = {"balance": {"side_effect": "read_only", "timeout": "5s"}, "pay": PAY_RULES,
              "refund": {"side_effect": "destructive", "timeout": "5s",
                         "outcome": "require_approval"}}
ECHO_RULES = {"echo": {"side_effect": "read_only", "timeout": "5s"}}
FILES_RULES = {"write_file": {"side_effect": "local_mutation", "timeout": "30s",
                              "outcome": "allow"},
               "read_file": {"side_effect": "read_only", "timeout": "30s"},
               "list_entries": {"side_effect": "read_only", "timeout": "30s"}}

FASTMCP_SCRIPT = '''\
import json, sys
from fastmcp.client.transports import StdioTransport
from fastmcp.server import create_proxy
command, env = json.loads(sys.argv[1]), json.loads(sys.argv[2])
proxy = create_proxy(StdioTransport(command[0], command[1:], env=env), name="bench")
proxy.run(transport="stdio", show_banner=False)
'''


class BenchError(Exception):
    """A measurement could not be taken: a process failed, or an answer was not the one due."""


# ==== the raw JSON-RPC client ====

def child_pids(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return found


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def status_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory figure of /proc/<pid>/status (VmRSS now, VmHWM its peak) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / KIB
    raise BenchError(f"no {field} for pid {pid}")


def reset_peak(pid: int) -> float:
    """Lower the process's VmHWM to its VmRSS (clear_refs 5), which is returned."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        raise BenchError(f"cannot reset the peak memory of pid {pid}: {exc}") from None
    return status_mb(pid)


def wire(msg: dict) -> bytes:
    """A message as the client writes it: compact JSON, one line."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


class Client:
    """One server process spoken to over its pipes: requests out as lines, answers read back
    by id with selectors (one thread, no hand-off between the reader and the timer)."""

    def __init__(self, name: str, argv: list[str], cwd: str, env: dict | None = None):
        self.name = name
        self.stderr_path = os.path.join(cwd, f"{name}.stderr")
        self.err_file = open(self.stderr_path, "wb")
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err_file, cwd=cwd, env=env, bufsize=0)
        self.pid = self.proc.pid
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.fd, selectors.EVENT_READ)
        self.buf = b""
        self.answers: dict = {}          # id -> (perf_counter when read, message)
        self.next_id = 0
        self.children: dict[int, bytes] = {}
        self.ready_after = 0.0           # seconds from spawn to the first tools/list answer

    # -- wire --

    def _write(self, msg: dict) -> None:
        data = wire(msg)
        try:
            while data:
                data = data[os.write(self.proc.stdin.fileno(), data):]
        except OSError as exc:
            raise BenchError(f"{self.name}: cannot write: {exc}{self.tail()}") from None

    def send(self, method: str, params: dict) -> tuple[int, float]:
        self.next_id += 1
        ident = self.next_id
        sent = time.perf_counter()
        self._write({"jsonrpc": "2.0", "id": ident, "method": method, "params": params})
        return ident, sent

    def notify(self, method: str) -> None:
        self._write({"jsonrpc": "2.0", "method": method})

    def _pump(self, deadline: float) -> None:
        """Read what has arrived (waiting until the deadline for something)."""
        if not self.sel.select(max(0.0, deadline - time.perf_counter())):
            return
        data = os.read(self.fd, READ_CHUNK)
        now = time.perf_counter()
        if not data:
            raise BenchError(f"{self.name} closed its output (exit {self.proc.poll()})"
                             f"{self.tail()}")
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                raise BenchError(f"{self.name} wrote a line that is not JSON: {line[:200]!r}"
                                 ) from None
            if isinstance(msg, dict) and "id" in msg and "method" not in msg:
                self.answers[msg["id"]] = (now, msg)

    def wait(self, ident: int, timeout: float = CALL_TIMEOUT) -> tuple[float, dict]:
        deadline = time.perf_counter() + timeout
        while ident not in self.answers:
            if time.perf_counter() > deadline:
                raise BenchError(f"{self.name}: no answer to {ident} within {timeout} s"
                                 f"{self.tail()}")
            self._pump(deadline)
        return self.answers.pop(ident)

    def request(self, method: str, params: dict, timeout: float = CALL_TIMEOUT) -> dict:
        _, msg = self.wait(self.send(method, params)[0], timeout)
        if "result" not in msg:
            raise BenchError(f"{self.name}: {method} failed: {msg.get('error')}")
        return msg["result"]

    # -- MCP --

    def start(self) -> "Client":
        """initialize, notifications/initialized, tools/list; the time to that answer."""
        self.request("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                    "clientInfo": {"name": "bench", "version": "1"}},
                     START_TIMEOUT)
        self.notify("notifications/initialized")
        ident, _ = self.send("tools/list", {})
        got, msg = self.wait(ident, START_TIMEOUT)
        if "result" not in msg:
            raise BenchError(f"{self.name}: tools/list failed: {msg.get('error')}")
        self.ready_after = got - self.spawned
        self.note_children()
        return self

    def call(self, tool: str, args: dict) -> tuple[float, dict]:
        """One tools/call: (seconds from the write to the answer's read, the result)."""
        ident, sent = self.send("tools/call", {"name": tool, "arguments": args})
        got, msg = self.wait(ident)
        if "result" not in msg:
            raise BenchError(f"{self.name}: {tool} failed: {msg.get('error')}")
        return got - sent, msg["result"]

    def ok(self, tool: str, args: dict) -> float:
        """A call that must succeed; its latency."""
        took, result = self.call(tool, args)
        if result.get("isError"):
            raise BenchError(f"{self.name}: {tool} {args} answered an error: {text(result)}")
        return took

    def pipeline(self, calls: list[tuple[str, dict]], in_flight: int) -> tuple[list[float], float]:
        """The calls with ``in_flight`` outstanding: each latency, and the wall time."""
        pending: dict[int, float] = {}
        latencies: list[float] = []
        todo = iter(calls)
        began = time.perf_counter()
        deadline = began + CALL_TIMEOUT
        while True:
            while len(pending) < in_flight:
                nxt = next(todo, None)
                if nxt is None:
                    break
                ident, sent = self.send("tools/call", {"name": nxt[0], "arguments": nxt[1]})
                pending[ident] = sent
            if not pending:
                return latencies, time.perf_counter() - began
            for ident in [i for i in pending if i in self.answers]:
                got, msg = self.answers.pop(ident)
                if "result" not in msg or msg["result"].get("isError"):
                    raise BenchError(f"{self.name}: a pipelined call failed: {msg}")
                latencies.append(got - pending.pop(ident))
            if pending and not any(i in self.answers for i in pending):
                if time.perf_counter() > deadline:
                    raise BenchError(f"{self.name}: pipelined calls unanswered{self.tail()}")
                self._pump(deadline)

    # -- the process --

    def note_children(self) -> None:
        """Remember the servers this process started, by pid and command line, so that they
        can be ended by pid if they outlive it."""
        for pid in child_pids(self.pid):
            self.children.setdefault(pid, cmdline(pid))

    def tail(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                data = f.read()[-2000:].decode("utf-8", "replace")
        except OSError:
            return ""
        return f"\n--- {self.name} stderr ---\n{data}" if data.strip() else ""

    def stop(self) -> None:
        """Close stdin and wait; then SIGKILL by pid; then the children it left, by pid."""
        if self.proc.poll() is None:
            self.note_children()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=STOP_WAIT)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_WAIT)
        for pid, line in self.children.items():
            deadline = time.monotonic() + CHILD_WAIT
            while time.monotonic() < deadline and line and cmdline(pid) == line:
                time.sleep(POLL)
            if line and cmdline(pid) == line:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.children = {}
        self.sel.close()
        self.proc.stdout.close()
        self.err_file.close()


def text(result: dict) -> str:
    return "".join(b.get("text", "") for b in result.get("content", []))


# ==== the arms and their directories ====

def echo_server() -> dict:
    return {"name": "echo", "command": [PYTHON, ECHO_SERVER], "manifest": "echo.manifest.json",
            "rules": ECHO_RULES}


def files_server(root: str) -> dict:
    return {"name": "files", "command": [PYTHON, FILES_SERVER], "env": [f"FILES_ROOT={root}"],
            "manifest": "files.manifest.json", "rules": FILES_RULES}


def bank_server(ledger: str, rules: dict | None = None) -> dict:
    return {"name": "bank", "command": [PYTHON, FAKE_SERVER],
            "env": [f"FAKE_PAYMENTS_LEDGER={ledger}"], "manifest": "bank.manifest.json",
            "rules": rules or BANK_RULES}


def ledger_env(ledger: str) -> dict:
    return {"FAKE_PAYMENTS_LEDGER": ledger}


def ledger_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def wrap_entry(config: str) -> tuple[list[str], dict]:
    """The command line and environment that ``wrap`` writes into a host's configuration
    to start the proxy (agentrt_proxy.host_entry, the function wrap itself calls)."""
    sys.path.insert(0, ROOT)
    import agentrt_proxy
    entry = agentrt_proxy.host_entry(WRAP_HOST, config)
    return [entry["command"], *entry["args"]], entry.get("env", {})


@dataclasses.dataclass
class ProxyDir:
    path: str
    config: str
    database: str
    ledger: str


class Lab:
    """The temporary directory and every process started in it, stopped by pid at the end."""

    def __init__(self, root: str, fastmcp_python: str | None):
        self.root = root
        self.fastmcp_python = fastmcp_python
        self.clients: list[Client] = []
        self.fastmcp_script = os.path.join(root, "fastmcp_proxy.py")
        with open(self.fastmcp_script, "w") as f:
            f.write(FASTMCP_SCRIPT)
        self.files = os.path.join(root, "served")     # tests/files_server.py's FILES_ROOT
        os.mkdir(self.files, 0o700)

    def proxy_dir(self, name: str, bank: bool, echo: bool, bank_rules: dict | None = None,
                  files: bool = False, **top) -> ProxyDir:
        path = os.path.join(self.root, name)
        os.mkdir(path, 0o700)
        ledger = os.path.join(path, "ledger")
        servers = ([echo_server()] if echo else []) + \
            ([bank_server(ledger, bank_rules)] if bank else []) + \
            ([files_server(self.files)] if files else [])
        doc = {"database": "runs.db", "session": SESSION, "hold": "0s", "servers": servers}
        doc.update(top)
        config = os.path.join(path, "proxy.json")
        fd = os.open(config, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
        return ProxyDir(path, config, os.path.join(path, "runs.db"), ledger)

    def pin(self, dirs: list[ProxyDir]) -> None:
        """pin every configuration, side by side (before anything is timed)."""
        procs = [subprocess.Popen([PYTHON, PROXY, "pin", "-config", d.config], cwd=d.path,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT) for d in dirs]
        try:
            for d, p in zip(dirs, procs):
                out, _ = p.communicate(timeout=PIN_TIMEOUT)
                if p.returncode != 0:
                    raise BenchError(f"pin {d.config} failed ({p.returncode}):\n"
                                     f"{out.decode()}")
        finally:
            for p in procs:                 # a pin that did not finish: ended by its pid
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=STOP_WAIT)

    def _start(self, client: Client, start: bool) -> Client:
        """Registered before anything can fail, so that stop_all ends it; started (to the
        first tools/list answer) unless the caller starts several side by side itself."""
        self.clients.append(client)
        return client.start() if start else client

    def proxy(self, name: str, d: ProxyDir, start: bool = True, site: bool = False) -> Client:
        """The proxy as the README's faster host configuration starts it: ``python3 -S -P
        -m agentrt_proxy`` with its directory on PYTHONPATH, so that the interpreter loads
        its cached compiled form (kept here under PYTHONPYCACHEPREFIX, never in the
        checkout) and runs no site. ``site``: without -S. On a Python older than 3.11 (no
        -P): run as ``python3 agentrt_proxy.py``, compiled at every start."""
        if not MODULE_RUN:
            return self._start(Client(name, [PYTHON, PROXY, "-config", d.config], d.path),
                               start)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.update(PYTHONPATH=ROOT, PYTHONPYCACHEPREFIX=os.path.join(self.root, "pycache"))
        argv = [PYTHON, *([] if site else ["-S"]), "-P", "-m", "agentrt_proxy", "-config",
                d.config]
        return self._start(Client(name, argv, d.path, env), start)

    def wrapped(self, name: str, d: ProxyDir, start: bool = True) -> Client:
        """The proxy started by the entry wrap writes into a host's configuration."""
        argv, env = wrap_entry(d.config)
        return self._start(Client(name, argv, d.path, dict(os.environ, **env)), start)

    def direct(self, name: str, server: str, env: dict | None = None,
               start: bool = True) -> Client:
        """The server itself, ``env`` added to this process's environment."""
        return self._start(Client(name, [PYTHON, server], self.root,
                                  dict(os.environ, **env) if env else None), start)

    def relay(self, name: str, server: str, start: bool = True) -> Client:
        """tests/bare_relay.py in front of ``server``: lines passed through, nothing read."""
        return self._start(Client(name, [PYTHON, BARE_RELAY, PYTHON, server], self.root),
                           start)

    def fastmcp(self, name: str, server: str, env: dict | None = None,
                start: bool = True) -> Client:
        argv = [self.fastmcp_python, self.fastmcp_script, json.dumps([PYTHON, server]),
                json.dumps(env or {})]
        return self._start(Client(name, argv, self.root), start)

    def stop(self, client: Client) -> None:
        if client in self.clients:
            self.clients.remove(client)
            client.stop()

    def stop_all(self) -> None:
        while self.clients:
            client = self.clients.pop()
            try:
                client.stop()
            except (OSError, subprocess.TimeoutExpired) as exc:
                print(f"bench: stopping {client.name} (pid {client.pid}): {exc}",
                      file=sys.stderr)


# ==== figures ====

def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest rank."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def stats(samples: list[float]) -> dict:
    """p50/p95/p99 in milliseconds, from samples in seconds."""
    if not samples:
        return {}
    s = sorted(samples)
    return {"n": len(s), "p50": percentile(s, 0.50) * MS, "p95": percentile(s, 0.95) * MS,
            "p99": percentile(s, 0.99) * MS}


def fmt_stats(st: dict) -> str:
    if not st:
        return "-"
    return f"{st['p50']:.2f} / {st['p95']:.2f} / {st['p99']:.2f}"


@dataclasses.dataclass
class Row:
    measure: str
    direct: str = "-"
    proxy: str = "-"
    overhead: str = "-"
    fastmcp: str = "-"
    target: str = ""
    met: bool | None = None
    note: str = ""


class Report:
    def __init__(self):
        self.rows: list[Row] = []
        self.ratios: list[str] = []
        self.notes: list[str] = []
        self.figures: dict = {}

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def print(self) -> None:
        head = Row("measure", "direct", "proxy", "overhead", "FastMCP", "target")
        rows = [head] + self.rows
        cells = [[r.measure, r.direct, r.proxy, r.overhead, r.fastmcp, r.target,
                  "result" if r is head else verdict(r)] for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
        for n, c in enumerate(cells):
            print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
            if n == 0:
                print("  ".join("-" * w for w in widths))
        for r in self.rows:
            if r.note:
                print(f"  {r.measure}: {r.note}")
        judged = [r for r in self.rows if r.met is not None]
        print(f"\ntargets met: {sum(bool(r.met) for r in judged)} of {len(judged)}")
        print("\nratios")
        for line in self.ratios:
            print(f"  {line}")
        for line in self.notes:
            print(f"note: {line}")


def verdict(row: Row) -> str:
    return {True: "met", False: "MISSED", None: "-"}[row.met]


# ==== the rows ====

def interleave(arms: dict, rounds: int, per_round: int, one) -> dict:
    """Rounds of ``per_round`` calls on each arm in turn, the order rotating each round;
    ``one(name, client, i)`` makes call i and returns its latency (or a tuple of them)."""
    samples: dict = {name: [] for name in arms}
    names = list(arms)
    n = 0
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(per_round):
                samples[name].append(one(name, arms[name], n))
                n += 1
    return samples


def warm(arms: dict, tool_of, args_of) -> None:
    for name, client in arms.items():
        for i in range(WARMUP_CALLS):
            client.ok(tool_of(name), args_of(f"warm-{i}"))


def overhead_row(measure: str, got: dict, limit: float | None, target: str,
                 vs_fastmcp: float | None = None) -> Row:
    """Overhead at p50 against direct. With ``vs_fastmcp`` and FastMCP measured, the
    target is that multiple of FastMCP's own overhead; otherwise ``limit`` in ms."""
    d, p = stats(got["direct"]), stats(got["proxy"])
    f = stats(got["fastmcp"]) if "fastmcp" in got else None
    over = p["p50"] - d["p50"]
    met = None if limit is None else over <= limit
    note = ""
    if vs_fastmcp is not None and f:
        f_over = f["p50"] - d["p50"]
        met = over <= vs_fastmcp * f_over
        target = f"overhead <= {vs_fastmcp:g}x FastMCP's"
        note = (f"overhead {over:+.2f} ms against FastMCP's {f_over:+.2f} ms: "
                f"{over / f_over:.2f}x" if f_over > 0 else "FastMCP's overhead is not positive")
    elif vs_fastmcp is not None:
        note = "FastMCP not measured: judged against the ms target"
    return Row(measure, fmt_stats(d), fmt_stats(p), f"{over:+.2f}",
               fmt_stats(f) if f else "skipped", target, met, note)


def p50_ratios(measure: str, got: dict) -> str:
    """proxy / direct, and proxy / FastMCP when it ran, at p50."""
    p = stats(got["proxy"])["p50"]
    line = f"{measure}, p50: proxy / direct {p / stats(got['direct'])['p50']:.3g}x"
    if got.get("fastmcp"):
        line += f", proxy / FastMCP {p / stats(got['fastmcp'])['p50']:.3g}x"
    return line


def read_row(arms: dict, tools: dict, plan: Plan, rep: Report) -> None:
    warm(arms, tools.get, lambda s: {"text": s})
    got = interleave(arms, plan.rounds, plan.per_round,
                     lambda name, c, i: c.ok(tools[name], {"text": f"read-{i}"}))
    rep.add(overhead_row("allowed read-only call", got, READ_OVERHEAD_MS,
                         f"overhead <= {READ_OVERHEAD_MS} ms", READ_VS_FASTMCP))
    rep.ratios.append(p50_ratios("allowed read-only call", got))
    rep.figures["read"] = {k: stats(v) for k, v in got.items()}
    if "relay" in got:
        d, r = stats(got["direct"]), stats(got["relay"])
        rep.add(Row("bare Python relay, read-only call", fmt_stats(d), fmt_stats(r),
                    f"{r['p50'] - d['p50']:+.2f}", target="(the floor)",
                    note="tests/bare_relay.py: the same lines passed both ways on one event "
                         "loop, nothing parsed, checked or recorded: the plumbing any Python "
                         "proxy on stdio pays"))


def mutating_rows(arms: dict, ledgers: dict, plan: Plan, rep: Report) -> None:
    """Each pay timed, then the identical pay at once, timed: a DUPLICATE for the proxy."""
    tool = {"direct": "pay", "proxy": "bank_pay", "fastmcp": "pay"}
    before = {name: ledger_lines(path) for name, path in ledgers.items()}
    refused = {name: 0 for name in arms}

    def one(name, c, i):
        args = {"to": f"payee-{name}-{i}", "amount": i + 1}
        first = c.ok(tool[name], args)
        again, result = c.call(tool[name], args)
        refused[name] += text(result).startswith("DUPLICATE")
        return first, again
    got = interleave(arms, plan.rounds, plan.per_round, one)
    firsts = {k: [a for a, _ in v] for k, v in got.items()}
    agains = {k: [b for _, b in v] for k, v in got.items()}
    rep.add(overhead_row("allowed mutating call", firsts, MUTATING_OVERHEAD_MS,
                         f"overhead <= {MUTATING_OVERHEAD_MS} ms", MUTATING_VS_FASTMCP))
    rep.ratios.append(p50_ratios("allowed mutating call", firsts))
    rep.ratios.append(p50_ratios("the identical pay repeated", agains))
    calls = plan.rounds * plan.per_round
    reached = {name: ledger_lines(path) - before[name] - calls for name, path in
               ledgers.items()}
    p = stats(agains["proxy"])
    f = stats(agains["fastmcp"]) if "fastmcp" in agains else None
    ok = p["p50"] <= DUPLICATE_TOTAL_MS and reached["proxy"] == 0 and refused["proxy"] == calls
    rep.add(Row("DUPLICATE refusal (total)", fmt_stats(stats(agains["direct"])),
                fmt_stats(p), "-", fmt_stats(f) if f else "skipped",
                f"<= {DUPLICATE_TOTAL_MS:g} ms, none reach upstream", ok,
                "repeats that reached the upstream: " +
                ", ".join(f"{k} {v} of {calls}" for k, v in reached.items()) +
                f"; refused as DUPLICATE by the proxy: {refused['proxy']} of {calls}"))
    rep.figures["mutating"] = {k: stats(v) for k, v in firsts.items()}
    rep.figures["duplicate"] = {"latency": {k: stats(v) for k, v in agains.items()},
                                "reached_upstream": reached, "refused": refused}


def same_request_rows(proxy: Client, direct: Client, plan: Plan, rep: Report) -> None:
    """One identical request, again and again; the first block against the last."""
    args = {"text": "the same request"}
    blocks: list[tuple[list[float], list[float]]] = []
    began = time.perf_counter()
    done = 0
    while done < plan.same_calls:
        p = [proxy.ok("echo_echo", args) for _ in range(BLOCK)]
        d = [direct.ok("echo", args) for _ in range(BLOCK)]
        blocks.append((p, d))
        done += BLOCK
        if time.perf_counter() - began > plan.same_deadline:
            break
    elapsed = time.perf_counter() - began
    first, last = blocks[0], blocks[-1]
    fp, lp = stats(first[0]), stats(last[0])
    fd, ld = stats(first[1]), stats(last[1])
    ratio = lp["p50"] / fp["p50"]
    stopped = done < plan.same_calls
    span = f"{done - BLOCK + 1:,}-{done:,}"
    rep.add(Row(f"same request, calls 1-{BLOCK}", fmt_stats(fd), fmt_stats(fp),
                f"{fp['p50'] - fd['p50']:+.2f}", "n/a", ""))
    rep.add(Row(f"same request, calls {span}", fmt_stats(ld), fmt_stats(lp),
                f"{lp['p50'] - ld['p50']:+.2f}", "n/a",
                f"p50 <= {SAME_REQUEST_RATIO:.2f}x calls 1-{BLOCK}",
                False if stopped else ratio <= SAME_REQUEST_RATIO,
                f"{done:,} identical calls through the proxy in {elapsed:.1f} s" +
                (f"; STOPPED at the {plan.same_deadline:.0f} s deadline, short of "
                 f"{plan.same_calls:,}" if stopped else "")))
    rep.ratios.append(f"same request: calls {span} / calls 1-{BLOCK}, p50: proxy "
                      f"{ratio:.2f}x, direct {ld['p50'] / fd['p50']:.2f}x")
    rep.figures["same_request"] = {"calls": done, "target_calls": plan.same_calls,
                                   "seconds": elapsed, "first": fp, "last": lp,
                                   "direct_first": fd, "direct_last": ld, "ratio": ratio}


# -- the database of recorded runs --

def build_runs(database: str, runs: int) -> float:
    """Copy the one run the proxy recorded (its run, step, events and index row) ``runs``
    times, with fresh ids and request keys, in one transaction of plain SQL; seconds taken.
    The proxy must not be running."""
    began = time.perf_counter()
    conn = sqlite3.connect(database, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")     # the proxy switches it back to WAL
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("PRAGMA cache_size=-1000000")
        conn.execute("PRAGMA temp_store=MEMORY")
        (template,) = conn.execute("SELECT run_id FROM proxy_calls").fetchone()
        (step,) = conn.execute("SELECT id FROM steps WHERE run_id=?", (template,)).fetchone()
        (events,) = conn.execute("SELECT MAX(seq) FROM events").fetchone()
        conn.execute("BEGIN")
        conn.execute("CREATE TEMP TABLE ids (i INTEGER PRIMARY KEY, run TEXT, step TEXT, "
                     "key TEXT)")
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            "INSERT INTO ids SELECT i, ? || '.' || printf('%016x', random()), "
            "printf('%016x%016x', random(), random()), "
            "printf('%016x%016x%016x%016x', random(), random(), random(), random()) FROM n",
            (runs, SESSION))
        conn.execute("INSERT INTO runs SELECT ids.run, goal, status, reason, reason_detail, "
                     "limits_json, step_count, created_at, started_at, finished_at, "
                     "result_json, active_ms, lease_owner, lease_expires_at "
                     "FROM ids, runs WHERE runs.id=?", (template,))
        conn.execute("INSERT INTO steps SELECT ids.step, ids.run, idx, status, decision_json, "
                     "policy_json, observation_json, observation_hash, started_at, "
                     "finished_at, spec_hash, policy_id FROM ids, steps WHERE steps.id=?",
                     (step,))
        conn.execute("INSERT INTO events (seq, run_id, step_id, at, type, payload_json, hash) "
                     "SELECT e.seq + ids.i * ?, ids.run, CASE WHEN e.step_id='' THEN '' ELSE "
                     "ids.step END, e.at, e.type, e.payload_json, e.hash "
                     "FROM ids, events e WHERE e.run_id=? ORDER BY ids.i, e.seq",
                     (events, template))
        conn.execute("INSERT INTO proxy_calls (session, request_key, tool, side_effect, "
                     "run_id, created_at, open, closed_at, settled_at, outcome) "
                     "SELECT session, ids.key, tool, side_effect, ids.run, created_at, open, "
                     "closed_at, settled_at, outcome FROM ids, proxy_calls WHERE run_id=?",
                     (template,))
        conn.execute("COMMIT")
        # Back to the proxy's own journal mode, on disk: otherwise the proxy's first sync
        # at start-up would flush what this unsynced build wrote, and be timed for it.
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()
    return time.perf_counter() - began


def database_rows(lab: Lab, dirs: dict, direct: Client, plan: Plan, rep: Report) -> None:
    empty_dir, full_dir = dirs["db-empty"], dirs["db-full"]
    seed = lab.proxy("db-seed", full_dir)         # records the run that is copied
    seed.ok("echo_echo", {"text": "template"})
    lab.stop(seed)
    took = build_runs(full_dir.database, plan.db_runs)
    size = os.path.getsize(full_dir.database) / KIB / KIB
    arms = {"direct": direct, "empty": lab.proxy("db-empty", empty_dir),
            "full": lab.proxy("db-full", full_dir)}
    tools = {"direct": "echo", "empty": "echo_echo", "full": "echo_echo"}
    warm(arms, tools.get, lambda s: {"text": s})
    got = interleave(arms, plan.db_rounds, plan.db_per_round,
                     lambda name, c, i: c.ok(tools[name], {"text": f"db-read-{i}"}))
    d, e, f = stats(got["direct"]), stats(got["empty"]), stats(got["full"])
    ratio = f["p50"] / e["p50"]
    rep.add(Row("allowed read, empty database", fmt_stats(d), fmt_stats(e),
                f"{e['p50'] - d['p50']:+.2f}", "n/a", ""))
    rep.add(Row(f"allowed read, {plan.db_runs:,} recorded runs", fmt_stats(d), fmt_stats(f),
                f"{f['p50'] - d['p50']:+.2f}", "n/a",
                f"p50 <= {FULL_DATABASE_RATIO:.2f}x empty", ratio <= FULL_DATABASE_RATIO,
                f"built by plain SQL in {took:.1f} s, {size:,.0f} MiB; the proxy started on "
                f"it in {arms['full'].ready_after * MS:.0f} ms (on the empty one in "
                f"{arms['empty'].ready_after * MS:.0f} ms)"))
    rep.ratios.append(f"{plan.db_runs:,} recorded runs / empty database, p50: {ratio:.2f}x")
    rep.figures["database"] = {"runs": plan.db_runs, "build_seconds": took, "mib": size,
                               "direct": d, "empty": e, "full": f, "ratio": ratio}
    lab.stop(arms["empty"])
    lab.stop(arms["full"])


# A sum limit that never refuses (its max is far above what the bench pays), so that what is
# timed is its cost alone: one indexed query and one row, in the start's transaction.
LIMIT_RULES = dict(BANK_RULES, pay=dict(PAY_RULES, limits=[
    {"sum": "/amount", "max": "1e30", "per": "31d", "name": "bench"}]))
LIMIT_KEY = json.dumps(["name", "bench", "sum /amount per 744h"], separators=(",", ":"))


def build_limit_rows(database: str, rows: int) -> float:
    """``rows`` executions of the bench limit within its window, in proxy_limit_uses, by
    plain SQL (each adds 1: n and its running total rise by one each); seconds taken."""
    began = time.perf_counter()
    conn = sqlite3.connect(database, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("PRAGMA synchronous=OFF")
        (n,) = conn.execute("SELECT COUNT(*) FROM proxy_limit_uses").fetchone()
        if n:
            raise BenchError("the limit's table was not empty")
        conn.execute("BEGIN")
        conn.execute(
            "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < ?) "
            "INSERT INTO proxy_limit_uses (key, n, at, total, run_id, step_id) "
            "SELECT ?, i, ? + i * 1e-3, printf('%d', i) || ?, 'bench', 'bench' FROM k",
            (rows, LIMIT_KEY, time.time() - rows * 1e-3 - 60, "0" * 36))
        conn.execute("COMMIT")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()
    return time.perf_counter() - began


def time_use_query(database: str, calls: int = 2000) -> float:
    """Microseconds of one read of the bench limit's use, the query a call under the limit
    runs (the proxy's own SQL text, imported), on the database as built."""
    sys.path.insert(0, ROOT)
    import agentrt_proxy
    conn = sqlite3.connect(database)
    try:
        now = time.time()
        began = time.perf_counter()
        for i in range(calls):
            conn.execute(agentrt_proxy._USE_SQL, (LIMIT_KEY, now - 31 * 86400 + i)).fetchall()
        return (time.perf_counter() - began) / calls * 1e6
    finally:
        conn.close()


def limit_rows(lab: Lab, dirs: dict, plan: Plan, rep: Report) -> None:
    """Allowed pays without a limit, under a sum limit with an empty history, and under one
    whose window holds a million executions, side by side."""
    rows = LIMIT_ROWS_QUICK if plan is QUICK else LIMIT_ROWS_FULL
    seed = lab.proxy("limit-seed", dirs["limit-full"])      # creates the tables
    lab.stop(seed)
    took = build_limit_rows(dirs["limit-full"].database, rows)
    query_us = time_use_query(dirs["limit-full"].database)
    arms = {name: lab.proxy(name, dirs[name]) for name in ("no-limit", "limit-empty",
                                                             "limit-full")}

    def one(name, c, i):
        return c.ok("bank_pay", {"to": f"limit-{name}-{i}", "amount": 1})
    warm(arms, lambda name: "bank_pay", lambda s: {"to": s, "amount": 1})
    got = interleave(arms, plan.rounds, plan.per_round, one)
    base, empty, full = (stats(got[k]) for k in ("no-limit", "limit-empty", "limit-full"))
    for label, st in (("sum limit, empty history", empty),
                      (f"sum limit, {rows:,} executions in the window", full)):
        extra = st["p50"] - base["p50"]
        rep.add(Row(f"allowed mutating call, {label}", fmt_stats(base), fmt_stats(st),
                    f"{extra:+.2f} vs no limit", "n/a", f"<= +{LIMIT_EXTRA_MS} ms",
                    extra <= LIMIT_EXTRA_MS,
                    "" if st is empty else f"the window's rows built by plain SQL in "
                                           f"{took:.1f} s; the use query alone on them: "
                                           f"{query_us:.0f} us"))
    rep.figures["limits"] = {"rows": rows, "no_limit": base, "empty": empty, "full": full,
                             "use_query_us": query_us}
    for arm in arms.values():
        lab.stop(arm)


class _Captured:
    """The store's connection, every statement it is given recorded with its parameters."""

    def __init__(self, conn: sqlite3.Connection, into: list):
        self._conn, self._into = conn, into

    def execute(self, sql: str, params=()):
        self._into.append((sql, tuple(params)))
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


def records_alone(root: str, tool: str, calls: int) -> tuple[float, float]:
    """What an allowed call's records cost with no Python of the proxy's: the statements
    ``calls`` calls of ``tool`` ran in-process (tests/profile_call.py's set-up, an instant
    upstream), captured with their parameters, are replayed by sqlite3 on a copy of the
    database as it was before them, here on this disk, each call's commits followed by
    the syncs of the WAL the proxy makes for it (one for a read's outcome; the attempt's
    and the outcome's for a mutating call). Returns ms a call, and statements a call."""
    sys.path.insert(0, HERE)
    import pathlib
    from profile_call import RULES, arguments
    from proxy_harness import ProxyHarness
    from test_rules_cost import InstantServer, instant_proxy
    where = tempfile.mkdtemp(prefix=f"records-{tool}-", dir=root)
    h = ProxyHarness(pathlib.Path(where), rules=RULES)
    proxy = instant_proxy(h, InstantServer())
    per_call: list[list] = []
    try:
        for i in range(WARMUP_CALLS * 10):
            h.run(proxy.call(tool, arguments(tool, i)))
        h.store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        copy = sqlite3.connect(os.path.join(where, "replay.db"))
        h.store.conn.backup(copy)
        copy.close()
        real = h.store.conn
        for i in range(calls):
            per_call.append([])
            h.store.conn = _Captured(real, per_call[-1])
            try:
                h.run(proxy.call(tool, arguments(tool, 1000 + i)))
            finally:
                h.store.conn = real
    finally:
        proxy.close()
        h.close()
    syncs_after = {"COMMIT"} if tool == "bank_pay" else set()
    conn = sqlite3.connect(os.path.join(where, "replay.db"), isolation_level=None)
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "foreign_keys=ON"):
        conn.execute(f"PRAGMA {pragma}")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("COMMIT")                           # the WAL file exists from here on
    wal = os.open(os.path.join(where, "replay.db-wal"), os.O_RDWR)
    try:
        began = time.perf_counter()
        for statements in per_call:
            for sql, params in statements:
                conn.execute(sql, params).fetchall()
                if sql in syncs_after:
                    os.fsync(wal)
            if not syncs_after:
                os.fsync(wal)                        # the read's one sync, before its answer
        took = time.perf_counter() - began
    finally:
        os.close(wal)
        conn.close()
    return took / calls * MS, sum(len(c) for c in per_call) / calls


def records_row(rep: Report, root: str, calls: int) -> None:
    """The floor under the read and mutating rows: their records alone, against the
    FastMCP overhead those rows measured (a proxy that records nothing)."""
    for tool, row, key, factor in (("bank_balance", "read", "read", READ_VS_FASTMCP),
                                   ("bank_pay", "mutating", "mutating", MUTATING_VS_FASTMCP)):
        ms, statements = records_alone(root, tool, calls)
        got = rep.figures.get(key, {})
        note = (f"the {statements:g} statements of an allowed {row} call replayed by sqlite3 "
                f"with its syncs of the WAL, no proxy Python")
        f_over = got["fastmcp"]["p50"] - got["direct"]["p50"] if "fastmcp" in got else None
        if f_over and f_over > 0:
            note += (f": {ms / f_over:.2f}x FastMCP's overhead ({f_over:.2f} ms), where the "
                     f"{row} row's target allows {factor:g}x ({factor * f_over:.2f} ms)")
            if "relay" in got:
                both = ms + got["relay"]["p50"] - got["direct"]["p50"]
                note += (f"; with the bare relay's plumbing, {both:.2f} ms: "
                         f"{both / f_over:.2f}x, before any of the proxy's own Python")
        rep.add(Row(f"records alone, {row}", proxy=f"{ms:.2f}", overhead=f"{ms:+.2f}",
                    fastmcp=f"{f_over:+.2f}" if f_over else "skipped", target="(the floor)",
                    note=note))
        rep.figures.setdefault("records_alone", {})[row] = {"ms": ms, "statements": statements}


def flight_row(arms: dict, tools: dict, plan: Plan, rep: Report) -> None:
    walls = {name: 0.0 for name in arms}
    samples: dict = {name: [] for name in arms}
    names = list(arms)
    for r in range(plan.flight_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            calls = [(tools[name], {"text": f"flight-{r}-{i}"}) for i in range(plan.flight_calls)]
            lat, wall = arms[name].pipeline(calls, IN_FLIGHT)
            samples[name] += lat
            walls[name] += wall
    rate = {name: len(samples[name]) / walls[name] for name in arms}
    cell = {name: f"{rate[name]:,.0f}/s; {fmt_stats(stats(samples[name]))}" for name in arms}
    vs = rate["proxy"] / rate["fastmcp"] if "fastmcp" in rate else None
    met = rate["proxy"] >= INFLIGHT_MIN_RATE if vs is None else vs >= INFLIGHT_VS_FASTMCP
    rep.add(Row(f"{IN_FLIGHT} in flight, read-only", cell["direct"], cell["proxy"],
                f"{rate['proxy'] / rate['direct']:.3g}x direct", cell.get("fastmcp", "skipped"),
                f">= {INFLIGHT_MIN_RATE:,.0f}/s" if vs is None else
                f">= {INFLIGHT_VS_FASTMCP:g}x FastMCP's rate", met,
                f"{vs:.2f}x FastMCP's rate" if vs is not None else
                "FastMCP not measured: judged against the rate target"))
    rep.ratios.append(f"{IN_FLIGHT} in flight, calls/s: proxy / direct "
                      f"{rate['proxy'] / rate['direct']:.3g}x"
                      + (f", proxy / FastMCP {vs:.2f}x" if vs is not None else ""))
    rep.figures["in_flight"] = {"rate": rate, "latency": {k: stats(v) for k, v in
                                                          samples.items()}}


# -- large payloads --

WORDS = ("the gate records every call before it runs and answers the host with what the "
         "server said; an operator approves by hash").split()
LINE_WORDS = 13                  # about 80 bytes a line: one escaped newline per line


def plain_text(size: int) -> str:
    """``size`` bytes of ASCII prose in lines."""
    line = " ".join(WORDS[:LINE_WORDS]) + "\n"
    return (line * (size // len(line) + 1))[:size]


def json_text(size: int) -> str:
    """About ``size`` bytes of a JSON array, a record a line: a quote every few bytes, each
    escaped (as is each newline) when the file is read as text into an answer's frame."""
    lines: list[str] = []
    total = 0
    while total < size:
        i = len(lines)
        lines.append(json.dumps({"id": i, "name": f"item-{i}", "path": f"/srv/data/{i}.json",
                                 "tags": ["alpha", "beta"], "done": i % 2 == 0,
                                 "parent": None}, separators=(",", ":")))
        total += len(lines[-1]) + 2
    return "[\n" + ",\n".join(lines) + "\n]"


@dataclasses.dataclass(frozen=True)
class Large:
    """One large-payload row: the call each arm makes, and the frame that carries the
    payload (the host's request for an argument, the server's answer for a result)."""
    label: str
    tool: str                    # the server's name; the proxy's is files_<tool>
    args: object                 # (arm, i) -> the call's arguments
    frame: bytes
    vs_fastmcp: float
    size: int                    # payload bytes: how many calls a round makes
    parsed: bool = False         # its frame is one of the strict-parse rows'
    peak_judged: bool = False    # its peak memory row has a target


def large_cases(files: str) -> list[Large]:
    """The rows' calls and frames; the files they read are written under ``files``."""
    sys.path.insert(0, HERE)
    import echo_server
    import files_server

    def answered(tool: str, args: dict) -> bytes:
        return echo_server.frame({"jsonrpc": "2.0", "id": 1,
                                  "result": files_server.call(tool, args, files)})
    body = plain_text(ARGUMENT_BYTES)

    def write_args(arm: str, i: int) -> dict:        # distinct: never a DUPLICATE
        return {"path": f"written-{arm}.txt", "content": f"{arm} {i}\n{body}"}
    request = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "files_write_file", "arguments": write_args("proxy", 0)}}
    cases = [Large("1 MB argument, allowed write_file", "write_file", write_args,
                   wire(request), ARGUMENT_VS_FASTMCP, ARGUMENT_BYTES, parsed=True)]
    for kind, make in (("text", plain_text), ("JSON text", json_text)):
        for label, size in READ_SIZES:
            name = f"{label.replace(' ', '')}-{kind.replace(' ', '-')}.txt"
            with open(os.path.join(files, name), "w") as f:
                f.write(make(size))
            args = {"path": name}
            judged = (label, kind) == JUDGED_PEAK
            cases.append(Large(f"read of {label} {kind}", "read_file",
                               lambda arm, i, args=args: args, answered("read_file", args),
                               LARGE_READ_VS_FASTMCP, size, parsed=judged, peak_judged=judged))
    listing = {"count": LISTING_ENTRIES, "prefix": "entry"}
    frame = answered("list_entries", listing)
    cases.append(Large(f"{LISTING_ENTRIES:,}-entry structured result", "list_entries",
                       lambda arm, i: listing, frame, LISTING_VS_FASTMCP, len(frame), parsed=True))
    return cases


def large_rows(lab: Lab, d: ProxyDir, cases: list[Large], plan: Plan, with_fastmcp: bool,
               rep: Report) -> None:
    """Each case side by side, tests/files_server.py direct, behind the proxy and behind
    FastMCP; after it, each arm's peak memory over its calls (VmHWM, lowered to VmRSS
    before them), the target on the 4 MB JSON text's."""
    env = {"FILES_ROOT": lab.files}
    arms = {"direct": lab.direct("direct-files", FILES_SERVER, env, start=False),
            "proxy": lab.proxy("proxy-files", d, start=False)}
    if with_fastmcp:
        arms["fastmcp"] = lab.fastmcp("fastmcp-files", FILES_SERVER, env, start=False)
    for client in arms.values():                 # side by side
        client.start()
    tool = {arm: ("files_" if arm == "proxy" else "") for arm in arms}
    for case in cases:
        def one(arm, c, i):
            return c.ok(tool[arm] + case.tool, case.args(arm, i))
        interleave(arms, 1, 1, one)                  # untimed: each path warmed for this size
        before = {arm: reset_peak(c.pid) for arm, c in arms.items()}
        got = interleave(arms, plan.large_rounds, max(1, plan.large_bytes // case.size), one)
        growth = {arm: status_mb(c.pid, "VmHWM") - before[arm] for arm, c in arms.items()}
        rep.add(overhead_row(case.label, got, None, "", case.vs_fastmcp))
        rep.ratios.append(p50_ratios(case.label, got))
        frame_mb = len(case.frame) / MB
        judged = case.peak_judged
        cell = {arm: f"{g:+.0f} MB" for arm, g in growth.items()}
        rep.add(Row(f"peak memory, {case.label}", cell["direct"], cell["proxy"],
                    f"{growth['proxy'] / frame_mb:.1f}x frame", cell.get("fastmcp", "skipped"),
                    f"<= {PEAK_VS_FRAME:g}x frame" if judged else "",
                    growth["proxy"] <= PEAK_VS_FRAME * frame_mb if judged else None,
                    f"VmHWM growth over the row's calls; the frame is {frame_mb:.1f} MB"))
        rep.figures.setdefault("large", {})[case.label] = {
            "frame_bytes": len(case.frame), "latency": {k: stats(v) for k, v in got.items()},
            "peak_growth_mb": growth}
    for client in arms.values():
        lab.stop(client)


def parse_rows(cases: list[Large], plan: Plan, rep: Report) -> None:
    """In-process: the proxy's strict parse against json.loads on three of the frames."""
    sys.path.insert(0, ROOT)
    import agentrt_proxy
    parsers = {"json.loads": json.loads, "parse_json": agentrt_proxy.parse_json}
    for case in (c for c in cases if c.parsed):
        def one(name, parse, i):
            began = time.perf_counter()
            parse(case.frame)
            return time.perf_counter() - began
        got = interleave(parsers, plan.parse_rounds, 1, one)
        j, p = stats(got["json.loads"]), stats(got["parse_json"])
        ratio = p["p50"] / j["p50"]
        rep.add(Row(f"strict parse, {case.label} frame", f"{j['p50']:.1f}", f"{p['p50']:.1f}",
                    f"{ratio:.2f}x", "n/a", f"<= {STRICT_PARSE_VS_JSON:g}x json.loads",
                    ratio <= STRICT_PARSE_VS_JSON,
                    f"ms at p50 of {plan.parse_rounds}: json.loads (direct column) and "
                    f"agentrt_proxy.parse_json (proxy column) on the {len(case.frame) / MB:.1f}"
                    f" MB frame"))
        rep.figures.setdefault("strict_parse", {})[case.label] = {
            "json_loads": j, "parse_json": p, "ratio": ratio}


def startup_row(lab: Lab, d: ProxyDir, plan: Plan, with_fastmcp: bool, rep: Report) -> None:
    """Process start to the first tools/list answer: the proxy as wrap writes it into a host's
    configuration (the target), and beside it the forms the README offers for a faster
    start, all against the server's own start and FastMCP's."""
    starts = {"direct": lambda: lab.direct("startup-direct", FAKE_SERVER),
              "proxy": lambda: lab.wrapped("startup-wrapped", d),
              "module": lambda: lab.proxy("startup-module", d)}
    if MODULE_RUN:
        starts["site"] = lambda: lab.proxy("startup-site", d, site=True)
    if with_fastmcp:
        starts["fastmcp"] = lambda: lab.fastmcp("startup-fastmcp", FAKE_SERVER)

    def one(name, start, i):
        client = start()
        lab.stop(client)
        return client.ready_after
    interleave(starts, 1, 1, one)            # once untimed: the database made, files cached
    got = interleave(starts, plan.startup_rounds, 1, one)
    wrapped = {k: v for k, v in got.items() if k in ("direct", "proxy", "fastmcp")}
    row = overhead_row("start-up to first tools/list, as wrap writes it", wrapped,
                       STARTUP_BEYOND_MS, f"beyond upstream <= {STARTUP_BEYOND_MS:.0f} ms")
    row.note = ("started by wrap's host entry: " +
                " ".join(os.path.basename(a) for a in wrap_entry(d.config)[0]) +
                "; a script run compiles the whole file at every start (CPython caches the "
                "compiled form of modules only)")
    rep.add(row)
    rep.ratios.append(p50_ratios("start-up (as wrap writes it)", wrapped))

    def beside(arm: str, measure: str, short: str, note: str) -> None:
        """Another way of starting the proxy, against the same upstream starts."""
        other = dict(wrapped, proxy=got[arm])
        row = overhead_row(measure, other, None, "")
        row.note = note
        rep.add(row)
        rep.ratios.append(p50_ratios(short, other))
    if MODULE_RUN:
        beside("module", "start-up, python3 -S -P -m agentrt_proxy", "start-up (python3 -S -P -m)",
               "the compiled form cached, no site: the bench's other proxy arms")
        beside("site", "start-up, python3 -P -m (site runs)", "start-up (python3 -P -m, site)",
               "site runs the .pth files of site-packages before the proxy's first line; "
               "-S skips it")
    rep.figures["startup"] = {k: stats(v) for k, v in got.items()}


def memory_row(lab: Lab, d: ProxyDir, rep: Report) -> None:
    proxy = lab.proxy("held", d)
    proxy.ok("bank_balance", {"account": "A-1"})
    idle = status_mb(proxy.pid)
    for i in range(HELD_CALLS):
        proxy.send("tools/call", {"name": "bank_refund", "arguments": {"payment": f"p-{i}"}})
    waiting = wait_pending(d.database, HELD_CALLS)
    held = status_mb(proxy.pid)
    lab.stop(proxy)
    rep.add(Row(f"memory, {HELD_CALLS} calls held", "n/a", f"{held:.1f} MB",
                f"+{held - idle:.1f} MB on idle", "n/a",
                f"<= {HELD_RSS_MB:.0f} MB", held <= HELD_RSS_MB,
                f"VmRSS of the proxy with {waiting} approvals pending (idle: {idle:.1f} MB)"))
    rep.figures["memory"] = {"idle_mb": idle, "held_mb": held, "held": waiting}


def wait_pending(database: str, want: int) -> int:
    """Poll the database (read-only) until ``want`` approvals are pending."""
    deadline = time.monotonic() + HELD_WAIT
    while True:
        conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
        try:
            (n,) = conn.execute("SELECT COUNT(*) FROM approvals WHERE status='pending'"
                                ).fetchone()
        finally:
            conn.close()
        if n >= want:
            return n
        if time.monotonic() > deadline:
            raise BenchError(f"only {n} of {want} calls held after {HELD_WAIT:.0f} s")
        time.sleep(POLL)


# ==== main ====

def fastmcp_available(python: str) -> tuple[bool, str]:
    try:
        p = subprocess.run([python, "-c", "import fastmcp; print(fastmcp.__version__)"],
                           capture_output=True, text=True, timeout=PIN_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if p.returncode != 0:
        return False, (p.stderr.strip().splitlines() or ["import failed"])[-1]
    return True, p.stdout.strip()


def machine() -> str:
    return (f"{platform.platform()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}")


def measure(lab: Lab, plan: Plan, with_fastmcp: bool, rep: Report) -> None:
    dirs = {"main": lab.proxy_dir("main", bank=True, echo=True),
            "db-empty": lab.proxy_dir("db-empty", bank=False, echo=True),
            "db-full": lab.proxy_dir("db-full", bank=False, echo=True),
            "startup": lab.proxy_dir("startup", bank=True, echo=False),
            "held": lab.proxy_dir("held", bank=True, echo=False, hold=HOLD,
                                  max_pending=HELD_MAX_PENDING),
            "no-limit": lab.proxy_dir("no-limit", bank=True, echo=False),
            "files": lab.proxy_dir("files", bank=False, echo=False, files=True),
            "limit-empty": lab.proxy_dir("limit-empty", bank=True, echo=False,
                                         bank_rules=LIMIT_RULES),
            "limit-full": lab.proxy_dir("limit-full", bank=True, echo=False,
                                        bank_rules=LIMIT_RULES)}
    lab.pin(list(dirs.values()))
    main_dir = dirs["main"]
    direct = {"echo": lab.direct("direct-echo", ECHO_SERVER, start=False),
              "bank": lab.direct("direct-bank", FAKE_SERVER,
                                 ledger_env(os.path.join(lab.root, "direct.ledger")),
                                 start=False)}
    proxy = lab.proxy("proxy", main_dir, start=False)
    relay = lab.relay("relay-echo", ECHO_SERVER, start=False)
    fm = {}
    if with_fastmcp:
        fm = {"echo": lab.fastmcp("fastmcp-echo", ECHO_SERVER, start=False),
              "bank": lab.fastmcp("fastmcp-bank", FAKE_SERVER,
                                  ledger_env(os.path.join(lab.root, "fastmcp.ledger")),
                                  start=False)}
    for client in [*direct.values(), proxy, relay, *fm.values()]:     # side by side
        client.start()
    cases = large_cases(lab.files)
    reads = {"direct": direct["echo"], "proxy": proxy, **({"fastmcp": fm["echo"]} if fm else {})}
    read_tools = {"direct": "echo", "proxy": "echo_echo", "fastmcp": "echo"}
    pays = {"direct": direct["bank"], "proxy": proxy, **({"fastmcp": fm["bank"]} if fm else {})}
    ledgers = {"direct": os.path.join(lab.root, "direct.ledger"), "proxy": main_dir.ledger,
               **({"fastmcp": os.path.join(lab.root, "fastmcp.ledger")} if fm else {})}
    steps = [
        ("read", lambda: read_row({**reads, "relay": relay}, {**read_tools, "relay": "echo"},
                                  plan, rep)),
        ("mutating", lambda: mutating_rows(pays, ledgers, plan, rep)),
        ("records alone", lambda: records_row(rep, lab.root, plan.records_calls)),
        ("in flight", lambda: flight_row(reads, read_tools, plan, rep)),
        ("same request", lambda: same_request_rows(proxy, direct["echo"], plan, rep)),
        ("database", lambda: database_rows(lab, dirs, direct["echo"], plan, rep)),
        ("limits", lambda: limit_rows(lab, dirs, plan, rep)),
        ("large payloads", lambda: large_rows(lab, dirs["files"], cases, plan, with_fastmcp,
                                              rep)),
        ("strict parse", lambda: parse_rows(cases, plan, rep)),
        ("start-up", lambda: startup_row(lab, dirs["startup"], plan, with_fastmcp, rep)),
        ("memory", lambda: memory_row(lab, dirs["held"], rep)),
    ]
    for name, step in steps:
        began = time.perf_counter()
        try:
            step()
        except BenchError as exc:
            rep.add(Row(name, target="(not measured)", met=False, note=f"ERROR: {exc}"))
        rep.figures.setdefault("seconds", {})[name] = time.perf_counter() - began


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="The proxy's benchmark of record.")
    p.add_argument("-quick", "--quick", action="store_true", help="fewer calls: under a minute")
    p.add_argument("-json", "--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--fastmcp-python", metavar="PATH", default=PYTHON,
                   help="the interpreter that can import fastmcp (default: this one)")
    p.add_argument("--dir", metavar="DIR", default=None,
                   help="where the temporary directory goes (default: the system's)")
    return p


def _terminated(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so that the finally blocks stop every arm by pid."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    plan = QUICK if args.quick else FULL
    began = time.perf_counter()
    print(f"machine: {machine()}")
    with_fastmcp, fm_note = fastmcp_available(args.fastmcp_python)
    print(f"FastMCP: {fm_note} ({args.fastmcp_python})" if with_fastmcp else
          f"FastMCP: skipped, cannot import fastmcp with {args.fastmcp_python}: {fm_note}")
    rep = Report()
    with tempfile.TemporaryDirectory(prefix="agentrt-bench-", dir=args.dir) as root:
        print(f"run: {'quick' if args.quick else 'full'}, in {root}\n")
        lab = Lab(root, args.fastmcp_python if with_fastmcp else None)
        try:
            measure(lab, plan, with_fastmcp, rep)
        finally:
            lab.stop_all()
    total = time.perf_counter() - began
    rep.notes.append(f"the whole run took {total:.1f} s")
    rep.print()
    rep.figures.update(machine=machine(), quick=args.quick, fastmcp=fm_note if with_fastmcp
                       else None, seconds_total=total,
                       rows=[dataclasses.asdict(r) for r in rep.rows])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.figures, f, indent=2)
    return 1 if any(r.note.startswith("ERROR") for r in rep.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
