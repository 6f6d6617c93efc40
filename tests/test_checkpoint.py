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
