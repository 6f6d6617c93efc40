"""The operator's inbox: `agentrt_proxy.py -db DB inbox`, run on a pseudo-terminal as an
operator runs it over ssh, against real proxy processes and their database. It shows what
waits in full, decides it bound to what it showed, waits for new approvals, and goes on
across a proxy restart; `-once` decides what waits and exits; a stdin that is not a
terminal is refused unless -tty-not-required says otherwise.

Every read has a deadline; every process a test starts is ended by its pid.
"""

import os
import select
import signal
import sqlite3
import subprocess
import time

import pytest

from process_helpers import PROXY, PYTHON, ProcessDir, eventually, is_error, prefix, text




class Terminal:
    """A command on a pseudo-terminal: stdin, stdout and stderr all the terminal's."""

    def __init__(self, argv: list[str], cwd: str):
        master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                                     start_new_session=True)
        os.close(slave)
        self.master, self.output, self.mark = master, b"", 0

    def _pump(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:                        # EIO: the command ended
            chunk = b""
        self.output += chunk
        return bool(chunk)

    def expect(self, what: str, timeout: float = 30) -> str:
        """Wait until ``what`` appears after what was expected last; what came in between."""
        deadline = time.monotonic() + timeout
        want = what.encode()
        while want not in self.output[self.mark:]:
            left = deadline - time.monotonic()
            if left <= 0 or (not self._pump(min(left, 0.2)) and
                             want not in self.output[self.mark:]):
                raise AssertionError(f"no {what!r} within {timeout} s; the terminal shows:\n"
                                     + self.output[self.mark:].decode("utf-8", "replace"))
        end = self.output.index(want, self.mark) + len(want)
        seen, self.mark = self.output[self.mark:end], end
        return seen.decode("utf-8", "replace")

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._pump(0.1)
        code = self.proc.poll()
        assert code is not None, "the inbox did not exit"
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        os.close(self.master)


@pytest.fixture
def terminals():
    opened: list[Terminal] = []

    def open_inbox(d: ProcessDir, *flags: str) -> Terminal:
        t = Terminal([PYTHON, PROXY, "-db", d.db, "inbox", "-by", "operator", *flags], d.tmp)
        opened.append(t)
        return t
    yield open_inbox
    for t in opened:
        t.close()


def pending_when_ready(d: ProcessDir) -> list[dict]:
    """The pending approvals; none while the proxy has not yet made its database."""
    try:
        return d.pending()
    except sqlite3.Error:
        return []


PROMPT = ": a approve, r reject, s skip, q quit: "


def test_inbox_decides_an_approval_that_a_running_proxy_then_collects(tmp_path, procs,
                                                                      terminals):
    d = procs(tmp_path, hold="60s")
    p = d.start()
    args = {"to": "ida", "amount": 5}
    ident = p.send_call("bank_pay", args)                # held while it waits
    asked = eventually(lambda: pending_when_ready(d), 30, "the approval to be asked")[0]

    t = terminals(d)
    shown = t.expect(f"approval {asked['id']}{PROMPT}")
    assert f"APPROVAL WAITING  {asked['id']}" in shown
    for line in ("kind          remote_mutation", "server        bank", "upstream tool pay",
                 "tool          bank_pay", '"ida"', f"---- end of approval {asked['id']}"):
        assert line in shown, shown
    assert d.payments() == 0
    t.type("a")
    t.expect(f"approval {asked['id']}: approved by operator")
    r = p.result(ident, 30)                             # the held call collects it
    assert not is_error(r) and text(r) == "paid 5.00 to ida", text(r)
    assert d.payments() == 1
    t.expect("no approval waits")
    t.type("q")
    assert t.wait() == 0
    p.stop()
    assert d.runs()[0]["status"] == "COMPLETED"


def test_inbox_waits_for_new_approvals_across_a_proxy_restart(tmp_path, procs, terminals):
    d = procs(tmp_path)
    d.start("first").stop()                             # the database exists, nothing waits
    t = terminals(d)
    t.expect("no approval waits")

    p = d.start("second")
    rejected = {"to": "jon", "amount": 9}
    assert prefix(p.call("bank_pay", rejected)) == "PENDING_APPROVAL"
    first = d.pending()[0]
    t.expect(f"approval {first['id']}{PROMPT}")
    t.type("r")
    t.expect("note for the rejection")
    t.type("not this month")
    t.expect(f"approval {first['id']}: rejected by operator")
    p.stop()                                            # the proxy goes away under the inbox

    p = d.start("third")
    approved = {"to": "kim", "amount": 2}
    assert prefix(p.call("bank_pay", approved)) == "PENDING_APPROVAL"
    second = d.pending()[0]
    t.expect(f"approval {second['id']}{PROMPT}")
    t.type("a")
    t.expect(f"approval {second['id']}: approved by operator")
    r = p.call("bank_pay", approved)
    assert text(r) == "paid 2.00 to kim", text(r)
    r = p.call("bank_pay", rejected)
    assert prefix(r) == "REJECTED" and "not this month" in text(r), text(r)
    t.type("q")
    assert t.wait() == 0
    p.stop()
    assert d.payments() == 1


def test_inbox_refuses_a_decision_on_an_approval_changed_since_it_was_shown(tmp_path, procs,
                                                                           terminals):
    d = procs(tmp_path)
    p = d.start()
    assert prefix(p.call("bank_pay", {"to": "lou", "amount": 3})) == "PENDING_APPROVAL"
    asked = d.pending()[0]
    t = terminals(d, "-once")
    t.expect(f"approval {asked['id']}{PROMPT}")
    # Behind the inbox's back, what it showed is replaced (the hash of what it showed no
    # longer names the row).
    import sqlite3
    conn = sqlite3.connect(d.db, timeout=10)
    try:
        conn.execute("UPDATE approvals SET hash=? WHERE id=?", ("0" * 64, asked["id"]))
        conn.commit()
    finally:
        conn.close()
    t.type("a")
    t.expect(f"approval {asked['id']} changed after it was shown: nothing was decided")
    t.expect("nothing more waits")
    assert t.wait() == 0
    assert d.pending()[0]["id"] == asked["id"]          # still pending: nothing decided
    p.stop()
    assert d.payments() == 0


def test_inbox_refuses_a_stdin_that_is_not_a_terminal_unless_told(tmp_path, procs):
    d = procs(tmp_path)
    p = d.start()
    skipped, taken = {"to": "max", "amount": 1}, {"to": "ned", "amount": 2}
    assert prefix(p.call("bank_pay", skipped)) == "PENDING_APPROVAL"
    assert prefix(p.call("bank_pay", taken)) == "PENDING_APPROVAL"
    first, second = d.pending()

    code, out, err = d.operator("inbox", "-once", "-by", "operator")       # stdin /dev/null
    assert code == 2, (code, out, err)
    assert "inbox: stdin is not a terminal; pass -tty-not-required" in err
    assert [a["status"] for a in d.pending()] == ["pending", "pending"]

    r = subprocess.run([PYTHON, PROXY, "-db", d.db, "inbox", "-once", "-by", "operator",
                        "-tty-not-required"], input="s\na\n", capture_output=True, text=True,
                       timeout=60, cwd=d.tmp)
    assert r.returncode == 0, r.stderr
    assert r.stdout.index(first["id"]) < r.stdout.index(second["id"])       # oldest first
    assert f"approval {second['id']}: approved by operator" in r.stdout
    assert "nothing more waits" in r.stdout
    assert [a["id"] for a in d.pending()] == [first["id"]]                # skipped: waits
    assert text(p.call("bank_pay", taken)) == "paid 2.00 to ned"
    p.stop()


def test_inbox_quits_at_end_of_input_without_deciding(tmp_path, procs):
    d = procs(tmp_path)
    p = d.start()
    assert prefix(p.call("bank_pay", {"to": "ola", "amount": 1})) == "PENDING_APPROVAL"
    r = subprocess.run([PYTHON, PROXY, "-db", d.db, "inbox", "-by", "operator",
                        "-tty-not-required"], input="", capture_output=True, text=True,
                       timeout=60, cwd=d.tmp)
    assert r.returncode == 0, r.stderr
    assert "APPROVAL WAITING" in r.stdout
    assert len(d.pending()) == 1
    p.stop()


def test_inbox_has_no_json_output(tmp_path, procs):
    d = procs(tmp_path, pin=False)
    code, _, err = d.operator("-json", "inbox", "-tty-not-required")
    assert code == 2 and "inbox: there is no -json output" in err, err


def test_inbox_answers_typed_ahead_decide_nothing_not_yet_shown(tmp_path, procs, terminals):
    # "a", Enter, "a", Enter at the first prompt approves the first approval only: the
    # second is shown, and waits for an answer typed after it was shown.
    d = procs(tmp_path, hold="0s")
    p = d.start()
    for to in ("ann", "bea"):
        assert prefix(p.call("bank_pay", {"to": to, "amount": 3})) == "PENDING_APPROVAL"
    first, second = eventually(lambda: len(pending_when_ready(d)) == 2 and d.pending(), 30,
                               "two approvals to be asked")
    t = terminals(d)
    t.expect(f"approval {first['id']}{PROMPT}")
    os.write(t.master, b"a\na\n")
    t.expect(f"approval {first['id']}: approved by operator")
    t.expect(f"approval {second['id']}{PROMPT}")
    time.sleep(0.5)            # give a typed-ahead answer every chance to be (wrongly) taken
    statuses = {a["id"]: a["status"] for a in d.approvals()}
    assert statuses[first["id"]] == "approved"
    assert statuses[second["id"]] == "pending", statuses
    t.type("s")
    t.type("q")
    assert t.wait() == 0
    assert {a["id"]: a["status"] for a in d.approvals()}[second["id"]] == "pending"
