"""The store: the file it keeps, what it refuses to open, one transaction per state change,
the event hash chain, writers in several processes, and migrations.

Specification: DESIGN.md section 5; reference/core.md 1.1-1.5 (connection settings, openers,
migrations, transactions), 4.4 (events) and 12 (the event hash chain).

- A run a transaction moves is returned as a fresh read finds it, and a read of a run
  inside this thread's open transaction sees that transaction's writes.
- A run id already taken is refused and nothing is written.
- A transaction inside a batch joins the batch only on the batch's own thread: another
  thread's transaction waits for the batch to end and is never part of it.
- The call index's claim is a compare-and-set without a read: the open row the caller read
  is closed only while it is still open, and a key that has an open row takes no second one.
- The key's open row and its newest closed rows are one statement.
- A spec found only inside this thread's open transaction is not taken as stored: if that
  transaction rolls back, the next ensure_spec stores it, and the store can read it back.
- A policy identity that is too long is refused by its size in bytes, measured one way,
  even when it holds lone surrogates (which it would be refused for next).
"""

import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import BALANCE, LIMITS, PAY, ROOT, ap
from proxy_harness import ProxyHarness

PAUSE_EVENTS = ["run.created", "run.started", "step.started", "step.decided", "step.policy",
                "approval.requested"]


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def make_store(path: str) -> None:
    """A database of this proxy with its schema, then closed."""
    ap.Store.open(path).close()


def sql(path: str, *statements: str, params: tuple = ()) -> None:
    """Change the database behind the store's back, as anyone with write access could."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for s in statements:
            conn.execute(s, params)
    finally:
        conn.close()


def rows(path: str, query: str, params: tuple = ()) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(query, params).fetchall()
    finally:
        conn.close()


def event_types(path: str, run_id: str) -> list[str]:
    return [r[0] for r in rows(path, "SELECT type FROM events WHERE run_id=? ORDER BY seq",
                               (run_id,))]


OPENERS = {
    "open": lambda p: ap.Store.open(p),
    "open_existing_ro": lambda p: ap.Store.open_existing(p, readonly=True),
    "open_existing_rw": lambda p: ap.Store.open_existing(p, readonly=False),
}


@pytest.fixture(params=sorted(OPENERS))
def opener(request):
    return OPENERS[request.param]


# --------------------------------------------------------------------------------------------
# The file and the connection
# --------------------------------------------------------------------------------------------

def test_file_is_created_0600_whatever_the_umask(tmp_path):
    path = str(tmp_path / "runs.db")
    old = os.umask(0)          # a umask that would let everyone write a file created 0666
    try:
        store = ap.Store.open(path)
    finally:
        os.umask(old)
    try:
        assert mode_of(path) == 0o600
        for side in (path + "-wal", path + "-shm"):
            if os.path.exists(side):
                assert mode_of(side) & 0o077 == 0, side
    finally:
        store.close()


def test_writer_uses_wal(tmp_path):
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        assert store.conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        store.close()
    # the mode is a property of the file: a plain connection sees it too
    assert rows(str(tmp_path / "runs.db"), "PRAGMA journal_mode")[0][0].lower() == "wal"


def test_writer_connection_is_synchronous_full(tmp_path):
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 2       # FULL
        assert store.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
        assert store.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    finally:
        store.close()


def test_a_connection_caches_the_pages_a_large_call_writes(tmp_path):
    """A call with a 1 MB argument writes about 5 MB of pages in its transactions: every
    connection's page cache holds them (SQLite's default holds 2 MB)."""
    store = ap.Store.open(str(tmp_path / "runs.db"))
    try:
        for conn in (store.conn, ap._connection(store.path, "ro")):
            assert conn.execute("PRAGMA cache_size").fetchone()[0] == -ap.STORE_CACHE_KIB
        assert ap.STORE_CACHE_KIB >= 8 * 1024
    finally:
        store.close()


def test_existing_writer_is_synchronous_full_too(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    store = ap.Store.open_existing(path, readonly=False)
    try:
        assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 2
    finally:
        store.close()


def test_writer_tightens_owned_file_0644_to_0600(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    os.chmod(path, 0o644)
    fd = os.open(path + "-wal", os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    os.chmod(path + "-wal", 0o644)
    store = ap.Store.open(path)
    try:
        assert mode_of(path) == 0o600
        assert mode_of(path + "-wal") == 0o600
    finally:
        store.close()


def test_operator_writer_tightens_owned_file_0644_to_0600(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    os.chmod(path, 0o644)
    ap.Store.open_existing(path, readonly=False).close()
    assert mode_of(path) == 0o600


def test_read_only_open_does_not_chmod(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    os.chmod(path, 0o644)
    ap.Store.open_existing(path, readonly=True).close()
    assert mode_of(path) == 0o644


# --------------------------------------------------------------------------------------------
# Refusals: each names the problem and says what to do
# --------------------------------------------------------------------------------------------

def test_symlinked_database_path_refused(tmp_path, opener):
    real = str(tmp_path / "real.db")
    make_store(real)
    link = str(tmp_path / "link.db")
    os.symlink(real, link)
    with pytest.raises(ap.UnsafeDatabase) as exc:
        opener(link)
    msg = str(exc.value)
    assert link in msg and "symbolic link" in msg
    assert "name the database file itself" in msg


def test_dangling_symlink_refused_and_nothing_created(tmp_path):
    target = tmp_path / "target.db"
    link = str(tmp_path / "link.db")
    os.symlink(str(target), link)
    with pytest.raises(ap.UnsafeDatabase, match="symbolic link"):
        ap.Store.open(link)
    assert not target.exists()


def test_database_that_is_not_a_regular_file_refused(tmp_path, opener):
    path = tmp_path / "dir.db"
    path.mkdir()
    with pytest.raises(ap.UnsafeDatabase, match="not a regular file"):
        opener(str(path))


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_database_writable_by_group_or_others_refused(tmp_path, opener, mode):
    path = str(tmp_path / "runs.db")
    make_store(path)
    os.chmod(path, mode)
    with pytest.raises(ap.UnsafeDatabase) as exc:
        opener(path)
    msg = str(exc.value)
    assert path in msg
    assert "writable by group or others" in msg
    assert f"chmod 600 {path}" in msg
    assert "owner only" in msg
    assert mode_of(path) == mode          # refused, not silently repaired


def test_wal_sidecar_writable_by_others_refused(tmp_path, opener):
    path = str(tmp_path / "runs.db")
    make_store(path)
    fd = os.open(path + "-wal", os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    os.chmod(path + "-wal", 0o602)
    with pytest.raises(ap.UnsafeDatabase) as exc:
        opener(path)
    msg = str(exc.value)
    assert path + "-wal" in msg
    assert "writable by group or others" in msg
    assert "chmod 600" in msg


def test_wal_sidecar_that_is_a_symlink_refused(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    other = tmp_path / "elsewhere"
    other.write_bytes(b"")
    os.symlink(str(other), path + "-wal")
    with pytest.raises(ap.UnsafeDatabase, match="not a regular file"):
        ap.Store.open(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_wal_sidecar_owned_by_another_user_refused(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    fd = os.open(path + "-wal", os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    os.chown(path + "-wal", 65534, 65534)
    with pytest.raises(ap.UnsafeDatabase, match="owned by another user than the database"):
        ap.Store.open(path)


@pytest.mark.parametrize("kind,create", [
    ("trigger", "CREATE TRIGGER sneaky AFTER INSERT ON events BEGIN DELETE FROM events; END"),
    ("view", "CREATE VIEW sneaky AS SELECT * FROM runs"),
])
def test_database_holding_trigger_or_view_refused(tmp_path, opener, kind, create):
    path = str(tmp_path / "runs.db")
    make_store(path)
    sql(path, create)
    with pytest.raises(ap.UnsafeDatabase) as exc:
        opener(path)
    msg = str(exc.value)
    assert path in msg
    assert f"holds a {kind}" in msg
    assert "sneaky" in msg
    assert "could run SQL" in msg


def test_schema_newer_than_this_build_refused(tmp_path, opener):
    path = str(tmp_path / "runs.db")
    make_store(path)
    sql(path, "INSERT INTO schema_migrations (version, applied_at) VALUES (99, 'later')")
    with pytest.raises(ap.SchemaVersionError) as exc:
        opener(path)
    msg = str(exc.value)
    assert "99" in msg and str(ap.SCHEMA_VERSION) in msg
    assert "newer" in msg
    assert "newer version of the proxy" in msg
    # and Store.open did not touch the migrations it does not know
    assert rows(path, "SELECT MAX(version) FROM schema_migrations")[0][0] == 99


def test_schema_older_than_this_build_refused_by_operator_open(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    sql(path, "DELETE FROM schema_migrations")
    for readonly in (True, False):
        with pytest.raises(ap.SchemaVersionError) as exc:
            ap.Store.open_existing(path, readonly=readonly)
        assert "older" in str(exc.value) and "do not migrate" in str(exc.value)
    assert rows(path, "SELECT COUNT(*) FROM schema_migrations")[0][0] == 0


@pytest.mark.parametrize("readonly", [True, False])
def test_open_existing_of_missing_file_raises_not_found_and_creates_nothing(tmp_path, readonly):
    path = str(tmp_path / "missing.db")
    with pytest.raises(ap.NotFound):
        ap.Store.open_existing(path, readonly=readonly)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("readonly", [True, False])
def test_open_existing_of_a_foreign_sqlite_database_refused(tmp_path, readonly):
    path = str(tmp_path / "other.db")
    sql(path, "CREATE TABLE notes (body TEXT)")
    os.chmod(path, 0o600)
    with pytest.raises(ap.StoreError) as exc:
        ap.Store.open_existing(path, readonly=readonly)
    assert "not a database of this proxy" in str(exc.value)
    assert path in str(exc.value)
    # nothing was migrated into it
    assert rows(path, "SELECT name FROM sqlite_master WHERE type='table'") == [("notes",)]


def test_open_existing_of_an_empty_sqlite_database_refused(tmp_path):
    path = str(tmp_path / "empty.db")
    sqlite3.connect(path).close()
    os.chmod(path, 0o600)
    with pytest.raises(ap.StoreError, match="not a database of this proxy"):
        ap.Store.open_existing(path, readonly=True)


def test_open_existing_of_a_file_that_is_not_sqlite_refused(tmp_path):
    path = str(tmp_path / "junk.db")
    with open(path, "wb") as f:
        f.write(b"this is not a database, it is a note to self\n" * 100)
    os.chmod(path, 0o600)
    with pytest.raises(ap.StoreError):
        ap.Store.open_existing(path, readonly=True)


# --------------------------------------------------------------------------------------------
# Every state change commits together with its events
# --------------------------------------------------------------------------------------------

def test_begin_writes_the_run_with_run_created_and_run_started(harness):
    harness.gate.begin("run-1", "call pay", LIMITS)
    run = harness.store.get_run("run-1")
    assert run.status == ap.RUNNING
    assert event_types(harness.path, "run-1") == ["run.created", "run.started"]
    created = rows(harness.path, "SELECT payload_json FROM events WHERE type='run.created'")
    doc = ap.loads_own(created[0][0])
    assert doc["goal"] == "call pay"
    assert doc["tools"] == [BALANCE.hash(), PAY.hash()]      # spec hashes in name order


def test_pause_writes_step_policy_and_approval_requested_with_the_approval_row(harness):
    approval = harness.waiting("run-1")
    assert event_types(harness.path, "run-1") == PAUSE_EVENTS
    assert harness.store.get_run("run-1").status == ap.WAITING
    [step] = harness.store.list_steps("run-1")
    assert step.status == "awaiting_approval"
    [row] = harness.store.list_approvals("run-1")
    assert (row.id, row.status, row.hash, row.step_id) == \
        (approval.id, ap.PENDING, approval.hash, step.id)
    payload = rows(harness.path, "SELECT payload_json FROM events WHERE type='approval.requested'")
    doc = ap.loads_own(payload[0][0])
    assert doc["approval_id"] == row.id and doc["hash"] == row.hash
    assert doc["kind"] == "remote_mutation"


def test_reject_writes_approval_decided_and_run_finished_with_the_cancel(harness):
    approval = harness.waiting("run-1")
    ap.decide_approval(harness.store, "run-1", approval.id, False, "op", "too much",
                       approval.hash, time.time(), view="")
    assert event_types(harness.path, "run-1") == PAUSE_EVENTS + ["approval.decided",
                                                                 "run.finished"]
    run = harness.store.get_run("run-1")
    assert (run.status, run.reason, run.reason_detail) == \
        (ap.CANCELLED, "approval_rejected", "too much")
    assert harness.store.list_steps("run-1")[0].status == "failed"


def test_cancel_writes_run_finished_with_the_cancel(harness):
    approval = harness.waiting("run-1")
    ap.cancel_run(harness.store, "run-1", "op", "stop", time.time())
    # The pending approval the cancel ends is marked cancelled, with its own event
    # (stricter than the reference, which leaves it pending).
    assert event_types(harness.path, "run-1") == PAUSE_EVENTS + ["approval.decided",
                                                                 "run.finished"]
    assert harness.store.get_approval(approval.id).status == ap.CANCELLED_APPROVAL
    payload = ap.loads_own(rows(harness.path, "SELECT payload_json FROM events WHERE "
                                "type='run.finished'")[0][0])
    assert payload["by"] == "op" and payload["reason"] == "operator_cancelled"
    decided = ap.loads_own(rows(harness.path, "SELECT payload_json FROM events WHERE "
                                "type='approval.decided'")[0][0])
    assert (decided["status"], decided["by"], decided["note"]) == ("cancelled", "op", "stop")


def test_refused_state_change_writes_nothing(harness):
    approval = harness.waiting("run-1")
    before = rows(harness.path, "SELECT COUNT(*) FROM events")[0][0]
    with pytest.raises(ap.ApprovalChanged):
        ap.decide_approval(harness.store, "run-1", approval.id, True, "op", "",
                           "0" * 64, time.time(), view="")
    with pytest.raises(ap.RunStateError):
        harness.gate.begin("run-1", "again", LIMITS)        # duplicate run id
    assert rows(harness.path, "SELECT COUNT(*) FROM events")[0][0] == before
    assert harness.store.get_approval(approval.id).status == ap.PENDING


def test_rolled_back_transaction_leaves_no_event_and_no_seq_gap(harness):
    harness.gate.begin("run-1", "one", LIMITS)
    head = harness.store.chain_head()
    with pytest.raises(RuntimeError):
        with harness.store.tx() as tx:
            tx.event("run-1", "", ap.fmt_time(time.time()), "run.started", {})
            raise RuntimeError("boom")
    assert harness.store.chain_head() == head
    harness.gate.begin("run-2", "two", LIMITS)
    seqs = [r[0] for r in rows(harness.path, "SELECT seq FROM events ORDER BY seq")]
    assert seqs == list(range(1, len(seqs) + 1))
    assert ap.verify_events(harness.store).broken is None


# --------------------------------------------------------------------------------------------
# The event hash chain
# --------------------------------------------------------------------------------------------

def test_event_hash_golden():
    assert ap.event_hash("", 1, "r", "", "2026-10-01T09:00:00Z", "run.started", "{}") == \
        "215d2d4feca5e8542594838002508a9d6739ae568ac25b15fa28058b3943b60f"


def test_event_hash_lengths_are_bytes_not_characters():
    # "é" is one character and two bytes: a netstring of characters would collide with
    # another split of the same text
    a = ap.event_hash("", 1, "r\u00e9", "", "t", "x", "{}")
    b = ap.event_hash("", 1, "r", "\u00e9", "t", "x", "{}")
    assert a != b


def test_stored_hashes_follow_the_netstring_rule(harness):
    harness.completed("run-1")
    prev = ""
    for seq, run_id, step_id, at, typ, payload, digest in rows(
            harness.path, "SELECT seq, run_id, step_id, at, type, payload_json, hash "
            "FROM events ORDER BY seq"):
        assert digest == ap.event_hash(prev, seq, run_id, step_id, at, typ, payload)
        prev = digest


def test_verify_events_intact_after_a_few_runs(harness):
    harness.completed("run-1")
    harness.waiting("run-2")
    harness.completed("run-3")
    report = ap.verify_events(harness.store)
    head = harness.store.chain_head()
    assert report.broken is None
    assert report.checked == head[0] == rows(harness.path, "SELECT COUNT(*) FROM events")[0][0]
    assert report.hash == head[1]


def test_verify_events_empty_database(harness):
    report = ap.verify_events(harness.store)
    assert (report.checked, report.broken) == (0, None)


def test_edited_payload_breaks_the_chain_at_that_seq(harness):
    harness.completed("run-1")
    harness.waiting("run-2")
    harness.close()
    target = rows(harness.path, "SELECT seq FROM events WHERE run_id='run-2' AND "
                  "type='step.decided'")[0][0]
    sql(harness.path, "UPDATE events SET payload_json=replace(payload_json, '25.00', '2500.00') "
        f"WHERE seq={target}")
    store = ap.Store.open_existing(harness.path, readonly=True)
    try:
        report = ap.verify_events(store)
    finally:
        store.close()
    assert report.broken is not None
    assert report.broken.seq == target
    assert report.checked == target - 1
    assert "stored hash" in report.broken.detail
    assert report.broken.expected != report.broken.found


def test_deleted_event_in_the_middle_reports_a_missing_event(harness):
    harness.completed("run-1")
    harness.close()
    sql(harness.path, "DELETE FROM events WHERE seq=5")
    store = ap.Store.open_existing(harness.path, readonly=True)
    try:
        report = ap.verify_events(store)
    finally:
        store.close()
    assert report.broken is not None
    assert report.broken.seq == 6
    assert "seq 6 follows 4" in report.broken.detail and "missing" in report.broken.detail


def test_deleted_first_event_reports_a_missing_event(harness):
    harness.completed("run-1")
    harness.close()
    sql(harness.path, "DELETE FROM events WHERE seq=1")
    store = ap.Store.open_existing(harness.path, readonly=True)
    try:
        report = ap.verify_events(store)
    finally:
        store.close()
    assert report.broken is not None and report.broken.seq == 2
    assert "first event is seq 2" in report.broken.detail and "missing" in report.broken.detail


def test_seq_is_never_reused_after_a_deletion(harness):
    harness.gate.begin("run-1", "one", LIMITS)
    harness.gate.close()
    head = harness.store.chain_head()[0]
    sql(harness.path, f"DELETE FROM events WHERE seq={head}")
    harness.gate = ap.Gate(harness.store, [], ap.SideEffectPolicy())
    harness.gate.begin("run-2", "two", LIMITS)
    assert rows(harness.path, "SELECT MIN(seq) FROM events WHERE run_id='run-2'")[0][0] == head + 1


def test_chain_spans_runs(harness):
    harness.completed("run-1")
    harness.completed("run-2")
    events = rows(harness.path, "SELECT seq, run_id, step_id, at, type, payload_json, hash "
                  "FROM events ORDER BY seq")
    first_of_2 = next(i for i, e in enumerate(events) if e[1] == "run-2")
    prev, cur = events[first_of_2 - 1], events[first_of_2]
    assert prev[1] == "run-1"
    assert cur[0] == prev[0] + 1
    assert cur[6] == ap.event_hash(prev[6], *cur[:6])
    # and not a per-run chain starting again from ''
    assert cur[6] != ap.event_hash("", *cur[:6])


def test_verify_events_range_starts_from_the_stored_hash_below(harness):
    harness.completed("run-1")
    report = ap.verify_events(harness.store, 3, 6)
    assert report.broken is None and report.checked == 4


# --------------------------------------------------------------------------------------------
# Writers in several processes
# --------------------------------------------------------------------------------------------

WRITER = r"""
import asyncio, os, sys, time
sys.path.insert(0, sys.argv[1])
import agentrt_proxy as ap
path, prefix, n, ready, go = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]

async def balance(args, value=None):
    return ap.ToolResult(b'{"balance":10}', "balance 10")

spec = ap.ToolSpec("balance", "reads", b'{"type":"object"}', "read_only", 5.0)
store = ap.Store.open(path)
gate = ap.Gate(store, [ap.Tool(spec, balance)], ap.SideEffectPolicy())
open(ready, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.005)
for i in range(n):
    s = gate.begin(f"{prefix}-{i}", "read the balance", ap.Limits(3, 3, 3, 0, 0))
    s.step()
    v = s.propose(ap.Decision("tool_call", "balance", b"{}", origin="model"))
    if v.kind != "allowed":
        sys.exit(f"not allowed: {v}")
    asyncio.run(s.execute())
    s.step()
    v = s.propose(ap.Decision("complete", origin="model"))
    if v.run.status != "COMPLETED":
        sys.exit(f"not completed: {v.run}")
gate.close()
store.close()
print("done", n)
"""

# run.created, run.started, step.started, step.decided, step.policy, step.tool_started,
# step.tool_finished, step.started, step.decided, run.finished
EVENTS_PER_COMPLETED_RUN = 10


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, ROOT, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:            # only the processes this test started
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


def wait_for_files(paths: list, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
            errs = [p.stderr.read() for p in procs]
            pytest.fail(f"writers did not get ready: {errs}")
        time.sleep(0.01)


def test_processes_writing_one_database_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    n, prefixes = 30, ["alpha", "beta", "gamma"]
    ready = [str(tmp_path / f"{p}.ready") for p in prefixes]
    go = str(tmp_path / "go")
    procs = [start([path, p, str(n), r, go]) for p, r in zip(prefixes, ready)]
    wait_for_files(ready, procs, 60)
    open(go, "w").close()
    results = wait_all(procs, 180)
    for code, out, err in results:
        assert code == 0, err
        assert out.strip() == f"done {n}"

    store = ap.Store.open_existing(path, readonly=True)
    try:
        runs, total = store.list_runs(0)
        assert total == len(prefixes) * n
        assert {r.id for r in runs} == {f"{p}-{i}" for p in prefixes for i in range(n)}
        assert all(r.status == ap.COMPLETED for r in runs)
        report = ap.verify_events(store)
        assert report.broken is None
        assert report.checked == len(prefixes) * n * EVENTS_PER_COMPLETED_RUN
        assert store.chain_head()[0] == report.checked
    finally:
        store.close()
    # the runs really interleaved: the chain links events of different writers
    owners = [r[0].split("-")[0] for r in rows(path, "SELECT run_id FROM events ORDER BY seq")]
    switches = sum(1 for a, b in zip(owners, owners[1:]) if a != b)
    assert switches >= len(prefixes) - 1


OPENER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import agentrt_proxy as ap
path, go, ready = sys.argv[2], sys.argv[3], sys.argv[4]
open(ready, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.002)
ap.Store.open(path).close()
print("opened")
"""


def test_concurrent_first_opens_migrate_once(tmp_path):
    path = str(tmp_path / "runs.db")
    go = str(tmp_path / "go")
    ready = [str(tmp_path / f"opener-{i}.ready") for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, ROOT, path, go, r],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ready]
    wait_for_files(ready, procs, 60)     # every interpreter started; the go file releases them
    open(go, "w").close()
    for code, out, err in wait_all(procs, 60):
        assert code == 0, err
        assert out.strip() == "opened"
    assert mode_of(path) == 0o600
    assert rows(path, "SELECT version FROM schema_migrations ORDER BY version") == \
        [(v,) for v in range(1, ap.SCHEMA_VERSION + 1)]


# --------------------------------------------------------------------------------------------
# Migrations
# --------------------------------------------------------------------------------------------

def test_schema_migrations_holds_one_row_per_migration(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    versions = rows(path, "SELECT version, applied_at FROM schema_migrations ORDER BY version")
    assert [v for v, _ in versions] == list(range(1, ap.SCHEMA_VERSION + 1))
    assert ap.SCHEMA_VERSION == len(ap._MIGRATIONS)
    assert all(applied for _, applied in versions)
    tables = {r[0] for r in rows(path, "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "steps", "events", "approvals", "tool_specs",
            "schema_migrations"} <= tables


def test_opening_twice_does_not_reapply_migrations(tmp_path):
    path = str(tmp_path / "runs.db")
    make_store(path)
    first = rows(path, "SELECT version, applied_at FROM schema_migrations ORDER BY version")
    time.sleep(0.01)       # the clock must pass, so a migration applied again stamps anew
    make_store(path)
    ap.Store.open_existing(path, readonly=False).close()
    assert rows(path, "SELECT version, applied_at FROM schema_migrations ORDER BY version") == first


def test_reopening_keeps_the_data(tmp_path):
    path = str(tmp_path / "runs.db")
    store = ap.Store.open(path)
    gate = ap.Gate(store, [], ap.SideEffectPolicy())
    gate.begin("run-1", "keep me", LIMITS)
    gate.close()
    store.close()
    store = ap.Store.open(path)
    try:
        assert store.get_run("run-1").goal == "keep me"
        assert ap.verify_events(store).checked == 2
    finally:
        store.close()


# --------------------------------------------------------------------------------------------
# Runs as a transaction knows them
# --------------------------------------------------------------------------------------------

RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
BANK_PAY = "bank_pay"


@pytest.fixture
def h(tmp_path):
    harness = ProxyHarness(tmp_path, rules=RULES)
    yield harness
    harness.close()


def fresh_run(store: ap.Store, run_id: str) -> ap.Run:
    """The run as the table holds it, read past every cache."""
    row = store.conn.execute(f"SELECT {ap._RUN_COLS} FROM runs WHERE id=?",
                             (run_id,)).fetchone()
    return ap._run_from_row(row)


def fields(run: ap.Run) -> tuple:
    return tuple(getattr(run, f) for f in ap.Run.__dataclass_fields__)


def test_the_runs_a_transaction_knows_are_the_rows_a_fresh_read_finds(h):
    gate, store = h.proxy.gate, h.store
    decision = ap.Decision("tool_call", BANK_PAY, b'{"to":"bob","amount":1}')
    seen = []
    with store.tx():
        session = gate.begin("test.known", f"call {BANK_PAY}", h.proxy.limits)
        seen.append((store.get_run("test.known"), fresh_run(store, "test.known")))
        step = session.step()
        seen.append((store.get_run("test.known"), fresh_run(store, "test.known")))
        verdict = session.propose(decision)
        assert verdict.kind == "allowed"
        session.start()
        seen.append((store.get_run("test.known"), fresh_run(store, "test.known")))
        with store.tx() as tx:
            moved = tx.transition("test.known", (ap.RUNNING,), ap.WAITING)
            seen.append((moved, fresh_run(store, "test.known")))
            seen.append((tx.run("test.known"), fresh_run(store, "test.known")))
            moved = tx.transition("test.known", (ap.WAITING,), ap.RUNNING, owner=gate.owner,
                                  lease_until="2030-01-01T00:00:00.000000Z")
            seen.append((moved, fresh_run(store, "test.known")))
    assert step.idx == 0 and seen[1][1].step_count == 1
    for known, row in seen:
        assert fields(known) == fields(row)
    session.close()


def test_a_run_id_already_taken_is_refused_and_nothing_is_written(h):
    gate = h.proxy.gate
    session = gate.begin("test.taken", "the first", h.proxy.limits)
    session.close()
    before = h.store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    other = ap.Gate(h.store, [ap.Tool(t.spec, t.call) for t in h.proxy.tools.values()],
                    h.proxy.policy, now=h.clock, lease_owner="another")
    try:
        with pytest.raises(ap.RunStateError, match="already exists"):
            other.begin("test.taken", "the second", h.proxy.limits)
    finally:
        other.close()
    assert fresh_run(h.store, "test.taken").goal == "the first"
    assert h.store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == before


BOUND = 10.0               # no wait in these tests is longer


def test_another_threads_transaction_waits_for_a_batch_and_is_not_part_of_it(tmp_path):
    store = ap.Store.open(str(tmp_path / "runs.db"))
    joined, order = threading.Event(), []
    insert = "INSERT INTO tool_specs (hash, spec_json) VALUES (?, '{}')"

    def other():
        joined.wait(BOUND)
        with store.tx() as tx:
            order.append("other")
            tx.exec(insert, ("other",))
    t = threading.Thread(target=other)
    t.start()
    try:
        with pytest.raises(RuntimeError):
            with store.tx():
                with store.tx() as tx:
                    tx.exec(insert, ("batch",))
                joined.set()
                time.sleep(0.3)             # the other thread is waiting meanwhile
                order.append("batch ends")
                raise RuntimeError("the batch fails: rolled back whole")
        t.join(BOUND)
        assert order == ["batch ends", "other"]
        kept = [r[0] for r in store._read("SELECT hash FROM tool_specs ORDER BY hash")]
        assert kept == ["other"]
    finally:
        t.join(BOUND)
        store.close()


# --------------------------------------------------------------------------------------------
# The call index: a claim is a compare-and-set, a key's rows one statement
# --------------------------------------------------------------------------------------------

def index_rows(h) -> list[tuple]:
    return h.store.conn.execute("SELECT id, request_key, run_id, open FROM proxy_calls "
                                "ORDER BY id").fetchall()


def test_a_claim_over_an_open_row_it_did_not_read_writes_nothing(h):
    index, now = h.proxy.index, h.clock()
    index.claim("key", BANK_PAY, "remote_mutation", "test.one", None, now)
    before = index_rows(h)
    with pytest.raises(ap.IndexRace):
        index.claim("key", BANK_PAY, "remote_mutation", "test.two", None, now)     # read none
    assert index_rows(h) == before
    first = index.open_row("key")
    index.claim("key", BANK_PAY, "remote_mutation", "test.three", first, now)
    after = index_rows(h)
    with pytest.raises(ap.IndexRace):                                           # closed since
        index.claim("key", BANK_PAY, "remote_mutation", "test.four", first, now)
    assert index_rows(h) == after
    assert [r[2:] for r in after] == [("test.one", 0), ("test.three", 1)]


def test_a_claim_under_a_run_id_in_use_is_an_error_not_a_race(h):
    index, now = h.proxy.index, h.clock()
    index.claim("key", BANK_PAY, "remote_mutation", "test.one", None, now)
    with pytest.raises(ap.StoreError):
        index.claim("other key", BANK_PAY, "remote_mutation", "test.one", None, now)
    assert [r[1:] for r in index_rows(h)] == [("key", "test.one", 1)]


def test_the_keys_rows_are_its_open_row_and_its_newest_closed_rows(h):
    index = h.proxy.index
    prev = None
    for i in range(12):
        index.claim("key", BANK_PAY, "remote_mutation", f"test.{i}", prev, 100.0 + i)
        index.claim(f"noise {i}", BANK_PAY, "remote_mutation", f"test.noise.{i}", None, 100.0 + i)
        prev = index.open_row("key")
    open_row, rows = index.for_key("key", 0.0)
    assert open_row.run_id == "test.11" and open_row.open == 1
    assert [r.run_id for r in rows] == ["test.11"] + [f"test.{i}" for i in
                                                      range(10, 10 - ap.RULE_ROWS, -1)]
    open_row, rows = index.for_key("key", 108.0)       # closed at 108 or later: 7 to 10
    assert [r.run_id for r in rows] == ["test.11", "test.10", "test.9", "test.8", "test.7"]
    assert index.for_key("no such key", 0.0) == (None, [])


def test_a_closed_rows_only_key_has_no_open_row(h):
    index = h.proxy.index
    index.claim("key", BANK_PAY, "remote_mutation", "test.a", None, 1.0)
    with h.store.tx() as tx:
        tx.exec("UPDATE proxy_calls SET open=0, closed_at=2.0 WHERE run_id='test.a'")
    open_row, rows = index.for_key("key", 0.0)
    assert open_row is None and [r.run_id for r in rows] == ["test.a"]
    with pytest.raises(sqlite3.IntegrityError):       # the index the claim relies on
        h.store.conn.execute("INSERT INTO proxy_calls (session, request_key, tool, "
                             "side_effect, run_id, created_at) VALUES ('s','k','t','r','x',0), "
                             "('s','k','t','r','y',0)")


def test_a_spec_seen_in_a_rolled_back_transaction_is_stored_again(tmp_path):
    store = ap.Store.open(str(tmp_path / "db"))
    try:
        with pytest.raises(RuntimeError):
            with store.tx() as tx:
                tx.save_spec(BALANCE)
                store.ensure_spec(BALANCE)      # finds the uncommitted row
                raise RuntimeError("roll back")
        store.ensure_spec(BALANCE)
        assert store.spec(BALANCE.hash()).name == BALANCE.name
    finally:
        store.close()


def test_a_long_policy_identity_with_surrogates_is_refused_by_its_size():
    pid = "\ud800" * 100                        # 300 bytes as UTF-8 with surrogatepass
    with pytest.raises(ValueError) as caught:
        ap.check_policy_id(pid)
    assert str(caught.value) == (f"policy identity is 300 bytes, more than "
                                 f"{ap.MAX_POLICY_ID_BYTES}")
