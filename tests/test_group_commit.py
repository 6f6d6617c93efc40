"""Group commit: calls that finish together share one sync of the WAL, and nothing that
depends on a commit leaves before the sync that covers it.

- Sixteen reads at once: while the WAL's sync is held up, none is answered; once it goes
  through, all are, with fewer syncs than calls.
- A mutating call: while the WAL's sync of its start is held up, its request does not
  leave.
- A DUPLICATE that names an outcome committed but not yet synced waits for that sync.
- A sync that fails is final: the call answers UNAVAILABLE saying it may have executed, and
  the store refuses every later write.
"""

import asyncio
import errno
import os
import threading
import time

import pytest

from proxy_harness import ProxyHarness, ap
from test_rules_cost import InstantServer, instant_proxy

RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
         "refund": {"side_effect": "destructive", "timeout": "10s"}}
HELD = 0.5                 # seconds the WAL's sync is held up
BOUND = 10.0               # no wait in these tests is longer
POLL = 0.005               # how often a held sync looks whether it may be let go


class Hold:
    at = float("inf")          # when the held syncs were let go; not yet: never


class WalSyncs:
    """The store's sync of the WAL file (sync_wal_fd), watched: each sync's start and end
    times, held up while ``hold`` is set (released by a timer, so a sync on the event loop's
    own thread ends too), or failing with EIO while ``fail`` is set."""

    def __init__(self, store: ap.Store, real):
        st = os.stat(store.path + "-wal")
        self.wal = (st.st_dev, st.st_ino)
        self.real = real
        self.started: list[float] = []
        self.ended: list[float] = []
        self.release = threading.Event()
        self.release.set()
        self.fail = False

    def hold_for(self, seconds: float) -> "Hold":
        """Hold the syncs up for ``seconds``; the Hold returned says when they were let go
        (noted before the release, so nothing waiting on it can end earlier)."""
        hold = Hold()
        self.release.clear()

        def release():
            hold.at = time.monotonic()
            self.release.set()
        timer = threading.Timer(seconds, release)
        timer.daemon = True
        timer.start()
        return hold

    def hold_until(self, done) -> "Hold":
        """Hold the syncs up until done() is true (looked at from a thread of its own), or
        BOUND at most: what a test orders against the held sync happens while it is held,
        however slow the machine, unless it waits for the sync (then BOUND lets it go)."""
        hold = Hold()
        self.release.clear()

        def release():
            deadline = time.monotonic() + BOUND
            while not done() and time.monotonic() < deadline:
                time.sleep(POLL)
            hold.at = time.monotonic()
            self.release.set()
        threading.Thread(target=release, daemon=True).start()
        return hold

    def __call__(self, fd):
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.wal:
            return self.real(fd)
        self.started.append(time.monotonic())
        if self.fail:
            raise OSError(errno.EIO, "Input/output error")
        assert self.release.wait(BOUND)
        self.real(fd)
        self.ended.append(time.monotonic())


class Upstream(InstantServer):
    """Answers at once, noting when each request arrived."""

    def __init__(self):
        super().__init__()
        self.arrived: list[float] = []

    async def call_tool(self, remote, args, timeout):
        self.arrived.append(time.monotonic())
        await asyncio.sleep(0)              # let other calls interleave
        return await super().call_tool(remote, args, timeout)


@pytest.fixture
def grouped(tmp_path, monkeypatch):
    h = ProxyHarness(tmp_path, rules=RULES)
    upstream = Upstream()
    proxy = instant_proxy(h, upstream)
    syncs = WalSyncs(h.store, ap.sync_wal_fd)
    monkeypatch.setattr(ap, "sync_wal_fd", syncs)
    yield h, proxy, upstream, syncs
    proxy.close()
    h.close()


async def answered_at(proxy, name, args):
    result = await proxy.call(name, args)
    return time.monotonic(), result


def test_group_commit_sixteen_reads_share_syncs_and_none_answers_before_its_sync(grouped):
    h, proxy, upstream, syncs = grouped
    h.run(proxy.call("bank_balance", b'{"account":"A-0"}'))       # warm
    before = len(syncs.started)
    released = syncs.hold_for(HELD)
    got = h.run(asyncio.gather(*[answered_at(proxy, "bank_balance",
                                             b'{"account":"A-%d"}' % i)
                                 for i in range(1, 17)]))
    for at, result in got:
        assert not result["isError"], result
        assert at >= released.at, "an answer left while the WAL's sync was held up"
    used = len(syncs.started) - before
    assert 1 <= used < 16, f"{used} syncs for 16 calls finishing together"
    assert upstream.calls == 17


def test_group_commit_mutating_request_waits_for_the_sync_of_its_start(grouped):
    h, proxy, upstream, syncs = grouped
    released = syncs.hold_for(HELD)
    at, result = h.run(answered_at(proxy, "bank_pay", b'{"to":"bob","amount":1}'))
    assert not result["isError"], result
    assert upstream.arrived and upstream.arrived[0] >= released.at, \
        "the request left before its start was on disk"
    assert len(syncs.ended) >= 2 and syncs.ended[0] <= upstream.arrived[0] <= at


def test_group_commit_sixteen_payments_none_leaves_before_its_start_is_synced(grouped):
    h, proxy, upstream, syncs = grouped
    released = syncs.hold_for(HELD)
    got = h.run(asyncio.gather(*[answered_at(proxy, "bank_pay",
                                             b'{"to":"bob","amount":%d}' % i)
                                 for i in range(1, 17)]))
    assert all(not r["isError"] for _, r in got), got
    assert len(upstream.arrived) == 16
    assert min(upstream.arrived) >= released.at
    assert len(syncs.started) < 32, f"{len(syncs.started)} syncs for 16 payments"


def test_group_commit_duplicate_waits_for_the_sync_of_the_outcome_it_names(grouped):
    h, proxy, upstream, syncs = grouped
    args = b'{"to":"bob","amount":7}'
    h.run(proxy.call("bank_balance", b'{"account":"A-0"}'))
    base, held = len(syncs.started), []
    real_call = upstream.call_tool

    async def hold_the_outcome(remote, a, timeout):
        held.append(syncs.hold_for(HELD))        # the next sync is the outcome's
        return await real_call(remote, a, timeout)
    upstream.call_tool = hold_the_outcome

    async def both():
        first = asyncio.ensure_future(answered_at(proxy, "bank_pay", args))
        deadline = time.monotonic() + BOUND
        while len(syncs.started) < base + 2:     # the start's sync, then the outcome's
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        second = await answered_at(proxy, "bank_pay", args)
        return await first, second

    proxy.store.calls_in_flight = 1       # the syncs on a worker thread, as under load
    (at1, r1), (at2, r2) = h.run(both())
    assert not r1["isError"] and h.prefix(r2) == "DUPLICATE", (r1, r2)
    assert at2 >= held[0].at, "a DUPLICATE named an outcome not yet on disk"
    assert upstream.calls == 2            # the warm read and the payment, once


def test_group_commit_failed_sync_is_final(grouped):
    h, proxy, upstream, syncs = grouped
    syncs.fail = True
    result = h.run(proxy.call("bank_pay", b'{"to":"bob","amount":3}'))
    assert h.prefix(result) == "UNAVAILABLE", result
    assert upstream.calls == 0, "the request left though its start could not be synced"
    syncs.fail = False
    again = h.run(proxy.call("bank_balance", b'{"account":"A-9"}'))
    assert h.prefix(again) == "UNAVAILABLE", again
    with pytest.raises(ap.StoreError, match="could not be synced"):
        with h.store.tx() as tx:
            tx.exec("SELECT 1")


def test_group_commit_failed_outcome_sync_says_it_may_have_executed(grouped):
    h, proxy, upstream, syncs = grouped
    real_call = upstream.call_tool

    async def then_fail(remote, args, timeout):
        syncs.fail = True               # the start is on disk; the outcome's sync fails
        return await real_call(remote, args, timeout)
    upstream.call_tool = then_fail
    result = h.run(proxy.call("bank_pay", b'{"to":"bob","amount":4}'))
    assert upstream.calls == 1
    assert h.prefix(result) == "UNAVAILABLE" and "may have taken effect" in h.text(result), \
        result


def test_group_commit_answer_resting_on_another_proxys_unsynced_commit_waits_for_it(
        grouped, tmp_path):
    """Another process's owed commit is visible here before it is on disk: an answer that
    may name it syncs the WAL first, though this store owes nothing itself."""
    h, proxy, upstream, syncs = grouped
    h.run(proxy.call("bank_balance", b'{"account":"A-0"}'))
    other = ap.Store.open(h.store.path)
    try:
        with other.batch(synced=ap.GROUPED), other.tx() as tx:     # the other's outcome,
            tx.exec("CREATE TABLE IF NOT EXISTS scratch (x)")      # owed, not yet synced
            tx.exec("INSERT INTO scratch VALUES (1)")
        before = len(syncs.started)
        h.run(h.store.durable(others=True))
        assert len(syncs.started) == before + 1, "an answer could name an unsynced record"
        h.run(h.store.durable(others=True))
        assert len(syncs.started) == before + 1, "nothing new: no second sync"
    finally:
        other.close()


class FailingFull:
    """The store's connection, except that setting synchronous=FULL fails."""

    def __init__(self, conn):
        self.conn = conn

    def execute(self, sql, *args):
        if sql == "PRAGMA synchronous=FULL":
            raise ap.sqlite3.OperationalError("disk I/O error")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_group_commit_synced_write_when_full_cannot_be_set_writes_nothing(grouped):
    """A transaction that asks for synchronous=FULL never commits under NORMAL: when the
    level cannot be set, it is refused before it begins. Set again, the next one is FULL."""
    h, proxy, upstream, syncs = grouped
    real = h.store.conn
    h.store.conn = FailingFull(real)
    try:
        with h.store.batch(synced=ap.GROUPED), h.store.tx() as tx:
            tx.exec("CREATE TABLE IF NOT EXISTS scratch (x)")       # NORMAL: it commits
        with pytest.raises(ap.StoreError, match="cannot begin"):
            with h.store.tx() as tx:
                tx.exec("INSERT INTO scratch VALUES (1)")
        h.run(h.store.durable())
        result = h.run(proxy.call("bank_refund", b'{"payment":"p-1"}'))   # held: synced
        assert h.prefix(result) == "UNAVAILABLE" and upstream.calls == 0, result
    finally:
        h.store.conn = real
    assert real.execute("SELECT COUNT(*) FROM scratch").fetchone()[0] == 0
    with h.store.tx() as tx:
        tx.exec("INSERT INTO scratch VALUES (2)")
        assert tx.rows("SELECT * FROM pragma_synchronous")[0][0] == 2
    result = h.run(proxy.call("bank_pay", b'{"to":"bob","amount":5}'))
    assert not result["isError"] and upstream.calls == 1, result


def test_group_commit_lease_lost_while_the_start_syncs_sends_nothing(grouped):
    h, proxy, upstream, syncs = grouped
    syncs.hold_until(lambda: proxy.gate.leases._lost)          # held till the lease is lost

    async def lose_it():
        deadline = time.monotonic() + BOUND
        while not syncs.started:                # the start's sync is held up
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        run_id = h.store.conn.execute(
            "SELECT id FROM runs ORDER BY created_at DESC LIMIT 1").fetchone()[0]
        proxy.gate.leases._lost.add(run_id)     # as the renewer finds when it was taken over

    async def both():
        call = asyncio.ensure_future(proxy.call("bank_pay", b'{"to":"bob","amount":6}'))
        await lose_it()
        return await call

    proxy.store.calls_in_flight = 1       # the sync on a worker thread, as under load
    result = h.run(both())
    assert upstream.calls == 0, "the request left though its run was taken over"
    assert h.prefix(result) == "IN_PROGRESS", result


def test_group_commit_unknown_data_version_counts_as_a_change(grouped, monkeypatch):
    h, proxy, upstream, syncs = grouped
    h.run(h.store.durable(others=True))
    before = len(syncs.started)
    monkeypatch.setattr(h.store, "_data_version", lambda: ap._UNKNOWN)
    h.run(h.store.durable(others=True))
    h.run(h.store.durable(others=True))
    assert len(syncs.started) == before + 2, "a version that could not be read was trusted"


def test_group_commit_read_request_waits_for_no_other_calls_sync(grouped):
    """An allowed read's start owes nothing: its request leaves while another call's
    outcome sync is still held up (its answer waits for that sync, as every answer does)."""
    h, proxy, upstream, syncs = grouped
    real_call = upstream.call_tool
    held = []

    async def hold_the_outcome(remote, a, timeout):
        if not held:            # the payment's outcome sync is held up till the read's
            held.append(syncs.hold_until(lambda: len(upstream.arrived) == 2))   # request
        return await real_call(remote, a, timeout)
    upstream.call_tool = hold_the_outcome

    async def both():
        pay = asyncio.ensure_future(answered_at(proxy, "bank_pay", b'{"to":"bob","amount":8}'))
        deadline = time.monotonic() + BOUND
        while not held or len(syncs.started) < 2:    # the start's sync, then the outcome's
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        read = await answered_at(proxy, "bank_balance", b'{"account":"A-8"}')
        return await pay, read

    proxy.store.calls_in_flight = 1
    (at_pay, r_pay), (at_read, r_read) = h.run(both())
    assert not r_pay["isError"] and not r_read["isError"], (r_pay, r_read)
    assert len(upstream.arrived) == 2 and upstream.arrived[1] < held[0].at, \
        "a read's request waited for another call's sync"
    assert at_read >= held[0].at, "the read's answer left before the owed sync"


def test_group_commit_read_only_view_syncs_the_wal_it_reads(grouped, monkeypatch):
    h, proxy, upstream, syncs = grouped
    h.run(proxy.call("bank_balance", b'{"account":"A-1"}'))
    before = len(syncs.started)
    view = ap.Store.open_existing(h.store.path, readonly=True)
    view.close()
    assert len(syncs.started) == before + 1


@pytest.mark.skipif(not hasattr(os, "fdatasync"), reason="no fdatasync on this system")
def test_group_commit_the_wal_is_synced_as_sqlite_syncs_it(tmp_path, monkeypatch):
    """fdatasync where the system has it, as SQLite's own synchronous=FULL commit: the data
    and the size that reading it back needs."""
    h = ProxyHarness(tmp_path, rules=RULES)
    proxy = instant_proxy(h, InstantServer())
    st = os.stat(h.store.path + "-wal")
    wal, calls = (st.st_dev, st.st_ino), {"fdatasync": 0, "fsync": 0}

    def watched(name, real):
        def sync(fd):
            st = os.fstat(fd)
            calls[name] += (st.st_dev, st.st_ino) == wal
            return real(fd)
        return sync
    monkeypatch.setattr(ap.os, "fdatasync", watched("fdatasync", os.fdatasync))
    monkeypatch.setattr(ap.os, "fsync", watched("fsync", os.fsync))
    try:
        result = h.run(proxy.call("bank_balance", b'{"account":"A-1"}'))
    finally:
        proxy.close()
        h.close()
    assert not result["isError"], result
    assert calls == {"fdatasync": 1, "fsync": 0}, calls
