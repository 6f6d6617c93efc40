"""The machine's own faults under a serving proxy: the database locked by another writer past
the busy timeout, the disk full at each commit of each flow, the database made read-only, the
WAL file deleted, the clock stepped by an hour, and the process stopped past its lease.

Each fault gets the answer the seed prescribes ("If the database fails under a call, the
proxy answers UNAVAILABLE", which says whether anything was executed, checked against the
fake server's ledger), nothing recorded before the fault is lost or changed, the event chain
verifies, and the next call after the fault clears works.

Specification: the seed's outcome prefixes (UNAVAILABLE, UNRECORDED), "Timeouts, crashes, and
restarts" (leases), Limitations (a database that fails under a call); DESIGN.md section 5.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import stat
import subprocess
import time

import pytest

from process_helpers import ProcessDir, eventually, eventually_async, is_error, prefix, text
from proxy_harness import DEFAULT_RULES, ProxyHarness, ap

ALLOW_PAY = dict(DEFAULT_RULES, pay={"side_effect": "remote_mutation", "timeout": "10s",
                                     "outcome": "allow"})
FULL = "database or disk is full"
NOTHING_RAN = "Nothing was executed."
IT_RAN = "It was executed"
TABLES = ("runs", "steps", "approvals", "events", "proxy_calls", "tool_specs")
# Columns a healthy proxy rewrites on its own: the lease heartbeat renews a running call.
VOLATILE = {"runs": ("lease_expires_at",)}


# -- reading the record behind the proxy's back ---------------------------------------------

def snapshot(db: str) -> dict:
    """Every row of the tables that keep the record, by table, read on a connection of its
    own (it sees what is committed, never a transaction in progress)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        out = {}
        for table in TABLES:
            cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")
                    if r[1] not in VOLATILE.get(table, ())]
            out[table] = sorted(conn.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall(),
                                key=repr)
        return out
    finally:
        conn.close()


def events(db: str) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("SELECT seq, run_id, step_id, at, type, payload_json, hash "
                            "FROM events ORDER BY seq").fetchall()
    finally:
        conn.close()


def assert_kept(before: dict, after: dict) -> None:
    """Nothing recorded before is lost: every event is still there, unchanged and in order,
    and every row of a finished run is unchanged."""
    assert set(before["events"]) <= set(after["events"]), "an earlier event was lost or changed"
    done = {r[0] for r in before["runs"] if r[2] in ap.TERMINAL}
    for table, key in (("runs", 0), ("steps", 1), ("approvals", 1)):
        old = [r for r in before[table] if r[key] in done]
        assert set(old) <= set(after[table]), f"a finished run's {table} row changed"


def assert_chain_intact(h: ProxyHarness) -> None:
    report = ap.verify_events(h.store)
    assert report.broken is None, report.broken


def want(result: dict, pfx: str, error: bool) -> str:
    t = text(result)
    assert t.startswith(pfx + ":"), f"want {pfx}, got: {t}"
    assert is_error(result) is error, f"isError {is_error(result)} for: {t}"
    return t


# -- the disk full, at a chosen commit ------------------------------------------------------

class FullDisk:
    """The store's connection, whose COMMITs fail as SQLite's SQLITE_FULL does from the Nth
    one on, until cleared (a full disk stays full): every other statement passes through.
    At the first failing commit it notes what was committed then, so a test can say the
    failed transaction left nothing behind."""

    def __init__(self, conn: sqlite3.Connection, db: str):
        self._conn, self.db = conn, db
        self.commits, self.full_from, self.at_fault, self.lasting = 0, 0, None, True

    def execute(self, sql, *args):
        if sql.strip().upper() == "COMMIT":
            self.commits += 1
            if self.full_from and (self.commits == self.full_from or
                                   self.lasting and self.commits > self.full_from):
                if self.at_fault is None:
                    self.at_fault = snapshot(self.db)
                raise sqlite3.OperationalError(FULL)
        return self._conn.execute(sql, *args)

    def fill(self, at: int, lasting: bool = True) -> None:
        """Full at the at-th commit counted from now, and (lasting) every one after it."""
        self.commits, self.full_from, self.at_fault = 0, at, None
        self.lasting = lasting

    def clear(self) -> None:
        self.full_from = 0

    def __getattr__(self, name):
        return getattr(self._conn, name)


def full_disk(h: ProxyHarness) -> FullDisk:
    disk = FullDisk(h.store.conn, h.cfg.database)
    h.store.conn = disk
    return disk


def commits_of(make, flow) -> int:
    """How many commits ``flow`` makes on a healthy disk."""
    h = make()
    try:
        disk = full_disk(h)
        prepare, fault = flow
        state = prepare(h)
        disk.fill(0)
        fault(h, state)
        return disk.commits
    finally:
        h.close()


PAY_7 = {"to": "bob", "amount": 7}


def paid_once_before(h: ProxyHarness) -> None:
    """An earlier payment on record, through the policy this harness has."""
    r = h.call("bank_pay", {"to": "amy", "amount": 1})
    if h.prefix(r) == "PENDING_APPROVAL":
        h.decide(h.pending()[0])
        r = h.call("bank_pay", {"to": "amy", "amount": 1})
    assert h.text(r) == "paid 1.00 to amy", h.text(r)


def prepare_plain(h):
    paid_once_before(h)


def prepare_approved(h):
    paid_once_before(h)
    want(h.call("bank_pay", PAY_7), "PENDING_APPROVAL", False)
    h.decide(h.pending()[0])


def prepare_held(h):
    paid_once_before(h)
    want(h.call("bank_pay", PAY_7), "PENDING_APPROVAL", False)
    return h.pending()[0]


def call_pay_7(h, _state):
    return h.call("bank_pay", PAY_7)


def operator_decides(h, approval):
    """The operator approves (through the store, as the command does): the exception it
    met, or None."""
    try:
        h.decide(approval)
    except ap.StoreError as exc:
        return exc
    return None


FLOWS = {
    "allowed call": (ALLOW_PAY, (prepare_plain, call_pay_7)),
    "held call": (None, (prepare_plain, call_pay_7)),
    "collection": (None, (prepare_approved, call_pay_7)),
    "operator decision": (None, (prepare_held, operator_decides)),
}


def after_the_fault(h: ProxyHarness, flow: str, answer, paid_before: int) -> None:
    """What the host was told, checked against what reached the server."""
    if flow == "operator decision":
        assert isinstance(answer, ap.StoreError) and FULL in str(answer), answer
        assert h.pending(), "the approval is no longer pending"
        want(h.call("bank_pay", PAY_7), "PENDING_APPROVAL", False)   # a read: no commit
        assert h.payments() == paid_before
        return
    if h.payments() == paid_before:
        t = want(answer, "UNAVAILABLE", True)
        assert NOTHING_RAN in t, t
    else:
        assert h.payments() == paid_before + 1
        t = want(answer, "UNAVAILABLE", True)
        assert IT_RAN in t and "do not call it again" in t, t


def lease_gone(h: ProxyHarness) -> None:
    """Wait (bounded) until no run holds a live lease: a run the fault left leased to this
    process, whose heartbeat let it go, runs out by itself."""
    def gone():
        return all(not r.lease_expires_at or ap.parse_time(r.lease_expires_at) < time.time()
                   for r in h.runs() if r.status == ap.RUNNING)
    eventually(gone, 15, "the lease of the run the fault left to run out")


def once_cleared(h: ProxyHarness, flow: str, paid_before: int) -> None:
    """The next call works: a request the fault left unexecuted runs once; one the fault
    left executed but unrecorded is never run again without an operator, who is asked."""
    executed = h.payments() > paid_before
    r = h.call("bank_pay", PAY_7)
    if flow == "operator decision":
        want(r, "PENDING_APPROVAL", False)
        h.decide(h.pending()[0])
        r = h.call("bank_pay", PAY_7)
    if not executed:
        if flow == "held call":
            want(r, "PENDING_APPROVAL", False)
            h.decide(h.pending()[0])
            r = h.call("bank_pay", PAY_7)
        assert h.text(r) == "paid 7.00 to bob", h.text(r)
        assert h.payments() == paid_before + 1
    else:
        if h.prefix(r) == "IN_PROGRESS":      # the lease could not be cleared on a full disk
            lease_gone(h)
            r = h.call("bank_pay", PAY_7)
        want(r, "INTERRUPTED", False)
        assert h.payments() == paid_before + 1
        interruption = h.pending()[-1]
        assert interruption.kind == ap.INTERRUPTED_KIND
        h.decide(interruption, approve=False, note="it went through")
        want(h.call("bank_pay", PAY_7), "REJECTED", True)
        assert h.payments() == paid_before + 1
    r = h.call("bank_balance", {"account": "main"})
    assert not h.is_error(r), h.text(r)


@pytest.mark.parametrize("lasting", [True, False], ids=["stays full", "one commit"])
@pytest.mark.parametrize("flow", list(FLOWS))
def test_disk_full_at_each_commit(tmp_path, flow, lasting):
    """The disk fills at each commit a flow makes, in turn (and stays full until cleared, or
    fails that one commit): the host is told UNAVAILABLE, saying truly whether the payment
    ran; the failed transaction leaves nothing behind, nothing earlier is lost, and once the
    disk has room the next call works and the chain verifies."""
    rules, steps = FLOWS[flow]
    made = iter(range(1000))

    def make():
        where = tmp_path / f"h{next(made)}"
        where.mkdir()
        return ProxyHarness(where, rules=rules, lease_ttl="3s")
    count = commits_of(make, steps)
    assert count >= 1
    prepare, fault = steps
    for n in range(1, count + 1):
        h = make()
        try:
            disk = full_disk(h)
            state = prepare(h)
            before, paid = snapshot(h.cfg.database), h.payments()
            disk.fill(n, lasting)
            answer = fault(h, state)
            assert disk.at_fault is not None, f"commit {n} of {count} was never made"
            after = snapshot(h.cfg.database)
            if lasting:
                assert after == disk.at_fault, f"commit {n}: the failed transaction left rows"
            assert_kept(before, after)
            after_the_fault(h, flow, answer, paid)
            disk.clear()
            once_cleared(h, flow, paid)
            assert_kept(before, snapshot(h.cfg.database))
            assert_chain_intact(h)
        finally:
            h.close()


def bound(h: ProxyHarness, pages: int | None = None) -> None:
    """Bound the database to ``pages`` pages (its present size unless told) on the proxy's
    own connection: a write that needs one more page fails with a real SQLITE_FULL."""
    conn = h.store.conn
    if pages is None:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={pages}")


UNBOUNDED = 1 << 30
BIG = 30000          # characters in a payee's name: the record of the call needs new pages


def test_database_at_its_size_bound_refuses_a_call_and_says_why(tmp_path):
    """A genuine SQLITE_FULL (the database at max_page_count) as a new call is recorded:
    UNAVAILABLE, nothing executed, nothing written, and the operator's log names the full
    disk. Once there is room the same call runs once."""
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY)
    try:
        paid_once_before(h)
        before, paid = snapshot(h.cfg.database), h.payments()
        args = {"to": "b" * BIG, "amount": 2}
        bound(h)
        t = want(h.call("bank_pay", args), "UNAVAILABLE", True)
        assert NOTHING_RAN in t and h.payments() == paid
        assert snapshot(h.cfg.database) == before
        errors = [line for line in h.log_lines if line.startswith("error:")]
        assert errors and FULL in errors[-1], errors
        bound(h, UNBOUNDED)
        r = h.call("bank_pay", args)
        assert h.text(r) == f"paid 2.00 to {'b' * BIG}" and h.payments() == paid + 1
        assert_kept(before, snapshot(h.cfg.database))
        assert_chain_intact(h)
    finally:
        h.close()


def test_database_full_while_a_payment_runs_says_it_ran(tmp_path):
    """The database reaches its bound while a payment is inside the server: its outcome
    cannot be recorded, so the host is told UNAVAILABLE and that it was executed; the
    identical call afterwards runs nothing and asks an operator."""
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY)
    try:
        paid_once_before(h)
        before, paid = snapshot(h.cfg.database), h.payments()
        args = {"to": "c" * BIG, "amount": 3, "mode": "block"}
        raw = json.dumps(args).encode()
        ident = h.request("tools/call", raw_params=b'{"name":"bank_pay","arguments":%s}' % raw,
                          wait=False)
        h.run(eventually_async(lambda: h.payments() == paid + 1, 15, "the payment to run"))
        bound(h)
        h.release()
        t = want(h.answer(ident)["result"], "UNAVAILABLE", True)
        assert IT_RAN in t and "do not call it again" in t, t
        bound(h, UNBOUNDED)
        assert_kept(before, snapshot(h.cfg.database))
        r = h.call("bank_pay", args)
        if h.prefix(r) == "IN_PROGRESS":
            lease_gone(h)
            r = h.call("bank_pay", args)
        want(r, "INTERRUPTED", False)
        assert h.payments() == paid + 1
        assert_chain_intact(h)
    finally:
        h.close()


# -- the database locked by another writer past the busy timeout ----------------------------

SHORT_BUSY_MS = 200      # the proxy's busy_timeout in these tests: a lock held past it


class Writer:
    """Another writer on the database, holding its write lock (BEGIN IMMEDIATE)."""

    def __init__(self, db: str):
        self.conn = sqlite3.connect(db, isolation_level=None, timeout=10)

    def lock(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def unlock(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def close(self) -> None:
        self.unlock()
        self.conn.close()


@pytest.fixture
def busy(monkeypatch):
    monkeypatch.setattr(ap, "BUSY_TIMEOUT_MS", SHORT_BUSY_MS)


def test_locked_database_refuses_a_new_call_and_nothing_runs(tmp_path, busy):
    """Another writer holds the lock past the busy timeout as a call is to be recorded: the
    host is told UNAVAILABLE, nothing executed; the lock released, the same call runs once.
    An operator's decision meanwhile is refused naming the lock, and decides nothing."""
    h = ProxyHarness(tmp_path)
    writer = Writer(h.cfg.database)
    try:
        paid_once_before(h)
        before, paid = snapshot(h.cfg.database), h.payments()
        writer.lock()
        t = want(h.call("bank_pay", PAY_7), "UNAVAILABLE", True)
        assert NOTHING_RAN in t and h.payments() == paid
        writer.unlock()
        assert snapshot(h.cfg.database) == before
        want(h.call("bank_pay", PAY_7), "PENDING_APPROVAL", False)
        approval = h.pending()[0]
        held = snapshot(h.cfg.database)
        writer.lock()
        with pytest.raises(ap.StoreError, match="locked"):
            h.decide(approval)
        want(h.call("bank_pay", PAY_7), "PENDING_APPROVAL", False)
        writer.unlock()
        assert snapshot(h.cfg.database) == held
        h.decide(approval)
        assert h.text(h.call("bank_pay", PAY_7)) == "paid 7.00 to bob"
        assert h.payments() == paid + 1
        assert_kept(before, snapshot(h.cfg.database))
        assert_chain_intact(h)
    finally:
        writer.close()
        h.close()


def test_locked_database_as_a_payment_returns_says_it_ran(tmp_path, busy):
    """The lock is taken while a payment is inside the server and held past the busy
    timeout as its outcome is recorded: UNAVAILABLE, saying it was executed. Released, the
    identical call runs nothing and an operator is asked."""
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY, lease_ttl="3s")
    writer = Writer(h.cfg.database)
    try:
        paid_once_before(h)
        before, paid = snapshot(h.cfg.database), h.payments()
        args = {"to": "bob", "amount": 7, "mode": "block"}
        raw = json.dumps(args).encode()
        ident = h.request("tools/call", raw_params=b'{"name":"bank_pay","arguments":%s}' % raw,
                          wait=False)
        h.run(eventually_async(lambda: h.payments() == paid + 1, 15, "the payment to run"))
        writer.lock()
        h.release()
        t = want(h.answer(ident)["result"], "UNAVAILABLE", True)
        assert IT_RAN in t and "do not call it again" in t, t
        writer.unlock()
        assert_kept(before, snapshot(h.cfg.database))
        r = h.call("bank_pay", args)
        if h.prefix(r) == "IN_PROGRESS":      # the lease could not be cleared under the lock
            lease_gone(h)
            r = h.call("bank_pay", args)
        want(r, "INTERRUPTED", False)
        assert h.payments() == paid + 1
        assert_chain_intact(h)
    finally:
        writer.close()
        h.close()


# -- the database file, its WAL, or its directory made read-only while serving ---------------

@contextlib.contextmanager
def made_read_only(paths: list[str]):
    """The paths read-only, then as they were. Root is not stopped by permissions, so as
    root they are made immutable (chattr +i), which on ext4 refuses even a write through a
    descriptor opened before; otherwise chmod a-w, which stops what opens them next."""
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in paths}
    immutable = os.geteuid() == 0 and subprocess.run(
        ["chattr", "+i", *paths], capture_output=True).returncode == 0
    if not immutable:
        for p in paths:
            os.chmod(p, modes[p] & ~0o222)
    try:
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", *paths], check=True)
        for p, mode in modes.items():
            os.chmod(p, mode)


def agrees(h: ProxyHarness, r: dict, paid_before: int, args: dict) -> bool:
    """The answer is what reached the server: the payment's own result, or UNAVAILABLE
    saying truly whether it was executed. True when it ran."""
    if h.payments() == paid_before:
        t = want(r, "UNAVAILABLE", True)
        assert NOTHING_RAN in t, t
        return False
    assert h.payments() == paid_before + 1
    if h.prefix(r) == "UNAVAILABLE":
        assert IT_RAN in h.text(r), h.text(r)
    else:
        assert h.text(r) == f"paid {args['amount']:.2f} to {args['to']}", h.text(r)
    return True


READ_ONLY = {
    "database file": lambda db: [db],
    "WAL file": lambda db: [db + "-wal"],
    "directory": lambda db: [os.path.dirname(db)],
}


@pytest.mark.parametrize("target", list(READ_ONLY))
def test_read_only_while_serving(tmp_path, target):
    """The database file, its WAL, or its directory is made read-only under a serving proxy.
    Each call is answered as the ledger says (recorded, or UNAVAILABLE saying whether it
    ran); the proxy stopped while it is still read-only, and started again once it is
    writable, finds every earlier record, the chain verifies, and the next call works."""
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY)
    db = h.cfg.database
    ran = []
    try:
        paid_once_before(h)
        before = snapshot(db)
        with made_read_only(READ_ONLY[target](db)):
            for amount in (2, 3):
                args, paid = {"to": "bob", "amount": amount}, h.payments()
                r = h.call("bank_pay", args)
                if agrees(h, r, paid, args):
                    ran.append(args)
            r = h.call("bank_balance", {"account": "main"})
            assert not h.is_error(r) or h.prefix(r) == "UNAVAILABLE", h.text(r)
            closing, h = h, None
            closing.close()               # stopped while still read-only
    finally:
        if h is not None:
            h.close()
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY, pin=False)
    try:
        assert_kept(before, snapshot(db))
        assert_chain_intact(h)
        for args in ran:                  # what ran is on record: not run again
            want(h.call("bank_pay", args), "DUPLICATE", True)
        paid = h.payments()
        r = h.call("bank_pay", {"to": "bob", "amount": 9})
        assert h.text(r) == "paid 9.00 to bob" and h.payments() == paid + 1, h.text(r)
    finally:
        h.close()


# -- processes: the WAL deleted underneath, the process stopped past its lease --------------



def operator_verify(d: ProcessDir) -> str:
    code, out, err = d.operator("verify")
    assert code == 0 and "intact" in out, out + err
    return out


@pytest.mark.parametrize("how", ["crash", "stop"])
def test_wal_deleted_under_a_serving_proxy_loses_nothing(tmp_path, procs, how):
    """runs.db-wal is deleted between calls. SQLite would go on committing into the file
    it has open, which no other process can read and a crash loses with every record since
    the last checkpoint (the whole database, schema and all, on a young file). The proxy
    notices at its next write: it writes what it committed into the database and refuses
    to record more, so the next call is UNAVAILABLE and nothing runs. Killed or stopped,
    nothing it answered is lost, the chain verifies, and started again it works."""
    d = procs(tmp_path, allow_pay=True)
    p = d.start()
    assert text(p.call("bank_pay", {"to": "amy", "amount": 1})) == "paid 1.00 to amy"
    os.unlink(d.db + "-wal")
    t = want(p.call("bank_pay", {"to": "bob", "amount": 2}), "UNAVAILABLE", True)
    assert NOTHING_RAN in t and d.payments() == 1, t
    r = p.call("bank_pay", {"to": "amy", "amount": 1})
    assert prefix(r) == "DUPLICATE" and d.payments() == 1, text(r)
    assert "WAL file was deleted or replaced" in p.stderr(), p.stderr()
    if how == "crash":
        p.crash()
    else:
        p.stop()
    runs = d.runs()
    assert [r["status"] for r in runs] == ["COMPLETED"], runs
    operator_verify(d)
    p = d.start()
    r = p.call("bank_pay", {"to": "amy", "amount": 1})
    assert prefix(r) == "DUPLICATE" and d.payments() == 1, text(r)
    assert text(p.call("bank_pay", {"to": "bob", "amount": 2})) == "paid 2.00 to bob"
    p.stop()
    assert d.payments() == 2 and len(d.runs()) == 2
    operator_verify(d)


def test_stopped_past_the_lease_while_a_payment_runs_pays_once(tmp_path, procs):
    """A proxy is stopped (SIGSTOP) while its payment is inside the server, past its lease.
    A second proxy on the database, given the identical call, answers IN_PROGRESS while the
    lease lives and, once it has run out, takes the run over and asks an operator
    (INTERRUPTED) instead of paying again. The payment answers while the first is still
    stopped; continued, it records it as a late outcome and gives its host the result. The
    books agree: one payment, on record, the chain intact; the operator's rejection then
    runs nothing in either proxy, and the next payment works."""
    d = procs(tmp_path, allow_pay=True, lease_ttl="3s")
    args = {"to": "rob", "amount": 5, "mode": "block"}
    first, second = d.start("first"), d.start("second")
    ident = first.send_call("bank_pay", args)
    eventually(lambda: d.payments() == 1, 15, "the payment to reach the server")
    run_id = d.runs()[0]["id"]
    os.kill(first.pid, signal.SIGSTOP)
    try:
        r = second.call("bank_pay", args)
        assert prefix(r) == "IN_PROGRESS" or d.lease(run_id)[2] < time.time(), text(r)
        eventually(lambda: d.lease(run_id)[2] is not None and d.lease(run_id)[2] < time.time(),
                   15, "the stopped proxy's lease to run out")
        r = second.call("bank_pay", args)
        assert prefix(r) == "INTERRUPTED" and not is_error(r), text(r)
        d.release()
    finally:
        os.kill(first.pid, signal.SIGCONT)
    r = first.result(ident)
    assert text(r) == "paid 5.00 to rob", text(r)
    assert d.payments() == 1
    # The late success settled the interruption it asked about: nothing waits, and the
    # identical call, in either proxy, is answered with the recorded payment.
    assert [a for a in d.pending() if a["run_id"] == run_id] == []
    asked = [a for a in d.approvals() if a["run_id"] == run_id]
    assert [(a["kind"], a["status"]) for a in asked] == [("interrupted_side_effect", "settled")]
    for p in (first, second):
        r = p.call("bank_pay", args)
        assert prefix(r) == "DUPLICATE" and "paid 5.00 to rob" in text(r), text(r)
    code, out, err = d.operator("reject", run_id, "-approval", asked[0]["id"], "-note", "x")
    assert code == 1 and "finished after it was cut off" in err, out + err
    assert d.payments() == 1
    late = [json.loads(pl) for t, pl in d.query(
        "SELECT type, payload_json FROM events WHERE run_id=? ORDER BY seq", (run_id,))
        if t == "step.tool_finished"]
    assert len(late) == 1 and late[0].get("late") is True, late
    operator_verify(d)
    assert text(second.call("bank_pay", {"to": "sue", "amount": 6})) == "paid 6.00 to sue"
    assert d.payments() == 2
    first.stop()
    second.stop()


# -- the clock stepped back and forward by an hour ------------------------------------------

HOUR = 3600


def test_clock_steps_around_a_held_call_and_its_expiry(tmp_path):
    """A held call with a 30-minute approval: the clock an hour back keeps it pending and
    runs nothing; an hour forward expires it (EXPIRED, nothing ran); stepped back again the
    identical call is still refused as EXPIRED, never asked again or run. An approved grant
    an hour past its 30-minute life executes nothing either. The chain verifies."""
    h = ProxyHarness(tmp_path, approval_ttl="30m", grant_ttl="30m")
    try:
        want(h.call("bank_pay", PAY_7), "PENDING_APPROVAL", False)
        h.clock.skew = -HOUR
        want(h.call("bank_pay", PAY_7), "PENDING_APPROVAL", False)
        h.clock.skew = HOUR
        want(h.call("bank_pay", PAY_7), "EXPIRED", True)
        h.clock.skew = 0
        want(h.call("bank_pay", PAY_7), "EXPIRED", True)
        assert h.payments() == 0 and not h.pending()
        args = {"to": "eve", "amount": 8}
        want(h.call("bank_pay", args), "PENDING_APPROVAL", False)
        h.decide(h.pending()[0])
        h.clock.skew = HOUR
        want(h.call("bank_pay", args), "EXPIRED", True)
        assert h.payments() == 0
        h.clock.skew = 0
        want(h.call("bank_pay", args), "EXPIRED", True)
        assert h.payments() == 0
        assert_chain_intact(h)
    finally:
        h.close()


def test_clock_steps_around_the_repeat_window(tmp_path):
    """A payment that ran: the clock an hour back leaves the identical call a DUPLICATE
    (the earlier one is not forgotten for being in the future); an hour forward the
    10-minute window has passed and it runs again, once, as the seed says."""
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY)
    try:
        assert h.text(h.call("bank_pay", PAY_7)) == "paid 7.00 to bob"
        h.clock.skew = -HOUR
        want(h.call("bank_pay", PAY_7), "DUPLICATE", True)
        assert h.payments() == 1
        h.clock.skew = HOUR
        assert h.text(h.call("bank_pay", PAY_7)) == "paid 7.00 to bob"
        want(h.call("bank_pay", PAY_7), "DUPLICATE", True)
        h.clock.skew = 0
        want(h.call("bank_pay", PAY_7), "DUPLICATE", True)
        assert h.payments() == 2
        assert_chain_intact(h)
    finally:
        h.close()


def test_clock_steps_around_a_limit_window(tmp_path):
    """A sum limit of 10 an hour: stepped an hour back, what was spent still counts (an
    execution is never counted as earlier than the one before it, so the window grows by
    the step); stepped two hours forward, the window has passed and the cap opens again,
    as the README says. What runs is what the count allowed, and the chain verifies."""
    rules = json.loads(json.dumps(ALLOW_PAY))
    rules["pay"]["limits"] = [{"sum": "/amount", "max": "10", "per": "1h", "over": "deny"}]
    h = ProxyHarness(tmp_path, rules=rules)
    try:
        assert not h.is_error(h.call("bank_pay", {"to": "bob", "amount": 8}))
        h.clock.skew = -HOUR
        want(h.call("bank_pay", {"to": "carol", "amount": 3}), "DENIED", True)
        assert not h.is_error(h.call("bank_pay", {"to": "carol", "amount": 2}))
        want(h.call("bank_pay", {"to": "dave", "amount": 0.5}), "DENIED", True)
        assert h.payments() == 2
        h.clock.skew = HOUR + 1
        # The rows of the two payments are at the real time, an hour behind this clock:
        # both have left the window.
        assert not h.is_error(h.call("bank_pay", {"to": "erin", "amount": 10}))
        want(h.call("bank_pay", {"to": "fay", "amount": 0.01}), "DENIED", True)
        assert h.payments() == 3
        assert_chain_intact(h)
    finally:
        h.close()
