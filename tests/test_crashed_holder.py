"""A crashed holder is noticed at once (DESIGN.md section 11, beyond the seed).

Each serving proxy holds an exclusive lock on a file of its own beside the database, and its
leases name that file. A proxy killed with SIGKILL while a payment is inside the server loses
the lock with its life, so the next proxy on the database takes its run over at once: the
identical call is INTERRUPTED and another payment to the tool is BLOCKED, though the dead
proxy's lease (one hour here) has most of its time left. A stopped proxy keeps its lock, and
a holder that cannot be checked (a symbolic link, a missing file, a file others may read, a
directory, a lease owner from an older build) keeps the seed's rule: the lease decides.

Every proxy here runs with lease_ttl 1h, so no outcome below can come from a lease running
out during the test. Each test starts real proxies (tests/process_helpers.py) and kills, by
pid, every process it started.
"""

import glob
import json
import os
import signal
import sqlite3
import stat
import sys
import time

from process_helpers import ProcessDir, eventually, is_error, prefix, text

LEASE = "1h"
NOBODY = 65534                           # a user id that is not this test's
PYTHON = sys.executable or "python3"

# A program that leaves behind a descendant keeping every descriptor it was given beyond its
# standard streams, in a session of its own, as a server or a notifier may. argv: the file
# to write the descendant's pid to, the file whose existence ends it, then (optionally) the
# program to become, as a wrapped server does; without one it reads its input (the
# on_pending document) and exits.
LINGERER = r'''
import os, sys, time
pid_file, stop_file, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
if os.fork() == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not os.path.exists(stop_file):
        time.sleep(0.1)
    os._exit(0)
if rest:
    os.execv(rest[0], rest)
sys.stdin.buffer.read()
'''


def want(result: dict, pfx: str, error: bool) -> str:
    t = text(result)
    assert t.startswith(pfx + ":"), f"want {pfx}, got: {t}"
    assert is_error(result) is error, f"isError {is_error(result)} for: {t}"
    return t


def holder_files(d: ProcessDir) -> list[str]:
    return sorted(glob.glob(glob.escape(d.db) + ".holder-*"))


def holder_of(d: ProcessDir, run_id: str) -> str:
    """The file the run's lease names: the one holder file whose name its owner carries."""
    owner = d.lease(run_id)[1]
    named = [f for f in holder_files(d) if f.rsplit(".", 1)[1] in owner]
    assert len(named) == 1, (owner, holder_files(d))
    return named[0]


def paying(d: ProcessDir, args: dict, victim=None):
    """A proxy that pays ``args`` (mode block): the payment is inside the server, its run
    RUNNING under the proxy's lease. Returns (proxy, request id, run id, its holder file)."""
    victim = victim or d.start("victim")
    ident = victim.send_call("bank_pay", args)
    eventually(lambda: d.payments() == 1, 15, "the payment to reach the server")
    run_id = [r for r in d.runs() if r["status"] == "RUNNING"][0]["id"]
    status, owner, until = d.lease(run_id)
    assert status == "RUNNING" and owner, (status, owner)
    assert until > time.time() + 600, "the lease is the test's hour: nothing here outlives it"
    held = holder_of(d, run_id)
    st = os.lstat(held)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    return victim, ident, run_id, held


def the_interruption(d: ProcessDir, run_id: str) -> dict:
    pending = d.pending()
    assert len(pending) == 1, pending
    a = pending[0]
    assert a["kind"] == "interrupted_side_effect" and a["run_id"] == run_id, a
    return a


def test_sigkilled_holders_payment_is_interrupted_at_once(tmp_path, procs):
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "rob", "amount": 5, "mode": "block"}
    victim, _, run_id, held = paying(d, args)
    victim.crash()
    assert d.pending() == []                 # nothing has noticed yet
    p = d.start("restarted")
    t = want(p.call("bank_pay", args), "INTERRUPTED", False)
    a = the_interruption(d, run_id)
    assert a["id"] in t, t
    assert d.show(run_id)["run"]["status"] == "WAITING_FOR_APPROVAL"
    assert not os.path.lexists(held), "the dead holder's file was left behind"
    assert d.payments() == 1
    d.release()
    d.approve(run_id, a["id"])
    r = p.call("bank_pay", args)
    assert not is_error(r) and text(r) == "paid 5.00 to rob", text(r)
    assert d.payments() == 2
    p.stop()


def test_sigkilled_holders_tool_is_blocked_at_once(tmp_path, procs):
    """The story of issue 31: after the kill, a different payment to the same tool must not
    go through while the dead proxy's payment has an unknown outcome."""
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    victim, _, run_id, held = paying(d, {"to": "rob", "amount": 5, "mode": "block"})
    victim.crash()
    p = d.start("restarted")
    t = want(p.call("bank_pay", {"to": "sam", "amount": 1}), "BLOCKED", True)
    a = the_interruption(d, run_id)
    assert a["id"] in t, t
    assert not os.path.lexists(held)
    r = p.call("bank_balance", {"account": "A-1"})
    assert not is_error(r), text(r)
    assert d.payments() == 1
    d.release()
    p.stop()
    assert d.payments() == 1


def test_every_run_of_a_sigkilled_holder_is_taken_over_at_once(tmp_path, procs):
    """The dead proxy had two payments inside the server. Taking the first over removes its
    file; the second's lease must not then fall back on the clock: it ran out with the
    first take-over, and the identical call asks about it at once too."""
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    first = {"to": "rob", "amount": 5, "mode": "block"}
    second = {"to": "sue", "amount": 7, "mode": "block"}
    victim = d.start("victim")
    victim.send_call("bank_pay", first)
    victim.send_call("bank_pay", second)
    eventually(lambda: d.payments() == 2, 15, "both payments to reach the server")
    runs = [r["id"] for r in d.runs() if r["status"] == "RUNNING"]
    assert len(runs) == 2, d.runs()
    held = holder_of(d, runs[0])
    victim.crash()
    p = d.start("restarted")
    want(p.call("bank_pay", first), "INTERRUPTED", False)
    assert not os.path.lexists(held)
    want(p.call("bank_pay", second), "INTERRUPTED", False)
    asked = sorted(a["run_id"] for a in d.pending())
    assert asked == sorted(runs), (asked, runs)
    assert d.payments() == 2
    d.release()
    p.stop()


def test_stopped_holders_payment_is_still_in_progress(tmp_path, procs):
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "rob", "amount": 5, "mode": "block"}
    stalled, ident, run_id, held = paying(d, args)
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        p = d.start("other")
        want(p.call("bank_pay", args), "IN_PROGRESS", False)
        assert d.pending() == [] and os.path.lexists(held)
        assert d.lease(run_id)[0] == "RUNNING"
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    d.release()
    r = stalled.result(ident)
    assert not is_error(r) and text(r) == "paid 5.00 to rob", text(r)
    assert d.payments() == 1
    stalled.stop()
    p.stop()
    assert holder_files(d) == []


def test_a_holder_that_cannot_be_checked_keeps_the_lease_rule(tmp_path, procs):
    """The dead proxy's file is replaced, one way after another, by what must not be read
    as its holder; each time the identical call is IN_PROGRESS, as the lease says. Put back
    as a private file that nobody locks, it is read as gone: the call is INTERRUPTED."""
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "rob", "amount": 5, "mode": "block"}
    victim, _, run_id, held = paying(d, args)
    owner = d.lease(run_id)[1]
    victim.crash()
    p = d.start("restarted")
    aside = held + ".aside"
    os.rename(held, aside)               # a private, unlocked file: read as gone if reached

    def still_leased(what: str, leased_to: str = owner) -> None:
        r = p.call("bank_pay", args)
        assert prefix(r) == "IN_PROGRESS", f"{what}: {text(r)}"
        assert d.pending() == [] and d.lease(run_id)[:2] == ("RUNNING", leased_to), what

    still_leased("missing")
    os.symlink(aside, held)
    still_leased("a symbolic link to an unlocked private file")
    os.unlink(held)
    os.mkdir(held, 0o700)
    still_leased("a directory")
    os.rmdir(held)
    os.mkfifo(held, 0o600)
    still_leased("a FIFO")
    os.unlink(held)
    with open(held, "w"):
        pass
    os.chmod(held, 0o644)
    still_leased("a file others may read")
    if os.getuid() == 0:                 # only root can give a file away
        os.chmod(held, 0o600)
        os.chown(held, NOBODY, NOBODY)
        still_leased("a file of another user")
    os.unlink(held)
    os.rename(aside, held)
    older = "agentrt-proxy:laptop/0123456789ab"     # as an older build wrote its owners
    write(d, "UPDATE runs SET lease_owner=? WHERE id=?", (older, run_id))
    still_leased("a lease owner from an older build, which names no file", older)
    assert os.path.lexists(held)
    write(d, "UPDATE runs SET lease_owner=? WHERE id=?", (owner, run_id))
    want(p.call("bank_pay", args), "INTERRUPTED", False)
    the_interruption(d, run_id)
    assert not os.path.lexists(held)
    d.release()
    p.stop()


def write(d: ProcessDir, sql: str, params: tuple) -> None:
    conn = sqlite3.connect(d.db, timeout=10, isolation_level=None)
    try:
        conn.execute(sql, params)
    finally:
        conn.close()


def read_pid(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def test_nothing_the_proxy_started_keeps_its_lock_after_it_is_killed(tmp_path, procs):
    """The proxy's upstream server (spawned before the proxy's lock exists) and its
    on_pending command (spawned while it serves, in a session of its own, never killed with
    the proxy) each leave a descendant that keeps every descriptor it was given and outlives
    the SIGKILLed proxy. Neither keeps the proxy's lock: its payment is INTERRUPTED at once."""
    lingerer = os.path.join(str(tmp_path), "lingerer.py")
    with open(lingerer, "w") as f:
        f.write(LINGERER)
    stop = os.path.join(str(tmp_path), "stop")
    server_pid = os.path.join(str(tmp_path), "server-descendant.pid")
    notifier_pid = os.path.join(str(tmp_path), "notifier-descendant.pid")
    d = procs(tmp_path, lease_ttl=LEASE, pin=False,
              on_pending=[PYTHON, lingerer, notifier_pid, stop])
    with open(d.config) as f:
        doc = json.load(f)
    doc["servers"][0]["command"] = [PYTHON, lingerer, server_pid, stop, PYTHON,
                                    doc["servers"][0]["command"][1]]
    with open(d.config, "w") as f:
        json.dump(doc, f)
    code, out, err = d.pin()
    assert code == 0, out + err
    lingering: list[int] = []
    try:
        args = {"to": "wes", "amount": 9, "mode": "block"}
        victim = d.start("victim")
        want(victim.call("bank_pay", args), "PENDING_APPROVAL", False)
        asked = d.pending()[0]
        d.approve(asked["run_id"], asked["id"])
        for path in (server_pid, notifier_pid):
            lingering.append(eventually(lambda: read_pid(path), 15, path))
        _, _, run_id, held = paying(d, args, victim=victim)
        victim.crash()
        for pid in lingering:
            os.kill(pid, 0)                  # still there, holding what it was given
        p = d.start("restarted")
        want(p.call("bank_pay", args), "INTERRUPTED", False)
        the_interruption(d, run_id)
        assert not os.path.lexists(held)
        d.release()
        p.stop()
    finally:
        open(stop, "w").close()
        for pid in lingering:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_holder_file_is_removed_at_a_normal_exit(tmp_path, procs):
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    p = d.start()
    r = p.call("bank_pay", {"to": "ann", "amount": 2})       # served: the file is there
    assert text(r) == "paid 2.00 to ann", text(r)
    files = holder_files(d)
    assert len(files) == 1, files
    st = os.lstat(files[0])
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    code, out, err = d.operator("runs")      # an operator command holds no lock
    assert code == 0, err
    assert holder_files(d) == files
    p.stop()
    assert holder_files(d) == []


def test_two_proxies_take_over_one_dead_holder_once(tmp_path, procs):
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "rob", "amount": 5, "mode": "block"}
    victim, _, run_id, held = paying(d, args)
    victim.crash()
    one, two = d.start("one"), d.start("two")
    i1, i2 = one.send_call("bank_pay", args), two.send_call("bank_pay", args)
    answers = sorted(prefix(r) for r in (one.result(i1), two.result(i2)))
    assert "INTERRUPTED" in answers and set(answers) <= {"INTERRUPTED", "IN_PROGRESS"}, answers
    the_interruption(d, run_id)
    assert not os.path.lexists(held)
    assert len(holder_files(d)) == 2
    assert d.payments() == 1
    d.release()
    one.stop()
    two.stop()
    assert holder_files(d) == []


def test_a_restarted_proxy_asks_about_a_dead_holders_payment_before_any_call(tmp_path, procs):
    """The story of issue 31: the host restarts its proxy at once after the kill. The
    operator's `pending` shows the question and stderr names it before the model calls
    anything: the restarted proxy takes the dead holder's runs over as it starts."""
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    victim, _, run_id, held = paying(d, {"to": "rob", "amount": 5, "mode": "block"})
    victim.crash()
    p = d.start("restarted")
    a = eventually(lambda: d.pending() and the_interruption(d, run_id), 15,
                   "the question asked as the proxy starts")
    assert f"approval {a['id']}" in p.stderr() and "decide with:" in p.stderr()
    assert d.show(run_id)["run"]["status"] == "WAITING_FOR_APPROVAL"
    assert not os.path.lexists(held)
    d.release()
    p.stop()
    assert d.payments() == 1


def test_a_restarted_proxy_leaves_a_stopped_holders_payment_alone(tmp_path, procs):
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    victim, _, run_id, held = paying(d, {"to": "rob", "amount": 5, "mode": "block"})
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        p = d.start("restarted")
        r = p.call("bank_balance", {"account": "A-1"})        # it has started and serves
        assert not is_error(r), text(r)
        assert d.pending() == [] and d.show(run_id)["run"]["status"] == "RUNNING"
        assert os.path.lexists(held)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    d.release()
    p.stop()


# ---- A live proxy's run is never taken over (DESIGN.md section 11 against the seed's rule 2)
#
# The lock on a holder file proves a proxy alive only while the file at the holder's name is
# the one it locked. Each test here has a live proxy with a payment inside the server (the
# fake server's mode block) and asks another proxy for the identical call: the seed's rule 2
# answers IN_PROGRESS, asks the operator nothing, and nothing is paid twice. Every proxy runs
# with lease_ttl 1h, so no outcome here can come from a lease running out.

import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402


def in_progress_and_nothing_asked(d, p, args: dict, run_id: str, what: str) -> None:
    r = p.call("bank_pay", args)
    assert prefix(r) == "IN_PROGRESS", f"{what}: the live proxy's run was taken: {text(r)}"
    assert d.pending() == [], f"{what}: the operator is asked about a live call: {d.pending()}"
    assert d.lease(run_id)[0] == "RUNNING", what


def test_a_live_proxys_holder_file_replaced_by_a_copy_keeps_its_run(tmp_path, procs):
    """The file is put back as a copy of itself (what a restore, rsync or an editor's save
    does: a new file renamed over the name, owner-only, nobody's lock on it). The proxy
    that locked the old file is alive and its payment is inside the server: the identical
    call must be IN_PROGRESS. Taken over instead, it is INTERRUPTED, the operator is asked
    about a call 'cut off while executing' that still executes, and approving runs the
    payment a second time while the first is still in the server."""
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "rob", "amount": 5, "mode": "block"}
    victim, ident, run_id, held = paying(d, args)
    shutil.copy2(held, held + ".new")
    os.replace(held + ".new", held)
    p = d.start("other")
    in_progress_and_nothing_asked(d, p, args, run_id, "a copy of the file")
    assert d.payments() == 1
    d.release()
    r = victim.result(ident)
    assert not is_error(r) and text(r) == "paid 5.00 to rob", text(r)
    assert d.payments() == 1
    victim.stop()
    p.stop()


def test_a_proxy_that_starts_takes_nothing_of_a_live_proxy_whose_file_was_replaced(
        tmp_path, procs):
    """The same replaced file, and no call at all to the tool: a proxy of the session that
    merely starts (Proxy.take_over_gone) must leave the live proxy's payment RUNNING under
    its lease, with nothing asked of the operator."""
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "rob", "amount": 5, "mode": "block"}
    victim, ident, run_id, held = paying(d, args)
    shutil.copy2(held, held + ".new")
    os.replace(held + ".new", held)
    p = d.start("other")
    r = p.call("bank_balance", {"account": "A-1"})          # it has started and serves
    assert not is_error(r), text(r)
    assert d.pending() == [], f"the operator is asked about a live call: {d.pending()}"
    assert d.show(run_id)["run"]["status"] == "RUNNING"
    d.release()
    r = victim.result(ident)
    assert not is_error(r) and text(r) == "paid 5.00 to rob", text(r)
    assert d.payments() == 1
    victim.stop()
    p.stop()


NO_OP_FLOCK = "int flock(int fd, int op) { (void)fd; (void)op; return 0; }\n"


def no_op_flock(tmp_path) -> str:
    """A library that makes flock succeed without locking anything, as on a filesystem
    whose flock is a no-op; skipped where no C compiler is found."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a flock that does nothing")
    src, lib = str(tmp_path / "noop_flock.c"), str(tmp_path / "noop_flock.so")
    with open(src, "w") as f:
        f.write(NO_OP_FLOCK)
    subprocess.run([cc, "-shared", "-fPIC", "-o", lib, src], check=True, timeout=120)
    return lib


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD, Linux")
def test_where_flock_locks_nothing_a_live_proxys_run_is_kept(tmp_path, procs, monkeypatch):
    """Where flock locks nothing (a filesystem on which it is a no-op), no lock is proof of
    anything: every checker takes a live holder's 'lock' and reads it as gone. The holder
    can see that at once (its own lock does not keep out a second open of its file) and
    must then name no file, as where there is no flock: the lease decides."""
    monkeypatch.setenv("LD_PRELOAD", no_op_flock(tmp_path))
    d = procs(tmp_path, allow_pay=True, lease_ttl=LEASE)
    args = {"to": "rob", "amount": 5, "mode": "block"}
    victim = d.start("victim")
    ident = victim.send_call("bank_pay", args)
    eventually(lambda: d.payments() == 1, 15, "the payment to reach the server")
    run_id = [r["id"] for r in d.runs() if r["status"] == "RUNNING"][0]
    p = d.start("other")
    in_progress_and_nothing_asked(d, p, args, run_id, "a flock that locks nothing")
    d.release()
    r = victim.result(ident)
    assert not is_error(r) and text(r) == "paid 5.00 to rob", text(r)
    assert d.payments() == 1
    victim.stop()
    p.stop()
