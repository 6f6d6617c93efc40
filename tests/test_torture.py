"""Crash torture: two proxy processes on one session and one database, killed and stalled
at random points many times, with the books checked after every trial.

Each trial starts two real proxies (`python agentrt_proxy.py -config proxy.json`) over
pipes. Behind each, the fake payment server, twice: `bank`, whose pay the operator's rule
allows, and `vault`, whose pay waits for an approval; both write one ledger. Then, at once:

- a host per proxy sends a random mix of calls: new payments (plain, `slow`, `block`,
  `error`), identical retries (often of a request that waits or was cut off, sometimes two
  at once, sometimes through the other proxy), changed arguments, reads and the status tool;
- a releaser lets `block` payments inside the server answer now and then; a `vault` one not
  released within 3 s times out (an unknown outcome); `bank`'s pay waits longer than a stall;
- an operator decides what waits with the real command line, and is itself killed
  mid-decision now and then: it approves, rejects or cancels an ordinary approval, and
  approves every interruption approval it finds, after a random wait, through one of three
  channels at random: `approve`, the inbox (`inbox -once -tty-not-required`, answering on a
  pipe) or the webhook (one process per trial on a free loopback port, a signed GET then a
  signed POST). What each channel answered (exit code, HTTP status) is in the timeline; a
  refusal (the attempt's outcome is known by now, it was decided elsewhere) is an answer;
- a killer sends SIGKILL to a random proxy at a random moment, often while a payment of its
  host is inside the server, and starts it again;
- a staller sends SIGSTOP to a proxy while a `slow` or `block` payment of its host is inside
  the server (the server writes its ledger line before it answers), keeps it stopped past
  its lease, has the other proxy's host make the identical call once the lease ran out (it
  takes the run over and an interruption approval is asked), and sends SIGCONT: the stopped
  proxy then gets the server's answer and records it as a late outcome of that attempt.

Then everything is stopped, and the books are read from the ledger and, read-only, from the
database (`check_books`): every payment is matched by an executed attempt, no request is
paid twice without an approved re-run of an unknown outcome (or a known outcome more than
the window earlier), no re-run starts after a known outcome of the attempt it re-runs was
recorded (`check_reruns`: approving an interruption whose late outcome is in must not pay
again), every run is finished, waiting on an approval, or resolvable by the next identical
call (which a fresh proxy then makes, and the books are read again), no tool is BLOCKED with
nothing to act on, no approval is lost or changed, and `verify` finds the chain intact.

    python3 -m pytest -q tests/test_torture.py        # CI: at least 30 kills and 4 stalls
    TORTURE_STALLS=300 TORTURE_KILLS=1000 python3 -m pytest -q -s tests/test_torture.py  # long
    TORTURE_SEED=1234 python3 -m pytest -q -s tests/test_torture.py        # replay a seed

TORTURE_KILLS and TORTURE_STALLS (defaults 30 and 4) are the least numbers of kills and
stalls; they are shared evenly over trials of at most 20 kills and 6 stalls. The seed and
each trial's kill schedule are printed, then one line: kills, stalls (taken over, late
outcomes recorded, known), payments, double executions, re-runs of a recorded outcome, and
how the interruption approvals went on each channel. A failing trial prints its timeline:
the host calls, kills, stalls and operator decisions, the ledger, the runs, the events and
each process's stderr. Processes are real, so a replay follows the same schedule and
choices, not the same interleaving to the millisecond. Every process is ended by the pid it
was started under.

The tasks trial runs one trial twice with the same seed and kill schedule: with both
servers answering pay with a task they keep across their own restarts (the fake server's
tasks mode), and without. Both books must balance, and with tasks the operator must be asked
about fewer cut-off payments (a proxy taking over asks the server first); it prints both
counts and how many outcomes were learned from the server.

    python3 -m pytest -q -s tests/test_torture.py -k tasks     # CI: 12 kills each
    TORTURE_TASK_KILLS=100 python3 -m pytest -q -s tests/test_torture.py -k tasks

The budget trial: two proxies on one database pay through one tool under two sum limits of
one 2 s window, `cap` (over it: deny) and `soft` (over it: an approval), and a condition
that asks about large amounts. Each host keeps 16 calls in flight; a killer sends SIGKILL to
a random proxy after every 100 to 300 answers; the operator approves most of what waits and
rejects the rest. The books, from the events: in every window that ends at an execution,
the executions sum to at most `cap`, and to at most `soft` plus those an operator approved
over it; and the ledger holds nothing that no execution started. A planted mutant, checking
the limits only before the start's transaction, must fail the same books.

    python3 -m pytest -q -s tests/test_torture.py -k budget     # CI: 1,500 answers, 6 kills

The trial is counted in answers, never in seconds, so that a slow machine runs the same
trial, only longer (10 to 30 s on a 2-core machine, busy or not). Past its answers it goes
on without kills until the books hold a refusal by the cap and a run approved over soft
(the kills may leave no window that reaches the cap), at most twice its answers more. The
mutant's trial stops once a window is over, at most 6,000 answers. Only a trial that gets
no answer at all for 120 s fails for time: it is stuck.
    TORTURE_BUDGET_ANSWERS=90000 python3 -m pytest -q -s tests/test_torture.py -k budget
"""

from __future__ import annotations

import dataclasses
import decimal
import hashlib
import hmac
import http.client
import json
import math
import os
import queue
import random
import re
import secrets
import select
import signal
import sqlite3
import subprocess
import threading
import time
import traceback

from process_helpers import (FAKE_SERVER, PROXY, PYTHON, ProcessDir, eventually, parse_time,
                             prefix, proxy_command, text)

KILLS = int(os.environ.get("TORTURE_KILLS", "30"))
STALLS = int(os.environ.get("TORTURE_STALLS", "4"))
SEED = int(os.environ.get("TORTURE_SEED", str(int(time.time() * 1000) % 1_000_000)))
KILLS_PER_TRIAL = 20
STALLS_PER_TRIAL = 6             # at most; stalls overlap the kills, so a trial hardly grows
LEASE = "3s"
LEASE_SECONDS = 3.0
WINDOW = "10m"
WINDOW_SECONDS = 600.0
PAY_TIMEOUT = "3s"               # vault: a `block` payment not released within it: unknown
BANK_PAY_TIMEOUT = "10s"         # bank: outlasts a stall, so the stopped proxy finds the
                                 # server's answer waiting when it goes on (not a timeout)
MAX_PENDING = 5
ANSWER_WAIT = 25.0               # a live proxy that answers no call in this long is a finding
STOP_WAIT = 30.0
THINK = (0.0, 0.04)              # a host's pause between two calls
KILL_GAP = (0.15, 0.7)           # seconds between two kills
KILL_TRIES = 4                   # a kill finds its proxy stalled: the other one, or again
IN_PAYMENT_WAIT = 3.0            # how long the killer waits for a payment inside the server
STALL_GAP = (0.2, 1.5)           # seconds between two stalls
STALL_PAYMENT_WAIT = 5.0         # how long the staller waits for a payment inside the server
STALL_HOLD = (3.6, 4.6)          # seconds a proxy stays stopped: past its lease (LEASE)
STALL_MAX = 7.0                  # at most, while the other host has not yet taken it over
STALL_CALL_AFTER = 0.2           # the identical call: this long after the lease ran out
STALL_RETRY = 0.25               # before the identical call again, when it took nothing over
STALL_RETRY_ON = {"IN_PROGRESS", "BLOCKED", "lost", "error"}   # answers that take nothing over
STALL_TRIES = 8                  # attempts per stall owed (one finding no payment inside: none)
STALL_JOIN = 900.0               # the staller's attempts are bounded; this bounds the wait
LOCK_PROBE = 0.3                 # a stopped proxy holding the write lock this long: let go
OPERATOR_GAP = (0.1, 0.6)
OPERATOR_KILL_AFTER = (0.0, 0.35)
INTERRUPTION_WAIT = (0.0, 2.5)   # how long an interruption approval waits for the operator:
                                 # a stall's late outcome lands about 1 s after it is asked;
                                 # longer, and its tool stays BLOCKED for all that time
CHANNELS = ("cli", "inbox", "webhook")
INBOX_WAIT = 30.0
WEBHOOK_START = 30.0
HTTP_WAIT = 20.0
RELEASE_GAP = (0.4, 2.5)
RELEASE_HOLD = 0.15
APPROVAL_ID = re.compile(r"\(approval ([0-9a-f]{32})\)")
STDERR_APPROVAL = re.compile(r"agentrt-proxy: approval ([0-9a-f]{32}) \(")
INBOX_PROMPT = re.compile(r"approval ([0-9a-f]{32}): a approve, r reject, s skip, q quit: ")
LISTENING = re.compile(r"agentrt-proxy: webhook listening on http://127\.0\.0\.1:(\d+)")
OPEN_PREFIXES = {"PENDING_APPROVAL", "INTERRUPTED", "UNKNOWN_OUTCOME", "IN_PROGRESS", "lost"}
SERVER_ERROR = "card declined"     # the one error the fake server answers (mode error)
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}
PAY_TOOLS = ("bank_pay", "vault_pay")
INTERRUPTED = "interrupted_side_effect"


# -- the directory: two server entries, one ledger -------------------------------------------

class TortureDir(ProcessDir):
    """`bank` (pay allowed) and `vault` (pay waits for an approval), both the fake payment
    server writing one ledger; two proxies share the session and the database. With
    ``tasks``, both servers run pay as a task when asked and keep their tasks in one file
    across their restarts (the fake server's tasks mode)."""

    def __init__(self, tmp, tasks: bool = False, **kw):
        os.makedirs(str(tmp), exist_ok=True)
        self.tasks = tasks
        super().__init__(tmp, **kw)

    def write_config(self, rules, **top) -> None:
        def server(name: str, outcome: str | None, timeout: str) -> dict:
            pay = {"side_effect": "remote_mutation", "timeout": timeout}
            if outcome:
                pay["outcome"] = outcome
            return {"name": name, "command": [PYTHON, FAKE_SERVER],
                    "env": [f"FAKE_PAYMENTS_LEDGER={self.ledger}"] +
                    (["FAKE_PAYMENTS_TASKS=optional"] if self.tasks else []),
                    "manifest": f"{name}.manifest.json",
                    "rules": {"balance": {"side_effect": "read_only", "timeout": "5s"},
                              "pay": pay}}
        doc = {"database": "runs.db", "session": "torture", "hold": "0s",
               "lease_ttl": LEASE, "repeat_window": WINDOW, "max_pending": MAX_PENDING,
               "servers": [server("bank", "allow", BANK_PAY_TIMEOUT),
                           server("vault", None, PAY_TIMEOUT)]}
        with open(self.config, "w") as f:
            json.dump(doc, f, indent=2)
        os.chmod(self.config, 0o600)


def canon(args) -> str:
    return json.dumps(args, sort_keys=True, separators=(",", ":"))


def ledger_keys(path: str) -> list[str]:
    """The ledger's payments, each as the canonical form of the arguments it received."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [canon(json.loads(line)) for line in lines if line.strip()]


# -- the books ------------------------------------------------------------------------------

@dataclasses.dataclass
class Books:
    payments: int = 0
    double: int = 0
    rerun_of_recorded: int = 0
    lost: int = 0
    unresolvable: int = 0
    questions: int = 0          # interruption approvals: what the operator was asked
    to_resolve: list = dataclasses.field(default_factory=list)   # (run id, tool, args)
    problems: list = dataclasses.field(default_factory=list)


def read_db(db: str) -> dict:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        q = conn.execute
        return {
            "runs": q("SELECT id, status, reason, lease_owner, lease_expires_at FROM runs "
                      "ORDER BY created_at, rowid").fetchall(),
            "events": q("SELECT seq, run_id, step_id, at, type, payload_json FROM events "
                        "ORDER BY seq").fetchall(),
            "approvals": q("SELECT id, run_id, kind, status, hash, capability_json, "
                           "request_json, decided_at FROM approvals "
                           "ORDER BY created_at, rowid").fetchall(),
        }
    finally:
        conn.close()


def known_outcome(doc: dict) -> bool:
    """A step.tool_finished payload recording what the server answered: a result (it has a
    summary) or the server's own error. A timeout or a lost server is no known outcome."""
    return "summary" in doc or SERVER_ERROR in json.dumps(doc.get("error")) + \
        json.dumps(doc.get("observation"))


def write_lock_free(db: str) -> bool:
    """Whether the database's write lock can be taken within LOCK_PROBE seconds. Taken and
    given back at once, writing nothing."""
    conn = sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=LOCK_PROBE,
                           isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def attempts_by_key(events) -> dict:
    """Each request's executed attempts (step.tool_started), oldest first, as
    [start time, step id, whether the server's answer was recorded, when]. A step re-run
    after an approval holds two attempts, so an answer is given to the attempt it ends: a
    late one to the attempt its started_at names (a re-run's start, else the step's first
    attempt), any other to the step's latest attempt before it."""
    attempts: dict[str, list] = {}            # step id -> [[seq, at, key, answered at]]
    for seq, run_id, step_id, at, typ, payload in events:
        if typ == "step.tool_started":
            doc = json.loads(payload)
            if doc.get("tool") in PAY_TOOLS:
                attempts.setdefault(step_id, []).append([seq, at, canon(doc["args"]), None])
        elif typ == "step.tool_finished" and step_id in attempts:
            doc = json.loads(payload)
            if not known_outcome(doc):
                continue
            before = [a for a in attempts[step_id] if a[0] < seq]
            named = doc.get("started_at") if doc.get("late") else None
            if named:
                before = [a for a in before if a[1] == named] or before[:1]
            if before and before[-1][3] is None:
                before[-1][3] = parse_time(at)
    found: dict[str, list] = {}
    for step_id, tries in attempts.items():
        for seq, at, key, answered in tries:
            found.setdefault(key, []).append([seq, parse_time(at), step_id, answered is not None,
                                              answered])
    return {k: [t[1:] for t in sorted(v)] for k, v in found.items()}


def approved_reruns(approvals) -> dict:
    """When an operator approved a re-run of an unknown outcome, by request. An approval
    `settled` grants nothing, whoever approved it first: the attempt's late outcome answered
    it, and nothing may run again under it."""
    found: dict[str, list] = {}
    for aid, run_id, kind, status, _hash, cap, request, decided in approvals:
        if kind == INTERRUPTED and status == "approved":
            found.setdefault(canon(json.loads(request)["args"]), []).append(parse_time(decided))
    return {k: sorted(v) for k, v in found.items()}


def check_payments(books: Books, ledger: list[str], attempts: dict, reruns: dict) -> None:
    """Every payment matched by exactly one executed attempt; every attempt the server
    answered is in the ledger; no request paid (or attempted) twice unless, between the two,
    an operator approved a re-run of its unknown outcome, or the first had a known outcome
    more than the window earlier."""
    paid: dict[str, int] = {}
    for key in ledger:
        paid[key] = paid.get(key, 0) + 1
    books.payments = len(ledger)
    for key, count in paid.items():
        tries = attempts.get(key, [])
        if count > len(tries):
            books.lost += count - len(tries)
            books.problems.append(f"{count} payment(s) of {key} but {len(tries)} executed "
                                  "attempt(s) recorded")
    for key, tries in attempts.items():
        answered = sum(1 for t in tries if t[2])
        if answered > paid.get(key, 0):
            books.lost += answered - paid.get(key, 0)
            books.problems.append(f"{answered} attempt(s) of {key} recorded as answered by "
                                  f"the server, {paid.get(key, 0)} payment(s) in the ledger")
        grants = list(reruns.get(key, []))
        allowed = 1
        for before, after in zip(tries, tries[1:]):
            known_long_ago = before[3] is not None and after[0] - before[3] > WINDOW_SECONDS
            grant = next((g for g in grants if before[0] < g <= after[0]), None)
            if grant is not None:
                grants.remove(grant)
            if grant is not None or known_long_ago:
                allowed += 1
            else:
                books.double += 1
                books.problems.append(f"{key} attempted again at {after[0]:.3f} (step "
                                      f"{after[1]}) with no approved re-run since the attempt "
                                      f"at {before[0]:.3f} (step {before[1]})")
        if paid.get(key, 0) > allowed:
            books.double += paid[key] - allowed
            books.problems.append(f"{key} paid {paid[key]} times, {allowed} allowed")


def asked_attempts(approvals) -> dict:
    """The attempt each interruption approval asks about (its capability's `interrupted`:
    run_id, step_id, started_at), by approval id."""
    found: dict[str, dict] = {}
    for aid, run_id, kind, status, _hash, cap, request, decided in approvals:
        at = (json.loads(cap) or {}).get("interrupted") if kind == INTERRUPTED and cap else None
        if isinstance(at, dict):
            found[aid] = at
    return found


def started_before(events, seq) -> dict:
    """By (run id, step id): the seq of the latest step.tool_started on that step before
    seq (its attempt: a step is attempted again only when it is re-run)."""
    found: dict[tuple, int] = {}
    for s, run_id, step_id, at, typ, payload in events:
        if typ == "step.tool_started" and s < seq:
            found[(run_id, step_id)] = s
    return found


def recorded_outcomes(events) -> dict:
    """Each step's step.tool_finished events with a known outcome, late or not, by (run id,
    step id), as (seq, the attempt's start when the payload names it, else None, the seq of
    the latest step.tool_started on the step before it)."""
    found: dict[tuple, list] = {}
    starts: dict[tuple, int] = {}
    for seq, run_id, step_id, at, typ, payload in events:
        if typ == "step.tool_started":
            starts[(run_id, step_id)] = seq
        elif typ == "step.tool_finished":
            doc = json.loads(payload)
            if known_outcome(doc):
                found.setdefault((run_id, step_id), []).append(
                    (seq, doc.get("started_at"), starts.get((run_id, step_id))))
    return found


def check_reruns(books: Books, events, approvals) -> None:
    """No payment of a request whose earlier attempt has a recorded outcome: a re-run (a
    step.tool_started under an interruption approval) starts only while the outcome of the
    attempt that approval asks about is unknown. An outcome is that attempt's when it names
    the attempt's start or, naming none, follows the step's latest start before the approval
    was asked. One recorded after the re-run began is no finding (the re-run was approved
    without it), nor one of another attempt of the same step."""
    asked, recorded = asked_attempts(approvals), recorded_outcomes(events)
    requested = {json.loads(e[5]).get("approval_id"): e[0] for e in events
                 if e[4] == "approval.requested"}
    for seq, run_id, step_id, at, typ, payload in events:
        if typ != "step.tool_started":
            continue
        doc = json.loads(payload)
        attempt = asked.get(doc.get("approval_id", ""))
        if attempt is None:
            continue
        step = (attempt.get("run_id"), attempt.get("step_id"))
        named = started_before(events, requested[doc["approval_id"]]).get(step) \
            if doc["approval_id"] in requested else None
        earlier = [s for s, started, start in recorded.get(step, []) if s < seq and (
            started == attempt.get("started_at") if started is not None else
            named is None or start == named)]
        if earlier:
            books.rerun_of_recorded += 1
            books.problems.append(
                f"{canon(doc.get('args'))} re-run at seq {seq} (run {run_id}, step {step_id}) "
                f"under approval {doc['approval_id']}, though the outcome of the attempt it "
                f"re-runs (run {attempt.get('run_id')}, step {attempt.get('step_id')}, started "
                f"{attempt.get('started_at')}) was recorded at seq {earlier[0]}")


def settled_by_outcome(events, approvals) -> set:
    """The interruption approvals whose attempt has a known outcome recorded: these may be
    `settled` though an operator approved them (the outcome answered them before the
    identical call collected the grant)."""
    recorded = recorded_outcomes(events)
    return {aid for aid, at in asked_attempts(approvals).items()
            if (at.get("run_id"), at.get("step_id")) in recorded}


def check_runs(books: Books, runs, approvals, final: bool) -> None:
    """Every run is finished, waiting on a pending approval, approved and waiting to be
    collected, or left running by a proxy that is gone; the last two are resolvable by the
    next identical call, and none may be left when final."""
    pending: dict[str, int] = {}
    latest: dict[str, str] = {}
    for a in approvals:
        latest[a[1]] = a[3]
        if a[3] == "pending":
            pending[a[1]] = pending.get(a[1], 0) + 1
    for run_id, status, reason, owner, until in runs:
        if status in TERMINAL:
            if pending.get(run_id):
                books.unresolvable += 1
                books.problems.append(f"run {run_id} is {status} with a pending approval")
        elif status == "WAITING_FOR_APPROVAL" and latest.get(run_id) == "approved" \
                and not pending.get(run_id) and not final:
            books.to_resolve.append(run_id)        # approved: the identical call collects it
        elif status == "WAITING_FOR_APPROVAL":
            if pending.get(run_id) != 1:
                books.unresolvable += 1
                books.problems.append(f"run {run_id} waits with {pending.get(run_id, 0)} "
                                      "pending approvals")
        elif status == "RUNNING" and not final:
            books.to_resolve.append(run_id)
        else:
            books.unresolvable += 1
            books.problems.append(f"run {run_id} is left {status} ({reason}, lease {owner} "
                                  f"until {until})")


def check_approvals(books: Books, approvals, seen: dict, decided: list, told: set,
                    settled_ok: set = frozenset()) -> None:
    """No approval lost or changed: every one the operator saw is still there with the same
    kind, hash, capability and request; a decided one is never decided otherwise (an
    approved interruption in settled_ok may become settled); a decision its channel reported
    done (exit 0, the inbox's `approved by`, HTTP 200 or 202) holds; every approval a host or
    a stderr line was told of exists."""
    now = {a[0]: a for a in approvals}

    def holds(aid: str, was: str, status) -> bool:
        return status == was or (was, status, aid in settled_ok) == ("approved", "settled", True)

    for aid, first in seen.items():
        cur = now.get(aid)
        if cur is None:
            books.lost += 1
            books.problems.append(f"approval {aid} seen by the operator is gone")
            continue
        if (cur[1], cur[2], cur[4], cur[5], cur[6]) != (first[1], first[2], first[4],
                                                        first[5], first[6]):
            books.lost += 1
            books.problems.append(f"approval {aid} changed: was {first[:7]}, is {cur[:7]}")
        if first[3] != "pending" and not holds(aid, first[3], cur[3]):
            books.lost += 1
            books.problems.append(f"approval {aid} was {first[3]}, is {cur[3]}")
    want = {"approve": "approved", "reject": "rejected", "cancel": "cancelled"}
    for d in decided:
        status = now.get(d["approval"], (None,) * 4)[3]
        if d["done"] and not holds(d["approval"], want[d["action"]], status):
            books.lost += 1
            books.problems.append(f"{d['action']} of approval {d['approval']} through "
                                  f"{d.get('channel', 'cli')} was done ({d['rc']}), the "
                                  f"approval is {status}")
    for aid in sorted(told - set(now)):
        books.lost += 1
        books.problems.append(f"approval {aid} named to a host or on stderr does not exist")


def check_books(db: str, ledger_path: str, seen=None, decided=(), told=(),
                final: bool = True) -> Books:
    """Read the ledger and the database (read-only) and judge them; see the module doc."""
    books = Books()
    rows = read_db(db)
    books.questions = sum(1 for a in rows["approvals"] if a[2] == "interrupted_side_effect")
    check_payments(books, ledger_keys(ledger_path), attempts_by_key(rows["events"]),
                   approved_reruns(rows["approvals"]))
    check_reruns(books, rows["events"], rows["approvals"])
    check_runs(books, rows["runs"], rows["approvals"], final)
    check_approvals(books, rows["approvals"], seen or {}, list(decided), set(told),
                    settled_by_outcome(rows["events"], rows["approvals"]))
    code, out, err = run_cli("-db", db, "-json", "verify")
    try:
        intact = code == 0 and json.loads(out)["intact"] is True
    except (ValueError, KeyError):
        intact = False
    if not intact:
        books.problems.append(f"verify: exit {code}\n{out}\n{err}")
    return books


def run_cli(*argv: str, timeout: float = 60) -> tuple[int, str, str]:
    command, env = proxy_command()
    p = subprocess.run([*command, *argv], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


# -- the actors -----------------------------------------------------------------------------

class Timeline:
    """What happened in a trial, in order, for the report of a failing one."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def add(self, line: str) -> None:
        with self.lock:
            self.lines.append(f"{time.monotonic() - self.t0:8.3f} {line}")


class Slot:
    """One of the two proxies, started again after each kill, stopped and let go on by the
    staller (never killed while it is stopped)."""

    def __init__(self, d: TortureDir, index: int, log: Timeline):
        self.d, self.index, self.log = d, index, log
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.proc = None
        self.paused = None       # the process the staller stopped, until it goes on
        self.killed: set[int] = set()
        # Of a slow or block payment its host awaits: (args, payments of them before, tool,
        # arguments, pid of the proxy it was sent to).
        self.inflight = None
        self.start()

    def start(self) -> None:
        p = self.d.start(f"slot{self.index}")
        with self.lock:
            self.proc = p
        self.log.add(f"slot{self.index}: started pid {p.pid}")
        self.ready.set()

    def kill(self) -> bool:
        with self.lock:
            p = self.proc
            if p is None or not self.ready.is_set() or self.paused is not None:
                return False
            self.ready.clear()
            self.killed.add(p.pid)
        try:
            p.crash()
        except ProcessLookupError:
            pass
        inflight = self.inflight
        self.log.add(f"slot{self.index}: SIGKILL pid {p.pid} (in flight: "
                     f"{inflight[:2] if inflight else None})")
        return True

    def pause(self, pid: int):
        """SIGSTOP of the proxy, if it is still the one with pid and running; it, or None."""
        with self.lock:
            p = self.proc
            if p is None or p.pid != pid or not self.ready.is_set() or \
                    p.proc.poll() is not None:
                return None
            os.kill(p.pid, signal.SIGSTOP)
            self.paused = p
        self.log.add(f"slot{self.index}: SIGSTOP pid {p.pid}")
        return p

    def resume(self) -> None:
        with self.lock:
            p, self.paused = self.paused, None
        if p is not None:
            os.kill(p.pid, signal.SIGCONT)
            self.log.add(f"slot{self.index}: SIGCONT pid {p.pid}")


class Order:
    """A call the staller needs a host to make: not before `at`, not after `until`
    (monotonic); `said` is the answer's prefix once `done` is set."""

    def __init__(self, tool: str, args: dict, at: float, until: float):
        self.tool, self.args, self.at, self.until = tool, args, at, until
        self.done = threading.Event()
        self.said = ""


class Host(threading.Thread):
    """A raw JSON-RPC host on one slot: a random mix of calls, answers recorded, and the
    staller's orders first."""

    def __init__(self, trial: "Trial", slot: Slot, rng: random.Random):
        super().__init__(daemon=True)
        self.trial, self.slot, self.rng = trial, slot, rng
        self.n = 0
        self.orders: queue.Queue = queue.Queue()

    def order(self, tool: str, args: dict, at: float, until: float) -> Order:
        o = Order(tool, args, at, until)
        self.orders.put(o)
        return o

    def follow(self, o: Order) -> None:
        """Make the ordered call at its time, unless that time is past (the staller gave up)."""
        try:
            if not self.trial.stop.wait(max(0.0, o.at - time.monotonic())) and \
                    self.slot.ready.wait(max(0.0, o.until - time.monotonic())) and \
                    time.monotonic() < o.until:
                o.said = self.call(o.tool, o.args, False)[-1]
        finally:
            o.done.set()

    def new_request(self, server: str) -> dict:
        self.n += 1
        args = {"to": f"{server}-{self.trial.number}-{self.slot.index}-{self.n}",
                "amount": self.rng.randint(1, 99)}
        mode = self.rng.choice([None, None, "slow", "slow", "block", "error"])
        if mode:
            args["mode"] = mode
        return {"tool": f"{server}_pay", "args": args}

    def choose(self) -> tuple[str, dict]:
        r, pool = self.rng.random(), self.trial.pool
        if r < 0.30 or not pool.requests:
            req = self.new_request("bank" if r < 0.22 or not pool.requests else "vault")
            pool.add(req)
            return req["tool"], req["args"]
        if r < 0.40:
            req = self.new_request("vault")
            pool.add(req)
            return req["tool"], req["args"]
        if r < 0.75:
            req = pool.pick(self.rng)
            return req["tool"], req["args"]
        if r < 0.83:
            req = pool.pick(self.rng)
            changed = dict(req["args"], amount=req["args"]["amount"] + self.rng.randint(1, 9))
            new = {"tool": req["tool"], "args": changed}
            pool.add(new)
            return new["tool"], changed
        if r < 0.95:
            return "bank_balance", {"account": f"A-{self.rng.randint(1, 9)}"}
        return "gate_status", {}

    def run(self) -> None:
        while not self.trial.stop.wait(self.rng.uniform(*THINK)):
            try:
                self.follow(self.orders.get_nowait())
                continue
            except queue.Empty:
                pass
            tool, args = self.choose()
            twice = tool in PAY_TOOLS and self.rng.random() < 0.15
            if not self.slot.ready.wait(60):
                self.trial.fail(f"slot{self.slot.index} was not started again within 60 s")
                return
            self.call(tool, args, twice)

    def call(self, tool: str, args: dict, twice: bool) -> list[str]:
        """The call (twice at once when asked); each answer's prefix."""
        with self.slot.lock:
            p = self.slot.proc
        key = canon(args)
        self.slot.inflight = (key, ledger_keys(self.trial.d.ledger).count(key), tool, args,
                              p.pid) \
            if tool in PAY_TOOLS and args.get("mode") in ("slow", "block") else None
        try:
            idents = [p.send_call(tool, args)]
            if twice:
                idents.append(p.send_call(tool, args))
        except OSError:                            # its proxy was just killed
            self.record(p, tool, args, "lost", "")
            return ["lost"]
        said = [self.await_answer(p, ident, tool, args) for ident in idents]
        self.slot.inflight = None
        return said

    def await_answer(self, p, ident: int, tool: str, args: dict) -> str:
        try:
            msg = p.answer(ident, ANSWER_WAIT)
        except AssertionError as e:
            if p.pid not in self.slot.killed:
                if p.proc.poll() is None:
                    self.trial.fail(f"pid {p.pid} gave no answer to {tool} {args} within "
                                    f"{ANSWER_WAIT} s")
                else:
                    self.trial.fail(f"pid {p.pid} exited {p.proc.poll()} by itself: {e}")
            self.record(p, tool, args, "lost", "")
            return "lost"
        if "error" in msg:
            self.trial.fail(f"protocol error from pid {p.pid} for {tool} {args}: {msg}")
            self.record(p, tool, args, "error", json.dumps(msg["error"]))
            return "error"
        said = text(msg["result"])
        self.record(p, tool, args, prefix(msg["result"]), said)
        return prefix(msg["result"])

    def record(self, p, tool: str, args: dict, pfx: str, said: str) -> None:
        self.trial.calls += 1
        self.trial.told.update(APPROVAL_ID.findall(said))
        if tool in PAY_TOOLS:
            self.trial.pool.answered(canon(args), pfx)
        self.trial.log.add(f"host{self.slot.index} pid {p.pid} {tool} {canon(args)} -> "
                           f"{pfx}: {said[:120]}")


class Pool:
    """The requests the hosts made, shared, so a retry may go through the other proxy."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.last: dict[str, str] = {}

    def add(self, req: dict) -> None:
        with self.lock:
            self.requests.append(req)

    def answered(self, key: str, pfx: str) -> None:
        with self.lock:
            self.last[key] = pfx

    def pick(self, rng: random.Random) -> dict:
        """Mostly a request still open (waiting, cut off, lost), as a host would retry."""
        with self.lock:
            open_ = [r for r in self.requests if self.last.get(canon(r["args"]), "lost")
                     in OPEN_PREFIXES]
            return rng.choice(open_ if open_ and rng.random() < 0.7 else self.requests)


class Webhook:
    """`agentrt_proxy.py -db DB webhook` on a free loopback port (port 0: the one it says it
    bound), and a client signing each request by the README's recipe."""

    def __init__(self, d: TortureDir):
        self.secret = secrets.token_hex(32).encode()
        path = os.path.join(d.tmp, "webhook.secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.secret + b"\n")
        command, env = proxy_command()
        self.proc = subprocess.Popen(
            [*command, "-db", d.db, "webhook", "-listen", "127.0.0.1:0", "-secret-file", path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self.port = None
        self.listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.listening.wait(WEBHOOK_START):
            self.stop()
            raise AssertionError(f"the webhook did not listen within {WEBHOOK_START} s: "
                                 f"{self.lines}")

    def _read(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            match = LISTENING.search(line)
            if match and self.port is None:
                self.port = int(match.group(1))
                self.listening.set()

    def call(self, method: str, path: str, doc=None) -> tuple[int, dict]:
        """(HTTP status, the JSON answer); (0, {"error": ...}) when no answer came."""
        body = b"" if doc is None else json.dumps(doc).encode()
        ts, nonce = str(int(time.time())), secrets.token_hex(16)
        mac = hmac.new(self.secret, f"{ts}\n{nonce}\n{method}\n{path}\n".encode() + body,
                       hashlib.sha256)
        headers = {"X-Approval-Timestamp": ts, "X-Approval-Nonce": nonce,
                   "X-Approval-Signature": "v1=" + mac.hexdigest(),
                   "Content-Type": "application/json"}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_WAIT)
        try:
            conn.request(method, path, body=body if doc is not None else None, headers=headers)
            resp = conn.getresponse()
            status, data = resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:
            return 0, {"error": f"{type(e).__name__}: {e}"}
        finally:
            conn.close()
        try:
            return status, json.loads(data)
        except ValueError:
            return status, {"error": data[:200].decode("utf-8", "replace")}

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, of this pid only."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            os.kill(self.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass


class Trial:
    def __init__(self, tmp, number: int, seed: int, kills: int, stalls: int,
                 tasks: bool = False):
        self.number, self.seed = number, seed
        self.rng = random.Random(seed)
        self.d = TortureDir(tmp, tasks)
        self.log = Timeline()
        self.stop = threading.Event()
        self.pool = Pool()
        self.calls = 0
        self.kills = 0
        self.kills_in_payment = 0
        self.operator_kills = 0
        self.stall_target = stalls
        self.stalls = 0
        self.stalled: list[tuple] = []     # per stall: (request, attempt taken over or None)
        self.stalls_late = 0
        self.stalls_known = 0
        self.told: set[str] = set()
        self.seen: dict[str, tuple] = {}
        self.decided: list[dict] = []
        self.due: dict[str, float] = {}    # when the operator approves an interruption
        self.failures: list[str] = []
        self.hook = None
        self.schedule = [(round(self.rng.uniform(*KILL_GAP), 3), self.rng.randrange(2),
                          "in_payment" if self.rng.random() < 0.6 else "any")
                         for _ in range(kills)]

    def fail(self, why: str) -> None:
        self.log.add(f"FAILURE {why}")
        self.failures.append(why)

    def guarded(self, actor, *args) -> None:
        """Run an actor's loop; one that dies of an exception is a failure, not a quieter
        trial."""
        try:
            actor(*args)
        except Exception:
            self.fail(f"{actor.__name__} died: {traceback.format_exc()}")

    # -- the killer, the staller, the operator, the releaser --

    def payment_inside(self, slot: Slot, wait: float):
        """The slow or block payment slot's host awaits, once the server has it (its ledger
        line is written before it answers), within wait seconds; None if none."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.stop.is_set():
            inflight = slot.inflight
            if inflight and ledger_keys(self.d.ledger).count(inflight[0]) > inflight[1]:
                return inflight
            time.sleep(0.02)
        return None

    def killer(self, slots: list[Slot]) -> None:
        for gap, index, trigger in self.schedule:
            if self.stop.wait(gap):
                return
            for _ in range(KILL_TRIES):         # a stalled proxy is not killed: the other is
                slot = slots[index] if slots[index].paused is None else slots[1 - index]
                if not slot.ready.wait(60):
                    self.fail(f"slot{slot.index} was not started again within 60 s")
                    return
                inside = trigger == "in_payment" and \
                    self.payment_inside(slot, IN_PAYMENT_WAIT) is not None
                if slot.kill():
                    self.kills += 1
                    self.kills_in_payment += inside
                    threading.Thread(target=self.restart, args=(slot,), daemon=True).start()
                    break

    def staller(self, slots: list[Slot], hosts: list[Host]) -> None:
        rng = random.Random(self.seed * 7 + 5)
        for _ in range(self.stall_target * STALL_TRIES):
            if self.stalls >= self.stall_target or self.stop.wait(rng.uniform(*STALL_GAP)):
                return
            found = self.either_payment_inside(rng, slots, STALL_PAYMENT_WAIT)
            if found is not None:
                self.stall(rng, slots[found[0]], hosts[1 - found[0]], found[1])

    def either_payment_inside(self, rng: random.Random, slots: list[Slot], wait: float):
        """(slot index, in flight) of the first slow or block payment found inside the
        server, of either host, within wait seconds; None if none."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.stop.is_set():
            paid = ledger_keys(self.d.ledger)
            inside = [(s.index, s.inflight) for s in slots if s.inflight and
                      s.ready.is_set() and paid.count(s.inflight[0]) > s.inflight[1]]
            if inside:
                return rng.choice(inside)
            time.sleep(0.02)
        return None

    def stall(self, rng: random.Random, slot: Slot, other: Host, inflight: tuple) -> None:
        """Stop slot's proxy while a payment of its host is inside the server, past its
        lease; the other host makes the identical call once the lease ran out, until it takes
        the run over (or STALL_MAX); then let the stopped proxy go on."""
        key, _, tool, args, pid = inflight
        try:
            asked_before = set(self.interruptions_of(key))
        except sqlite3.Error as e:
            self.log.add(f"stall: database busy: {e}")
            return
        p = slot.pause(pid)
        if p is None:
            return
        began, hold, attempt = time.monotonic(), rng.uniform(*STALL_HOLD), None
        try:
            if not write_lock_free(self.d.db):
                # Stopped inside a transaction: every other process would wait on its lock
                # (SQLite's, not the proxy's, to answer for); not a stall worth having.
                self.log.add(f"stall: slot{slot.index} pid {p.pid} was stopped holding the "
                             "database's write lock; let go at once")
                return
            attempt = self.take_over(other, tool, args, key, asked_before, began)
            time.sleep(max(0.0, began + hold - time.monotonic()))
            self.stalls += 1
            self.stalled.append((key, attempt))
        finally:
            slot.resume()
        self.log.add(f"stall: slot{slot.index} pid {p.pid} stopped "
                     f"{time.monotonic() - began:.2f} s with {key} inside the server; "
                     + (f"taken over, attempt {canon(attempt)}" if attempt else
                        "not taken over"))

    def take_over(self, other: Host, tool: str, args: dict, key: str, asked_before: set,
                  began: float):
        """The other host's identical call once the lease ran out, again while its answer
        took nothing over; the attempt the new interruption approval asks about, or None."""
        at, until = began + LEASE_SECONDS + STALL_CALL_AFTER, began + STALL_MAX
        while time.monotonic() < until:
            o = other.order(tool, args, at, until)
            o.done.wait(max(0.0, until - time.monotonic()) + 1.0)
            try:
                attempt = self.asked_about(key, asked_before)
            except sqlite3.Error:
                attempt = None
            if attempt is not None:
                return attempt
            if o.said not in STALL_RETRY_ON:   # e.g. DUPLICATE: it finished before the stop
                return None
            at = time.monotonic() + STALL_RETRY
        return None

    def interruptions_of(self, key: str) -> dict:
        """The interruption approvals of this request, by id: the attempt each asks about."""
        approvals = read_db(self.d.db)["approvals"]
        mine = [a for a in approvals if a[2] == INTERRUPTED and
                canon(json.loads(a[6])["args"]) == key]
        return asked_attempts(mine)

    def asked_about(self, key: str, asked_before: set):
        found = [at for aid, at in self.interruptions_of(key).items()
                 if aid not in asked_before]
        return found[-1] if found else None

    def late_outcomes(self, events) -> None:
        """Of the stalls taken over, those whose stopped proxy recorded the server's answer
        as a late outcome of the attempt, and how many of those outcomes are known."""
        late: dict[tuple, list] = {}
        for seq, run_id, step_id, at, typ, payload in events:
            doc = json.loads(payload) if typ == "step.tool_finished" else {}
            if doc.get("late") is True:
                late.setdefault((run_id, step_id), []).append(doc)
        for key, attempt in self.stalled:
            if attempt is None:
                continue
            docs = [d for d in late.get((attempt.get("run_id"), attempt.get("step_id")), [])
                    if d.get("started_at") in (None, attempt.get("started_at"))]
            self.stalls_late += bool(docs)
            self.stalls_known += any(known_outcome(d) for d in docs)

    def restart(self, slot: Slot) -> None:
        try:
            slot.start()
        except Exception as e:                     # a proxy that cannot start is a finding
            self.fail(f"slot{slot.index} could not start again: {e}")

    def snapshot(self) -> list[tuple]:
        approvals = read_db(self.d.db)["approvals"]
        for a in approvals:
            first = self.seen.get(a[0])
            if first is None or first[3] == "pending":
                self.seen[a[0]] = a
        return approvals

    def operator(self) -> None:
        """An interruption approval, once its random wait is over, is approved through a
        channel at random; any other is approved, rejected or cancelled."""
        rng = random.Random(self.seed * 7 + 1)
        while not self.stop.wait(rng.uniform(*OPERATOR_GAP)):
            try:
                pending = [a for a in self.snapshot() if a[3] == "pending"]
            except sqlite3.Error as e:
                self.log.add(f"operator: database busy: {e}")
                continue
            now = time.monotonic()
            for a in pending:
                if a[2] == INTERRUPTED and a[0] not in self.due:
                    self.due[a[0]] = now + rng.uniform(*INTERRUPTION_WAIT)
            due = [a for a in pending if a[2] == INTERRUPTED and self.due[a[0]] <= now]
            others = [a for a in pending if a[2] != INTERRUPTED]
            if due:
                a = rng.choice(due)
                channel = rng.choice(CHANNELS)
                if channel == "cli":
                    self.decide(rng, a[0], a[1], "approve", kill=rng.random() < 0.2,
                                interruption=True)
                elif channel == "inbox":
                    self.inbox_approve(a[0], a[1])
                else:
                    self.webhook_approve(a[0], a[1])
            elif others:
                a = rng.choice(others)
                action = rng.choices(["approve", "reject", "cancel"], [6, 2, 2])[0]
                self.decide(rng, a[0], a[1], action, kill=rng.random() < 0.2)

    def decide(self, rng: random.Random, aid: str, run_id: str, action: str,
               kill: bool, interruption: bool = False) -> None:
        command, env = proxy_command()
        argv = [*command, "-db", self.d.db]
        if action == "cancel":
            argv += ["cancel", run_id, "-by", "operator", "-note", "torture"]
        else:
            argv += [action, run_id, "-approval", aid, "-by", "operator"]
            if action == "reject":
                argv += ["-note", "torture"]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        rc = None
        if kill:
            try:
                rc = p.wait(rng.uniform(*OPERATOR_KILL_AFTER))
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                self.operator_kills += 1
        out, err = p.communicate(timeout=60)
        rc = p.returncode if rc is None else rc
        self.decided.append({"approval": aid, "action": action, "rc": rc, "done": rc == 0,
                             "channel": "cli", "interruption": interruption})
        self.log.add(f"operator: {action} {aid} (run {run_id}) -> exit {rc}"
                     f"{' (killed)' if rc == -signal.SIGKILL else ''} {err.strip()[:160]}")

    def inbox_approve(self, aid: str, run_id: str) -> None:
        """`inbox -once` on a pipe: `a` when aid is shown, `s` to any shown before it, `q`
        to the next; done when it says `approval AID: approved by operator`."""
        command, env = proxy_command()
        p = subprocess.Popen([*command, "-db", self.d.db, "inbox", "-once",
                              "-tty-not-required", "-by", "operator"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        out, answered, approving = b"", 0, False
        deadline = time.monotonic() + INBOX_WAIT
        try:
            while time.monotonic() < deadline:
                if select.select([p.stdout], [], [], 0.2)[0]:
                    chunk = os.read(p.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    out += chunk
                for shown in INBOX_PROMPT.findall(out.decode("utf-8", "replace"))[answered:]:
                    answer = "q" if approving else "a" if shown == aid else "s"
                    approving = approving or answer == "a"
                    answered += 1
                    try:
                        p.stdin.write(answer.encode() + b"\n")
                        p.stdin.flush()
                    except OSError:                # it exited meanwhile
                        pass
        finally:
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                rc = p.wait(max(0.0, deadline - time.monotonic()) + 1.0)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                rc = p.wait(10)
                self.fail(f"inbox pid {p.pid} did not end within {INBOX_WAIT} s")
            p.stdout.close()
        said = out.decode("utf-8", "replace")
        done = f"approval {aid}: approved by operator" in said
        after = said.split(f"approval {aid}: a approve, r reject, s skip, q quit: ", 1)
        self.decided.append({"approval": aid, "action": "approve", "rc": rc, "done": done,
                             "channel": "inbox", "interruption": True})
        self.log.add(f"operator: inbox approve {aid} (run {run_id}) -> exit {rc}, "
                     + (f"shown: {after[1].strip()[:160]!r}" if len(after) > 1 else
                        f"not shown: {said.strip()[-160:]!r}"))

    def webhook_approve(self, aid: str, run_id: str) -> None:
        """A signed GET of the approval, then a signed POST approving what it showed; done
        on 202 (or 200)."""
        path = f"/runs/{run_id}/approvals/{aid}"
        got, shown = self.hook.call("GET", path)
        posted, answer = None, {}
        if got == 200 and isinstance(shown.get("approval"), dict):
            posted, answer = self.hook.call("POST", path + "/approve", {
                "run_id": run_id, "approval_id": aid, "hash": shown["approval"].get("hash"),
                "by": "operator", "note": "torture"})
        self.decided.append({"approval": aid, "action": "approve", "rc": posted or got,
                             "done": posted in (200, 202), "channel": "webhook",
                             "interruption": True})
        self.log.add(f"operator: webhook approve {aid} (run {run_id}) -> GET {got} "
                     f"{shown.get('code', '')} POST {posted} {answer.get('code', '')} "
                     f"{(answer or shown).get('error', '')[:160]}")

    def releaser(self) -> None:
        rng = random.Random(self.seed * 7 + 2)
        release = self.d.ledger + ".release"
        while not self.stop.wait(rng.uniform(*RELEASE_GAP)):
            open(release, "w").close()
            self.stop.wait(RELEASE_HOLD)
            if not self.stop.is_set():
                os.unlink(release)

    # -- a trial: torture, then quiet, then the books --

    def run(self) -> Books:
        slots = [Slot(self.d, i, self.log) for i in range(2)]
        self.hook = Webhook(self.d)
        try:
            return self.torture(slots)
        finally:
            self.stop.set()
            self.hook.stop()

    def torture(self, slots: list[Slot]) -> Books:
        hosts = [Host(self, s, random.Random(self.seed * 7 + 3 + s.index)) for s in slots]
        releaser = threading.Thread(target=self.releaser, daemon=True)
        actors = hosts + [threading.Thread(target=self.guarded, args=(self.operator,),
                                           daemon=True), releaser]
        staller = threading.Thread(target=self.guarded, args=(self.staller, slots, hosts),
                                   daemon=True)
        for a in actors + [staller]:
            a.start()
        self.killer(slots)
        staller.join(STALL_JOIN)
        if staller.is_alive():
            self.fail(f"the staller did not finish within {STALL_JOIN} s")
        self.stop.set()
        releaser.join(STOP_WAIT)
        open(self.d.ledger + ".release", "w").close()   # what still waits inside answers now
        for a in actors:
            a.join(ANSWER_WAIT + STOP_WAIT)
            if a.is_alive():
                self.fail(f"{a} did not stop")
        if self.hook.proc.poll() is not None:
            self.fail(f"the webhook exited {self.hook.proc.poll()} by itself")
        for s in slots:
            if not s.ready.wait(60):
                self.fail(f"slot{s.index} was not started again within 60 s")
                continue
            self.stop_proxy(s.proc)
        self.snapshot()
        books = check_books(self.d.db, self.d.ledger, self.seen, self.decided, self.told,
                            final=False)
        self.resolve(books)
        final = check_books(self.d.db, self.d.ledger, self.seen, self.decided,
                            self.told | self.stderr_approvals(), final=True)
        final.problems = books.problems + final.problems
        final.unresolvable += books.unresolvable
        self.late_outcomes(read_db(self.d.db)["events"])
        return final

    def stop_proxy(self, p) -> None:
        p.close_stdin()
        code = p.wait_exit(STOP_WAIT)
        if code != 0:
            self.fail(f"pid {p.pid} exited {code} on stdin close")

    def resolve(self, books: Books) -> None:
        """A fresh proxy makes the identical call of every run left running, once its lease
        ran out, and a call with new arguments to each payment tool: BLOCKED must name an
        approval that waits for an operator."""
        try:
            self.resolve_with(self.d.start("resolver"), books)
        except AssertionError as e:
            self.fail(f"resolver: {e}")

    def resolve_with(self, p, books: Books) -> None:
        rows = read_db(self.d.db)
        last = max([parse_time(r[4]) for r in rows["runs"] if r[0] in books.to_resolve
                    and r[4]] or [0.0])
        time.sleep(max(0.0, last - time.time() + 0.2))
        decided = {}
        for seq, run_id, step_id, at, typ, payload in rows["events"]:
            if typ == "step.decided" and run_id not in decided:
                decided[run_id] = json.loads(payload)
        for run_id in books.to_resolve:
            call = decided.get(run_id)
            if call is None:
                self.log.add(f"resolver: run {run_id} has no call to repeat")
                continue
            r = p.call(call["tool"], call["args"], ANSWER_WAIT)
            self.told.update(APPROVAL_ID.findall(text(r)))
            self.log.add(f"resolver: {call['tool']} {canon(call['args'])} -> {text(r)[:120]}")
        for tool in PAY_TOOLS:
            r = p.call(tool, {"to": f"probe-{self.number}", "amount": 1}, ANSWER_WAIT)
            said = text(r)
            self.log.add(f"resolver: {tool} probe -> {said[:160]}")
            if prefix(r) == "BLOCKED":
                pending = {a[0] for a in read_db(self.d.db)["approvals"] if a[3] == "pending"}
                named = set(APPROVAL_ID.findall(said))
                if not (named & pending) and len(pending) < MAX_PENDING:
                    books.unresolvable += 1
                    books.problems.append(f"{tool} is BLOCKED with nothing for an operator "
                                          f"to act on: {said}")
        self.stop_proxy(p)

    def stderr_approvals(self) -> set[str]:
        found: set[str] = set()
        for p in self.d.procs:
            found.update(STDERR_APPROVAL.findall(p.stderr()))
        return found

    def report(self, books: Books) -> str:
        rows = read_db(self.d.db)
        parts = [f"trial {self.number} seed {self.seed}: kill schedule {self.schedule}",
                 "problems:", *books.problems, *self.failures, "timeline:", *self.log.lines,
                 "ledger:", *ledger_keys(self.d.ledger), "runs:", *map(str, rows["runs"]),
                 "approvals:", *(str(a[:4]) for a in rows["approvals"]), "events:",
                 *(f"{e[0]} {e[1]} {e[3]} {e[4]} {e[5][:200]}" for e in rows["events"])]
        for p in self.d.procs:
            parts += [f"stderr of pid {p.pid}:", p.stderr()]
        if self.hook is not None:
            parts += [f"stderr of the webhook, pid {self.hook.pid}:", *self.hook.lines]
        return "\n".join(parts)


# -- the tests ------------------------------------------------------------------------------

def test_books_checker_catches_a_planted_double_payment(tmp_path):
    """The checker is not vacuous: one real payment checks clean, and the same records with
    the ledger line written twice, or a payment no attempt made, do not."""
    d = TortureDir(tmp_path / "real")
    try:
        p = d.start()
        r = p.call("bank_pay", {"to": "once", "amount": 5})
        assert text(r) == "paid 5.00 to once", text(r)
        p.stop()
    finally:
        d.cleanup()
    clean = check_books(d.db, d.ledger)
    assert clean.problems == [] and clean.payments == 1, clean

    with open(d.ledger, "rb") as f:
        line = f.read()
    doubled = str(tmp_path / "doubled")
    with open(doubled, "wb") as f:
        f.write(line + line)
    books = check_books(d.db, doubled)
    assert books.double == 1 and books.lost == 1 and books.payments == 2, books

    stray = str(tmp_path / "stray")
    with open(stray, "wb") as f:
        f.write(line + b'{"to":"nobody","amount":1}\n')
    books = check_books(d.db, stray)
    assert books.lost == 1 and books.double == 0, books

    empty = str(tmp_path / "empty")
    open(empty, "wb").close()
    books = check_books(d.db, empty)
    assert books.lost == 1, books           # an attempt the server answered, not in the ledger


def test_books_checker_catches_a_rerun_of_a_recorded_outcome(tmp_path):
    """check_reruns is not vacuous. Real records of a re-run of an unknown outcome (a proxy
    killed with its payment inside the server, the run taken over by another, the
    interruption approved, the identical call paying again) check clean; planted among them,
    a known outcome of the attempt before the re-run's start is counted, and a plant naming
    another start, coming after the re-run's start, or recording no known outcome is not.
    The same records with the approval settled instead of approved are two double payments."""
    d = TortureDir(tmp_path / "real")
    args = {"to": "twice", "amount": 5, "mode": "block"}
    try:
        a = d.start("a")
        a.send_call("bank_pay", args)
        eventually(lambda: d.payments() == 1, 30, "the payment to reach the server")
        a.crash()
        b = d.start("b")
        eventually(lambda: prefix(b.call("bank_pay", args)) == "INTERRUPTED", 3 * LEASE_SECONDS,
                   "the other proxy to take the run over once the lease ran out", 0.3)
        (asked,) = d.pending()
        d.approve(asked["run_id"], asked["id"])
        d.release()
        r = b.call("bank_pay", args)
        assert text(r) == "paid 5.00 to twice", text(r)
        b.stop()
    finally:
        d.cleanup()
    clean = check_books(d.db, d.ledger)
    assert clean.problems == [] and clean.payments == 2 and clean.rerun_of_recorded == 0, clean

    rows = read_db(d.db)
    attempt = asked_attempts(rows["approvals"])[asked["id"]]
    started = [e for e in rows["events"] if e[4] == "step.tool_started"]
    assert len(started) == 2, started
    first, rerun = started
    assert json.loads(rerun[5]).get("approval_id") == asked["id"], rerun
    known = {"duration_ms": 1, "known": True, "late": True, "started_at": attempt["started_at"],
             "observation": {"kind": "tool_result", "content": "paid 5.00 to twice"},
             "content_hash": "0" * 64, "summary": "bank/pay: 18 bytes", "tool": "bank_pay"}

    def planted(doc: dict, seq: float = rerun[0] - 0.5) -> int:
        event = (seq, attempt["run_id"], attempt["step_id"], rerun[3], "step.tool_finished",
                 json.dumps(doc))
        books = Books()
        check_reruns(books, sorted(rows["events"] + [event]), rows["approvals"])
        assert len(books.problems) == books.rerun_of_recorded, books
        return books.rerun_of_recorded

    assert planted(known) == 1
    assert planted({k: v for k, v in known.items() if k != "started_at"}) == 1
    assert planted({"duration_ms": 1, "late": True, "tool": "bank_pay", "observation": {
        "kind": "tool_error", "content": "card declined for twice"}}) == 1
    assert planted({"duration_ms": 1, "tool": "bank_pay", "summary": "bank/pay: 18 bytes",
                    "content_hash": "0" * 64}) == 1                      # not late: the same
    assert planted(dict(known, started_at="2001-01-01T00:00:00.000000Z")) == 0
    assert planted(known, rerun[0] + 0.5) == 0                           # after the re-run
    assert planted({k: v for k, v in known.items() if k != "started_at"},
                   first[0] - 0.5) == 0                  # before the attempt: not its outcome
    assert planted({"duration_ms": 1, "known": False, "late": True, "tool": "bank_pay",
                    "observation": {"kind": "tool_error", "content": {
                        "error": "no answer within 10s", "failure": "timeout"}}}) == 0

    settled = [x[:3] + ("settled",) + x[4:] if x[0] == asked["id"] else x
               for x in rows["approvals"]]
    books = Books()
    check_payments(books, ledger_keys(d.ledger), attempts_by_key(rows["events"]),
                   approved_reruns(settled))
    assert books.double == 2, books


def share(total: int, parts: int, n: int) -> int:
    """Part n of total split as evenly as it goes over parts."""
    return total // parts + (n < total % parts)


def channel_counts(decided: list, totals: dict) -> None:
    """The interruption approvals each channel was asked for, and how many it did."""
    for d in decided:
        if d["action"] == "approve" and d.get("interruption"):
            asked, done = totals["channels"].get(d["channel"], (0, 0))
            totals["channels"][d["channel"]] = (asked + 1, done + d["done"])


def test_torture_kills_proxies_and_the_books_balance(tmp_path, capsys):
    trials = max(1, math.ceil(KILLS / KILLS_PER_TRIAL), math.ceil(STALLS / STALLS_PER_TRIAL))
    rng = random.Random(SEED)
    totals = {"kills": 0, "kills_in_payment": 0, "operator_kills": 0, "stalls": 0,
              "taken_over": 0, "stalls_late": 0, "stalls_known": 0, "calls": 0,
              "payments": 0, "double": 0, "rerun_of_recorded": 0, "lost": 0,
              "unresolvable": 0, "verify": "intact", "channels": {}}
    failed: list[str] = []
    began = time.monotonic()
    with capsys.disabled():
        print(f"\ntorture: seed {SEED} (TORTURE_SEED={SEED} replays it), {KILLS} kills and "
              f"{STALLS} stalls in {trials} trials")
    for n in range(trials):
        trial = Trial(tmp_path / f"trial{n}", n, rng.randrange(1 << 30),
                      share(KILLS, trials, n), share(STALLS, trials, n))
        with capsys.disabled():
            print(f"torture: trial {n} seed {trial.seed} stalls {trial.stall_target} "
                  f"schedule {trial.schedule}")
        try:
            books = trial.run()
        finally:
            trial.stop.set()
            trial.d.cleanup()
        totals["kills"] += trial.kills
        totals["operator_kills"] += trial.operator_kills
        totals["kills_in_payment"] += trial.kills_in_payment
        totals["stalls"] += trial.stalls
        totals["taken_over"] += sum(1 for _, attempt in trial.stalled if attempt)
        totals["stalls_late"] += trial.stalls_late
        totals["stalls_known"] += trial.stalls_known
        totals["calls"] += trial.calls
        for k in ("payments", "double", "rerun_of_recorded", "lost", "unresolvable"):
            totals[k] += getattr(books, k)
        channel_counts(trial.decided, totals)
        if any(p.startswith("verify:") for p in books.problems):
            totals["verify"] = "BROKEN"
        if books.problems or trial.failures:
            failed.append(trial.report(books))
    channels = ", ".join(f"{c} {totals['channels'].get(c, (0, 0))[1]} of "
                         f"{totals['channels'].get(c, (0, 0))[0]}" for c in CHANNELS)
    summary = (f"torture: seed {SEED}: {totals['kills']} kills ({totals['kills_in_payment']} "
               f"with a payment inside the server; and {totals['operator_kills']} operator "
               f"commands killed), {totals['stalls']} stalls ({totals['taken_over']} taken "
               f"over, {totals['stalls_late']} late outcomes recorded, "
               f"{totals['stalls_known']} known), {totals['calls']} calls, "
               f"{totals['payments']} payments, {totals['double']} double executions, "
               f"{totals['rerun_of_recorded']} re-runs of a recorded outcome, "
               f"{totals['lost']} lost records, {totals['unresolvable']} runs left "
               f"unresolvable, interruption approvals done ({channels}), verify "
               f"{totals['verify']}, {time.monotonic() - began:.0f} s")
    with capsys.disabled():
        print(summary)
    with open(tmp_path / "summary.txt", "w") as f:
        f.write(summary + "\n")
    if failed:
        with capsys.disabled():
            print("\n\n".join(failed))
    assert not failed, summary + "; the failing trials' timelines are printed above"
    assert totals["kills"] >= KILLS, summary
    assert totals["stalls"] >= STALLS, summary


TASK_KILLS = int(os.environ.get("TORTURE_TASK_KILLS", "12"))


def test_torture_with_a_server_that_runs_pay_as_tasks_asks_the_operator_less(tmp_path, capsys):
    """The same trial twice, with the same seed and kill schedule: once with servers that
    answer pay with a task and keep their tasks across their restarts, once without. Both
    books balance; with tasks, a proxy taking over a killed one's payment asks the server
    first, and the operator is asked about fewer payments."""
    seed = random.Random(SEED).randrange(1 << 30)
    counts = {}
    for tasks in (True, False):
        trial = Trial(tmp_path / f"tasks{int(tasks)}", 0, seed, TASK_KILLS, 1, tasks=tasks)
        try:
            books = trial.run()
        finally:
            trial.stop.set()
            trial.d.cleanup()
        learned = sum(1 for e in read_db(trial.d.db)["events"] if e[4] == "step.tool_task_asked"
                      and json.loads(e[5]).get("known") is True)
        counts[tasks] = (books.questions, learned, trial.kills, trial.kills_in_payment)
        assert not books.problems and not trial.failures, trial.report(books)
        assert (books.double, books.rerun_of_recorded, books.lost) == (0, 0, 0)
    with capsys.disabled():
        print(f"\ntorture with tasks: seed {SEED}: with tasks {counts[True][0]} operator "
              f"questions ({counts[True][1]} outcomes learned from the server; "
              f"{counts[True][2]} kills, {counts[True][3]} with a payment inside the server); "
              f"without {counts[False][0]} ({counts[False][2]} kills, {counts[False][3]} "
              "inside)")
    assert counts[True][1] >= 1, counts
    assert counts[True][0] < counts[False][0], counts


def test_replay_cancel_of_a_waiting_run_cancels_its_approval(tmp_path):
    """Found by the torture (seed 65372, trial 0): the operator cancelled a run waiting on an
    approval (`cancel` exited 0) and the approval stayed `pending`; the model's status tool
    went on telling it the request waited for an operator, who could no longer decide it
    (approve: the run is CANCELLED). Replayed: pay through `vault`, cancel its run."""
    d = TortureDir(tmp_path)
    try:
        p = d.start()
        args = {"to": "vault-0-1-6", "amount": 25}
        r = p.call("vault_pay", args)
        assert prefix(r) == "PENDING_APPROVAL", text(r)
        asked = d.pending()[0]
        code, out, err = d.operator("cancel", asked["run_id"], "-by", "operator", "-note",
                                    "torture")
        assert code == 0, out + err
        shown = d.show(asked["run_id"])
        assert shown["run"]["status"] == "CANCELLED", shown
        assert [a["status"] for a in shown["approvals"]] == ["cancelled"], shown["approvals"]
        assert d.pending() == []
        said = text(p.call("gate_status", {}))
        assert asked["id"] not in said and "no request" in said, said
        said = text(p.call("gate_status", {"approval_id": asked["id"]}))
        assert "CANCELLED" in said and "PENDING" not in said, said
        r = p.call("vault_pay", args)
        assert prefix(r) == "REJECTED", text(r)
        code, out, err = d.operator("approve", asked["run_id"], "-approval", asked["id"])
        assert code == 1, out + err
        p.stop()
        books = check_books(d.db, d.ledger, decided=[{"approval": asked["id"],
                                                       "action": "cancel", "rc": 0,
                                                       "done": True}])
        assert books.problems == [] and books.payments == 0, books
    finally:
        d.cleanup()


# -- the budget trial -----------------------------------------------------------------------
# Two proxies on one database pay through one tool under two sum limits of one window: `cap`
# (over it: deny) and `soft` (over it: an approval). Each host keeps BUDGET_IN_FLIGHT calls
# in flight; a killer sends SIGKILL to a random proxy now and then (after numbers of
# answers) and starts it again; an operator approves most of what waits (an approval over `soft` among them) and rejects the
# rest. The books, from the events alone: for every window that ends at an execution, the
# executions in it sum to at most `cap`, and to at most `soft` plus the executions in it
# that an operator approved over `soft`.

BUDGET_ANSWERS = int(os.environ.get("TORTURE_BUDGET_ANSWERS", "1500"))  # while it kills
BUDGET_PER, BUDGET_PER_SECONDS = "2s", 2.0
BUDGET_CAP, BUDGET_SOFT = decimal.Decimal("40"), decimal.Decimal("20")
BUDGET_LARGE = 8                    # an amount at least this asks (a condition), limits aside
BUDGET_IN_FLIGHT = 16
BUDGET_KILL_GAP = (100, 300)        # answers to the hosts between two kills
BUDGET_OPERATOR_GAP = (0.05, 0.4)
BUDGET_THINK = (0.0, 0.02)          # a host's pause before each call it sends
BUDGET_RETRY = 0.3                  # of a host's calls, this share retries an open request
BUDGET_MUTANT_ANSWERS = 6000    # at most: it stops once a window is over
UNAVAILABLE_SHOWN = 10           # the budget trial prints the first few UNAVAILABLE answers
BUDGET_OVERTIME = 2              # then, without kills, at most this many times its answers
                                 # more, until the books hold a cap's refusal and a run
                                 # approved over soft
BUDGET_LOOK = 1.0                # seconds between two looks at the answers and the books
BUDGET_QUIET = 120.0             # seconds without a single answer: stuck, a failure


class BudgetDir(ProcessDir):
    """`bank` (the fake payment server) whose pay runs under the two limits; `program` is the
    proxy file the proxies run (a planted mutant's copy, for the checker's own test)."""

    def __init__(self, tmp, program: str = PROXY):
        os.makedirs(str(tmp), exist_ok=True)
        self.program = program
        super().__init__(tmp)

    def write_config(self, rules, **top) -> None:
        pay = {"side_effect": "remote_mutation", "outcome": "allow", "timeout": "5s",
               "when": [{"if": {"properties": {"amount": {"type": "number",
                                                          "minimum": BUDGET_LARGE}},
                                "required": ["amount"]},
                         "outcome": "require_approval", "why": "a large payment"}],
               "limits": [{"name": "cap", "sum": "/amount", "max": str(BUDGET_CAP),
                           "per": BUDGET_PER, "over": "deny"},
                          {"name": "soft", "sum": "/amount", "max": str(BUDGET_SOFT),
                           "per": BUDGET_PER}]}
        server = {"name": "bank", "command": [PYTHON, FAKE_SERVER],
                  "env": [f"FAKE_PAYMENTS_LEDGER={self.ledger}"],
                  "manifest": "bank.manifest.json",
                  "rules": {"balance": {"side_effect": "read_only", "timeout": "5s"},
                            "pay": pay}}
        doc = {"database": "runs.db", "session": "budget", "hold": "0s", "lease_ttl": LEASE,
               "max_pending": 2 * BUDGET_IN_FLIGHT, "servers": [server]}
        with open(self.config, "w") as f:
            json.dump(doc, f, indent=2)
        os.chmod(self.config, 0o600)


def exact(args_json: str) -> dict:
    return json.loads(args_json, parse_float=decimal.Decimal, parse_int=decimal.Decimal)


def budget_executions(events, approvals) -> list[tuple]:
    """Each execution of bank_pay (step.tool_started), as (time, amount, whether an approval
    asked by `soft` let it start), in the order the store recorded them."""
    over_soft = {aid for aid, _run, _kind, status, _h, cap, _req, _at in approvals
                 if status == "approved" and "soft" in json.loads(cap).get("asked_by", [])}
    found = []
    for seq, run_id, step_id, at, typ, payload in events:
        if typ != "step.tool_started":
            continue
        doc = json.loads(payload)
        if doc.get("tool") != "bank_pay":
            continue
        amount = exact(json.dumps(doc["args"]))["amount"]
        found.append((parse_time(at), amount, doc.get("approval_id") in over_soft))
    return found


def check_budget_windows(executions: list[tuple], per: float, cap, soft) -> list[str]:
    """For each window (t - per, t] ending at an execution's start t, the sum of the
    executions that started in it: at most cap, and at most soft plus those of them approved
    over soft. (A limit counts an execution while its start is later than now - per.)"""
    problems = []
    for t, _amount, _over in executions:
        inside = [(a, over) for s, a, over in executions if t - per < s <= t]
        total = sum((a for a, _ in inside), decimal.Decimal(0))
        approved = sum((a for a, over in inside if over), decimal.Decimal(0))
        if total > cap:
            problems.append(f"the window ending {fmt(t)} sums to {total}, over cap {cap}")
        if total > soft + approved:
            problems.append(f"the window ending {fmt(t)} sums to {total}, over soft {soft} "
                            f"plus {approved} approved over it")
    return problems


def fmt(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}"


@dataclasses.dataclass
class BudgetBooks:
    executions: int = 0
    approved_over_soft: int = 0
    payments: int = 0
    problems: list = dataclasses.field(default_factory=list)


def check_budget_books(db: str, ledger_path: str) -> BudgetBooks:
    """The windows, and the ledger against the executions: nothing reached the server that
    no counted execution started. The ledger is read first: a payment in it had its start
    committed before its request left, so the events read after it hold that start (read
    the other way round, during a trial, a payment made in between is one never started)."""
    paid = ledger_keys(ledger_path)
    rows = read_db(db)
    executions = budget_executions(rows["events"], rows["approvals"])
    books = BudgetBooks(len(executions), sum(1 for e in executions if e[2]))
    books.problems = check_budget_windows(executions, BUDGET_PER_SECONDS, BUDGET_CAP,
                                          BUDGET_SOFT)
    started: dict[str, int] = {}
    for seq, run_id, step_id, at, typ, payload in rows["events"]:
        if typ == "step.tool_started" and json.loads(payload).get("tool") == "bank_pay":
            key = canon(json.loads(payload)["args"])
            started[key] = started.get(key, 0) + 1
    books.payments = len(paid)
    for key in set(paid):
        if paid.count(key) > started.get(key, 0):
            books.problems.append(f"{key} was paid {paid.count(key)} times and started "
                                  f"{started.get(key, 0)}")
    return books


class BudgetHost(threading.Thread):
    """A host on one slot keeping BUDGET_IN_FLIGHT calls in flight, on one thread: it sends
    until that many wait, then reads one answer. New payments, and retries of requests still
    open (waiting for an approval, cut off by a kill)."""

    def __init__(self, trial: "BudgetTrial", slot: Slot, rng: random.Random):
        super().__init__(daemon=True)
        self.trial, self.slot, self.rng = trial, slot, rng
        self.n = 0

    def choose(self) -> dict:
        cut, waits = self.trial.open_requests()
        if cut and self.rng.random() < BUDGET_RETRY:      # what a kill cut off blocks the
            return self.rng.choice(cut)                   # tool until it is called again
        if waits and self.rng.random() < BUDGET_RETRY:
            return self.rng.choice(waits)
        self.n += 1
        large = self.rng.random() < 0.15
        args = {"to": f"payee-{self.slot.index}-{self.n}",
                "amount": self.rng.choice([8, 9.5, 12] if large else [1, 2, 3, 4.5, 5, 6.25])}
        if self.rng.random() < 0.2:
            args["mode"] = "slow"
        return args

    def run(self) -> None:
        while not self.trial.stop.is_set():
            if not self.slot.ready.wait(60):
                self.trial.fail(f"slot{self.slot.index} was not started again within 60 s")
                return
            with self.slot.lock:
                p = self.slot.proc
            self.serve(p)

    def serve(self, p) -> None:
        waiting: dict[int, tuple[dict, float]] = {}
        try:
            while not self.trial.stop.is_set() and p.proc.poll() is None:
                while len(waiting) < BUDGET_IN_FLIGHT and \
                        not self.trial.stop.wait(self.rng.uniform(*BUDGET_THINK)):
                    args = self.choose()
                    waiting[p.send_call("bank_pay", args)] = (args, time.monotonic())
                if not p._pump(time.monotonic() + 0.2) and p.proc.poll() is None:
                    late = [a for a, since in waiting.values()
                            if time.monotonic() - since > ANSWER_WAIT]
                    if late and p.pid not in self.slot.killed:
                        self.trial.fail(f"pid {p.pid} answered none of {late[:3]} within "
                                        f"{ANSWER_WAIT} s")
                        return
                for ident in [i for i in waiting if json.dumps(i) in p.answers]:
                    args, _ = waiting.pop(ident)
                    self.trial.answered(p, args, p.answers.pop(json.dumps(ident)))
        except OSError:                            # its proxy was just killed
            pass
        if self.trial.stop.is_set():               # the last answers, before the proxy stops
            deadline = time.monotonic() + ANSWER_WAIT
            while waiting and time.monotonic() < deadline and p._pump(deadline):
                for ident in [i for i in waiting if json.dumps(i) in p.answers]:
                    args, _ = waiting.pop(ident)
                    self.trial.answered(p, args, p.answers.pop(json.dumps(ident)))
        for args, _ in waiting.values():
            self.trial.answered(p, args, None)


class BudgetTrial:
    """Its length is counted in answers, never in seconds: a slow machine runs the same
    trial, only longer. The kills come after numbers of answers drawn from the seed."""

    def __init__(self, tmp, seed: int, answers: int, program: str = PROXY,
                 kills: bool = True, until_found: bool = False):
        self.seed, self.answers = seed, answers
        self.until_found = until_found      # stop once the books find a window over
        self.rng = random.Random(seed)
        self.schedule: list[int] = []       # the answers counted when each kill comes
        while kills:
            at = (self.schedule[-1] if self.schedule else 0) + self.rng.randint(*BUDGET_KILL_GAP)
            if at > answers:
                break
            self.schedule.append(at)
        self.d = BudgetDir(tmp, program)
        self.log = Timeline()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.last: dict[str, tuple[dict, str]] = {}    # request -> (arguments, last prefix)
        self.said: dict[str, int] = {}                  # answers by prefix
        self.count = 0                                  # answers, all prefixes
        self.cap_denials = 0
        self.ran = 0.0                                  # seconds the trial ran
        self.kills = 0
        self.decided: dict[str, int] = {}
        self.failures: list[str] = []

    def fail(self, why: str) -> None:
        self.log.add(f"FAILURE {why}")
        self.failures.append(why)

    def open_requests(self) -> tuple[list[dict], list[dict]]:
        """The requests cut off or of unknown outcome, and those waiting for an approval."""
        with self.lock:
            return ([a for a, pfx in self.last.values()
                     if pfx in OPEN_PREFIXES and pfx != "PENDING_APPROVAL"],
                    [a for a, pfx in self.last.values() if pfx == "PENDING_APPROVAL"])

    def answered(self, p, args: dict, msg: dict | None) -> None:
        if msg is None:
            pfx, said = "lost", ""
        elif "error" in msg:
            pfx, said = "error", json.dumps(msg["error"])
            self.fail(f"protocol error from pid {p.pid} for {args}: {said}")
        else:
            pfx, said = prefix(msg["result"]), text(msg["result"])
            pfx = "paid" if said.startswith("paid ") else pfx
        with self.lock:
            self.last[canon(args)] = (args, pfx)
            self.said[pfx] = self.said.get(pfx, 0) + 1
            self.count += 1
            self.cap_denials += pfx == "DENIED" and 'limit "cap"' in said
        self.log.add(f"pid {p.pid} bank_pay {canon(args)} -> {pfx}: {said[:140]}")

    def killer(self, slots: list[Slot]) -> None:
        rng = random.Random(self.seed * 7 + 3)
        for at in self.schedule:
            while self.count < at:
                if self.stop.wait(BUDGET_LOOK / 10):
                    return
            slot = slots[rng.randrange(2)]
            if slot.kill():
                self.kills += 1
                try:
                    slot.start()
                except Exception as e:             # a proxy that cannot start is a finding
                    self.fail(f"slot{slot.index} could not start again: {e}")

    def operator(self) -> None:
        rng = random.Random(self.seed * 7 + 1)
        while not self.stop.wait(rng.uniform(*BUDGET_OPERATOR_GAP)):
            try:
                pending = [a for a in read_db(self.d.db)["approvals"] if a[3] == "pending"]
            except sqlite3.Error as e:
                self.log.add(f"operator: database busy: {e}")
                continue
            # An interruption first: until it is decided its tool is BLOCKED for every call.
            first = [a for a in pending if a[2] == INTERRUPTED] or pending
            if not first:
                continue
            aid, run_id, kind = rng.choice(first)[:3]
            action = "approve" if kind == INTERRUPTED or rng.random() < 0.75 else "reject"
            argv = [action, run_id, "-approval", aid, "-by", "operator"]
            code, out, err = run_cli("-db", self.d.db, *argv + (["-note", "budget"]
                                                                 if action == "reject" else []))
            self.decided[action] = self.decided.get(action, 0) + (code == 0)
            self.log.add(f"operator: {action} {aid} ({kind}) -> exit {code} {err.strip()[:120]}")

    def run(self) -> BudgetBooks:
        slots = [Slot(self.d, i, self.log) for i in range(2)]
        hosts = [BudgetHost(self, s, random.Random(self.seed * 7 + 10 + s.index))
                 for s in slots]
        actors = hosts + [threading.Thread(target=self.operator, daemon=True)]
        killer = threading.Thread(target=self.killer, args=(slots,), daemon=True)
        for a in actors + [killer]:
            a.start()
        began = time.monotonic()
        if self.until_found:
            self.go_on(lambda: bool(check_budget_books(self.d.db, self.d.ledger).problems),
                       self.answers)
        else:
            self.go_on(lambda: not killer.is_alive() and self.count >= self.answers,
                       self.answers)
            # The kills may leave no window that reaches the cap (each leaves an unknown
            # outcome that blocks the tool until an operator approves it, so half the
            # answers may be BLOCKED): it goes on without them until the books hold both a
            # refusal by the cap and a run approved over soft, at most BUDGET_OVERTIME
            # times its answers more.
            self.go_on(lambda: self.cap_denials > 0 and self.approved_over_soft(),
                       self.count + self.answers * BUDGET_OVERTIME)
        self.ran = time.monotonic() - began
        self.stop.set()
        killer.join(STOP_WAIT + 60)
        for a in actors:
            a.join(ANSWER_WAIT + STOP_WAIT)
            if a.is_alive():
                self.fail(f"{a} did not stop")
        for s in slots:
            if s.ready.wait(60):
                s.proc.close_stdin()
                code = s.proc.wait_exit(STOP_WAIT)
                if code != 0:
                    self.fail(f"pid {s.proc.pid} exited {code} on stdin close")
        return check_budget_books(self.d.db, self.d.ledger)

    def go_on(self, done, most: int) -> None:
        """Until done() or most answers, looking every BUDGET_LOOK; a failure when no
        answer at all came for BUDGET_QUIET (the trial is stuck, however slow the machine)."""
        seen, since = self.count, time.monotonic()
        while not done() and self.count < most and not self.stop.wait(BUDGET_LOOK):
            if self.count != seen:
                seen, since = self.count, time.monotonic()
            elif time.monotonic() - since > BUDGET_QUIET:
                self.fail(f"no answer in {BUDGET_QUIET:.0f} s, after {self.count}")
                return

    def approved_over_soft(self) -> bool:
        """Whether a run an operator approved over `soft` has started."""
        try:
            rows = read_db(self.d.db)
        except sqlite3.Error:
            return False                           # busy: asked again at the next look
        return any(e[2] for e in budget_executions(rows["events"], rows["approvals"]))

    def report(self, books: BudgetBooks) -> str:
        parts = [f"budget trial seed {self.seed}", "problems:", *books.problems,
                 *self.failures, "timeline:", *self.log.lines]
        for p in self.d.procs:
            parts += [f"stderr of pid {p.pid}:", p.stderr()[-4000:]]
        return "\n".join(parts)


def budget_trial(tmp, seed: int, answers: int, program: str = PROXY, kills: bool = True,
                 until_found: bool = False):
    trial = BudgetTrial(tmp, seed, answers, program, kills, until_found)
    try:
        return trial, trial.run()
    finally:
        trial.stop.set()
        trial.d.cleanup()


def test_budget_books_catch_a_window_over_its_max():
    """The window checker is not vacuous: executions that fit pass; one more inside the
    window, or an approval over soft counted as over cap, is found."""
    D = decimal.Decimal
    fits = [(0.0, D(20), False), (0.5, D("19.5"), True), (1.9, D("0.5"), True),
            (2.0, D(10), False)]
    assert check_budget_windows(fits, 2.0, D(40), D(20)) == []
    over_cap = fits + [(2.4, D("10.000000000000000000001"), True)]
    assert check_budget_windows(over_cap, 2.0, D(40), D(20)) != []
    over_soft = [(0.0, D(15), False), (1.0, D(6), False)]
    assert check_budget_windows(over_soft, 2.0, D(40), D(20)) != []
    assert check_budget_windows([(0.0, D(15), False), (2.0, D(6), False)], 2.0, D(40),
                                D(20)) == []                     # 0.0 left the window at 2.0


def test_torture_budget_holds_across_two_proxies_and_kills(tmp_path, capsys):
    trial, books = budget_trial(tmp_path / "budget", SEED, BUDGET_ANSWERS)
    summary = (f"torture budget: seed {SEED}: {trial.ran:.0f} s, {trial.kills} kills of "
               f"{len(trial.schedule)}, {trial.count} answers "
               f"{dict(sorted(trial.said.items()))}, "
               f"{books.executions} executions ({books.approved_over_soft} approved over "
               f"soft), {books.payments} payments, {trial.cap_denials} denied by cap, "
               f"operator {trial.decided}, {len(books.problems)} windows over")
    with capsys.disabled():
        print("\n" + summary)
        for line in [x for x in trial.log.lines if "-> UNAVAILABLE" in x][:UNAVAILABLE_SHOWN]:
            print(f"  {line[:400]}")            # a fault's answer, allowed; what it said
        if books.problems or trial.failures:
            print(trial.report(books))
    assert not books.problems and not trial.failures, summary
    assert trial.kills == len(trial.schedule) > 0, summary
    assert books.executions and trial.cap_denials and books.approved_over_soft, summary


def test_torture_budget_catches_a_check_outside_the_transaction(tmp_path, capsys):
    """A planted mutant: the limits are checked only by the evaluation before the start's
    transaction (its check inside it never refuses), and a call waits 0.2 s between the
    two, long enough that the two proxies' calls meet in it on a loaded machine (at 0.05 s
    a busy run could spend its answers without a meeting). The same trial, without kills (a kill's unknown outcome blocks the tool for a
    while), must find a window over its max; it stops when it does, or after
    BUDGET_MUTANT_ANSWERS answers without one (it fails then)."""
    with open(PROXY) as f:
        source = f.read()
    for old, new in [
            ("            if problem or (used + adds > limit.most and",
             "            if False and (used + adds > limit.most and"),
            ("        judged = self._prejudge(run_id, step_id, goal, limits, decision)\n",
             "        judged = self._prejudge(run_id, step_id, goal, limits, decision)\n"
             "        time.sleep(0.2)\n")]:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    mutant = tmp_path / "agentrt_proxy.py"
    mutant.write_text(source)
    trial, books = budget_trial(tmp_path / "budget", SEED, BUDGET_MUTANT_ANSWERS, str(mutant),
                                kills=False, until_found=True)
    with capsys.disabled():
        print(f"\ntorture budget mutant: seed {SEED}: {trial.ran:.0f} s, {trial.count} "
              f"answers, {books.executions} executions, "
              f"{len(books.problems)} windows over; first: {books.problems[:1]}")
    assert books.problems, trial.report(books)
