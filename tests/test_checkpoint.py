"""Serving, the WAL is copied into the database by a thread of its own (Store.checkpoint_aside),
not inside the commit that crosses SQLite's threshold.

- Every CHECKPOINT_COMMITS commits the thread checkpoints: the database file takes the pages
  the WAL held, long before the writing connection's own threshold.
- The writing connection's own checkpoint stays, at CHECKPOINT_BACKSTOP_PAGES; a store that
  does not serve keeps SQLite's default.
- What is committed reads back the same, from this connection and from another, whatever
  the thread has copied.
- close() ends the thread and closes its connection first, so that SQLite, closing the last
  connection, checkpoints and removes the WAL as it did before.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import agentrt_proxy as ap  # noqa: E402

WAIT = 10.0
FILLER = "x" * 3000                 # about a page a row


def _commit(store: ap.Store, n: int) -> None:
    with store.tx() as tx:
        tx.exec("INSERT INTO tool_specs (hash, spec_json) VALUES (?, ?)",
                (f"h{n}", FILLER))


def _checkpointers() -> int:
    return sum(t.name == "agentrt-proxy-checkpoint" for t in threading.enumerate())


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_thread_copies_the_wal_every_so_many_commits(tmp_path):
    path = str(tmp_path / "runs.db")
    store = ap.Store.open(path)
    try:
        store.checkpoint_aside()
        size = os.path.getsize(path)
        for n in range(ap.CHECKPOINT_COMMITS - 1):
            _commit(store, n)
        time.sleep(0.2)
        assert os.path.getsize(path) == size, "copied before CHECKPOINT_COMMITS commits"
        _commit(store, ap.CHECKPOINT_COMMITS)
        # About a page a commit, far below the writing connection's own threshold: only
        # the thread copies them.
        _wait_for(lambda: os.path.getsize(path) > size + 32 * 4096,
                  "the WAL was not copied into the database")
    finally:
        store.close()


def test_the_connections_own_checkpoint_is_the_backstop(tmp_path):
    serving = ap.Store.open(str(tmp_path / "a.db"))
    plain = ap.Store.open(str(tmp_path / "b.db"))
    try:
        serving.checkpoint_aside()
        got = serving.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        assert got == ap.CHECKPOINT_BACKSTOP_PAGES
        assert plain.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    finally:
        serving.close()
        plain.close()


def test_what_is_committed_reads_the_same_while_the_thread_copies(tmp_path):
    path = str(tmp_path / "runs.db")
    store = ap.Store.open(path)
    try:
        store.checkpoint_aside()
        for n in range(3 * ap.CHECKPOINT_COMMITS):
            _commit(store, n)
        other = sqlite3.connect(path)
        try:
            for conn in (store.conn, other):
                rows = conn.execute("SELECT hash FROM tool_specs WHERE hash LIKE 'h%'"
                                    ).fetchall()
                assert sorted(r[0] for r in rows) == sorted(
                    f"h{n}" for n in range(3 * ap.CHECKPOINT_COMMITS))
        finally:
            other.close()
    finally:
        store.close()


def test_close_ends_the_thread_and_sqlite_removes_the_wal(tmp_path):
    path = str(tmp_path / "runs.db")
    before = _checkpointers()
    store = ap.Store.open(path)
    store.checkpoint_aside()
    assert _checkpointers() == before + 1
    for n in range(2 * ap.CHECKPOINT_COMMITS + 5):
        _commit(store, n)
    store.close()
    assert _checkpointers() == before
    assert not os.path.exists(path + "-wal"), "a connection was left open"
    check = sqlite3.connect(path)
    try:
        assert check.execute("SELECT count(*) FROM tool_specs WHERE hash LIKE 'h%'"
                             ).fetchone()[0] == 2 * ap.CHECKPOINT_COMMITS + 5
    finally:
        check.close()


def _held(store: ap.Store):
    """The thread's wake, held until the test lets it go (threading.Event.set(wake))."""
    wake = store._aside.wake
    wake.set = lambda: None
    return wake


def test_a_wal_put_in_place_of_the_stores_is_never_copied(tmp_path):
    """The WAL renamed over by another file between a wake and the checkpoint: the thread
    copies nothing from it (it stops), and what the database keeps is what was committed."""
    import shutil
    path = str(tmp_path / "runs.db")
    store = ap.Store.open(path)
    store.checkpoint_aside()
    wake = _held(store)
    for n in range(ap.CHECKPOINT_COMMITS):
        _commit(store, n)
    forged = path + "-wal.new"
    shutil.copyfile(path + "-wal", forged)
    with open(forged, "r+b") as f:
        data = f.read().replace(FILLER.encode(), b"Z" * len(FILLER))
        f.seek(0)
        f.write(data)
    os.rename(forged, path + "-wal")
    threading.Event.set(wake)
    store._aside.thread.join(WAIT)
    assert not store._aside.thread.is_alive(), "the thread went on past a replaced WAL"
    try:
        with store.tx():
            pass
    except ap.StoreError:
        pass                                    # the store refuses, as it did before
    store.close()
    check = sqlite3.connect(path)
    try:
        rows = check.execute("SELECT DISTINCT substr(spec_json, 1, 1) FROM tool_specs "
                             "WHERE hash LIKE 'h%'").fetchall()
    finally:
        check.close()
    assert rows == [("x",)], rows


def test_after_a_failed_sync_the_thread_copies_nothing(tmp_path, monkeypatch):
    """A failed sync is final: the WAL may hold pages the kernel dropped, so nothing more
    is copied from it into the database."""
    import errno
    path = str(tmp_path / "runs.db")
    store = ap.Store.open(path)
    try:
        store.checkpoint_aside()
        wake = _held(store)
        for n in range(ap.CHECKPOINT_COMMITS - 1):
            _commit(store, n)

        def eio(fd):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(ap, "sync_wal_fd", eio)
        with store.batch(synced=ap.GROUPED), store.tx() as tx:
            tx.exec("INSERT INTO tool_specs (hash, spec_json) VALUES (?, ?)", ("last", FILLER))
        try:
            store.sync_owed()
        except ap.StoreError:
            pass
        assert store._unsyncable
        size = os.path.getsize(path)
        threading.Event.set(wake)
        store._aside.thread.join(WAIT)
        assert not store._aside.thread.is_alive(), "the thread went on after a failed sync"
        assert os.path.getsize(path) == size, "pages were copied after a failed sync"
    finally:
        monkeypatch.undo()
        store.close()


def test_the_thread_is_not_started_on_a_wal_that_is_not_the_stores(tmp_path):
    import shutil
    path = str(tmp_path / "runs.db")
    store = ap.Store.open(path)
    try:
        shutil.copyfile(path + "-wal", path + "-wal.new")
        os.rename(path + "-wal.new", path + "-wal")
        before = _checkpointers()
        store.checkpoint_aside()
        assert store._aside is None and _checkpointers() == before
        assert store.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    finally:
        store.close()
