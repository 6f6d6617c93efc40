"""Shared helpers for tests that need a database with runs in it (test_store.py, test_cli.py).

Data is written the way the proxy writes it: through a Gate over a Store on a temporary file,
with in-process async tools. ``pay`` is remote_mutation (the default policy asks an operator),
``balance`` is read_only (allowed, executes).
"""

import asyncio
import io
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402

PAY_SCHEMA = b'{"type":"object","properties":{"amount":{"type":"number"}}}'
PAY = ap.ToolSpec("pay", "pays", PAY_SCHEMA, "remote_mutation", 5.0, True)
BALANCE = ap.ToolSpec("balance", "reads the balance", b'{"type":"object"}', "read_only", 5.0)
LIMITS = ap.Limits(3, 3, 3, 3600, 3600)


class Harness:
    """A store and a gate on one database file, and short ways to leave runs in it."""

    def __init__(self, path: str):
        self.path = path
        self.store = ap.Store.open(path)
        self.paid: list[bytes] = []

        async def pay(args: bytes, value=None) -> ap.ToolResult:
            self.paid.append(args)
            return ap.ToolResult(b'{"paid":true}', "paid")

        async def balance(args: bytes, value=None) -> ap.ToolResult:
            return ap.ToolResult(b'{"balance":10}', "balance 10")

        self.gate = ap.Gate(self.store, [ap.Tool(PAY, pay), ap.Tool(BALANCE, balance)],
                            ap.SideEffectPolicy())

    def completed(self, run_id: str, goal: str = "read the balance") -> ap.Run:
        """A run that read the balance (allowed, executed) and then completed."""
        s = self.gate.begin(run_id, goal, LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "balance", b"{}", origin="model"))
        assert v.kind == "allowed"
        asyncio.run(s.execute())
        s.step()
        v = s.propose(ap.Decision("complete", origin="model"))
        assert v.run.status == ap.COMPLETED
        return v.run

    def waiting(self, run_id: str, args: bytes = b'{"amount": 25.00}',
                goal: str = "call pay") -> ap.Approval:
        """A run waiting for an operator on a pay call; returns its pending approval."""
        s = self.gate.begin(run_id, goal, LIMITS)
        s.step()
        v = s.propose(ap.Decision("tool_call", "pay", args, origin="model"))
        assert v.kind == "pending"
        return v.approval

    def close(self) -> None:
        self.gate.close()
        self.store.close()


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "runs.db"))
    yield h
    h.close()


@pytest.fixture
def exact_numbers(monkeypatch):
    """Every exact conversion of a JSON number while the test runs: Num.exact (a fraction;
    1.7e-9999 has 20,000 digits of denominator, 1e20000000 twenty million) and an integer
    of more than INT_TEXT_DIGITS digits. Each is listed (its literal, cut) and refused with
    an error, so that code which makes one fails the test at once, never after minutes.
    Counted, not timed: a busy machine judges the cost as an idle one does."""
    made: list[str] = []

    def exact(num):
        made.append(num.text[:40])
        raise AssertionError(f"an exact conversion of {num.text[:40]}")

    int_text = ap._int_text

    def long_int(digits: str) -> int:
        if len(digits) > ap.INT_TEXT_DIGITS:
            made.append(digits[:40])
            raise AssertionError(f"an integer of {len(digits)} digits")
        return int_text(digits)
    monkeypatch.setattr(ap.Num, "exact", exact)
    monkeypatch.setattr(ap, "_int_text", long_int)
    return made


@pytest.fixture
def cli():
    """Run the operator command in-process: cli(*argv, stdin=text) -> (code, stdout, stderr).
    stdin is a StringIO, never a terminal."""
    def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = ap.main(list(argv), stdin=io.StringIO(stdin), stdout=out, stderr=err)
        return code, out.getvalue(), err.getvalue()
    return run


def _made(build, end):
    """A factory fixture's body: it yields ``build``, remembering what each call made,
    and ends each of them afterwards with ``end``."""
    made: list = []

    def make(*args, **kw):
        made.append(build(*args, **kw))
        return made[-1]
    yield make
    for thing in made:
        end(thing)


@pytest.fixture
def procs():
    """Directories of real proxy processes a test makes (process_helpers.ProcessDir); every
    proxy started in them is killed, by its pid, at the end."""
    from process_helpers import ProcessDir
    yield from _made(ProcessDir, lambda d: d.cleanup())


@pytest.fixture
def harnesses(tmp_path):
    """In-process proxies a test makes (proxy_harness.ProxyHarness), each in a directory of
    its own under tmp_path, closed at the end."""
    from proxy_harness import ProxyHarness

    def build(name="h", **kw):
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        return ProxyHarness(d, **kw)
    yield from _made(build, lambda h: h.close())


@pytest.fixture(scope="session")
def script(tmp_path_factory):
    """The scripted stdio MCP server (tests/scripted_server.py's SCRIPT), written once to a
    directory of its own."""
    from scripted_server import SCRIPT
    path = tmp_path_factory.mktemp("scripted") / "scripted_server.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.fixture
def two_tools(script, tmp_path):
    """`fs` with read_file (readOnlyHint) and write_file (no annotations)."""
    from scripted_server import READ_SCHEMA, WRITE_SCHEMA, Scripted, tool_entry
    return Scripted(script, tmp_path, tools=[
        tool_entry("read_file", READ_SCHEMA, "Read a file.", {"readOnlyHint": True}),
        tool_entry("write_file", WRITE_SCHEMA, "Write a file.")])
