"""Which commits a call makes, and how each is synced.

- An allowed read-only call: its start commits unsynced (synchronous=NORMAL), its outcome
  commits owed to disk (NORMAL) and the WAL file is synced before the call answers, which
  makes both durable. The level is set before each transaction that needs another than
  the last: a synced transaction after them commits FULL.
- An allowed mutating call: its start commits owed to disk and the WAL is synced before the
  request leaves; its outcome likewise before the answer.
- A held call and a denied read: every commit synced.
- A batch in which one change failed rolls back whole, even when the failure was caught
  inside it: nothing of a half-done batch is committed.
"""

import os
import sqlite3

import pytest

from proxy_harness import ProxyHarness, ap
from test_rules_cost import InstantServer, instant_proxy


class Trace:
    """The statements the store's connection runs, with the synchronous level each COMMIT
    ran under, each sync of the database's WAL file, and the point at which the upstream
    was called."""

    def __init__(self, store: ap.Store):
        self.lines: list[str] = []
        self.store = store
        self.level = LEVELS[store.conn.execute("PRAGMA synchronous").fetchone()[0]]
        store.conn.set_trace_callback(self.lines.append)
        wal = os.stat(store.path + "-wal")
        self.wal = (wal.st_dev, wal.st_ino)

    def mark(self, what: str) -> None:
        self.lines.append(f"-- {what}")

    def commits(self) -> list[str]:
        """'FULL' or 'NORMAL' for each COMMIT, and '-- ...' marks, in order."""
        level, out = self.level, []
        for line in self.lines:
            if line.startswith("PRAGMA synchronous="):
                level = line.split("=", 1)[1]
            elif line == "COMMIT":
                out.append(level)
            elif line.startswith("-- "):
                out.append(line)
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

    async def call_tool(self, remote, args, timeout):
        self.trace_box[0].mark("upstream called")
        return await super().call_tool(remote, args, timeout)


RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
         "refund": {"side_effect": "destructive", "timeout": "10s"}}
FULL = 2
LEVELS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


@pytest.fixture
def traced(tmp_path):
    h = ProxyHarness(tmp_path, rules=RULES)
    box: list = [None]
    proxy = instant_proxy(h, MarkingServer(box))
    yield h, proxy, box
    proxy.close()
    h.close()


@pytest.fixture(autouse=True)
def wal_syncs_marked(monkeypatch):
    """Every sync of the WAL file is marked in the trace under way."""
    real = ap.sync_wal_fd

    def fsync(fd):
        real(fd)
        st, trace = os.fstat(fd), TRACES[-1] if TRACES else None
        if trace is not None and (st.st_dev, st.st_ino) == trace.wal:
            trace.mark("WAL synced")
    monkeypatch.setattr(ap, "sync_wal_fd", fsync)
    yield
    TRACES.clear()


TRACES: list = []


def call_traced(h, proxy, box, name, args):
    h.run(h.store.durable(others=True))     # what other connections committed, synced
    box[0] = Trace(h.store)
    TRACES.append(box[0])
    result = h.run(proxy.call(name, args))
    return result, box[0]


def test_allowed_read_starts_unsynced_and_its_outcome_commit_syncs_both(traced):
    h, proxy, box = traced
    result, trace = call_traced(h, proxy, box, "bank_balance", b'{"account":"A-1"}')
    assert not result["isError"], result
    assert trace.commits() == ["NORMAL", "-- upstream called", "NORMAL", "-- WAL synced"]
    assert trace.level_of_a_synced_transaction() == FULL


def test_allowed_mutation_start_is_synced_before_the_request_leaves(traced):
    h, proxy, box = traced
    result, trace = call_traced(h, proxy, box, "bank_pay", b'{"to":"bob","amount":1}')
    assert not result["isError"], result
    assert trace.commits() == ["NORMAL", "-- WAL synced", "-- upstream called", "NORMAL",
                               "-- WAL synced"]
    assert trace.level_of_a_synced_transaction() == FULL


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
            assert levels and set(levels) == {"FULL"}, (name, levels)    # no sync owed
            assert trace.level_of_a_synced_transaction() == FULL
    finally:
        proxy.close()
        h.close()


def test_read_whose_arguments_fail_the_schema_commits_synced(traced):
    h, proxy, box = traced
    result, trace = call_traced(h, proxy, box, "bank_balance", b'{"account":7}')
    assert result["isError"] and "INVALID" in h.text(result), result
    assert set(trace.commits()) == {"FULL"}


def add_run(tx, run_id: str) -> None:
    tx.exec("INSERT INTO runs (id, goal, status, limits_json, created_at, started_at) "
            "VALUES (?,?,?,?,?,?)", (run_id, "g", "RUNNING", ap.Limits().record(),
                                     "2026-01-01T00:00:00Z", "2026-01-01T00:00:00Z"))
    tx.event(run_id, "", "2026-01-01T00:00:00Z", "run.created", {})


def test_batch_with_a_failed_change_caught_inside_rolls_back_whole(tmp_path):
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        before = store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        with pytest.raises(ap.StoreError, match="rolled back"):
            with store.batch():
                with store.tx() as tx:
                    add_run(tx, "r-1")
                try:
                    with store.tx() as tx:
                        tx.exec("INSERT INTO no_such_table VALUES (1)")
                except ap.StoreError:
                    pass                    # caught inside the batch: the batch still fails
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
    """One unsynced batch that commits, one that fails: the next plain transaction, and the
    next synced batch, each run under synchronous=FULL."""
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        def level(tx):
            return tx.rows("SELECT * FROM pragma_synchronous")[0][0]
        with store.batch(synced=False), store.tx() as tx:
            add_run(tx, "r-1")
            assert level(tx) == 1
        with store.tx() as tx:
            assert level(tx) == FULL
        with pytest.raises(ap.StoreError):
            with store.batch(synced=ap.GROUPED), store.tx() as tx:
                tx.exec("INSERT INTO no_such_table VALUES (1)")
        with store.batch(), store.tx() as tx:
            add_run(tx, "r-2")
            assert level(tx) == FULL
        with store.batch(synced=False), store.tx() as tx:
            assert level(tx) == 1
        with store.tx() as tx:
            assert level(tx) == FULL
    finally:
        store.close()


def test_sqlite_refuses_a_safety_level_change_inside_a_transaction(tmp_path):
    """Why Store._synchronous changes the level between transactions: inside one, SQLite
    refuses (so a relaxed commit cannot be chosen after the batch has begun)."""
    conn = sqlite3.connect(str(tmp_path / "x.db"), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError):
        conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("ROLLBACK")
    conn.close()
