"""A live proxy's run is never taken over (DESIGN.md section 11 against the seed's rule 2).

The lock on a holder file proves a proxy alive only while the file at the holder's name is
the one it locked. Each test here has a live proxy with a payment inside the server (the
fake server's mode block) and asks another proxy for the identical call: the seed's rule 2
answers IN_PROGRESS, asks the operator nothing, and nothing is paid twice.

Every proxy runs with lease_ttl 1h, so no outcome here can come from a lease running out.
"""

import os
import shutil
import subprocess
import sys

import pytest

from process_helpers import eventually, is_error, prefix, text
from test_crashed_holder import LEASE, holder_files, paying


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
