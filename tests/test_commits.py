"""Which commits a call makes, and that each is on disk before what rests on it leaves.

- Every commit runs under synchronous=FULL (DESIGN.md section 5): SQLite syncs the WAL
  before COMMIT returns. Three commit unsynced (NORMAL), each followed by an answer to the
  host and never by a request to a server: a call's outcome, the start of an allowed read
  no limit counts, and a refusal's count. Store.sync syncs them all with one fsync of the
  WAL, and the host's writer calls it before each message leaves (group commit: the calls
  that finish together share one sync). A counted read's start is synced.
- An allowed read-only or mutating call commits its start before its request leaves for the
  server, and its outcome before the call is answered; a mutating call's start is synced.
- A held call and a denied read: every commit synced, all before the answer.
- Every write of the store's connection is inside a transaction begun IMMEDIATE (Store.tx),
  and every transaction that changes a run, a step or an approval records an event in it.
- A transaction in which one change failed rolls back whole, even when the failure was
  caught inside it: nothing of a half-done transaction is committed.
"""

import io
import os
import re

import pytest

import process_helpers
from proxy_harness import ProxyHarness, ap
from test_rules_cost import InstantServer, instant_proxy


class Trace:
    """The statements the store's connection runs, with the synchronous level each COMMIT
    ran under, the point at which the upstream was called and the point of the answer."""

    def __init__(self, store: ap.Store):
        self.lines: list[str] = []
        self.store = store
        self.level = LEVELS[store.conn.execute("PRAGMA synchronous").fetchone()[0]]
        store.conn.set_trace_callback(self.lines.append)

    def mark(self, what: str) -> None:
        self.lines.append(f"-- {what}")

    def commits(self) -> list[str]:
        """'FULL' or 'NORMAL' for each COMMIT, and '-- ...' marks, in order."""
        level, out = self.level, []
        for line in self.lines:
            if line.upper().startswith("PRAGMA SYNCHRONOUS"):
                level = line.split("=", 1)[1] if "=" in line else "unknown"
            elif line == "COMMIT":
                out.append(level)
            elif line.startswith("-- "):
                out.append(line)
        return out

    def transactions(self) -> list[list[str]]:
        """The statements of each transaction, and each write made outside one on its own."""
        out, open_ = [], None
        for line in self.lines:
            if line == "BEGIN IMMEDIATE":
                open_ = []
            elif line in ("COMMIT", "ROLLBACK") and open_ is not None:
                out.append(open_)
                open_ = None
            elif open_ is not None:
                open_.append(line)
            elif WRITES.match(line):
                out.append(["(outside a transaction) " + line])
        return out

    def level_of_a_synced_transaction(self) -> int:
        """The level a plain transaction of the store commits under, read inside it."""
        self.store.conn.set_trace_callback(None)
        with self.store.tx() as tx:
            return tx.rows("SELECT * FROM pragma_synchronous")[0][0]


class MarkingServer(InstantServer):
    def __init__(self, trace_box: list):
        super().__init__()
        self.trace_box = trace_box

    def offers_tasks(self, support):
        return False

    async def call_tool(self, remote, args, timeout, on_task=None):
        self.trace_box[0].mark("upstream called")
        return await super().call_tool(remote, args, timeout)


WAIT = 10
RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
         "refund": {"side_effect": "destructive", "timeout": "10s"}}
FULL = 2
LEVELS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
WRITES = re.compile(r"\s*(INSERT|UPDATE|DELETE|REPLACE|CREATE|DROP)\b", re.I)
RECORD = re.compile(r"\s*(?:INSERT|UPDATE)\b.*?\b(runs|steps|approvals)\b", re.I)


@pytest.fixture
def traced(tmp_path):
    h = ProxyHarness(tmp_path, rules=RULES)
    box: list = [None]
    proxy = instant_proxy(h, MarkingServer(box))
    yield h, proxy, box
    proxy.close()
    h.close()


def call_traced(h, proxy, box, name, args):
    box[0] = Trace(h.store)
    result = h.run(proxy.call(name, args))
    box[0].mark("answered")
    return result, box[0]


def assert_each_change_with_its_event(trace: Trace) -> None:
    for statements in trace.transactions():
        assert not statements[0].startswith("(outside"), statements[0]
        if any(RECORD.match(s) for s in statements):
            assert any(s.startswith("INSERT INTO events") for s in statements), statements


def test_allowed_read_commits_its_start_before_the_request_and_its_outcome_before_the_answer(
        traced):
    h, proxy, box = traced
    result, trace = call_traced(h, proxy, box, "bank_balance", b'{"account":"A-1"}')
    assert not result["isError"], result
    assert trace.commits() == ["NORMAL", "-- upstream called", "NORMAL", "-- answered"]
    assert trace.level_of_a_synced_transaction() == FULL
    assert_each_change_with_its_event(trace)


def test_a_read_a_limit_counts_starts_synced(tmp_path):
    rules = dict(RULES, balance={"side_effect": "read_only", "timeout": "10s",
                                 "limits": [{"calls": 3, "per": "1h"}]})
    h = ProxyHarness(tmp_path, rules=rules)
    box: list = [None]
    proxy = instant_proxy(h, MarkingServer(box))
    try:
        result, trace = call_traced(h, proxy, box, "bank_balance", b'{"account":"A-1"}')
        assert not result["isError"], result
        assert trace.commits() == ["FULL", "-- upstream called", "NORMAL", "-- answered"]
    finally:
        proxy.close()
        h.close()


def test_allowed_mutation_start_is_synced_before_the_request_leaves(traced):
    h, proxy, box = traced
    result, trace = call_traced(h, proxy, box, "bank_pay", b'{"to":"bob","amount":1}')
    assert not result["isError"], result
    assert trace.commits() == ["FULL", "-- upstream called", "NORMAL", "-- answered"]
    assert trace.level_of_a_synced_transaction() == FULL
    assert_each_change_with_its_event(trace)


def test_duplicate_is_answered_after_its_count_commits(traced):
    h, proxy, box = traced
    call_traced(h, proxy, box, "bank_pay", b'{"to":"bob","amount":2}')
    result, trace = call_traced(h, proxy, box, "bank_pay", b'{"to":"bob","amount":2}')
    assert result["isError"] and "DUPLICATE" in h.text(result), result
    assert trace.commits() == ["NORMAL", "-- answered"]      # the refusal's count alone
    assert any("proxy_refusals" in line for line in trace.lines)
    assert trace.level_of_a_synced_transaction() == FULL
    assert_each_change_with_its_event(trace)


def test_held_and_denied_calls_commit_synced_only(tmp_path):
    rules = dict(RULES, balance={"side_effect": "read_only", "timeout": "10s",
                                 "outcome": "deny"})
    h = ProxyHarness(tmp_path, rules=rules)
    box: list = [None]
    proxy = instant_proxy(h, MarkingServer(box))
    try:
        for name, args in (("bank_refund", b'{"payment":"p-1"}'),
                           ("bank_balance", b'{"account":"A-1"}')):
            result, trace = call_traced(h, proxy, box, name, args)
            assert result["isError"], result
            levels = trace.commits()
            assert levels[-1] == "-- answered" and set(levels[:-1]) == {"FULL"}, (name, levels)
            assert trace.level_of_a_synced_transaction() == FULL
            assert_each_change_with_its_event(trace)
    finally:
        proxy.close()
        h.close()


def test_read_whose_arguments_fail_the_schema_commits_synced(traced):
    h, proxy, box = traced
    result, trace = call_traced(h, proxy, box, "bank_balance", b'{"account":7}')
    assert result["isError"] and "INVALID" in h.text(result), result
    levels = trace.commits()
    assert levels[-1] == "-- answered" and set(levels[:-1]) == {"FULL"}, levels


def add_run(tx, run_id: str) -> None:
    tx.exec("INSERT INTO runs (id, goal, status, limits_json, created_at, started_at) "
            "VALUES (?,?,?,?,?,?)", (run_id, "g", "RUNNING", ap.Limits().record(),
                                     "2026-01-01T00:00:00Z", "2026-01-01T00:00:00Z"))
    tx.event(run_id, "", "2026-01-01T00:00:00Z", "run.created", {})


def test_transaction_with_a_failed_change_caught_inside_rolls_back_whole(tmp_path):
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        before = store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        with pytest.raises(ap.StoreError, match="rolled back"):
            with store.tx():
                with store.tx() as tx:
                    add_run(tx, "r-1")
                try:
                    with store.tx() as tx:
                        tx.exec("INSERT INTO no_such_table VALUES (1)")
                except ap.StoreError:
                    pass                    # caught inside: the transaction still fails
        after = store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        assert after == before
        assert not store.conn.in_transaction
        assert store.find_run("r-1") is None
        with store.tx() as tx:              # the store is usable again
            add_run(tx, "r-2")
        assert store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == before + 1
    finally:
        store.close()


def test_synced_transaction_after_unsynced_ones_commits_full(tmp_path):
    """One unsynced transaction that commits, one that fails: the next plain transaction
    runs under synchronous=FULL; a plain transaction inside an unsynced one is part of it."""
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        def level(tx):
            return tx.rows("SELECT * FROM pragma_synchronous")[0][0]
        with store.tx(synced=False) as tx:
            add_run(tx, "r-1")
            assert level(tx) == 1
        with store.tx() as tx:
            assert level(tx) == FULL
        with pytest.raises(ap.StoreError):
            with store.tx(synced=False) as tx:
                tx.exec("INSERT INTO no_such_table VALUES (1)")
        with store.tx() as tx:
            add_run(tx, "r-2")
            assert level(tx) == FULL
        with store.tx(synced=False), store.tx() as tx:
            assert level(tx) == 1
        with store.tx() as tx:
            assert level(tx) == FULL
    finally:
        store.close()


def fsyncs(monkeypatch, fail: bool = False) -> list[str]:
    """The paths Store.sync syncs, in order (SQLite's own syncs are not Python's)."""
    done: list[str] = []
    real = ap.os.fsync

    def fsync(fd):
        done.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd")
                    else str(fd))
        if fail:
            raise OSError(5, "Input/output error")
        real(fd)
    monkeypatch.setattr(ap.os, "fsync", fsync)
    return done


def test_unsynced_commits_are_synced_together_by_one_sync_of_the_wal(tmp_path, monkeypatch):
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        done = fsyncs(monkeypatch)
        store.sync()
        assert done == []                            # nothing owed
        for run_id in ("r-1", "r-2", "r-3"):
            with store.tx(synced=False) as tx:
                add_run(tx, run_id)
        store.sync()
        assert len(done) == 1 and done[0].endswith("runs.db-wal"), done
        store.sync()
        with store.tx() as tx:                       # synced by SQLite: nothing owed
            add_run(tx, "r-4")
        store.sync()
        assert len(done) == 1, done
    finally:
        store.close()


def test_a_failed_sync_is_final(tmp_path, monkeypatch):
    """After a failed sync nothing that rests on a commit leaves (sync raises again) and
    nothing more is written: a mutating call's start, synced by SQLite, could otherwise
    leave upstream on a WAL whose lost page cuts off every frame after it."""
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        done = fsyncs(monkeypatch, fail=True)
        with store.tx(synced=False) as tx:
            add_run(tx, "r-1")
        with pytest.raises(ap.StoreError, match="cannot sync"):
            store.sync()
        monkeypatch.undo()
        with pytest.raises(ap.StoreError, match="failed before"):
            store.sync()
        for synced in (True, False):
            with pytest.raises(ap.StoreError, match="nothing more is recorded"):
                with store.tx(synced=synced) as tx:
                    add_run(tx, "r-2")
        assert store.find_run("r-2") is None and len(done) == 1
    finally:
        store.close()


class Sink(io.BytesIO):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def fileno(self):
        raise io.UnsupportedOperation("no descriptor")

    def write(self, data):
        self.log.append(("wrote", bytes(data)))
        return super().write(data)


def test_the_hosts_writer_syncs_the_store_before_each_message_leaves(tmp_path):
    log: list = []
    writer = ap.LineWriter(Sink(log), lambda: None)
    writer.before = lambda: log.append(("synced", b""))
    writer.write(b"one\n")
    writer.write(b"two\n")
    assert writer.drain(WAIT)
    assert log == [("synced", b""), ("wrote", b"one\n"), ("synced", b""), ("wrote", b"two\n")]


def test_a_failed_sync_ends_serving_and_nothing_leaves(tmp_path):
    log: list = []
    gone: list = []

    def failing():
        raise ap.StoreError("cannot sync the WAL")
    writer = ap.LineWriter(Sink(log), lambda: gone.append(1))
    writer.before = failing
    writer.write(b"one\n")
    writer.write(b"two\n")
    assert writer.drain(WAIT)
    assert log == [] and gone == [1] and writer.broken


TRACED_SERVE = (
    "import os, sys; sys.path.insert(0, sys.argv.pop(1)); log = open(sys.argv.pop(1), 'a'); "
    "import agentrt_proxy as ap; fsync, write = os.fsync, ap._write_all\n"
    "def traced_fsync(fd):\n"
    "    log.write('fsync ' + os.readlink('/proc/self/fd/%d' % fd) + '\\n'); log.flush()\n"
    "    fsync(fd)\n"
    "def traced_write(fd, data):\n"
    "    log.write('answer %d\\n' % len(data)); log.flush(); write(fd, data)\n"
    "os.fsync, ap._write_all = traced_fsync, traced_write\n"
    "sys.exit(ap.main())")


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="names descriptors by /proc")
def test_serving_syncs_a_calls_outcome_before_its_answer_leaves(tmp_path, monkeypatch):
    """Through the real serve path: the outcome of an allowed read commits unsynced, and the
    WAL is synced after it and before the answer is written to the host."""
    log_path = str(tmp_path / "io.log")

    def command(program=process_helpers.PROXY, env=None):
        return [process_helpers.PYTHON, "-c", TRACED_SERVE, process_helpers.ROOT,
                log_path], env
    monkeypatch.setattr(process_helpers, "proxy_command", command)
    d = process_helpers.ProcessDir(tmp_path)
    try:
        p = d.start()
        open(log_path, "w").close()                  # what the call alone does
        answer = p.request("tools/call", {"name": "bank_balance",
                                          "arguments": {"account": "A-1"}})
        assert not answer["result"]["isError"], answer
        lines = open(log_path).read().split("\n")[:-1]
        assert lines[-1].startswith("answer "), lines
        assert lines[-2].startswith("fsync ") and lines[-2].endswith("-wal"), lines
    finally:
        d.cleanup()


FAILING_SYNC = (
    "import os, sys; sys.path.insert(0, sys.argv.pop(1)); import agentrt_proxy as ap\n"
    "def failing_fsync(fd):\n"
    "    raise OSError(5, 'Input/output error')\n"
    "os.fsync = failing_fsync\n"
    "sys.exit(ap.main())")


def test_a_failed_sync_while_serving_sends_nothing_and_fails_with_its_reason(tmp_path,
                                                                              monkeypatch):
    """The outcome's sync fails: the answer never leaves, serving ends, and the exit status
    and the stderr line say why (a supervisor must not take it for a clean stop)."""
    def command(program=process_helpers.PROXY, env=None):
        return [process_helpers.PYTHON, "-c", FAILING_SYNC, process_helpers.ROOT], env
    d = process_helpers.ProcessDir(tmp_path)             # pinned with a sync that works
    monkeypatch.setattr(process_helpers, "proxy_command", command)
    try:
        p = d.start()
        ident = p.send("tools/call", {"name": "bank_balance", "arguments": {"account": "A-1"}})
        assert p.proc.wait(timeout=30) == 1
        with pytest.raises(AssertionError, match="no answer"):
            p.answer(ident, timeout=1)
        assert "error: " in p.stderr() and "cannot sync the WAL" in p.stderr(), p.stderr()
    finally:
        d.cleanup()
