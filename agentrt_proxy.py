"""agentrt_proxy: a gate between an MCP host and the MCP servers it calls.

What it governs, and what it does not
-------------------------------------
The proxy governs only calls that go through it. If the host gives the model a shell, file
access, or other tools of its own, the model can bypass the proxy, and it can approve its own
request with the operator command or by editing the database. So the proxy is for hosts
without such tools, or with them disabled or behind the host's own prompts, or inside a
sandbox whose only way out is the proxy.

It is for one person who is both the host's user and the operator. It does not separate them.
The upstream servers run as that same user: no server may be able to reach the proxy's
configuration, its manifests, or its database. It never sees model calls, so it sets no token
or cost limits, and it never sees the user's prompt. Each call is a separate run, so there are
no limits or policy over a conversation's history (a rule's limits count only what its tools
executed). The duplicate rule refuses a deliberate identical repeat of a mutating call inside
the window, not only a retry. Results are capped and flattened. The pin covers what a server
presents, not what it does.

What it keeps: each promise, the one function that keeps it, why every path goes through
that function, and the test that fails when that function gives the permissive answer.

1. An approval is bound by hash to the exact request, survives restarts, and the policy is
   evaluated again at collection. grant_covers (12.1). A grant runs only through
   Gate._resume_waiting (the row verified, the request built from its record with today's
   spec), _Decider._resume and _apply, which evaluates the policy again and asks grant_covers;
   _require_grant re-reads the grant in the start's transaction. tests/test_gate.py::
   test_a_changed_fixed_value_asks_for_a_new_approval.
2. A mutating call whose outcome is unknown is not run again as the identical request without
   an operator, and other mutating calls to its tool are refused meanwhile. _observe (12.1),
   the one classifier: every call that returns or raises reaches it through _call_tool (a
   cancel through _StepExecution.call_started) and it records the ending from what happened;
   unknown_ending and _known_outcome read only that field (none recorded: unknown). A crash
   or stall is the take-over's (Gate._take_over_claimed): the step interrupted while
   executing, read as cut off; where the server ran that attempt as a task, Proxy.ask_task
   asks it first (Resume.recover), and what it tells passes UpstreamTool.answer_of and
   _observe as a call's answer does. tests/test_outcome_classifier.py::
   test_the_server_crashing_mid_call_is_unknown.
3. Within the repeat window, a known outcome, on time or late, is not run again unless the
   operator approves a repeat; the window runs from the later of the run's end and the
   recording of its outcome. Rules.executed_within (22): rule 5 of Rules.refusal asks it,
   for a rule that refuses and one that asks a repeat alike, and it reads the index's
   executions with their late outcomes (execution_of). tests/test_proxy_rules.py::
   test_unknown_server_error_is_a_known_failure.
4. Every state change is committed with its audit record before the host is answered, and a
   mutating call's attempt before its request leaves. Store.tx (10): the gate writes runs,
   steps and approvals only through the Tx it hands out, Tx.event writes the event in the
   same transaction, and tx returns only after a FULL commit, or (synced=False, for the
   three writes an answer follows) the host's writer runs Store.sync before any message
   leaves; _StepExecution.start commits step.tool_started, FULL, before call_started sends.
   tests/test_store.py::test_rolled_back_transaction_leaves_no_event_and_no_seq_gap;
   tests/test_commits.py::test_serving_syncs_a_calls_outcome_before_its_answer_leaves.
5. Only tools the operator pinned and classified are offered or called. _build (17), by way
   of register (17): every tool served is built by it from the pin and a rule, at start
   (load_server) and when a server's listing changes (ServerWatch.relist, section 25), both
   through register; Proxy.listing and Gate.tools hold only what it built. tests/test_pinning.py::
   test_proxy_changed_description_refuses_the_tool.
6. An identical mutating call is not executed twice within the window, unless the operator
   approves a repeat. CallIndex.claim (21) with Rules.refusal (22): claim's compare-and-set
   on the key's one open row lets one call at a time decide a key, across processes; refusal
   judges that call against the key's finished runs (rules 4 and 5). tests/test_store.py
   ::test_a_claim_over_an_open_row_it_did_not_read_writes_nothing (claim);
   tests/test_proxy_rules.py::test_unknown_server_error_is_a_known_failure (refusal).
7. The bytes sent upstream are derived from the record, and nothing else builds them.
   wire_arguments (17), pure: the recorded arguments (the proxy's own encoding of what the
   host sent) as they are, or with the operator's fixed values set. UpstreamTool.call is
   the only caller of a connection's call_tool, and sends what wire_arguments returns, once
   it has refused denied or fixed parameters the model set. tests/test_upstream_calls.py::
   test_the_arguments_sent_are_wire_arguments_of_the_record.
8. No limit is overspent, across processes and crashes; unknown outcomes count. Budgets.admit
   (20.1), inside the start's IMMEDIATE transaction: the Budgets docstring. tests/
   test_policy_limits.py::test_policy_sum_limit_asks_with_the_figures_and_names_the_limit.
9. A task is answered what the identical call is answered, and executes nothing that call
   would not. Proxy.outcome (22), the one path of every tools/call: HostServer.run_call and
   a task's follower (Tasks._follow, 23.1) both go through it, and a task's row records only
   its answer. tests/test_tasks.py::test_proxy_approval_round_trip_as_a_legacy_task.

Trust boundaries
----------------
- Bytes from the host (the model's arguments) and from upstream servers (results, schemas,
  descriptions) are hostile. They are parsed by the strict parser of section 3 (the
  runtime's json scanner under the proxy's own strictness), never by ``json`` as it comes,
  which is lenient; text from them is sanitised (section 5) before it reaches a
  terminal or the model's prose answers.
- The database, the configuration and the manifests are trusted only while no one else can
  write them: the store refuses files others can write, symbolic links, and schemas holding
  triggers or views. A serving proxy's holder file beside the database (section 11) says
  that its proxy died only when it is a regular 0600 file of this user whose lock can be
  taken; anything else leaves a crashed proxy's lease to decide, as the seed does.
- The operator decides approvals outside the host, from a shell; a decision is bound to the
  hash of exactly what the operator was shown, and to the view it was shown in: everything
  the store holds that bears on it, a late outcome of the attempt it asks about included.
- The on_pending command is the operator's own program, started without a shell when an
  approval starts to wait; what it is told (the model's arguments among it) is sanitised,
  and it can neither decide nor delay anything.
- The webhook (section 32), only when an operator starts it, takes the same decisions over
  HTTP from whoever holds its shared secret; the serving proxy itself opens no listener.

Sections, in dependency order
-----------------------------
 1. Constants and limits                15. Upstream client (stdio)
 2. Errors                              16. Upstream client (streamable HTTP)
 3. Strict JSON                         17. Pinning and loading upstream tools
 4. Canonical JSON, request keys        18. Configuration
 5. Sanitising                          19. The proxy: a run per call; 19.1 Answers; 19.2 on_pending
 6. Schema patterns (ECMA-262, linear)  20. Conditions and limits; 20.1 Limits: counting
 7. Schema validation                   21. The rules across calls: the call index
 8. Time and records                    22. Deciding a call; 22.1 Executing, holding
 9. Policy                              23. The host-facing server; 23.1 Tasks
10. The store                           24. Serving, pinning, checking; 24.1 wrap
11. The gate; 11.1 Leases, holder file  25. Tools that change while serving
12. A run's session; 12.1 Executing     26. Re-checking recorded calls
13. Decisions and late outcomes         27. Operator commands: the command line
14. JSON-RPC framing                    28. Operator views (runs, show, events, pending)
                                        29. Operator decisions (approve, reject, cancel)
                                        30. The inbox
                                        31. Running a command
                                        32. The webhook (HTTP approvals)
                                        33. main
"""

from __future__ import annotations

import sys

# The oldest Python the module runs on, checked before anything else runs, so that an older
# interpreter stops with one line saying what to use instead of a traceback from deep inside
# (Python 3.9 is past its end of life, and kept because macOS still ships it). For the check
# to run at all the whole file must compile on the interpreter being refused: nothing newer
# than Python 3.7's syntax anywhere in it. Python 3.6 and older stop at the __future__ import.
MIN_PYTHON = (3, 9)
PYTHON_SOURCES = ("on macOS, /usr/bin/python3 from the Command Line Tools (xcode-select "
                  "--install; update them if it is older than 3.9), Homebrew's python (brew "
                  "install python), or the installer from https://www.python.org/downloads/")


if sys.version_info < MIN_PYTHON:
    sys.exit("agentrt_proxy.py needs Python %d.%d or newer; this is Python %s (%s). Get one: %s"
             % (MIN_PYTHON[0], MIN_PYTHON[1], sys.version.split()[0], sys.executable,
                PYTHON_SOURCES))

# Run as a module (python3 -m agentrt_proxy), the interpreter loads its cached compiled form
# of this file instead of compiling it at every start, as it does a script. But -m also puts
# the current directory first on the module path, and a host starts the proxy in a directory
# of its choosing (a workspace, say): a file there named like any module imported below would
# run in its place. So a module run needs -P (or PYTHONSAFEPATH=1; Python 3.11 and newer),
# which leaves the current directory out. Checked before any other import.
SAFE_MODULE_RUN = ("agentrt_proxy: run as a module, start it as python3 -P -m agentrt_proxy "
                   "with its directory on PYTHONPATH (Python 3.11 or newer), so that the "
                   "current directory is not searched for modules; or run the file itself: "
                   "python3 /path/to/agentrt_proxy.py")
if __name__ == "__main__" and globals().get("__spec__") is not None and \
        not getattr(sys.flags, "safe_path", False):
    sys.exit(SAFE_MODULE_RUN)

import argparse
import asyncio
import base64
import bisect
import collections
import contextlib
import dataclasses
import datetime as _dt
import hashlib
import hmac
import io
import ipaddress
import itertools
import json
import operator
import os
import queue
import re
import secrets
import select
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import tempfile
import threading
import time
import unicodedata
import urllib.parse
from decimal import Context, Decimal
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

# flock, for a serving proxy's holder file (section 11), exists on every POSIX system. Where
# it does not (Windows), a proxy holds no such file and its leases name none: a crashed
# proxy's runs are taken over when their leases run out, the seed's rule, as everywhere for
# a holder that cannot be checked.
try:
    import fcntl
except ImportError:
    fcntl = None

# Imported where first used, so that starting the proxy does not pay for them: http.client
# (with the email package it loads) only for a server reached over HTTP (section 15,
# _http_client), fractions only for Num.exact (section 3).
if TYPE_CHECKING:
    import http.client
    from fractions import Fraction

# ==== 1. Constants and limits ====
# Every bound the proxy enforces is named here; bodies use these names, never bare numbers.

MAX_DEPTH = 256                      # nesting of arrays and objects in any JSON we accept
# Our own records wrap data that may nest MAX_DEPTH levels: a step's decision holds the
# arguments, an event's payload holds an approval's capability holding the arguments, and
# an operator command's -json output wraps those again. Records are read back with this
# allowance, so that data the gate accepted can never make its own record unreadable.
RECORD_WRAP = 16
RECORD_DEPTH = MAX_DEPTH + RECORD_WRAP
JSON_WS = b" \t\n\r"                  # the only whitespace JSON has; bytes.strip() takes more
MAX_NUMBER_LITERAL = 10_000          # bytes in one number literal
MAX_EXPONENT = 10_000                # absolute value of a number's written exponent
MAX_EXPONENT_DIGITS = 5              # exponent digits (after leading zeros) before we refuse
NUMBER_SHOWN = 24                    # bytes of a refused literal quoted in the error
VALUE_SHOWN = 96                     # bytes of a schema's value quoted in a mismatch
HASH_SHOWN = 128                     # characters of a stored hash a chain report quotes
ID_BYTES = 16                        # random bytes in a run, step, approval or lease id
OWNER_SUFFIX = 12                    # hex characters of the id a named lease owner shows
RUN_SUFFIX_BYTES = 8                 # random bytes after the session in a proxy run id
MAX_RESULT_BYTES = 64 * 1024         # a result or quoted result shown to the model
MAX_POLICY_ID_BYTES = 256            # a policy identity
MAX_SCHEMA_ERRORS = 8                # schema failures listed in one message
MAX_SCHEMA_CHAIN = 64                # $refs and combinators applying to one value, in a row
MAX_SCHEMA_FAN_OUT = 10_000          # subschemas one value may be checked against, through them
MAX_SCHEMA_EVALUATIONS = 300_000     # what checking one call's arguments may spend (see 7.)
MAX_MULTIPLE_OF_DIGITS = 64          # significant digits of a schema's multipleOf
DIGITS_PER_EVALUATION = 100          # a multipleOf check of a long number costs one more per
LEVELS_PER_EVALUATION = 32           # an evaluation this deep in the value costs one more
INT_TEXT_DIGITS = 4000               # digits int() converts from text (the runtime stops at 4300)
# Arguments nest up to MAX_DEPTH and checking takes a few frames per level; Python's default
# of 1000 frames is too few. Deeper still is refused (RecursionError), never accepted.
RECURSION_LIMIT = 6000
sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))

BUSY_TIMEOUT_MS = 5000               # SQLite busy_timeout on every connection
# SQLite's page cache of a connection, in KiB (its default is 2,000): a call with a 1 MB
# argument writes it three times and rewrites its step row (DESIGN section 5), about 5 MB of
# pages a call, which the default cache cannot hold until its commit. Memory is taken only as
# pages are used.
STORE_CACHE_KIB = 16 * 1024
REFUSAL_WAIT_MS = 50                 # ... and for counting a refusal, which may be skipped
WAL_SWITCH_SECONDS = 5.0             # how long to retry switching to WAL while busy
WAL_SWITCH_STEP = 0.005
DEFAULT_LEASE_TTL = 30.0             # seconds a run's lease lasts without renewal
TOOL_TIMEOUT_SLACK = 2.0             # the gate's bound on a tool call, past its own timeout
LEASE_RENEW_FRACTION = 3             # the heartbeat renews every ttl / this
HOLDER_CREATE_TRIES = 8              # fresh names tried for a holder file (section 11)
DEFAULT_APPROVAL_TTL = 24 * 3600.0
DEFAULT_GRANT_TTL = 24 * 3600.0

CLI_FIELD_BYTES = 2000               # a string in an approval's printed fields
CLI_FIELD_KEEP = 200                 # bytes kept at each end of a cut field string
CLI_EVENT_PAYLOAD = 8000             # bytes of one event payload in `events` text output
CLI_GOAL_WIDTH = 60
CLI_SUMMARY_WIDTH = 60
CLI_RUNS_LIMIT = 100
CLI_SHOW_LIMIT = 500
CLI_EVENTS_LIMIT = 500
CLI_LIST_IDS = 20                    # pending approval ids named when one must be chosen
VERIFY_PAGE = 128                    # events read at once by verify

INTERRUPTED_KIND = "interrupted_side_effect"
REPEAT_KIND = "repeat"                 # an identical call the operator allows (section 10)
REPEAT_QUOTE_BYTES = 2000              # of the earlier execution's result, in its approval
INTERRUPTED_REASON = "interrupted while executing; outcome unknown"
DENIED_RERUN_NOTICE = ("A condition or limit of the policy denies this call now (its figures "
                       "are shown): if it still does when the model calls again, approving "
                       "runs nothing, and this question is resolved as a rejection resolves it.")
REPEAT_REASON = "an identical call already executed within the window"
INTERRUPTED_NOTICE = (
    "This tool call started, and the process running it stopped before its outcome was "
    "recorded, so whether it took effect is unknown. Approving runs it again with these "
    "arguments; rejecting ends the run.")

SIDE_EFFECTS = ("read_only", "local_mutation", "remote_mutation", "destructive")
DEFAULT_POLICY = {"read_only": "allow", "local_mutation": "allow",
                  "remote_mutation": "require_approval", "destructive": "deny"}

RUNNING, WAITING = "RUNNING", "WAITING_FOR_APPROVAL"
COMPLETED, FAILED, CANCELLED = "COMPLETED", "FAILED", "CANCELLED"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})

PENDING, APPROVED, REJECTED, EXPIRED = "pending", "approved", "rejected", "expired"
# An approval whose run an operator cancelled while it waited. Stricter than the reference,
# which leaves such a row pending: a pending row on a cancelled run is read as waiting by
# anything that looks at the row alone (show, a count, the model's status tool).
CANCELLED_APPROVAL = "cancelled"
# An interruption approval whose question was answered by the record itself: the attempt it
# asks about finished after it was cut off, and what it came to is recorded (a late outcome).
# Stricter than the reference, which leaves it pending: approving it would run again a call
# the store knows has taken effect. Nothing can decide a settled approval.
SETTLED_APPROVAL = "settled"
SETTLED_BY = "the late outcome"      # decided_by of a settled approval: the record, not a person
# What the operator says came of a cut-off attempt when rejecting the interruption approval
# that asks about it (reject -outcome). The proxy keeps it in a table of its own, never in the
# runtime's columns; an attempt said not to have executed stops counting toward limits.
OUTCOME_EXECUTED, OUTCOME_NOT_EXECUTED, OUTCOME_UNKNOWN = "executed", "not-executed", "unknown"
OPERATOR_OUTCOMES = (OUTCOME_EXECUTED, OUTCOME_NOT_EXECUTED, OUTCOME_UNKNOWN)
OUTCOME_EVENT = "approval.outcome"

LOG_PREFIX = "agentrt-proxy: "


# ==== 2. Errors ====
# One family. Callers match on class, never on text; each message says what to do next.

class ProxyError(Exception):
    """Root of every error this module raises on purpose."""


class JSONError(ProxyError, ValueError):
    """Bytes the strict parser refuses. Shaped like json.JSONDecodeError.

    ``pos`` is a byte offset into the input; ``lineno`` and ``colno`` count from 1, and the
    column counts bytes.
    """

    def __init__(self, msg: str, doc: bytes, pos: int):
        self.msg, self.doc, self.pos = msg, doc, pos
        self.lineno = doc.count(b"\n", 0, pos) + 1
        self.colno = pos - (doc.rfind(b"\n", 0, pos) + 1) + 1
        super().__init__(f"{msg}: line {self.lineno} column {self.colno} (char {pos})")

    def __reduce__(self):
        return self.__class__, (self.msg, self.doc, self.pos)


class SchemaError(ProxyError, ValueError):
    """A schema we refuse to load, or arguments that do not match one."""


class PatternTooCostly(SchemaError):
    """A string that would cost more than a pattern may spend to match it."""


class CheckTooCostly(SchemaError):
    """Checking arguments against a schema spent the call's budget: a refusal, like any
    mismatch. ``at`` is the schema location it ran out in (filled in as the error passes
    the nearest schema object), ``path`` the pointer of the value being checked."""

    def __init__(self, at: tuple | None, path: str):
        self.at, self.path = at, path
        super().__init__(at, path)

    def __str__(self) -> str:
        where = "" if self.at is None else _pointer(self.at)
        return (f"checking these arguments against the schema at #{where} exceeded "
                f"{MAX_SCHEMA_EVALUATIONS} evaluations (at the value '{self.path}')")


class StoreError(ProxyError):
    """The database could not be opened, read or written as required."""


class NotFound(StoreError):
    """A run, step, approval or event that is not in the database."""


class SchemaVersionError(StoreError):
    """The database was written by another version of the schema."""


class UnsafeDatabase(StoreError):
    """A database file we refuse: a symbolic link, others can write it, triggers or views."""


class RunStateError(ProxyError):
    """A run or step is not in the state an operation needs."""


class RunLeased(RunStateError):
    """Another process holds the run's lease."""

    def __init__(self, run_id: str, owner: str, until: str):
        self.run_id, self.owner, self.until = run_id, owner, until
        super().__init__(f"run {run_id} is leased by {owner} until {until}")


class OutcomeNotRecorded(StoreError):
    """The tool ran and what came of it could not be written: it may have taken effect."""


class LeaseLost(ProxyError):
    """This process no longer holds the lease of the run it was working on."""


class LateOutcome(LeaseLost):
    """The tool returned after its run was taken over. What it returned is recorded, as a
    late event on its step, and carried here in ``observation``."""

    def __init__(self, msg: str, observation: dict):
        super().__init__(msg)
        self.observation = observation


class NotPending(ProxyError):
    """The approval was already decided or has expired."""


class ApprovalExpired(NotPending):
    """The approval, or the grant it became, expired before it was used."""


class AttemptSettled(NotPending):
    """The attempt an interruption approval asks about has a recorded outcome (it finished
    after it was cut off): nothing is decided, and the re-run never executes."""


class ApprovalHashMismatch(ProxyError):
    """The approval's stored hash is not the hash of its stored contents."""


class ApprovalChanged(ProxyError):
    """The approval is not the one the operator was shown."""


class UsageError(ProxyError):
    """A command line that cannot be carried out as written."""


# ==== 3. Strict JSON ====
# The runtime's C scanner (json's _json) is the engine, under strictness the proxy writes
# itself. The nesting bound and strict UTF-8 are checked first, on the bytes. The scanner
# refuses raw control characters, "\u+123", leading zeros, trailing commas and comments (its
# pure-Python fallback would take "\u+123": it is never used). Its hooks see the rest: a
# repeated key (object_pairs_hook), NaN and Infinity (parse_constant), and each number
# literal as written (parse_int, parse_float), kept as a Num because 10, 10.0 and 1e1 are
# different requests, and checked against our bounds. Unpaired surrogate escapes, which the
# scanner lets through, are found in the text. A refused document is walked again, exactly,
# to report the first failing check in a fixed order: depth, UTF-8, syntax, surrogates,
# repeated keys, number bounds.

_SCANNER = json.scanner.c_make_scanner
_SCAN_STRING = json.decoder.c_scanstring
if _SCANNER is None or _SCAN_STRING is None:
    raise ImportError("agentrt_proxy needs the json module's C scanner (_json)")
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {True: "true", False: "false", None: "null"}      # looked up by identity
_CLOSING = {"{": "}", "[": "]"}
_FIRST = operator.itemgetter(0)          # a member's key: members sorted by key alone
# A surrogate escape: a high one with the low one after it, or either alone.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                               r"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
SURROGATE_ESCAPE_LEN = 6                 # a \uXXXX escape, and its U+FFFD stand-in \ufffd
# The same, and an escaped backslash: read from the left, so that one is never the start of
# an escape.
_ESCAPE_RUN = re.compile(r"\\\\|" + _SURROGATE_ESCAPE.pattern)
# The nesting pre-check reads the bytes with escaped backslashes and quotes masked by two
# spaces (the same length: offsets hold), so that a string runs from one quote to the next,
# matched by a single-character repeat: no stack grows with a string's length.
_STRING_BYTES = re.compile(rb'"[^"]*"?')
_DEPTH_TOKENS = re.compile(rb'"[^"]*"?|[\[{\]}]')
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
DEPTH_CHUNK = 1 << 16                   # brackets summed at a time by the nesting pre-check


class Num:
    """A JSON number, kept as the literal text it was written with. Immutable by use: a
    plain slotted class because a frozen dataclass costs a microsecond to build. Its
    normal form is computed from the text once, when first asked for."""
    __slots__ = ("text", "_normal")

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Num) and other.text == self.text

    def __hash__(self) -> int:
        return hash(("Num", self.text))

    def __repr__(self) -> str:
        return f"Num({self.text!r})"

    def exact(self) -> Fraction:
        """The number's exact value. Costly for long literals (1.7...7e-9999 has a
        denominator of 20,000 digits): the schema checks use ``normal`` instead."""
        from fractions import Fraction   # at first use: see the imports at the top
        return Fraction(Decimal(self.text))

    def normal(self) -> tuple[int, str, int]:
        """(sign, digits, exponent): the value is sign * int(digits) * 10**exponent, with no
        leading or trailing zero in digits; zero is (0, "", 0). Equal values, however they
        are spelled (1, 1.0, 10e-1), have equal normal forms."""
        try:
            return self._normal
        except AttributeError:
            self._normal = _normal_form(self.text)
            return self._normal

    def is_integer(self) -> bool:
        sign, _, exponent = self.normal()
        return sign == 0 or exponent >= 0


def _normal_form(text: str) -> tuple[int, str, int]:
    """Num.normal from a well-formed literal, in time linear in its length: no big integer
    is built, so a 10,000-character literal costs microseconds, not seconds."""
    sign = -1 if text.startswith("-") else 1
    mantissa, _, written = text.lstrip("-").replace("E", "e").partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0") if fraction else whole.lstrip("0")
    if not digits:
        return 0, "", 0
    kept = digits.rstrip("0")
    power = _int_text(written.lstrip("+-").lstrip("0") or "0") if written else 0
    power = -power if written.startswith("-") else power
    return sign, kept, power - len(fraction) + len(digits) - len(kept)


def _int_text(digits: str) -> int:
    """int() of a digit string (no sign, no leading zeros) of any length. Within the
    parser's bounds an exponent has at most MAX_EXPONENT_DIGITS digits; longer ones only
    come from documents read without bounds, and are converted the slow way, never refused."""
    return int(digits) if len(digits) <= INT_TEXT_DIGITS else int(Decimal(digits))


class _Hooks:
    """What the C scanner is built from, as it is from a json.JSONDecoder: the proxy's
    strictness, as the scanner's hooks. NaN, Infinity and -Infinity are not JSON: the
    constant hook fails the scan, as a syntax error does. The other hooks note that the
    document holds a fault, and the exact walk (_Walk) finds which one and where, once the
    scan is over. ``repeated`` refuses repeated keys, ``bounds`` numbers past our bounds and
    ``float_range`` a number beyond a 64-bit float inside a container; with ``repeated``,
    ``sort_keys`` builds each object with its members sorted by key (a repeated key keeps
    its last value, as without)."""
    strict = True                   # the scanner's own sense: raw control characters refused
    object_hook = None

    def __init__(self, repeated: bool = False, bounds: bool = False, float_range: bool = False,
                 sort_keys: bool = False):
        self.object_pairs_hook = self.members if repeated else None
        self.sort_keys = sort_keys
        self.parse_int = self.parse_float = self.number if bounds or float_range else Num
        self.parse_constant = self.constant
        self.bounds, self.float_range = bounds, float_range
        self.fault = self.overflow = False
        self.scan = _SCANNER(self)

    def members(self, pairs: list[tuple[str, Any]]) -> dict:
        out = dict(sorted(pairs, key=_FIRST) if self.sort_keys else pairs)
        if len(out) != len(pairs):
            self.fault = True
        return out

    def number(self, lit: str) -> Num:
        # Only long literals or ones with an exponent can be past a bound.
        if len(lit) > NUMBER_SHOWN or "e" in lit or "E" in lit:
            if self.bounds and _number_problem(lit):
                self.fault = True
            if self.float_range and abs(float(lit)) == float("inf"):
                self.overflow = True        # a fault inside a container only (_parse_text)
        return Num(lit)

    def constant(self, name: str) -> None:
        raise ValueError(f"{name} is not JSON")


def _parse_text(raw: bytes, text: str, strict: bool = True, bounds: bool = True,
                float_range: bool = False) -> Any:
    """The one value ``text`` (``raw`` decoded) holds, read by the C scanner, or the
    refusal the exact walk finds. Strict: every check. Else a repeated key keeps its last
    value, an unpaired surrogate escape reads as U+FFFD, and with ``bounds`` numbers past
    our bounds (and with ``float_range`` a float overflow in a container) are refused."""
    lone = _lone_surrogates(text)
    if lone and not strict:
        text = _without_surrogates(text)
    bounds = strict or bounds
    hooks = _Hooks(strict, bounds, strict or (bounds and float_range))
    value, end = None, -1
    try:
        value, end = hooks.scan(text, _WS.match(text).end())
        end = _WS.match(text, end).end()
    except (ValueError, StopIteration):     # a JSONDecodeError, or no value at all
        pass
    overflow = hooks.overflow and type(value) is not Num    # a number alone may be large
    if end == len(text) and not hooks.fault and not overflow and not (strict and lone):
        return value
    raise _Walk(raw, text, strict, bounds, float_range).refusal(lone if strict else [])


class _Walk:
    """The exact pass over a document the scan refused. It builds no value: it raises the
    first syntax error where it is, else returns the first fault of each kind in the fixed
    order. Strings are read by the scanner's own string reader, so the two agree on them."""

    def __init__(self, raw: bytes, text: str, strict: bool, bounds: bool, float_range: bool):
        self.raw, self.src = raw, text
        self.strict, self.bounds, self.float_range = strict, bounds, float_range
        # A repeated key, or a number inside a container beyond a 64-bit float: the
        # runtime's decoder refuses both in one pass, so the first of them is reported.
        self.decode_fault: tuple[str, int] | None = None
        self.overflow: tuple[str, int] | None = None
        self.number: tuple[str, int] | None = None

    def fail(self, reason: str, pos: int) -> JSONError:
        """The error for a fault at character ``pos`` of the decoded text."""
        return JSONError(reason, self.raw, len(self.src[:pos].encode("utf-8", "surrogatepass")))

    def syntax(self, reason: str, pos: int) -> JSONError:
        return self.fail("not valid JSON: " + reason, pos)

    def refusal(self, lone: list[int]) -> JSONError:
        src = self.src
        pos = _WS.match(src).end()
        if pos >= len(src):
            raise self.syntax("no value", pos)
        end = _WS.match(src, self.value(pos, False)).end()
        if end != len(src):
            raise self.syntax("data after the value", end)
        surrogate = (f"unpaired surrogate {src[lone[0]:lone[0] + SURROGATE_ESCAPE_LEN]}",
                     lone[0]) if lone else None
        checks = (surrogate, self.decode_fault, self.number) if self.strict else \
            (self.overflow if self.float_range else None, self.number) if self.bounds else ()
        for found in checks:
            if found:
                return self.fail(*found)
        return self.syntax("refused by the runtime's scanner", 0)   # the two agree: unreached

    def value(self, pos: int, inside: bool) -> int:
        """Where the value at ``pos`` ends; ``inside`` a container."""
        src = self.src
        ch = src[pos:pos + 1]
        if ch in _CLOSING:
            return self.members(_WS.match(src, pos + 1).end(), _CLOSING[ch])
        if ch == '"':
            return self.string(pos)[1]
        if ch == "-" or "0" <= ch <= "9":
            return self.num(pos, inside)
        for word in _LITERALS.values():
            if src.startswith(word, pos):
                return pos + len(word)
        raise self.syntax(f"unexpected character {_show_char(ch)}" if ch else
                          "unexpected end of input", pos)

    def members(self, pos: int, close: str) -> int:
        """Where the object or array whose first member (or its ``close``) is at ``pos``
        ends."""
        src, keys = self.src, set()
        if src.startswith(close, pos):
            return pos + 1
        while True:
            if src.startswith(close, pos):
                raise self.syntax("trailing comma", pos)
            key_at, key = pos, None
            if close == "}":
                key, pos = self.key(pos)
            pos = _WS.match(src, self.value(pos, True)).end()
            if key is not None:
                if key in keys and self.decode_fault is None:
                    self.decode_fault = (f"duplicate key {_quote(key)}", key_at)
                keys.add(key)
            if src.startswith(",", pos):
                pos = _WS.match(src, pos + 1).end()
            elif src.startswith(close, pos):
                return pos + 1
            else:
                raise self.syntax(f"expected ',' or '{close}' in "
                                  f"{'an object' if close == '}' else 'an array'}", pos)

    def key(self, pos: int) -> tuple[str, int]:
        """The key at ``pos`` of an object, and where its value begins."""
        src = self.src
        ch = src[pos:pos + 1]
        if ch != '"':
            raise self.syntax(f"expected a string key, found {_show_char(ch)}" if ch else
                              "unexpected end of input", pos)
        key, pos = self.string(pos)
        pos = _WS.match(src, pos).end()
        if not src.startswith(":", pos):
            raise self.syntax("expected ':' after an object key", pos)
        return key, _WS.match(src, pos + 1).end()

    def string(self, pos: int) -> tuple[str, int]:
        """The string whose opening quote is at ``pos``, and where it ends."""
        src = self.src
        try:
            return _SCAN_STRING(src, pos + 1, True)
        except ValueError as exc:           # the reasons, told by the messages' first words
            at = exc.pos                    # json 3.9 to 3.13 spell them alike
            if exc.msg.startswith("Invalid control"):
                raise self.syntax(f"control character U+{ord(src[at]):04X} in a string",
                                  at) from None
            if exc.msg.startswith("Unterminated"):
                tail = len(src) - len(src.rstrip("\\"))     # a backslash escaping nothing
                if tail % 2 == 0:
                    raise self.syntax("unterminated string", len(src)) from None
                at = len(src) - 1
            raise self.syntax("invalid escape", src.rfind("\\", 0, at + 1)) from None

    def num(self, pos: int, inside: bool) -> int:
        m = _NUMBER.match(self.src, pos)
        end = m.end() if m else pos
        nxt = self.src[end:end + 1]
        if not m or (nxt and nxt in "0123456789.eE+-"):
            zero = m and m.group().lstrip("-") == "0" and nxt.isdigit()
            raise self.syntax("leading zero in a number" if zero else "malformed number", pos)
        lit = m.group()
        if inside and self.overflow is None and abs(float(lit)) == float("inf"):
            self.overflow = (f"number {lit[:NUMBER_SHOWN]} is beyond the range of a "
                             "64-bit float", pos)
            self.decode_fault = self.decode_fault or self.overflow
        problem = self.number is None and _number_problem(lit)
        if problem:
            self.number = (problem, pos)
        return end


def _lone_surrogates(text: str) -> list[int]:
    """Where each unpaired surrogate escape of ``text`` begins. Escapes are read from the
    left, an escaped backslash as one, so a backslash that is itself escaped begins no
    escape. Exact in a document the scanner accepts, where every backslash is inside a
    string; one search of the runtime's when there is no surrogate escape at all."""
    if not _SURROGATE_ESCAPE.search(text):
        return []
    return [m.start() for m in _ESCAPE_RUN.finditer(text)
            if len(m.group()) == SURROGATE_ESCAPE_LEN]


def _without_surrogates(text: str) -> str:
    """``text`` with each unpaired surrogate escape written \\ufffd: the same length."""
    return _ESCAPE_RUN.sub(lambda m: "\\ufffd" if len(m.group()) == SURROGATE_ESCAPE_LEN
                           else m.group(), text)


def _number_problem(lit: str) -> str | None:
    """Why a well-formed literal is past the bounds we accept, or None."""
    if len(lit) > MAX_NUMBER_LITERAL:
        return f"number {lit[:NUMBER_SHOWN]}... is longer than {MAX_NUMBER_LITERAL} characters"
    head, sep, exp = lit.lower().partition("e")
    if not sep:
        return None
    digits = exp.lstrip("+-").lstrip("0")
    if len(digits) > MAX_EXPONENT_DIGITS or (digits and int(digits) > MAX_EXPONENT):
        shown = lit if len(lit) <= NUMBER_SHOWN else lit[:NUMBER_SHOWN] + "..."
        return f"number {shown} has an exponent beyond \u00b1{MAX_EXPONENT}"
    return None


def _show_char(ch: str) -> str:
    return repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"


def _quote(s: str) -> str:
    """A value quoted for an error message, with nothing that can drive a terminal."""
    return '"' + sanitize(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _depth_exceeds(raw: bytes, limit: int) -> int | None:
    """Byte offset where nesting first passes ``limit``, counting brackets outside strings.
    Needs no validity: this check runs first, so absurd nesting is refused cheaply. It costs
    a few of the runtime's passes over the bytes and one addition per bracket outside a
    string; only a refusal walks the brackets one at a time, to find the offset."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return None
    masked = raw.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    # Quotes and brackets alone; two quotes in a row can go, as they leave whether each
    # bracket is inside a string (an odd number of quotes before it) as it was.
    structure = masked.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    brackets = _STRING_BYTES.sub(b"", structure)
    depth = 0
    for at in range(0, len(brackets), DEPTH_CHUNK):
        levels = list(itertools.accumulate(
            map(_BRACKET_STEP.__getitem__, brackets[at:at + DEPTH_CHUNK]), initial=depth))
        if max(levels) > limit:
            break
        depth = levels[-1]
    else:
        return None
    depth = 0
    for m in _DEPTH_TOKENS.finditer(masked):
        depth += _BRACKET_STEP.get(m.group()[0], 0)     # a string's quote steps by 0
        if depth > limit:
            return m.start()
    return None


def _decoded(raw: bytes, max_depth: int) -> str:
    """``raw`` as text, once its nesting is within ``max_depth``: UTF-8, or refused."""
    at = _depth_exceeds(raw, max_depth)
    if at is not None:
        raise JSONError(f"nested deeper than {max_depth} levels", raw, at)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONError("not valid UTF-8", raw, exc.start) from None


def parse_json(raw: bytes, strict: bool = True, max_depth: int = MAX_DEPTH,
               bounds: bool = True, float_range: bool | None = None) -> Any:
    """Parse exactly one JSON value from ``raw``.

    Objects become dicts, arrays lists, numbers ``Num``. With ``strict`` false (only for
    documents we canonicalise but do not judge, such as an upstream's schema) a repeated key
    keeps its last value and an unpaired surrogate escape becomes U+FFFD. With ``bounds``
    false (only for reading a message to route it; its parts are judged on their own) numbers
    past our bounds are not refused either. ``float_range`` (on when strict) also refuses a
    number inside a container beyond a 64-bit float, as a server's pinned schema must.
    """
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    return _parse_text(raw, _decoded(raw, max_depth), strict, bounds, bool(float_range))


def check_json(raw: bytes) -> None:
    """Refuse what the strict parser refuses; accept everything else."""
    parse_json(raw)


# A strict parse's value travels with the call that made it (Decision.value, ToolRequest.value)
# so that no step parses the same bytes again; this marks one not made yet.
NOT_PARSED: Any = type("NotParsed", (), {"__repr__": lambda self: "NOT_PARSED"})()


def member_spans(raw: bytes, max_depth: int = RECORD_DEPTH) -> dict[str, bytes]:
    """The exact bytes of each member value of a top-level object, so that a record can hand
    back what was written into it byte for byte, never a re-serialisation. Kept where the
    bytes need not be the proxy's own encoding: a gate caller's arguments (recorded as
    given), a server's listing (its schemas judged with bounds its read does not apply), a
    message's members (refused arguments are recorded as sent, a request id echoed)."""
    return read_members(raw, max_depth)[1]


def read_members(raw: bytes, max_depth: int = RECORD_DEPTH) -> tuple[dict, dict[str, bytes]]:
    """read_own of an object (number literals kept), and member_spans of it, from one
    parse: its members' spans are recorded as it is parsed."""
    text = _decoded(raw, max_depth)
    doc, spans, _ = _read_object(raw, text, 1)
    if not isinstance(doc, dict):
        raise JSONError("not valid JSON: expected an object", raw, 0)
    return doc, {k: text[a:b].encode("utf-8") for k, (a, b) in spans.items()}


def _read_object(raw: bytes, text: str, levels: int, clean: set[int] | None = None,
                 judged: str = "", sort_keys: bool = False) -> tuple[Any, dict, dict]:
    """The value ``text`` (``raw`` decoded) holds, read leniently and without bounds, and
    when it is an object the spans of its members (_members); ``clean`` gets where each
    value inside its member ``judged`` begins that the scanner read without a fault of the
    strict parser's (the faults are looked for there alone), its objects' members sorted
    with ``sort_keys``. Anything else, valid or not, is left to _parse_text, which returns
    it or raises its exact refusal."""
    clean = set() if clean is None else clean
    lone = _lone_surrogates(text)
    text = _without_surrogates(text) if lone else text
    pos = _WS.match(text).end()
    if text.startswith("{", pos):
        try:
            end, doc, spans, inner = _members(_Hooks(), text, pos, levels, clean,
                                              {judged: _Hooks(True, True, True, sort_keys)})
            for member in (spans, *inner.values()):
                clean.difference_update(a for a, b in member.values() if _any_in(lone, a, b))
            if _WS.match(text, end).end() == len(text):
                return doc, spans, inner
        except (ValueError, StopIteration):
            pass
    return _parse_text(raw, text, False, False), {}, {}


def _any_in(offsets: list[int], start: int, end: int) -> bool:
    """Whether one of ``offsets`` is in [start, end)."""
    return any(start <= at < end for at in offsets)


def _members(hooks: _Hooks, text: str, pos: int, levels: int, clean: set[int],
             judging: dict[str, _Hooks],
             ) -> tuple[int, dict, dict[str, tuple[int, int]], dict[str, dict]]:
    """The object whose '{' is at ``pos``, member by member, each value read by the
    scanner of ``hooks``: where it ends, its value, each member value's span (character
    offsets), and with ``levels`` above 1 the spans of the members of each member that is
    an object, read with ``judging``'s hooks for a member it names; ``clean`` gets the start
    of each value read by hooks that look for faults and found none. A repeated key keeps
    its last value. Anything but an object raises ValueError."""
    doc: dict = {}
    spans: dict[str, tuple[int, int]] = {}
    inner: dict[str, dict] = {}
    pos = _WS.match(text, pos + 1).end()
    if text.startswith("}", pos):
        return pos + 1, doc, spans, inner
    while True:
        if not text.startswith('"', pos):
            raise ValueError("expected a key")
        key, pos = _SCAN_STRING(text, pos + 1, True)
        pos = _WS.match(text, pos).end()
        if not text.startswith(":", pos):
            raise ValueError("expected ':'")
        start = _WS.match(text, pos + 1).end()
        inner.pop(key, None)
        if levels > 1 and text.startswith("{", start):
            pos, doc[key], inner[key], _ = _members(judging.get(key, hooks), text, start,
                                                    levels - 1, clean, {})
        else:
            hooks.fault = hooks.overflow = False
            doc[key], pos = hooks.scan(text, start)
            if hooks.object_pairs_hook and not (hooks.fault or hooks.overflow):
                clean.add(start)
        spans[key] = (start, pos)
        pos = _WS.match(text, pos).end()
        if text.startswith(",", pos):
            pos = _WS.match(text, pos + 1).end()
        elif text.startswith("}", pos):
            return pos + 1, doc, spans, inner
        else:
            raise ValueError("expected ',' or '}'")


def _value_end(text: str, pos: int) -> int:
    """Where the value at ``pos`` of a document the parser accepted ends."""
    return _Hooks().scan(text, pos)[1]



# ==== 4. Canonical JSON and request keys ====
# One spelling for each value: keys sorted by UTF-8 bytes, no insignificant whitespace,
# strings escaped one fixed way, number literals verbatim. Hashes and request keys are taken
# over this form, so key order and escape spelling never matter and literals always do.

# Each replaced by the runtime's replace, one pass a character (a pass that finds none is a
# fast search): a translation table or a pattern costs a step for every character.
_HTML_SAFE = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
              ("\u2029", "\\u2029"))


def _canon_str(text: str) -> str:
    """A string in canonical form: the stdlib's escaping of '"', '\\' and C0 controls
    (named escapes, else \\u00xx in lower case), then <, >, &, U+2028, U+2029 escaped."""
    out = _json_str(text)
    for char, escape in _HTML_SAFE:
        out = out.replace(char, escape)
    return out


_json_str = json.encoder.encode_basestring   # ensure_ascii off: other characters stay raw
_policy_str = _json_str                       # policy form: only '"', '\\' and C0 controls escaped


def _encode(value: Any, out: list[str], quote: Callable[[str], str], own: bool = False) -> None:
    """The JSON text of ``value`` appended to ``out``, its strings and keys written by
    ``quote``. The canonical and policy forms sort keys and take parsed values alone; the
    proxy's own encoding (``own``, dump_json) keeps members in the order given and also takes
    tuples, ints and ``RawJSON`` fragments, so no fragment ever reaches a hashed form."""
    kind = type(value)
    if kind is str:
        out.append(quote(value))
    elif kind is Num:
        out.append(value.text)
    elif kind is dict:
        out.append("{")
        # Python orders str by code point, which for scalar values is UTF-8 byte order.
        for i, key in enumerate(value if own else sorted(value)):
            out.append(("," if i else "") + quote(key) + ":")
            _encode(value[key], out, quote, own)
        out.append("}")
    elif kind is list or (own and kind is tuple):
        out.append("[")
        for i, item in enumerate(value):
            out.append("," if i else "")
            _encode(item, out, quote, own)
        out.append("]")
    elif value is True or value is False or value is None:
        out.append(_LITERALS[value])
    elif own and kind is RawJSON:
        out.append(_raw_text(value.data))
    elif own and isinstance(value, int):
        out.append(str(int(value)))
    elif own and isinstance(value, str):
        out.append(quote(str(value)))
    else:
        raise TypeError("floats are not written into records; use Num or int"
                        if own and kind is float else f"not a JSON value: {kind.__name__}")


def encode_canonical(value: Any) -> bytes:
    """The canonical bytes of an already parsed value."""
    out: list[str] = []
    _encode(value, out, _canon_str)
    return "".join(out).encode("utf-8")


def canonical_json(raw: bytes) -> bytes:
    """The canonical form of ``raw``; raises JSONError for anything the strict parser refuses."""
    return encode_canonical(parse_json(raw))


def policy_json(raw: bytes, strict: bool = True) -> bytes:
    """The canonical form without HTML escaping: what a policy is handed. Never hashed."""
    return encode_policy(parse_json(raw, strict))


def encode_policy(value: Any) -> bytes:
    """policy_json of an already parsed value."""
    out: list[str] = []
    _encode(value, out, _policy_str)
    return "".join(out).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def same_digest(a: Any, b: Any) -> bool:
    """Two hashes compared in constant time, as bytes: one of them is read from a file or a
    row that may have been edited, and compare_digest raises on a str that is not ASCII (or
    on anything that is not text), where a hash that does not match must simply not match."""
    return isinstance(a, str) and isinstance(b, str) and hmac.compare_digest(
        a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def content_hash(raw: bytes) -> str:
    """Hash of the canonical form of the first value in ``raw`` (read leniently: a repeated
    key keeps its last value, bad bytes become U+FFFD, blank is null), or of the bytes
    themselves when there is no value to read. Only hashes what was recorded; never judges.
    Bytes parsed strictly read the same leniently: the hash of their value is this hash."""
    text = _decode_lossy(raw)
    pos = _WS.match(text).end()
    if pos >= len(text):
        return sha256_hex(b"null")
    if _depth_exceeds(raw, MAX_DEPTH) is not None:
        return sha256_hex(raw)
    lone = _lone_surrogates(text)
    try:
        value = _Hooks().scan(_without_surrogates(text) if lone else text, pos)[0]
    except (ValueError, StopIteration):
        return sha256_hex(raw)
    return sha256_hex(encode_canonical(value))


def request_key(tool: str, raw_args: bytes) -> str | None:
    """SHA-256 over the tool name, a zero byte and the canonical arguments; None when the
    arguments have no canonical form (such a call never matches another)."""
    try:
        value = parse_json(raw_args)
    except JSONError:
        return None
    return _request_key_of(tool, value)


def _request_key_of(tool: str, value: Any) -> str:
    """request_key of arguments already parsed strictly."""
    return sha256_hex(tool.encode("utf-8") + b"\x00" + encode_canonical(value))


# The proxy's own encoding, of every frame it writes (to a server or to the host) and every
# record it stores: compact, members in the order given, number literals as written, and
# strings escaped so that no reader can find a line break in them. Bytes a peer chose never
# pass through: a host's CR between two tokens is JSON whitespace to a strict parser but a
# line end to a server that reads with universal newlines, and would let one frame carry
# two. So C0 controls, DEL, C1 controls (U+0085 is a line end to str.splitlines) and
# U+2028/U+2029 are escaped, and a lone surrogate (bytes that were not UTF-8) is U+FFFD.
_WIRE_ESCAPES = {code: f"\\u{code:04x}" for code in (*range(0x7F, 0xA0), 0x2028, 0x2029)}
_WIRE_ESCAPES.update({code: "\ufffd" for code in range(0xD800, 0xE000)})
_WIRE_SPECIAL = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff]")
# What must never appear in a frame outside our own escaping: line ends of every reader.
_LINE_BREAKS = (b"\n", b"\r", b"\xc2\x85", b"\xe2\x80\xa8", b"\xe2\x80\xa9")
# The ones an ASCII string can hold, from the tables above: each by the runtime's replace.
_WIRE_ASCII = [(chr(code), escape) for code, escape in _WIRE_ESCAPES.items() if code < 0x80]
_ASCII_BREAKS = tuple(brk for brk in _LINE_BREAKS if brk.isascii())


def _wire_str(text: str) -> str:
    out = _json_str(text)
    if out.isascii():                     # known without reading it
        for char, escape in _WIRE_ASCII:
            out = out.replace(char, escape)
        return out
    return out.translate(_WIRE_ESCAPES) if _WIRE_SPECIAL.search(out) else out


def dump_json(value: Any) -> str:
    """The proxy's own compact JSON text of a value built by this module (dicts keep their
    order; ``RawJSON`` fragments, already in this encoding, are embedded as they are)."""
    out: list[str] = []
    _encode(value, out, _wire_str, True)
    return "".join(out)


@dataclasses.dataclass(frozen=True, repr=False)
class RawJSON:
    """JSON bytes in the proxy's own encoding, embedded as they are when a record or frame
    is written. Bytes holding a line break of any reader are written again by the encoder
    instead: a guard, so that no fragment can ever split a frame."""
    data: bytes


def _raw_text(data: bytes) -> str:
    breaks = _ASCII_BREAKS if data.isascii() else _LINE_BREAKS
    if any(brk in data for brk in breaks):
        return dump_json(parse_json(data, strict=False, max_depth=RECORD_DEPTH, bounds=False))
    return data.decode("utf-8")


def to_plain(value: Any) -> Any:
    """A parsed value with numbers made Python numbers, for display and simple reads: an
    integer literal (no fraction, no exponent) becomes an int, any other a float. Decided
    from the text: a record holds the model's arguments and a server's results, whose long
    literals must not cost an exact fraction each."""
    if isinstance(value, Num):
        text = value.text
        if "." in text or "e" in text or "E" in text:
            return float(text)
        sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
        return sign * _int_text(digits.lstrip("0") or "0")
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


def read_own(text: str | bytes) -> Any:
    """Parse a record this module wrote, number literals kept, with the allowance for the
    levels a record adds around the data it holds."""
    return parse_json(text, strict=False, max_depth=RECORD_DEPTH, bounds=False)


def loads_own(text: str | bytes) -> Any:
    """Parse a record this module wrote, with numbers as plain Python numbers."""
    return to_plain(read_own(text))


# ==== 5. Sanitising ====
# Text a model, a server or an operator chose can reach a terminal or a model's prose. It is
# made inert: invalid UTF-8 becomes U+FFFD (one per run of bad bytes), CR and LF become
# spaces, C0, DEL and C1 controls are written \xHH, bidirectional and invisible characters
# \u{hhhh}, and a run of combining marks keeps its first four.

_INVISIBLE = ("\u202a-\u202e\u2066-\u2069\u061c\u200e\u200f\u200b-\u200d\u2060-\u2064"
              "\ufeff\u00ad\u180e\u2028\u2029\U000e0000-\U000e007f")
_ESCAPED = re.compile(f"[\x00-\x1f\x7f-\x9f{_INVISIBLE}]")
_NEEDS_WORK = re.compile(f"[\x00-\x1f\x7f-\x9f{_INVISIBLE}\ud800-\udfff]")
_BAD_BYTES = re.compile("[\udc80-\udcff]+")
MAX_COMBINING = 4


def _decode_lossy(data: bytes) -> str:
    """Decode UTF-8, one U+FFFD for each maximal run of invalid bytes."""
    return _BAD_BYTES.sub("\ufffd", data.decode("utf-8", "surrogateescape"))


def sanitize(text: str | bytes) -> str:
    """Make text safe to print on a terminal or quote to a model. Does not bound length."""
    if isinstance(text, bytes):
        text = _decode_lossy(text)
    if not _NEEDS_WORK.search(text) and (text.isascii() or not any(
            unicodedata.combining(c) or unicodedata.category(c)[0] == "M" for c in text)):
        return text
    # Lone surrogates in a str stand for bytes that were not UTF-8. No escape is a mark and
    # no mark is escaped, so escaping first leaves every run of marks as it was.
    text = _ESCAPED.sub(_escape, re.sub("[\ud800-\udfff]+", "\ufffd", text))
    out: list[str] = []
    for is_mark, run in itertools.groupby(text, lambda c: unicodedata.category(c)[0] == "M"):
        run = "".join(run)
        if is_mark and len(run) > MAX_COMBINING:
            run = f"{run[:MAX_COMBINING]}[+{len(run) - MAX_COMBINING} combining marks dropped]"
        out.append(run)
    return "".join(out)


def _escape(found: re.Match) -> str:
    """CR and LF as spaces, a C0, DEL or C1 control as \\xHH, any other \\u{hhhh}."""
    code = ord(found.group())
    if code in (0x0A, 0x0D):
        return " "
    return f"\\x{code:02x}" if code < 0x20 or 0x7F <= code <= 0x9F else f"\\u{{{code:04x}}}"


def truncate(text: str, limit: int) -> str:
    """The longest prefix of at most ``limit`` UTF-8 bytes that splits no character, then
    '…' (three more bytes) when anything was cut."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore") + "\u2026"


def clean(text: str | bytes, limit: int) -> str:
    """Sanitise, then bound to ``limit`` bytes: every piece of chosen text in a prose answer."""
    return truncate(sanitize(text), limit)


# ==== 6. Schema patterns: an ECMA-262 matcher that never backtracks ====
# `pattern` and `patternProperties` are ECMA-262 regular expressions, and the model chooses
# the strings they are matched against. A backtracking matcher (Python's re) takes time
# exponential in the input for patterns like ^(\w+\s?)*$ and cannot be interrupted, so one
# pinned pattern could hang the proxy. Patterns are compiled here, once, to a program for a
# Thompson/Pike simulation that tracks every possible position at once and never backtracks.

MAX_PATTERN_CHARS = 2000             # characters in one pattern
MAX_PATTERN_REPEAT = 1000            # the largest count in {n}, {n,} or {n,m}
MAX_PATTERN_NESTING = 64             # groups inside groups
MAX_PATTERN_PROGRAM = 4000           # instructions in one compiled pattern
MAX_PATTERN_WORK = 10_000_000        # instruction visits (a few seconds) to match one string
# Matching is charged to the call's budget too (MAX_SCHEMA_EVALUATIONS): one evaluation for
# this many instruction visits, about what an evaluation costs, so that many strings, each
# cheap enough alone, cannot add up to seconds either.
PATTERN_VISITS_PER_EVALUATION = 4
PATTERN_MEMO_STEPS = 10_000          # memoised steps kept per pattern before the memo empties
PATTERN_MEMO_STATES = 100_000        # instructions held in memoised states, likewise
MAX_CODE_POINT = 0x10FFFF
_SET, _JUMP, _ASSERT, _MATCH = range(4)
_AT_START, _AT_END, _PREV_WORD, _NEXT_WORD, _BOUNDARY = 1, 2, 4, 8, 16
# Each assertion: the bit of a position's context it reads, and the value that bit must have.
_ASSERTIONS = {"^": (_AT_START, True), "$": (_AT_END, True),
               "b": (_BOUNDARY, True), "B": (_BOUNDARY, False)}
_SYNTAX_CHARS = frozenset("^$\\.*+?()[]{}|")
# A quantifier, and the counts it stands for ('{' reads its own).
_REPEATS = {"*": (0, None), "+": (1, None), "?": (0, 1), "{": None}
# Escapes that stand for one code point: the controls, and each syntax character and '/'.
_CHAR_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D,
                 **{ch: ord(ch) for ch in _SYNTAX_CHARS | {"/"}}}
_DECIMAL = frozenset("0123456789")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
# ECMA-262's WhiteSpace and LineTerminator (the Zs category as of Unicode 15), not Python's.
_SPACE_RANGES = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680),
                 (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
                 (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_DIGIT_RANGES = ((0x30, 0x39),)
_WORD_RANGES = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_WORD_CHARS = frozenset(chr(cp) for lo, hi in _WORD_RANGES for cp in range(lo, hi + 1))
_LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_ALL = ((0, MAX_CODE_POINT),)


def _merge(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for lo, hi in _merge(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


# What an escape's letter stands for outside a class (a code point, or a class escape's
# ranges), and inside one, where \b is a backspace and \- a hyphen.
_ESCAPES = {"d": _DIGIT_RANGES, "D": _complement(_DIGIT_RANGES),
            "w": _WORD_RANGES, "W": _complement(_WORD_RANGES),
            "s": _SPACE_RANGES, "S": _complement(_SPACE_RANGES), **_CHAR_ESCAPES}
_ESCAPES_IN_CLASS = {**_ESCAPES, "b": 0x08, "-": ord("-")}
_DOT = _complement(_LINE_TERMINATORS)


class _PatternParser:
    """ECMA-262 pattern syntax, read as with the u flag, to a tree of tuples: ("set", ranges),
    ("assert", (bit, value)) from _ASSERTIONS, ("cat", [nodes]), ("alt", [nodes]),
    ("repeat", node, min, max or None). Anything else raises SchemaError saying why."""

    def __init__(self, text: str):
        self.text, self.pos, self.depth = text, 0, 0

    def fail(self, why: str) -> SchemaError:
        return SchemaError(f"{why} at character {self.pos}")

    def peek(self, ahead: int = 0) -> str:
        return self.text[self.pos + ahead:self.pos + ahead + 1]

    def take(self) -> str:
        ch = self.peek()
        if not ch:
            raise self.fail("the pattern ends early")
        self.pos += 1
        return ch

    def accept(self, ch: str) -> bool:
        """Whether ``ch`` comes next; if it does, it is consumed."""
        found = self.peek() == ch
        self.pos += found
        return found

    def parse(self) -> tuple:
        node = self.disjunction()
        if self.pos < len(self.text):       # only a ')' ends a disjunction early
            raise self.fail("unmatched ')'")
        return node

    def disjunction(self) -> tuple:
        branches = [self.alternative()]
        while self.accept("|"):
            branches.append(self.alternative())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def alternative(self) -> tuple:
        terms = []
        while self.peek() not in ("", "|", ")"):
            terms.append(self.term())
        return terms[0] if len(terms) == 1 else ("cat", terms)

    def term(self) -> tuple:
        ch = self.peek()
        if ch in ("^", "$") or (ch == "\\" and self.peek(1) in ("b", "B")):
            self.pos += 1 + (ch == "\\")
            if self.peek() in _REPEATS:
                raise self.fail("an assertion cannot be repeated")
            return ("assert", _ASSERTIONS[self.text[self.pos - 1]])
        atom = self.atom()
        ch = self.peek()
        if ch not in _REPEATS:
            return atom
        self.pos += 1
        low, high = _REPEATS[ch] or self.counts()
        self.accept("?")        # lazy: the same strings match, only captures differ
        return ("repeat", atom, low, high)

    def counts(self) -> tuple[int, int | None]:
        low = self.number()
        high: int | None = low
        if self.accept(","):
            high = None if self.peek() == "}" else self.number()
        if not self.accept("}"):
            raise self.fail("expected '}'")
        if high is not None and high < low:
            raise self.fail("the numbers of {n,m} are out of order")
        return low, high

    def number(self) -> int:
        start = self.pos
        while self.peek() in _DECIMAL:
            self.pos += 1
        digits = self.text[start:self.pos]
        if not digits:
            raise self.fail("'{' does not start a quantifier {n}, {n,} or {n,m}")
        if len(digits) > len(str(MAX_PATTERN_REPEAT)) or int(digits) > MAX_PATTERN_REPEAT:
            raise self.fail(f"a count above {MAX_PATTERN_REPEAT} is not supported")
        return int(digits)

    def atom(self) -> tuple:
        ch = self.take()
        if ch == ".":
            return ("set", _DOT)
        if ch == "[":
            return self.char_class()
        if ch == "(":
            return self.group()
        if ch == "\\":
            found = self.escape(in_class=False)
            return ("set", found if isinstance(found, tuple) else ((found, found),))
        if ch in _SYNTAX_CHARS:
            self.pos -= 1
            raise self.fail(f"{ch!r} has nothing to repeat" if ch in _REPEATS else
                            f"a lone {ch!r} must be escaped")
        return ("set", ((ord(ch), ord(ch)),))

    def group(self) -> tuple:
        if self.peek() == "?" and self.peek(1) != ":":
            named = self.peek(1) == "<" and self.peek(2) not in ("=", "!")
            kind = {"=": "a lookahead", "!": "a lookahead", "<": "a lookbehind"}
            raise self.fail("a named group is not supported" if named else
                            f"{kind.get(self.peek(1), 'this group')} is not supported")
        self.pos += 2 if self.peek() == "?" else 0      # past the "?:" of (?:...)
        self.depth += 1
        if self.depth > MAX_PATTERN_NESTING:
            raise self.fail(f"groups nest deeper than {MAX_PATTERN_NESTING}")
        node = self.disjunction()
        self.depth -= 1
        if not self.accept(")"):
            raise self.fail("a group is not closed")
        return node

    def escape(self, in_class: bool) -> int | tuple:
        """After a backslash: a class escape's ranges, or the code point of a character
        escape. A refusal names where the escape's letter is, or an octal or property
        escape's end."""
        ch = self.take()
        found = (_ESCAPES_IN_CLASS if in_class else _ESCAPES).get(ch)
        if found is not None:
            return found
        if ch == "0" and self.peek() not in _DECIMAL:
            return 0
        if ch == "c" and self.peek().isascii() and self.peek().isalpha():
            return ord(self.take()) % 32
        if ch in ("x", "u"):
            return self.hex_digits(2) if ch == "x" else self.unicode_escape()
        if ch in ("0", "p", "P"):
            raise self.fail("an octal escape is not allowed" if ch == "0" else
                            "a Unicode property escape is not supported")
        self.pos -= 1
        if ch in _DECIMAL:
            raise self.fail("a backreference is not allowed in a class" if in_class else
                            "a backreference is not supported")
        if ch == "k" and not in_class:
            raise self.fail("a named backreference is not supported")
        raise self.fail(f"the escape \\{ch} is not allowed")

    def hex_digits(self, count: int) -> int:
        digits = self.text[self.pos:self.pos + count]
        if len(digits) != count or not set(digits) <= _HEX_DIGITS:
            raise self.fail("an escape needs more hexadecimal digits")
        self.pos += count
        return int(digits, 16)

    def unicode_escape(self) -> int:
        if self.peek() == "{":
            end = self.text.find("}", self.pos)
            digits = self.text[self.pos + 1:end] if end > 0 else ""
            if not digits or not set(digits) <= _HEX_DIGITS or \
                    int(digits, 16) > MAX_CODE_POINT:
                raise self.fail("a \\u{...} escape is not a code point")
            self.pos = end + 1
            return int(digits, 16)
        cp = self.hex_digits(4)
        rest = self.text[self.pos:self.pos + 6]
        if 0xD800 <= cp <= 0xDBFF and rest[:2] == "\\u" and set(rest[2:]) <= _HEX_DIGITS \
                and len(rest) == 6 and 0xDC00 <= int(rest[2:], 16) <= 0xDFFF:
            self.pos += 6     # a surrogate pair is one code point, as with the u flag
            return 0x10000 + ((cp - 0xD800) << 10) + (int(rest[2:], 16) - 0xDC00)
        return cp

    def char_class(self) -> tuple:
        negated = self.accept("^")
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            low = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                high = self.class_atom()
                if isinstance(low, tuple) or isinstance(high, tuple):
                    raise self.fail("a class escape cannot end a range")
                if high < low:
                    raise self.fail("a range is out of order")
                ranges.append((low, high))
            else:
                ranges.extend(low if isinstance(low, tuple) else [(low, low)])
        self.pos += 1
        return ("set", _complement(ranges) if negated else _merge(ranges))

    def class_atom(self) -> int | tuple:
        """One code point, or a class escape's ranges."""
        if not self.peek():
            raise self.fail("a character class is not closed")
        ch = self.take()
        return self.escape(in_class=True) if ch == "\\" else ord(ch)


def _program_size(node: tuple) -> int:
    """Instructions _emit writes for ``node``; each copy of a repeat counts at least one, so
    a repeat of nothing cannot make emitting slow."""
    kind = node[0]
    if kind in ("set", "assert"):
        return 1
    if kind == "cat":
        return sum(_program_size(n) for n in node[1])
    if kind == "alt":
        return sum(_program_size(n) + 2 for n in node[1])
    body, low, high = max(_program_size(node[1]), 1), node[2], node[3]
    return low * body + (body + 2 if high is None else (high - low) * (body + 1))


def _emit(node: tuple, prog: list) -> None:
    """Append ``node``'s instructions to ``prog``: a JUMP goes on at each of its targets (one,
    or two for a split), and is held as None until the end it jumps to is known."""
    kind = node[0]
    if kind in ("set", "assert"):
        prog.append((_SET if kind == "set" else _ASSERT, node[1]))
    elif kind == "cat":
        for sub in node[1]:
            _emit(sub, prog)
    elif kind == "alt":             # split(a, L); a; jmp out; L: split(b, M); b; ...; out:
        jumps = [_split_over(branch, None, prog) for branch in node[1][:-1]]
        _emit(node[1][-1], prog)
        for at in jumps:
            prog[at] = (_JUMP, len(prog))
    else:
        _, body, low, high = node
        for _ in range(low):
            _emit(body, prog)
        if high is None:            # L: split(body, out); body; jmp L; out:
            _split_over(body, (_JUMP, len(prog)), prog)
            return
        splits = []
        for _ in range(high - low):     # each optional copy may be skipped to the end
            splits.append(len(prog))
            prog.append(None)
            _emit(body, prog)
        for at in splits:
            prog[at] = (_JUMP, at + 1, len(prog))


def _split_over(node: tuple, last: tuple | None, prog: list) -> int:
    """Append split(node, past); node; ``last``, where past follows ``last``, and return
    where ``last`` is (a None there is a jump whose end is not known yet)."""
    split = len(prog)
    prog.append(None)
    _emit(node, prog)
    prog.append(last)
    prog[split] = (_JUMP, split + 1, len(prog))
    return len(prog) - 1


def _in_ranges(ranges: tuple, cp: int) -> bool:
    at = bisect.bisect_right(ranges, (cp, MAX_CODE_POINT)) - 1    # the last to start at cp or below
    return at >= 0 and ranges[at][1] >= cp


class Pattern:
    """A JSON Schema pattern: an ECMA-262 regular expression, searched for (not anchored).

    The subset: literals; the escapes \\t \\n \\v \\f \\r \\0 \\cX \\xHH \\uHHHH \\u{H...}
    and escaped syntax characters and '/'; '.'; classes [...] and [^...] with ranges and
    class escapes; \\d \\D \\w \\W \\s \\S; the assertions ^ $ \\b \\B; groups (...) and
    (?:...); alternation; the quantifiers * + ? {n} {n,} {n,m} and their lazy forms (which
    match the same strings). Refused, with the reason, when the schema loads: backreferences,
    lookahead and lookbehind, named groups, Unicode property escapes, counts above
    MAX_PATTERN_REPEAT, programs above MAX_PATTERN_PROGRAM instructions, and whatever
    ECMA-262 itself refuses with the u flag (a lone ']' or '{', an out-of-order range, ...).

    Semantics: ECMA-262's, with the u flag: a Python str is a sequence of code points, and
    the pattern is read and matched over code points, so an astral character is one
    character to '.' and to a class. No flags otherwise: '.' matches anything but the line
    terminators \\n \\r U+2028 U+2029; ^ and $ match only at the very start and end of the
    string (never before a final newline); \\d \\w are ASCII ([0-9], [A-Za-z0-9_]); \\s is
    ECMA's WhiteSpace and LineTerminator, \\b is a \\w boundary.

    Cost: a step over one character visits each instruction at most once, so a match takes
    at most (len(string) + 1) * MAX_PATTERN_PROGRAM instruction visits, and more than
    MAX_PATTERN_WORK refuses the string rather than matching on. Steps are memoised on
    (the set of live threads, the character, the context), so most characters cost one
    dictionary lookup.
    """

    def __init__(self, text: str):
        if len(text) > MAX_PATTERN_CHARS:
            raise SchemaError(f"the pattern is longer than {MAX_PATTERN_CHARS} characters")
        tree = _PatternParser(text).parse()
        size = _program_size(tree) + 4
        if size > MAX_PATTERN_PROGRAM:
            raise SchemaError(f"the pattern needs {size} instructions, more than "
                              f"{MAX_PATTERN_PROGRAM}")
        # A search: "[^]*" first, so a match may start anywhere.
        prog: list = [(_JUMP, 3, 1), (_SET, _ALL), (_JUMP, 0)]
        _emit(tree, prog)
        prog.append((_MATCH,))
        self.text, self._prog, self._match = text, prog, len(prog) - 1
        self._words = any(op[0] == _ASSERT and op[1][0] == _BOUNDARY for op in prog)
        self._memo: dict[tuple, frozenset] = {}
        self._states: dict[frozenset, frozenset] = {}
        self._memo_states = 0

    def search_costed(self, s: str, limit: int) -> tuple[bool, int]:
        """Whether the pattern matches somewhere in ``s``, and the instruction visits that
        took; past ``limit`` visits, PatternTooCostly."""
        work = [0, limit]
        state = self._closure((0,), self._context(s, 0), work)
        for i, ch in enumerate(s):
            if self._match in state:
                return True, work[0]
            ctx = self._context(s, i + 1)
            nxt = self._memo.get((state, ch, ctx))
            if nxt is None:
                nxt = self._step(state, ch, ctx, work)
            else:                # a memoised step is cheaper, never free: a visit a character
                self._charge(work, 1)
            state = nxt
        return self._match in state, work[0]

    def _context(self, s: str, i: int) -> int:
        ctx = (_AT_START if i == 0 else 0) | (_AT_END if i == len(s) else 0)
        if self._words:
            prev, nxt = i > 0 and s[i - 1] in _WORD_CHARS, i < len(s) and s[i] in _WORD_CHARS
            ctx |= (_PREV_WORD if prev else 0) | (_NEXT_WORD if nxt else 0) | \
                   (_BOUNDARY if prev != nxt else 0)
        return ctx

    def _step(self, state: frozenset, ch: str, ctx: int, work: list) -> frozenset:
        cp, prog = ord(ch), self._prog
        moved = [pc + 1 for pc in state if pc != self._match and _in_ranges(prog[pc][1], cp)]
        nxt = self._closure(moved, ctx, work)
        if len(self._memo) >= PATTERN_MEMO_STEPS or self._memo_states >= PATTERN_MEMO_STATES:
            self._memo, self._states, self._memo_states = {}, {}, 0
        # One copy of each state set is kept, so that a memoised step is found by identity:
        # comparing two equal sets of up to MAX_PATTERN_PROGRAM threads would make a step
        # that is charged one visit cost thousands.
        nxt = self._states.setdefault(nxt, nxt)
        self._memo_states += len(nxt)
        self._memo[(state, ch, ctx)] = nxt
        return nxt

    def _closure(self, starts: Iterable[int], ctx: int, work: list) -> frozenset:
        """The instructions that consume a character (or match) reachable from ``starts``
        without consuming one, at a position with context ``ctx``."""
        prog, seen, out, stack = self._prog, set(), [], list(starts)
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            op = prog[pc]
            if op[0] == _JUMP:
                stack += op[1:]
            elif op[0] == _ASSERT:
                if bool(ctx & op[1][0]) == op[1][1]:
                    stack.append(pc + 1)
            else:
                out.append(pc)
        self._charge(work, len(seen) + 1)
        return frozenset(out)

    def _charge(self, work: list, visits: int) -> None:
        """Count ``visits`` in ``work`` (spent, limit); past the limit, PatternTooCostly."""
        work[0] += visits
        if work[0] > work[1]:
            raise PatternTooCostly(f"the string is too costly to match against pattern "
                                   f"{_quote(self.text)}")


# ==== 7. Schema validation ====
# A small JSON Schema validator (draft-07 and 2020-12 keywords real servers use). A schema is
# compiled when its tool loads: a keyword we do not implement, a reference outside the
# document, or a malformed keyword refuses the tool then, so nothing is ever passed silently.
# Validation errors name the JSON pointer of the failing value. What checking one call may
# cost is bounded: a schema's fan-out when it loads, a budget of evaluations per call.

_ANNOTATIONS = frozenset({
    "$schema", "$comment", "title", "description", "default", "examples", "format",
    "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                             "dependentSchemas"})
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SUBSCHEMA_ONE = frozenset({"additionalProperties", "propertyNames", "additionalItems",
                            "contains", "not", "if", "then", "else"})
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                      "multipleOf"})
_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# Each bound, and whether a comparison of the value with it (-1, 0, 1) is outside it.
_RANGE = (("minimum", lambda c: c < 0), ("exclusiveMinimum", lambda c: c <= 0),
          ("maximum", lambda c: c > 0), ("exclusiveMaximum", lambda c: c >= 0))
# What a count is of, and its bounds, by the type of value counted.
_COUNTED = {str: ("minLength", "maxLength", "characters"),
            list: ("minItems", "maxItems", "items"),
            dict: ("minProperties", "maxProperties", "properties")}


def _names_types(value: Any) -> bool:
    names = value if isinstance(value, list) else [value]
    return bool(names) and all(isinstance(n, str) and n in _TYPES for n in names)


def _string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


def _subschemas(key: str, val: Any) -> list[tuple[tuple, Any]]:
    """The subschemas a keyword's value (of its form) holds, each with its place under the
    keyword; an entry of dependencies that is an array of names is none."""
    if key in _SUBSCHEMA_MAPS or key == "dependencies":
        return [((name,), sub) for name, sub in val.items()
                if key != "dependencies" or not _string_list(sub)]
    if key in _SUBSCHEMA_LISTS or (key == "items" and isinstance(val, list)):
        return [((i,), sub) for i, sub in enumerate(val)]
    return [((), val)] if key in _SUBSCHEMA_ONE or key == "items" else []


# The form a keyword's value must have, and what a schema whose value lacks it is told.
# exclusiveMinimum and exclusiveMaximum may also be draft-04's flags on minimum and maximum.
_FORMS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(_SUBSCHEMA_MAPS | {"dependentRequired", "dependencies"},
                    (lambda v: isinstance(v, dict), "is not an object")),
    **dict.fromkeys(_SUBSCHEMA_LISTS, (lambda v: isinstance(v, list) and len(v) > 0,
                                       "is not a non-empty array of schemas")),
    "prefixItems": (lambda v: isinstance(v, list), "is not a non-empty array of schemas"),
    **dict.fromkeys(_NUMERIC, (lambda v: isinstance(v, Num), "is not a number")),
    **dict.fromkeys(("exclusiveMinimum", "exclusiveMaximum"),
                    (lambda v: isinstance(v, (Num, bool)), "is not a number")),
    "multipleOf": (lambda v: isinstance(v, Num) and v.normal()[0] > 0,
                   "is not a positive number"),
    **dict.fromkeys(("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                     "maxProperties", "minContains", "maxContains"),
                    (lambda v: isinstance(v, Num) and v.is_integer() and v.normal()[0] >= 0,
                     "is not a non-negative integer")),
    "type": (_names_types, "names a type that does not exist"),
    "enum": (lambda v: isinstance(v, list), "is not an array"),
    "required": (_string_list, "is not an array of strings"),
    **dict.fromkeys(("pattern", "$ref"), (lambda v: isinstance(v, str), "is not a string")),
    "uniqueItems": (lambda v: isinstance(v, bool), "is not a boolean"),
}
# Every keyword implemented: those above, and those any value of which is compiled or kept.
SCHEMA_KEYWORDS = _ANNOTATIONS | _SUBSCHEMA_ONE | frozenset(_FORMS) | {"items", "const", "$id"}
# Keywords whose check does work for every member or item of the value that no evaluation
# of a subschema pays for (the rest, items or contains, evaluate one for each): a schema
# holding one costs one more for each member, and for each patternProperties regex tried.
_MEMBER_LOOPS = frozenset({"properties", "patternProperties", "additionalProperties",
                           "uniqueItems"})
# Exact integer arithmetic on a value's digits for multipleOf: the quotient has at most as
# many digits as a literal may have.
_EXACT = Context(prec=MAX_NUMBER_LITERAL)


def _pointer(path: Iterable[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


_KINDS = {bool: "boolean", type(None): "null", dict: "object", list: "array", str: "string"}


def _kind(value: Any) -> str:
    if isinstance(value, Num):
        return "integer" if value.is_integer() else "number"
    return _KINDS[type(value)]


def _compare(a: tuple[int, str, int], b: tuple[int, str, int]) -> int:
    """-1, 0 or 1 as the number with normal form ``a`` is below, equal to or above ``b``.
    Exact, and linear in the digits: first the signs, then the position of the leading digit,
    then the digit strings, whose order is the numbers' order once the leading digits line up
    (neither has a trailing zero)."""
    (sa, da, ea), (sb, db, eb) = a, b
    if sa != sb or sa == 0:
        return (sa > sb) - (sa < sb)
    lead_a, lead_b = ea + len(da), eb + len(db)
    if lead_a != lead_b:
        return sa if lead_a > lead_b else -sa
    return sa * ((da > db) - (da < db))


def _compare_count(n: int, bound: Num) -> int:
    """_compare for a length or count against a schema's integer bound (which may be
    1e10000), without building the bound as an integer."""
    return _compare(_normal_form(str(n)), bound.normal())


def _is_multiple(value: tuple[int, str, int], of: tuple[int, str, int]) -> bool:
    """Whether value / of is an integer, for normal forms with ``of`` positive and at most
    MAX_MULTIPLE_OF_DIGITS digits. value / of = (digits / divisor) * 10**shift: no power of
    ten is ever built, however far apart the exponents are (1e10000 and 1e-300)."""
    (sign, digits, exponent), (_, divisor, power) = value, of
    shift = exponent - power
    if sign == 0 or shift < 0:
        # zero is a multiple of anything; with shift < 0, digits has no trailing zero, so it
        # is never a multiple of divisor * 10**-shift
        return sign == 0
    modulus = int(divisor)
    rest = int(_EXACT.remainder(Decimal(digits), Decimal(divisor)))
    return rest * pow(10, shift, modulus) % modulus == 0


def _size(value: Any) -> int:
    """The number of JSON values in ``value``, itself included."""
    members = value.values() if isinstance(value, dict) else value
    return 1 + sum(_size(v) for v in members) if isinstance(value, (dict, list)) else 1


class Schema:
    """A compiled tool input schema. ``check`` takes the raw argument bytes.

    What checking may cost is bounded twice. When the schema loads, the number of
    subschemas one value is checked against through $ref and the combinators is counted and
    refused past MAX_SCHEMA_FAN_OUT. Each call then has MAX_SCHEMA_EVALUATIONS to spend: an
    evaluation of a schema object costs one per keyword that checks anything (at least one),
    one per enum or const value and required name, one per member of the value that its
    keywords visit without evaluating a subschema, and one per LEVELS_PER_EVALUATION levels
    deep in the value; of a boolean schema, one and the same for depth. Spending it all is a
    refusal (CheckTooCostly), so a fan-out that multiplies through items or properties over
    a large array is refused, never run long; nothing is executed either way."""

    def __init__(self, raw: bytes):
        try:
            self.root = parse_json(raw, strict=False)
        except JSONError as exc:
            raise SchemaError(f"input schema is not JSON: {exc}") from None
        if not isinstance(self.root, (dict, bool)):
            raise SchemaError("input schema is not an object")
        self.patterns: dict[str, Pattern] = {}     # each compiled once, by its text
        self._schemas: dict[tuple, Any] = {}        # every compiled subschema, by location
        self._refs: dict[str, tuple] = {}           # each $ref, resolved to a location
        # By the id of each schema object (the tree is kept, so ids stay unique): what one
        # evaluation of it costs (fixed, per member of the value), runs, and where it is
        # (_plan); by the id of each enum and const value, how a mismatch shows it.
        self.plans: dict[int, tuple[int, int, tuple, tuple]] = {}
        self.shown: dict[int, str] = {}
        self._compile(self.root, ())
        self._check_refs()

    def _check_refs(self) -> None:
        """Every $ref names a subschema we compiled, and following $refs and the keywords
        that apply to the same value (allOf, not, if, ...) never comes back to where it
        started, nor runs longer than MAX_SCHEMA_CHAIN: a schema that could recurse
        without consuming input is refused here, not discovered while checking. Nor does
        one value get checked against more than MAX_SCHEMA_FAN_OUT subschemas that way."""
        for ref, target in self._refs.items():
            if target not in self._schemas:
                raise SchemaError(f"$ref {_quote(ref)} does not name a schema")
        longest: dict[tuple, int | None] = {}
        fan: dict[tuple, int] = {}
        for start in self._schemas:
            self._chain(start, longest, fan)
        # The depth of a chain is bounded, its breadth is not: 31 levels each an allOf of two
        # $refs to the next, 1.3 KB, check every value 2^32 times. The first location the
        # walk finished past the limit is named.
        for at, found in fan.items():
            if found > MAX_SCHEMA_FAN_OUT:
                raise SchemaError(
                    f"the schema at #{_pointer(at)} makes one value be checked against more "
                    f"than {MAX_SCHEMA_FAN_OUT} subschemas (through $ref, allOf, anyOf, oneOf, "
                    "not, if, then, else and dependentSchemas)")

    def _chain(self, at: tuple, longest: dict, fan: dict) -> int:
        """The longest chain from ``at`` through the keywords that apply to the same value;
        ``longest`` holds it for each location done, and None for each on the way to it.
        ``fan`` gets, for each location done, how many subschemas one value checked against
        it is checked against through those keywords: a count over the graph, never a walk
        of every path."""
        if at in longest:
            if longest[at] is None:
                raise SchemaError(f"the schema at #{_pointer(at)} refers to itself through "
                                  "$ref without consuming input")
            return longest[at]
        longest[at] = None
        # The subschemas that apply to the same value as the one at ``at``.
        node, children = self._schemas[at], []
        if isinstance(node, dict):
            children = [self._refs[node["$ref"]]] if "$ref" in node else []
            for key in ("allOf", "anyOf", "oneOf", "not", "if", "then", "else",
                        "dependentSchemas", "dependencies"):
                if key in node:
                    children += [at + (key,) + place for place, _ in _subschemas(key, node[key])]
        depth = max((1 + self._chain(nxt, longest, fan) for nxt in children), default=0)
        if depth > MAX_SCHEMA_CHAIN:
            raise SchemaError(f"the schema at #{_pointer(at)} chains more than "
                              f"{MAX_SCHEMA_CHAIN} references and combinators")
        longest[at] = depth
        fan[at] = 1 + sum(fan[nxt] for nxt in children)
        return depth

    # -- compiling: every keyword is known and well formed, every $ref resolves locally --

    def _compile(self, node: Any, at: tuple) -> None:
        where = "#" + _pointer(at)
        if not isinstance(node, (bool, dict)):
            raise SchemaError(f"schema at {where} is not an object or boolean")
        self._schemas[at] = node
        if isinstance(node, bool):
            return
        for key, val in node.items():
            if key not in SCHEMA_KEYWORDS:
                raise SchemaError(f"schema at {where} uses {_quote(key)}, "
                                  "a keyword this validator does not implement")
            self._keyword(key, val, at + (key,))
        self.plans[id(node)] = _plan(node, at)

    def _keyword(self, key: str, val: Any, at: tuple) -> None:
        where = "#" + _pointer(at)
        form = _FORMS.get(key)
        if form and not form[0](val):
            raise SchemaError(f"{where} {form[1]}")
        if key in ("const", "enum"):
            self.shown[id(val)] = _show(val) if key == "const" else \
                ", ".join(_show(o) for o in val)
        elif key == "pattern":
            self._regex(val, where)
        elif key == "$ref":
            self._refs[val] = self._resolve(val)
        elif key == "$id" and at != ("$id",):
            raise SchemaError(f"{where}: an $id inside the schema is not supported")
        elif key == "multipleOf" and len(val.normal()[1]) > MAX_MULTIPLE_OF_DIGITS:
            # Checking one needs exact division by its digits: bounded, they stay cheap.
            raise SchemaError(f"{where}: multipleOf has {len(val.normal()[1])} significant "
                              f"digits, more than the {MAX_MULTIPLE_OF_DIGITS} checked")
        elif key == "dependentRequired":
            for name, dep in val.items():
                if not _string_list(dep):
                    raise SchemaError(f"{where}/{name} is not an array of strings")
        for place, sub in _subschemas(key, val):
            if key == "patternProperties":
                self._regex(place[0], where)
            self._compile(sub, at + place)

    def _regex(self, pattern: str, where: str) -> None:
        """Compile the pattern once per schema (by its text), or raise SchemaError naming
        where it is and why it is refused."""
        if pattern not in self.patterns:
            try:
                self.patterns[pattern] = Pattern(pattern)
            except SchemaError as exc:
                raise SchemaError(f"{where}: pattern does not compile: {_quote(pattern)}: "
                                  f"{exc}") from None

    def _resolve(self, ref: str) -> tuple:
        """The location a local reference names (RFC 6901 within this document).
        Anything else is refused: no URL is ever loaded."""
        if not ref.startswith("#"):
            raise SchemaError(f"$ref {_quote(ref)} is outside the schema; "
                              "only references within the schema are resolved")
        frag = urllib.parse.unquote(ref[1:])
        if frag and not frag.startswith("/"):
            raise SchemaError(f"$ref {_quote(ref)} is not a JSON pointer")
        found = walk_pointer(self.root, frag)
        if found is None:
            raise SchemaError(f"$ref {_quote(ref)} does not resolve")
        return found[1]


    # -- validating --

    def check(self, raw: bytes, value: Any = NOT_PARSED) -> Any:
        """Parse strict JSON arguments (unless ``value`` is their strict parse, which is only
        read) and validate them; returns the parsed value. Raises JSONError for bytes that
        are not usable JSON, SchemaError for a mismatch (CheckTooCostly when checking spent
        the call's budget)."""
        if value is NOT_PARSED:
            value = parse_json(raw)
        try:
            errors = _Check(self, MAX_SCHEMA_EVALUATIONS).failures(self.root, value, [])
        except RecursionError:      # a refusal, never an acceptance
            raise SchemaError("the arguments are nested too deeply to check against this "
                              "schema") from None
        except CheckTooCostly as exc:
            raise CheckTooCostly(exc.at or (), exc.path) from None
        if errors:
            shown = "; ".join(f"at '{p}': {d}" for p, d in errors)
            raise SchemaError(shown + (f"; and {errors.more} more" if errors.more else ""))
        return value

    def test(self, value: Any, budget: int) -> tuple[bool, int]:
        """Whether a parsed value validates, spending from ``budget`` (what is left is
        returned): a rule's conditions share one call's budget (section 20). Raises
        CheckTooCostly when the budget runs out, never answering either way."""
        check = _Check(self, budget)
        try:
            errors = check.failures(self.root, value, [])
        except RecursionError:
            raise CheckTooCostly((), "") from None
        return not errors, check.left

    def located(self) -> list[tuple[tuple, Any]]:
        """Every subschema compiled (each schema object or boolean that checking may
        evaluate, and $defs no $ref names), by location, the root first."""
        return list(self._schemas.items())

    def referenced(self, at: tuple) -> bool:
        """Whether a $ref names the subschema at ``at``."""
        return at in self._refs.values()

    def target(self, ref: str) -> Any:
        """The subschema a $ref (compiled) names."""
        return self._schemas[self._refs[ref]]


class _Check:
    """One check of a value against a compiled Schema, which every call of its tool shares:
    what is left of the budget this check spends (see Schema), and the keys (``key``) given
    to the arrays and objects compared so far. Its check_ methods are the keyword checks,
    one for each keyword or family of keywords read together (_CHECKS)."""

    def __init__(self, schema: Schema, budget: int):
        self.schema, self.left = schema, budget
        self._keys: dict[int, int] = {}
        self._interned: dict[tuple, int] = {}

    def failures(self, node: Any, value: Any, path: list) -> _Failures:
        """How the value at ``path`` fails ``node``: none when it passes."""
        errors = _Failures()
        self.validate(node, value, path, errors)
        return errors

    def validate(self, node: Any, value: Any, path: list, errors: _Failures) -> None:
        if node is True or node is False:
            self.spend(1 + len(path) // LEVELS_PER_EVALUATION, path)
            if node is False:
                errors.add(path, "no value is allowed here")
            return
        try:
            fixed, per_member, plan, at = self.schema.plans[id(node)]
            # deep in a value, each member's path (a list) is copied: that costs too
            fixed += len(path) // LEVELS_PER_EVALUATION
            loops = per_member and type(value) in (list, dict)
            self.spend(fixed + per_member * len(value) if loops else fixed, path)
            for check, kind, val in plan:
                if isinstance(value, kind):
                    check(self, node, val, value, path, errors)
        except CheckTooCostly as exc:
            # Spent inside this schema object or a boolean schema under it: name this one.
            # Never caught on the way up (not, anyOf, ...): it is never read as a mismatch.
            exc.at = at if exc.at is None else exc.at
            raise

    def spend(self, units: int, path: list) -> None:
        self.left -= units
        if self.left < 0:
            raise CheckTooCostly(None, _pointer(path))

    def found(self, pattern: str, text: str, path: list, errors: _Failures) -> bool:
        """Whether ``pattern`` (compiled at load) matches in ``text``, the matching charged
        to the call's budget. A string too costly to match alone is a failure recorded here,
        and counts as found so nothing else is reported for it: it is refused, never let
        through as unmatched. One that would spend what is left of the budget spends it."""
        left = max(0, self.left) * PATTERN_VISITS_PER_EVALUATION
        try:
            found, work = self.schema.patterns[pattern].search_costed(
                text, min(MAX_PATTERN_WORK, left))
        except PatternTooCostly as exc:
            if left < MAX_PATTERN_WORK:
                raise CheckTooCostly(None, _pointer(path)) from None
            errors.add(path, str(exc))
            return True
        self.spend(work // PATTERN_VISITS_PER_EVALUATION, path)
        return found

    def key(self, value: Any) -> Any:
        """A key that is equal for two values exactly when they are equal as JSON: numbers by
        exact value (their normal forms), objects without regard to order. Arrays and objects
        are interned to a number once per call (by the id of the parsed value or the schema's
        value, alive for the call), so comparing the same array again (uniqueItems, enum,
        const) never walks or hashes its contents again."""
        kind = type(value)
        if kind is Num:
            return ("n",) + value.normal()
        if kind is not list and kind is not dict:
            return (kind.__name__, value)
        found = self._keys.get(id(value))
        if found is None:
            if kind is list:
                shape = ("a",) + tuple(self.key(v) for v in value)
            else:   # names are distinct, so sorting never compares two keys
                shape = ("o",) + tuple(sorted((k, self.key(v)) for k, v in value.items()))
            found = self._keys[id(value)] = self._interned.setdefault(shape, len(self._interned))
        return found


    def check_type(self, node, want, value, path, errors):
        names = want if isinstance(want, list) else [want]
        kind = _kind(value)
        if kind not in names and not (kind == "integer" and "number" in names):
            errors.add(path, f"got {kind}, want {' or '.join(names)}")

    def check_enum(self, node, options, value, path, errors):
        key = self.key(value)
        if all(self.key(o) != key for o in options):
            errors.add(path, "value must be one of " + self.schema.shown[id(options)])

    def check_const(self, node, const, value, path, errors):
        if self.key(value) != self.key(const):
            errors.add(path, f"value must be {self.schema.shown[id(const)]}")

    def check_range(self, node, _unused, value, path, errors):
        v = value.normal()
        for key, outside in _RANGE:
            bound = node.get(key)
            if bound is True:  # draft-04 spelling: the flag makes minimum or maximum exclusive
                bound = node.get("minimum" if key == "exclusiveMinimum" else "maximum")
            if isinstance(bound, Num) and outside(_compare(v, bound.normal())):
                errors.add(path, f"{key}: got {value.text}, want {bound.text}")

    def check_multiple(self, node, m, value, path, errors):
        # Exact division reads every digit of the value: a long one costs more evaluations.
        self.spend(len(value.normal()[1]) // DIGITS_PER_EVALUATION, path)
        if not _is_multiple(value.normal(), m.normal()):
            errors.add(path, f"multipleOf: got {value.text}, want a multiple of {m.text}")

    def check_pattern(self, node, pattern, value, path, errors):
        if not self.found(pattern, value, path, errors):
            errors.add(path, f"does not match pattern {_quote(pattern)}")

    def check_counts(self, node, _unused, value, path, errors):
        low, high, noun = _COUNTED[type(value)]
        n = len(value)
        for key, outside in ((low, -1), (high, 1)):     # below the least, above the most
            if key in node and _compare_count(n, node[key]) == outside:
                errors.add(path, f"{key}: got {n} {noun}, want {node[key].text}")

    def check_required(self, node, names, value, path, errors):
        missing = [name for name in names if name not in value]
        self.spend(len(missing), path)        # a failure costs more to report than to find
        for name in missing:
            errors.add(path, f"missing property {_quote(name)}")

    def check_properties(self, node, _unused, value, path, errors):
        """properties, patternProperties and additionalProperties together, as they
        interact."""
        props = node.get("properties", {})
        patterns = node.get("patternProperties", {})
        extra = node.get("additionalProperties", True)
        unexpected = []
        for name, item in value.items():
            matched = name in props
            if matched:
                self.validate(props[name], item, path + [name], errors)
            for pat, sub in patterns.items():
                if self.found(pat, name, path + [name], errors):
                    matched = True
                    self.validate(sub, item, path + [name], errors)
            if not matched and extra is False:
                unexpected.append(name)
            elif not matched and extra is not True:
                self.validate(extra, item, path + [name], errors)
        if unexpected:
            names = ", ".join(_quote(n) for n in unexpected)
            errors.add(path, f"additional properties {names} not allowed")

    def check_property_names(self, node, sub, value, path, errors):
        for name in value:
            if self.failures(sub, name, path):
                errors.add(path, f"property name {_quote(name)} is not allowed")

    def check_items(self, node, _unused, value, path, errors):
        """prefixItems, items (either draft's form) and additionalItems together."""
        items = node.get("items", True)
        if isinstance(items, list):            # draft-07 tuple form
            prefix, rest = items, node.get("additionalItems", True)
        else:
            prefix, rest = node.get("prefixItems", []), items
        for i, item in enumerate(value):
            if i >= len(prefix) and rest is False:
                errors.add(path, f"array has {len(value)} items, at most {len(prefix)} allowed")
                return
            self.validate(prefix[i] if i < len(prefix) else rest, item, path + [i], errors)

    def check_contains(self, node, sub, value, path, errors):
        n = sum(1 for i, item in enumerate(value) if not self.failures(sub, item, path + [i]))
        low = node.get("minContains", _ONE)
        if _compare_count(n, low) < 0:
            errors.add(path, f"contains: {n} items match, want at least {low.text}")
        if "maxContains" in node and _compare_count(n, node["maxContains"]) > 0:
            errors.add(path, f"contains: {n} items match, want at most {node['maxContains'].text}")

    def check_unique(self, node, flag, value, path, errors):
        seen: set = set()
        for i, item in enumerate(value if flag else ()):   # false: nothing to check
            h = self.key(item)
            if h in seen:
                errors.add(path + [i], "uniqueItems: a repeated item")
                return
            seen.add(h)

    def check_all_of(self, node, subs, value, path, errors):
        for sub in subs:
            self.validate(sub, value, path, errors)

    def check_any_of(self, node, subs, value, path, errors):
        if all(self.failures(sub, value, path) for sub in subs):
            errors.add(path, "does not match any schema of anyOf")

    def check_one_of(self, node, subs, value, path, errors):
        n = sum(1 for sub in subs if not self.failures(sub, value, path))
        if n != 1:
            errors.add(path, f"matches {n} schemas of oneOf, want exactly one")

    def check_not(self, node, sub, value, path, errors):
        if not self.failures(sub, value, path):
            errors.add(path, "matches a schema it must not match")

    def check_if(self, node, cond, value, path, errors):
        branch = node.get("else") if self.failures(cond, value, path) else node.get("then")
        if branch is not None:
            self.validate(branch, value, path, errors)

    def check_ref(self, node, ref, value, path, errors):
        self.validate(self.schema.target(ref), value, path, errors)

    def check_dependent(self, node, deps, value, path, errors):
        for name, dep in deps.items():
            if name in value and isinstance(dep, list):
                for need in dep:
                    if need not in value:
                        errors.add(path, f"property {_quote(need)} is required with {_quote(name)}")
            elif name in value:
                self.validate(dep, value, path, errors)


class _Failures(list):
    """The failures of one check, as (pointer, detail): the first MAX_SCHEMA_ERRORS kept and
    the rest only counted. A check may fail hundreds of thousands of times within its budget,
    each detail quoting a 10,000-character number; holding them all would take gigabytes."""
    more = 0        # the failures past the first MAX_SCHEMA_ERRORS

    def add(self, path: list, detail: str) -> None:
        """Record that the value at ``path`` fails, for ``detail``."""
        if len(self) < MAX_SCHEMA_ERRORS:
            self.append((_pointer(path), detail))
        else:
            self.more += 1


_ARRAY_INDEX = re.compile("0|[1-9][0-9]*")


def walk_pointer(doc: Any, pointer: str) -> tuple[Any, tuple] | None:
    """The value a JSON Pointer (RFC 6901, such as "/a/0") names in ``doc``, and its path
    there as keys and indexes; None where it names nothing. An index is read only when it has
    no more digits than the array's length: no long digit string is ever converted."""
    node, at = doc, ()
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node, at = node[part], at + (part,)
        elif isinstance(node, list) and _ARRAY_INDEX.fullmatch(part) and \
                len(part) <= len(str(len(node))) and int(part) < len(node):
            node, at = node[int(part)], at + (int(part),)
        else:
            return None
    return node, at


_ONE = Num("1")         # the matching items contains wants, unless minContains says


def _show(value: Any) -> str:
    return truncate(sanitize(encode_canonical(value).decode("utf-8")), VALUE_SHOWN)


# Each keyword that constrains a value (the rest are annotations, or read by another's
# check), and its check, run only on a value of the type it constrains (object: any).
# Keywords read together share one check, run once where the first of them stands in the
# schema object: the bounds, the lengths and counts, the property family, the item family.
_CHECKS: dict[str, tuple[Callable, type]] = {
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
                    (_Check.check_range, Num)),
    **{key: (_Check.check_counts, kind) for kind, keys in _COUNTED.items() for key in keys[:2]},
    **dict.fromkeys(("properties", "patternProperties", "additionalProperties"),
                    (_Check.check_properties, dict)),
    **dict.fromkeys(("items", "prefixItems", "additionalItems"), (_Check.check_items, list)),
    "type": (_Check.check_type, object), "enum": (_Check.check_enum, object),
    "const": (_Check.check_const, object), "multipleOf": (_Check.check_multiple, Num),
    "pattern": (_Check.check_pattern, str), "required": (_Check.check_required, dict),
    "propertyNames": (_Check.check_property_names, dict),
    "contains": (_Check.check_contains, list), "uniqueItems": (_Check.check_unique, list),
    "allOf": (_Check.check_all_of, object), "anyOf": (_Check.check_any_of, object),
    "oneOf": (_Check.check_one_of, object), "not": (_Check.check_not, object),
    "if": (_Check.check_if, object), "$ref": (_Check.check_ref, object),
    **dict.fromkeys(("dependentRequired", "dependencies", "dependentSchemas"),
                    (_Check.check_dependent, dict)),
}


def _plan(node: dict, at: tuple) -> tuple[int, int, tuple, tuple]:
    """What one evaluation of the schema object at ``at`` costs, fixed (one per keyword that
    checks anything, at least one, and one per value its keywords compare with or name they
    require) and per member of the value when a keyword loops over them (one, and one per
    patternProperties regex); the checks it runs, in order: (check, the type of value it
    constrains, the keyword's value); and ``at``, named when checking runs out of budget."""
    fixed = max(1, sum(1 for key in node if key in _CHECKS)) + len(node.get("required", ()))
    fixed += sum(_size(o) for o in node.get("enum", ()))
    fixed += _size(node["const"]) if "const" in node else 0
    for key in ("dependentRequired", "dependencies"):
        fixed += sum(len(dep) for dep in node.get(key, {}).values() if isinstance(dep, list))
    per_member = 0 if _MEMBER_LOOPS.isdisjoint(node) else \
        1 + len(node.get("patternProperties", ()))
    checks: dict = {}
    for key, val in node.items():
        entry = _CHECKS.get(key)
        if entry:       # a check shared by keywords once; dependent* each, by their keyword
            checks.setdefault(key if entry[0] is _Check.check_dependent else entry,
                              (*entry, val))
    return fixed, per_member, tuple(checks.values()), at


def compile_schema(raw: bytes) -> Schema:
    """Compile a tool's input schema, refusing what this validator cannot check."""
    return Schema(raw)


# ==== 8. Time and records ====
# Every timestamp is stored as RFC 3339 UTC text with microseconds, fixed width, so it sorts.
# Durations are written as the configuration writes them: 15s, 10m, 1h30m, 300ms, 0s.
# Records are small frozen dataclasses read from, and written to, the store.
# No dataclass here has a generated __repr__ (repr=False): nothing the proxy writes
# shows one (what it prints goes through its own encoder or sanitize), and each
# generated method is compiled when the module loads, at every start.

Clock = "Callable[[], float]"        # seconds since the epoch
NANOS = 1_000_000_000                # a tool spec's timeout is hashed in integer nanoseconds
_DURATION = re.compile(r"(?:([0-9]+)h)?(?:([0-9]+)m(?!s))?(?:([0-9]+(?:\.[0-9]+)?)s)?"
                       r"(?:([0-9]+)ms)?")


def fmt_time(t: float) -> str:
    d = _dt.datetime.fromtimestamp(t, _dt.timezone.utc)
    return "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ" % (d.year, d.month, d.day, d.hour, d.minute,
                                                    d.second, d.microsecond)


def fmt_time_s(t: float) -> str:
    """Whole seconds, for text a model or an operator reads."""
    return _dt.datetime.fromtimestamp(int(t), _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parse_duration(text: str) -> float:
    """Seconds in a duration such as 15s, 10m, 1h30m, 1.5s, 300ms or 0s."""
    if isinstance(text, str) and text.startswith("-"):
        raise ValueError(f"duration {text!r} is negative")
    m = _DURATION.fullmatch(text) if isinstance(text, str) and text else None
    if not m or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration such as 15s, 10m, 1h30m or 300ms")
    h, mins, secs, ms = m.groups()
    return int(h or 0) * 3600 + int(mins or 0) * 60 + float(secs or 0) + int(ms or 0) / 1000


def fmt_duration(seconds: float) -> str:
    """The spelling of ``seconds`` that parse_duration reads back (to the microsecond)."""
    micros = round(seconds * 1_000_000)
    if micros <= 0:
        return "0s"
    if micros < 1_000_000 and micros % 1000 == 0:
        return f"{micros // 1000}ms"
    whole, frac = divmod(micros, 1_000_000)
    hours, rest = divmod(whole, 3600)
    mins, secs = divmod(rest, 60)
    out = (f"{hours}h" if hours else "") + (f"{mins}m" if mins else "")
    if secs or frac:
        out += (f"{secs}.{frac:06d}".rstrip("0") if frac else str(secs)) + "s"
    return out


SPEC_CACHE_SIZE = 1024                # tool specs whose canonical form is kept
LIMITS_CACHE_SIZE = 64                # limits records whose parse is kept


def _kept(cache: dict, key: Any, make: Callable[[], Any], size: int) -> Any:
    """``make()``, worked out once per ``key`` while ``cache`` holds fewer than ``size``
    entries (then it is emptied): every cache of values derived from a frozen record."""
    found = cache.get(key)
    if found is None:
        found = make()
        if len(cache) >= size:
            cache.clear()
        cache[key] = found
    return found


@dataclasses.dataclass(frozen=True, repr=False)
class ToolSpec:
    """What a tool is. Its canonical JSON is hashed into every approval for it."""
    name: str
    description: str
    input_schema: bytes
    side_effect: str
    timeout: float
    terminal: bool = False

    def as_value(self) -> dict:
        return {"name": self.name, "description": self.description,
                "input_schema": parse_json(self.input_schema, strict=False),
                "side_effect": self.side_effect,
                "timeout": Num(str(round(self.timeout * NANOS))),     # integer nanoseconds
                **({"terminal": True} if self.terminal else {})}

    def canonical(self) -> bytes:
        """Its canonical JSON, worked out once per spec: every run and step names it."""
        return _kept(_SPEC_FORMS, self, lambda: encode_canonical(self.as_value()),
                     SPEC_CACHE_SIZE)

    def hash(self) -> str:
        """The hash of its canonical JSON, worked out once per spec too."""
        return _kept(_SPEC_HASHES, self, lambda: sha256_hex(self.canonical()), SPEC_CACHE_SIZE)

    def policy_form(self) -> "ToolSpec":
        """The spec as a policy is handed it, its input schema in policy form (policy_json),
        worked out once."""
        return _kept(_SPEC_POLICY_FORMS, self, lambda: dataclasses.replace(
            self, input_schema=policy_json(self.input_schema, False)), SPEC_CACHE_SIZE)

    @classmethod
    def from_json(cls, raw: bytes) -> "ToolSpec":
        doc = read_own(raw)
        return cls(doc["name"], doc["description"], encode_canonical(doc["input_schema"]),
                   doc["side_effect"], int(doc["timeout"].text) / NANOS,
                   doc.get("terminal", False))


_SPEC_FORMS: dict[ToolSpec, bytes] = {}
_SPEC_HASHES: dict[ToolSpec, str] = {}
_SPEC_POLICY_FORMS: dict[ToolSpec, ToolSpec] = {}


@dataclasses.dataclass(frozen=True, repr=False)
class ToolRequest:
    """One request to execute: the exact argument bytes for one step of one run, and their
    strict parse when the call made it (only read: the request is one call's own)."""
    run_id: str
    step_id: str
    spec: ToolSpec
    args: bytes
    value: Any = dataclasses.field(default=NOT_PARSED, compare=False)

    def parsed(self) -> Any:
        """The arguments' strict parse: the one the call made, else made now."""
        return parse_json(self.args) if self.value is NOT_PARSED else self.value

    def as_value(self) -> dict:
        return {"run_id": self.run_id, "step_id": self.step_id, "spec": self.spec.as_value(),
                "args": self.parsed()}

    def record(self) -> str:
        """The request as stored with an approval: the arguments byte for byte."""
        spec = self.spec.as_value()
        spec["input_schema"] = RawJSON(encode_canonical(spec["input_schema"]))
        return dump_json({"run_id": self.run_id, "step_id": self.step_id, "spec": spec,
                          "args": RawJSON(self.args)})

    @classmethod
    def from_record(cls, text: str) -> "ToolRequest":
        doc, spans = read_members(text.encode("utf-8"))
        return cls(doc["run_id"], doc["step_id"], ToolSpec.from_json(spans["spec"]), spans["args"])


@dataclasses.dataclass(frozen=True, repr=False)
class PolicyDecision:
    """A policy's answer. ``capability`` and ``presentation`` are JSON bytes (or empty)."""
    outcome: str
    reason: str = ""
    kind: str = ""
    capability: bytes = b""
    presentation: bytes = b""


def need_approval(kind: str, reason: str, capability: Any, presentation: Any) -> PolicyDecision:
    """A require_approval decision with the two values encoded as JSON."""
    def enc(v: Any) -> bytes:
        return b"{}" if v is None else v if isinstance(v, bytes) else dump_json(v).encode()
    return PolicyDecision("require_approval", reason, kind, enc(capability), enc(presentation))


def approval_hash(kind: str, capability: bytes, presentation: bytes, request: ToolRequest) -> str:
    """SHA-256 of the canonical JSON of everything an approval binds: its kind, capability and
    presentation, and the request (run, step, the whole tool spec, the arguments). A value
    that will not encode raises; there is never a substitute hash."""
    doc = {"capability": parse_json(capability or b"{}", max_depth=RECORD_DEPTH), "kind": kind,
           "presentation": parse_json(presentation or b"{}", max_depth=RECORD_DEPTH),
           "request": request.as_value()}
    return sha256_hex(encode_canonical(doc))


@dataclasses.dataclass(frozen=True, repr=False)
class Limits:
    """Per-run limits; a TTL of 0 means no expiry."""
    max_steps: int = 50
    max_consecutive_tool_failures: int = 3
    loop_threshold: int = 3
    approval_ttl: float = 0.0
    grant_ttl: float = 0.0

    def record(self) -> str:
        """Its record, written once per limits (every run of a proxy records the same)."""
        return _kept(_LIMITS_WRITTEN, self, lambda: dump_json({
            **dataclasses.asdict(self), "approval_ttl": fmt_duration(self.approval_ttl),
            "grant_ttl": fmt_duration(self.grant_ttl)}), LIMITS_CACHE_SIZE)

    @classmethod
    def from_record(cls, text: str) -> "Limits":
        """The limits a run records (read once per text: every run of a proxy has the
        same, and every read of a run reads them)."""
        def read() -> "Limits":
            d = loads_own(text)
            return cls(d["max_steps"], d["max_consecutive_tool_failures"], d["loop_threshold"],
                       parse_duration(d.get("approval_ttl", "0s")),
                       parse_duration(d.get("grant_ttl", "0s")))
        return _kept(_LIMITS_READ, text, read, LIMITS_CACHE_SIZE)

    def validate(self) -> None:
        for name in ("max_steps", "max_consecutive_tool_failures", "loop_threshold"):
            if getattr(self, name) <= 0:
                raise ValueError(f"limits: {name} must be positive")
        if self.approval_ttl < 0 or self.grant_ttl < 0:
            raise ValueError("limits: a TTL cannot be negative")


_LIMITS_READ: dict[str, "Limits"] = {}
_LIMITS_WRITTEN: dict["Limits", str] = {}


@dataclasses.dataclass(frozen=True, repr=False)
class Run:
    """A run as the runs table holds it."""
    id: str
    goal: str
    status: str
    reason: str
    reason_detail: str
    limits: Limits
    step_count: int
    created_at: str
    finished_at: str
    result_json: str
    lease_owner: str
    lease_expires_at: str


@dataclasses.dataclass(frozen=True, repr=False)
class Step:
    """A step as the steps table holds it: one proposal of a run and what became of it."""
    id: str
    run_id: str
    idx: int
    status: str
    decision: dict | None          # parsed, numbers plain; exact args are in ``args``
    args: bytes                    # the decision's argument bytes as recorded
    policy: dict | None
    observation: dict | None
    observation_hash: str
    started_at: str
    finished_at: str
    spec_hash: str
    policy_id: str

    @property
    def obs_kind(self) -> str:
        return (self.observation or {}).get("kind", "")

    @property
    def obs_content(self) -> dict:
        content = (self.observation or {}).get("content")
        return content if isinstance(content, dict) else {}


@dataclasses.dataclass(frozen=True, repr=False)
class Approval:
    """An approval as the approvals table holds it, bound to its request by hash."""
    id: str
    run_id: str
    step_id: str
    kind: str
    capability: bytes
    presentation: bytes
    request_json: str
    hash: str
    status: str
    created_at: str
    decided_at: str
    decided_by: str
    note: str
    expires_at: str

    def request(self) -> ToolRequest:
        return ToolRequest.from_record(self.request_json)

    def verify(self) -> None:
        """Refuse an approval whose stored hash is not the hash of its stored contents."""
        try:
            again = approval_hash(self.kind, self.capability, self.presentation, self.request())
        except (ProxyError, KeyError, TypeError, ValueError) as exc:
            raise ApprovalHashMismatch(f"approval {self.id} could not be decoded: {exc}") from None
        if not same_digest(again, self.hash):
            raise ApprovalHashMismatch(f"approval {self.id}: the stored hash does not match "
                                       "its recorded request")


@dataclasses.dataclass(frozen=True, repr=False)
class RunView:
    """What a policy is shown of the run it decides in."""
    run: Run
    steps: list[Step]
    approvals: list[Approval]


# ==== 9. Policy ====
# A policy maps a request and a view of its run to allow, require_approval, deny or abort.
# The default decides by the tool's side-effect class alone.

class SideEffectPolicy:
    """Decide by side-effect class; a class missing from the map is denied."""

    policy_id = ""

    def __init__(self, outcomes: dict[str, str] | None = None):
        self.outcomes = dict(DEFAULT_POLICY if outcomes is None else outcomes)

    def evaluate(self, request: ToolRequest, view: RunView) -> PolicyDecision:
        cls = request.spec.side_effect
        outcome = self.outcomes.get(cls)
        if outcome is None:
            return PolicyDecision("deny", f'no policy for side effect "{cls}"')
        reason = f"side effect {cls} is {outcome} by policy"
        if outcome != "require_approval":
            return PolicyDecision(outcome, reason)
        cap = b'{"args":' + request.args + b',"tool":' + \
            json.dumps(request.spec.name).encode() + b"}"
        return PolicyDecision(outcome, reason, cls, cap, cap)


def check_policy_id(pid: str) -> str:
    """A policy identity is short, UTF-8, and free of control characters."""
    size = len(pid.encode("utf-8", "surrogatepass"))
    if size > MAX_POLICY_ID_BYTES:
        raise ValueError(f"policy identity is {size} bytes, "
                         f"more than {MAX_POLICY_ID_BYTES}")
    for ch in pid:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            raise ValueError(f"policy identity holds the control character U+{ord(ch):04X}")
    return pid


# ==== 10. The store ====
# One SQLite file. Every state change is one BEGIN IMMEDIATE transaction holding the row
# writes and their audit events; events form a SHA-256 hash chain across all runs. Status
# changes are compare-and-set inside the transaction, so two processes never both win.
# Every commit is on disk before anything resting on it leaves: synced by SQLite itself
# (synchronous=FULL) before Store.tx returns, or, for the writes an answer follows, by
# Store.sync, which the host's writer runs before each message (one sync for them all).
# Another process can read such a commit before it is synced (a second proxy, an operator's
# view) and act on it; a power loss then takes it back, and what remains is the safe side:
# a call's start is always synced, so its outcome reads as unknown and an operator decides.
# The file is created 0600; a symbolic link, a file others can write, a schema holding
# triggers or views, and a schema from another version are refused.

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1: runs, their steps, approvals, the event chain, and the tool specs runs refer to
        """CREATE TABLE runs (
            id TEXT PRIMARY KEY, goal TEXT NOT NULL, status TEXT NOT NULL,
            reason TEXT NOT NULL DEFAULT '', reason_detail TEXT NOT NULL DEFAULT '',
            limits_json TEXT NOT NULL, step_count INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL, started_at TEXT NOT NULL DEFAULT '',
            finished_at TEXT NOT NULL DEFAULT '', result_json TEXT NOT NULL DEFAULT '',
            active_ms INTEGER NOT NULL DEFAULT 0,
            lease_owner TEXT NOT NULL DEFAULT '', lease_expires_at TEXT NOT NULL DEFAULT '')""",
        """CREATE TABLE steps (
            id TEXT PRIMARY KEY, run_id TEXT NOT NULL REFERENCES runs(id),
            idx INTEGER NOT NULL, status TEXT NOT NULL,
            decision_json TEXT NOT NULL DEFAULT '', policy_json TEXT NOT NULL DEFAULT '',
            observation_json TEXT NOT NULL DEFAULT '', observation_hash TEXT NOT NULL DEFAULT '',
            started_at TEXT NOT NULL, finished_at TEXT NOT NULL DEFAULT '',
            spec_hash TEXT NOT NULL DEFAULT '', policy_id TEXT NOT NULL DEFAULT '',
            UNIQUE(run_id, idx))""",
        """CREATE TABLE events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL REFERENCES runs(id),
            step_id TEXT NOT NULL DEFAULT '', at TEXT NOT NULL, type TEXT NOT NULL,
            payload_json TEXT NOT NULL, hash TEXT NOT NULL DEFAULT '')""",
        "CREATE INDEX events_run ON events(run_id, seq)",
        """CREATE TABLE approvals (
            id TEXT PRIMARY KEY, run_id TEXT NOT NULL REFERENCES runs(id),
            step_id TEXT NOT NULL, kind TEXT NOT NULL, capability_json TEXT NOT NULL,
            presentation_json TEXT NOT NULL, request_json TEXT NOT NULL, hash TEXT NOT NULL,
            status TEXT NOT NULL, created_at TEXT NOT NULL,
            decided_at TEXT NOT NULL DEFAULT '', decided_by TEXT NOT NULL DEFAULT '',
            note TEXT NOT NULL DEFAULT '', expires_at TEXT NOT NULL DEFAULT '')""",
        "CREATE INDEX approvals_run ON approvals(run_id, created_at)",
        "CREATE TABLE tool_specs (hash TEXT PRIMARY KEY, spec_json TEXT NOT NULL)",
    ),
    (  # 2: the runs that wait for an operator, found without reading every run (pending, inbox)
        f"CREATE INDEX runs_waiting ON runs(created_at) WHERE status='{WAITING}'",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)    # the version of the runtime tables this build writes

_RUN_COLS = ("id, goal, status, reason, reason_detail, limits_json, step_count, created_at, "
             "finished_at, result_json, lease_owner, lease_expires_at")
_STEP_COLS = ("id, run_id, idx, status, decision_json, policy_json, observation_json, "
              "observation_hash, started_at, finished_at, spec_hash, policy_id")
_APPROVAL_COLS = ("id, run_id, step_id, kind, capability_json, presentation_json, request_json, "
                  "hash, status, created_at, decided_at, decided_by, note, expires_at")
_EVENT_COLS = "seq, run_id, step_id, at, type, payload_json, hash"
# Every approval of a waiting run that may still matter to an operator, oldest first: each
# pending one, and an approved interruption grant that is its run's latest (it blocks its tool
# until the identical call collects it). The runs come from the partial index runs_waiting and
# the approvals from approvals_run, so the cost follows what waits, never the history.
_WAITING_SQL = (
    "SELECT " + ", ".join(f"a.{c.strip()}" for c in _APPROVAL_COLS.split(",")) +
    f" FROM runs AS r CROSS JOIN approvals AS a ON a.run_id = r.id"
    f" WHERE r.status = '{WAITING}' AND (a.status = '{PENDING}' OR"
    f" (a.status = '{APPROVED}' AND a.kind = '{INTERRUPTED_KIND}' AND a.rowid ="
    f" (SELECT MAX(b.rowid) FROM approvals AS b WHERE b.run_id = r.id)))"
    " ORDER BY a.created_at, a.rowid")


def check_database_file(path: str, writer: bool) -> bool:
    """Refuse a database path we must not trust; False when it does not exist yet. Every
    opener applies it (serving, every operator command, the webhook, recheck): a database
    another user owns is theirs to rewrite, so nothing it says is verified, listed or decided
    on, and nothing is written into it, not even by root. Writers tighten an owned file (and
    its WAL sidecars) that others may read to 0600."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDatabase(f"{path} is a symbolic link; name the database file itself")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeDatabase(f"{path} is not a regular file")
    uid = os.getuid()
    if st.st_uid != uid:
        raise UnsafeDatabase(f"database: {path} is owned by uid {st.st_uid}, not by the "
                             f"current user (uid {uid}); use the database of the user that "
                             "runs the proxy, as that user")
    for name in (path, path + "-wal", path + "-shm"):
        try:
            side = os.lstat(name)
        except FileNotFoundError:
            continue
        reason = ("not a regular file" if not stat.S_ISREG(side.st_mode) else
                  "owned by another user than the database" if side.st_uid != st.st_uid else
                  "writable by group or others" if side.st_mode & 0o022 else "")
        if reason:
            raise UnsafeDatabase(
                f"{name} (mode {stat.filemode(side.st_mode)}) is {reason}; the database must "
                f"be readable and writable by its owner only: run 'chmod 600 {name}' and make "
                "it owned by the user that runs the proxy")
        if writer and side.st_mode & 0o077:     # owned by this user, as the database is
            os.chmod(name, 0o600)
    return True


def _connection(path: str, mode: str) -> sqlite3.Connection:
    """A connection to the database, set up as every connection of the proxy is (the store's,
    and the lease heartbeat's own): writers sync every commit (synchronous=FULL)."""
    quoted = path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")
    uri = ("file://" if quoted.startswith("/") else "file:") + quoted + f"?mode={mode}"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    for pragma in (f"busy_timeout={BUSY_TIMEOUT_MS}", "foreign_keys=ON", "trusted_schema=OFF",
                   f"cache_size=-{STORE_CACHE_KIB}",
                   *(("synchronous=FULL",) if mode != "ro" else ())):
        conn.execute(f"PRAGMA {pragma}")
    if hasattr(sqlite3, "SQLITE_DBCONFIG_DEFENSIVE"):
        conn.setconfig(sqlite3.SQLITE_DBCONFIG_DEFENSIVE, True)
    return conn


def event_hash(prev: str, seq: int, run_id: str, step_id: str, at: str, typ: str,
               payload: str) -> str:
    """SHA-256 over seven netstrings: the previous hash and the event's stored fields."""
    data = []
    for part in (prev, seq, run_id, step_id, at, typ, payload):
        raw = str(part).encode("utf-8", "surrogatepass")   # an edited row may hold anything
        data.append(b"%d:%s," % (len(raw), raw))
    return sha256_hex(b"".join(data))


_HEAD_SQL = ("SELECT e.seq, e.hash, (SELECT seq FROM sqlite_sequence WHERE name='events') "
             "FROM (SELECT 1) LEFT JOIN (SELECT seq, hash FROM events ORDER BY seq DESC "
             "LIMIT 1) AS e")


class Tx:
    """One open write transaction: compare-and-set reads, writes, and chained events."""

    def __init__(self, conn: sqlite3.Connection, specs: set[str]):
        self.c = conn
        self._head: tuple[int, str] | None = None
        self._specs = specs                 # the store's: hashes of specs known to be stored

    def run(self, run_id: str) -> Run:
        row = self.c.execute(f"SELECT {_RUN_COLS} FROM runs WHERE id=?", (run_id,)).fetchone()
        return _run_from_row(_found(row, f"run {run_id}"))

    def require(self, run_id: str, statuses: tuple[str, ...], owner: str = "") -> Run:
        """The run, if its status is one of ``statuses`` and (with ``owner``) a RUNNING run
        is leased to that owner; else nothing is written and the caller is told why."""
        run = self.run(run_id)
        if run.status not in statuses:
            raise RunStateError(f"run {run_id} is {run.status}, not {' or '.join(statuses)}")
        if owner and run.status == RUNNING and run.lease_owner != owner:
            raise RunLeased(run_id, run.lease_owner or "nobody", run.lease_expires_at or "-")
        return run

    def exec(self, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        return self.c.execute(sql, params)

    def rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        """A read inside the transaction (a Query, as Store._read is outside one)."""
        return self.c.execute(sql, params).fetchall()

    def event(self, run_id: str, step_id: str, at: str, typ: str, payload: Any) -> int:
        """Append one event, chained to the newest event of any run."""
        if self._head is None:          # the newest event, and the last seq ever given
            last, digest, used = self.c.execute(_HEAD_SQL).fetchone()
            self._head = (max(last or 0, used or 0), digest or "")
        text = payload if isinstance(payload, str) else dump_json(payload or {})
        seq = self._head[0] + 1
        digest = event_hash(self._head[1], seq, run_id, step_id, at, typ, text)
        self.c.execute("INSERT INTO events (seq, run_id, step_id, at, type, payload_json, hash) "
                       "VALUES (?,?,?,?,?,?,?)", (seq, run_id, step_id, at, typ, text, digest))
        self._head = (seq, digest)
        return seq

    def transition(self, run_id: str, statuses: tuple[str, ...], to: str, *, owner: str = "",
                   lease_until: str = "", reason: str = "", detail: str = "",
                   finished_at: str = "", result: str = "") -> Run:
        """Move a run to ``to``. Entering or staying RUNNING under a lease writes the lease;
        pausing or finishing releases it in the same transaction."""
        run = self.require(run_id, statuses, owner)
        lease = (owner, lease_until) if to == RUNNING and owner else ("", "")
        self.c.execute("UPDATE runs SET status=?, reason=?, reason_detail=?, finished_at=?, "
                       "result_json=?, lease_owner=?, lease_expires_at=? WHERE id=?",
                       (to, reason, detail, finished_at, result, *lease, run_id))
        # The row as the statement left it: the one read under this transaction's lock, with
        # the columns it wrote.
        return dataclasses.replace(run, status=to, reason=reason, reason_detail=detail,
                                   finished_at=finished_at, result_json=result,
                                   lease_owner=lease[0], lease_expires_at=lease[1])

    def add_run(self, run: Run, limits_json: str, started_at: str) -> None:
        """Insert a new run (refused when its id is taken: nothing is written)."""
        cur = self.c.execute(
            "INSERT INTO runs (id, goal, status, limits_json, created_at, started_at, "
            "lease_owner, lease_expires_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (id) DO NOTHING",
            (run.id, run.goal, run.status, limits_json, run.created_at, started_at,
             run.lease_owner, run.lease_expires_at))
        if cur.rowcount != 1:
            raise RunStateError(f"run {run.id} already exists")

    def count_step(self, run_id: str, step_count: int, owner: str) -> bool:
        """Add one to a RUNNING run's step count, if it still has ``step_count`` steps and
        is leased to ``owner``; False (nothing written) otherwise."""
        return self.c.execute("UPDATE runs SET step_count=step_count+1 WHERE id=? AND status=? "
                              "AND step_count=? AND lease_owner=?",
                              (run_id, RUNNING, step_count, owner)).rowcount == 1

    def take_lease(self, run_id: str, owner: str, until: str) -> None:
        """Write a new lease on a RUNNING run (a take-over: the caller judged the old one)."""
        cur = self.c.execute("UPDATE runs SET lease_owner=?, lease_expires_at=? "
                             "WHERE id=? AND status=?", (owner, until, run_id, RUNNING))
        if cur.rowcount != 1:
            raise RunStateError(f"run {run_id} is no longer RUNNING")

    def update_step(self, step_id: str, from_statuses: tuple[str, ...], **cols: Any) -> None:
        sets = ", ".join(f"{k}=?" for k in cols)
        marks = ",".join("?" * len(from_statuses))
        cur = self.c.execute(f"UPDATE steps SET {sets} WHERE id=? AND status IN ({marks})",
                             (*cols.values(), step_id, *from_statuses))
        if cur.rowcount != 1:
            row = self.c.execute("SELECT status FROM steps WHERE id=?", (step_id,)).fetchone()
            raise RunStateError(f"step {step_id} is {row[0] if row else 'missing'}")

    def save_spec(self, spec: ToolSpec) -> str:
        """Store a spec (unless the store knows it holds it already) and return its hash."""
        digest = spec.hash()
        if digest not in self._specs:
            self.c.execute("INSERT OR IGNORE INTO tool_specs (hash, spec_json) VALUES (?,?)",
                           (digest, spec.canonical().decode()))
        return digest


# A row this build cannot read (damaged, or written by hand) is a StoreError naming its run,
# never a parsing exception that escapes the code reading it.
_UNREADABLE = (JSONError, KeyError, TypeError, ValueError, AttributeError, IndexError)


def _run_from_row(row: tuple) -> Run:
    try:
        return Run(*row[:5], Limits.from_record(row[5]), *row[6:])
    except _UNREADABLE as exc:
        raise StoreError(f"run {sanitize(str(row[0]))}: its record cannot be read: "
                         f"{sanitize(str(exc))}") from None


def _step_from_row(row: tuple) -> Step:
    decision, args = None, b""
    try:
        if row[4]:
            record, members = read_members(row[4].encode())
            decision, args = to_plain(record), members.get("args", b"")
        policy = loads_own(row[5]) if row[5] else None
        observation = read_own(row[6]) if row[6] else None   # literals kept: passed on as is
        return Step(*row[:4], decision, args, policy, observation, *row[7:])
    except _UNREADABLE as exc:
        raise StoreError(f"run {sanitize(str(row[1]))}: step {sanitize(str(row[0]))} cannot "
                         f"be read: {sanitize(str(exc))}") from None


def _approval_from_row(row: tuple) -> Approval:
    return Approval(*row[:4], row[4].encode(), row[5].encode(), *row[6:])


def _found(record: Any, what: str) -> Any:
    if record is None:
        raise NotFound(f"{what} not found")
    return record


class Store:
    """The database: opened once per process for writing, or read-only by an operator."""

    def __init__(self, path: str, *, create: bool = False, readonly: bool = False):
        self.path, self.readonly = path, readonly
        self._specs: set[str] = set()           # hashes of specs known to be stored
        self._lock = threading.RLock()          # held by the thread whose transaction is open
        self._open: Tx | None = None            # that transaction
        self._failed = False                    # a change inside it failed: it rolls back
        self._level = "FULL"                    # PRAGMA synchronous, as last set; None: unknown
        self._wal: tuple[int, int] | None = None   # a writer's WAL file: (device, inode),
        self._wal_fd = -1                       # and its own descriptor of it (Store.sync)
        self._owed = self._synced = 0           # commits made with synced=False; those synced
        self._sync_lock = threading.Lock()      # one sync at a time (Store.sync)
        if not check_database_file(path, writer=not readonly):
            if not create:
                raise NotFound(f"{path} does not exist")
            _create_private(path)
        try:
            self.conn = _connection(path, "ro" if readonly else "rw")
            if not readonly:
                _switch_to_wal(self.conn, path)
        except sqlite3.Error as exc:
            raise StoreError(f"{path}: cannot open the database: {exc}") from None
        try:
            self._refuse_triggers_and_views()           # a read: the WAL file exists now
            if not readonly:    # held from before this process writes: sync sees every error
                self._wal_fd, self._wal = _open_wal(path)
            if create:
                self._migrate()
            self._check_version()
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path: str) -> "Store":
        """For the proxy: create the file (0600) and migrate it when needed."""
        return cls(path, create=True)

    @classmethod
    def open_existing(cls, path: str, readonly: bool) -> "Store":
        """For operator commands: never create and never migrate."""
        return cls(path, readonly=readonly)

    def _refuse_triggers_and_views(self) -> None:
        try:
            row = self.conn.execute("SELECT type, name FROM sqlite_master "
                                    "WHERE type IN ('trigger','view') LIMIT 1").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path} is not a database this proxy can read: {exc}") from None
        if row:
            raise UnsafeDatabase(
                f"{self.path} holds a {row[0]} named {_quote(row[1])}, which could run SQL "
                "nobody reviewed; this proxy refuses databases with triggers or views")

    def _migrate(self) -> None:
        """Bring the schema up to this build's version, in one transaction: of two proxies
        starting at once, the second finds it done. A newer schema is left as it is, for
        _check_version to refuse."""
        with self.tx() as tx:
            tx.exec("CREATE TABLE IF NOT EXISTS schema_migrations "
                    "(version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)")
            have = tx.exec("SELECT COALESCE(MAX(version),0) FROM schema_migrations").fetchone()[0]
            for version, statements in enumerate(_MIGRATIONS[have:], have + 1):
                for sql in statements:
                    tx.exec(sql)
                tx.exec("INSERT INTO schema_migrations (version, applied_at) VALUES (?,?)",
                        (version, fmt_time(time.time())))

    def _check_version(self) -> None:
        try:
            have = self.conn.execute(
                "SELECT COALESCE(MAX(version),0) FROM schema_migrations").fetchone()[0]
        except sqlite3.Error:
            raise StoreError(f"{self.path} is not a database of this proxy "
                             "(it has no schema_migrations table)") from None
        if have != SCHEMA_VERSION:
            raise SchemaVersionError(f"{self.path} has schema version {have}, " + (
                f"newer than version {SCHEMA_VERSION} this build knows; a newer version of the "
                "proxy wrote it: use that version" if have > SCHEMA_VERSION else
                f"older than version {SCHEMA_VERSION} this build writes; operator commands do "
                "not migrate a database: start the proxy that owns it once to migrate it"))

    @contextlib.contextmanager
    def tx(self, synced: bool = True):
        """A write transaction, and the one way anything the proxy records is written: the
        place that keeps "every state change is committed with its audit record before the
        host is answered, and a mutating call's attempt is committed before its request
        leaves".

        Why it holds: the connection is the store's own, and SQL reaches it only through
        the Tx handed out here, so every state change and its events (Tx.event, chained) are
        in one transaction, begun IMMEDIATE (it takes the write lock before anything in it
        is read, so a compare-and-set read cannot be overtaken). COMMIT runs under
        synchronous=FULL: SQLite has synced the WAL before this block returns, so whatever
        the caller does next (answer the host, send a call's request upstream) rests on a
        record on disk. A tx() inside this thread's open transaction is part of it, at its
        level (several changes with nothing outside in between, one commit: a call's run,
        step, decision and start), and a failure inside fails all of it; another
        thread waits for the lock. A tool is never called inside an open transaction
        (_StepExecution.call_started).

        ``synced=False`` commits under synchronous=NORMAL: written to the WAL, not yet synced.
        Store.sync syncs every such commit at once, and the host's writer calls it before
        each message leaves (LineWriter), so no answer rests on a commit a power loss could
        take back, and the calls that finish together share one sync, off the event loop.
        Three writes use it, because the next thing that leaves is an answer to the host,
        never a request to a server: a call's outcome (_StepExecution._record), the start
        of an allowed read-only call no limit counts (Gate.start: its request changes
        nothing), and a refusal's count (RefusalLog). The level is set before each BEGIN
        that needs another than the last, never inside a transaction.

        Two writes record no event, both of lease fields only, which are an executor's
        claim on a run and not its record: Leases.renew extends a lease every ttl/3 on its
        own connection (an event each would fill the chain with heartbeats, and a busy
        store must not starve it), and Session._let_go clears this process's lease after a
        failure, so that the next executor takes the run over at once; that take-over
        records what it finds (step.interrupted, run.resumed)."""
        if self.readonly:
            raise StoreError(f"{self.path} is open read-only")
        with self._lock:                    # another thread's transaction is waited for
            if self._open is not None:      # this thread's own, whose lock it holds
                # No savepoint (nothing inside goes on after a failed change): a failure
                # marks the transaction failed, and it rolls back whole even if caught inside.
                try:
                    yield self._open
                except BaseException as exc:
                    self._failed = True
                    if isinstance(exc, sqlite3.Error):
                        raise StoreError(f"{self.path}: write failed: {exc}") from None
                    raise
                return
            self._check_wal()
            if self._synced < 0:
                raise StoreError(f"{self.path}: a sync of the WAL failed; nothing more is "
                                 "recorded until the proxy is started again")
            level = "FULL" if synced else "NORMAL"
            try:
                if self._level != level:
                    self._level = None      # unknown until the PRAGMA succeeds
                    self.conn.execute(f"PRAGMA synchronous={level}")
                    self._level = level
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: cannot begin a transaction: {exc}") from None
            self._open, self._failed = Tx(self.conn, self._specs), False
            try:
                yield self._open
                if self._failed:
                    raise StoreError(f"{self.path}: a change inside a transaction failed; "
                                     "the whole transaction is rolled back")
                self.conn.execute("COMMIT")
                self._owed += not synced
            except BaseException as exc:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"{self.path}: write failed: {exc}") from None
                raise
            finally:
                self._open = None

    def sync(self) -> None:
        """Sync to disk every commit made so far with synced=False: one fsync of the WAL
        file, which holds them all, on the calling thread (the host's writer's), through the
        descriptor opened with the store (a descriptor opened later is not told of a write
        error another one saw first). A failed sync is final: what the kernel held for the
        file may be lost, so nothing that rests on a commit leaves again and nothing more is
        written (Store.tx); StoreError from here on."""
        with self._sync_lock:
            owed = self._owed
            if owed == self._synced:
                return
            if self._synced < 0:
                raise StoreError(f"{self.path}: a sync of the WAL failed before")
            try:
                os.fsync(self._wal_fd)
            except OSError as exc:
                self._synced = -1
                raise StoreError(f"{self.path}: cannot sync the WAL: {exc}") from None
            self._synced = owed

    def in_tx(self) -> bool:
        """Whether a transaction is open on this thread."""
        with self._lock:
            return self._open is not None

    def _check_wal(self) -> None:
        """Refuse to write once the WAL file this connection writes was deleted or replaced
        (a cleanup script, a hand): SQLite goes on committing into the file it has open,
        which nothing else can read and a crash loses, with every record since the last
        checkpoint. What was committed is first written into the database itself."""
        if _file_identity(self.path + "-wal") == self._wal:
            return
        with contextlib.suppress(sqlite3.Error):
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        raise StoreError(f"{self.path}: its WAL file was deleted or replaced while the "
                         "database was open; what was committed is written into the database, "
                         "and nothing more is recorded until the proxy is started again")

    @contextlib.contextmanager
    def waiting_at_most(self, ms: int):
        """Writes inside wait at most ``ms`` for another process's write lock, not
        BUSY_TIMEOUT_MS: for a write that may be skipped rather than waited for."""
        with self._lock:
            self.conn.execute(f"PRAGMA busy_timeout={int(ms)}")
            try:
                yield
            finally:
                self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self.conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: read failed: {exc}") from None

    def find_run(self, run_id: str) -> Run | None:
        rows = self._read(f"SELECT {_RUN_COLS} FROM runs WHERE id=?", (run_id,))
        return _run_from_row(rows[0]) if rows else None

    def get_run(self, run_id: str) -> Run:
        return _found(self.find_run(run_id), f"run {run_id}")

    def list_runs(self, limit: int, offset: int = 0) -> tuple[list[Run], int]:
        """Newest first, with the total count."""
        rows = self._read(f"SELECT {_RUN_COLS} FROM runs ORDER BY rowid DESC LIMIT ? OFFSET ?",
                          (limit if limit > 0 else -1, offset))
        return [_run_from_row(r) for r in rows], self._read("SELECT COUNT(*) FROM runs")[0][0]

    def list_steps(self, run_id: str) -> list[Step]:
        return [_step_from_row(r) for r in self._read(
            f"SELECT {_STEP_COLS} FROM steps WHERE run_id=? ORDER BY idx", (run_id,))]

    def list_approvals(self, run_id: str) -> list[Approval]:
        return [_approval_from_row(r) for r in self._read(
            f"SELECT {_APPROVAL_COLS} FROM approvals WHERE run_id=? ORDER BY rowid", (run_id,))]

    def find_approval(self, approval_id: str) -> Approval | None:
        rows = self._read(f"SELECT {_APPROVAL_COLS} FROM approvals WHERE id=?", (approval_id,))
        return _approval_from_row(rows[0]) if rows else None

    def get_approval(self, approval_id: str) -> Approval:
        return _found(self.find_approval(approval_id), f"approval {approval_id}")

    def pending_approvals(self, run_id: str) -> list[Approval]:
        return [a for a in self.list_approvals(run_id) if a.status == PENDING]

    def waiting_approvals(self) -> list[Approval]:
        """Across all runs: what waits for an operator, oldest first (_WAITING_SQL). Expiry
        is the caller's to judge, on its clock."""
        return [_approval_from_row(r) for r in self._read(_WAITING_SQL)]

    def spec(self, digest: str) -> ToolSpec:
        rows = self._read("SELECT spec_json FROM tool_specs WHERE hash=?", (digest,))
        if not rows or sha256_hex(rows[0][0].encode()) != digest:
            raise NotFound(f"tool spec {digest} not found or does not match its hash")
        try:
            return ToolSpec.from_json(rows[0][0].encode())
        except (JSONError, KeyError, TypeError, AttributeError, ValueError):
            raise NotFound(f"tool spec {digest} cannot be read") from None

    def ensure_spec(self, spec: ToolSpec) -> None:
        """Store a tool spec unless it is stored already (a read first: no needless commit).
        Once it is known to be committed, later transactions do not write it again: a spec is
        never deleted."""
        digest = spec.hash()
        if digest in self._specs:
            return
        joined = self.in_tx()               # then part of one that may yet roll back
        if not self._read("SELECT 1 FROM tool_specs WHERE hash=?", (digest,)):
            with self.tx() as tx:
                tx.save_spec(spec)
        if not joined:
            self._specs.add(digest)

    def list_events(self, run_id: str, limit: int = -1, offset: int = 0) -> list[tuple]:
        """(seq, run_id, step_id, at, type, payload_json, hash) in seq order."""
        return self._read(f"SELECT {_EVENT_COLS} FROM events WHERE run_id=? ORDER BY seq "
                          "LIMIT ? OFFSET ?", (run_id, limit, offset))

    def count_events(self, run_id: str) -> int:
        return self._read("SELECT COUNT(*) FROM events WHERE run_id=?", (run_id,))[0][0]

    def chain_head(self) -> tuple[int, str]:
        rows = self._read("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")
        return (rows[0][0], rows[0][1]) if rows else (0, "")

    def close(self) -> None:
        """Close the connection, after syncing what is owed: no answer rested on it yet."""
        with self._lock:
            with contextlib.suppress(StoreError):
                self.sync()
            self.conn.close()
            if self._wal_fd >= 0:
                os.close(self._wal_fd)
                self._wal_fd = -1


@dataclasses.dataclass(repr=False)
class ChainBreak:
    """The first event whose hash does not follow from the one before it."""
    seq: int
    expected: str
    found: str
    detail: str


@dataclasses.dataclass(repr=False)
class ChainReport:
    """What verify_events found, walking the events up to ``last``."""
    last: int
    checked: int = 0
    hash: str = ""
    broken: ChainBreak | None = None


def verify_events(store: Store, first: int = 1, last: int = 0) -> ChainReport:
    """Walk the store's chain from ``first`` to ``last`` (the head when 0); writes nothing."""
    first = max(first, 1)
    last = last if last > 0 else store.chain_head()[0]
    report = ChainReport(last)
    rows = store._read("SELECT hash FROM events WHERE seq<? ORDER BY seq DESC LIMIT 1",
                       (first,)) if first > 1 else []
    prev, expect = rows[0][0] if rows else "", first
    while expect <= last:
        rows = store._read(f"SELECT {_EVENT_COLS} FROM events WHERE seq>=? AND seq<=? "
                           "ORDER BY seq LIMIT ?", (expect, last, VERIFY_PAGE))
        if not rows:
            break
        for seq, run_id, step_id, at, typ, payload, stored in rows:
            want = event_hash(prev, seq, run_id, step_id, at, typ, payload) if seq == expect else ""
            # A missing event or an edited row is reported, never fatal.
            if not want or not same_digest(want, stored):
                report.broken = ChainBreak(seq, want, str(stored)[:HASH_SHOWN], (
                    "the stored hash is not the one the event's fields and the previous "
                    "event's hash give" if want else
                    f"the first event is seq {seq}: an event is missing" if expect == 1 else
                    f"seq {seq} follows {expect - 1}: an event is missing"))
                return report
            prev, expect = stored, seq + 1
            report.checked, report.hash = report.checked + 1, str(stored)[:HASH_SHOWN]
    return report


def _create_private(path: str) -> None:
    """Create the database file owner-only, never through a link."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
    except FileExistsError:                 # made meanwhile by another process: checked as any
        check_database_file(path, writer=True)


def _file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _open_wal(path: str) -> tuple[int, tuple[int, int]]:
    """A read-only descriptor of the database's WAL file, and the file's (device, inode)."""
    try:
        fd = os.open(path + "-wal", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise StoreError(f"{path}: cannot open its WAL file: {exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):      # created after check_database_file looked
        os.close(fd)
        raise StoreError(f"{path}: its WAL file is not a regular file")
    return fd, (st.st_dev, st.st_ino)


def _switch_to_wal(conn: sqlite3.Connection, path: str) -> None:
    """Switching can answer SQLITE_BUSY without waiting on busy_timeout, so retry briefly."""
    deadline = time.monotonic() + WAL_SWITCH_SECONDS
    while True:
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            break
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(WAL_SWITCH_STEP)
    if str(mode).lower() != "wal":
        raise StoreError(f"{path}: journal mode is {mode}, not wal")


# ==== 11. The gate ====
# Record, validate, evaluate, pause, execute, record. A run is begun under a caller-chosen id
# and leased to one executor at a time; the lease is renewed on its own thread so a crashed
# executor's run can be taken over once its lease runs out, or at once when the lease names a
# holder file that its executor no longer locks (Holder). Nothing is executed that was not
# recorded first, and what executes after an approval is the recorded request, never new
# bytes. The gate holds a transaction only around its own state, never across a tool call.

TOOL_RESULT, TOOL_ERROR = "tool_result", "tool_error"
# How a tool call ended, as _observe classes it and records it in its observation's content
# ("ending"). Only the first three leave its outcome known: the server answered (an error),
# nothing was sent, or the server answered and its answer could not be recorded.
ANSWERED, NOT_SENT, UNREADABLE = "answered", "not_sent", "invalid_content"
TIMED_OUT, NO_ANSWER, CUT_OFF = "timed_out", "no_answer", "cut_off"
KNOWN_ENDINGS = (ANSWERED, NOT_SENT, UNREADABLE)
POLICY_DENIED, INVALID_DECISION = "policy_denied", "invalid_decision"
INTERRUPTED_OBS = "interrupted"
ORIGINS = ("", "model", "plan", "operator")


@dataclasses.dataclass(frozen=True, repr=False)
class ToolResult:
    """What a tool returned: JSON content bytes and a one-line summary; and, when the
    content is the server's structured content, the text the server sent beside it (what
    the model reads as text), recorded with it. ``value``: the content's strict parse,
    when its maker made the bytes from it (map_result), so that they are not read again."""
    content: bytes = b"{}"
    summary: str = ""
    text: str | None = None
    value: Any = NOT_PARSED


class ToolFailure(Exception):
    """A tool call that failed, and how it ended (``ending``): by default the tool's own
    error answer (the tool ran and reported a failure); NOT_SENT for a call refused before
    anything left, NO_ANSWER for one sent that got no answer (UpstreamTool.call)."""

    def __init__(self, message: str, ending: str = ANSWERED):
        super().__init__(message)
        self.ending = ending


class AnswerUnreadable(Exception):
    """The tool answered, and its answer could not be made into content: it ran, so this is
    recorded as an answer that could not be recorded (UNRECORDED), never as no answer."""


@dataclasses.dataclass(frozen=True, repr=False)
class Tool:
    """A tool the gate can execute: its spec, and the call that runs it, handed the
    arguments' bytes and their strict parse (NOT_PARSED when the call has none), which it
    only reads. A call that takes a third argument (``tasks``: every upstream tool's) is
    handed what to do with a server's task id once it is known, should the server run it
    as a task (the attempt's record of it, section 12.1)."""
    spec: ToolSpec
    call: Callable[..., Awaitable[ToolResult]]
    tasks: bool = False


@dataclasses.dataclass(frozen=True, repr=False)
class Decision:
    """What the caller proposes: a tool call, or ending the run."""
    kind: str                      # tool_call, complete or fail
    tool: str = ""
    args: bytes = b""
    result: bytes = b""
    message: str = ""
    origin: str = ""
    value: Any = NOT_PARSED         # the strict parse of args, when the caller made it

    def call_args(self) -> bytes:
        """A tool call's arguments as they are parsed, checked and sent: stripped of the
        whitespace around them, and the empty object when there are none."""
        return self.args.strip(JSON_WS) or b"{}"


@dataclasses.dataclass(frozen=True, repr=False)
class Verdict:
    """allowed (call execute), denied (the step is over), pending (the run waits on
    ``approval``), ended (the run is over); empty for a session ready for a step."""
    kind: str = ""
    approval: Approval | None = None
    run: Run | None = None
    observation: dict | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class Reconciliation:
    """A reconcile hook's answer for a run found mid-step: continue, or wait on ``pause``."""
    outcome: str
    pause: PolicyDecision | None = None
    detail: str = ""


@dataclasses.dataclass(repr=False)
class _ProposalCheck:
    """A proposal's validation and policy decision (Gate._judge), worked out before its
    transaction when the run is begun with it (Gate.start), else as it is acted on."""
    problem: str
    decision: "PolicyDecision | None" = None
    error: Exception | None = None
    view: "RunView | None" = None     # what the policy was shown


@dataclasses.dataclass(repr=False)
class _AllowedRequest:
    """An allowed request waiting for execute: nothing about it is written yet."""
    request: ToolRequest
    decision: PolicyDecision
    policy_at: str
    extra: dict                     # what its step.policy event records beside the decision
    granted: Approval | None


def new_hex_id() -> str:
    return secrets.token_hex(ID_BYTES)


class Observation(collections.namedtuple("Observation", "doc json_text content_hash content",
                                          defaults=(None,))):
    """An observation as a step records it: the dict, its stored JSON (observation_json) and
    its content hash (observation_hash); and, when _obs built it, the exact bytes of its
    content member in that JSON, so that what is built is never parsed again to find them
    (_content_bytes). One read back from a record has none."""
    __slots__ = ()


def _obs(kind: str, content: Any, summary: str, text: str | None = None,
         value: Any = NOT_PARSED) -> Observation:
    """An observation: the dict, its stored JSON, and its content hash. Text that will not
    encode (a lone surrogate) is replaced, never allowed to stop the recording. ``text`` is
    a result's text beside its structured content (ToolResult.text); ``value`` the strict
    parse of content bytes, which the hash and the dict are made from."""
    summary = _SURROGATES.sub("\ufffd", str(summary))
    if isinstance(content, dict):
        content = {k: _SURROGATES.sub("\ufffd", v) if isinstance(v, str) else v
                   for k, v in content.items()}
    raw = content if isinstance(content, bytes) else dump_json(content).encode()
    known = value is not NOT_PARSED
    digest = sha256_hex(encode_canonical(value)) if known else content_hash(raw)
    embedded = _raw_text(raw).encode()      # as the record will hold it, byte for byte
    doc = {"kind": kind, "content": RawJSON(embedded), "summary": summary, "content_hash": digest}
    if text is not None:
        doc["text"] = _SURROGATES.sub("\ufffd", text)
    text = dump_json(doc)
    # strict content reads back as its value; the strings beside it are free of surrogates
    return Observation({**doc, "content": value} if known else read_own(text), text, digest,
                       embedded)


def _with_value(d: Decision) -> Decision:
    """A tool call's decision with its arguments' strict parse, made once here when its
    caller did not make it; arguments the strict parser refuses stay unparsed."""
    if d.kind != "tool_call" or d.value is not NOT_PARSED:
        return d
    try:
        return dataclasses.replace(d, value=parse_json(d.call_args()))
    except JSONError:
        return d


def _decision_record(d: Decision) -> tuple[str, dict]:
    """The decision as recorded: argument and result bytes verbatim when they are JSON,
    else kept as text (base64 when not UTF-8) under invalid_* and never as JSON. And the
    record as read back (loads_own), made from the values rather than parsed again."""
    doc: dict[str, Any] = {"kind": d.kind, **({"tool": d.tool} if d.tool else {})}
    bad: dict[str, bytes] = {}
    values: dict[str, Any] = {}
    for name, raw in (("args", d.args.strip(JSON_WS)), ("result", d.result.strip(JSON_WS))):
        if not raw:
            continue
        try:
            known = name == "args" and d.value is not NOT_PARSED
            values[name] = d.value if known else parse_json(raw)
            doc[name] = RawJSON(raw)
        except JSONError:
            bad[name] = raw
    doc.update({k: v for k, v in (("message", d.message), ("origin", d.origin)) if v})
    try:
        texts = {k: v.decode("utf-8") for k, v in bad.items()}
    except UnicodeDecodeError:
        texts = {k: base64.b64encode(v).decode() for k, v in bad.items()}
        doc["invalid_base64"] = True
    doc.update({"invalid_" + name: text for name, text in texts.items()})
    return dump_json(doc), to_plain({k: _SURROGATES.sub("\ufffd", v) if type(v) is str else v
                                     for k, v in {**doc, **values}.items()})


def _policy_record(p: PolicyDecision, extra: dict | None = None) -> str:
    raws = {name: getattr(p, name).strip(JSON_WS) for name in ("capability", "presentation")}
    doc = {"outcome": p.outcome, "reason": p.reason, "kind": p.kind,
           **{name: RawJSON(raw) for name, raw in raws.items() if raw}, **(extra or {})}
    return dump_json({k: v for k, v in doc.items() if v or k == "outcome"})


class Gate:
    """The gate over one store and one set of tools. Clock and ids are injected."""

    def __init__(self, store: Store, tools: Iterable[Tool],
                 policy: "SideEffectPolicy | ProxyPolicy", *,
                 now: Clock = time.time, wall: Clock = time.time,
                 new_id: Callable[[], str] = new_hex_id, lease_owner: str = "",
                 holder: "Holder | None" = None, lease_ttl: float = DEFAULT_LEASE_TTL,
                 reconcile: Callable[[RunView], Reconciliation] | None = None,
                 known: Callable[[str, dict], bool] | None = None,
                 on_settled: Callable[[Tx, list[str]], None] | None = None,
                 budget: "Budgets | None" = None):
        self.store, self.policy, self.reconcile = store, policy, reconcile
        # A caller's limits (section 20): budget.admit(tx, request, decision, at) is called
        # inside the transaction that starts an attempt, and may refuse it by raising.
        self.budget = budget
        # Whether a tool's observation is a known outcome (it ran and what came of it is
        # known); the caller knows its tools' errors. on_settled is told, inside the
        # transaction, of the runs a late outcome ended (section 13).
        self.known = known or (lambda _tool, doc: _known_outcome(doc))
        self.on_settled = on_settled or (lambda _tx, _runs: None)
        self.tools: dict[str, Tool] = {}
        for tool in sorted(tools, key=lambda t: t.spec.name):
            _check_tool(tool.spec, self.tools)
            self.tools[tool.spec.name] = tool
        self.clock, self.wall, self.new_id = now, wall, new_id
        self.lease_ttl = lease_ttl if lease_ttl > 0 else DEFAULT_LEASE_TTL
        suffix = new_id()
        self.owner = f"{lease_owner}/{suffix[:OWNER_SUFFIX]}" if lease_owner else suffix
        if holder is not None:          # its leases name the file that proves it alive
            self.owner += f";{holder.ident}"
        self.policy_id = check_policy_id(getattr(policy, "policy_id", "") or "")
        self.leases = Leases(store.path, self.owner, self.lease_ttl, wall)
        self._claimed: set[str] = set()
        self._claim_lock = threading.Lock()
        if not store.readonly:      # once stored, a run's or step's spec is not written again
            for tool in self.tools.values():
                store.ensure_spec(tool.spec)

    def now(self) -> str:
        return fmt_time(self.clock())

    def close(self) -> None:
        self.leases.close()

    # -- runs --

    def begin(self, run_id: str, goal: str, limits: Limits) -> "Session":
        """Create a run under ``run_id`` (which must be new), leased to this gate."""
        limits.validate()
        if not run_id:
            raise ValueError("a run id is required")
        with self._claiming(run_id):
            now, until = self.now(), self.wall() + self.lease_ttl
            record = limits.record()
            with self.store.tx() as tx:
                tx.add_run(Run(run_id, goal, RUNNING, "", "", Limits.from_record(record), 0, now,
                               "", "", self.owner, fmt_time(until)), record, now)
                hashes = [tx.save_spec(t.spec) for t in self.tools.values()]
                tx.event(run_id, "", now, "run.created",
                         {"goal": goal, "limits": RawJSON(record.encode()), "tools": hashes})
                tx.event(run_id, "", now, "run.started", {})
        self.leases.hold(run_id, until)
        return Session(self, run_id)

    def start(self, run_id: str, goal: str, limits: Limits, decision: Decision,
              also: Callable[[], None] | None = None) -> tuple["Session", Verdict]:
        """Begin a run and propose one decision; when it is allowed, start the tool. The
        arguments are checked and the policy evaluated first, outside any transaction (a
        schema's pattern or a policy may be slow); then the run, ``also`` (a caller's own
        write), the proposal and the tool's start commit as one transaction, before anything
        leaves the process. Then ``await session.run_started()`` runs the tool."""
        step_id = self.new_id()
        decision = _with_value(decision)
        judged = self._prejudge(run_id, step_id, goal, limits, decision)
        session = None
        try:
            with self.store.tx(synced=not self._unsynced_read(decision, judged)):
                session = self.begin(run_id, goal, limits)
                if also is not None:
                    also()
                if session.step(step_id) is None:
                    verdict = Verdict("ended", run=session.final)
                else:
                    verdict = session.propose(decision, judged)
                    if verdict.kind == "allowed":
                        session.start()
        except BaseException:
            if session is not None:
                session._let_go()
            raise
        return session, verdict

    def _unsynced_read(self, decision: Decision, judged: "_ProposalCheck") -> bool:
        """Whether a call's start may commit unsynced (Store.tx): a read-only call the
        policy allows outright and no limit counts. A policy decision is there only for a
        known tool's valid call (_prejudge)."""
        return judged.decision is not None and judged.decision.outcome == "allow" and \
            self.tools[decision.tool].spec.side_effect == "read_only" and \
            not (self.budget is not None and self.budget.counts(decision.tool))

    def _prejudge(self, run_id: str, step_id: str, goal: str, limits: Limits,
                  decision: Decision) -> "_ProposalCheck":
        """What propose would find for this decision as the first step of a new run."""
        tool = self.tools.get(decision.tool) if decision.kind == "tool_call" else None
        problem = self.invalid_reason(decision, tool)
        if problem or tool is None:
            return _ProposalCheck(problem)
        run = Run(run_id, goal, RUNNING, "", "", limits, 1, self.now(), "", "", self.owner, "")
        request = ToolRequest(run_id, step_id, tool.spec, decision.call_args(), decision.value)
        return self._judge(request, RunView(run, [], []))

    def _judge(self, request: ToolRequest, view: RunView) -> "_ProposalCheck":
        """The policy's decision on a request, its capability and presentation stripped (one
        spelling of "no value" for both); a policy's failure is kept as ``error``, and ends
        the run (_Decider._apply), never allows."""
        try:
            decision = self.evaluate(request, view)
            decision = dataclasses.replace(decision,
                                           capability=decision.capability.strip(JSON_WS),
                                           presentation=decision.presentation.strip(JSON_WS))
        except Exception as exc:
            return _ProposalCheck("", error=exc, view=view)
        return _ProposalCheck("", decision, view=view)

    def invalid_reason(self, d: Decision, tool: "Tool | None") -> str:
        """Why a decision cannot be acted on, or ''."""
        if d.origin not in ORIGINS:
            return f"unknown decision origin {_quote(d.origin)}"
        if d.kind == "tool_call":
            if not d.tool:
                return "tool_call without a tool name"
            if tool is None:
                return f"unknown tool {_quote(d.tool)}"
            return self.check_args(tool, d.call_args(), d.value)
        if d.kind not in ("complete", "fail"):
            return f"unknown decision kind {_quote(d.kind)}" if d.kind else "decision has no kind"
        result = d.result.strip(JSON_WS)
        try:
            if d.kind == "complete" and result:
                check_json(result)
        except JSONError as exc:
            return f"result is not usable JSON: {exc}"
        return ""

    async def call(self, run_id: str, goal: str, limits: Limits,
                   decision: Decision) -> tuple["Session", Verdict, dict | None]:
        """start(), then run the tool when allowed: two commits for an allowed call.
        Returns the session, the verdict, and the observation if the tool ran."""
        session, verdict = self.start(run_id, goal, limits, decision)
        ran = await session.run_started() if verdict.kind == "allowed" else None
        return session, verdict, ran

    def attach(self, run_id: str) -> tuple["Session | None", Verdict]:
        """Continue a run left waiting or running: collect an approved grant (the policy is
        evaluated again on the recorded request), expire what is overdue, or take over a run
        whose lease ran out."""
        run = self.store.get_run(run_id)
        if run.status in TERMINAL:
            raise RunStateError(f"run {run_id} is already {run.status}")
        if run.status == RUNNING and _lease_live(run, self.store.path, self.wall()):
            raise RunLeased(run.id, run.lease_owner, run.lease_expires_at)
        with self._claiming(run_id):
            if run.status == RUNNING:
                return self._take_over_claimed(run)
            return self._resume_waiting(run)

    @contextlib.contextmanager
    def _claiming(self, run_id: str):
        """This gate's claim on a run, let go when what runs under it fails."""
        with self._claim_lock:
            if run_id in self._claimed:
                raise RunLeased(run_id, self.owner, "this session ends")
            self._claimed.add(run_id)
        try:
            yield
        except BaseException:
            self._release_claim(run_id)
            raise

    def _release_claim(self, run_id: str) -> None:
        with self._claim_lock:
            self._claimed.discard(run_id)

    def _resume_waiting(self, run: Run) -> tuple["Session | None", Verdict]:
        steps, approvals = self.store.list_steps(run.id), self.store.list_approvals(run.id)
        step = next((s for s in reversed(steps) if s.status == "awaiting_approval"), None)
        if step is None:
            raise RunStateError(f"run {run.id} is waiting but has no awaiting step")
        granted = next((a for a in reversed(approvals) if a.step_id == step.id), None)
        if granted is None:
            raise RunStateError(f"run {run.id}: step {step.id} has no approval")
        if granted.status == PENDING and _expired(granted, self.clock()):
            self._release_claim(run.id)
            return None, Verdict("ended", run=expire_approval(self.store, granted, self.now()))
        if granted.status != APPROVED:
            raise RunStateError(f"the latest approval for step {step.id} is {granted.status}, "
                                "not approved")
        granted.verify()
        stored = granted.request()
        tool = self.tools.get(stored.spec.name)
        if tool is None:
            raise RunStateError(f"approved tool {_quote(stored.spec.name)} is not registered")
        request = dataclasses.replace(stored, spec=tool.spec)
        resumed = self.clock()
        if _grant_stale(run, granted, resumed):
            self._release_claim(run.id)
            return None, Verdict("ended",
                                 run=expire_approval(self.store, granted, fmt_time(resumed)))
        session = Session(self, run.id, step=step)
        return session, session.decider._resume(request, step, steps, approvals, granted,
                                                fmt_time(resumed))

    def _take_over_claimed(self, run: Run) -> tuple["Session | None", Verdict]:
        """Take over a RUNNING run whose lease is gone: steps cut off in flight are marked
        interrupted; a non-read-only tool cut off while executing waits for an operator."""
        now, wall = self.now(), self.wall()
        until = wall + self.lease_ttl
        in_flight = [s for s in self.store.list_steps(run.id)
                     if s.status in ("deciding", "executing")]
        with self.store.tx() as tx:
            current = tx.require(run.id, (RUNNING,))
            if _lease_live(current, self.store.path, wall):
                raise RunLeased(run.id, current.lease_owner, current.lease_expires_at)
            # A holder that is gone (section 11) holds none of its leases: they all run out
            # now, in this transaction, so that every reader finds them so once its file,
            # removed below, can no longer say it.
            gone = holder_gone(self.store.path, current.lease_owner)
            if gone:
                tx.exec("UPDATE runs SET lease_expires_at=? WHERE status=? AND lease_owner=? "
                        "AND id<>?", (fmt_time(wall), RUNNING, current.lease_owner, run.id))
            tx.take_lease(run.id, self.owner, fmt_time(until))
            if current.lease_owner:
                tx.event(run.id, "", now, "lease.taken_over",
                         {"owner": self.owner, "previous_expires_at": current.lease_expires_at,
                          "previous_owner": current.lease_owner})
            for s in in_flight:
                content = {"previous_status": s.status}
                obs = _obs(INTERRUPTED_OBS, content, f"step interrupted while {s.status}")
                tx.update_step(s.id, (s.status,), status="interrupted", finished_at=now,
                               observation_json=obs.json_text, observation_hash=obs.content_hash)
                tx.event(run.id, s.id, now, "step.interrupted", {"previous_status": content})
        self.leases.hold(run.id, until)
        if gone:
            holder_gone(self.store.path, current.lease_owner, remove=True)
        session = Session(self, run.id)
        try:
            # Only the last step can have been in flight: it, when cut off while executing
            # (just now, or by an earlier take-over that went no further), is judged.
            steps = self.store.list_steps(run.id)
            if steps and steps[-1].status == "interrupted" and \
                    steps[-1].obs_content.get("previous_status") == "executing":
                verdict = session.decider._after_interruption(steps[-1], steps, now)
                if verdict is not None:
                    return session, verdict
            with self.store.tx() as tx:
                tx.transition(run.id, (RUNNING,), RUNNING, owner=self.owner,
                              lease_until=fmt_time(self.wall() + self.lease_ttl))
                tx.event(run.id, "", now, "run.resumed", {"after": "interruption"})
        except BaseException:
            # Whatever failed, the lease taken above is let go, in memory and on disk: a
            # lease renewed by a process that is not working on the run would hide it from
            # every other executor, and from the operator, for good.
            session._let_go()
            raise
        return session, Verdict()

    # -- helpers the session uses --

    def evaluate(self, request: ToolRequest, view: RunView) -> PolicyDecision:
        """Hand the policy a copy in policy form: arguments and schema canonical, unescaped."""
        handed = ToolRequest(request.run_id, request.step_id, request.spec.policy_form(),
                             encode_policy(request.parsed()))
        return self.policy.evaluate(handed, view)

    def check_args(self, tool: Tool, args: bytes, value: Any = NOT_PARSED) -> str:
        """Why the arguments (``value``, their strict parse, when known) are not acceptable,
        or ''."""
        try:
            _schema_for(tool.spec).check(args, value)     # parses strictly, then checks
        except JSONError as exc:
            return f"arguments are not usable JSON: {exc}"
        except SchemaError as exc:
            return f"arguments do not match schema: {exc}"
        return ""


_SCHEMAS: dict[bytes, Schema] = {}


def _schema_for(spec: ToolSpec) -> Schema:
    """Compiled schemas, cached by their bytes (registration compiled each already)."""
    if spec.input_schema not in _SCHEMAS:
        _SCHEMAS[spec.input_schema] = compile_schema(spec.input_schema)
    return _SCHEMAS[spec.input_schema]


def _check_tool(spec: ToolSpec, seen: dict) -> None:
    if not spec.name:
        raise ValueError("tool with empty name")
    if spec.name in seen:
        raise ValueError(f"duplicate tool {_quote(spec.name)}")
    problem = (f"invalid side effect {_quote(spec.side_effect)}"
               if spec.side_effect not in SIDE_EFFECTS else
               "timeout is required" if spec.timeout <= 0 else
               "input schema is required" if not spec.input_schema.strip() else "")
    try:
        if not problem:
            _schema_for(spec)       # compiled once here, and cached
    except (SchemaError, JSONError) as exc:
        problem = str(exc)
    if problem:
        raise ValueError(f"tool {_quote(spec.name)}: {problem}")


# ==== 11.1 Leases and the holder file ====
# A run's lease, renewed on a thread of its own (Leases), and the holder file whose lock
# proves a serving proxy alive (Holder): what lets the gate take a crashed executor's run
# over, once its lease runs out or at once when its holder is gone.

# A serving proxy's holder file (DESIGN.md section 11). The proxy holds an exclusive flock on
# a file of its own beside the database, <database>.holder-<32 hex>, created exclusively,
# 0600, for as long as it serves, and its leases name the file (HOLDER_IN_OWNER). The lock
# is the proof of life: the operating system lets go of it when the process dies, whatever
# killed it, and keeps it while the process is stopped. flock and not lockf: a POSIX record
# lock belongs to the process, so a proxy checking a holder it held itself would take the
# lock, and closing that descriptor would let go of its own; a flock belongs to the open
# file description. That description is close-on-exec (os.open's default) and every child is
# started with close_fds, so no server or on_pending command keeps it past the proxy (the
# servers are started before the file exists in any case: loading comes first).
#
# A checker takes a shared lock, so that two proxies checking one dead holder at once both
# see it gone; only the holder's exclusive lock refuses it. A holder it cannot check keeps
# the seed's rule, the lease decides: a lock held, a missing file, a symbolic link (never
# followed), anything but a regular 0600 file of this user, an owner naming no file (an older
# build, or a system without flock). Nothing is created while checking. The file is removed
# only under a lock: by the holder at a normal exit, and by the proxy that took a gone
# holder's run over, once the same transaction let every other lease of that holder run out
# (Gate._take_over_claimed). Names are random and created exclusively, so a name once used
# never names another holder.
#
# The lease names the file by its name and by its device and inode too, and a checker
# judges only that very file: a copy put in its place under the same name (cp -p, a restore,
# a save by rename), which the holder never locked, is not the holder's file, and the lease
# decides. While the holder lives it keeps the file open, so no other file has its inode.
# And a proxy on a file system where flock locks nothing (some network and virtual file
# systems) names no file: Holder.take finds that holder_gone, judging its own file while it
# holds the lock, reads it as gone, and gives the file up; the lease decides there too.
HOLDER_IN_OWNER = re.compile(r";(holder-[0-9a-f]{32}):([0-9]{1,20}):([0-9]{1,20})\Z")
_HELD: set[str] = set()         # holder names this process locks: alive, never opened again


class Holder:
    """This serving proxy's holder file, exclusively locked until close()."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd
        self.name = path.rsplit(".", 1)[1]          # holder-<hex>
        st = os.fstat(fd)
        self.ident = f"{self.name}:{st.st_dev}:{st.st_ino}"     # as the leases name it

    @classmethod
    def take(cls, database: str) -> "Holder | None":
        """Create and lock a new holder file beside the database; None where the system has
        no flock (the leases then name no file). OSError when it cannot be made."""
        if fcntl is None:
            return None
        for _ in range(HOLDER_CREATE_TRIES):
            path = f"{database}.holder-{new_hex_id()}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue                # never a name in use: another holder's, however old
            try:
                os.fchmod(fd, 0o600)    # whatever the umask took: checkers want exactly 0600
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                holder = cls(path, fd)
                # The checkers' own judgment must find this file, locked, held: where flock
                # locks nothing (or is emulated with the process's record locks, which a
                # second description of the same process shares) it finds it gone.
                if holder_gone(database, ";" + holder.ident):
                    raise OSError(f"flock locks nothing on the file system of {path}")
            except OSError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            _HELD.add(holder.name)
            return holder
        raise OSError(f"no fresh name for a holder file beside {database}")

    def close(self) -> None:
        """At a normal exit: the file is removed while still locked, then let go, so that
        no checker can read this proxy as gone from a file it finds unlocked."""
        if self.fd < 0:
            return
        _unlink_locked(self.path, self.fd)
        os.close(self.fd)
        self.fd = -1
        _HELD.discard(self.name)


def holder_gone(database: str, owner: str, remove: bool = False) -> bool:
    """Whether the lease owner names a holder file beside the database whose lock can be
    taken: the proxy that held it is gone. The one judgment of a holder's death: every
    "is this lease live" goes through _lease_live, which asks this. With ``remove``, a gone
    holder's file is removed, under the shared lock taken to judge it, and only that file.
    False whenever it cannot be checked."""
    named = HOLDER_IN_OWNER.search(owner)
    if named is None or fcntl is None or named.group(1) in _HELD:
        return False
    path = f"{database}.{named.group(1)}"
    try:                                # O_NONBLOCK: a FIFO put in its place does not hang us
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                     getattr(os, "O_NOCTTY", 0))
    except OSError:
        return False                    # missing, a symbolic link, not ours to read
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and
                stat.S_IMODE(st.st_mode) == 0o600 and
                (str(st.st_dev), str(st.st_ino)) == named.group(2, 3)):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if remove:
            _unlink_locked(path, fd)
        return True
    except OSError:
        return False                    # held: its proxy runs, or is stopped
    finally:
        os.close(fd)


def _unlink_locked(path: str, fd: int) -> None:
    """Remove ``path`` if it still names the file open (and locked) on ``fd``."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            os.unlink(path)


class Leases:
    """Renews this process's leases every ttl/3 on a connection and thread of its own, so a
    busy event loop or a long transaction elsewhere cannot starve the renewals."""

    def __init__(self, path: str, owner: str, ttl: float, wall: Clock):
        self.path, self.owner, self.ttl, self.wall = path, owner, ttl, wall
        self._held: dict[str, float] = {}
        self._lost: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, run_id: str, until: float) -> None:
        with self._lock:
            self._held[run_id] = until
            self._lost.discard(run_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="agentrt-proxy-leases")
                self._thread.start()

    def drop(self, run_id: str) -> None:
        with self._lock:
            self._held.pop(run_id, None)
            self._lost.discard(run_id)

    def ok(self, run_id: str) -> bool:
        with self._lock:
            until = self._held.get(run_id)
            return until is not None and run_id not in self._lost and self.wall() < until

    def holds(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self._held

    def _loop(self) -> None:
        conn = None
        try:
            while not self._stop.wait(self.ttl / LEASE_RENEW_FRACTION):
                try:
                    conn = conn or _connection(self.path, "rw")
                    self.renew(conn)
                except sqlite3.Error:
                    conn = None     # opened again at the next tick; ok() judges the expiry
        finally:
            if conn is not None:
                conn.close()

    def renew(self, conn: sqlite3.Connection) -> None:
        with self._lock:
            runs = list(self._held)
        for run_id in runs:
            until = self.wall() + self.ttl
            try:
                cur = conn.execute("UPDATE runs SET lease_expires_at=? WHERE id=? AND "
                                   "lease_owner=? AND status='RUNNING'",
                                   (fmt_time(until), run_id, self.owner))
            except sqlite3.Error:
                continue            # retried at the next tick; ok() judges the old expiry
            with self._lock:
                if run_id not in self._held:
                    continue
                if cur.rowcount == 1:
                    self._held[run_id] = until
                else:
                    self._lost.add(run_id)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl)


# ==== 12. A run's session ====
# One executor's hold on one run: steps opened one at a time, each proposal recorded before
# it is judged, each allowed request started (committed) before its tool is called, and each
# outcome recorded with nothing but this executor's ownership of the lease required. The
# Session keeps the run's state and its surface; its _Decider acts on what the policy
# decides, its _StepExecution (section 12.1) starts, calls and records the tool.

class Session:
    """One executor's hold on one run: at most one open step, calls in order. It keeps the
    run's state (the open step, the request allowed and the one started, how the session
    ended), opens steps, and ends steps and runs; a proposal is judged and acted on by its
    _Decider, and an allowed request is started, called and recorded by its _StepExecution."""

    def __init__(self, gate: Gate, run_id: str, step: Step | None = None):
        self.gate, self.store, self.run_id = gate, gate.store, run_id
        self.current: Step | None = step
        self._allowed: _AllowedRequest | None = None
        self._started: ToolRequest | None = None
        self.state = "open"            # open, paused, ended, lost, closed
        self.final: Run | None = None
        # Called with the observation inside the transaction that records a tool's outcome.
        self.on_recorded: Callable[[dict], None] | None = None
        self.decider, self.executor = _Decider(self), _StepExecution(self)

    # -- the step cycle --

    def step(self, step_id: str = "") -> Step | None:
        """Open the next step, or None when the run is no longer running (an operator
        cancelled it, or a limit ended it now)."""
        self._usable()
        if self.current is not None:
            raise RunStateError(f"run {self.run_id}: a step is already open")
        run = self.store.get_run(self.run_id)
        if run.status != RUNNING:
            self._finish("ended" if run.status in TERMINAL else "paused", run)
            return None
        if not self.gate.leases.ok(self.run_id):
            raise self._lose()
        # A run with no step counted has none: a step is counted in the transaction that
        # inserts it (below).
        steps = self.store.list_steps(self.run_id) if run.step_count else []
        hit = _limit_hit(run, steps)
        if hit:
            reason, detail, loop = hit
            pre = [("loop.detected", self.gate.now(), loop)] if loop else []
            self._settle(None, (), "", None, FAILED, reason, detail, pre=pre)
            return None
        now, step_id = self.gate.now(), step_id or self.gate.new_id()
        with self.store.tx() as tx:
            if not tx.count_step(self.run_id, run.step_count, self.gate.owner):
                tx.require(self.run_id, (RUNNING,), self.gate.owner)
                raise RunStateError(f"run {self.run_id} cannot start step {run.step_count}")
            tx.exec("INSERT INTO steps (id, run_id, idx, status, started_at) VALUES (?,?,?,?,?)",
                    (step_id, self.run_id, run.step_count, "deciding", now))
            tx.event(self.run_id, step_id, now, "step.started", {"index": run.step_count})
        self.current = Step(step_id, self.run_id, run.step_count, "deciding", None, b"", None,
                            None, "", now, "", "", "")
        return self.current

    async def execute(self) -> dict:
        """Run the allowed request once and record its outcome. Returns the observation."""
        self.start()
        return await self.run_started()

    # -- what the gate and the proxy call, done by its parts --

    def propose(self, decision: Decision, judged: "_ProposalCheck | None" = None) -> Verdict:
        return self.decider.propose(decision, judged)

    def start(self) -> None:
        self.executor.start()

    async def run_started(self) -> dict:
        return await self.executor.run_started()

    async def call_started(self) -> tuple[Observation, float]:
        return await self.executor.call_started()

    def record_outcome(self, called: tuple[Observation, float]) -> dict:
        return self.executor.record_outcome(called)

    # -- ending steps and runs --

    def _end_step(self, tx: Tx, step: Step, from_steps: tuple, status: str,
                  obs: Observation | None, now: str, *, finished_event: dict | None = None,
                  detail: str = "", **cols: Any) -> None:
        if obs is not None:
            cols.update(observation_json=obs.json_text, observation_hash=obs.content_hash)
        tx.update_step(step.id, from_steps, status=status, finished_at=now, **cols)
        if finished_event is not None:
            tx.event(self.run_id, step.id, now, "step.tool_finished", finished_event)
        if status == "failed":
            payload: dict[str, Any] = {"detail": detail or (obs.doc["summary"] if obs else "")}
            if obs is not None:
                payload.update(content_hash=obs.content_hash, observation=obs.doc["kind"])
            tx.event(self.run_id, step.id, now, "step.failed", payload)

    def _settle(self, step: Step | None, from_steps: tuple, step_status: str,
                obs: Observation | None, status: str, reason: str, detail: str,
                result: str = "", *,
                origin: str = RUNNING, pre: list | None = None, step_detail: str = "",
                finished_event: dict | None = None, **cols: Any) -> Run:
        """End the run (and its open step) in one transaction."""
        step_at, run_at = self.gate.now(), self.gate.now()
        with self.store.tx() as tx:
            tx.require(self.run_id, (origin,), self.gate.owner if origin == RUNNING else "")
            for typ, at, payload in pre or []:
                tx.event(self.run_id, step.id if step else "", at, typ, payload)
            if step is not None:
                self._end_step(tx, step, from_steps, step_status, obs, step_at,
                               finished_event=finished_event, detail=step_detail, **cols)
            run = tx.transition(self.run_id, (origin,), status, reason=reason, detail=detail,
                                finished_at=run_at, result=result)
            if reason.startswith("limit_") or reason == "repeated_tool_failures":
                tx.event(self.run_id, "", run_at, "limit.exceeded",
                         {"detail": detail, "reason": reason})
            tx.event(self.run_id, "", run_at, "run.finished",
                     {"detail": detail, "reason": reason, "status": status,
                      "steps": run.step_count})
        self._finish("ended", run)
        return run

    def fail(self, detail: str) -> Run:
        """End the run with a fail decision of origin operator, in a step of its own when
        none is open. Returns the run as it ended (a limit or an operator may end it first)."""
        if not detail:
            raise ValueError("fail needs a reason")
        if self.current is None and self.step() is None:
            return self.final
        return self.propose(Decision("fail", message=detail, origin="operator")).run

    # -- session state --

    def _usable(self) -> None:
        if self.state != "open":
            raise RunStateError(f"run {self.run_id}: the session is {self.state}")

    def _finish(self, state: str, run: Run | None) -> None:
        self.state, self.final, self.current, self._allowed = state, run, None, None
        self.gate.leases.drop(self.run_id)
        self.gate._release_claim(self.run_id)

    def _lose(self) -> LeaseLost:
        self._finish("lost", self.store.find_run(self.run_id))
        return LeaseLost(f"run {self.run_id}: the lease was lost")

    def _let_go(self) -> None:
        """Give up the run after a failure: the lease is dropped here and cleared on disk,
        so the next executor takes the run over at once and judges what it was doing."""
        self.gate.leases.drop(self.run_id)
        self._clear_lease(Exception)
        self._finish("lost", None)

    def close(self) -> None:
        """End the session; a lease still held is released. An open step is left as a
        crash would leave it, for the next executor to take over."""
        if self.state != "open":
            return
        if self.gate.leases.holds(self.run_id):
            self._clear_lease(StoreError)
        self._finish("closed", self.final)

    def _clear_lease(self, tolerated: type) -> None:
        """Clear this gate's lease on the run on disk, best effort (``tolerated`` is what
        may fail it): a lease left unrenewed runs out by itself."""
        with contextlib.suppress(tolerated):
            with self.store.tx() as tx:
                tx.exec("UPDATE runs SET lease_owner='', lease_expires_at='' WHERE id=? "
                        "AND lease_owner=?", (self.run_id, self.gate.owner))


class _SessionPart:
    """A part of a session (its _Decider, its _StepExecution): it acts on the session's run,
    through the session's gate and store."""

    def __init__(self, session: Session):
        self.session, self.gate, self.store = session, session.gate, session.store
        self.run_id = session.run_id


class _Decider(_SessionPart):
    """A session's judge of proposals: records each decision, validates it, evaluates the
    policy, and acts on what it decides: allow (the request handed to the _StepExecution), deny,
    abort, or pause on an approval; and, on resume, judges the approved request again."""

    def propose(self, decision: Decision, judged: "_ProposalCheck | None" = None) -> Verdict:
        """Record the decision, validate it, and (for a tool call) evaluate the policy;
        ``judged`` carries both worked out already (Gate.start)."""
        self.session._usable()
        step = self.session.current
        if step is None or step.status != "deciding" or self.session._allowed is not None:
            raise RunStateError(f"run {self.run_id}: no step is open for a proposal")
        if not self.gate.leases.ok(self.run_id):
            raise self.session._lose()
        tool = self.gate.tools.get(decision.tool) if decision.kind == "tool_call" else None
        if judged is None:
            decision = _with_value(decision)
        (record, recorded), now = _decision_record(decision), self.gate.now()
        with self.store.tx() as tx:
            tx.require(self.run_id, (RUNNING,), self.gate.owner)
            spec_hash = tx.save_spec(tool.spec) if tool else ""
            tx.update_step(step.id, ("deciding",), decision_json=record, spec_hash=spec_hash)
            tx.event(self.run_id, step.id, now, "step.decided", record)
        self.session.current = step = dataclasses.replace(
            step, decision=recorded, args=decision.args.strip(JSON_WS), spec_hash=spec_hash)
        problem = judged.problem if judged else self.gate.invalid_reason(decision, tool)
        if problem:
            obs = _obs(INVALID_DECISION, {"error": problem}, f"invalid decision: {problem}")
            return self._refuse(step, ("deciding",), None, obs, detail=problem)
        if decision.kind == "complete":
            return Verdict("ended", run=self.session._settle(
                step, ("deciding",), "done", None, COMPLETED, "goal_completed", "",
                decision.result.strip(JSON_WS).decode()))
        if decision.kind == "fail":
            return Verdict("ended", run=self.session._settle(
                step, ("deciding",), "done", None, FAILED, "goal_failed", decision.message))
        request = ToolRequest(self.run_id, step.id, tool.spec, decision.call_args(),
                              decision.value)
        if judged is not None and step.idx == 0:
            view = judged.view           # the first step of a run begun in this transaction
        else:
            run = self.store.get_run(self.run_id)
            prior = [s for s in self.store.list_steps(self.run_id) if s.idx < step.idx]
            view = RunView(run, prior, self.store.list_approvals(self.run_id))
        return self._apply(request, step, view, None, None, judged)

    def _apply(self, request: ToolRequest, step: Step, view: RunView,
               granted: Approval | None, resumed_at: str | None,
               judged: "_ProposalCheck | None" = None) -> Verdict:
        """Act on the policy's decision. On resume (``granted``) the run is still WAITING."""
        origin = WAITING if granted else RUNNING
        from_steps = ("awaiting_approval",) if granted else ("deciding",)
        judged = judged or self.gate._judge(request, view)
        if judged.error is not None:
            return self._policy_failure(step, from_steps, origin, f"{judged.error}")
        decision = judged.decision
        policy_at = resumed_at or self.gate.now()
        extra = {"policy_id": self.gate.policy_id, "spec_hash": request.spec.hash(),
                 "view": {"status": view.run.status, "step_count": view.run.step_count,
                          "steps": len(view.steps), "approvals": len(view.approvals)}}
        for name in ("capability", "presentation"):
            try:
                if getattr(decision, name):     # it wraps the arguments: the records' allowance
                    parse_json(getattr(decision, name), max_depth=RECORD_DEPTH)
            except JSONError as exc:
                return self._policy_failure(
                    step, from_steps, origin, f"{name} is not usable JSON: {exc}",
                    PolicyDecision(decision.outcome, decision.reason, decision.kind), extra,
                    policy_at)
        try:
            allowed = decision.outcome == "allow" or (
                granted is not None and grant_covers(granted, decision, request))
        except (JSONError, TypeError, ValueError) as exc:
            return self._policy_failure(step, from_steps, origin, f"the approval will not "
                                        f"encode: {exc}", decision, extra, policy_at)
        if allowed:
            self.session._allowed = _AllowedRequest(request, decision, policy_at, extra, granted)
            return Verdict("allowed", approval=granted)
        if decision.outcome in ("deny", "abort"):
            done = "aborted" if decision.outcome == "abort" else \
                "denied on resume" if granted else "denied"
            obs = _obs(POLICY_DENIED, {"reason": decision.reason, "tool": request.spec.name},
                       f"{done}: {decision.reason}")
        if decision.outcome == "deny":
            return self._refuse(step, from_steps, granted, obs, decision, extra, policy_at)
        if decision.outcome == "abort":
            pre = [("step.policy", policy_at, _policy_record(decision, extra))]
            return Verdict("ended", run=self.session._settle(
                step, from_steps, "failed", obs, FAILED, "policy_abort", decision.reason,
                origin=origin, pre=pre, policy_json=_policy_record(decision)))
        if decision.outcome == "require_approval":
            return self._pause(request, step, from_steps, origin, decision, extra, policy_at)
        return self._policy_failure(step, from_steps, origin,
                                    f"unknown policy outcome {_quote(decision.outcome)}",
                                    decision, extra, policy_at)

    def _policy_failure(self, step, from_steps, origin, detail, decision=None, extra=None,
                        policy_at=""):
        pre = [("step.policy", policy_at, _policy_record(decision, extra))] if decision else []
        return Verdict("ended", run=self.session._settle(
            step, from_steps, "failed", None, FAILED, "internal_error", f"policy: {detail}",
            origin=origin, pre=pre, step_detail=f"policy error: {detail}",
            policy_json=_policy_record(decision) if decision else ""))

    def _refuse(self, step, from_steps, granted, obs, decision=None, extra=None, policy_at="",
                detail="") -> Verdict:
        """End the step failed and the run goes on (resumed, on a ``granted`` one): an invalid
        decision, or the policy's deny (``decision``, recorded with the step)."""
        now, until = self.gate.now(), self.gate.wall() + self.gate.lease_ttl
        cols = {}
        with self.store.tx() as tx:
            if granted:
                tx.transition(self.run_id, (WAITING,), RUNNING, owner=self.gate.owner,
                              lease_until=fmt_time(until))
                tx.event(self.run_id, step.id, now, "run.resumed", {"approval_id": granted.id})
            else:
                tx.require(self.run_id, (RUNNING,), self.gate.owner)
            if decision is not None:
                tx.event(self.run_id, step.id, policy_at, "step.policy",
                         _policy_record(decision, extra))
                cols = {"policy_json": _policy_record(decision), "policy_id": self.gate.policy_id}
            self.session._end_step(tx, step, from_steps, "failed", obs, now, detail=detail,
                                   **cols)
        if granted:
            self.gate.leases.hold(self.run_id, until)
        self.session.current = None
        return Verdict("denied", observation=obs.doc)

    def _pause(self, request, step, from_steps, origin, decision, extra, policy_at) -> Verdict:
        """Wait on a new approval bound by hash to exactly this request."""
        now = self.gate.clock()
        ttl = self.store.get_run(self.run_id).limits.approval_ttl
        cap = decision.capability.strip(JSON_WS) or b"{}"
        pres = decision.presentation.strip(JSON_WS) or b"{}"
        approval = Approval(self.gate.new_id(), self.run_id, step.id, decision.kind, cap, pres,
                            request.record(), approval_hash(decision.kind, cap, pres, request),
                            PENDING, fmt_time(now), "", "", "",
                            fmt_time(now + ttl) if ttl > 0 else "")
        owner = self.gate.owner if origin == RUNNING else ""
        with self.store.tx() as tx:
            attempt = asked_attempt(approval, tx.rows)
            tx.event(self.run_id, step.id, policy_at, "step.policy",
                     _policy_record(decision, extra))
            # No interruption approval is ever asked about an attempt whose outcome is
            # recorded: looked for in the transaction that would ask, so that a late outcome
            # recorded before it is found here, and one recorded after it settles what it
            # asked (settle_attempt).
            late = late_record(tx.rows, attempt, known=True) if attempt else None
            if late is not None:
                run = end_with_late(tx, self.run_id, step.id, (origin,), from_steps, late,
                                    fmt_time(now), request.spec.terminal, owner)
                self.gate.on_settled(tx, [self.run_id])
            else:                           # the run waits, its step waits, the approval is asked
                tx.transition(self.run_id, (origin,), WAITING, owner=owner)
                tx.update_step(step.id, from_steps, status="awaiting_approval",
                               policy_json=_policy_record(decision), spec_hash=step.spec_hash
                               or request.spec.hash(), policy_id=extra.get("policy_id", ""),
                               observation_json="", observation_hash="", finished_at="")
                tx.exec(f"INSERT INTO approvals ({_APPROVAL_COLS}) VALUES "  # every field, in order
                        f"({','.join('?' * len(_APPROVAL_COLS.split(',')))})",
                        [v.decode() if isinstance(v, bytes) else v
                         for v in dataclasses.astuple(approval)])
                tx.event(self.run_id, step.id, approval.created_at, "approval.requested",
                         {"approval_id": approval.id, "capability": RawJSON(approval.capability),
                          "hash": approval.hash, "kind": approval.kind,
                          "presentation": RawJSON(approval.presentation),
                          "reason": decision.reason})
        if late is not None:
            self.session._finish("ended", run)
            return Verdict("settled", run=run)
        self.session._finish("paused", None)
        return Verdict("pending", approval=approval)

    def _resume(self, request, step, steps, approvals, granted, resumed_at) -> Verdict:
        """An approved step: check the recorded arguments against today's schema, then
        evaluate the policy again while the run is still WAITING."""
        tool = self.gate.tools[request.spec.name]
        self.store.ensure_spec(request.spec)     # the spec the re-evaluation is recorded with
        problem = self.gate.check_args(tool, request.args)
        if problem:
            detail = f"invalid decision on resume: {problem}"
            obs = _obs(INVALID_DECISION, {"error": problem}, detail)
            return self._refuse(step, ("awaiting_approval",), granted, obs)
        run = self.store.get_run(self.run_id)
        prior = [s for s in steps if s.idx < step.idx]
        return self._apply(request, step, RunView(run, prior, approvals), granted, resumed_at)

    def _after_interruption(self, step: Step, steps: list[Step], now: str) -> Verdict | None:
        """A step cut off while executing: ask the reconcile hook, or, without one, pause a
        tool that is not read-only on an interrupted_side_effect approval. None: go on."""
        name, args = (step.decision or {}).get("tool", ""), step.args or b"{}"
        tool = self.gate.tools.get(name)
        run = self.store.get_run(self.run_id)
        if self.gate.reconcile is not None:
            rec = self.gate.reconcile(RunView(run, steps, self.store.list_approvals(self.run_id)))
            if rec.outcome == "continue":
                return None
            if rec.outcome != "waiting" or rec.pause is None:
                return self._conflict(step, rec.detail or f"reconcile answered {rec.outcome}")
            decision = rec.pause
        elif tool is not None and tool.spec.side_effect == "read_only":
            return None
        else:                               # keys in sorted order, as canonical JSON has them
            decision = need_approval(
                INTERRUPTED_KIND, INTERRUPTED_REASON, {"args": RawJSON(args), "tool": name},
                {"args": RawJSON(args), "notice": INTERRUPTED_NOTICE,
                 "side_effect": tool.spec.side_effect if tool else "", "tool": name})
        if tool is None:
            return self._conflict(step, "the tool is no longer offered")
        problem = self.gate.check_args(tool, args)
        if problem:
            return self._conflict(step, problem)
        request = ToolRequest(self.run_id, step.id, tool.spec, args)
        return self._pause(request, step, ("interrupted",), RUNNING, decision,
                           {"spec_hash": tool.spec.hash()}, now)

    def _conflict(self, step: Step, why: str) -> Verdict:
        detail = (f"step {step.idx} was interrupted while executing a tool call whose outcome "
                  f"is unknown and cannot wait for an operator ({why})")
        return Verdict("ended", run=self.session._settle(None, (), "", None, FAILED,
                                                         "reconcile_conflict", detail))


# ==== 12.1 Executing a step: its start, the tool's call, and its outcome ====
# An allowed request's start is committed before anything leaves the process; the tool is
# called once; and what came of it is recorded, on time or late, through one classifier.

class _StepExecution(_SessionPart):
    """A session's runner of the allowed request: commits its start (the grant judged again
    in that transaction), calls the tool, and records the outcome, late when the run was
    taken over or cancelled meanwhile."""

    def start(self) -> None:
        """Commit the policy's decision and the tool's start: after this the attempt is on
        record, before anything leaves the process. Raises when nothing may execute."""
        self.session._usable()
        allowed, step = self.session._allowed, self.session.current
        if allowed is None or step is None:
            raise RunStateError(f"run {self.run_id}: nothing is allowed to execute")
        self.session._allowed = None
        gate, granted = self.gate, allowed.granted
        # The grant's age is judged again just before executing: a stale grant is expired here
        # (its run cancelled).
        if granted is not None:
            run, at = self.store.get_run(self.run_id), gate.clock()
            if _grant_stale(run, granted, at):
                self.session._finish("ended", expire_approval(self.store, granted, fmt_time(at)))
                raise ApprovalExpired(
                    f"approval {granted.id} was granted at {granted.decided_at} and its grant "
                    f"expired ({fmt_duration(run.limits.grant_ttl)}) before it was executed")
        elif not gate.leases.ok(self.run_id):
            raise self.session._lose()
        start_at = gate.now() if granted else allowed.policy_at
        until = gate.wall() + gate.lease_ttl
        spec, request = allowed.request.spec, allowed.request
        started = {"args": RawJSON(request.args), "tool": spec.name}
        with self.store.tx() as tx:
            settled = self._settled_at_start(tx, granted, start_at, spec) if granted else None
            if settled is None:
                if granted:
                    tx.transition(self.run_id, (WAITING,), RUNNING, owner=gate.owner,
                                  lease_until=fmt_time(until))
                    tx.event(self.run_id, step.id, start_at, "run.resumed",
                             {"approval_id": granted.id})
                    started = {"approval_id": granted.id, **started}
                else:       # starting a side effect needs the lease unexpired, judged here
                    run = tx.require(self.run_id, (RUNNING,), gate.owner)
                    if not _lease_live(run, gate.store.path, gate.wall()):
                        raise LeaseLost(f"run {self.run_id}: the lease expired at "
                                        f"{run.lease_expires_at or '-'}")
                if gate.budget is not None:
                    gate.budget.admit(tx, request, allowed.decision, start_at)
                tx.update_step(step.id, ("awaiting_approval",) if granted else ("deciding",),
                               status="executing", policy_json=_policy_record(allowed.decision),
                               policy_id=gate.policy_id,
                               **({"started_at": start_at} if granted else {}))
                tx.event(self.run_id, step.id, allowed.policy_at, "step.policy",
                         _policy_record(allowed.decision, allowed.extra))
                tx.event(self.run_id, step.id, start_at, "step.tool_started", started)
        if settled is not None:
            self.session._finish("ended", settled[0])
            raise AttemptSettled(f"run {self.run_id}: approval {granted.id} is not run: the "
                                 f"attempt it re-runs {settled[1].text()}")
        gate.leases.hold(self.run_id, until)
        # The attempt's start as the store holds it: a late outcome names it (section 13).
        self.session.current = dataclasses.replace(
            step, status="executing", started_at=start_at if granted else step.started_at)
        self.session._started = request

    def _settled_at_start(self, tx: Tx, granted: Approval, at: str, spec: ToolSpec):
        """The grant may be collected only while it is the step's grant, and a re-run never
        executes once the attempt it re-runs has a recorded outcome, whatever the approval
        says: judged in the transaction that would start it, so that no late outcome lands
        between the look and the start. (run, late record) when the run ended instead."""
        _require_grant(tx, self.session.current.id, granted)
        late = late_record(tx.rows, asked_attempt(granted, tx.rows), known=True)
        if late is None:
            return None
        settle_approval(tx, granted, late, at)
        run = end_with_late(tx, self.run_id, self.session.current.id, (WAITING,),
                            ("awaiting_approval",), late, at, spec.terminal)
        self.gate.on_settled(tx, [self.run_id])
        return run, late

    async def run_started(self) -> dict:
        """Call the tool whose start was committed, and record what came of it. When the
        outcome cannot be recorded the lease is let go, so that the next executor takes the
        run over as cut off while executing, and StoreError is raised."""
        return self.record_outcome(await self.call_started())

    async def call_started(self) -> tuple[Observation, float]:
        """Call the tool whose start was committed; its observation, not yet recorded (a
        caller records it with record_outcome, when nothing may come in between). A call
        cancelled meanwhile is recorded at once, as cut off."""
        request, self.session._started = self.session._started, None
        if request is None:
            raise RunStateError(f"run {self.run_id}: no tool call was started")
        if self.store.in_tx():
            raise RunStateError("a tool never runs inside an open transaction: its start "
                                "must be committed first")
        spec, began, step = request.spec, time.monotonic(), self.session.current
        try:
            obs = await _call_tool(self.gate.tools[spec.name], request.args, request.value,
                                   lambda task_id, created: self._task_of(step, task_id, created))
        except asyncio.CancelledError as exc:
            self.record_outcome((_observe(spec.name, spec.timeout, exc), began))
            raise
        return obs, began

    def record_outcome(self, called: tuple[Observation, float]) -> dict:
        """Record what call_started observed; the observation, as recorded."""
        try:
            return self._record(*called)
        except (LeaseLost, RunStateError):
            raise
        except Exception as exc:
            self.session._let_go()
            raise OutcomeNotRecorded(f"run {self.run_id}: the tool ran, and its outcome "
                                     f"could not be recorded: {exc}") from exc

    def _task_of(self, step: Step, task_id: str, created: str) -> None:
        """The server runs the attempt as a task: its id, recorded at once in a transaction
        of its own (an event of the step, naming the attempt's start), so that whoever takes
        the run over can ask the server what came of it. Should it not be recorded, the
        attempt is an ordinary one: nothing else depends on the record."""
        with contextlib.suppress(StoreError):
            with self.store.tx() as tx:
                tx.event(self.run_id, step.id, self.gate.now(), TASK_EVENT,
                         {"task_id": task_id, "created_at": created,
                          "started_at": step.started_at})

    def _record(self, obs: Observation, began: float) -> dict:
        """Record a finished tool call. Needs only that this gate still owns the lease, not
        that it is unexpired; a run taken over meanwhile keeps what its new owner wrote."""
        doc, step = obs.doc, self.session.current
        spec = self.gate.tools[step.decision["tool"]].spec
        ok = doc["kind"] == TOOL_RESULT
        finished = {"duration_ms": int((time.monotonic() - began) * 1000), "tool": spec.name,
                    **({"content_hash": obs.content_hash, "summary": doc["summary"]} if ok
                       else {"error": doc["summary"]})}
        try:
            # The outcome, and the caller's own write with it, in one commit.
            with self.store.tx(synced=False):       # synced before the answer leaves
                if ok and spec.terminal:
                    self.session._settle(step, ("executing",), "done", obs, COMPLETED,
                                         "goal_completed", f"terminal tool {spec.name}",
                                         _content_bytes(obs).decode(), finished_event=finished)
                else:
                    with self.store.tx() as tx:
                        tx.require(self.run_id, (RUNNING,), self.gate.owner)
                        self.session._end_step(tx, step, ("executing",),
                                               "done" if ok else "failed", obs,
                                               self.gate.now(), finished_event=finished)
                    self.session.current = None
                if self.session.on_recorded is not None:
                    self.session.on_recorded(doc)
        except RunStateError:
            self._late(doc, obs, finished)
        return doc

    def _late(self, doc: dict, obs: Observation, finished: dict) -> None:
        """The run was cancelled or taken over while the tool ran. What came of the call is
        recorded all the same, as a late event on its step (an event needs no lease), naming
        the attempt's start and whether the outcome is known: a known outcome is never
        thrown away. A known one settles the attempt in the same transaction: an approval
        asking whether it runs again is answered by it, and its run ends (section 13)."""
        step, gate = self.session.current, self.gate
        known = bool(gate.known(finished["tool"], doc))
        late = late_event(obs, step.started_at, finished["tool"], finished["duration_ms"],
                          known)
        at = gate.now()
        with self.store.tx() as tx:
            seq = tx.event(self.run_id, step.id, at, "step.tool_finished", late)
            if known:                                   # the run's index row, with it:
                gate.on_settled(tx, [self.run_id])      # one row's update by its run id
        # Settled in a transaction of its own, so that nothing in it can cost the late event
        # itself. Should it fail, nothing is lost: whatever would act on the attempt as
        # unknown looks for the event first (section 13), and settles it then.
        if known:
            record = LateRecord(seq, self.run_id, step.id, step.started_at, at, True,
                                obs.json_text, doc)
            with contextlib.suppress(StoreError, RunStateError, NotPending):
                with self.store.tx() as tx:
                    ended = settle_attempt(tx, record, at)
                    if ended:
                        gate.on_settled(tx, ended)
        run = self.store.get_run(self.run_id)
        cancelled = run.status == CANCELLED and run.reason == "operator_cancelled"
        self.session._finish("ended" if cancelled else "lost", run)
        if not cancelled:
            raise LateOutcome(f"run {self.run_id}: the tool returned after the run was "
                              "taken over; its outcome is recorded as a late event", doc)


def late_event(obs: Observation, started_at: str, tool: str, duration_ms: int,
               known: bool) -> dict:
    """The payload of a late step.tool_finished event: what came of an attempt that was
    cut off, naming its start (LateRecord reads it)."""
    late = {"duration_ms": duration_ms, "known": known, "late": True,
            "observation": RawJSON(obs.json_text.encode()), "started_at": started_at,
            "tool": tool}
    if obs.doc["kind"] == TOOL_RESULT:
        late.update(content_hash=obs.content_hash, summary=obs.doc["summary"])
    return late


def _content_bytes(obs: Observation) -> bytes:
    """The exact bytes of an observation's content member: kept by _obs, else read from
    its stored JSON (an observation read back from a record)."""
    return obs.content if obs.content is not None else \
        member_spans(obs.json_text.encode()).get("content", b"{}")


def _grant_stale(run: Run, approval: Approval, now: float) -> bool:
    """An approved grant older than the run's grant_ttl (strictly after) executes nothing."""
    ttl = run.limits.grant_ttl
    return ttl > 0 and bool(approval.decided_at) and now > parse_time(approval.decided_at) + ttl


def _lease_live(run: Run, database: str, wall: float | None = None) -> bool:
    """Someone holds the run's lease: unexpired, judged on the wall clock only, never the
    proxy's, and its holder (section 11) not gone. Every reader asks this one function (the
    rules across calls, the gate's take-over inside its transaction, the start of a side
    effect), so that none can find a lease live that another finds gone."""
    return bool(run.lease_owner and run.lease_expires_at) and \
        parse_time(run.lease_expires_at) > (time.time() if wall is None else wall) and \
        not holder_gone(database, run.lease_owner)


def _expired(approval: Approval, now: float) -> bool:
    """A pending approval past its expiry (strictly after). An expiry that does not read as
    a time (the row was edited) is past: nothing may be approved on a date nobody can
    read, and every reader (the gate, the operator's commands, the webhook) agrees."""
    if not approval.expires_at:
        return False
    try:
        return now > parse_time(approval.expires_at)
    except (ValueError, TypeError, OverflowError, AttributeError):
        return True


def grant_covers(granted: Approval, decision: PolicyDecision, request: ToolRequest) -> bool:
    """At collection: whether the approved ``granted`` covers the policy's decision, made
    again now on the request to run. It does only when the policy asks for an approval and
    the hash of what it asks (kind, capability, presentation) and of the request (run, step,
    today's tool spec, the arguments) is the hash the operator's decision was bound to.

    Why every collection is judged here: a grant runs only through Gate._resume_waiting,
    which verifies the row (Approval.verify: its hash is its recorded contents') and builds
    the request from its record with today's spec, then _Decider._resume and _apply, which
    evaluates the policy again and calls this; nothing else makes an _Allowed with a grant.
    A policy may hand back what it asked before (the proxy's covered(), section 20, returns
    the grant's own capability and presentation when the grant asked about at least what
    asks now): the hash still covers all of it, so a decision is covered only when it is
    byte for byte what the operator approved, on the same request and spec. A deny, a new
    reason to ask or a changed spec asks again. _require_grant repeats the one part that can
    change after this look, in the transaction that starts the call."""
    return decision.outcome == "require_approval" and same_digest(
        approval_hash(decision.kind, decision.capability, decision.presentation, request),
        granted.hash)


def _require_grant(tx: Tx, step_id: str, granted: Approval) -> None:
    """Only the step's latest approval is a grant, and only while it is approved as it was
    read: another executor may have asked for a new approval between grant_covers' look
    and this, the transaction that starts the call."""
    row = tx.exec("SELECT id, status, hash FROM approvals WHERE step_id=? ORDER BY rowid DESC "
                  "LIMIT 1", (step_id,)).fetchone()
    if row is None or row[0] != granted.id or row[1] != APPROVED or \
            not same_digest(row[2], granted.hash):
        raise RunStateError(f"approval {granted.id} is no longer the step's grant")


async def in_time(aw: Awaitable, seconds: float) -> Any:
    """``await aw`` under a deadline: its result, or asyncio.TimeoutError once ``seconds``
    have passed, with what it waited for cancelled (a coroutine runs as a task of its own).
    The deadline is judged a turn of the loop after its timer fires, so that whatever that
    turn handled (an upstream's answer read by its reading task) is set first: a call
    answered in time is never recorded as timed out. A cancel of the caller cancels what it
    waited for and reaches the caller as a cancel, never as the deadline."""
    fut = asyncio.ensure_future(aw)
    loop = asyncio.get_running_loop()
    woken = loop.create_future()

    def wake(_: Any = None) -> None:
        if not woken.done():
            woken.set_result(None)
    fut.add_done_callback(wake)
    timer = loop.call_later(seconds, loop.call_soon, wake)
    try:
        await woken
    except asyncio.CancelledError:
        fut.cancel()
        raise
    finally:
        timer.cancel()
        fut.remove_done_callback(wake)
    if fut.done():
        return fut.result()
    fut.cancel()
    raise asyncio.TimeoutError()


async def _call_tool(tool: Tool, args: bytes, value: Any = NOT_PARSED,
                     on_task: Callable[[str, str], None] | None = None) -> Observation:
    """Call the tool under its timeout and turn every outcome into an observation (``value``:
    the arguments' strict parse, when the call has it). Once the
    call has returned, whatever fails in making its observation is an answer that could not
    be recorded: the call executed, and counts as executed (UNRECORDED), never as nothing."""
    name = tool.spec.name
    try:
        # A backstop just past the tool's own timeout, so that an upstream client's timeout
        # fires first and tells the server it stopped waiting.
        call = tool.call(args, value, on_task) if tool.tasks else tool.call(args, value)
        outcome: Any = await in_time(call, tool.spec.timeout + TOOL_TIMEOUT_SLACK)
    except Exception as exc:     # an outcome too, observed below; a cancel (BaseException) is not
        outcome = exc
    try:
        return _observe(name, tool.spec.timeout, outcome)
    except Exception as exc:
        return _observe(name, tool.spec.timeout, AnswerUnreadable(
            f"the answer could not be recorded ({type(exc).__name__})"))


def _observe(name: str, timeout: float, result: Any) -> Observation:
    """The one classifier of how a tool call ended. The observation of what it came to (its
    result, or what it raised) records its ending in its content, decided from what happened
    (the type of what was raised, the answer), never from text; _known_outcome and
    unknown_ending read only that. Every way a call can end reaches it:
    - the call returned or raised: _call_tool hands that here (what fails here, after an
      answer, it records UNREADABLE). The upstream client's endings arrive as ToolFailure
      with theirs (UpstreamTool.call: an error answer ANSWERED; a refusal before sending, or
      NotSent, NOT_SENT; a connection lost, a protocol error or a server that died mid-call
      NO_ANSWER), or as the deadline (TIMED_OUT). Anything else is a tool's own bug:
      NO_ANSWER.
    - the caller was cancelled while the tool ran: _StepExecution.call_started hands the cancel
      here (CUT_OFF, recorded interrupted).
    - the proxy crashed or stalled past its lease: nothing returns. The executor that takes
      the run over (Gate._take_over_claimed) marks the step interrupted while executing,
      which _last_attempt reads as CUT_OFF and _Decider._after_interruption pauses on an
      operator's approval."""
    if isinstance(result, asyncio.CancelledError):
        err = "the caller was cancelled while the tool ran"
        return _obs(INTERRUPTED_OBS, {"ending": CUT_OFF, "error": err, "failure": "cancelled",
                                      "tool": name},
                    f"{name} was cancelled; its outcome is unknown: {err}")
    if isinstance(result, asyncio.TimeoutError):
        err = f"no answer within {fmt_duration(timeout)}"
        return _obs(TOOL_ERROR, {"ending": TIMED_OUT, "error": err, "failure": "timeout",
                                 "tool": name}, f"{name} timeout: {err}")
    if isinstance(result, ToolFailure):
        return _obs(TOOL_ERROR, {"ending": result.ending, "error": str(result),
                                 "failure": "error", "tool": name}, f"{name} error: {result}")
    if isinstance(result, AnswerUnreadable):
        return _obs(TOOL_ERROR, {"ending": UNREADABLE, "error": str(result),
                                 "failure": "invalid_content", "tool": name},
                    f"{name} answered, and its answer could not be recorded")
    if isinstance(result, Exception):   # a tool's own bug is recorded as its failure, never lost
        return _obs(TOOL_ERROR, {"ending": NO_ANSWER, "error": f"panic: {result!r}",
                                 "tool": name}, f"{name} panicked")
    if not isinstance(result, ToolResult) or not isinstance(result.content, bytes):
        return _obs(TOOL_ERROR, {"ending": NO_ANSWER, "error": f"the tool returned "
                                 f"{type(result).__name__}, not a ToolResult", "tool": name},
                    f"{name} panicked")
    content = result.content.strip(JSON_WS) or b"{}"
    try:
        value = parse_json(content) if result.value is NOT_PARSED else result.value
    except JSONError as exc:
        err = f"content is not usable JSON: {exc}"
        try:
            kept = {"content": content.decode("utf-8")}
        except UnicodeDecodeError:
            kept = {"content_base64": base64.b64encode(content).decode()}
        return _obs(TOOL_ERROR, {**kept, "ending": UNREADABLE, "error": err,
                                 "failure": "invalid_content", "tool": name},
                    f"{name} returned content is not usable JSON: {exc}")
    text = result.text if isinstance(result.text, str) else None
    return _obs(TOOL_RESULT, content, result.summary, text, value)


def _known_outcome(doc: dict) -> bool:
    """Whether an observation is a known outcome: a result, or an error whose recorded
    ending (_observe) is known. An ending not recorded (an observation written before it
    was) is not known: an operator is asked."""
    content = doc.get("content")
    return doc.get("kind") == TOOL_RESULT or (
        doc.get("kind") == TOOL_ERROR and isinstance(content, dict) and
        content.get("ending") in KNOWN_ENDINGS)


def unknown_ending(tool, obs: dict) -> str | None:
    """How a mutating call's error leaves its outcome, read from the ending its observation
    records (_observe, the one classifier): None when known (the server answered, or
    nothing was sent), else TIMED_OUT or NO_ANSWER. An error recorded without an ending
    (written before endings were) is NO_ANSWER: an operator is asked."""
    if tool is None:
        return NO_ANSWER
    if tool.spec.side_effect == "read_only" or obs.get("kind") != TOOL_ERROR or \
            _known_outcome(obs):
        return None
    content = obs.get("content")
    return TIMED_OUT if isinstance(content, dict) and content.get("ending") == TIMED_OUT \
        else NO_ANSWER


def _limit_hit(run: Run, steps: list[Step]) -> tuple[str, str, dict | None] | None:
    """The limit that stops the next step, checked in the runtime's order."""
    lim = run.limits
    if run.step_count >= lim.max_steps:
        return "limit_steps", f"step limit {lim.max_steps} reached", None
    failures = next((i for i, s in enumerate(reversed(steps))
                     if s.observation is None or s.obs_kind == TOOL_RESULT), len(steps))
    if failures >= lim.max_consecutive_tool_failures:
        return "repeated_tool_failures", f"{failures} consecutive failed steps", None
    sigs = []
    for s in reversed(steps):
        d = s.decision or {}
        if d.get("kind") != "tool_call" or s.observation is None or \
                s.obs_kind == INVALID_DECISION:
            break
        sigs.append((d.get("tool", ""), content_hash(s.args or b"{}"), s.observation_hash))
    repeats = next((i for i, sig in enumerate(sigs) if sig != sigs[0]), len(sigs))
    if sigs and repeats >= lim.loop_threshold:
        tool, args_hash, obs_hash = sigs[0]
        return "loop_detected", (f"tool {tool} produced the same observation {repeats} times "
                                 "in a row"), {"args_hash": args_hash, "observation_hash": obs_hash,
                                               "repeats": repeats, "tool": tool}
    return None


# ==== 13. Decisions and late outcomes ====
# Approve and reject bound to the view of the approval the operator was shown; cancel; and
# expiry. Each is one transaction with its events; none executes anything. A late outcome
# answers the interruption approvals that ask about its attempt: they are settled, and
# nothing decides or runs them afterwards.

# -- what came of an attempt that was cut off --
# A tool call whose run was taken over or cancelled while it ran may still return. What it
# came to is then recorded as a late step.tool_finished event on its step, naming the
# attempt's start and whether the outcome is known (_StepExecution._late). A known late outcome
# settles the attempt: every interruption approval still asking about it (pending, or
# approved and not collected) is settled, and its run ends with that outcome, in the
# transaction that records it (settle_attempt). Whatever would act on the attempt as
# unknown afterwards looks for it first, inside its own transaction: the pause that would
# ask (_Decider._pause), the collection that would run it again (_StepExecution.start), an
# operator's decision (decide_approval), and the rules across calls (last_attempt). Stricter
# than the reference, which leaves such an approval pending and approvable.

Query = "Callable[[str, tuple], list]"     # Store._read, or Tx.rows inside a transaction


def _named_in(capability: bytes, key: str, read: Callable[[bytes], Any]) -> dict | None:
    """The object a capability names under ``key`` (read by ``read``), or None."""
    try:
        cap = read(capability)
    except JSONError:
        return None
    found = cap.get(key) if isinstance(cap, dict) else None
    return found if isinstance(found, dict) else None


def repeat_in(approval: Approval) -> dict | None:
    """The earlier execution a repeat approval names, from its capability."""
    return _named_in(approval.capability, "repeat_of", read_own)


def _interrupted_attempt(approval: Approval | None) -> dict | None:
    """The earlier attempt an interruption approval names, from its capability ({run_id,
    step_id, started_at, ended}), or None."""
    if approval is None or approval.kind != INTERRUPTED_KIND:
        return None
    return _named_in(approval.capability, "interrupted", loads_own)


def asked_attempt(approval: Approval | None, q: Query) -> dict | None:
    """The attempt an interruption approval asks about: the one its capability names, else
    (a gate's own pause, whose capability names none) the latest attempt of the step it waits
    on, which is the one its start in the store names while the approval waits (a re-run
    after the approval would start another; read through ``q``)."""
    named = _interrupted_attempt(approval)
    if named is not None or approval is None or approval.kind != INTERRUPTED_KIND:
        return named
    rows = q("SELECT started_at FROM steps WHERE id=?", (approval.step_id,))
    return {"run_id": approval.run_id, "step_id": approval.step_id,
            "started_at": rows[0][0] if rows and isinstance(rows[0][0], str) else ""}


@dataclasses.dataclass(frozen=True, repr=False)
class LateRecord:
    """A late step.tool_finished event: the attempt it ends, when, and what it says."""
    seq: int
    run_id: str
    step_id: str
    started_at: str
    at: str
    known: bool
    observation: str               # the observation as recorded, JSON text
    doc: dict

    def answers(self, attempt: dict) -> bool:
        """Whether this outcome is of ``attempt``: of its run's step, and of that very attempt
        when the event names its start (a step re-run after an approval is another attempt
        of it)."""
        return attempt.get("run_id") == self.run_id and attempt.get("step_id") == \
            self.step_id and (not self.started_at or attempt.get("started_at") == self.started_at)

    def outcome(self) -> str:
        return "it succeeded" if self.doc.get("kind") == TOOL_RESULT else \
            f"it failed: {clean(error_text(self.doc), REASON_BYTES)}"

    def text(self) -> str:
        try:
            when = fmt_time_s(parse_time(self.at))
        except (ValueError, TypeError, OverflowError):
            when = clean(str(self.at), CLI_BAD_TIME_WIDTH)
        return f"finished after it was cut off, at {when}: {self.outcome()}"


def _late_of(seq: Any, run_id: str, step_id: str, at: Any, payload: Any) -> LateRecord | None:
    try:                                    # a payload not text: AttributeError
        doc, spans = read_members(payload.encode("utf-8"))    # not an object: JSONError
    except (JSONError, UnicodeError, AttributeError):
        return None
    obs, flag, start = doc.get("observation"), doc.get("known"), doc.get("started_at")
    if doc.get("late") is not True or "observation" not in spans or not isinstance(obs, dict):
        return None
    # An event written before it said whether it is known: a result is, anything else is
    # left to the operator (who is shown it).
    known = flag if isinstance(flag, bool) else obs.get("kind") == TOOL_RESULT
    return LateRecord(seq if isinstance(seq, int) else 0, run_id, step_id,
                      start if isinstance(start, str) else "", str(at), known,
                      spans["observation"].decode("utf-8"), obs)


def late_record(q: Query, attempt: dict | None, known: bool = False) -> LateRecord | None:
    """The newest late outcome recorded for ``attempt`` (LateRecord.answers). With ``known``,
    only an outcome that is known. None when there is none. The events of one run are few,
    read through the index events_run."""
    run_id, step_id = (attempt or {}).get("run_id"), (attempt or {}).get("step_id")
    if not isinstance(run_id, str) or not isinstance(step_id, str):
        return None
    for seq, at, payload in q("SELECT seq, at, payload_json FROM events WHERE run_id=? AND "
                              "step_id=? AND type='step.tool_finished' ORDER BY seq DESC",
                              (run_id, step_id)):
        late = _late_of(seq, run_id, step_id, at, payload)
        if late is not None and (late.known or not known) and late.answers(attempt):
            return late
    return None


def end_with_late(tx: Tx, run_id: str, step_id: str, from_run: tuple, from_steps: tuple,
                  late: LateRecord, at: str, terminal: bool, owner: str = "") -> Run:
    """End a run whose open step would re-run (or ask about) an attempt with a known late
    outcome: the step records that outcome, and the run ends with it, as it would have had
    the outcome come in time (a terminal tool's result completes its run). The step records
    the late observation naming where it came from."""
    doc, spans = read_members(late.observation.encode("utf-8"))
    doc["content"] = RawJSON(spans.get("content", b"{}"))
    doc["late"] = {"at": late.at, "run_id": late.run_id, "step_id": late.step_id}
    text = dump_json(doc)
    obs = Observation(read_own(text), text, str(doc.get("content_hash", "")))
    ok = obs.doc.get("kind") == TOOL_RESULT
    tx.update_step(step_id, from_steps, status="done" if ok else "failed", finished_at=at,
                   observation_json=obs.json_text, observation_hash=obs.content_hash)
    detail = f"the attempt in run {late.run_id}, step {late.step_id}, {late.text()}"
    if not ok:
        tx.event(run_id, step_id, at, "step.failed",
                 {"content_hash": obs.content_hash, "detail": detail,
                  "observation": obs.doc.get("kind")})
    status, reason = (COMPLETED, "goal_completed") if ok and terminal else (FAILED, "goal_failed")
    return _end_run(tx, run_id, from_run, status, reason, detail, at, owner=owner,
                    result=_content_bytes(obs).decode() if status == COMPLETED else "")


def _end_run(tx: Tx, run_id: str, from_run: tuple, status: str, reason: str, detail: str,
             at: str, by: str = "", **cols: str) -> Run:
    """Move a run to its end and record its run.finished event, in the caller's
    transaction."""
    run = tx.transition(run_id, from_run, status, reason=reason, detail=detail,
                        finished_at=at, **cols)
    said = {"detail": detail, "reason": reason, "status": status, "steps": run.step_count}
    tx.event(run_id, "", at, "run.finished", {"by": by, **said} if by else said)
    return run


def _decided(tx: Tx, approval: Approval, status: str, at: str, by: str, note: str,
             only: str = "", *held: Any, **said: Any) -> bool:
    """Write a decision onto ``approval`` while ``only`` (a fixed condition, its values
    ``held``) still holds of its row, with its approval.decided event (``said`` adds to
    it); False, and nothing written, when it no longer held."""
    cur = tx.exec("UPDATE approvals SET status=?, decided_at=?, decided_by=?, note=? "
                  f"WHERE id=?{only}", (status, at, by, note, approval.id, *held))
    if cur.rowcount == 1:
        tx.event(approval.run_id, approval.step_id, at, "approval.decided",
                 {"approval_id": approval.id, "by": by, "note": note, **said, "status": status})
    return cur.rowcount == 1


def settle_approval(tx: Tx, approval: Approval, late: LateRecord, at: str) -> None:
    """Mark an interruption approval settled by the late outcome, with an event naming it."""
    note = clean(f"the attempt it asks about {late.text()}", NOTE_BYTES)
    if not _decided(tx, approval, SETTLED_APPROVAL, at, SETTLED_BY, note,
                    " AND status IN (?,?)", PENDING, APPROVED, late_outcome={
                        "at": late.at, "run_id": late.run_id, "seq": late.seq,
                        "step_id": late.step_id}):
        raise NotPending(f"approval {approval.id} is no longer pending or approved")


# Interruption approvals that may still lead to a re-run: pending or approved, each its
# step's latest, on a run that waits. From the partial index runs_waiting: what waits.
_ASKING_SQL = (
    f"SELECT {_APPROVAL_COLS} FROM approvals WHERE rowid IN (SELECT a.rowid"
    f" FROM runs AS r CROSS JOIN approvals AS a ON a.run_id = r.id"
    " CROSS JOIN steps AS s ON s.id = a.step_id"
    f" WHERE r.status = '{WAITING}' AND s.status = 'awaiting_approval'"
    f" AND a.kind = '{INTERRUPTED_KIND}' AND a.status IN"
    f" ('{PENDING}', '{APPROVED}') AND a.rowid = (SELECT MAX(b.rowid) FROM approvals AS b"
    " WHERE b.run_id = a.run_id AND b.step_id = a.step_id)) ORDER BY rowid")


def _settle_waiting(tx: Tx, approval: Approval, late: LateRecord, at: str) -> None:
    """Settle the interruption approval a run waits on, and end the run with the outcome."""
    settle_approval(tx, approval, late, at)
    try:
        terminal = approval.request().spec.terminal
    except (ProxyError, KeyError, ValueError, TypeError):
        terminal = False
    end_with_late(tx, approval.run_id, approval.step_id, (WAITING,), ("awaiting_approval",),
                  late, at, terminal)


def settle_attempt(tx: Tx, late: LateRecord, at: str) -> list[str]:
    """A known late outcome answers every approval asking about its attempt, in this run or
    in a fresh run of the same request: each is settled and its run ends with the outcome.
    Returns the runs it ended."""
    ended = []
    for row in tx.rows(_ASKING_SQL):
        approval = _approval_from_row(row)
        if late.answers(asked_attempt(approval, tx.rows) or {}):
            _settle_waiting(tx, approval, late, at)
            ended.append(approval.run_id)
    return ended


# -- the view of an approval: what every channel shows, and what a decision is bound to --

@dataclasses.dataclass(frozen=True, repr=False)
class ApprovalView:
    """Everything the store holds that bears on deciding one approval: the approval, its
    run, the attempt it asks about and any late outcome of that attempt, the policy's
    reason, the grant's lapse. Every channel (approve and reject, pending, the inbox, the
    webhook, on_pending, show, the status tool) shows what it shows from this, and a
    decision is bound to its digest: if anything in it changed between showing and
    deciding, nothing is decided. The approval row's own hash, which binds the exact
    request, is part of it and stays in the record as the seed defines it. Beside it the
    channels show the tool's limits as they stand (limits_now, section 20): read at each
    showing and deliberately not part of it, since any payment would move them and void
    every answer."""
    approval: Approval
    run: Run | None
    attempt: dict | None
    late: LateRecord | None
    reason: str
    grant_lapses: str

    def bound(self) -> dict:
        a, run, late = self.approval, self.run, self.late
        return {
            "approval": {k: str(getattr(a, k)) for k in (
                "id", "run_id", "step_id", "kind", "status", "hash", "created_at",
                "expires_at", "decided_at", "decided_by", "note")},
            "run": None if run is None else {"id": str(run.id), "status": str(run.status),
                                             "reason": str(run.reason)},
            "attempt": None if self.attempt is None else
            {k: str(v) for k, v in sorted(self.attempt.items())},
            "late": None if late is None else {"seq": str(late.seq), "at": late.at,
                                               "known": late.known, "outcome": late.outcome()},
            "reason": str(self.reason), "grant_lapses": self.grant_lapses}

    @property
    def digest(self) -> str:
        return sha256_hex(encode_canonical(self.bound()))

    def late_text(self) -> str:
        return self.late.text() if self.late is not None else ""

    def changes(self, now: "ApprovalView") -> list[str]:
        """What differs in ``now``, one phrase a part, for an operator told nothing was
        decided."""
        was, is_ = self.bound(), now.bound()
        said = [f"{part} {k} was {clean(str((was[part] or {}).get(k)), ID_SHOWN)}, is "
                f"{clean(str(v), ID_SHOWN)}" for part in ("approval", "run")
                for k, v in sorted((is_[part] or {}).items()) if (was[part] or {}).get(k) != v]
        if was["late"] != is_["late"]:
            said.append(f"the attempt it asks about {now.late_text()}" if now.late else
                        "the late outcome shown is gone")
        said += [f"its {part.replace('_', ' ')} changed" for part in
                 ("attempt", "reason", "grant_lapses") if was[part] != is_[part]]
        return said or ["its record changed"]


def _step_reason(q: Query, step_id: str) -> str:
    rows = q("SELECT policy_json FROM steps WHERE id=?", (step_id,))
    with contextlib.suppress(JSONError, TypeError, AttributeError):    # not an object: ""
        reason = loads_own(rows[0][0]).get("reason", "") if rows and rows[0][0] else ""
        return reason if isinstance(reason, str) else ""
    return ""


def approval_view(q: Query, approval: Approval) -> ApprovalView:
    """The view of ``approval`` from the store (``q``: Store._read, or Tx.rows to read it
    inside the transaction that decides)."""
    rows = q(f"SELECT {_RUN_COLS} FROM runs WHERE id=?", (approval.run_id,))
    run = _run_from_row(rows[0]) if rows else None
    attempt = asked_attempt(approval, q)
    lapses = ""
    if approval.status == APPROVED and run is not None and run.limits.grant_ttl > 0:
        with contextlib.suppress(ValueError, TypeError, OverflowError):
            lapses = fmt_time(parse_time(approval.decided_at) + run.limits.grant_ttl)
    return ApprovalView(approval, run, attempt, late_record(q, attempt),
                        _step_reason(q, approval.step_id), lapses)


def view_of(store: Store, approval: Approval) -> ApprovalView:
    return approval_view(store._read, approval)


def late_outcome(store: Store, approval: Approval) -> str:
    """What the attempt an interruption approval asks about came to, when its tool returned
    after the attempt was cut off and a late event records it; '' otherwise."""
    return view_of(store, approval).late_text()


def expire_approval(store: Store, approval: Approval, now: str) -> Run:
    """Expire a pending approval or a stale grant and cancel its run."""
    with store.tx() as tx:
        cur = tx.exec("UPDATE approvals SET status=?, decided_at=CASE WHEN status=? THEN ? "
                      "ELSE decided_at END, note=CASE WHEN status=? THEN 'expired' ELSE note END "
                      "WHERE id=? AND status IN (?,?)",
                      (EXPIRED, PENDING, now, PENDING, approval.id, PENDING, APPROVED))
        if cur.rowcount != 1:
            raise NotPending(f"approval {approval.id} is no longer pending or approved")
        # The run's end refuses a run no longer waiting, and the whole transaction with it.
        tx.event(approval.run_id, approval.step_id, now, "approval.decided",
                 {"approval_id": approval.id, "status": EXPIRED})
        return _end_run(tx, approval.run_id, (WAITING,), CANCELLED, "approval_expired",
                        f"approval {approval.id} expired", now)


def operator_word(approval: Approval, approve: bool, given: str | None) -> str:
    """What a decision records of the attempt it is about: for the rejection of an
    interruption approval, the outcome the operator gives (unknown unless given); for any
    other decision, nothing, and an outcome given to one is refused (UsageError) before
    anything is decided: only an interruption approval asks about an attempt."""
    if given and given not in OPERATOR_OUTCOMES:
        raise UsageError(f"outcome {sanitize(given)!r} is not one of "
                         f"{', '.join(OPERATOR_OUTCOMES)}; nothing was decided")
    asks = approval.kind == INTERRUPTED_KIND and not approve
    if given and not asks:
        what = "an approval" if approve else f"a rejection of a {sanitize(approval.kind)} approval"
        raise UsageError(f"approval {approval.id}: an outcome says what came of a cut-off "
                         f"attempt, and only the rejection of an {INTERRUPTED_KIND} approval "
                         f"records one, not {what}; nothing was decided")
    return (given or OUTCOME_UNKNOWN) if asks else ""


def decide_approval(store: Store, run_id: str, approval_id: str, approve: bool, by: str,
                    note: str, shown_hash: str, now: float,
                    view: "ApprovalView | str", outcome: str = "") -> tuple[Approval, Run]:
    """Approve or reject the approval the operator was shown: bound to its hash (the exact
    request, as the seed binds it) and to ``view``, the view it was shown from (an
    ApprovalView, or its digest): if anything in it changed, nothing is decided and the
    refusal says what. Every caller names the view it showed; '' is its word that it showed
    the hash alone (a webhook decision sent without the GET's view). An interruption approval
    whose attempt has a known late outcome is never approved: it is settled, and the refusal
    names the outcome (AttemptSettled). Its rejection records ``outcome``, the operator's
    word on the attempt (operator_word), with the decision: in the proxy's own table, which
    a rejection first brings to this build's version, as a proxy's start does (a newer one
    is refused, and nothing is decided)."""
    run = store.get_run(run_id)
    approval = store.find_approval(approval_id)
    word = operator_word(approval, approve, outcome) if approval is not None else ""
    if word:
        CallIndex(store, "").migrate(now)
    mine = approval is not None and approval.run_id == run_id
    if mine and approval.status == SETTLED_APPROVAL:
        _check_shown(approval, shown_hash)          # names the late outcome that settled it
    if run.status != WAITING:
        raise RunStateError(f"run {run_id} is {run.status}, not waiting for approval")
    if not mine:
        raise NotFound(f"approval {approval_id} " + ("not found" if approval is None else
                                                      f"is not an approval of run {run_id}"))
    _check_shown(approval, shown_hash)
    if _expired(approval, now):
        expire_approval(store, approval, fmt_time(now))
        raise ApprovalExpired(f"approval {approval_id} expired at {approval.expires_at}")
    at = fmt_time(now)
    with store.tx() as tx:
        tx.require(run_id, (WAITING,))
        current = _approval_from_row(tx.rows(f"SELECT {_APPROVAL_COLS} FROM approvals "
                                             "WHERE id=?", (approval_id,))[0])
        _check_shown(current, shown_hash)
        attempt = asked_attempt(current, tx.rows)
        late = late_record(tx.rows, attempt, known=True)
        if late is not None:
            _settle_waiting(tx, current, late, at)
        else:
            _check_view(tx, current, view)
            _decide_in(tx, current, approve, by, note, at)
            if word:
                record_outcome(tx, current, attempt, word, by, at)
    if late is not None:
        raise AttemptSettled(f"approval {approval_id} is settled, and nothing runs: the "
                             f"attempt it asks about {late.text()}")
    return store.get_approval(approval_id), store.get_run(run_id)


def _check_view(tx: Tx, approval: Approval, shown: "ApprovalView | str") -> None:
    """Refuse a decision on a view that is no longer the store's, saying what changed."""
    if not shown:
        return
    now = approval_view(tx.rows, approval)
    digest = shown.digest if isinstance(shown, ApprovalView) else shown
    if same_digest(now.digest, digest):
        return
    said = shown.changes(now) if isinstance(shown, ApprovalView) else \
        [f"the attempt it asks about {now.late_text()}" if now.late else "its record changed"]
    raise ApprovalChanged("; ".join(said))


def _decide_in(tx: Tx, approval: Approval, approve: bool, by: str, note: str, at: str) -> None:
    if not _decided(tx, approval, APPROVED if approve else REJECTED, at, by, note,
                    " AND status=? AND hash=?", PENDING, approval.hash):
        raise ApprovalChanged(f"approval {approval.id} changed after it was shown")
    if not approve:
        obs = _obs(POLICY_DENIED, {"approval_id": approval.id, "note": note},
                   f"approval rejected: {note}")
        tx.exec("UPDATE steps SET status='failed', observation_json=?, observation_hash=?, "
                "finished_at=? WHERE id=?", (obs.json_text, obs.content_hash, at, approval.step_id))
        _end_run(tx, approval.run_id, (WAITING,), CANCELLED, "approval_rejected", note, at)


def _check_shown(approval: Approval, shown_hash: str) -> None:
    if approval.status == EXPIRED:
        raise ApprovalExpired(f"approval {approval.id} is already expired")
    if approval.status == SETTLED_APPROVAL:
        raise AttemptSettled(f"approval {approval.id} is settled, and nothing runs: "
                             f"{sanitize(approval.note)}")
    if approval.status != PENDING:
        raise NotPending(f"approval {approval.id} is already {approval.status}")
    if not shown_hash:
        raise ApprovalChanged(f"approval {approval.id}: no hash was shown")
    if not same_digest(approval.hash, shown_hash):
        raise ApprovalChanged(f"approval {approval.id} is not the one that was shown")
    approval.verify()


def cancel_run(store: Store, run_id: str, by: str, note: str, now: float,
               reason: str = "operator_cancelled", ending: tuple = (RUNNING, WAITING),
               pending: str = "") -> Run:
    """End a run that has not finished (one of ``ending``); a tool already running is not
    interrupted. ``reason``: an operator's cancel, or a host's withdrawal (section 23.1) of
    the approval ``pending``, which must still be pending (RunStateError if not)."""
    run = store.get_run(run_id)
    if run.status in TERMINAL:
        raise RunStateError(f"run {run_id} is already {run.status}")
    at = fmt_time(now)
    with store.tx() as tx:
        tx.require(run_id, ending)
        if pending and tx.rows("SELECT status FROM approvals WHERE id=?", (pending,)) != \
                [(PENDING,)]:
            raise RunStateError(f"approval {pending} is no longer pending")
        obs = _obs(INTERRUPTED_OBS, {"by": by, "note": note},
                   f"cancelled by operator: {note}" if reason == "operator_cancelled" else note)
        tx.exec("UPDATE steps SET status='failed', observation_json=?, observation_hash=?, "
                "finished_at=? WHERE run_id=? AND status IN ('deciding','awaiting_approval',"
                "'executing')", (obs.json_text, obs.content_hash, at, run_id))
        # What a cancel ends: the run's pending approval is marked cancelled, with an event,
        # so that nothing reads it as waiting (stricter than the reference: see
        # CANCELLED_APPROVAL). A grant already approved keeps its status: it was approved,
        # and the run's end says why it was never collected.
        for row in tx.rows(f"SELECT {_APPROVAL_COLS} FROM approvals WHERE run_id=? AND "
                           "status=? ORDER BY rowid", (run_id, PENDING)):
            _decided(tx, _approval_from_row(row), CANCELLED_APPROVAL, at, by, note)
        return _end_run(tx, run_id, ending, CANCELLED, reason, note, at, by=by)


# ==== 14. JSON-RPC framing ====
# Newline-delimited JSON-RPC 2.0 over bytes. A message is parsed leniently for routing (its
# method, id and params), and the exact bytes of its members are kept: the host's
# ``params.arguments`` and an upstream's ``result`` are judged later, strictly, as sent.

MAX_FRAME = 16 * 1024 * 1024          # one message, on stdio or in an HTTP body
# A message or arguments longer than this are parsed and judged on a worker thread: that
# work is linear in their size, and the event loop goes on answering meanwhile.
OFFLOAD_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024                 # bytes read from the host's input at a time
WRITE_DRAIN = 5.0                      # seconds at exit for answers still being written
# A message is read deeper than the gate accepts, so that arguments or content nested past
# MAX_DEPTH reach the gate and are recorded as refused (INVALID arguments; content the server
# answered with) rather than lost; past this the line is not JSON-RPC we can route.
ENVELOPE_DEPTH = 4 * MAX_DEPTH
PARAMS_LEVELS = 2                      # a params member's value: inside the message and params
UPSTREAM_DEPTH = ENVELOPE_DEPTH
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND = -32700, -32600, -32601
INVALID_PARAMS, INTERNAL_ERROR = -32602, -32603
UNSUPPORTED_VERSION = -32022
MODERN_VERSION = "2026-07-28"
LEGACY_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT = "io.modelcontextprotocol/clientInfo"
META_SERVER = "io.modelcontextprotocol/serverInfo"
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"           # MCP tasks, 2026-07-28 (23.1)
META_RELATED_TASK = "io.modelcontextprotocol/related-task"
PROXY_VERSION = "0.1.0"


class ProtocolError(ProxyError):
    """A peer broke the protocol, or a JSON-RPC request failed."""

    def __init__(self, msg: str, code: int = INTERNAL_ERROR, data: Any = None):
        super().__init__(msg)
        self.code, self.data = code, data


@dataclasses.dataclass(repr=False)
class Message:
    """One JSON-RPC message: its lenient parse and the exact bytes of its members."""
    doc: dict
    text: str                                    # the line, decoded with surrogateescape
    spans: dict[str, tuple[int, int]]            # top-level members
    params_spans: dict[str, tuple[int, int]]     # members of params, when it is an object
    inner: dict[str, dict[str, tuple[int, int]]]  # members of each top-level object member
    strict_at: frozenset[int] = frozenset()      # judged members' values read strict
    judged: str = "params"                       # a request's params, an answer's result

    def parsed(self, name: str, member: str = "params") -> Any:
        """The value of ``member``'s member ``name`` when the message's one read judged
        ``member`` (a request's params, a server's result) and found those bytes strict
        JSON (parse_json of them gives this value, to be only read); else NOT_PARSED: they
        are then parsed on their own, for the exact refusal."""
        span = self.inner.get(member, {}).get(name) if member == self.judged else None
        return self.doc[member][name] if span is not None and span[0] in self.strict_at \
            else NOT_PARSED

    def raw(self, name: str, in_params: bool = False) -> bytes | None:
        """The bytes of a member as they were sent, or None when it is absent."""
        span = (self.params_spans if in_params else self.spans).get(name)
        return None if span is None else \
            self.text[span[0]:span[1]].encode("utf-8", "surrogateescape")

    def inner_spans(self, name: str) -> dict[str, bytes]:
        """The bytes of each member of the top-level member ``name``, an object, found
        without parsing it again; a byte that was not UTF-8 reads as U+FFFD."""
        return {k: self.text[a:b].encode("utf-8", "surrogateescape").decode(
                    "utf-8", "replace").encode("utf-8")
                for k, (a, b) in self.inner.get(name, {}).items()}

    @property
    def method(self) -> str | None:
        m = self.doc.get("method")
        return m if isinstance(m, str) else None

    @property
    def params(self) -> dict:
        p = self.doc.get("params")
        return p if isinstance(p, dict) else {}

    @property
    def has_id(self) -> bool:
        return "id" in self.doc and self.doc["id"] is not None

    def id_value(self) -> Any:
        """The id to echo: the same JSON value when it is a string or a number, else null.
        It is written again by the proxy's encoder, never copied: a number keeps its literal
        (which has no room for anything but digits, a sign, a point and an exponent), a string
        is escaped the proxy's way. A string holding bytes that were not UTF-8 is no id we
        can echo."""
        ident = self.doc.get("id")
        return ident if isinstance(ident, Num) or (
            isinstance(ident, str) and not _SURROGATES.search(ident)) else None


def parse_message(line: bytes, max_depth: int = ENVELOPE_DEPTH, judged: str = "params",
                  ) -> Message:
    """Parse one frame. Bytes that are not UTF-8 are kept (they may sit inside arguments,
    which the gate then refuses as INVALID); anything that is not a JSON object raises.
    The one read also tells which members of ``judged`` (a request's params, a server's
    result) are strict JSON (Message.parsed): within MAX_DEPTH below it, UTF-8, and
    without a fault the strict parser refuses."""
    inner_depth = MAX_DEPTH + PARAMS_LEVELS
    at = _depth_exceeds(line, min(max_depth, inner_depth))
    within = at is None
    if not within and max_depth > inner_depth:
        at = _depth_exceeds(line, max_depth)
    if at is not None:
        raise JSONError(f"nested deeper than {max_depth} levels", line, at)
    try:
        text, bad = line.decode("utf-8"), []
    except UnicodeDecodeError:
        text = line.decode("utf-8", "surrogateescape")
        bad = [m.start() for m in _SURROGATES.finditer(text)]
    # the message's members' spans, and those of each of its objects
    clean: set[int] = set()
    # A server's result is read with its objects' members sorted: the order the record
    # keeps its structured content in (policy form), so the value is recorded as it is read.
    doc, spans, inner = _read_object(line, text, 2, clean, judged, judged == "result")
    if not isinstance(doc, dict):
        raise ProtocolError("not a JSON-RPC message: expected an object", INVALID_REQUEST)
    strict = frozenset(a for a, b in inner.get(judged, {}).values()
                       if within and a in clean and not _any_in(bad, a, b))
    return Message(doc, text, spans, inner.get("params", {}), inner, strict, judged)


def server_message(line: bytes) -> Message:
    """A server's frame, read once. A frame that can hold structured content the gate
    keeps (at most STRUCTURED_READ_LIMIT) has its result judged: read under the strict
    parser's hooks, its objects' members sorted as the record keeps them, so that the
    content's value is that read's (map_result). A longer one is read as a host's message
    is (its params judged): what its result holds is either never kept or read again from
    its own bytes, and the strict hooks would cost the event loop a call per object."""
    return parse_message(line, UPSTREAM_DEPTH,
                         "result" if len(line) <= STRUCTURED_READ_LIMIT else "params")


def rpc_request(msg_id: int, method: str, params: Any) -> bytes:
    return (dump_json({"jsonrpc": "2.0", "id": msg_id, "method": method,
                       "params": params}) + "\n").encode()


def rpc_notification(method: str, params: Any) -> bytes:
    return (dump_json({"jsonrpc": "2.0", "method": method, "params": params}) + "\n").encode()


# A lone surrogate in text decoded from JSON (the strict parser refuses one in the
# arguments; elsewhere it is replaced before it is recorded or shown).
_SURROGATES = re.compile("[\ud800-\udfff]")


def rpc_result(msg_id: Any, result: Any) -> bytes:
    return (dump_json({"jsonrpc": "2.0", "id": msg_id, "result": result}) + "\n").encode()


def rpc_error(msg_id: Any, code: int, message: str, data: Any = None) -> bytes:
    err = {"code": code, "message": message, **({} if data is None else {"data": data})}
    return (dump_json({"jsonrpc": "2.0", "id": msg_id, "error": err}) + "\n").encode()


def error_code(exc: BaseException) -> int:
    """The one place a JSON-RPC error code is chosen for an exception."""
    if isinstance(exc, ProtocolError):
        return exc.code
    if isinstance(exc, JSONError):             # first: it is a ValueError too
        return PARSE_ERROR
    return INVALID_PARAMS if isinstance(exc, (SchemaError, ValueError)) else INTERNAL_ERROR


# ==== 15. Upstream client (stdio) ====
# The proxy as an MCP client of each real server: the protocol, and the stdio transport
# (streamable HTTP is section 16). The era is
# probed per server (server/discover, falling back to initialize on any error or timeout)
# and kept for the connection. Requests a server sends the proxy are refused, its
# notifications ignored but for a change of its tools (section 25). Every wait is bounded;
# nothing is read past MAX_FRAME.

STDERR_TAIL = 4096
STDERR_WAIT = 2.0
CLOSE_WAIT = 5.0                      # each step of: close stdin, SIGTERM, SIGKILL
# A server runs in a process group of its own, killed whole at close (what it started too).
# Popen sets the group itself from Python 3.11 (process_group=0); before that a new session
# (start_new_session, done before exec like setpgid) makes the group, and drops a terminal
# the server never needed.
POPEN_PROCESS_GROUP = sys.version_info >= (3, 11)
DISCOVER_TIMEOUT = 5.0                # the era probe, within the connect deadline
DEFAULT_CONNECT_TIMEOUT = 30.0
HTTP_POOL = 4                         # idle keep-alive connections per HTTP server
# Requests in flight at once to one HTTP server, each in a worker thread of that server's
# own: a server that trickles its answers ties up these and no other server's.
HTTP_CONCURRENCY = 4
HTTP_SLACK = 1.0                      # beyond a request's timeout, for the socket to give up
HTTP_CLOSE_WAIT = 2.0                 # the session's DELETE at close, at most
HTTP_BODY_SHOWN = 200                 # bytes of an unexpected HTTP answer quoted in an error
# A socket's timeout: TimeoutError itself from Python 3.10, before that socket.timeout, an
# OSError apart. Both are the deadline passing (outcome unknown), never a plain failure.
SOCKET_TIMEOUTS = (TimeoutError, socket.timeout)
# Envelope numbers are read from their literal, never converted exactly: an id or a code of
# 1e20000000 costs seconds of CPU per conversion. The proxy's own ids are small positive
# integers, so an answer's id matches only as those plain digits; a code is taken only from a
# plain integer literal of at most this many digits (else INTERNAL_ERROR).
MAX_ID_DIGITS = 20
MAX_CODE_DIGITS = 10
CLIENT_INFO = {"name": "agentrt-proxy", "version": PROXY_VERSION}
_BASE_ENV = ("PATH", "HOME", "TMPDIR")


def _http_client():
    """The http.client module, imported at its first use: only a server reached over HTTP
    needs it, and its import (the email package comes with it) would otherwise be a part of
    every start-up."""
    import http.client
    return http.client


class UpstreamError(ProxyError):
    """A server could not be reached or answered outside the protocol."""


class NotSent(UpstreamError):
    """A request that never left the proxy: nothing can have taken effect."""


def child_env(inherit: Iterable[str], env: Iterable[str]) -> dict[str, str]:
    """A stdio server's whole environment: PATH, HOME and TMPDIR when set here, then the
    names the operator passes through, then the operator's NAME=value entries. Nothing else:
    not proxy variables, not credentials."""
    out = {name: os.environ[name] for name in (*_BASE_ENV, *inherit) if name in os.environ}
    for entry in env:
        name, _, value = entry.partition("=")
        out[name] = value
    return out


def _executable(argv0: str, cwd: str | None) -> str:
    """The program to start: a relative path such as ./server is the server's working
    directory's, as its arguments are; a bare name is looked up on PATH."""
    if cwd and os.sep in argv0 and not os.path.isabs(argv0):
        return os.path.join(cwd, argv0)
    return shutil.which(argv0, path=os.environ.get("PATH")) or argv0


_PRCTL: list = []                       # libc's prctl once looked up, or None
PR_SET_PDEATHSIG = 1                    # prctl: the signal a child gets when its parent dies


def _prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux), looked up once in the proxy itself: looked up in each child,
    between its fork and its exec, importing ctypes there delayed every server's start."""
    if not _PRCTL:
        try:
            import ctypes
            _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (OSError, AttributeError):
            _PRCTL.append(None)
    return _PRCTL[0]


class Upstream:
    """One server connection: its era, its requests, its tools. Subclasses move the bytes."""

    def __init__(self, name: str):
        self.name = name
        self.modern = False
        self.version = ""
        self._next_id = 0
        self.closed = False
        self.caps: dict = {}                 # the capabilities the server declared
        self.change_notices = 0              # its tools/list_changed notices, ever
        self.on_tools_changed: Callable[[], None] | None = None    # section 25

    # -- the transport's: _exchange(msg_id, method, payload, timeout, tool) -> the answer,
    # _post(payload, method) a notification, close(); and stderr_tail() for its errors and
    # _stop_waiting(notice) after a timeout, where it differs from these --
    def stderr_tail(self) -> str:
        return ""

    async def _stop_waiting(self, notice: bytes) -> None:
        """Send ``notice``, that the proxy stopped waiting for an answer (a late one is
        dropped), if the server can still take it."""
        with contextlib.suppress(ProxyError, OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self._post(notice, "notifications/cancelled"), CLOSE_WAIT)

    # -- the protocol --
    def _frame(self, method: str, params: dict, tasks: bool = False) -> tuple[int, bytes]:
        """A new request's id and frame. Modern requests carry the protocol version and
        capabilities in every _meta: with ``tasks``, the tasks extension, which lets the
        server answer a tools/call with a task."""
        self._next_id += 1
        if self.modern:
            caps = {"extensions": {TASKS_EXTENSION: {}}} if tasks else {}
            params = {**params, "_meta": {META_VERSION: MODERN_VERSION, META_CAPABILITIES: caps,
                                          META_CLIENT: CLIENT_INFO}}
        return self._next_id, rpc_request(self._next_id, method, params)

    async def request(self, method: str, params: dict, timeout: float,
                      tool: str = "", tasks: bool = False) -> Message:
        """Send a request and return the response message, or raise ProtocolError for an
        error answer, asyncio.TimeoutError when none came in time (the server told so,
        _stop_waiting)."""
        if self.closed:
            raise NotSent(f"the connection to {self.name} is closed")
        msg_id, payload = self._frame(method, params, tasks)
        try:
            reply = await self._exchange(msg_id, method, payload, timeout, tool)
        except asyncio.TimeoutError:
            if method != "server/discover":      # a legacy server must see initialize first
                await self._stop_waiting(rpc_notification("notifications/cancelled", {
                    "requestId": msg_id, "reason": f"no answer within {fmt_duration(timeout)}"}))
            raise
        err = reply.doc.get("error")
        if err is not None:
            raise rpc_failure(err, "error")
        if "result" not in reply.doc:
            raise ProtocolError("the answer has neither a result nor an error")
        return reply

    async def connect(self, deadline: float) -> None:
        """Probe the era: server/discover first; any error or timeout means the legacy
        handshake. The answer holds for this connection."""
        probe = min(DISCOVER_TIMEOUT, max(0.0, deadline - time.monotonic()) / 2)
        self.modern = True
        try:
            result = (await self.request("server/discover", {}, probe)).doc["result"]
            if MODERN_VERSION in (result.get("supportedVersions", [])
                                  if isinstance(result, dict) else []):
                self.version, self.caps = MODERN_VERSION, _declared(result)
                return
        except ProtocolError as exc:
            supported = exc.data.get("supported") if isinstance(exc.data, dict) else None
            if exc.code == UNSUPPORTED_VERSION and isinstance(supported, list) and \
                    MODERN_VERSION in supported:
                self.version = MODERN_VERSION
                return
        except (asyncio.TimeoutError, UpstreamError):
            if self.closed:
                raise
        self.modern = False
        result = (await self.request("initialize", {
            "protocolVersion": LEGACY_VERSIONS[0], "capabilities": {},
            "clientInfo": CLIENT_INFO}, max(0.0, deadline - time.monotonic()))).doc["result"]
        version = result.get("protocolVersion") if isinstance(result, dict) else None
        if version not in LEGACY_VERSIONS:
            raise UpstreamError(f"unsupported protocol version: {_quote(str(version))}")
        self.version, self.caps = version, _declared(result)
        await self._post(rpc_notification("notifications/initialized", {}),
                         "notifications/initialized")

    async def list_tools(self, deadline: float) -> list["LiveTool"]:
        """Every tool, following cursors: at most MAX_TOOL_PAGES pages and MAX_TOOLS tools;
        a repeated cursor or a tool listed twice fails the listing."""
        tools: dict[str, LiveTool] = {}
        seen: set[str] = set()
        cursor = None
        for _page in range(MAX_TOOL_PAGES):
            reply = await self.request("tools/list", {} if cursor is None else {"cursor": cursor},
                                       max(0.0, deadline - time.monotonic()))
            # request() holds a result; _page_tools refuses one that is not an object
            for tool in _page_tools(reply.raw("result")):
                if tool.name in tools:
                    raise UpstreamError(f"the server lists tool {_quote(tool.name)} twice")
                if len(tools) >= MAX_TOOLS:
                    raise UpstreamError(f"more than {MAX_TOOLS} tools")
                tools[tool.name] = tool
            cursor = reply.doc["result"].get("nextCursor")
            if not cursor:
                return list(tools.values())
            if not isinstance(cursor, str):
                raise UpstreamError("the listing's nextCursor is not a string")
            if cursor in seen:
                raise UpstreamError(f"the cursor {_quote(cursor)} repeats")
            seen.add(cursor)
        raise UpstreamError(f"more than {MAX_TOOL_PAGES} pages")

    def offers_tasks(self, support: str) -> bool:
        """Whether this server may be asked to run a tool as a task: in 2026-07-28 when it
        declared the tasks extension, in 2025-11-25 when it declared tasks for tools/call
        and the tool's taskSupport is optional or required."""
        if self.modern:
            return isinstance(self.caps.get("extensions"), dict) and \
                isinstance(self.caps["extensions"].get(TASKS_EXTENSION), dict)
        tasks = self.caps.get("tasks")
        call = tasks.get("requests", {}) if isinstance(tasks, dict) else None
        call = call.get("tools") if isinstance(call, dict) else None
        return support in TASK_SUPPORTS and isinstance(call, dict) and \
            isinstance(call.get("call"), dict)

    async def call_tool(self, remote: str, args: bytes, timeout: float,
                        on_task: Callable[[str, str], None] | None = None) -> Message:
        """One tools/call; the arguments go as the given bytes. With ``on_task``, the call
        asks for a task (the caller judged offers_tasks); a server that answers one has its
        task's id and creation time handed to ``on_task`` at once, and the task followed
        (follow_task) to the answer, within the same ``timeout``."""
        deadline = time.monotonic() + timeout
        params = {"name": remote, "arguments": RawJSON(args)}
        if on_task is not None and not self.modern:
            params["task"] = {}
        reply = await self.request("tools/call", params, timeout, remote, on_task is not None)
        result, task = reply.doc["result"], None
        if on_task is not None and isinstance(result, dict):
            task = result.get("task") if not self.modern else \
                result if result.get("resultType") == "task" else None
        if not isinstance(task, dict):
            return reply                    # an answer (map_result refuses a task's shape)
        task_id, created = task.get("taskId"), task.get("createdAt")
        if not isinstance(task_id, str) or not 0 < len(task_id) <= MAX_TASK_ID:
            raise ProtocolError("the server answered a task without a task id the proxy can "
                                "keep")
        on_task(task_id, created if isinstance(created, str) and
                len(created) <= MAX_TIME_TEXT else "")
        try:
            return await self.follow_task(task_id, deadline)
        except NotSent as exc:          # the call was sent and answered: never "not sent"
            raise UpstreamError(f"following task {_quote(task_id)}: {exc}") from None

    async def follow_task(self, task_id: str, deadline: float) -> Message:
        """Poll a server's task until it ends, by ``deadline`` (asyncio.TimeoutError past
        it: an unknown outcome, as any call's timeout). Completed: the server's answer (the
        2025-11-25 tasks/result, or the result 2026-07-28 embeds); failed: its JSON-RPC
        error (ProtocolError); cancelled: an unknown outcome. A task that asks for input is
        cancelled (the proxy gives a server none: it elicits nothing from the host), and
        what it ends as is its outcome, unknown unless that says otherwise."""
        asked = False

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            return remaining
        while True:
            reply = await self.request("tasks/get", {"taskId": task_id}, left(), task_id, True)
            got = reply.doc["result"] if isinstance(reply.doc["result"], dict) else {}
            status = got.get("status")
            if got.get("taskId") != task_id:
                raise ProtocolError(f"tasks/get for {_quote(task_id)} answered another task")
            if status in ("completed", "failed"):
                return await self._task_end(reply, task_id, left())
            if status == "cancelled" or (status == "input_required" and asked):
                raise UpstreamError(f"the server's task ended {_quote(str(status))}: whether "
                                    "it took effect is not known")
            if status == "input_required":
                asked = True
                with contextlib.suppress(ProtocolError):
                    await self.request("tasks/cancel", {"taskId": task_id}, left(), task_id,
                                       True)
                continue
            every = got.get("pollIntervalMs" if self.modern else "pollInterval")  # a hint
            every = _plain_int(every, MAX_POLL_DIGITS) if isinstance(every, Num) else None
            await asyncio.sleep(min(left(), max(TASK_POLL_MIN, min(
                TASK_POLL_MAX, every / 1000 if every else TASK_POLL_DEFAULT))))

    async def _task_end(self, reply: Message, task_id: str, timeout: float) -> Message:
        """The answer of a task a tasks/get ``reply`` says ended: completed, the server's
        answer (2025-11-25 fetches it with tasks/result; 2026-07-28 embeds it); failed, its
        JSON-RPC error, raised as ProtocolError, as the call would have raised it."""
        if not self.modern:
            return await self.request("tasks/result", {"taskId": task_id}, timeout, task_id)
        got = reply.doc["result"]
        if got.get("status") == "failed":
            raise rpc_failure(got.get("error"), "the task failed")
        embedded = reply.inner_spans("result").get("result")
        if embedded is None:
            raise ProtocolError("the server's completed task holds no result")
        return server_message(b'{"jsonrpc":"2.0","id":0,"result":%s}' % embedded)

    async def ended_task(self, task_id: str, created: str, since: str, timeout: float,
                         ) -> "Message | ProtocolError | str | None":
        """What the server says its task ``task_id`` ended with, asked once about an attempt
        cut off or timed out while the server ran it: its answer, or the JSON-RPC error of a
        failed task (_task_end). Only the very task the attempt was told of counts: its id
        and its creation time exactly as recorded then (``created``), not before ``since``,
        the attempt's start, and in 2025-11-25 a result naming it. A restarted server may
        give an old id to a new task, which this tells apart. None when the server cannot
        say: the task unknown to it or expired, not ended, ended cancelled, not that task,
        or the asking failed. TASK_WORKING_STILL when that very task has not ended yet."""
        deadline = time.monotonic() + timeout
        try:
            reply = await self.request("tasks/get", {"taskId": task_id}, timeout, task_id, True)
            got = reply.doc["result"] if isinstance(reply.doc["result"], dict) else {}
            if got.get("taskId") != task_id or not created or got.get("createdAt") != created \
                    or parse_time(created) < parse_time(since):
                return None
            if got.get("status") in ("working", "input_required"):
                return TASK_WORKING_STILL
            if got.get("status") not in ("completed", "failed"):
                return None
        except (ProxyError, OSError, asyncio.TimeoutError, ValueError, OverflowError):
            return None                       # the asking failed, or a time not ours to read
        try:
            end = await self._task_end(reply, task_id, max(0.0, deadline - time.monotonic()))
        except ProtocolError as exc:
            return exc                        # a failed task's JSON-RPC error
        except (ProxyError, OSError, asyncio.TimeoutError):
            return None
        meta = end.doc["result"].get("_meta") if isinstance(end.doc["result"], dict) else None
        named = meta.get(META_RELATED_TASK) if isinstance(meta, dict) else None
        if not self.modern and (not isinstance(named, dict) or named.get("taskId") != task_id):
            return None
        return end

    def _route(self, msg: Message) -> bytes | None:
        """What to answer a message the server sent on its own: requests are refused (the
        proxy neither samples, elicits nor lists roots), ping is answered."""
        if msg.method in DRIFT_NOTICES and not msg.has_id:
            self.change_notices += 1
            if self.on_tools_changed is not None:
                self.on_tools_changed()      # thread-safe: HTTP reads on worker threads
        if msg.method and msg.has_id:
            if msg.method == "ping" and not self.modern:
                return rpc_result(msg.id_value(), {})
            return rpc_error(msg.id_value(), METHOD_NOT_FOUND,
                             f"{msg.method} is not available through this proxy")
        return None

    # -- tools that change while serving (section 25) --
    # Any notice that the tools may have changed only ever leads to a re-listing, bounded
    # in rate, that can withhold tools and never offers one that is not pinned: so notices
    # are taken from the server in either era, with or without a subscription id, and a
    # forged or repeated one costs at most that bounded re-listing.
    can_listen = False                  # whether the transport keeps a listen open

    async def listen(self) -> bool:
        """2026-07-28: open subscriptions/listen for tool changes, when the server's
        discover result declared tools.listChanged. It is never answered (its id is not
        awaited: an answer to it, an error included, is dropped); the server's notices on
        it arrive through _route. Legacy servers send their notices unasked."""
        tools = self.caps.get("tools")
        if self.closed or not (self.modern and self.can_listen and isinstance(tools, dict)
                               and tools.get("listChanged") is True):
            return False
        await self._post(self._frame("subscriptions/listen", {
            "notifications": {"toolsListChanged": True}})[1], "subscriptions/listen")
        return True


def rpc_failure(err: Any, said: str) -> ProtocolError:
    """A server's JSON-RPC error object (a request's answer, or a failed task's) as the
    ProtocolError it raises: its message sanitised (``said`` when it gives none), its code
    when it is a plain integer."""
    err = err if isinstance(err, dict) else {}
    code = _plain_int(err.get("code"), MAX_CODE_DIGITS, signed=True)
    return ProtocolError(sanitize(str(err.get("message", said))),
                         INTERNAL_ERROR if code is None else code, err.get("data"))


MAX_TOOL_PAGES = 100
MAX_TOOLS = 1000
MAX_TASK_ID = 256                       # a server's task id the proxy records
MAX_TIME_TEXT = 64                      # ... and its creation time (longer: not recorded)
MAX_POLL_DIGITS = 9                     # a server's poll interval hint, in ms
TASK_SUPPORTS = ("optional", "required")    # a tool's taskSupport that lets it be a task
TASK_WORKING_STILL = "working"          # Upstream.ended_task: the task has not ended
TASK_EVENT = "step.tool_task"           # the event that records it (section 12.1)
TASK_POLL_MIN, TASK_POLL_MAX = 0.05, 5.0    # seconds between looks at a server's task
TASK_POLL_DEFAULT = 1.0                 # ... where the server gives no hint
# The notices that make the proxy list a server's tools again: the change itself, and a
# subscription's acknowledgement (a change between the first listing and the subscription
# taking effect would otherwise go unseen).
DRIFT_NOTICES = ("notifications/tools/list_changed", "notifications/subscriptions/acknowledged")


def _declared(result: Any) -> dict:
    caps = result.get("capabilities") if isinstance(result, dict) else None
    return caps if isinstance(caps, dict) else {}


@dataclasses.dataclass(frozen=True, repr=False)
class LiveTool:
    """One tool as the server lists it now."""
    name: str
    description: str
    schema: bytes                       # canonical bytes of its input schema
    annotations: dict | None
    task_support: str = "forbidden"     # execution.taskSupport: forbidden, optional, required


def canonical_schema(raw: bytes) -> bytes:
    """The form schemas are pinned and hashed in: canonical, lenient about repeated keys
    (the last wins) and unpaired surrogates; nothing else is forgiven."""
    if not raw.strip(JSON_WS):
        raw = b"null"
    return encode_canonical(parse_json(raw, strict=False, float_range=True))


def _page_tools(result_raw: bytes) -> list[LiveTool]:
    """The tools of one listing page, read from the result's exact bytes."""
    result = parse_json(result_raw, strict=False, bounds=False)
    if not isinstance(result, dict):
        raise UpstreamError("the listing is not an object")
    entries = result.get("tools", [])
    if not isinstance(entries, list):
        raise UpstreamError("the listing's tools is not an array")
    out = []
    raw_entries = _array_items(member_spans(result_raw).get("tools", b"[]"))
    for entry, raw_entry in zip(entries, raw_entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        desc = entry.get("description", "")
        if not isinstance(desc, str):
            raise UpstreamError(f"tool {_quote(entry['name'])}: description is not a string")
        ann = entry.get("annotations")
        if ann is not None and not isinstance(ann, dict):
            raise UpstreamError(f"tool {_quote(entry['name'])}: annotations is not an object")
        try:
            schema = canonical_schema(member_spans(raw_entry).get("inputSchema", b"null"))
        except JSONError as exc:
            raise UpstreamError(f"tool {_quote(entry['name'])}: input schema: {exc}") from None
        execution = entry.get("execution")
        support = execution.get("taskSupport") if isinstance(execution, dict) else None
        out.append(LiveTool(entry["name"], desc, schema, _annotations(ann),
                            support if support in TASK_SUPPORTS else "forbidden"))
    return out


def _array_items(raw: bytes) -> list[bytes]:
    """The exact bytes of each item of a JSON array."""
    text = raw.decode("utf-8")
    pos, items = _WS.match(text, _WS.match(text).end() + 1).end(), []
    while pos < len(text) and text[pos] != "]":
        end = _value_end(text, pos)
        items.append(text[pos:end].encode("utf-8"))
        pos = _WS.match(text, end).end()
        if text[pos] == ",":
            pos = _WS.match(text, pos + 1).end()
    return items


_HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")


def _annotations(ann: dict | None) -> dict | None:
    """The hints as the server asserts them (values must be booleans), and the title."""
    if ann is None:
        return None
    out: dict[str, Any] = {}
    if isinstance(ann.get("title"), str) and ann["title"]:
        out["title"] = ann["title"]
    for hint in _HINTS:
        if ann.get(hint) is not None:
            if not isinstance(ann[hint], bool):
                raise UpstreamError(f"annotation {hint} is not a boolean")
            out[hint] = ann[hint]
    return out


def _plain_int(value: Any, max_digits: int, signed: bool = False) -> int | None:
    """The integer a plain literal of at most ``max_digits`` digits spells (a leading '-'
    when ``signed``), else None. Nothing else is converted: 1.0, 1e0 and 1e20000000 are
    no such literal, and an exact conversion of the last would freeze the event loop."""
    if not isinstance(value, Num):
        return None
    digits = value.text[1:] if signed and value.text.startswith("-") else value.text
    if not (0 < len(digits) <= max_digits and digits.isascii() and digits.isdigit()):
        return None
    return int(value.text)


def _answers(msg: Message, msg_id: int | None) -> bool:
    """Whether ``msg`` is the answer to the proxy's request ``msg_id``."""
    return msg.method is None and msg_id is not None and \
        _plain_int(msg.doc.get("id"), MAX_ID_DIGITS) == msg_id


class _ServerPipes(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's own protocol for a child's pipes, with ``exited`` set when the child itself
    exits: Process.wait() waits for its pipes too (Python 3.12 and later), and a descendant
    may hold them open. Its stderr is kept as it arrives: the last STDERR_TAIL bytes, in
    ``tail``; its stream reader is only told the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tail: bytearray):
        super().__init__(limit=MAX_FRAME + 1024, loop=loop)
        self.exited = asyncio.Event()
        self.pid = 0
        self.tail = tail

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if fd != 2:
            super().pipe_data_received(fd, data)
            return
        self.tail += data
        del self.tail[:-STDERR_TAIL]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.pid = transport.get_pid()

    def process_exited(self) -> None:
        """SIGKILL what is left of the server's process group in the turn its exit is seen:
        while a member of the group lives, the group's id cannot be given to another, and it
        is never signalled later, when it could lead another group. A server that exits
        while connected leaves nothing of its group running."""
        super().process_exited()
        self.exited.set()
        if self.pid > 0:                # 0 would name the proxy's own process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)


class StdioUpstream(Upstream):
    """A server started as a child process: its own process group, a minimal environment,
    newline-delimited JSON-RPC, the last 4 KiB of its stderr kept for error messages."""
    can_listen = True

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: str = ""):
        super().__init__(name)
        self.argv, self.env = argv, env
        self.cwd = cwd or None      # the configuration's directory (section 18)
        self.proc: asyncio.subprocess.Process | None = None
        self._transport: asyncio.SubprocessTransport | None = None
        self._exited: asyncio.Event | None = None      # set once the server has exited
        self._pending: dict[int, asyncio.Future] = {}
        self._write_lock = asyncio.Lock()
        self._tail = bytearray()
        self._reader: asyncio.Task | None = None
        self._close_lock = asyncio.Lock()

    async def start(self) -> None:
        """Spawn the server: its own process group, killed with the proxy (Linux). Its exit
        is watched from then on (_ServerPipes)."""
        kwargs: dict[str, Any] = ({"process_group": 0} if POPEN_PROCESS_GROUP
                                  else {"start_new_session": True})
        prctl = _prctl() if sys.platform.startswith("linux") else None
        if prctl is not None:       # run in the child before exec: die when the proxy dies
            kwargs["preexec_fn"] = lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        try:
            self._transport, pipes = await loop.subprocess_exec(
                lambda: _ServerPipes(loop, self._tail), _executable(self.argv[0], self.cwd),
                *self.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=self.env, cwd=self.cwd, **kwargs)
        except OSError as exc:
            raise UpstreamError(f"cannot start {_quote(self.argv[0])}: {exc}") from None
        self.proc = asyncio.subprocess.Process(self._transport, pipes, loop)
        self._exited = pipes.exited
        self._reader = asyncio.create_task(self._read())

    def stderr_tail(self) -> str:
        return sanitize(bytes(self._tail)).strip()

    async def _read(self) -> None:
        """Dispatch answers by id, and answer what the server sends on its own (_route); a
        broken frame or EOF ends the connection."""
        reason = "the server closed its output"
        stdout = self.proc.stdout
        try:
            while True:
                line = await stdout.readuntil(b"\n")
                if not line.strip():
                    continue
                try:
                    # Parsed here, not on a worker: a request's timeout runs meanwhile,
                    # and an answer that arrived in time must never lose to it.
                    msg = server_message(line)
                except (JSONError, ProtocolError) as exc:
                    reason = f"the server sent a line that is not JSON-RPC: {exc}"
                    break
                if msg.method is not None:
                    answer = self._route(msg)
                    if answer is not None:
                        await self._post(answer)
                    continue
                fut = self._pending.pop(_plain_int(msg.doc.get("id"), MAX_ID_DIGITS), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except asyncio.IncompleteReadError:
            pass                                    # the end of its output: the default reason
        except asyncio.LimitOverrunError:
            reason = f"the server sent a message larger than {MAX_FRAME} bytes"
        finally:
            self.closed = True
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(UpstreamError(reason))
            self._pending.clear()

    async def _post(self, data: bytes, method: str = "") -> None:
        async with self._write_lock:
            if self.proc is None or self.proc.stdin.is_closing():
                raise UpstreamError("the server's input is closed")
            self.proc.stdin.write(data)
            try:
                await self.proc.stdin.drain()
            except ConnectionError as exc:           # a broken pipe among them
                raise UpstreamError(f"the server's input is closed: {exc}") from None

    async def _exchange(self, msg_id, method, payload, timeout, tool="") -> Message:
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        try:
            await self._post(payload)
            return await in_time(fut, timeout)
        finally:
            self._pending.pop(msg_id, None)

    async def close(self) -> None:
        """Close stdin, wait, SIGTERM, wait, SIGKILL, wait: the server's process group is
        killed once it has exited (_ServerPipes). Safe to call twice and while a call is in
        flight; a close cancelled while it waits still closes the transport (which kills
        the server)."""
        async with self._close_lock:
            proc, self.closed = self.proc, True
            if proc is None:
                return
            try:
                proc.stdin.close()
                for sig in (None, signal.SIGTERM, signal.SIGKILL):
                    if sig is not None and not self._exited.is_set():
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(sig)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._exited.wait(), CLOSE_WAIT)
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self._reader, STDERR_WAIT)
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(proc.stderr.read(), STDERR_WAIT)  # its stderr's end
            finally:
                # A descendant may still hold the pipes: they are closed here, what the
                # server never read dropped.
                if proc.stdin.transport.get_write_buffer_size():
                    proc.stdin.transport.abort()
                self._transport.close()
                self.proc = None


# ==== 16. Upstream client over streamable HTTP ====
# http.client on worker threads of the server's own (at most HTTP_CONCURRENCY), every read
# under the request's deadline, an answer taken only with its request's id; a request that
# never left the proxy is NotSent; closing interrupts what is in flight.

class HttpUpstream(Upstream):
    """A server at a streamable-HTTP endpoint, spoken to with http.client: JSON or SSE
    answers, the session id and protocol version headers (legacy), the method and name
    headers (modern), no redirects, bodies capped at MAX_FRAME, connections kept alive.
    Every read and write waits only until its request's deadline (``_TimedSocket``), and the
    blocking work runs in this server's own workers (``_post``), so one slow server can
    neither outlast a deadline nor starve the others."""

    def __init__(self, name: str, endpoint: str):
        super().__init__(name)
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UpstreamError(f"endpoint {_quote(endpoint)} is not an http(s) URL")
        self.url = url
        self.path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self.session_id = ""
        self._idle: list[http.client.HTTPConnection] = []
        self._active: set[_TimedSocket] = set()          # sockets of requests in flight
        self._pool_lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None     # made in the loop that uses them
        self._notices: set[asyncio.Task] = set()         # cancellations being sent

    def _connection(self) -> http.client.HTTPConnection:
        """An idle kept-alive connection the server has not closed, else a new one. An idle
        connection has nothing to read, so anything readable (the server's close, or stray
        bytes) means it is not reused."""
        while True:
            with self._pool_lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            with contextlib.suppress(OSError, ValueError):
                if conn.sock is not None and not select.select([conn.sock], [], [], 0)[0]:
                    return conn
            conn.close()
        client = _http_client()
        cls = client.HTTPSConnection if self.url.scheme == "https" else client.HTTPConnection
        return cls(self.url.hostname, self.url.port)

    def _headers(self, method: str, tool: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream"}
        if self.modern:
            headers.update({"MCP-Protocol-Version": MODERN_VERSION, "Mcp-Method": method})
            if tool:
                headers["Mcp-Name"] = _header_value(tool)
        elif self.version:
            headers["MCP-Protocol-Version"] = self.version
        if self.session_id and not self.modern:
            headers["Mcp-Session-Id"] = self.session_id
        return headers

    def _round_trip(self, msg_id: int | None, payload: bytes, method: str, tool: str,
                    deadline: float) -> Message | None:
        """One POST, in a worker thread, over by ``deadline``. Returns the answer to
        ``msg_id`` (None for a notification). NotSent only while nothing was written."""
        if self.closed:
            raise NotSent(f"the connection to {self.name} is closed")
        conn = self._connection()
        reusable, timed, resp = False, None, None
        try:
            timed = self._ready(conn, deadline)
            with self._pool_lock:
                # Refused once closing: no request starts after close() shut down the ones
                # in flight.
                if self.closed:
                    raise NotSent(f"the connection to {self.name} is closed")
                self._active.add(timed)
            conn.request("POST", self.path, body=payload, headers=self._headers(method, tool))
            resp = conn.getresponse()
            if method == "initialize" and resp.getheader("Mcp-Session-Id"):
                self.session_id = resp.getheader("Mcp-Session-Id")
            answer = self._read_answer(resp, msg_id, deadline)
            # An event stream may go on after the answer: its connection is not reused.
            reusable = not resp.will_close and resp.isclosed()
            return answer
        except SOCKET_TIMEOUTS:
            raise asyncio.TimeoutError() from None
        except (OSError, _http_client().HTTPException) as exc:
            # The endpoint is configuration: it may carry credentials, and never reaches
            # the model's text. The server's name does.
            raise UpstreamError(f"HTTP request failed: {type(exc).__name__}: "
                                f"{getattr(exc, 'strerror', None) or exc}") from None
        finally:
            if resp is not None and not reusable:
                # The response owns the socket once the server said it closes (every
                # event stream): closing it is what ends the stream, the modern cancel.
                with contextlib.suppress(OSError):
                    resp.close()
            with self._pool_lock:
                self._active.discard(timed)
                kept = reusable and not self.closed and len(self._idle) < HTTP_POOL
                if kept:
                    self._idle.append(conn)
            if not kept:
                conn.close()

    @staticmethod
    def _ready(conn: http.client.HTTPConnection, deadline: float) -> _TimedSocket:
        """Connect (a failure here sent nothing) and bound every read and write on the
        connection by ``deadline`` (a kept-alive socket served an earlier deadline)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise NotSent("the deadline passed before the request could be sent")
        conn.timeout = left
        if conn.sock is None:
            try:
                conn.connect()
            except OSError as exc:
                raise NotSent(f"cannot connect to the server: "
                              f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
            conn.sock = _TimedSocket(conn.sock)
        conn.sock.deadline = deadline
        return conn.sock

    def _read_answer(self, resp: http.client.HTTPResponse, msg_id: int | None,
                     deadline: float) -> Message | None:
        status, ctype = resp.status, (resp.getheader("Content-Type") or "").split(";")[0]
        # http.client's own reading of Content-Length: None when absent or not a number.
        if resp.length is not None and resp.length > MAX_FRAME:
            raise UpstreamError(f"response body of {resp.length} bytes exceeds {MAX_FRAME}")
        if 300 <= status < 400:
            raise UpstreamError(f"the server answered {status} (a redirect), "
                                "which this proxy does not follow")
        if status == 202 and msg_id is None:
            _read_capped(resp)
            return None
        if status == 404 and self.session_id:
            self.closed = True
            raise UpstreamError("the server ended the session (404)")
        if ctype == "text/event-stream" and status == 200:
            return self._read_events(resp, msg_id, deadline)
        body = _read_capped(resp)
        if ctype == "application/json" and body.strip():
            try:
                msg = server_message(body)
            except JSONError as exc:
                raise UpstreamError(f"the server's answer is not JSON-RPC: {exc}") from None
            if status == 200 or "error" in msg.doc:
                return None if msg_id is None else _matched(msg, msg_id)
        raise UpstreamError(f"the server answered HTTP {status}: "
                            f"{truncate(sanitize(body), HTTP_BODY_SHOWN)}")

    def _read_events(self, resp: http.client.HTTPResponse, msg_id: int | None,
                     deadline: float) -> Message:
        """Read SSE events until the answer to ``msg_id``, within ``deadline`` however the
        server trickles (inside a line too: the socket's reads are bounded); only events
        named 'message' (or unnamed) carry messages; a request the server sends on the
        stream is answered with a refusal."""
        total, data, event = 0, [], ""
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError()
            line = resp.readline(MAX_FRAME + 1)
            total += len(line)
            if total > MAX_FRAME:
                raise UpstreamError(f"response body exceeds {MAX_FRAME} bytes")
            field, colon, value = line.rstrip(b"\n").rstrip(b"\r").partition(b":")
            if field or colon:            # not a blank line, nor the stream's end
                value = value[1:] if value.startswith(b" ") else value
                if field == b"data":
                    data.append(value)
                elif field == b"event":
                    event = value.strip().decode("utf-8", "replace")
                continue
            if b"".join(data).strip() and event in ("", "message"):   # not a priming event
                try:
                    msg = server_message(b"\n".join(data))
                except (JSONError, ProtocolError) as exc:
                    raise UpstreamError(f"the server sent an event that is not JSON-RPC: "
                                        f"{exc}") from None
                if _answers(msg, msg_id):
                    return msg
                refusal = self._route(msg)      # a request the server sent on the stream
                if refusal is not None:         # answered within the stream's own deadline
                    with contextlib.suppress(ProxyError, OSError, TimeoutError,
                                             _http_client().HTTPException):
                        self._round_trip(None, refusal, "", "",
                                         min(deadline, time.monotonic() + DISCOVER_TIMEOUT))
            data, event = [], ""
            if not line:
                raise UpstreamError("the event stream ended before the answer")

    async def _exchange(self, msg_id, method, payload, timeout, tool="") -> Message:
        return await self._post(payload, method, timeout, msg_id, tool)

    async def _stop_waiting(self, notice: bytes) -> None:
        """A modern server reads the dropped stream as the cancel. A legacy one is told in
        the background (within HTTP_SLACK): the caller's timeout comes at its deadline, not
        after a slow server took this too."""
        if self.modern:
            return

        async def cancel() -> None:
            with contextlib.suppress(ProxyError, OSError, asyncio.TimeoutError):
                await self._post(notice, "notifications/cancelled", HTTP_SLACK)
        task = asyncio.get_running_loop().create_task(cancel())
        self._notices.add(task)               # held until done: the loop keeps weak refs
        task.add_done_callback(self._notices.discard)

    async def _post(self, payload: bytes, method: str, timeout: float = DISCOVER_TIMEOUT,
                    msg_id: int | None = None, tool: str = "") -> Message | None:
        """One POST in a worker of this server's own (_in_thread), once one of its
        HTTP_CONCURRENCY slots is free; the answer to ``msg_id``, when one is given. A
        server that never finishes an answer holds only its own slots, never the shared
        default executor. A request still waiting for a slot at its deadline never left
        the proxy: NotSent, never an unknown outcome."""
        deadline = time.monotonic() + timeout
        if self._slots is None:
            self._slots = asyncio.Semaphore(HTTP_CONCURRENCY)
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout)
        except asyncio.TimeoutError:
            raise NotSent(f"all {HTTP_CONCURRENCY} connections to the server stayed busy "
                          "until the deadline") from None
        # The worker ends the request at its deadline; this is only a backstop.
        return await asyncio.wait_for(_in_thread(
            self._round_trip, msg_id, payload, method, tool, deadline,
            on_done=self._slots.release), deadline + HTTP_SLACK - time.monotonic())

    async def close(self) -> None:
        """Refuse new requests and interrupt those in flight (their sockets are shut down,
        so no worker is left waiting on a trickling server), then end a legacy session
        with DELETE within HTTP_CLOSE_WAIT. Safe to call twice and while calls are in
        flight; a session the server ended (404) gets no DELETE. Cancellations still
        being sent get HTTP_SLACK to go first."""
        if self._notices:
            await asyncio.wait(list(self._notices), timeout=HTTP_SLACK)
        with self._pool_lock:
            was_closed, self.closed = self.closed, True
            idle, self._idle = self._idle, []
            active = list(self._active)
        for conn in idle:
            conn.close()
        for timed in active:
            timed.interrupt()
        if was_closed or not self.session_id or self.modern:
            return
        deadline = time.monotonic() + HTTP_CLOSE_WAIT
        with contextlib.suppress(ProxyError, OSError, _http_client().HTTPException,
                                 asyncio.TimeoutError):
            await asyncio.wait_for(_in_thread(self._delete, deadline),
                                   HTTP_CLOSE_WAIT + HTTP_SLACK)

    def _delete(self, deadline: float) -> None:
        conn = self._connection()
        try:
            self._ready(conn, deadline)
            conn.request("DELETE", self.path, headers=self._headers("", ""))
            conn.getresponse().close()
        finally:
            conn.close()


async def _in_thread(fn: Callable, *args: Any, on_done: Callable | None = None) -> Any:
    """``fn(*args)`` in a new daemon thread (one never holds up the exit). ``on_done`` runs
    in the loop when the thread ends, even when the caller stopped waiting: a slot is the
    thread's until then."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(deliver: Callable[[Any], None], value: Any) -> None:
        if on_done is not None:
            on_done()
        if not done.done():                   # else the caller stopped waiting
            deliver(value)

    def work() -> None:
        try:
            deliver, value = done.set_result, fn(*args)
        except BaseException as err:          # every outcome goes back to the loop
            deliver, value = done.set_exception, err
        with contextlib.suppress(RuntimeError):        # the loop is already closed
            loop.call_soon_threadsafe(settle, deliver, value)

    threading.Thread(target=work, daemon=True).start()
    return await done


class _TimedSocket:
    """A connected socket whose every send and receive waits only until the current
    request's deadline. A plain socket timeout restarts with each receive, so a server that
    trickles a byte at a time without a newline would hold a status line, a header, a chunk
    size or an SSE line (and the worker reading it) for ever; here the time left shrinks."""

    def __init__(self, sock: Any):
        self.sock = sock
        self.deadline = 0.0

    def arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self.arm()
        self.sock.sendall(data)

    def makefile(self, mode: str = "rb", *_args: Any, **_kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_TimedReader(self))

    def fileno(self) -> int:
        return self.sock.fileno()

    def interrupt(self) -> None:
        """End a read or write in flight in a worker (the upstream is closing). The base
        class's shutdown: a TLS socket's own would tear down its state under the reader."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        # While a response still reads, the real close waits for its reader (the socket
        # counts the reader's reference), as with http.client's own sockets.
        self.sock.close()


class _TimedReader(io.RawIOBase):
    """The raw stream under an HTTP response: each receive armed with the time left."""

    def __init__(self, timed: _TimedSocket):
        super().__init__()
        self.timed = timed
        self.raw = timed.sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int | None:
        self.timed.arm()
        return self.raw.readinto(buf)

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


def _matched(msg: Message, msg_id: int) -> Message:
    """The answer to ``msg_id``, or a protocol error: an answer with another id, or none,
    belongs to another exchange (or is forged), and taking it would record another call's
    outcome as this one's. Not NotSent: the request was sent."""
    if _answers(msg, msg_id):
        return msg
    got = msg.raw("id")
    shown = "no id" if got is None else \
        f"id {truncate(sanitize(got[:HTTP_BODY_SHOWN]), NUMBER_SHOWN)}"
    raise UpstreamError(f"the server's answer has {shown}, not the request's id {msg_id}")


def _header_value(text: str) -> str:
    """A header value as the modern transport spells one that is not plain ASCII."""
    if text.isascii() and text.isprintable():
        return text
    return "=?base64?" + base64.b64encode(text.encode("utf-8")).decode() + "?="


def _read_capped(resp: http.client.HTTPResponse) -> bytes:
    """A whole body, at most MAX_FRAME bytes; its socket's reads end at the deadline."""
    chunks, total = [], 0
    for chunk in iter(lambda: resp.read1(READ_CHUNK), b""):
        total += len(chunk)
        if total > MAX_FRAME:
            raise UpstreamError(f"response body exceeds {MAX_FRAME} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# ==== 17. Pinning and loading upstream tools ====
# `pin` records what each server presents: every tool's description and canonical input
# schema, hashed. Loading connects again and registers a tool only when it is pinned,
# classified by the operator's rule, unchanged since the pin, not contradicted by the hints
# the server asserts (unless the rule allows it), named acceptably, self-contained, and
# compiled by the gate's validator. Denied and fixed parameters are hidden from the model.

MAX_CONTENT_BYTES = MAX_RESULT_BYTES
TRUNCATION_MARKER = "\n[truncated]"
STRUCTURED_DROPPED = "[structured content dropped: too large]"
# Structured content written in more bytes than this cannot encode within the cap (whitespace
# aside), so it is dropped for the text without being parsed.
STRUCTURED_READ_LIMIT = 4 * MAX_CONTENT_BYTES
_PLACEHOLDERS = {"image": "[image omitted]", "audio": "[audio omitted]",
                 "resource_link": "[resource link omitted]",
                 "resource": "[embedded resource omitted]"}
_DRAFT_URI = re.compile(r"https?://json-schema\.org/(draft-0[467]/schema|draft/2019-09/schema|"
                        r"draft/2020-12/schema|schema)#?")
DRIFT_GONE = "the server no longer offers it"      # a pinned tool missing from the listing
_HIDE_CHECKED = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentRequired",
                 "dependentSchemas", "dependencies", "$defs", "definitions")


class MCPError(ProxyError):
    """Pinning or loading a server failed. ``report`` is kept when one was made."""

    def __init__(self, msg: str, report: "Report | None" = None):
        super().__init__(msg)
        self.report = report


def offered_name(server: str, remote: str, rule: Rule) -> str:
    """The name the host is offered a tool by: the rule's rename, else server_tool."""
    return rule.rename or f"{server}_{remote}"


def hash_string(text: str) -> str:
    """A description's hash: of its JSON form, quotes included."""
    return sha256_hex(encode_canonical(text))


async def open_upstream(server: ServerConfig) -> tuple[Upstream, list[LiveTool], float]:
    """Start or reach the server, settle its era and list its tools, all within its
    connect_timeout: the connection, the tools, and that deadline. A step not done by the
    deadline, or failed, closes the connection and is an MCPError naming the step, with the
    tail of the server's stderr."""
    deadline = time.monotonic() + server.connect_timeout
    if server.command:
        conn: Upstream = StdioUpstream(server.name, list(server.command),
                                       child_env(server.inherit_env, server.env), server.cwd)
        try:
            await conn.start()
        except BaseException:
            await conn.close()
            raise
    else:
        conn = HttpUpstream(server.name, server.endpoint)
    step = "connect"
    try:
        await asyncio.wait_for(conn.connect(deadline), max(0.0, deadline - time.monotonic()))
        step = "list tools"
        tools = await asyncio.wait_for(conn.list_tools(deadline),
                                       max(0.0, deadline - time.monotonic()))
    except BaseException as exc:
        await conn.close()
        if isinstance(exc, asyncio.TimeoutError):
            text = f"timed out after {fmt_duration(server.connect_timeout)}"
        else:
            text = sanitize(str(exc) or type(exc).__name__)
        tail = conn.stderr_tail()
        raise MCPError(f"mcp: server {_quote(server.name)}: {step}: {text}" +
                       (f"; stderr: {_quote(tail)}" if tail else "")) from exc
    return conn, tools, deadline


async def pin_server(server: ServerConfig, now: float) -> dict:
    """Connect, list every tool, and return the manifest (nothing is written here)."""
    conn, tools, _ = await open_upstream(server)
    await conn.close()
    entries = {tool.name: {
        "name": tool.name, "description": tool.description,
        "input_schema": RawJSON(tool.schema), "schema_hash": sha256_hex(tool.schema),
        "description_hash": hash_string(tool.description),
        **({} if tool.annotations is None else {"annotations": tool.annotations})}
        for tool in sorted(tools, key=lambda t: t.name)}
    return {"server": server.name, "pinned_at": fmt_time(now), "tools": entries}


def write_manifest(path: str, manifest: dict) -> None:
    """Write the manifest owner-only (an existing file is made 0600 too)."""
    text = _pretty(read_own(dump_json(manifest)), cut=False) + "\n"
    replace_file(path, text.encode("utf-8"), ".manifest-")


def replace_file(path: str, data: bytes, prefix: str, mode: int = 0o600,
                 last_check: Callable[[], None] = lambda: None) -> None:
    """Replace the file at ``path`` with ``data``, whole or not at all, and the only writer
    that replaces a file: a temporary file named ``prefix``... in the same folder (mkstemp
    creates it 0600; it is given ``mode``), written and synced, then renamed over ``path``.
    ``last_check`` runs just before the rename and refuses it by raising; on any failure
    the temporary file is removed."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        last_check()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclasses.dataclass(frozen=True, repr=False)
class PinnedTool:
    """One tool as the manifest pins it."""
    name: str
    description: str
    schema: bytes
    schema_hash: str
    description_hash: str
    annotations: dict | None


def read_manifest(path: str, server: str) -> dict[str, PinnedTool]:
    """The pinned tools of a manifest that only its owner can write."""
    try:
        doc = parse_json(read_owned(path), max_depth=RECORD_DEPTH)      # it wraps schemas
    except JSONError as exc:
        raise ConfigError(f"{path}: not usable JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), dict):
        raise ConfigError(f"{path}: not a manifest (no tools object)")
    if doc.get("server") != server:
        raise ConfigError(f"mcp: manifest is for server {_quote(str(doc.get('server')))}, "
                          f"not {_quote(server)}")
    if "pinned_at" in doc:
        try:
            parse_time(doc["pinned_at"])
        except (TypeError, ValueError, AttributeError):
            raise ConfigError(f"{path}: pinned_at is not an RFC 3339 time") from None
    tools = {}
    for key, entry in doc["tools"].items():
        try:
            tools[key] = PinnedTool(
                entry["name"], entry["description"], encode_canonical(entry["input_schema"]),
                entry["schema_hash"], entry["description_hash"], entry.get("annotations"))
        except (KeyError, TypeError):
            raise ConfigError(f"{path}: tool {_quote(key)} is not a manifest entry") from None
    return tools


@dataclasses.dataclass(repr=False)
class Report:
    """What loading one server decided, tool by tool, in the server's name order."""
    server: str
    registered: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    unpinned: list[str] = dataclasses.field(default_factory=list)
    unclassified: list[str] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        s = sanitize
        return [f"{s(self.server)}: registered {s(tool)} as {s(name)} ({s(cls)})" +
                (f" [hint mismatch allowed: {s(mismatch)}]" if mismatch else "")
                for tool, name, cls, mismatch in self.registered] + \
            [f"{s(self.server)}: refused {s(t)}: {s(r)}" for t, r in self.refused] + \
            [f"{s(self.server)}: unclassified {s(t)}: no rule" for t in self.unclassified] + \
            [f"{s(self.server)}: unpinned {s(t)}: not in the manifest" for t in self.unpinned]

    def __str__(self) -> str:
        return "".join(line + "\n" for line in self.lines())


@dataclasses.dataclass(frozen=True, repr=False)
class UpstreamTool:
    """A registered upstream tool: what the gate calls, and what the proxy's rules need."""
    spec: ToolSpec
    server: str
    remote: str
    rule: Rule
    conn: Upstream
    max_content: int = MAX_CONTENT_BYTES
    task_support: str = "forbidden"     # the tool's execution.taskSupport, as listed

    @property
    def tasks(self) -> bool:
        """Whether its server may be asked to run it as a task (Upstream.offers_tasks)."""
        return self.conn is not None and self.conn.offers_tasks(self.task_support)

    def refused_param(self, value: dict) -> str:
        """Why arguments holding a denied or a fixed parameter are refused, or ''."""
        for how, params in (("denied", self.rule.deny), ("fixed", dict(self.rule.fixed))):
            for param in params:
                if param in value:
                    return f'{self.spec.name}: parameter "{param}" is {how} by the operator'
        return ""

    async def call(self, args: bytes, value: Any = NOT_PARSED,
                   on_task: Callable[[str, str], None] | None = None) -> ToolResult:
        """Send the call: denied or fixed parameters the model set are refused before
        anything is sent; fixed values are injected; the answer is mapped to content.
        ``value`` is the strict parse of ``args`` when the call has it: only read, and
        copied before fixed values go in. ``on_task``: where the server offers tasks
        (tasks), the call asks for one, and is told its id (Upstream.call_tool)."""
        name = self.spec.name
        raw, value = empty_as_object(args, value)
        try:
            value = parse_json(raw) if value is NOT_PARSED else value
        except JSONError as exc:
            raise ToolFailure(f"{name}: arguments are not a JSON object: {exc}",
                              NOT_SENT) from None
        if not isinstance(value, dict):
            raise ToolFailure(f"{name}: arguments are not a JSON object: got {_kind(value)}",
                              NOT_SENT)
        refused = self.refused_param(value)
        if refused:
            raise ToolFailure(refused, NOT_SENT)
        return await self.answer_of(self.conn.call_tool(
            self.remote, wire_arguments(raw, value, self.rule.fixed), self.spec.timeout,
            on_task if self.tasks else None))

    async def answer_of(self, sent: Awaitable[Message]) -> ToolResult:
        """What a call's answer, or its failure to come, is to the classifier (_observe):
        the one reading of a server's answer, a call's or its task's (Proxy.ask_task)."""
        name = self.spec.name
        try:
            reply = await sent
        except asyncio.TimeoutError:
            raise
        except NotSent as exc:
            raise ToolFailure(f"{name}: nothing was sent to server {_quote(self.server)}: "
                              f"{sanitize(str(exc))}", NOT_SENT) from None
        except (ProxyError, OSError) as exc:
            raise ToolFailure(f"mcp: server {_quote(self.server)}: tool {_quote(self.remote)}: "
                              f"{sanitize(str(exc))}", NO_ANSWER) from None
        try:
            return map_result(self, reply)  # linear, and within the call's own timeout
        except ToolFailure:
            raise
        except Exception as exc:
            # The server answered: whatever its answer does to the mapping, the call ran.
            raise AnswerUnreadable(f"{name}: server {_quote(self.server)} answered, and its "
                                   f"answer could not be read ({type(exc).__name__})") from None


def empty_as_object(args: bytes, value: Any = NOT_PARSED) -> tuple[bytes, Any]:
    """A call's arguments and their strict parse (NOT_PARSED when not made): arguments that
    are empty or JSON null are the empty object, as checked, recorded and sent, for a host's
    call and for the upstream call alike; others are stripped of the whitespace around
    them, ``value`` unchanged."""
    args = args.strip(JSON_WS)
    return (b"{}", {}) if args in (b"", b"null") else (args, value)


def wire_arguments(raw: bytes, value: dict, fixed: tuple) -> bytes:
    """The arguments a tools/call sends upstream, and the only maker of them: ``raw``, the
    arguments as the record keeps them (the proxy's own encoding of what the host sent),
    when the operator fixes nothing; else the proxy's encoding of ``value`` (their parse)
    with each of the rule's ``fixed`` (name, JSON) values set, on a copy. Pure: the same
    record and rule give the same bytes, in any process, at any time."""
    return dump_json(with_fixed(value, fixed)).encode("utf-8") if fixed else raw


def with_fixed(value: Any, fixed: tuple) -> Any:
    """Arguments (their parse) with each of a rule's ``fixed`` (name, JSON) values set, on a
    copy: what the server receives (wire_arguments) and what a limit or a condition reads."""
    sent = {name: parse_json(given) for name, given in fixed}
    return {**value, **sent} if isinstance(value, dict) and sent else value


def map_result(tool: UpstreamTool, reply: Message) -> ToolResult:
    """The server's structured content when it sent some and it fits the cap together with
    the server's text blocks, which travel beside it (ToolResult.text: the model reads the
    text as it would straight from the server, and the structured content as
    structuredContent); else the text blocks joined (other content as placeholders), capped
    with a marker. isError is a failure whose text is what the model is told."""
    # The message was parsed as it was read: its result is used as parsed (a bad byte in a
    # string reads as U+FFFD where text is taken from it). The structured content is that
    # read's value when the strict parser would give it (Message.parsed: its members already
    # in the order the record keeps), and the value travels to the classifier
    # (ToolResult.value); else (a repeated key, a lone surrogate, a byte not UTF-8) it is
    # read again, from its own bytes, when it may fit, and its record read by the classifier.
    result = reply.doc.get("result")
    result, spans = (result, reply.inner_spans("result")) if isinstance(result, dict) else \
        ({}, {})
    if result.get("resultType") == "input_required":
        raise ToolFailure(f"{tool.spec.name}: the server asked for more input, which this "
                          "proxy does not support")
    if result.get("resultType") == "task" or "task" in result:
        # A task the proxy did not ask for, or could not follow: no answer to the call,
        # whose outcome is unknown, never an empty result.
        raise ToolFailure(f"{tool.spec.name}: the server answered with a task the proxy "
                          "cannot follow", NO_ANSWER)
    cap, content, dropped, beside = tool.max_content, None, 0, None
    text = _joined_text(result.get("content"))
    structured = spans.get("structuredContent")
    if structured is not None and len(structured) > STRUCTURED_READ_LIMIT:
        dropped, structured = len(structured), None      # far past the cap: never parsed
    # Structured content is taken only as an object, the form every era's host reads as
    # structuredContent: anything else would be recorded but never reach the host, and the
    # record would say the model was given what it was not.
    value: Any = NOT_PARSED
    if structured is not None and structured.lstrip(JSON_WS)[:1] == b"{":
        try:
            value = reply.parsed("structuredContent", "result")
            encoded = encode_policy(parse_json(structured, strict=False, max_depth=MAX_DEPTH,
                                               float_range=True)
                                    if value is NOT_PARSED else value)
        except JSONError as exc:
            # Nested too deep: handed on as sent, so the gate refuses it as content it cannot
            # record and the call counts as executed. A number we cannot keep: the text
            # stands instead.
            encoded = structured.strip(JSON_WS) if exc.msg.startswith("nested") else None
            value = NOT_PARSED
        if encoded is not None and _wire_len(encoded) + _wire_len(text) <= cap:
            content, beside = encoded, text
        elif encoded is not None:
            dropped, value = len(encoded), NOT_PARSED
    truncated = dropped > 0              # structured content is dropped only for the text
    if content is None:
        value, cut = cap_text(text or (STRUCTURED_DROPPED if dropped else ""), cap)
        content, truncated = encode_policy(value), truncated or cut
    summary = f"{tool.server}/{tool.remote}: {len(content)} bytes" + \
        (", truncated" if truncated else "") + \
        (f", structured content of {dropped} bytes dropped for the text" if dropped else "")
    if result.get("isError") is True:
        # The text the model is told: the text cap_text made; else the text blocks beside
        # the structured content, or that content itself when there are none.
        shown = value if beside is None else beside or content.decode("utf-8", "replace")
        raise ToolFailure(f"{summary}, error: {shown}")
    return ToolResult(content, summary, beside, value)


def _wire_len(value: "bytes | str") -> int:
    """The bytes a text, or JSON bytes in the proxy's encoding, take in a frame or record,
    where line breaks of every reader and C1 controls are escaped (six bytes each): the cap
    holds for what is written, not only for the value."""
    return len(dump_json(value if isinstance(value, str) else RawJSON(value)).encode("utf-8"))


def _joined_text(blocks: Any) -> str:
    parts = []
    for block in blocks if isinstance(blocks, list) else ():
        kind = block.get("type") if isinstance(block, dict) else None
        kind = kind if isinstance(kind, str) else None      # a list is no key of the table
        text = block.get("text") if kind == "text" else None
        parts.append(text if isinstance(text, str) else
                     _PLACEHOLDERS.get(kind, "[content omitted]"))
    return "\n".join(parts)


def cap_text(text: str, limit: int) -> tuple[str, bool]:
    """``text``, cut so that as a JSON string it takes at most ``limit`` bytes (at least the
    marker's size): the longest prefix that fits, with the marker, when it must be cut;
    and whether it was."""
    # A character takes a byte or more: what lies past ``limit`` characters is never written.
    # An ASCII text (known without reading it) holds no lone surrogate.
    text = text[:limit + 1]
    text = text if text.isascii() else _SURROGATES.sub("\ufffd", text)
    written = _wire_str(text)[1:-1].encode("utf-8")
    if len(text) <= limit and len(written) + 2 <= limit:
        return text, False
    room = max(limit, _wire_len(TRUNCATION_MARKER)) - _wire_len(TRUNCATION_MARKER)
    # The cut, in one pass: the text as written, cut at ``room`` bytes (escaping is a
    # character at a time, so this is the written form of a prefix), less a character or an
    # escape the cut split, read back as text.
    written = written[:room].decode("utf-8", "ignore")
    escape = written.rfind("\\", max(0, len(written) - SURROGATE_ESCAPE_LEN + 1))
    if escape >= 0:
        run = escape - len(written[:escape].rstrip("\\"))    # backslashes before it
        whole = SURROGATE_ESCAPE_LEN if written[escape + 1:escape + 2] == "u" else 2
        if run % 2 == 0 and len(written) - escape < whole:
            written = written[:escape]
    return json.loads('"' + written + '"') + TRUNCATION_MARKER, True


async def load_server(server: ServerConfig, pinned: dict[str, PinnedTool],
                      ) -> tuple[list[UpstreamTool], Report]:
    """Connect, list, and register what passes every check. Nothing registered is an
    error that carries the report."""
    check_rules_pinned(server, pinned)
    conn, live_list, deadline = await open_upstream(server)
    live = {t.name: t for t in live_list}
    report = Report(server.name, unpinned=sorted(set(live) - set(pinned)),
                    unclassified=sorted(set(pinned) - set(server.rule_map)))
    try:                                 # whatever fails, the connection is closed
        built, refusals = register(server, pinned, live, conn, {})
        tools = [tool for _, tool, _ in built]
        report.registered = [(key, t.spec.name, t.rule.side_effect, mismatch)
                             for key, t, mismatch in built]
        report.refused = [(key, why) for key, _, why in refusals]
        if time.monotonic() > deadline:
            raise MCPError(f"mcp: server {_quote(server.name)}: load: timed out after "
                           f"{fmt_duration(server.connect_timeout)}")
        if not tools:
            raise MCPError(f"mcp: server {_quote(server.name)}: no tool registered", report)
    except BaseException:
        await conn.close()
        raise
    return tools, report


def register(server: ServerConfig, pinned: dict[str, PinnedTool], live: dict[str, LiveTool],
             conn: Upstream, taken: dict[str, str],
             ) -> tuple[list[tuple[str, UpstreamTool, str]], list[tuple[str, str, str]]]:
    """What loading registers of the server's classified tools now, in name order, and the
    one place that decides it (load_server at start, ServerWatch.relist on a change): each
    tool _build makes under a name not ``taken``, by its key, with the hint mismatch its
    rule allows; and each other one by its key, the name it would be offered by, and why
    not. ``taken`` maps each name in use to the tool holding it ('' when not this
    server's); the names registered are added to it."""
    built, refused = [], []
    for key, rule in sorted(server.rule_map.items()):
        name = offered_name(server.name, key, rule)
        try:
            if key not in pinned:
                raise ConfigError("it is not in the manifest")
            tool, mismatch = _build(server, pinned[key], live.get(key), rule, conn)
            name = tool.spec.name
            if name in taken:
                raise ConfigError(f"the name {_quote(name)} is already taken" +
                                  (f" by tool {_quote(taken[name])}" if taken[name] else ""))
        except (ProxyError, ValueError) as exc:
            refused.append((key, name, str(exc)))
            continue
        taken[name] = key
        built.append((key, tool, mismatch))
    return built, refused


def _build(server: ServerConfig, pin: PinnedTool, live: LiveTool | None, rule: Rule,
           conn: Upstream) -> tuple[UpstreamTool, str]:
    """The checks for one tool, in order; the first failure is the reason it is refused."""
    if live is None:
        raise ConfigError(DRIFT_GONE)
    changed = changed_since_pin(pin, live)
    if "the input schema" in changed:
        raise ConfigError("the input schema changed since the pin")
    if changed:
        raise ConfigError("the description changed since the pin; a description is model "
                          "input, so the tool must be pinned again")
    # The pinned hints first, then what the server says now.
    mismatch = _hint_mismatch(rule.side_effect, pin.annotations) or \
        _hint_mismatch(rule.side_effect, live.annotations, "the server now says: ")
    if mismatch and not rule.allow_hint_mismatch:
        raise ConfigError(mismatch)
    timeout = rule.timeout or server.default_timeout
    if timeout <= 0:
        raise ConfigError("no timeout: set the rule's timeout or the server's default_timeout")
    name = offered_name(server.name, pin.name, rule)
    if not _NAME_RE.fullmatch(name):
        raise ConfigError(f"the name {_quote(name)} does not match ^[a-zA-Z0-9_-]{{1,64}}$")
    schema = parse_json(pin.schema, strict=False)
    if not isinstance(schema, dict):
        raise ConfigError("the input schema is not a JSON object")
    if schema.get("type") != "object":
        raise ConfigError('the input schema is not an object schema ("type":"object")')
    _self_contained(schema)
    restricted = _restrict(schema, list(rule.deny) + [k for k, _ in rule.fixed])
    spec = ToolSpec(name, rule.description or pin.description, restricted, rule.side_effect,
                    timeout, terminal=True)
    try:
        _check_tool(spec, {})
    except ValueError as exc:
        raise ConfigError(f"the runtime refuses it: {exc}") from None
    return UpstreamTool(spec, server.name, pin.name, rule, conn,
                        task_support=live.task_support), mismatch


def changed_since_pin(pin: PinnedTool, live: LiveTool) -> list[str]:
    """What of a listed tool differs from its pin, by hash: "the description", "the input
    schema", in that order; none when it has not drifted. Loading and drift both ask this."""
    return [what for what, same in (
        ("the description", same_digest(hash_string(live.description), pin.description_hash)),
        ("the input schema", same_digest(sha256_hex(live.schema), pin.schema_hash)))
        if not same]


def _hint_mismatch(cls: str, ann: dict | None, said: str = "") -> str:
    """A hint the server asserts that disputes the operator's class, after ``said``; or ''.
    Silence claims nothing; a hint can dispute a class, never relax one."""
    if ann is None:
        return ""
    if cls == "read_only" and ann.get("readOnlyHint") is not True:
        return f"{said}classified read_only, but the server does not claim readOnlyHint"
    if cls != "destructive" and ann.get("readOnlyHint") is not True and \
            ann.get("destructiveHint") is True:
        return f"{said}classified {cls}, but the server claims destructiveHint"
    return ""


def _self_contained(node: Any, at: str = "#", root: Any = None) -> None:
    """Refuse any key that could make a schema compiler read outside the schema, wherever
    it stands (in defaults and examples too): no URL is ever fetched."""
    root = node if root is None else root
    draft04 = isinstance(root, dict) and "draft-04" in str(root.get("$schema", ""))
    # An item of a list is no key: its index matches none of the keys below.
    items = enumerate(node) if isinstance(node, list) else \
        sorted(node.items()) if isinstance(node, dict) else ()
    for key, value in items:
        if isinstance(value, str):
            outside = (
                (key in ("$ref", "$dynamicRef", "$recursiveRef") and not value.startswith("#"))
                or (key == "$id" and not value.startswith("#") and not _DRAFT_URI.fullmatch(value))
                or (key == "$schema" and not _DRAFT_URI.fullmatch(value))
                or (key == "id" and draft04 and not value.startswith("#")
                    and (":" in value or value.startswith("//"))))
            if outside:
                raise ConfigError(f"{key} at {at} is {_quote(value)}, which could make the "
                                  "schema compiler read outside it")
        _self_contained(value, f"{at}/{key}", root)


def _mentions(node: Any, name: str) -> bool:
    if isinstance(node, str):
        return node == name
    if isinstance(node, list):
        return any(_mentions(v, name) for v in node)
    if isinstance(node, dict):
        return name in node or any(_mentions(v, name) for v in node.values())
    return False


def _restrict(schema: dict, hidden: list[str]) -> bytes:
    """The schema the model is offered: hidden names removed from properties and required.
    A hidden parameter must be a top-level property that nothing else in the schema could
    still require or match; this over-refuses on purpose."""
    if not hidden:
        return encode_canonical(schema)
    props = schema.get("properties")
    for name in hidden:
        if not isinstance(props, dict) or name not in props:
            raise ConfigError(f"the rule hides {_quote(name)}, which is not a top-level "
                              "property of the input schema")
    if "patternProperties" in schema:
        raise ConfigError("the rule hides parameters and the input schema has "
                          "patternProperties, which could still match them")
    for keyword in _HIDE_CHECKED:
        for name in hidden:
            if _mentions(schema.get(keyword), name):
                raise ConfigError(f"the rule hides {_quote(name)} and the input schema's "
                                  f"{keyword} mentions it")
    out = {**schema, "properties": {k: v for k, v in props.items() if k not in hidden}}
    if isinstance(schema.get("required"), list):
        out["required"] = [r for r in schema["required"] if r not in hidden]
        if not out["required"]:
            del out["required"]
    return encode_canonical(out)


# ==== 18. Configuration ====
# One JSON file, read with the strict parser: a repeated key anywhere, an unknown field at any
# level, or a value of the wrong type is refused with an error naming the field and the file.
# It is read only when the current user owns it and nobody else can write it; so are the
# manifests. Relative paths are relative to the file's own directory.

POLICY_ID_PREFIX = "agentrt-proxy/sha256:"
DEFAULT_HOLD = 15.0
DEFAULT_REPEAT_WINDOW = 600.0
REPEATS = ("refuse", "ask")          # an identical call within the window (section 10)
DEFAULT_MAX_PENDING = 5
DEFAULT_STATUS_TOOL = "gate_status"
MIN_LEASE_TTL = 3.0
# A server's default_timeout when the configuration gives none: a tool call without its own
# timeout is cut off after this long (its outcome is then unknown, if it mutates).
DEFAULT_TOOL_TIMEOUT = 30.0
MANIFEST_SUFFIX = ".manifest.json"     # a server's manifest when none is named: <name>.<this>
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
CONFIG_OUTCOMES = ("allow", "require_approval", "deny")
# SQLite keeps part of the database beside it: a server that writes the WAL (or a hot
# journal) rewrites committed rows, approvals included, as surely as one that writes the file.
DATABASE_SIDECARS = ("-wal", "-shm", "-journal")


class ConfigError(ProxyError):
    """A configuration, manifest or rule that cannot be used as written."""


@dataclasses.dataclass(frozen=True, repr=False)
class Rule:
    """The operator's classification of one upstream tool."""
    side_effect: str = ""
    timeout: float = 0.0
    terminal: bool = False
    description: str = ""
    deny: tuple[str, ...] = ()
    fixed: tuple[tuple[str, bytes], ...] = ()      # name -> canonical JSON bytes, sorted
    rename: str = ""
    allow_hint_mismatch: bool = False
    outcome: str = ""
    repeat_window: float | None = None
    repeat: str = ""                         # "" : the configuration's default
    when: tuple["Condition", ...] = ()      # section 20
    limits: tuple["Limit", ...] = ()


@dataclasses.dataclass(frozen=True, repr=False)
class ServerConfig:
    """One entry of the configuration's servers."""
    name: str
    command: tuple[str, ...] = ()
    endpoint: str = ""
    env: tuple[str, ...] = ()
    inherit_env: tuple[str, ...] = ()
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    default_timeout: float = 0.0
    manifest: str = ""
    rules: tuple[tuple[str, Rule], ...] = ()
    skip_path_check: bool = False
    cwd: str = ""           # a stdio server starts in the configuration's directory

    @property
    def rule_map(self) -> dict[str, Rule]:
        return dict(self.rules)


@dataclasses.dataclass(frozen=True, repr=False)
class Config:
    """The configuration file as loaded and checked; the database is named relative to
    the file's directory."""
    path: str
    database: str
    session: str
    servers: tuple[ServerConfig, ...]
    policy: tuple[tuple[str, str], ...] = tuple(DEFAULT_POLICY.items())
    hold: float = DEFAULT_HOLD
    repeat_window: float = DEFAULT_REPEAT_WINDOW
    repeat: str = "refuse"
    max_pending: int = DEFAULT_MAX_PENDING
    approval_ttl: float = DEFAULT_APPROVAL_TTL
    grant_ttl: float = DEFAULT_GRANT_TTL
    status_tool: str = DEFAULT_STATUS_TOOL
    lease_ttl: float = DEFAULT_LEASE_TTL
    policy_given: tuple[str, ...] = ()      # the classes the configuration's policy names
    on_pending: tuple[str, ...] = ()         # the operator's notification command, argv

    @property
    def policy_map(self) -> dict[str, str]:
        return dict(self.policy)

    def policy_id(self) -> str:
        """The identity of exactly what the policy decides from: the policy map (defaults
        merged) and, per server by name, each rule's class, outcome, fixed values, rename,
        conditions and limits, each given only when set. Descriptions, timeouts, hold,
        windows, TTLs and paths leave it unchanged."""
        def written(rule: Rule) -> dict:
            given = {"outcome": rule.outcome, "rename": rule.rename,
                     "fixed": {k: RawJSON(v) for k, v in rule.fixed},
                     "when": [c.written() for c in rule.when],
                     "limits": [lim.written() for lim in rule.limits]}
            return {"side_effect": rule.side_effect, **{k: v for k, v in given.items() if v}}
        servers = [{"name": s.name, "rules": {tool: written(rule) for tool, rule in s.rules}}
                   for s in sorted(self.servers, key=lambda s: s.name)]
        doc = dump_json({"policy": self.policy_map, "servers": servers}).encode()
        return POLICY_ID_PREFIX + sha256_hex(canonical_json(doc))


OWNED_READ_CHUNK = 1 << 20             # bytes read from an owned file at a time
OWNED_FILE_MAX = 64 << 20              # an owned file (configuration, manifest) at most


def read_owned(path: str) -> bytes:
    """Read a file that decides what tools may do, only if it is a regular file owned by the
    current user that group and others cannot write. What is checked is what is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path} is not a regular file")
        mode = stat.filemode(stat.S_IFREG | (st.st_mode & 0o777))
        if st.st_mode & 0o022:
            raise ConfigError(f"{path} ({mode}) lets its group or others write it: "
                              f"run 'chmod go-w {path}'")
        if st.st_uid != os.getuid():
            raise ConfigError(f"{path} ({mode}) is owned by uid {st.st_uid}, "
                              "not by the current user")
        chunks, size = [], 0
        for chunk in iter(lambda: os.read(fd, OWNED_READ_CHUNK), b""):
            size += len(chunk)
            if size > OWNED_FILE_MAX:
                raise ConfigError(f"{path} is over {OWNED_FILE_MAX // (1 << 20)} MiB: not a "
                                  "configuration, manifest or host file this proxy reads")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class _ConfigObject:
    """Strict reading of one JSON object: each field once, of its type, none unknown."""

    def __init__(self, doc: Any, where: str, known: Iterable[str]):
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected an object")
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown field {_quote(unknown[0])}")
        self.doc, self.where = doc, where

    def _get(self, name: str, kinds: tuple, what: str, default: Any,
             fits: Callable[[Any], bool] = lambda value: True) -> Any:
        if name not in self.doc:
            return default
        value = self.doc[name]
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)) \
                or not fits(value):
            raise ConfigError(f"{self.where}: {name} must be {what}")
        return value

    def text(self, name: str, default: str = "") -> str:
        return self._get(name, (str,), "a string", default)

    def flag(self, name: str) -> bool:
        return self._get(name, (bool,), "true or false", False)

    def texts(self, name: str) -> tuple[str, ...]:
        return tuple(self._get(name, (list,), "an array of strings", [],
                               lambda items: all(isinstance(i, str) for i in items)))

    def duration(self, name: str, default: float | None) -> float | None:
        value = self._get(name, (str,), 'a duration string such as "15s"', None)
        if value is None:
            return default
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise ConfigError(f"{self.where}: {name}: {exc}") from None

    def obj(self, name: str) -> dict:
        return self._get(name, (dict,), "an object", {})

    def repeat(self) -> str:
        """What an identical call within the window meets; "" where the field is not given."""
        return self._get("repeat", (str,), '"refuse" or "ask"', "",
                         lambda value: value in ("", *REPEATS))


# The fields a file may give: the records' own, less those the loader itself fills in.
_TOP_FIELDS = {f.name for f in dataclasses.fields(Config)} - {"path", "policy_given"}
_SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)} - {"cwd"}
_RULE_FIELDS = {f.name for f in dataclasses.fields(Rule)}


def load_config(path: str) -> Config:
    """Read, parse and validate the configuration at ``path``."""
    path = os.path.abspath(path)
    raw = read_owned(path)
    try:
        return parse_config(raw, path)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from None


def parse_config(raw: bytes, path: str) -> Config:
    try:
        doc = parse_json(raw)
    except JSONError as exc:
        raise ConfigError(f"not usable JSON: {exc}") from None
    top = _ConfigObject(doc, "configuration", _TOP_FIELDS)
    base = os.path.dirname(path)
    database = top.text("database")
    if not database:
        raise ConfigError("database is required")
    session = top.text("session")
    if not _NAME_RE.fullmatch(session):
        raise ConfigError(f"session {_quote(session)} must be 1 to 64 letters, digits, _ or -")
    policy, given = dict(DEFAULT_POLICY), top.obj("policy")
    for cls, outcome in given.items():
        if cls not in SIDE_EFFECTS:
            raise ConfigError(f"policy: unknown side effect {_quote(cls)}")
        policy[cls] = _outcome(outcome, f"policy: {cls}")
    max_pending = int(top._get("max_pending", (Num,), "a whole number",
                               Num(str(DEFAULT_MAX_PENDING)), Num.is_integer).exact())
    if max_pending < 0:
        raise ConfigError("max_pending must not be negative")
    lease_ttl = top.duration("lease_ttl", DEFAULT_LEASE_TTL)
    if lease_ttl < MIN_LEASE_TTL:
        raise ConfigError(f"lease_ttl {fmt_duration(lease_ttl)} is shorter than "
                          f"{fmt_duration(MIN_LEASE_TTL)}")
    status_tool = top.text("status_tool", DEFAULT_STATUS_TOOL)
    if not _NAME_RE.fullmatch(status_tool):
        raise ConfigError(f"status_tool {_quote(status_tool)} does not match "
                          "^[a-zA-Z0-9_-]{1,64}$")
    servers_doc = top._get("servers", (list,), "an array of servers", [])
    if not servers_doc:
        raise ConfigError("at least one server is required")
    servers: list[ServerConfig] = []
    for i, entry in enumerate(servers_doc):
        server = _parse_server(entry, i, base)
        if any(s.name == server.name for s in servers):
            raise ConfigError(f"servers[{i}]: the name {_quote(server.name)} is used twice")
        servers.append(server)
    check_shared_limits(servers)
    return Config(
        path=path, database=os.path.join(base, database), session=session,
        servers=tuple(servers), policy=tuple(policy.items()),
        hold=top.duration("hold", DEFAULT_HOLD),
        repeat_window=top.duration("repeat_window", DEFAULT_REPEAT_WINDOW),
        repeat=top.repeat() or "refuse",
        max_pending=max_pending or DEFAULT_MAX_PENDING,
        approval_ttl=top.duration("approval_ttl", DEFAULT_APPROVAL_TTL),
        grant_ttl=top.duration("grant_ttl", DEFAULT_GRANT_TTL),
        status_tool=status_tool, lease_ttl=lease_ttl,
        policy_given=tuple(sorted(given)), on_pending=_parse_on_pending(top))


def _outcome(outcome: Any, where: str) -> str:
    """One of the outcomes a policy or a rule may name, or an error naming ``where``."""
    if outcome not in CONFIG_OUTCOMES:
        raise ConfigError(f"{where}: outcome {_quote(str(outcome))} is not allow, "
                          "require_approval, or deny")
    return outcome


# -- on_pending: the command the proxy starts when an approval starts to wait --

def _parse_on_pending(top: _ConfigObject) -> tuple[str, ...]:
    """An argv, never a shell line: a non-empty array of strings whose program is an absolute
    path to an executable file or a name found on PATH now. A name is resolved here, once,
    so that the program that runs is the one the configuration named when it was read."""
    if "on_pending" not in top.doc:
        return ()
    argv = top.doc["on_pending"]
    if not isinstance(argv, list) or not argv or \
            not all(isinstance(a, str) and a for a in argv):
        raise ConfigError("on_pending must be a non-empty array of non-empty strings: the "
                          'program and its arguments, such as ["/usr/bin/notify-send", '
                          '"approval waiting"]')
    program = argv[0]
    if os.path.isabs(program):
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ConfigError(f"on_pending: {_quote(program)} is not an executable file")
        return tuple(argv)
    if os.sep in program or (os.altsep and os.altsep in program):
        raise ConfigError(f"on_pending: {_quote(program)} is a relative path; name the "
                          "program by its absolute path, or by a name found on PATH")
    found = shutil.which(program)
    if not found:
        raise ConfigError(f"on_pending: the program {_quote(program)} is not found on PATH; "
                          "name it by its absolute path")
    return (os.path.abspath(found), *argv[1:])


def check_reach(cfg: Config) -> None:
    """Refuse a stdio server whose arguments name the configuration, a manifest, the database
    or one of its sidecars, the proxy's own file, or a directory holding one; a relative
    argument is read from the configuration's directory, where the server starts. A guard
    against a mistake in the configuration, not a boundary: it cannot see what a server
    reaches by other means."""
    # SQLite names the sidecars after the path it opened: beside the name given and beside
    # the file it resolves to. A server that can rewrite the proxy's own code rewrites the gate.
    # os.path.realpath resolves a path that does not exist yet through its directory.
    db = (cfg.database, os.path.realpath(cfg.database))
    here = os.path.abspath(__file__)
    protected = [cfg.path, *(d + s for d in db for s in ("", *DATABASE_SIDECARS)),
                 *(s.manifest for s in cfg.servers), here, os.path.realpath(here)]
    base = os.path.dirname(cfg.path)    # where a stdio server starts (section 15)
    idents: dict[tuple[int, int], str] = {}     # a protected file, or a directory holding one
    unborn: dict[str, str] = {}                 # one that does not exist yet, by its real path
    for path in protected:
        if not os.path.lexists(path):
            unborn.setdefault(os.path.realpath(path), path)
        for start in (os.path.abspath(path), os.path.realpath(path)):
            for ancestor in _ancestors(start):
                with contextlib.suppress(OSError):
                    st = os.stat(ancestor)
                    idents.setdefault((st.st_dev, st.st_ino), path)
    for server, arg in [(s, a) for s in cfg.servers if not s.skip_path_check
                        for a in s.command[1:]]:
        for candidate in _reach_candidates(arg):
            candidate = os.path.join(base, candidate)
            try:
                st = os.stat(candidate)
                hit = idents.get((st.st_dev, st.st_ino))
            except OSError:
                hit = unborn.get(os.path.realpath(candidate))
            if hit:
                raise ConfigError(
                    f"server {_quote(server.name)}: the argument {_quote(arg)} reaches "
                    f"{hit}, which the proxy's policy and approvals depend on: point the "
                    "server elsewhere, or set skip_path_check on it if it cannot write there")


def _ancestors(path: str) -> list[str]:
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def _reach_candidates(arg: str) -> list[str]:
    """The paths an argument may name: itself, after its first '=' or ':', the rest of a
    short flag such as -r/path, a file:// URL's path, and a leading ~ expanded."""
    found = [arg] + [arg.split(sep, 1)[1] for sep in "=:" if sep in arg]
    if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
        found.append(arg[2:])
    for cand in [c for c in found if ":" in c]:     # no colon: no scheme
        try:
            url = urllib.parse.urlsplit(cand)
        except ValueError:          # not a URL (an unclosed "[" host): no path to add
            continue
        if url.scheme.lower() == "file":
            found.append(urllib.parse.unquote(url.path))
    home = os.path.expanduser("~")
    return [home + c[1:] if c == "~" or c.startswith("~/") else c for c in found if c]


def _parse_server(entry: Any, i: int, base: str) -> ServerConfig:
    f = _ConfigObject(entry, f"servers[{i}]", _SERVER_FIELDS)
    name = f.text("name")
    if not name:
        raise ConfigError(f"servers[{i}]: name is required")
    where = f"server {_quote(name)}"
    command, endpoint = f.texts("command"), f.text("endpoint")
    if bool(command) == bool(endpoint):
        raise ConfigError(f"{where}: exactly one of command or endpoint is required")
    if "manifest" not in f.doc and not _NAME_RE.fullmatch(name):   # ../x would leave the dir
        raise ConfigError(f"{where}: manifest is required for a name that is not 1 to 64 "
                          "letters, digits, _ or -")
    manifest = f.text("manifest", name + MANIFEST_SUFFIX)
    if not manifest:
        raise ConfigError(f"{where}: manifest is empty: name a file, or leave manifest out "
                          f"for {name}{MANIFEST_SUFFIX}")
    env, inherit = f.texts("env"), f.texts("inherit_env")
    for entry_text in env:
        if "=" not in entry_text or entry_text.startswith("="):
            raise ConfigError(f"{where}: env entry {_quote(entry_text)} is not NAME=value")
    for var in inherit:
        if not var or "=" in var:
            raise ConfigError(f"{where}: inherit_env entry {_quote(var)} is not a variable name")
    rules = tuple((tool, _parse_rule(rule_doc, f"{where}: tool {_quote(tool)}"))
                  for tool, rule_doc in sorted(f.obj("rules").items()))
    return ServerConfig(
        name=name, command=command, endpoint=endpoint, env=env, inherit_env=inherit,
        connect_timeout=f.duration("connect_timeout", 0.0) or DEFAULT_CONNECT_TIMEOUT,
        default_timeout=f.duration("default_timeout", DEFAULT_TOOL_TIMEOUT),
        manifest=os.path.join(base, manifest), rules=rules,
        skip_path_check=f.flag("skip_path_check"), cwd=base)


def _parse_rule(doc: Any, where: str) -> Rule:
    f = _ConfigObject(doc, where, _RULE_FIELDS)
    outcome = f.text("outcome")
    if outcome:                          # "": the policy decides
        _outcome(outcome, where)
    side_effect = f.text("side_effect")
    if side_effect and side_effect not in SIDE_EFFECTS:     # missing: the tool is refused
        raise ConfigError(f"{where}: side_effect {_quote(side_effect)} is not one of the four "
                          f"classes: {', '.join(SIDE_EFFECTS)}")
    fixed = tuple(sorted((k, encode_canonical(v)) for k, v in f.obj("fixed").items()))
    return Rule(side_effect=side_effect, timeout=f.duration("timeout", 0.0),
                terminal=f.flag("terminal"), description=f.text("description"),
                deny=f.texts("deny"), fixed=fixed, rename=f.text("rename"),
                allow_hint_mismatch=f.flag("allow_hint_mismatch"), outcome=outcome,
                repeat_window=f.duration("repeat_window", None), repeat=f.repeat(),
                when=parse_conditions(f.doc.get("when"), where),
                limits=parse_limits(f.doc.get("limits"), where))


# ==== 19. The proxy: one run per call ====
# Each tools/call is a run of its own, `<session>.<16 hex>`, goal `call <tool>`, holding the
# call's one step; every upstream tool is terminal, so a call that succeeds completes its run
# in the transaction that records the result. A call that was denied, invalid or failed
# leaves its run running after that step, and the proxy ends it with a fail decision of
# origin operator. Answers that are not the tool's own result are prose with a fixed prefix;
# nothing the model sees names the runtime, the operator command, the database, the
# configuration or a run id.

CALL_MAX_STEPS = 3                     # the call, one re-run, a closing decision
CALL_MAX_FAILURES = 3                  # consecutive failed steps in one call's run
CALL_LOOP_THRESHOLD = 3                # identical outcomes in a row in one call's run
TOOL_NAME_SHOWN, ARGS_SHOWN, ID_SHOWN, RUN_REASON_SHOWN = 64, 200, 100, 64
PIN_NAME_WIDTH, PIN_HINTS_WIDTH, PIN_DESCRIPTION_BYTES = 28, 26, 72
CLOSE_TOOL_ERROR = "this run held one call; the tool call returned an error"
CLOSE_DENIED = "this run held one call; the request was denied"
CLOSE_DENIED_RERUN = ("this run held one call; an operator approved running an attempt of "
                      "unknown outcome again, and the policy then denied it: nothing ran, and "
                      "the unknown outcome is resolved as a rejection resolves it")
CLOSE_INVALID = "this run held one call; the request was invalid"
CLOSE_UNRECORDED = "this run held one call; it executed and its result could not be recorded"
CLOSE_TAKEN_OVER = ("this run held one call; it was taken over after an interruption with "
                    "nothing left in it to execute")
PENDING_TEXT = (
    "PENDING_APPROVAL: this request is waiting for an operator's approval (approval {id}). "
    "Nothing has been executed. Do not call this tool again until you have been told it was "
    "approved, do not try another tool to achieve the same thing, and do not ask the user to "
    "approve it: the operator decides elsewhere. Tell the user it is waiting. After approval, "
    "call this tool again with exactly the same arguments to run it and get the result.")
REASON_BYTES, SCHEMA_ERROR_BYTES, NOTE_BYTES = 500, 1000, 500
# A schema compiler's resource URL would name the runtime in a model's text: never shown.
_RUNTIME_URL = re.compile(r" with '[a-z]+://tools/[^']*'")


def prose(prefix: str, text: str, is_error: bool) -> dict:
    """An answer in prose: one text block that starts with its prefix."""
    return {"content": [{"type": "text", "text": f"{prefix}: {text}"}], "isError": is_error}


def result_of(obs: dict) -> dict:
    """What the gate recorded, as the host's CallToolResult: the server's content as it was
    recorded (not escaped: it is data), or its error text."""
    content = obs.get("content")
    if obs.get("kind") == TOOL_RESULT:
        out = {"content": [{"type": "text", "text": result_text(obs)}], "isError": False}
        if isinstance(content, dict):
            out["structuredContent"] = content
        return out
    if obs.get("kind") == TOOL_ERROR:
        return {"content": [{"type": "text", "text": clean(error_text(obs), MAX_RESULT_BYTES)}],
                "isError": True}
    return prose("UNAVAILABLE", "the call's outcome was not recorded. Tell the user.", True)


def error_text(obs: dict) -> str:
    content = obs.get("content")
    if isinstance(content, dict) and isinstance(content.get("error"), str) and content["error"]:
        return content["error"]
    return dump_json(content) if content is not None else ""


class ProxyPolicy:
    """The policy the gate evaluates: the rule's outcome for the tool, else its class's
    outcome in the configured map. An approval binds the server, the upstream tool, the
    registered name, the class, the arguments and the operator's fixed values; a re-run of
    an attempt whose outcome is unknown asks with an interruption approval naming it,
    whatever the policy says short of deny."""

    def __init__(self, policy: dict[str, str], tools: dict[str, "UpstreamTool"],
                 proxy: "Proxy | None" = None, policy_id: str = ""):
        self.policy, self.tools, self.proxy, self.policy_id = policy, tools, proxy, policy_id
        self.seen: dict = {}             # the last call's first condition (first_condition)

    def decide(self, tool: "UpstreamTool") -> tuple[str, str]:
        if tool.rule.outcome:
            return tool.rule.outcome, \
                f"tool {tool.spec.name} is {tool.rule.outcome} by the operator's rule"
        cls = tool.spec.side_effect
        outcome = self.policy.get(cls)
        if outcome is None:
            return "deny", f'no policy for side effect "{cls}"'
        return outcome, f"side effect {cls} is {outcome} by policy"

    def evaluate(self, request: ToolRequest, view: RunView) -> PolicyDecision:
        tool = self.tools.get(request.spec.name)
        if tool is None:
            return PolicyDecision("deny", f"tool {_quote(request.spec.name)} is not offered")
        outcome, reason = self.decide(tool)
        judged = None
        if tool.rule.when or tool.rule.limits:          # section 20
            judged = judge(tool, request.args, outcome, reason, self.use_of(), self.seen,
                           self.proxy.budgets.frees_at if self.proxy is not None else None)
            outcome, reason = judged.outcome, judged.reason
        # Seed rule 6: a re-run of an unknown outcome is asked about whatever the policy
        # says short of a deny by the class or the rule. A condition's or a limit's deny
        # does not stop the question (the operator must learn the call may have taken
        # effect); it is shown, and at collection, still denying, it runs nothing.
        through = judged is not None and bool(judged.denied_by)
        attempt = self.rerun_of(request, view) if outcome != "deny" or through else None
        if outcome == "deny" and (attempt is None or _granted(request, view)):
            return PolicyDecision(outcome, reason)
        earlier = self.repeat_of(request, view) if attempt is None else None
        if attempt is not None or earlier is not None:
            decision = self.asking(tool, request.args, attempt, earlier, judged)
            return covered(decision, request, view) if judged else decision
        if outcome == "allow":
            return PolicyDecision(outcome, reason)
        if outcome != "require_approval":
            return PolicyDecision("deny", f"unknown outcome {_quote(outcome)}")
        cap = self.capability(tool, request.args)
        shown = {"question": f"May the model call {tool.remote} on server {tool.server} with "
                             "these arguments?", **cap, "reason": reason,
                 **limits_shown(tool, request.args)}         # what views read the use by
        if not judged or not judged.asked:
            return need_approval(tool.spec.side_effect, reason, cap, shown)
        cap["asked_by"], shown["figures"] = judged.asked, judged.figures
        return covered(need_approval(tool.spec.side_effect, reason, cap, shown), request, view)

    def use_of(self) -> "UseOf | None":
        """How a limit's use is read: from the proxy's index of executions."""
        return self.proxy.budgets.use_of if self.proxy is not None else None

    def outcome_of(self, tool: "UpstreamTool", args: bytes, unknown: bool = False) -> str:
        """What the policy makes of this call to ``tool``, short of an approval's kind. For
        the re-run of an unknown outcome (``unknown``) a condition's or a limit's deny asks
        instead, as evaluate decides it."""
        outcome, reason = self.decide(tool)
        if not (tool.rule.when or tool.rule.limits):
            return outcome
        try:
            judged = judge(tool, args, outcome, reason, self.use_of(), self.seen)
        except (ProxyError, ValueError):
            return "require_approval"
        through = unknown and judged.outcome == "deny" and judged.denied_by
        return "require_approval" if through else judged.outcome

    def never_runs(self, tool: "UpstreamTool") -> bool:
        """Whether every call to ``tool`` is denied, whatever its arguments."""
        return self.decide(tool)[0] == "deny" and \
            all(c.outcome == "deny" for c in tool.rule.when)

    def rerun_of(self, request: ToolRequest, view: RunView) -> dict | None:
        """The earlier attempt this request re-runs, if it does: named by the step's own
        interruption approval, or by the proxy as it proposes the re-run."""
        mine = [a for a in view.approvals if a.step_id == request.step_id]
        if mine and mine[-1].kind == INTERRUPTED_KIND:
            at = _interrupted_attempt(mine[-1])
            if at is not None:
                return at
            step = next((s for s in view.steps if s.id == request.step_id), None)
            if step is None and self.proxy is not None:
                step = next((s for s in self.proxy.store.list_steps(request.run_id)
                             if s.id == request.step_id), None)
            if step is not None:
                return _attempt(request.run_id, step, "cut_off")
        return self.proxy.reruns.get(request.run_id) if self.proxy is not None else None

    def repeat_of(self, request: ToolRequest, view: RunView) -> dict | None:
        """The earlier execution this request repeats, if the rules found one: named by
        the step's own repeat approval, or by the proxy as it proposes the call."""
        mine = [a for a in view.approvals if a.step_id == request.step_id]
        if mine:
            return repeat_in(mine[-1]) if mine[-1].kind == REPEAT_KIND else None
        return self.proxy.repeats.get(request.run_id) if self.proxy is not None else None

    def asking(self, tool: "UpstreamTool", args: bytes, at: dict | None = None,
               earlier: dict | None = None, judged: "Judgement | None" = None
               ) -> PolicyDecision:
        """An approval the proxy asks whatever the policy says short of deny: an
        interruption approval about an earlier attempt of unknown outcome (``at``), else a
        repeat approval about an earlier execution (``earlier``: its run, time and outcome).
        Built only from its inputs, which its capability names, so the pause, the
        collection and a re-check of the record hash alike. A condition or limit that asks
        too is named in it; the question is whether the tool may run again, or once more."""
        if at is not None:
            kind, reason, named = INTERRUPTED_KIND, INTERRUPTED_REASON, {"interrupted": at}
            how, ended = "again with these arguments", HOW.get(at.get("ended"), HOW["cut_off"])
            notice = (f"An earlier attempt of this call, started at {at.get('started_at')} in "
                      f"run {at.get('run_id')}, ended as follows: {ended}. "
                      "Whether it took effect is unknown: it may have. Approving runs it again "
                      "with these arguments once the model calls it again. Rejecting ends this "
                      "request, and an identical call later asks an operator again, whatever "
                      "the policy.")
        else:
            kind, reason, named = REPEAT_KIND, REPEAT_REASON, {"repeat_of": earlier}
            how = "once more with the same arguments"
            notice = (f"This exact request already executed, in run {earlier.get('run_id')}, "
                      f"finished at {earlier.get('at')}; {earlier.get('outcome')}. Approving "
                      "runs it once more, with these arguments, when the model calls it again. "
                      "Rejecting refuses it, and the model is told your note.")
        cap = {**self.capability(tool, args), **named}
        asked = judged.asked if judged is not None else []
        if asked:
            cap["asked_by"] = asked
        shown = {"question": f"May the model run {tool.remote} on server {tool.server} {how}?",
                 **cap, "reason": reason, "notice": notice, **limits_shown(tool, args)}
        if asked:
            shown["figures"] = judged.figures
        if judged is not None and judged.outcome == "deny":     # asked through it (rule 6)
            shown["figures"] = [judged.shown or judged.reason]
            shown["notice"] = f"{notice} {DENIED_RERUN_NOTICE}"
        return need_approval(kind, reason, cap, shown)

    @staticmethod
    def capability(tool: "UpstreamTool", args: bytes) -> dict:
        cap: dict[str, Any] = {"server": tool.server, "tool": tool.remote,
                               "name": tool.spec.name, "side_effect": tool.spec.side_effect,
                               "args": RawJSON(args)}
        if tool.rule.fixed:
            cap["fixed"] = {k: RawJSON(v) for k, v in tool.rule.fixed}
        return cap


# ==== 19.1 The answers the model reads ====
# Each starts with its prefix; chosen text is cleaned.

_NOT_AGAIN = ("Do not call this tool again until you are told the operator decided, and do "
              "not try another tool to achieve the same thing. Tell the user. If you are told "
              "it was approved, call this tool again with exactly the same arguments.")


def pending_approval(approval_id: str) -> dict:
    return {"content": [{"type": "text", "text": PENDING_TEXT.format(id=approval_id)}],
            "isError": False}


def repeat_pending(approval_id: str, at: Any) -> dict:
    try:
        when = fmt_time_s(parse_time(at))
    except (ValueError, TypeError, AttributeError, OverflowError):
        when = "an earlier time"
    return prose("PENDING_APPROVAL", f"this exact request already executed, at {when}, and an "
                 "operator must approve running it once more (approval "
                 f"{approval_id}). Nothing further has been executed. {_NOT_AGAIN}", False)


def interrupted(approval_id: str) -> dict:
    return prose("INTERRUPTED", "an earlier attempt of this exact request was cut off, and "
                 f"its outcome is unknown. An operator must decide whether it runs again "
                 f"(approval {approval_id}). Nothing further has been executed. {_NOT_AGAIN}",
                 False)


def unknown_outcome(ended: str, error: str, approval_id: str) -> dict:
    text = f"an attempt of this exact request ended as follows: {HOW.get(ended, HOW['cut_off'])}"
    if error:
        text += f" ({clean(error, REASON_BYTES)})"
    text += ". Whether it took effect is unknown: it may have. "
    text += (f"An operator must decide whether it runs again (approval {approval_id}). "
             if approval_id else "An identical call will wait for an operator to decide "
                                 "whether it runs again. ")
    return prose("UNKNOWN_OUTCOME", text + "Nothing further has been executed. " + _NOT_AGAIN,
                 False)


def unrecorded_answer(reason: str, window: float) -> dict:
    text = ("the server answered this request, so it executed, but its answer could not be "
            f"recorded ({clean(reason, REASON_BYTES)}). What it did is not known here: it may "
            "have taken effect. Do not call this tool again to retry it.")
    if window > 0:
        text += (f" An identical call within {fmt_duration(window)} is refused as a "
                 "duplicate.")
    return prose("UNRECORDED", text + " Tell the user.", False)


def in_progress() -> dict:
    return prose("IN_PROGRESS", "this exact request is already being executed, or the outcome "
                 "of an attempt of it is not yet known. Nothing new was started. Wait a little, "
                 "then call this tool again with exactly the same arguments to learn its "
                 "outcome.", False)


def denied_answer(reason: str) -> dict:
    return prose("DENIED", f"the policy does not allow this request: "
                           f"{clean(reason, REASON_BYTES)}. Nothing was executed.", True)


def denied_rerun_answer(reason: str) -> dict:
    return prose("DENIED", "an operator approved running this request again, but the policy "
                 f"denies it now: {clean(reason, REASON_BYTES)}. So nothing was run. Whether "
                 "the earlier attempt took effect is still unknown; the operator knows of it. "
                 "Tell the user.", True)


def denied_rerun_again(until: float) -> dict:
    return prose("DENIED", "an operator approved running this exact request again, but the "
                 f"policy denied it when it was called, so it was not run. {_closed(until)}",
                 True)


def invalid_answer(reason: str) -> dict:
    reason = reason.removeprefix("arguments do not match schema: ")
    reason = clean(_RUNTIME_URL.sub("", reason), SCHEMA_ERROR_BYTES)
    return prose("INVALID", f"the arguments do not match the tool's input schema: {reason}. "
                            "Nothing was executed. Correct the arguments and call again.", True)


def _note(note: str) -> str:
    note = note.strip()
    return f' The operator\'s note: "{clean(note, NOTE_BYTES)}".' if note else ""


def _closed(until: float) -> str:
    """How a request the operator's last word refused stays refused, for its window."""
    return (f"An identical request is refused until {fmt_time_s(until)}. Do not ask for it "
            "again; tell the user.")


def rejected(approval_id: str, note: str, until: float, rerun: bool = False) -> dict:
    """REJECTED. For a question about an earlier attempt (``rerun``), what the operator
    refused is running it again: that attempt may have taken effect, so the model is never
    told it "was not executed"."""
    what = ("running this exact request again", "Nothing further was executed; whether the "
            "earlier attempt took effect is the operator's to say.") if rerun else \
        ("this exact request", "It was not executed.")
    return prose("REJECTED", f"an operator rejected {what[0]} (approval {approval_id})."
                 f"{_note(note)} {what[1]} {_closed(until)}", True)


def cancelled_answer(note: str, until: float) -> dict:
    return prose("REJECTED", f"an operator cancelled this exact request.{_note(note)} Nothing "
                 f"further was executed. {_closed(until)}", True)


def expired(approval_id: str, until: float) -> dict:
    return prose("EXPIRED", f"the approval for this exact request (approval {approval_id}) "
                 "expired before it was used. It was not executed. An identical request is "
                 f"refused until {fmt_time_s(until)}. Tell the user.", True)


def answer_prefix(result: dict) -> str:
    """The prefix an answer starts with (DUPLICATE, REJECTED, BLOCKED, ...)."""
    try:
        return result["content"][0]["text"].split(":", 1)[0]
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""


def duplicate(at: float, window: float, outcome: str) -> dict:
    return prose("DUPLICATE", f"this exact request already executed, at {fmt_time_s(at)}. It "
                 f"is not executed again: an identical call to this tool within "
                 f"{fmt_duration(window)} of an earlier one is refused, whether it is a retry "
                 f"or meant as a new one. The earlier call's outcome: {outcome}", True)


def blocked_interrupted(tool: str, approval_id: str, approved: bool = False) -> dict:
    """Another call to the tool may have taken effect unseen. While the operator has not
    decided, the wait is for the operator; once they approved running it again, the wait is
    for the identical call that collects the grant (the seed keeps the tool blocked until
    then), and saying "until an operator decides" would send the user to someone who
    already did."""
    until = ("that earlier call is made again with exactly the same arguments, which runs it "
             "once if the policy still allows it then") if approved else "an operator decides it"
    return prose("BLOCKED", f"an earlier call to {tool} may have taken effect and its outcome "
                 f"is unknown{'; an operator approved running it again' if approved else ''} "
                 f"(approval {approval_id}), so no other call to {tool} that changes anything "
                 f"runs until {until}. Nothing was executed. Tell the user.", True)


def blocked_pending(limit: int) -> dict:
    return prose("BLOCKED", f"{limit} requests are already waiting for an operator's approval, "
                 "the most this session allows. Nothing was executed and no approval was "
                 "requested. Tell the user, and wait for the waiting requests to be decided.",
                 True)


def broken_answer(log: Callable[[str], None], exc: Exception) -> dict:
    """The answer owed when something broke in the proxy itself, logged."""
    log(f"error: {sanitize(str(exc))}")
    return unavailable("complete this request", "Whether anything was executed is not known "
                                                "here.")


def unavailable(what: str, executed: str = "Nothing was executed.") -> dict:
    said = " ".join(part for part in (f"the gate could not {what}.", executed, "Tell the user.")
                    if part)
    return prose("UNAVAILABLE", said, True)


def status_answer(proxy: "Proxy", items: list, wanted: str) -> dict:
    now = proxy.clock()
    if wanted:
        item = next((i for i in items if i[2].id == wanted), None)
        return prose("GATE_STATUS", describe(proxy, item, items, now) if item is not None else
                     f"no approval {clean(wanted, ID_SHOWN)} is known in this session from the "
                     "last hour.", False)
    waiting = [i for i in items if i[2].status == PENDING and not _expired(i[2], now)
               and i[1].run.status == WAITING]
    granted = [i for i in items if i[2].status == APPROVED and i[1].run.status == WAITING
               and (i[1].latest() is None or i[1].latest().id == i[2].id)]
    lines = [] if waiting else ["no request in this session is waiting for an operator's approval."]
    for group, one, many, what in (
            (waiting, "1 request in this session is waiting", "requests in this session are "
             "waiting", "for an operator's approval:"),
            (granted, "1 approved request waits", "approved requests wait", "for you to collect "
             "it: call the tool again with exactly the same arguments to run it:")):
        if group:
            lines.append(f"{one if len(group) == 1 else f'{len(group)} {many}'} {what}")
            lines += ["- " + describe(proxy, i, items, now) for i in group]
    tasks = proxy.tasks.open_lines()
    if tasks:
        lines.append("Open tasks of this session's host (each polled by the host, which is "
                     "told the call's answer once it has one):")
        lines += ["- " + line for line in tasks]
    limits = proxy.budgets.lines()
    if limits:
        lines.append("The limits on this session's tools, and what they have used (a call "
                     "over a limit waits for an operator or is denied):")
        lines += ["- " + line for line in limits]
    return prose("GATE_STATUS", "\n".join(lines), False)


def describe(proxy: "Proxy", item: tuple, items: list, now: float) -> str:
    """One approval: which call, then the first state that holds."""
    row, state, a = item
    try:
        args = encode_canonical(parse_json(a.request().args, strict=False)).decode()
    except (ProxyError, KeyError, ValueError):
        args = ""
    who = f"approval {a.id}, {clean(row.tool, TOOL_NAME_SHOWN)} with {clean(args, ARGS_SHOWN)}: "
    age = fmt_duration(max(0, round(now - parse_time(a.created_at))))
    # A pending row waits only while its run does (a row of a cancelled run may be left
    # pending by an older build or an edit): the model is never told to wait for nothing.
    waiting = a.status == PENDING and not _expired(a, now) and state.run.status == WAITING
    if waiting and a.kind == INTERRUPTED_KIND:
        late = late_outcome(proxy.store, a)
        if late:
            return who + (f"waiting {age} for an operator to decide whether it runs again; "
                          f"the earlier attempt it asks about {late}; nothing further has been "
                          "executed.")
        return who + (f"OUTCOME UNKNOWN, waiting {age} for an operator to decide whether it "
                      "runs again; an earlier attempt may have taken effect; nothing further "
                      "has been executed.")
    if waiting and a.kind == REPEAT_KIND:
        at = (repeat_in(a) or {}).get("at", "")
        return who + (f"PENDING for {age}: this exact request already executed (at "
                      f"{clean(str(at), ID_SHOWN)}), and an operator decides whether it runs "
                      "once more; nothing further has been executed; do not call the tool "
                      "again until it is approved.")
    if waiting:
        return who + (f"PENDING for {age}; nothing has been executed; the operator decides "
                      "elsewhere; do not call the tool again until it is approved.")
    if a.status in (REJECTED, EXPIRED, CANCELLED_APPROVAL, PENDING) and \
            a.kind == INTERRUPTED_KIND:
        late = view_of(proxy.store, a).late
        if late is not None and late.known:
            took = ", so it did take effect" if late.doc.get("kind") == TOOL_RESULT else ""
            return who + (f"{'CLOSED' if a.status == PENDING else a.status.upper()}: it was "
                          f"not run again, and the earlier attempt it asked about "
                          f"{late.text()}{took}.")
    if a.status == PENDING:
        return who + ("CANCELLED by the operator. It was not executed." if state.run.reason
                      == "operator_cancelled" else "EXPIRED without a decision; it was not "
                      "executed.")
    if a.status == SETTLED_APPROVAL:
        late = late_outcome(proxy.store, a) or "finished after it was cut off"
        return who + (f"SETTLED: the earlier attempt it asked about {late}. It is not run "
                      "again; an identical call is answered with that outcome.")
    ended = {REJECTED: f"REJECTED by the operator.{_note(a.note)} It was not executed; do not "
                       "ask for it again.", EXPIRED: "EXPIRED; it was not executed.",
             CANCELLED_APPROVAL: f"CANCELLED by the operator.{_note(a.note)} It was not "
                                 "executed." if state.run.reason != HOST_WITHDRAWN else
             "WITHDRAWN: the host cancelled its task before an operator decided. It was not "
             "executed; an identical call asks again."}
    if a.status in ended:
        return who + ended[a.status]
    step = next((s for s in state.steps if s.id == a.step_id), None)
    ran = _ran(proxy, row, state, step, items, a, now) if step is not None else ""
    if ran:
        return who + "APPROVED and executed: " + ran
    latest = state.latest()
    if latest is not None and latest.id != a.id:
        return who + f"APPROVED, and then a different approval was asked for the same call " \
                     f"(approval {latest.id})."
    if state.run.status == WAITING:
        return who + (f"APPROVED, awaiting collection: call {clean(row.tool, TOOL_NAME_SHOWN)} "
                      "again with exactly the same arguments to run it and get the result.")
    if not state.terminal:
        return who + "APPROVED and executing now."
    kind = step.obs_kind if step is not None else ""
    why = ("the policy denied it when it was collected" if kind == POLICY_DENIED else
           "its arguments no longer matched the tool's schema when it was collected"
           if kind == INVALID_DECISION else
           "an operator cancelled it" if state.run.reason == "operator_cancelled" else
           "the approval expired before it was collected"
           if state.run.reason == "approval_expired" else
           f"its run ended ({clean(state.run.reason, RUN_REASON_SHOWN)})")
    return who + f"APPROVED but not executed, because {why}."


def _ran(proxy: "Proxy", row, state: RunState, step: Step, items: list, a: Approval,
         now: float) -> str:
    """What an approved step that executed came to; '' when it did not execute."""
    tool = proxy.tools.get(row.tool)
    if step.status == "interrupted" and step.obs_content.get("previous_status") == "executing":
        return _ran_unknown(row, items, a, "cut_off", now)
    if step.obs_kind == TOOL_RESULT:
        return "it succeeded."
    if step.obs_kind == INTERRUPTED_OBS and "by" in step.obs_content and \
            _tool_started(proxy.store, state.run.id, step.id):
        return "an operator cancelled its run while it executed, so it may have taken effect."
    if step.obs_kind != TOOL_ERROR:
        return ""
    err = clean(error_text(step.observation), REASON_BYTES)
    if tool is not None and _unrecorded(tool, step.observation):
        return (f"the server answered but its result could not be recorded ({err}); it may "
                "have taken effect.")
    ended = unknown_ending(tool, step.observation)      # NO_ANSWER: a tool no longer offered
    if ended is None:
        return f"the server reported a failure: {err}"
    return _ran_unknown(row, items, a, ended, now)


def _ran_unknown(row, items: list, a: Approval, ended: str, now: float) -> str:
    text = f"{HOW[ended]}, so whether it took effect is unknown: it may have. "
    nxt = [i for i in items if i[0].key == row.key and i[2].id != a.id and
           i[2].kind == INTERRUPTED_KIND and i[2].status == PENDING and not _expired(i[2], now)]
    if nxt:
        return text + f"Approval {nxt[-1][2].id} now waits for an operator to decide whether " \
                      "it runs again."
    return text + "No approval to run it again is waiting now."


# What a host is told of each class, in MCP's tool annotations: readOnlyHint and
# destructiveHint always, so that no host falls back on MCP's defaults, which take a tool
# with no hints as destructive; openWorldHint only where the class says it (a mutation is
# local or remote). read_only and destructive say nothing of the world a tool reaches (a web
# search is read-only and open), so they claim nothing, and a host reads MCP's default.
CLASS_ANNOTATIONS = {
    "read_only": {"readOnlyHint": True, "destructiveHint": False},
    "local_mutation": {"readOnlyHint": False, "destructiveHint": False, "openWorldHint": False},
    "remote_mutation": {"readOnlyHint": False, "destructiveHint": False, "openWorldHint": True},
    "destructive": {"readOnlyHint": False, "destructiveHint": True},
}


def status_tool_entry(name: str) -> dict:
    return {"name": name, "annotations": CLASS_ANNOTATIONS["read_only"],
            "description": ("Reports the requests in this session that are waiting for an "
                            "operator's approval, or, given approval_id, what became of that "
                            "one: pending, approved, executed, rejected or expired. It only "
                            "reports; it never runs or approves anything."),
            "inputSchema": {"type": "object", "properties": {"approval_id": {
                "type": "string",
                "description": "The approval id that a pending result named."}},
                "additionalProperties": False}}


# ==== 19.2 on_pending: the operator's command ====
# Started when an approval starts to wait.

ON_PENDING_TIMEOUT = 10.0       # seconds the command may run; then its process group is killed
ON_PENDING_RUNNING = 8          # approval notices running at once; past it, they queue
ON_PENDING_QUEUED = 256         # approval notices waiting for a slot; past it, skipped (logged)
ON_PENDING_DRIFT_RUNNING = 2    # drift notices running at once, in slots of their own;
                                # past it, one is skipped (logged)
ON_PENDING_CLOSE_GRACE = 1.0    # at shutdown, what a command still running is given


class Notifier:
    """Runs the configuration's on_pending argv (never a shell) for each approval that starts
    to wait, with one JSON object (waiting_doc) on its stdin. Each runs detached: a session of
    its own (no controlling terminal, no signal meant for the proxy's group), its output
    discarded, killed with its process group after ON_PENDING_TIMEOUT. Starting, writing and
    waiting happen on a daemon thread, so the call that asked for the approval waits for none
    of it and the deciding lock is never held across it. A failure is logged and changes
    nothing else. At most ON_PENDING_RUNNING approval notices run at once, so a burst of
    approvals a model asks for cannot fill the process table; past that they queue (bounded)
    and run as slots free up. Drift notices have slots of their own, so a server that keeps
    changing its tools can never crowd out the notice that an approval waits."""

    def __init__(self, argv: Iterable[str], log: Callable[[str], None]):
        self.argv, self.log = tuple(argv), log
        self._slots = threading.BoundedSemaphore(ON_PENDING_RUNNING)
        self._drift_slots = threading.BoundedSemaphore(ON_PENDING_DRIFT_RUNNING)
        self._queue: list[tuple[str, Callable[[], dict]]] = []
        self._queue_lock = threading.Lock()     # the queue, and handing a slot on from it
        self._closed = False                    # set at shutdown: nothing new starts
        self._lock = threading.Lock()
        self._running: dict[int, subprocess.Popen] = {}      # by pid, until reaped

    def notify(self, label: str, doc: Callable[[], dict], drift: bool = False) -> None:
        """Start the command for this approval (or, with ``drift``, this drift notice);
        ``doc`` is built on the thread."""
        if not self.argv:
            return
        slots = self._drift_slots if drift else self._slots
        label = label if drift else f"approval {label}"
        with self._queue_lock:
            if self._closed:
                return
            if not slots.acquire(blocking=False):
                if drift:
                    self.log(f"on_pending: {ON_PENDING_DRIFT_RUNNING} drift notices are still "
                             f"running; not started for {label}")
                elif len(self._queue) < ON_PENDING_QUEUED:
                    self._queue.append((label, doc))
                else:
                    self.log(f"on_pending: {ON_PENDING_QUEUED} notices wait for one of "
                             f"{ON_PENDING_RUNNING} running; not started for {label}")
                return
        try:
            threading.Thread(target=self._run, args=(label, doc, slots), daemon=True,
                             name="on_pending").start()
        except RuntimeError as exc:         # no thread can be started now
            slots.release()
            self.log(f"on_pending: not started for {label}: {exc}")

    def _run(self, label: str, doc: Callable[[], dict], slots) -> None:
        """Run the command, then the next queued approval notice in the same slot; the slot
        is given back, under the queue's lock, only when none waits."""
        while True:
            try:
                self._once(label, (dump_json(doc()) + "\n").encode())
            except (ProxyError, OSError, ValueError, TypeError) as exc:
                self.log(f"on_pending: {label}: {exc}")
            except BaseException:
                slots.release()
                raise
            with self._queue_lock:
                if slots is not self._slots or not self._queue or self._closed:
                    slots.release()
                    return
                label, doc = self._queue.pop(0)

    def _once(self, label: str, data: bytes) -> None:
        # Started and registered under the lock close() reads the running ones under, once
        # it has said closed: so a command is either killed at shutdown or never started.
        with self._lock:
            if self._closed:
                return
            try:
                proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                self.log(f"on_pending: {self.argv[0]} could not be started for "
                         f"{label}: {exc.strerror or exc}")
                return
            self._running[proc.pid] = proc
        try:
            proc.communicate(data, timeout=ON_PENDING_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            with contextlib.suppress(subprocess.TimeoutExpired, OSError, ValueError):
                proc.communicate(timeout=ON_PENDING_TIMEOUT)       # reaped: no zombie
            self.log(f"on_pending: killed after {fmt_duration(ON_PENDING_TIMEOUT)} ({label})")
            return
        finally:
            with self._lock:
                self._running.pop(proc.pid, None)
        if proc.returncode != 0:
            self.log(f"on_pending: exited with status {proc.returncode} ({label})")

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """SIGKILL to the command's own process group (its pid: it leads a new session),
        sent only while it is not yet reaped, so the group id is still its own."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """At shutdown: nothing queued starts; a command still running gets
        ON_PENDING_CLOSE_GRACE, then its group is killed, so none outlives the proxy."""
        with self._queue_lock:
            self._closed, dropped = True, len(self._queue)
            self._queue.clear()
        if dropped:
            self.log(f"on_pending: shutting down; {dropped} queued notice(s) not started")
        deadline = time.monotonic() + ON_PENDING_CLOSE_GRACE
        with self._lock:
            running = list(self._running.values())
        for proc in running:         # its own thread reaps it once it is killed
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            self._kill(proc)


# ==== 20. Conditions and limits: a rule's, and what they make of one call ====
# Policy by argument value. A rule's `when` decides by the values of the arguments, and its
# `limits` by what its tools have executed (DESIGN section 9): this section reads both from a
# rule and judges one call by them, handed each limit's use and when its window frees
# (section 20.1 counts them), so each function here is one of the configuration, the call,
# the run's view and what it is handed. A condition is a JSON Schema compiled by section 7
# under the limits of an input schema, and the conditions of one call share one check's
# budget, so no arguments make them cost more than checking the arguments may.
#
# Sums are exact integers in units of 10**-LIMIT_PLACES. A value is rounded up to a unit
# (exact for any value with at most LIMIT_PLACES decimal places, otherwise counted as a
# little more, never less), and a value of 10**LIMIT_DIGITS or more, above any max, counts as
# that much: a number of ten thousand digits costs what a small one does.

LIMIT_PLACES = 36                    # decimal places a sum is counted exactly to
LIMIT_DIGITS = 36                    # a max is below 10**LIMIT_DIGITS
_UNIT = 10 ** LIMIT_PLACES
_CAP = 10 ** (LIMIT_DIGITS + LIMIT_PLACES)
MAX_CONDITIONS, MAX_LIMITS, WHY_CHARS = 32, 8, 200
MIN_PER, MAX_PER = 1.0, 31 * 86400.0
MAX_CALLS_DIGITS = 12                # calls is at most 999,999,999,999
_WHEN_FIELDS = ("if", "outcome", "why")
_LIMIT_FIELDS = ("calls", "sum", "max", "per", "over", "name")
_STRICTER = {"allow": 0, "require_approval": 1, "deny": 2}
# The validator's keywords (section 7) that constrain values of one JSON type: a value of any
# other type passes them. A condition gives `type` with each (DESIGN section 9), or
# {"maximum": 5} lets "500" through. (unevaluatedItems and unevaluatedProperties are not
# here: the validator refuses them.)
_ONE_TYPE_KEYWORDS = {
    "number": _NUMERIC,
    "string": frozenset({"pattern", "minLength", "maxLength"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "contains", "minItems",
                        "maxItems", "uniqueItems", "minContains", "maxContains"}),
    "object": frozenset({"properties", "patternProperties", "additionalProperties",
                         "required", "minProperties", "maxProperties", "propertyNames",
                         "dependentRequired", "dependentSchemas", "dependencies"}),
}
_KEYWORD_TYPE = {key: kind for kind, keys in _ONE_TYPE_KEYWORDS.items() for key in keys}
_TYPES_CONSTRAINED = {"number": {"number", "integer"}, "string": {"string"},
                      "array": {"array"}, "object": {"object"}}
_MAX_TEXT = re.compile(r"(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_DAYS = re.compile(r"[1-9][0-9]{0,2}d")


@dataclasses.dataclass(frozen=True, repr=False)
class Condition:
    """when[index]: when the arguments, as the server receives them, match ``schema``."""
    index: int
    schema_json: bytes               # the `if` schema, canonical: compared and hashed
    outcome: str
    why: str = ""
    schema: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"when[{self.index}]"

    def written(self) -> dict:
        why = {"why": self.why} if self.why else {}
        return {"if": RawJSON(self.schema_json), "outcome": self.outcome, **why}


@dataclasses.dataclass(frozen=True, repr=False)
class Limit:
    """limits[index]: at most ``most`` executions, or a sum of at most ``most`` (in units) of
    the value at ``pointer``, within the last ``per`` seconds."""
    index: int
    per: float
    over: str = "require_approval"
    name: str = ""
    pointer: str = ""                # the value a sum adds up; "" for a limit of calls
    most: int = 0                    # the most calls, or the max sum in units

    @property
    def ref(self) -> str:
        """What a capability names: stable however the window moves."""
        return self.name or f"limits[{self.index}]"

    @property
    def label(self) -> str:
        return f'limit "{self.name}"' if self.name else f"limits[{self.index}]"

    def key(self, server: str, remote: str) -> str:
        """The counter it is counted under: its name, or its place; and what it counts and
        over what window, so that a sum of another pointer never reads this one's rows, and
        a longer window starts from the history (Budgets.catch_up), not from its rows."""
        what = f"{'sum ' + self.pointer if self.pointer else 'calls'} per {fmt_duration(self.per)}"
        where = ["name", self.name] if self.name else ["tool", server, remote, self.index]
        return dump_json(where + [what])

    def written(self) -> dict:
        named = {"name": self.name} if self.name else {}
        most = {"sum": self.pointer, "max": fmt_units(self.most)} if self.pointer else \
            {"calls": Num(str(self.most))}
        return {"per": fmt_duration(self.per), "over": self.over, **named, **most}

    def what(self) -> str:
        return f"sum of {self.pointer}" if self.pointer else "calls"

    def shown(self, units: int) -> str:
        return fmt_units(units) if self.pointer else str(units)


def to_units(num: Num) -> int:
    """A number of at least 0 in units of 10**-LIMIT_PLACES, rounded up, at most _CAP; in
    time linear in its literal (no power of ten beyond _CAP is built)."""
    sign, digits, exponent = num.normal()
    if sign == 0:
        return 0
    if exponent + len(digits) > LIMIT_DIGITS:
        return _CAP
    shift = exponent + LIMIT_PLACES
    if shift >= 0:
        return int(digits) * 10 ** shift
    keep = len(digits) + shift          # the digits at or above one unit; digits has no
    if keep <= 0:                       # trailing zero, so any cut-off part is above zero
        return 1
    return int(digits[:keep]) + (1 if keep < len(digits) else 0)


def fmt_units(units: int) -> str:
    if units >= _CAP:
        return f"at least 1e{LIMIT_DIGITS}"
    whole, part = divmod(units, _UNIT)
    return str(whole) + (("." + str(part).rjust(LIMIT_PLACES, "0").rstrip("0")) if part else "")


# -- reading them from a rule (section 18 calls these) --

def _entries(doc: Any, where: str, field: str, what: str, most: int) -> list:
    """A rule's `when` or `limits`: an array of at most ``most`` entries ([] if absent)."""
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise ConfigError(f"{where}: {field} must be an array of {what}")
    if len(doc) > most:
        raise ConfigError(f"{where}: {field} holds {len(doc)} {what}, more than {most}")
    return doc


def _check_printable(text: str, at: str, field: str) -> None:
    """A text shown to the model and the operator as it is written."""
    bad = next((ch for ch in text if not ch.isprintable()), None)
    if bad is not None:
        raise ConfigError(f"{at}: {field} holds the character U+{ord(bad):04X}, which is not "
                          "printable")


def parse_conditions(doc: Any, where: str) -> tuple[Condition, ...]:
    out = []
    for i, entry in enumerate(_entries(doc, where, "when", "conditions", MAX_CONDITIONS)):
        at = f"{where}: when[{i}]"
        f = _ConfigObject(entry, at, _WHEN_FIELDS)
        if "if" not in f.doc:
            raise ConfigError(f"{at}: if is required: the JSON Schema the arguments match")
        if not f.text("outcome"):
            raise ConfigError(f"{at}: outcome is required: allow, require_approval, or deny")
        outcome = _outcome(f.text("outcome"), at)
        why = f.text("why")
        if "why" in f.doc and not 1 <= len(why) <= WHY_CHARS:
            raise ConfigError(f"{at}: why is {len(why)} characters; it must be 1 to {WHY_CHARS}")
        _check_printable(why, at, "why")
        if not isinstance(f.doc["if"], (dict, bool)):
            raise ConfigError(f"{at}: if must be a JSON Schema: an object or a boolean")
        raw = encode_canonical(f.doc["if"])
        try:
            schema = compile_schema(raw)
        except (SchemaError, JSONError) as exc:
            raise ConfigError(f"{at}: if: {exc}") from None
        _check_typed(schema, f"{at}: if")
        out.append(Condition(i, raw, outcome, why, schema))
    return tuple(out)


def _check_typed(schema: Schema, at: str) -> None:
    """Each schema object of a condition that uses a keyword of one type gives a type that
    holds only types the keyword constrains, and none uses format: a condition must never
    match a value it does not check. Every subschema the validator compiled is looked at.
    The root is exempt, as it checks the arguments, always an object; not when a $ref names
    it, since it then checks a nested value too."""
    for where, node in [(where, node) for where, node in schema.located()
                        if isinstance(node, dict)]:
        shown = "#" + _pointer(where)
        if "format" in node:
            raise ConfigError(f'{at}: the schema at {shown} uses "format", which constrains '
                              "nothing: the validator treats it as an annotation, so every "
                              "value passes it; remove it (to check the form of a string, "
                              'give "type": "string" and a pattern)')
        if not where and not schema.referenced(where):
            continue
        named = node.get("type", [])
        given = set(named if isinstance(named, list) else [named])
        for key, kind in [(key, _KEYWORD_TYPE[key]) for key in node if key in _KEYWORD_TYPE]:
            uses = (f"{at}: the schema at {shown} uses {_quote(key)}, which constrains "
                    f"only {kind}s")
            if not given:
                raise ConfigError(f"{uses}, and has no type: a value of any other type passes "
                                  f'it unchecked; add "type": "{kind}"')
            others = sorted(given - _TYPES_CONSTRAINED[kind])
            if others:
                raise ConfigError(f"{uses}, but its type {_show(named)} lets a value of "
                                  f"type {' or '.join(others)} pass it unchecked; make it "
                                  f'"type": "{kind}"')


def parse_limits(doc: Any, where: str) -> tuple[Limit, ...]:
    out: list[Limit] = []
    for i, entry in enumerate(_entries(doc, where, "limits", "limits", MAX_LIMITS)):
        at = f"{where}: limits[{i}]"
        f = _ConfigObject(entry, at, _LIMIT_FIELDS)
        if "per" not in f.doc:
            raise ConfigError(f'{at}: per is required: the window, such as "1h" or "24h"')
        text = f.doc["per"]          # a duration, or whole days such as "7d"
        per = int(text[:-1]) * 86400.0 if isinstance(text, str) and _DAYS.fullmatch(text) \
            else f.duration("per", 0.0)
        if not MIN_PER <= per <= MAX_PER:
            raise ConfigError(f"{at}: per {fmt_duration(per)} is not between 1s and 31d")
        over = f.text("over", "require_approval")
        if over not in ("require_approval", "deny"):
            raise ConfigError(f"{at}: over {_quote(over)} is not require_approval or deny")
        name = f.text("name")
        if "name" in f.doc and not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{at}: name {_quote(name)} must be 1 to 64 letters, digits, "
                              "_ or -")
        if any(name and other.name == name for other in out):
            raise ConfigError(f"{at}: the name {_quote(name)} is used twice in this rule")
        if ("calls" in f.doc) == ("sum" in f.doc):
            raise ConfigError(f"{at}: exactly one of calls or sum is required")
        if "calls" in f.doc:
            if "max" in f.doc:
                raise ConfigError(f"{at}: max goes with sum; calls is itself the most")
            calls = f._get("calls", (Num,), "a positive whole number", None)
            sign, digits, exponent = calls.normal()
            if sign <= 0 or not calls.is_integer() or len(digits) + exponent > MAX_CALLS_DIGITS:
                raise ConfigError(f"{at}: calls must be a whole number from 1 to "
                                  f"{10 ** MAX_CALLS_DIGITS - 1}")
            out.append(Limit(i, per, over, name, most=int(digits) * 10 ** exponent))
            continue
        pointer = f.text("sum")
        if not pointer.startswith("/"):
            raise ConfigError(f"{at}: sum {_quote(pointer)} is not a JSON Pointer to a value in "
                              'the arguments, such as "/amount"')
        if re.search(r"~(?![01])", pointer):
            raise ConfigError(f"{at}: sum {_quote(pointer)} holds a ~ that is not ~0 or ~1")
        _check_printable(pointer, at, "sum")
        if "max" not in f.doc:
            raise ConfigError(f"{at}: max is required with sum")
        out.append(Limit(i, per, over, name, pointer=pointer,
                         most=_parse_max(f.doc["max"], at)))
    return tuple(out)


def _parse_max(value: Any, at: str) -> int:
    if isinstance(value, str) and _MAX_TEXT.fullmatch(value):
        value = Num(value)
    if not isinstance(value, Num):
        raise ConfigError(f"{at}: max must be a decimal of at least 0, as a number or a "
                          'string such as "50" or "12.50"')
    sign, digits, exponent = value.normal()
    if sign < 0:
        raise ConfigError(f"{at}: max {value.text} is below 0")
    if sign and exponent + len(digits) > LIMIT_DIGITS:
        raise ConfigError(f"{at}: max {value.text} is not below 1e{LIMIT_DIGITS}")
    if sign and exponent < -LIMIT_PLACES:
        raise ConfigError(f"{at}: max {value.text} has more than {LIMIT_PLACES} decimal places")
    return to_units(value)


def check_shared_limits(servers: Iterable[ServerConfig]) -> None:
    """Limits of one name count together, so they must say the same thing wherever they
    are written: anything else is two limits that would read each other's counts."""
    seen: dict[str, tuple[str, bytes]] = {}
    for server in servers:
        for tool, rule in server.rules:
            for limit in [limit for limit in rule.limits if limit.name]:
                where = f"server {_quote(server.name)}: tool {_quote(tool)}: limits[{limit.index}]"
                spelled = encode_canonical(limit.written())
                first = seen.setdefault(limit.name, (where, spelled))
                if first[1] != spelled:
                    raise ConfigError(
                        f"{where}: the limit named {_quote(limit.name)} is written differently "
                        f"at {first[0]}: a shared limit must be written the same wherever it "
                        f"appears ({spelled.decode()} against {first[1].decode()})")


# -- judging one call --

@dataclasses.dataclass(frozen=True, repr=False)
class LimitUse:
    """One limit as one call finds it: its use in the window, and what the call adds."""
    limit: Limit
    used: int
    adds: int

    @property
    def over(self) -> bool:
        return self.used + self.adds > self.limit.most

    def figures(self, tool: str) -> str:
        lim = self.limit
        return (f"{lim.label} of {tool}: {lim.shown(self.used)} of {lim.shown(lim.most)}"
                f"{'' if lim.pointer else ' calls'} in the last {fmt_duration(lim.per)}; this "
                f"call adds {lim.shown(self.adds)}")


@dataclasses.dataclass(repr=False)
class Judgement:
    """What a rule's conditions and limits make of one call."""
    outcome: str
    reason: str
    asked: list[str]                 # what asks: when[N], and each limit over it that asks
    figures: list[str]               # what the operator reads of them
    denied_by: str = ""              # a deny's condition or limit; "" for the rule's or class's
    shown: str = ""                  # a limit's deny as the operator reads it: no clock in it


def server_value(tool: "UpstreamTool", args: bytes) -> Any:
    """The arguments as the server will receive them: the model's, with the rule's fixed
    values in."""
    return with_fixed(parse_json(args.strip(JSON_WS) or b"{}"), tool.rule.fixed)


def counted_value(limit: Limit, value: Any) -> tuple[int, str]:
    """What a call adds to a limit, or why it cannot be counted."""
    if not limit.pointer:
        return 1, ""
    found = walk_pointer(value, limit.pointer)
    if found is None:
        return 0, f"{limit.pointer} is missing"
    at = found[0]
    if not isinstance(at, Num):
        return 0, f"{limit.pointer} is {_kind(at)}, not a number"
    if at.normal()[0] < 0:
        return 0, f"{limit.pointer} is negative"
    return to_units(at), ""


UseOf = "Callable[[str, Limit], int]"


def first_condition(tool: "UpstreamTool", value: Any, args: bytes,
                    seen: dict | None = None) -> "Condition | str | None":
    """The first of the rule's conditions that ``value`` matches, None if none does, or the
    label of the one at which their shared budget of MAX_SCHEMA_EVALUATIONS ran out. All of
    a call's conditions spend one budget, so their cost is bounded like one input schema's.
    ``seen`` (a caller's one-entry memo) keeps the last call's answer, so that a call
    evaluated twice (its rules, then its policy) pays once."""
    if seen is not None and seen.get("tool") is tool and seen.get("args") == args:
        return seen["found"]
    found, budget = None, MAX_SCHEMA_EVALUATIONS    # found: a Condition, or a label
    for cond in tool.rule.when:
        try:
            hit, budget = cond.schema.test(value, budget)
        except CheckTooCostly:
            found = cond.label
            break
        if hit:
            found = cond
            break
    if seen is not None:
        seen.update(tool=tool, args=args, found=found)
    return found


def judge(tool: "UpstreamTool", args: bytes, outcome: str, reason: str,
          use_of: UseOf | None, seen: dict | None = None,
          frees: "Callable[[str, Limit, int], float | None] | None" = None) -> Judgement:
    """The rule's conditions, then its limits, on one call. ``outcome`` and ``reason`` are
    what the rule or the class says; ``use_of`` reads a limit's use (None: limits are not
    counted, as for check); ``seen`` is first_condition's memo; ``frees`` (Budgets.frees_at)
    tells a deny when the window has room for the call."""
    name, rule = tool.spec.name, tool.rule
    given = parse_json(args.strip(JSON_WS) or b"{}")
    refused = tool.refused_param(given) if isinstance(given, dict) else ""
    if refused:                      # refused unsent at the call: denied before it counts
        return Judgement("deny", refused, [], [])
    value = with_fixed(given, tool.rule.fixed)
    cond = first_condition(tool, value, args, seen) if rule.when else None
    if isinstance(cond, str):
        return Judgement("deny", f"{cond} of {name} could not be evaluated within "
                         f"{MAX_SCHEMA_EVALUATIONS} evaluations", [], [], cond)
    if cond is not None:
        outcome = cond.outcome
        reason = f"{cond.label} of {name}" + (f": {cond.why}" if cond.why else " matched")
    asks = cond is not None and outcome == "require_approval"
    asked, figures = ([cond.label], [reason]) if asks else ([], [])
    if outcome == "deny" or use_of is None:
        by = cond.label if cond is not None and outcome == "deny" else ""
        return Judgement(outcome, reason, asked, figures, by)
    base = "" if asked else reason      # the rule's or the class's reason to ask, if it asks
    for limit in rule.limits:
        adds, problem = counted_value(limit, value)
        if problem:
            return Judgement("deny", f"{limit.label} of {name} cannot count this call: {problem}; "
                             "the value must be a number of at least 0", [], [], limit.ref)
        use = LimitUse(limit, use_of(limit.key(tool.server, tool.remote), limit), adds)
        if not use.over:
            continue
        if limit.over == "deny":
            shown = f"{use.figures(name)}, over its max of {limit.shown(limit.most)} " \
                f"({limit.what()})"
            return Judgement("deny", shown + _room(tool, value, frees), [], [], limit.ref, shown)
        if outcome == "allow":
            outcome, base = "require_approval", ""
        asked.append(limit.ref)
        figures.append(use.figures(name))
    if outcome == "require_approval" and figures:
        reason = "; ".join(([base] if base else []) + figures)
    return Judgement(outcome, reason, asked, figures)


def _granted(request: ToolRequest, view: RunView) -> "Approval | None":
    """The step's latest approval when it is approved (the request's step is being
    collected); None otherwise."""
    mine = [a for a in view.approvals if a.step_id == request.step_id]
    return mine[-1] if mine and mine[-1].status == APPROVED else None


def _room(tool: "UpstreamTool", value: Any,
          frees: "Callable[[str, Limit, int], float | None] | None") -> str:
    """When the windows have room for a call a deny limit refuses, as the model reads it:
    the latest of the times every deny limit it is over frees room (one that frees earlier
    would deny it still); or that one of them never will. '' when no time can be told."""
    latest = 0.0
    for limit in tool.rule.limits:
        adds, problem = counted_value(limit, value)
        if limit.over != "deny" or problem:
            continue
        if adds > limit.most:
            return "; this call alone is over its max, so no window ever has room for it"
        at = frees(limit.key(tool.server, tool.remote), limit, adds) if frees else None
        latest = max(latest, at) if isinstance(at, float) else latest
    try:
        return f"; room for this call frees at {fmt_time_s(-int(-latest // 1))}" \
            if latest else ""
    except (ValueError, OverflowError, OSError):      # a time past any calendar: no time
        return ""


def _strings(doc: Any, member: str) -> list[str]:
    """The strings of ``doc``'s array ``member``: what an edited record or schema holds."""
    found = doc.get(member) if isinstance(doc, dict) else None
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def _own_object(raw: bytes) -> dict | None:
    """A record this module wrote (a capability, a presentation), read as an object; None
    where it does not read as one (none recorded, or an edited row)."""
    try:
        doc = read_own(raw)
    except ProxyError:
        return None
    return doc if isinstance(doc, dict) else None


def asked_by(capability: bytes) -> list[str]:
    """What a capability says asked for it (empty for one no condition or limit asked)."""
    return _strings(_own_object(capability), "asked_by")


def covered(fresh: PolicyDecision, request: ToolRequest, view: RunView) -> PolicyDecision:
    """At collection: when the step's grant asked about at least what asks now, on the same
    call, the grant's own capability and presentation are the decision, so the gate finds it
    (the presentation's figures were the window's when it asked). A new reason to ask, such
    as a limit crossed since, asks again."""
    grant = _granted(request, view)
    if grant is None or grant.kind != fresh.kind:
        return fresh
    had, now = _own_object(grant.capability), _own_object(fresh.capability)
    if had is None or now is None:
        return fresh
    had_asked, now_asked = _strings(had, "asked_by"), now.pop("asked_by", [])
    had.pop("asked_by", None)
    if encode_canonical(had) != encode_canonical(now) or not set(now_asked) <= set(had_asked):
        return fresh
    # Each presentation's record of its tool's limits as written (limits_shown): where one
    # is unreadable no grant covers anything, and a limit written differently since was
    # seen by nobody.
    was, shown = _own_object(grant.presentation), _own_object(fresh.presentation)
    if was is None or shown is None or \
            encode_canonical(was.get("limits", [])) != encode_canonical(shown.get("limits", [])):
        return fresh
    return dataclasses.replace(fresh, capability=grant.capability,
                               presentation=grant.presentation)


# -- what check prints of them --

def rule_lines(tool: "UpstreamTool", base: str) -> list[str]:
    """A tool's conditions and limits, one line each, then a warning for each condition that
    is looser than ``base`` (what the tool gets without it) and constrains a property that
    neither it nor the input schema requires: it also matches a call without that property,
    which is seldom what was meant (an amount of at most 10 allows a call with no amount)."""
    name, out, warnings = sanitize(tool.spec.name), [], []
    try:
        schema = parse_json(tool.spec.input_schema, strict=False)
    except JSONError:
        schema = {}
    needed = set(_strings(schema, "required"))
    for cond in tool.rule.when:
        why = f" ({sanitize(cond.why)})" if cond.why else ""
        out.append(f"{name}: {cond.label} -> {cond.outcome}{why}: if "
                   f"{sanitize(cond.schema_json.decode())}")
        doc = parse_json(cond.schema_json, strict=False)
        props = doc.get("properties") if isinstance(doc, dict) else None
        loose = [p for p in (props if isinstance(props, dict) else {})
                 if p not in needed and p not in _strings(doc, "required")]
        if _STRICTER[cond.outcome] < _STRICTER.get(base, 2) and loose:
            warnings.append(f"warning: {name}: {cond.label} gives {cond.outcome}, looser than "
                            f"{base}, and constrains {', '.join(_quote(p) for p in loose)}, "
                            "which neither the condition nor the input schema requires: it "
                            "also matches a call without it; add it to the condition's "
                            "required")
    for limit in tool.rule.limits:
        out.append(f"{name}: {limit.label}: at most {limit.shown(limit.most)} "
                   f"({limit.what()}) in any {fmt_duration(limit.per)}; over it: {limit.over}")
    return out + warnings


# ==== 20.1 Limits: counting what executed ====
# Policy by history. A limit is counted from proxy_limit_uses, the index of executions: one
# row per execution and limit, written in the transaction that records the attempt's start
# (Budgets.admit), holding its limit's running count and sum. The use within a window is the
# difference between two of those rows' sums (a calls limit's sum is its count), each found
# by one search of an index, so a call costs the same whatever the history holds. An attempt
# an operator says did not execute leaves every sum from its row onward (uncount_attempt).

_LIMIT_SQL = (
    """CREATE TABLE proxy_limit_uses (
        key TEXT NOT NULL, n INTEGER NOT NULL, at REAL NOT NULL, total TEXT NOT NULL,
        run_id TEXT NOT NULL, step_id TEXT NOT NULL, PRIMARY KEY (key, n)) WITHOUT ROWID""",
    "CREATE INDEX proxy_limit_uses_at ON proxy_limit_uses(key, at, n)",
)
# A limit's newest row (its running count and sum), and its last row at or before the
# window's start: two searches of the index, whatever the window holds.
_USE_SQL = ("SELECT 0, n, total, at FROM (SELECT n, total, at FROM proxy_limit_uses WHERE "
            "key=?1 ORDER BY n DESC LIMIT 1) UNION ALL SELECT 1, n, total, at FROM (SELECT n, "
            "total, at FROM proxy_limit_uses WHERE key=?1 AND at<=?2 ORDER BY at DESC, n DESC "
            "LIMIT 1)")


class BudgetMoved(ProxyError):
    """Between a call's evaluation and its start, another call counted by one of its limits
    started: nothing was started, and the call is decided again on the new count."""


def rule_tool(server: str, remote: str, rule: Rule) -> "UpstreamTool":
    """A tool as its rule alone describes it, with no server behind it: enough for the
    policy's judgement of it (ProxyPolicy.decide, never_runs), never for a call."""
    name = offered_name(server, remote, rule)
    spec = ToolSpec(name, "", b"{}", rule.side_effect, 1.0, True)
    return UpstreamTool(spec, server, remote, rule, None)


def configured_tools(cfg: Config) -> dict[str, "UpstreamTool"]:
    """A tool per rule, by the name the configuration gives it, whether or not a server
    offers it now: what a limit covers (Budgets), and what re-check hands the requests the
    runs recorded (with the specs they recorded). No connection: nothing calls these."""
    made = (rule_tool(s.name, remote, rule) for s in cfg.servers for remote, rule in s.rules)
    return {tool.spec.name: tool for tool in made}


class Budgets:
    """The limits of a proxy's tools, counted in proxy_limit_uses.

    How a call's check and the start of its attempt are one step: admit() runs inside the
    transaction that writes the attempt's step.tool_started, and that transaction is begun
    IMMEDIATE (Store.tx), which takes SQLite's write lock before anything in
    it is read. Every counted start, in this process or in another on the same database,
    writes its row here in such a transaction; so from admit's read of a limit's newest row
    to the commit that adds the call's own, no other write can commit, and every start
    committed before it is seen. The count admit reads is the count at commit, and the row
    it adds is committed with the start. The evaluation before it, outside the transaction,
    is a forecast: when admit finds the call over a limit the forecast did not ask about,
    it raises BudgetMoved, the whole transaction is rolled back (nothing started, nothing
    sent), and the call is decided again on the count that moved.

    What a limit covers is the configuration's (configured_tools: server, upstream tool,
    registered name), never what happened to load: a tool withheld at start and offered
    later by drift, or listed only after connecting, is counted from its first call, and
    every limit is caught up at start and listed whether its tool loaded or not."""

    def __init__(self, store: Store, cfg: Config, clock: Clock):
        self.store, self.clock = store, clock
        self.tools = {name: t for name, t in configured_tools(cfg).items() if t.rule.limits}

    def counts(self, name: str) -> bool:
        return name in self.tools

    def catch_up(self) -> None:
        """At start: each limit counts what its tools executed within its window that its
        rows do not hold yet; executions while no proxy counted it (a limit new, moved to
        another window, pointer or place, or a proxy on the database that lacked it). A
        limit's mark in proxy_limit_marks says up to which event its rows were last caught
        up (and its newest row then), so a start reads the events since the previous one,
        not the whole history; the long read is done outside the write lock, and only what
        was recorded meanwhile is read again under it. Two proxies starting together catch
        up once: the second finds the mark moved and leaves it."""
        now = self.clock()
        for key, (limit, tools) in _counted_by(self.tools).items():
            self._catch_up(key, limit, tools, fmt_time(now - limit.per))

    def _catch_up(self, key: str, limit: Limit, tools: dict, since: str) -> None:
        mark_sql = "SELECT seq, n FROM proxy_limit_marks WHERE key=?"
        mark = tuple(next(iter(self.store._read(mark_sql, (key,))), (0, 0)))
        top = self.store._read("SELECT COALESCE(MAX(seq), 0) FROM events")[0][0]
        ran = _executions(self.store._read, tools, limit, mark[0], top, since)
        with self.store.tx() as tx:
            if tuple(next(iter(tx.rows(mark_sql, (key,))), (0, 0))) != mark:
                return                       # another proxy caught it up meanwhile
            now_top = tx.rows("SELECT COALESCE(MAX(seq), 0) FROM events")[0][0]
            ran += _executions(tx.rows, tools, limit, top, now_top, since)
            # An attempt the operator said did not execute is neither an execution to count
            # nor a row that counted one (uncount_attempt zeroed it): read here, under the
            # write lock, so that a word given while the events were walked is seen.
            said = not_executed(tx.rows, MAX_ROW_ID)
            ran = [r for r in ran if not said(r[1], r[2], r[0])]
            held = collections.Counter((run_id, step_id) for run_id, step_id, at in tx.rows(
                "SELECT run_id, step_id, at FROM proxy_limit_uses WHERE key=? AND n>? AND at>?",
                (key, mark[1], parse_time(since)))
                if not said(run_id, step_id, at))
            (n, total, last), _, _ = _use(tx.rows, key, limit, self.clock())
            for at, run_id, step_id, adds in ran:
                if held[(run_id, step_id)] > 0:
                    held[(run_id, step_id)] -= 1          # counted when it started
                    continue
                n, total, last = n + 1, total + adds, max(at, last)
                tx.exec("INSERT INTO proxy_limit_uses (key, n, at, total, run_id, step_id) "
                        "VALUES (?,?,?,?,?,?)", (key, n, last, str(total), run_id, step_id))
            tx.exec("INSERT OR REPLACE INTO proxy_limit_marks (key, seq, n) VALUES (?,?,?)",
                    (key, now_top, n))

    def use_of(self, key: str, limit: Limit) -> int:
        return _use(self.store._read, key, limit, self.clock())[1]

    def frees_at(self, key: str, limit: Limit, adds: int) -> float | None:
        """When the window has room for a call that adds ``adds``: the moment enough of
        the executions it counts have left it (a row leaves at its time plus ``per``).
        Running totals never decrease (a call adds 1 to a calls limit's), so the row that
        must leave is found by a binary search of the window's rows: a few lookups by
        primary key, however many the window holds. None when there is room now."""
        read = self.store._read
        (top, total, _), used, first = _use(read, key, limit, self.clock())
        excess = used + adds - limit.most
        if excess <= 0 or first > top:
            return None
        found = _row(read, key, _first_row(read, key, first, top, total - used + excess))
        return float(found[1]) + limit.per if found and isinstance(found[1], (int, float)) \
            else None

    def admit(self, tx: Tx, request: ToolRequest, decision: PolicyDecision, at: str) -> None:
        tool = self.tools.get(request.spec.name)
        if tool is None:
            return
        now, covers = parse_time(at), set(asked_by(decision.capability))
        value = with_fixed(request.parsed(), tool.rule.fixed)    # the call's own parse
        for limit in tool.rule.limits:
            adds, problem = counted_value(limit, value)
            key = limit.key(tool.server, tool.remote)
            (n, total, last), used, _ = _use(tx.rows, key, limit, now)
            if problem or (used + adds > limit.most and
                           (limit.over == "deny" or limit.ref not in covers)):
                raise BudgetMoved(f"{limit.label} of {tool.spec.name} moved before the call "
                                  "started")
            tx.exec("INSERT INTO proxy_limit_uses (key, n, at, total, run_id, step_id) "
                    "VALUES (?,?,?,?,?,?)", (key, n + 1, max(now, last), str(total + adds),
                                             request.run_id, request.step_id))

    def lines(self) -> list[str]:
        """Each limit of each tool with its use now: what gate_status tells the model."""
        out = []
        for name, tool in self.tools.items():
            for limit in tool.rule.limits:
                used = self.use_of(limit.key(tool.server, tool.remote), limit)
                named = f', limit "{limit.name}"' if limit.name else ""
                out.append(f"{name}: {limit.shown(used)} of {limit.shown(limit.most)} "
                           f"({limit.what()}{named}) in the last {fmt_duration(limit.per)}")
        return out


def _counted_by(tools: dict[str, "UpstreamTool"]) -> dict[str, tuple[Limit, dict]]:
    """Each limit's key, with the limit and the tools (by name) it counts."""
    found: dict[str, tuple[Limit, dict]] = {}
    for name, tool in tools.items():
        for limit in tool.rule.limits:
            found.setdefault(limit.key(tool.server, tool.remote), (limit, {}))[1][name] = tool
    return found


def _executions(read: Query, tools: dict, limit: Limit, after: int,
                upto: int, since: str) -> list[tuple[float, str, str, int]]:
    """The executions of ``tools`` recorded as events after seq ``after`` up to ``upto``
    that started later than ``since``: (start, run id, step id, what each adds to
    ``limit``), in the order recorded. A walk through those events."""
    out = []
    for at, run_id, step_id, payload in read(
            "SELECT at, run_id, step_id, payload_json FROM events WHERE seq>? AND seq<=? AND "
            "type='step.tool_started' AND at>? ORDER BY seq", (after, upto, since)):
        try:
            doc = read_own(payload)          # one read: the arguments as recorded
            tool = tools.get(doc.get("tool"))
            if tool is not None:
                value = with_fixed(doc.get("args", {}), tool.rule.fixed)
                out.append((parse_time(at), run_id, step_id, counted_value(limit, value)[0]))
        except (ProxyError, AttributeError, ValueError):
            continue                 # an edited row: the chain's verify reports it
    return out


def recorded_use(store: Store, tools: dict[str, "UpstreamTool"], key: str, limit: Limit,
                 before_seq: int, now: float) -> int:
    """A limit's use as the events show it, for recheck: the executions of its tools
    (step.tool_started) recorded before event ``before_seq`` that started within the window
    ending ``now``, less those an operator had said by then did not execute. A walk through
    the window's events: recheck's cost, never a call's."""
    counted = _counted_by(tools).get(key, (limit, {}))[1]
    said = not_executed(store._read, before_seq)
    return sum(adds for at, run_id, step_id, adds in _executions(
        store._read, counted, limit, 0, before_seq - 1, fmt_time(now - limit.per))
        if not said(run_id, step_id, at))


# -- an attempt the operator said did not execute --
# reject -outcome not-executed (section 13) says a cut-off attempt never took effect. It
# stops counting in the rejection's transaction (uncount_attempt), and whatever counts from
# the events (Budgets.catch_up, recorded_use) leaves it out (not_executed). An attempt is
# named by its run, its step and its start; its start event, and its row, are the step's
# first at or after that start: a later attempt of the same step would be a re-run, and
# nothing re-runs a step whose interruption approval was rejected (its run ends), nor one of
# an earlier run a fresh run asks about (that run has ended).

def not_executed(read: Query, before_seq: int) -> Callable[[str, str, float], bool]:
    """Whether an execution (run id, step id, start) is of an attempt that does not count,
    as the words and events recorded before event ``before_seq`` stand: the step's attempt
    started at or before it. An attempt does not count when an operator's latest word on it
    says it did not execute, and the store knows of no known late outcome of it (a late
    success proves it executed, whatever was said). Few: each is an operator's explicit
    word. Nothing is said where the proxy's table is not there yet (a database the proxy of
    an older build last opened, read by recheck)."""
    try:
        rows = read("SELECT attempt_run_id, attempt_step_id, attempt_started_at, outcome FROM "
                    "proxy_operator_outcomes WHERE seq<? ORDER BY seq", (before_seq,))
    except StoreError:
        rows = []
    latest = {(run_id, step_id): (started, word) for run_id, step_id, started, word in rows}
    words = {}
    for (run_id, step_id), (started, word) in latest.items():
        if word != OUTCOME_NOT_EXECUTED:
            continue
        attempt = {"run_id": run_id, "step_id": step_id, "started_at": started}
        late = late_record(read, attempt, known=True)
        if late is not None and late.seq < before_seq:
            continue
        with contextlib.suppress(ValueError, TypeError, OverflowError):
            words[(run_id, step_id)] = parse_time(started)

    def said(run_id: str, step_id: str, at: Any) -> bool:
        # Only a step an operator spoke of is compared: ``at`` is a use row's, which an
        # edited database may hold as anything.
        start = words.get((run_id, step_id))
        return start is not None and at >= start
    return said


def uncount_attempt(tx: Tx, attempt: dict) -> None:
    """Stop counting a cut-off attempt the operator said did not execute, in every limit
    that counted it, inside the transaction that records the word.

    A limit's rows hold running totals (row n: the sum of the adds of rows 1..n), and its use
    in a window is total(newest) - total(b), b its last row at or before the window's start.
    The attempt's row r added a = total(r) - total(r-1); every row from r onward loses a.
    No row's time or number changes, so every window finds the same b as before, and:
      - b before r (r inside the window, or no b): the use is a less, the attempt's share;
      - b at or after r (r at or before the window's start): both totals lose a, and the
        use is unchanged, as r was not in it.
    So every window counts exactly the rows in it other than r, as if the attempt had never
    been counted: never less. A row appended now with -a would undercount: once r leaves a
    window that the new row is still inside, it subtracts a from rows that do count, and
    more than the max could be spent. The row itself stays, with a of 0, so that catching up
    still finds the attempt counted at its start (and the word leaves it out besides). A
    calls limit counts its total too (each row adds 1), not n. What it subtracted is kept in
    proxy_uncounted, so that a later word that it executed, or a known late outcome of it,
    counts it again (recount_attempt: the same rows gain a back). Run again, it subtracts
    nothing more. Not at all when the store already knows of a known late outcome of the
    attempt: it executed, whatever was said. It costs one write per row since the attempt:
    an operator's decision, never a call's; the write lock held from the read makes it one
    step with respect to every admit."""
    try:
        start = parse_time(attempt.get("started_at"))
    except (ValueError, TypeError, OverflowError):
        return                       # no start to find its row by: it goes on counting
    if late_record(tx.rows, attempt, known=True) is not None:
        return
    run_id, step_id = attempt.get("run_id"), attempt.get("step_id")
    for key, n in tx.rows("SELECT key, MIN(n) FROM proxy_limit_uses WHERE run_id=? AND "
                          "step_id=? AND at>=? GROUP BY key", (run_id, step_id, start)):
        if tx.rows("SELECT 1 FROM proxy_uncounted WHERE key=? AND n=?", (key, n)):
            continue                 # uncounted already
        before = _row(tx.rows, key, n - 1)          # rows are numbered 1, 2, ... per key
        adds = int(_row(tx.rows, key, n)[0]) - (int(before[0]) if before else 0)
        if adds > 0:
            _shift_totals(tx, key, n, -adds)
            tx.exec("INSERT INTO proxy_uncounted (key, n, adds, run_id, step_id) VALUES "
                    "(?,?,?,?,?)", (key, n, str(adds), run_id, step_id))


def recount_attempt(tx: Tx, run_id: str, step_id: str | None = None) -> None:
    """Count again what uncount_attempt stopped counting of a run's attempts (of one step,
    when named): a later word that it executed, or a known late outcome of it. Every row
    from the attempt's regains what it lost, so every window counts it again as at its
    start."""
    for key, n, adds in tx.rows("SELECT key, n, adds FROM proxy_uncounted WHERE run_id=? AND "
                                "step_id=COALESCE(?, step_id)", (run_id, step_id)):
        _shift_totals(tx, key, n, int(adds))
        tx.exec("DELETE FROM proxy_uncounted WHERE key=? AND n=?", (key, n))


def _shift_totals(tx: Tx, key: str, n: int, by: int) -> None:
    """Add ``by`` to the running total of the limit's row ``n`` and every row after it."""
    for m, total in tx.rows("SELECT n, total FROM proxy_limit_uses WHERE key=? AND n>=? "
                            "ORDER BY n", (key, n)):
        tx.exec("UPDATE proxy_limit_uses SET total=? WHERE key=? AND n=?",
                (str(int(total) + by), key, m))


# -- what an approval shows of them --
# Every view of an approval shows each limit of its tool as it stands when it is shown, and
# what the call adds, so that an operator does not approve a payment the limits will refuse
# at collection without knowing it. The operator's commands may run with the database alone,
# without the configuration, so the approval carries what they need: its presentation records
# each limit as the proxy counts it (limits_shown), and a view reads the limit's use from
# proxy_limit_uses, the index every serving proxy keeps current, with _use (limits_now).
#
# The record is a function of the configuration and the call alone, never of the running
# figures. The approval's hash binds the presentation, and at collection the policy builds
# the presentation again and compares hashes: a figure in it would let any payment made in
# between void the operator's answer. The figures are read at each showing and are part of
# nothing a decision is bound to (neither the hash nor ApprovalView.bound); the collection
# judges the limits again. A limit written differently since the approval asks again, as a
# changed reason does. An approval recorded without the record shows no figures.

SHOWN_LIMIT_FIELDS = ("key", "index", "limit", "adds")
_UNITS_TEXT = re.compile(r"[0-9]{1,%d}" % len(str(_CAP)))


def limits_shown(tool: "UpstreamTool", args: bytes) -> dict:
    """The presentation's record of the tool's limits ({} for a tool without any): for each,
    its key in proxy_limit_uses, its place among the rule's limits, its written form
    (Limit.written), and what this call adds, in the index's units."""
    if not tool.rule.limits:
        return {}
    value = server_value(tool, args)
    counted = [(limit, *counted_value(limit, value)) for limit in tool.rule.limits]
    # A limit that cannot count the call is left out: judge denies such a call, never asks.
    return {"limits": [{"key": limit.key(tool.server, tool.remote), "index": limit.index,
                        "limit": limit.written(), "adds": str(adds)}
                       for limit, adds, problem in counted if not problem]}


def limits_now(read: Query, approval: "Approval", now: float) -> list[dict]:
    """Each limit an approval's presentation records, with its use in the window ending
    ``now`` read from proxy_limit_uses, and what collecting the call then would meet: denied
    (over a limit whose `over` is deny) or asked again (over a limit that did not ask for
    this approval, which its grant therefore does not cover: covered). Every string is
    sanitised; an entry that does not read as limits_shown writes it is left out. An approval
    that no call can collect any more (decided otherwise, expired, its run no longer
    waiting) has nothing to weigh: none."""
    run = read("SELECT status FROM runs WHERE id=?", (approval.run_id,))
    found = (_own_object(approval.presentation) or {}).get("limits")
    if approval.status not in (PENDING, APPROVED) or run != [(WAITING,)] or \
            not isinstance(found, list):
        return []
    try:
        tool = approval.request().spec.name
    except (ProxyError, KeyError, ValueError, TypeError):
        return []
    asked = set(asked_by(approval.capability))
    uses = [_recorded_use(entry, read, now) for entry in found[:MAX_LIMITS]]
    return [_standing(use, tool, asked) for use in uses if use is not None]


def _recorded_use(entry: Any, read: Query, now: float) -> LimitUse | None:
    """An entry of limits_shown read back, strictly (the row may have been edited): its
    limit parsed again as a configuration's limit is, at its recorded place, with its use in
    the window ending ``now``."""
    if not isinstance(entry, dict) or sorted(entry) != sorted(SHOWN_LIMIT_FIELDS):
        return None
    key, index, adds = entry["key"], entry["index"], entry["adds"]
    if not (isinstance(key, str) and isinstance(adds, str) and _UNITS_TEXT.fullmatch(adds)
            and isinstance(index, Num) and re.fullmatch("[0-9]", index.text)
            and int(index.text) < MAX_LIMITS):
        return None
    try:
        limit = parse_limits([entry["limit"]], "a recorded limit")[0]
    except ConfigError:
        return None
    limit = dataclasses.replace(limit, index=int(index.text))
    return LimitUse(limit, _use(read, key, limit, now)[1], min(int(adds), _CAP))


def _standing(use: LimitUse, tool: str, asked: set[str]) -> dict:
    """One limit as a view shows it, in JSON and as a line."""
    lim = use.limit
    deny = use.over and lim.over == "deny"
    again = use.over and not deny and lim.ref not in asked
    then = "be DENIED" if deny else "ask an operator again" if again else ""
    text = use.figures(tool) + (f": over its max, so collecting it will {then} unless room "
                                "frees first" if then else "")
    return {"limit": sanitize(lim.ref), "what": sanitize(lim.what()),
            "used": lim.shown(use.used), "max": lim.shown(lim.most),
            "adds": lim.shown(use.adds), "per": fmt_duration(lim.per), "over": lim.over,
            "would_deny": deny, "asks_again": again, "text": sanitize(text)}


def _row(read: Query, key: str, n: int) -> tuple[str, float] | None:
    """A limit's row ``n``: its running total and its time."""
    found = read("SELECT total, at FROM proxy_limit_uses WHERE key=? AND n=?", (key, n))
    return (found[0][0], found[0][1]) if found else None


def _first_row(read: Query, key: str, low: int, high: int, total: int) -> int:
    """The first row from ``low`` to ``high`` whose running total reaches ``total``."""
    while low < high:
        mid = (low + high) // 2
        row = _row(read, key, mid)
        if row is not None and int(row[0]) >= total:
            high = mid
        else:
            low = mid + 1
    return low


def _use(read: Query, key: str, limit: Limit,
         now: float) -> tuple[tuple[int, int, float], int, int]:
    """A limit's newest row (n, total, at), its use in the window ending ``now``, and the
    number of the window's first row: the executions whose rows are later than the window's
    start, counted from the newest row and the last row at or before the start (none: 0 and
    a total of 0). A row's time is never earlier than the one before it (admit), so the rows
    after the start are the newest ones. A calls limit counts its running total too (each row
    adds 1), which stops counting an attempt the operator said did not execute
    (uncount_attempt), where n would not."""
    rows = {which: (n, int(total), at) for which, n, total, at in read(_USE_SQL,
                                                                       (key, now - limit.per))}
    newest, before = rows.get(0, (0, 0, 0.0)), rows.get(1, (0, 0, 0.0))
    return newest, newest[1] - before[1], before[0] + 1


# ==== 21. The rules across calls: the call index ====
# MCP gives a server no conversation, so each call is a run of its own; the rules that span
# calls are the proxy's, kept in its own table, proxy_calls. A row says "a call with this
# request key was given this run id"; it is written before its run begins, and what a call
# did is always read from its run and steps, never from the row. At most one row per key is
# open. Within one process a call's reading of the index and the runs, and whatever it
# begins or collects, happens without an await in between (atomic on the event loop; the
# SQLite calls block the loop while they run, at most busy_timeout); executing and holding
# happen outside that. Across processes the unique open-row index and
# IMMEDIATE transactions let exactly one call begin a row's run; the loser retries.

PROXY_SCHEMA_VERSION = 7
APPROVAL_POLL = 0.2                    # how often a held call looks at its approval
PROGRESS_EVERY = 1.0                   # seconds between progress notifications while held
MAX_RETRIES = 5                        # lost races before a call answers IN_PROGRESS
RULE_ROWS = 8                          # rows of one request key read at a time, newest first
MAX_ROW_ID = 2 ** 63 - 1               # above every row id: where a newest-first read starts
SETTLED_FLOOR = 1e-6                   # settled_at above this: 0 means "not yet settled"
STATUS_WINDOW = 3600.0                 # the status tool answers for the last hour
STATUS_ROWS = 200                      # ... from at most this many calls
UNSEEN, NO_ATTEMPT, KNOWN, UNKNOWN = 0, 1, 2, 3
HOW = {"timed_out": "it timed out before the server answered",
       "no_answer": "it failed without an answer from the server",
       "cut_off": "it was cut off before its outcome was recorded"}
_INDEX_SQL = (
    """CREATE TABLE proxy_calls (
        id INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL,
        request_key TEXT NOT NULL, tool TEXT NOT NULL, side_effect TEXT NOT NULL,
        run_id TEXT NOT NULL UNIQUE, created_at REAL NOT NULL,
        open INTEGER NOT NULL DEFAULT 1, closed_at REAL NOT NULL DEFAULT 0,
        settled_at REAL NOT NULL DEFAULT 0, outcome INTEGER NOT NULL DEFAULT 0)""",
    "CREATE UNIQUE INDEX proxy_calls_open ON proxy_calls(session, request_key) WHERE open = 1",
    "CREATE INDEX proxy_calls_key ON proxy_calls(session, request_key, id)",
    "CREATE INDEX proxy_calls_unsettled ON proxy_calls(session, settled_at, id)",
    "CREATE INDEX proxy_calls_outcome ON proxy_calls(session, request_key, outcome, id)",
)
# Each later version: its statements, applied in one transaction with its own record.
# A refusal changes nothing, so it is not an event of the chain: it is counted here, one row
# per run it names, request key and answer, the first and the last time. A model that repeats
# a refused call only moves a row's count and last time; 200 identical refusals are one row.
_REFUSALS_SQL = """CREATE TABLE proxy_refusals (
    run_id TEXT NOT NULL, request_key TEXT NOT NULL, answer TEXT NOT NULL,
    count INTEGER NOT NULL, first_at REAL NOT NULL, last_at REAL NOT NULL,
    PRIMARY KEY (run_id, request_key, answer)) WITHOUT ROWID"""


class RefusalLog:
    """proxy_refusals: each refusal of a call, against the run it names (the earlier
    execution of a DUPLICATE, the rejected, expired or cancelled run, the run that blocks).
    Written unsynced (Store.tx): a power loss may lose the last counts, never a run's record."""

    def __init__(self, store: Store):
        self.store = store

    def record(self, run_id: str, key: str, answer: str, now: float) -> None:
        """Count one refusal. It waits for the write lock at most REFUSAL_WAIT_MS, not the
        store's busy timeout: another process's long write costs a count (told to the
        operator), never a stall of this proxy's decisions."""
        with self.store.waiting_at_most(REFUSAL_WAIT_MS), self.store.tx(synced=False) as tx:
            tx.exec("INSERT INTO proxy_refusals VALUES (?,?,?,1,?,?) ON CONFLICT (run_id, "
                    "request_key, answer) DO UPDATE SET count=count+1, last_at=excluded.last_at",
                    (run_id, key, answer, now, now))

    @staticmethod
    def of_run(store: Store, run_id: str) -> list[dict]:
        """A run's refusals, oldest first."""
        rows = _proxy_rows(store, "SELECT answer, count, first_at, last_at, request_key FROM "
                                  "proxy_refusals WHERE run_id=? ORDER BY first_at", (run_id,))
        return [{"answer": a, "count": n, "first_at": fmt_time(f), "last_at": fmt_time(t),
                 "request_key": k} for a, n, f, t, k in rows]


def _proxy_rows(store: Store, sql: str, params: tuple) -> list[tuple]:
    """A read of the proxy's own tables; [] where the table is not there yet (a database
    this build's proxy never opened)."""
    try:
        return store._read(sql, params)
    except StoreError:
        return []


# The operator's word on a cut-off attempt (reject -outcome, section 13): one row per
# rejection of an interruption approval, written in the rejection's transaction beside its
# event in the chain, which the row names (seq). The runtime's rows keep their meaning (the
# run CANCELLED, approval_rejected); what the operator said came of the attempt is the
# proxy's: runs and show read it, and the limits leave out an attempt said not to have
# executed (section 20). The index on proxy_limit_uses finds an attempt's rows.
_OUTCOMES_SQL = (
    """CREATE TABLE proxy_operator_outcomes (
        approval_id TEXT PRIMARY KEY, run_id TEXT NOT NULL, attempt_run_id TEXT NOT NULL,
        attempt_step_id TEXT NOT NULL, attempt_started_at TEXT NOT NULL,
        outcome TEXT NOT NULL, decided_by TEXT NOT NULL, at REAL NOT NULL,
        seq INTEGER NOT NULL) WITHOUT ROWID""",
    "CREATE INDEX proxy_operator_outcomes_run ON proxy_operator_outcomes(run_id)",
    "CREATE INDEX proxy_operator_outcomes_word ON proxy_operator_outcomes(outcome, seq)",
    "CREATE INDEX proxy_limit_uses_step ON proxy_limit_uses(run_id, step_id)",
    # What uncount_attempt subtracted from each limit's rows, until counted again.
    """CREATE TABLE proxy_uncounted (
        key TEXT NOT NULL, n INTEGER NOT NULL, adds TEXT NOT NULL, run_id TEXT NOT NULL,
        step_id TEXT NOT NULL, PRIMARY KEY (key, n)) WITHOUT ROWID""",
    "CREATE INDEX proxy_uncounted_run ON proxy_uncounted(run_id)",
)


def record_outcome(tx: Tx, approval: Approval, attempt: dict | None, outcome: str, by: str,
                   at: str) -> None:
    """Record the operator's word on the attempt ``approval`` asks about: an event in the
    chain and a row of the proxy's table, in the rejection's transaction; an attempt said not
    to have executed stops counting toward limits in the same transaction."""
    named = {k: str((attempt or {}).get(k, "")) for k in ("run_id", "step_id", "started_at")}
    seq = tx.event(approval.run_id, approval.step_id, at, OUTCOME_EVENT,
                   {"approval_id": approval.id, "attempt": named, "by": by, "outcome": outcome})
    tx.exec("INSERT INTO proxy_operator_outcomes VALUES (?,?,?,?,?,?,?,?,?)",
            (approval.id, approval.run_id, named["run_id"], named["step_id"],
             named["started_at"], outcome, by, parse_time(at), seq))
    if outcome == OUTCOME_NOT_EXECUTED:
        uncount_attempt(tx, named)
    else:                            # a later word that it executed, or may have
        recount_attempt(tx, named["run_id"], named["step_id"])


def outcomes_of_run(store: Store, run_id: str) -> dict[str, dict]:
    """The words recorded on the rejections of a run's interruption approvals, by approval
    id."""
    rows = _proxy_rows(store, "SELECT approval_id, outcome, decided_by, attempt_run_id, "
                       "attempt_step_id FROM proxy_operator_outcomes WHERE run_id=?", (run_id,))
    return {a: {"outcome": o, "by": b, "run_id": r, "step_id": s} for a, o, b, r, s in rows}


def refusal_lines(refusals: list[dict]) -> list[str]:
    return [f"refused {r['count']} time(s) as {sanitize(r['answer'])}, first "
            f"{_stamp(r['first_at'])}, last {_stamp(r['last_at'])}" for r in refusals]


# The host's tasks (section 23.1): a row a task, its call's answer once it has one.
_TASKS_SQL = (
    """CREATE TABLE proxy_tasks (
        task_id TEXT PRIMARY KEY, session TEXT NOT NULL, tool TEXT NOT NULL,
        arguments BLOB NOT NULL, request_key TEXT, created_at REAL NOT NULL, ttl REAL,
        follower TEXT NOT NULL, answer TEXT, updated_at REAL NOT NULL,
        cancelled INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID""",
    "CREATE INDEX proxy_tasks_open ON proxy_tasks(session, created_at) WHERE answer IS NULL "
    "AND cancelled = 0",
    "CREATE INDEX proxy_tasks_session ON proxy_tasks(session, created_at)",
)


_INDEX_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: _INDEX_SQL,
    2: ("CREATE INDEX proxy_calls_tool_outcome ON proxy_calls(session, tool, outcome, id)",),
    3: _LIMIT_SQL,                   # the index of executions that limits count (section 20)
    4: ("CREATE TABLE proxy_limit_marks (key TEXT PRIMARY KEY, seq INTEGER NOT NULL, "
        "n INTEGER NOT NULL) WITHOUT ROWID",),          # how far each limit was caught up
    5: (_REFUSALS_SQL,),                                 # the refusals of each run (RefusalLog)
    6: _OUTCOMES_SQL,                   # the operator's word on a cut-off attempt
    7: _TASKS_SQL,                      # the host's tasks (section 23.1)
}
_ROW_COLS = "id, session, request_key, tool, side_effect, run_id, created_at, open, closed_at, " \
            "settled_at, outcome"


# CallIndex.for_key's two searches of the key's rows in one statement: the open row (at
# most one), then the newest closed rows.
_FOR_KEY_SQL = (f"SELECT {_ROW_COLS} FROM proxy_calls WHERE session=? AND request_key=? AND "
                f"open=1 UNION ALL SELECT * FROM (SELECT {_ROW_COLS} FROM proxy_calls WHERE "
                "session=? AND request_key=? AND open=0 ORDER BY id DESC LIMIT ?)")


class IndexRace(ProxyError):
    """Another call changed this request's index row first; the caller decides again."""


@dataclasses.dataclass(repr=False)
class CallRow:
    """A row of proxy_calls: a request key, the run it was given, and what came of it."""
    id: int
    session: str
    key: str
    tool: str
    side_effect: str
    run_id: str
    created_at: float
    open: int
    closed_at: float
    settled_at: float
    outcome: int


class CallIndex:
    """proxy_calls: which request key was given which run, and caches of what came of it."""

    def __init__(self, store: Store, session: str):
        self.store, self.session = store, session

    def migrate(self, now: float) -> None:
        with self.store.tx() as tx:
            tx.exec("CREATE TABLE IF NOT EXISTS proxy_schema_migrations "
                    "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
            have = tx.rows("SELECT COALESCE(MAX(version),0) FROM proxy_schema_migrations")[0][0]
            if have > PROXY_SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"the call index in {self.store.path} has version {have}, newer than "
                    f"version {PROXY_SCHEMA_VERSION} this build knows; a newer proxy wrote it")
        for version in range(have + 1, PROXY_SCHEMA_VERSION + 1):
            with self.store.tx() as tx:
                if tx.rows("SELECT 1 FROM proxy_schema_migrations WHERE version=?", (version,)):
                    continue                 # another process migrated it meanwhile
                for sql in _INDEX_MIGRATIONS[version]:
                    tx.exec(sql)
                tx.exec("INSERT INTO proxy_schema_migrations VALUES (?, ?)", (version, now))

    def _rows(self, sql: str, params: tuple) -> list[CallRow]:
        return [CallRow(*r) for r in self.store._read(f"SELECT {_ROW_COLS} FROM proxy_calls "
                                                      f"WHERE {sql}", params)]

    def _write(self, sql: str, params: tuple) -> None:
        """One statement on proxy_calls, in a transaction of its own."""
        with self.store.tx() as tx:
            tx.exec(f"UPDATE proxy_calls SET {sql}", params)

    # Every query below is a search of one of _INDEX_SQL's indexes that reads a bounded
    # number of rows, however long the session's history: a call costs the same on the first
    # day and after a million (tests/test_rules_cost.py holds them to that).

    def open_row(self, key: str) -> CallRow | None:
        return next(iter(self._rows("session=? AND request_key=? AND open=1",
                                    (self.session, key))), None)

    def for_key(self, key: str, since: float) -> tuple[CallRow | None, list[CallRow]]:
        """The key's open row, and the rows the window rules read, newest first: the open
        row, then the newest closed rows (at most RULE_ROWS) closed since ``since``. Rows of
        one key close in the order they were opened, so the newest rows are the ones a window
        can hold, and the rules need only the newest."""
        rows = [CallRow(*r) for r in self.store._read(_FOR_KEY_SQL,
                                                      (self.session, key) * 2 + (RULE_ROWS,))]
        current = next((r for r in rows if r.open), None)
        closed = sorted((r for r in rows if not r.open and r.closed_at >= since),
                        key=lambda r: r.id, reverse=True)
        return current, ([current] if current else []) + closed

    def unsettled(self) -> list[CallRow]:
        return self._rows("session=? AND settled_at=0 ORDER BY id", (self.session,))

    def executions(self, key: str, since: float) -> Iterable[CallRow]:
        """The key's rows whose outcome may be known within a window starting ``since``,
        newest first: those that may hold an attempt and closed since then (or are open),
        and then those a late outcome settled since then (known_in). Rows close in the
        order they were opened, so the first part stops at the first row closed before the
        window. The second part, read only when the first stopped there (else the first
        held every known row), reads the key's known rows: at most one a window, unless an
        operator approved a repeat or a re-run."""
        seen = set()
        for row in self.attempts(key):
            if row.closed_at and row.closed_at < since:
                break
            seen.add(row.id)
            yield row
        else:
            return
        yield from (row for row in self._rows(
            "session=? AND request_key=? AND outcome=? AND settled_at>=? ORDER BY id DESC",
            (self.session, key, KNOWN, since)) if row.id not in seen)

    def attempts(self, key: str) -> Iterable[CallRow]:
        """The key's rows that may hold an attempt, newest first, read a page at a time: the
        caller stops at the first it can judge, which is almost always the first."""
        before = MAX_ROW_ID
        while True:
            page = self._rows("session=? AND request_key=? AND outcome!=? AND id<? "
                              "ORDER BY id DESC LIMIT ?", (self.session, key, NO_ATTEMPT,
                                                          before, RULE_ROWS))
            yield from page
            if len(page) < RULE_ROWS:
                return
            before = page[-1].id

    def unknown_for_tool(self, tool: str, except_key: str) -> list[CallRow]:
        """For every other key of this tool, its newest row with an attempt, when that row's
        outcome is unseen or unknown."""
        return self._rows(
            "session=? AND tool=? AND request_key!=? AND outcome IN (?,?) AND id=(SELECT "
            "MAX(q.id) FROM proxy_calls q WHERE q.session=proxy_calls.session AND "
            "q.request_key=proxy_calls.request_key AND q.outcome!=?) ORDER BY id",
            (self.session, tool, except_key, UNSEEN, UNKNOWN, NO_ATTEMPT))

    def recent(self, since: float, limit: int) -> list[CallRow]:
        """The rows not yet settled, and those settled since ``since``: newest first, at most
        ``limit``. Two range searches of one index, never a walk through the history."""
        rows = self._rows("session=? AND settled_at=0 ORDER BY id DESC LIMIT ?",
                          (self.session, limit))
        rows += self._rows("session=? AND settled_at>=? ORDER BY settled_at DESC LIMIT ?",
                           (self.session, max(since, SETTLED_FLOOR), limit))
        return sorted(rows, key=lambda r: r.id, reverse=True)[:limit]

    def by_run(self, run_id: str) -> CallRow | None:
        return next(iter(self._rows("run_id=?", (run_id,))), None)

    def claim(self, key: str, tool: str, cls: str, run_id: str, prev: CallRow | None,
              now: float) -> None:
        """Open a row for ``key``, closing ``prev``; refused when the open row is not the one
        the caller read (another call got there first)."""
        with self.store.tx() as tx:
            # A key has at most one open row (the unique index proxy_calls_open): ``prev``
            # still open is still the open row; with no ``prev``, an open row inserted by
            # another call meanwhile makes the insert a no-op. Either way nothing is written.
            closed = prev is None or tx.exec("UPDATE proxy_calls SET open=0, closed_at=? WHERE "
                                             "id=? AND open=1", (now, prev.id)).rowcount == 1
            if not closed or tx.exec("INSERT INTO proxy_calls (session, request_key, tool, "
                                     "side_effect, run_id, created_at) VALUES (?,?,?,?,?,?) ON "
                                     "CONFLICT (session, request_key) WHERE open=1 DO NOTHING",
                                     (self.session, key, tool, cls, run_id, now)).rowcount != 1:
                raise IndexRace("proxy: the request's index row changed")

    def settle(self, row: CallRow, outcome: int, now: float) -> None:
        """Cache what the row's run came to (once: only while it is unseen)."""
        if row.outcome != UNSEEN:
            return
        self._write("settled_at=CASE WHEN settled_at=0 THEN ? ELSE settled_at END, "
                    "outcome=? WHERE id=? AND outcome=?", (now, outcome, row.id, UNSEEN))
        row.outcome = outcome

    def settle_run(self, run_id: str, outcome: int, now: float) -> None:
        """Cache what a run just came to, by its run id, in the caller's transaction (once:
        only while its row is unseen)."""
        self._write("settled_at=?, outcome=? WHERE run_id=? AND "
                    "outcome=?", (now, outcome, run_id, UNSEEN))

    def known_in(self, tx: Tx, run_id: str, now: float) -> None:
        """A known outcome of the run recorded now, late (section 13), inside the caller's
        transaction: its row is KNOWN, whatever it was, and settled no earlier than now, so
        that the duplicate rule finds it within the window that runs from the recording
        (executions), however long ago the row closed."""
        tx.exec("UPDATE proxy_calls SET outcome=?, settled_at=MAX(settled_at, ?) WHERE "
                "run_id=?", (KNOWN, now, run_id))

    def settle_empty(self, row: CallRow, now: float) -> None:
        """A row whose run never began: nothing started (checked in the same statement)."""
        self._write("settled_at=?, outcome=? WHERE id=? AND settled_at=0 AND NOT EXISTS (SELECT "
                    "1 FROM runs WHERE runs.id=proxy_calls.run_id)", (now, NO_ATTEMPT, row.id))

    def unsettle(self, run_id: str) -> None:
        """A run began under a row a scan had settled as empty: it is unseen again."""
        self._write("settled_at=0, outcome=? WHERE run_id=? AND settled_at!=0", (UNSEEN, run_id))


@dataclasses.dataclass(repr=False)
class RunState:
    """A run with its steps and approvals."""
    run: Run
    steps: list[Step]
    approvals: list[Approval]

    @property
    def terminal(self) -> bool:
        return self.run.status in TERMINAL

    def latest(self) -> Approval | None:
        return self.approvals[-1] if self.approvals else None


# ==== 22. Deciding a call ====
# The rules in the seed's order, then at most one hold for an approval and at most one
# execution. What executes is always what the gate recorded.

# Serving's reply to a call: the result the host gets.
Answer = collections.namedtuple("Answer", "result")
# Serving's reply to a call held for approval: the approval it waits on.
Pending = collections.namedtuple("Pending", "approval")
# An identical call within the window, where the rule asks about a repeat: it goes on to be
# begun, asking the operator with an approval naming ``earlier`` (section 10).
Repeat = collections.namedtuple("Repeat", "earlier")
# Run what the session's gate allowed: the recorded request, never this call's bytes.
# ``last_approval``: the grant a collected run executes under (Executor.execute starts it);
# "" for a new run, whose start Gate.start committed with it.
Execute = collections.namedtuple("Execute", "session tool last_approval", defaults=("",))


class Retry:
    """A race was lost: decide again."""


# An attempt whose outcome is unknown (cut off, timed out) was run by its server as a task
# that nobody has asked about: ask the server (Proxy.ask_task), then decide again.
AskTask = collections.namedtuple("AskTask", "run_id step_id started_at task_id created tool")
TASK_ASKED = "step.tool_task_asked"    # the event that says the server was asked, and what
TASK_ASK_TIMEOUT = 10.0                # the wait for a server's word on a task at a take-over
START_ASK_BUDGET = 3 * TASK_ASK_TIMEOUT   # ... and for all of them as a proxy starts
TASK_ASK_AGAIN = 30.0                  # a task still running then is asked about again after


def last_cut_off(q: Query, run_id: str) -> dict | None:
    """The run's last attempt when it was cut off: its step executing, or interrupted while
    executing (what a take-over finds)."""
    step = next(iter(q("SELECT id, status, started_at, observation_json FROM steps WHERE "
                       "run_id=? ORDER BY idx DESC LIMIT 1", (run_id,))), None)
    if step is None or step[1] not in ("executing", "interrupted"):
        return None
    if step[1] == "interrupted":
        with contextlib.suppress(ValueError, AttributeError):      # an edited record
            content = (loads_own(step[3] or "{}") or {}).get("content")
            if isinstance(content, dict) and content.get("previous_status") == "executing":
                return {"run_id": run_id, "step_id": step[0], "started_at": step[2]}
        return None
    return {"run_id": run_id, "step_id": step[0], "started_at": step[2]}


def task_to_ask(q: Query, attempt: dict | None, tool: str) -> AskTask | None:
    """The server's task of an attempt whose outcome is unknown, when its server recorded
    one for it (the step.tool_task event naming the attempt's start), nobody asked that
    server about it yet (step.tool_task_asked naming it), and no known outcome of it is
    recorded. A read of the attempt's step's events, on the paths of an unknown outcome
    only (a take-over, rule 6, a tool BLOCKED)."""
    if attempt is None or not isinstance(attempt.get("started_at"), str):
        return None
    run_id, step_id, started = attempt["run_id"], attempt["step_id"], attempt["started_at"]
    task = None
    for typ, at, payload in q("SELECT type, at, payload_json FROM events WHERE run_id=? AND "
                              "step_id=? AND type IN (?,?) ORDER BY seq",
                              (run_id, step_id, TASK_EVENT, TASK_ASKED)):
        try:
            doc = loads_own(payload) if payload else {}
        except ValueError:
            continue                          # an edited record: verify reports it
        if not isinstance(doc, dict) or doc.get("started_at") != started:
            continue                          # another attempt of the step
        if typ == TASK_ASKED:                 # asked: never again, or once it may have ended
            try:
                again = doc.get("again") is True and \
                    parse_time(at) + TASK_ASK_AGAIN <= time.time()
            except (ValueError, TypeError, AttributeError, OverflowError):
                again = False
            if not again:
                return None
        elif isinstance(doc.get("task_id"), str):
            task = (doc["task_id"], str(doc.get("created_at") or ""))
    if task is None or late_record(q, attempt, known=True) is not None:
        return None
    return AskTask(run_id, step_id, started, task[0], task[1], tool)


def resolved_by_operator(run: Run) -> bool:
    """Whether an operator resolved the unknown outcome a finished run asked about, so that
    other calls to its tool are free: they rejected the re-run or cancelled the run, or
    approved a re-run the policy then denied (it ran nothing)."""
    return run.reason in ("approval_rejected", "operator_cancelled") or \
        run.reason_detail == CLOSE_DENIED_RERUN


def _attempt(run_id: str, step: Step, ended: str) -> dict:
    return {"run_id": run_id, "step_id": step.id, "started_at": step.started_at, "ended": ended}


class Proxy:
    """The proxy behind the host: the tools it offers, each tools/call taken through the rules
    (Rules, under one deciding lock), at most one hold for an approval (Hold) and at most one
    execution (Executor), and answered only once its records are on disk; the gate's
    callbacks (what a known outcome is, what a late outcome settles, what a take-over
    reconciles); the take-over at start; and the status tool. It holds what they share: the
    configuration, the store, the call index, the gate, the policy and the limits."""

    def __init__(self, cfg: Config, store: Store, tools: list["UpstreamTool"],
                 log: Callable[[str], None], clock: Clock = time.time,
                 poll: float = APPROVAL_POLL):
        self.cfg, self.store, self.log, self.clock = cfg, store, log, clock
        self.tools = {t.spec.name: t for t in tools}
        self.reruns: dict[str, dict] = {}      # run id -> the attempt its proposal re-runs
        self.repeats: dict[str, dict] = {}     # run id -> the execution its proposal repeats
        self.budgets = Budgets(store, cfg, clock)
        self.policy = ProxyPolicy(cfg.policy_map, self.tools, self, cfg.policy_id())
        self.index = CallIndex(store, cfg.session)
        self.index.migrate(clock())
        self.budgets.catch_up()
        try:                        # this proxy's holder file (section 11), held while it serves
            self.holder: Holder | None = Holder.take(store.path)
        except OSError as exc:
            log(f"error: no holder file beside the database ({exc}): if this "
                "proxy dies, its calls are taken over only when their leases run out")
            self.holder = None
        try:
            self.gate = Gate(store, [Tool(t.spec, t.call, True) for t in tools], self.policy,
                             now=clock, lease_owner=f"agentrt-proxy:{cfg.session}",
                             holder=self.holder, lease_ttl=cfg.lease_ttl,
                             reconcile=self.reconcile, known=self.known,
                             on_settled=self._settled, budget=self.budgets)
        except BaseException:
            if self.holder is not None:
                self.holder.close()
            raise
        self.limits = Limits(CALL_MAX_STEPS, CALL_MAX_FAILURES, CALL_LOOP_THRESHOLD,
                             cfg.approval_ttl, cfg.grant_ttl)
        self.stopping = asyncio.Event()
        self._decide_lock: asyncio.Lock | None = None
        self.notifier = Notifier(cfg.on_pending, log)
        self.withheld: dict[str, tuple[str, str]] = {}    # name -> (server, why); drift
        self.order = list(self.tools)                     # the listing's order
        self.hold = Hold(cfg, store, log, clock, poll, self.stopping, self.notifier)
        self.executor = Executor(self)
        self.resume = Resume(self)
        self.rules = Rules(self)
        self.tasks = Tasks(self)

    def close(self) -> None:
        self.notifier.close()
        self.gate.close()
        if self.holder is not None:     # last: nothing of this proxy writes a lease after it
            self.holder.close()

    def window(self, tool: "UpstreamTool") -> float:
        w = tool.rule.repeat_window
        return self.cfg.repeat_window if w is None else w

    def listing(self) -> list[dict]:
        """The classified tools, then the status tool; no output schemas. Each tool's
        annotations say what the operator's class says, never what the server hinted: a
        host that prompts before a destructive tool, or trusts a read-only one, is told the
        class that the gate enforces."""
        return [{"name": t.spec.name, "description": t.spec.description,
                 "inputSchema": RawJSON(t.spec.input_schema),
                 "annotations": CLASS_ANNOTATIONS[t.spec.side_effect]}
                for t in self.tools.values()] + [status_tool_entry(self.cfg.status_tool)]

    def new_run_id(self) -> str:
        return f"{self.cfg.session}.{secrets.token_hex(RUN_SUFFIX_BYTES)}"

    def known(self, name: str, obs: dict) -> bool:
        """Whether a tool's observation is a known outcome: a result, or an error the server
        answered (or a refusal before sending); a timeout or no answer is not, nor an error
        of a tool no longer offered (unknown_ending)."""
        return obs.get("kind") == TOOL_RESULT or (
            obs.get("kind") == TOOL_ERROR and unknown_ending(self.tools.get(name), obs) is None)

    def _settled(self, tx: Tx, run_ids: list[str]) -> None:
        """Runs a late outcome settled, or ended: their index rows are known, in the same
        transaction."""
        for run_id in run_ids:
            self.index.known_in(tx, run_id, self.clock())
            recount_attempt(tx, run_id)  # a late success proves it executed, whatever was said

    def inspect(self, run_id: str) -> RunState | None:
        run = self.store.find_run(run_id)
        return None if run is None else \
            RunState(run, self.store.list_steps(run_id), self.store.list_approvals(run_id))

    # -- a call --

    async def call(self, name: str, args: bytes, progress: Callable[[float, float], None]
                   | None = None, cancelled: asyncio.Event | None = None,
                   value: Any = NOT_PARSED) -> dict:
        """One tools/call, answered: outcome(), a wait for an operator told as prose."""
        return self.answer(await self.outcome(name, args, progress, cancelled, value))

    def answer(self, action: "Answer | Pending") -> dict:
        """What the host is told of a call's outcome: its answer, or the prose of a wait."""
        return action.result if isinstance(action, Answer) else \
            self.hold.pending_answer(action.approval)

    async def outcome(self, name: str, args: bytes, progress: Callable[[float, float], None]
                      | None = None, cancelled: asyncio.Event | None = None,
                      value: Any = NOT_PARSED, hold: float | None = None) -> Answer | Pending:
        """The one path of a tools/call, the host's and a task's alike: rules first (atomic:
        one call decides at a time), then at most one hold for an approval (``hold``
        seconds, the configuration's by default), then at most one execution. An Answer, or
        the Pending approval the call still waits on. Every record an answer rests on was
        committed, synced, before it is given (Store.tx)."""
        if name == self.cfg.status_tool:
            return Answer(self.status(args))
        tool = self.tools.get(name)
        if tool is None:                 # withheld since the host was offered it (drift)
            return Answer(withheld_answer(self.withheld.get(
                name, ("", "it is no longer offered"))[1]))
        args, key, value = await self._offload(len(args), host_arguments, name, args, value)
        hold, held = self.cfg.hold if hold is None else hold, False
        for _ in range(MAX_RETRIES + 1):
            try:
                async with self._deciding():
                    action = await self._offload(len(args), self.rules.decide, tool, key,
                                                 args, value)
            except ProxyError as exc:       # a record that cannot be read, or written
                self.log(f"error: {sanitize(str(exc))}")
                return Answer(unavailable("read its records"))
            if isinstance(action, AskTask):
                await self.ask_task(action)
                continue
            if isinstance(action, Execute):
                result = await self.executor.execute(action)
                if result is not None:      # None: its attempt had a recorded outcome: decide again
                    return Answer(result)
            if isinstance(action, Pending):
                if not held and hold > 0 and not _is_set(cancelled) and \
                        not self.stopping.is_set():
                    held = True
                    if await self.hold.wait(action.approval, progress, cancelled, hold):
                        continue
                return action
            if isinstance(action, Answer):
                return action
        return Answer(in_progress())

    def _deciding(self) -> asyncio.Lock:
        """The lock under which a call reads the index and the runs and begins or collects
        what it decides: one call at a time in this process (made in the running loop)."""
        if self._decide_lock is None:
            self._decide_lock = asyncio.Lock()
        return self._decide_lock

    async def _offload(self, size: int, work: Callable, *args: Any) -> Any:
        """Run ``work`` here, or, for arguments past OFFLOAD_BYTES, on a worker thread: the
        parsing and checking it does cost in proportion to their size, and the event loop
        goes on answering the host (ping, other calls' answers, progress) meanwhile."""
        if size <= OFFLOAD_BYTES:
            return work(*args)
        return await asyncio.to_thread(work, *args)

    async def take_over_gone(self) -> None:
        """At start: each run of this session left running by a proxy that is gone (its
        holder's lock free, section 11, or its lease run out) is taken over now, as the next
        identical call would take it over (rule 3), so that the operator is asked about a
        call cut off while executing before the model calls anything. A run of a proxy
        that is alive, stopped included, keeps its lease. Then the tasks a gone proxy
        followed are followed from here (Tasks.take_over_gone)."""
        asking_until = time.monotonic() + START_ASK_BUDGET
        for row in self.index.unsettled():
            try:
                state = self.inspect(row.run_id)
                tool = self.tools.get(row.tool)
                if state is not None and state.run.status == RUNNING and tool is not None and \
                        not _lease_live(state.run, self.store.path):
                    ask = self.resume.recover(tool, row)
                    # its server is asked first, once; past the budget, by the next call
                    if isinstance(ask, AskTask) and time.monotonic() < asking_until:
                        await self.ask_task(ask, min(TASK_ASK_TIMEOUT,
                                                     asking_until - time.monotonic()))
                        self.resume.recover(tool, row)
            except ProxyError as exc:        # the next identical call takes it over instead
                self.log(f"error: run {row.run_id}: taking it over at start: {exc}")
        try:
            self.tasks.take_over_gone()
        except StoreError as exc:            # the next proxy to start follows them
            self.log(f"error: following the tasks of a proxy that is gone: {exc}")

    async def ask_task(self, ask: AskTask, timeout: float = TASK_ASK_TIMEOUT) -> None:
        """Ask the server that ran an attempt of unknown outcome as a task what came of it,
        before the operator is asked (task_to_ask): a known outcome it tells is recorded as
        the attempt's late outcome, so that a take-over finds it and asks nothing
        (Session._pause, section 13), and a question already asked is settled by it; what it
        cannot tell leaves the question to the operator. Either way a step.tool_task_asked
        event says it was asked (again later while the task still runs), written only if
        nobody wrote one meanwhile. Its word is read as the call's answer would have been
        (answer_of, then the one classifier)."""
        tool, began, found = self.tools.get(ask.tool), time.monotonic(), None
        if tool is not None and tool.conn is not None:
            found = await tool.conn.ended_task(ask.task_id, ask.created, ask.started_at,
                                               timeout)
        obs = None
        if found is not None and found != TASK_WORKING_STILL:
            async def given() -> Message:
                if isinstance(found, ProtocolError):
                    raise found
                return found
            try:
                obs = _observe(ask.tool, tool.spec.timeout, await tool.answer_of(given()))
            except Exception as exc:          # an outcome, classified as a call's would be
                obs = _observe(ask.tool, tool.spec.timeout, exc)
        known = obs is not None and self.known(ask.tool, obs.doc)
        said = obs.doc.get("summary", "") if known else "it has not ended yet" \
            if found == TASK_WORKING_STILL else "the server cannot say"
        at, seq = fmt_time(self.clock()), 0
        try:
            with self.store.tx() as tx:
                attempt = {"run_id": ask.run_id, "step_id": ask.step_id,
                           "started_at": ask.started_at}
                if task_to_ask(tx.rows, attempt, ask.tool) is None:
                    return                    # another call or process asked meanwhile
                if known:
                    seq = tx.event(ask.run_id, ask.step_id, at, "step.tool_finished",
                                   late_event(obs, ask.started_at, ask.tool,
                                              int((time.monotonic() - began) * 1000), True))
                tx.event(ask.run_id, ask.step_id, at, TASK_ASKED,
                         {"again": found == TASK_WORKING_STILL, "known": known, "said": said,
                          "started_at": ask.started_at, "task_id": ask.task_id})
                if known:                     # an approval already asking about it is settled
                    ended = settle_attempt(tx, LateRecord(
                        seq, ask.run_id, ask.step_id, ask.started_at, at, True, obs.json_text,
                        obs.doc), at)
                    self._settled(tx, ended)
        except (StoreError, RunStateError, NotPending) as exc:  # asked again at a later call
            self.log(f"error: run {ask.run_id}: what its server's task said was not "
                     f"recorded: {exc}")

    def reconcile(self, view: RunView) -> Reconciliation:
        """For the gate's take-over: a mutating call cut off while executing waits on an
        interruption approval naming that attempt."""
        step = next((s for s in reversed(view.steps) if s.status == "interrupted" and
                     s.obs_content.get("previous_status") == "executing"), None)
        if step is None:
            return Reconciliation("continue")
        tool = self.tools.get((step.decision or {}).get("tool", ""))
        if tool is None:
            return Reconciliation("waiting", detail="the tool is no longer offered")
        if tool.spec.side_effect == "read_only":
            return Reconciliation("continue")
        return Reconciliation("waiting", self.policy.asking(
            tool, policy_json(step.args or b"{}"), _attempt(view.run.id, step, "cut_off")))

    # the status tool

    def status(self, raw: bytes) -> dict:
        """What became of the session's approvals, from the database: never a write."""
        try:
            doc = parse_json(raw.strip(JSON_WS) or b"{}")
        except ValueError:
            doc = []                        # refused below, as a wrong shape is
        doc = {} if doc is None else doc
        if not isinstance(doc, dict) or set(doc) - {"approval_id"} or \
                not isinstance(doc.get("approval_id", ""), str):
            return invalid_answer("its only argument is approval_id, a string")
        items: list[tuple[CallRow, RunState, Approval]] = []
        try:
            for row in self.index.recent(self.clock() - STATUS_WINDOW, STATUS_ROWS):
                state = self.inspect(row.run_id)
                if state is not None:
                    items += [(row, state, a) for a in state.approvals]
            return status_answer(self, items, doc.get("approval_id", "").strip())
        except StoreError as exc:
            self.log(f"error: {exc}")
            return unavailable("read its records", "")


class Resume:
    """Rules 1 to 3: the request's own run, begun earlier and not finished. Waiting for an
    operator, the call is held (rule 1), and once approved the run is collected: the gate
    evaluates the policy again on the recorded request. Running under a live lease, the call
    is IN_PROGRESS (rule 2). Left running by a call that is gone, the run is taken over
    (rule 3): a mutating step cut off while executing waits for an operator. The gate
    attaches to the run; what its verdict asks for is done by the Executor."""

    def __init__(self, proxy: Proxy):
        self.hold, self.executor, self.store = proxy.hold, proxy.executor, proxy.store
        self.gate, self.log, self.clock = proxy.gate, proxy.log, proxy.clock

    def unfinished(self, tool, row: CallRow, state: RunState):
        if state.run.status == RUNNING:                           # rule 2, else rule 3
            return Answer(in_progress()) if _lease_live(state.run, self.store.path) else \
                self.recover(tool, row)
        latest = state.latest()                                   # rule 1
        if latest is not None and latest.status == PENDING:
            if not _expired(latest, self.clock()):
                ask = task_to_ask(self.store._read, asked_attempt(latest, self.store._read),
                                  tool.spec.name)
                return ask or Pending(latest)
            self.attach_and_close(row.run_id)      # the gate expires it and ends the run
            return None
        if latest is not None and latest.status == APPROVED:
            return self.collect(tool, row, state)
        return Answer(in_progress())

    def attach_and_close(self, run_id: str) -> None:
        """Let the gate judge the run by attaching to it (an approval past its time expires,
        and the run ends), then let go of it; a run it will not attach to is left as it is."""
        with contextlib.suppress(ProxyError):
            session, _ = self.gate.attach(run_id)
            if session is not None:
                session.close()

    def _attach(self, run_id: str, what: str):
        """The gate's attach, its refusals as actions: a live lease answers IN_PROGRESS, a
        run that moved meanwhile is decided again, anything else is UNAVAILABLE."""
        try:
            return self.gate.attach(run_id)
        except RunLeased:
            return Answer(in_progress())
        except RunStateError:
            return Retry()
        except ProxyError as exc:
            self.log(f"error: run {run_id}: {exc}")
            return Answer(unavailable(what))

    def collect(self, tool, row: CallRow, state: RunState):
        """The operator approved: the gate evaluates the policy again on the recorded request
        and judges the grant's age; what executes is the recorded request."""
        attached = self._attach(row.run_id, "collect the approved request")
        if isinstance(attached, (Answer, Retry)):
            return attached
        session, verdict = attached
        if verdict.kind == "ended":
            return None
        if verdict.kind in ("allowed", "pending", "denied", "settled"):
            return self.executor.verdict(session, verdict, tool, state.latest())
        session.close()
        return Retry()

    def recover(self, tool, row: CallRow):
        """A run left running by a call that is gone: take it over. A mutating step cut off
        while executing waits for an operator; otherwise nothing is left to execute. First,
        when its server was running it as a task and has not been asked, the AskTask to ask
        it (Proxy.ask_task), which the caller does before it decides again."""
        ask = task_to_ask(self.store._read, last_cut_off(self.store._read, row.run_id),
                          tool.spec.name)
        if ask is not None:
            return ask
        attached = self._attach(row.run_id, "recover an earlier attempt of this request")
        if isinstance(attached, (Answer, Retry)):
            return attached
        session, verdict = attached
        if verdict.kind == "pending":
            self.hold.hint(row.run_id, verdict.approval)
            self.log(f"run {row.run_id}: {tool.spec.name} was cut off while executing; "
                     "its outcome is unknown")
            return Pending(verdict.approval)
        if verdict.kind not in ("ended", "settled"):
            self.executor.finish(session, CLOSE_TAKEN_OVER)
        self.executor.settle_run(row.run_id)
        return None


class Rules:
    """The rules across calls, in the seed's order (decide): rules 1 to 3 by the request's
    own unfinished run (Resume), rules 4 and 5 by its finished runs within the window
    (refusal, and executed_within, the one answer to "did it execute"), rule 6 by an unknown
    outcome of it at any age (unresolved), the rules over the session (BLOCKED while an
    unknown outcome to the tool waits, max_pending), then rule 7, a new run (Executor.begin).
    A refusal is counted against the run it names (refused). The rules read the index and
    the runs and settle index rows; they execute nothing."""

    def __init__(self, proxy: Proxy):
        self.proxy, self.resume, self.executor = proxy, proxy.resume, proxy.executor
        self.cfg, self.store, self.index, self.policy = proxy.cfg, proxy.store, proxy.index, \
            proxy.policy
        self.clock, self.log, self.inspect, self.window = proxy.clock, proxy.log, \
            proxy.inspect, proxy.window
        self.refusals = RefusalLog(proxy.store)

    def decide(self, tool: "UpstreamTool", key: str | None, args: bytes, value: Any):
        """The rules, in order. Returns an Answer, a Pending approval, an Execute, or Retry.
        ``value`` is the arguments' strict parse (host_arguments)."""
        now = self.clock()
        if key is None:                 # arguments with no canonical form: INVALID, no rule
            return self.executor.begin(tool, None, args, None, False, None)
        open_row, recent = self.index.for_key(key, now - self.window(tool))
        reuse, ended = False, None
        if open_row is not None:
            state = self.inspect(open_row.run_id)
            if state is None:
                reuse = True                                  # begin the row's run
            elif not state.terminal:
                action = self.resume.unfinished(tool, open_row, state)   # rules 1 to 3
                if action is not None:
                    return action
                state = self.inspect(open_row.run_id)
                if state is not None and not state.terminal:
                    return Answer(in_progress())
            ended = state
        action = self.refusal(tool, key, recent, now, ended)     # rules 4 and 5
        repeat = action.earlier if isinstance(action, Repeat) else None
        if action is not None and repeat is None:
            return action
        prior = self.unresolved(key) if tool.spec.side_effect != "read_only" else None
        ask = task_to_ask(self.store._read, prior, tool.spec.name)
        if ask is not None:                   # its server may say what came of it first
            return ask
        asks = prior is not None or repeat is not None  # an approval, whatever the policy
        # BLOCKED, max_pending
        action = self.session_rules(tool, key, asks, args, prior is not None)
        if action is not None:
            return action
        return self.executor.begin(tool, key, args, open_row, reuse, prior,  # rule 7 (and 6)
                                   repeat=repeat, value=value)

    # rules 4 and 5: the request was refused, expired, or ran, within its window

    def refusal(self, tool, key: str, recent: list[CallRow], now: float, ended: RunState | None):
        """Rules 4 and 5. Rule 4 by the newest of the request's finished runs: the
        operator's last word on this request (no older run can say otherwise: when that run
        was begun, rule 4 found nothing to refuse in the older ones within the same window,
        and a window ending now reaches less of the past). Rule 5 by executed_within, for a
        rule that refuses and for one that asks alike. ``ended``: the open row's run,
        already read and ended: the decision reads each run once."""
        window = self.window(tool)
        if window <= 0:
            return None
        for row, state, outcome, _ in self.finished(recent, ended):
            action = self.refused_again(row, state, outcome, now, window)
            if action is not None:
                return action
            ended = state                    # read once: rule 5 may judge it too
            break
        if tool.spec.side_effect == "read_only":
            return None
        return self.executed_within(tool, key, now, window, ended)

    def refused_again(self, row: CallRow, state: RunState, outcome: int, now: float,
                      window: float):
        """Rule 4: the request was rejected, expired or cancelled within the window, or its
        approved re-run was denied at collection (which resolves it as a rejection does).
        Not when the store knows, late, that the attempt it asked about took effect: then it
        executed (rule 5), and the model is told that, never "not executed"."""
        end = parse_time(state.run.finished_at) if state.run.finished_at else 0.0
        reason, latest = state.run.reason, state.latest()
        if not end or end < now - window or not (resolved_by_operator(state.run) or
                                                 reason == "approval_expired"):
            return None
        if outcome == KNOWN and late_of(self.proxy, state) is not None:
            return None
        until = end + window
        if reason == "approval_rejected" and latest is not None:
            said = rejected(latest.id, latest.note, until, latest.kind == INTERRUPTED_KIND)
        elif reason == "approval_expired" and outcome != UNKNOWN and latest is not None:
            said = expired(latest.id, until)
        elif reason == "operator_cancelled":
            said = cancelled_answer(state.run.reason_detail, until)
        elif state.run.reason_detail == CLOSE_DENIED_RERUN:
            said = denied_rerun_again(until)
        else:
            return None                      # an expiry resolves nothing: rule 6 asks
        return self.refused(row.run_id, row.key, said)

    def executed_within(self, tool, key: str, now: float, window: float, read: RunState | None):
        """Rule 5, the one answer to "did this request execute within the window, and with
        what outcome, late outcomes included". Its outcome known, on time or late, within
        the window (which runs from the later of the run's end and the recording of its
        outcome, execution_of): DUPLICATE, or the Repeat to ask about where the rule asks.
        The rows read are the index's executions: the newest of them with an unknown
        outcome ends the search (rule 6 asks about it), and a run that made no attempt (a
        denied re-run, one denied at collection) is passed over, so it never hides an
        execution behind it. ``read``: a run the caller read already."""
        since = now - window
        for row, state, outcome, _ in self.finished(self.index.executions(key, since), read):
            if outcome == UNKNOWN:
                return None
            found = execution_of(self.proxy, state) if outcome == KNOWN else None
            if found is None or found[2] < since:
                continue
            run_id, at, moment, said = found
            if (tool.rule.repeat or self.cfg.repeat) == "ask":      # section 10, not DUPLICATE
                return Repeat({"run_id": run_id, "at": at,
                               "outcome": truncate(said, REPEAT_QUOTE_BYTES)})
            return self.refused(row.run_id, row.key, duplicate(moment, window, said))
        return None

    def finished(self, rows: Iterable[CallRow], read: RunState | None = None):
        """Each row whose run has ended, with that run and what its last attempt came to
        (last_attempt), the row settled by it as it is read. ``read``: a run the caller
        read already, not read again."""
        for row in rows:
            state = read if read is not None and read.run.id == row.run_id else \
                self.inspect(row.run_id)
            if state is not None and state.terminal:
                outcome, at = last_attempt(self.proxy, state)
                self.executor.settle(row, outcome)
                yield row, state, outcome, at

    def refused(self, run_id: str, key: str, result: dict) -> Answer:
        """The answer that refuses a call, counted against the run it names (RefusalLog).
        A count that cannot be written is told to the operator; the answer stands."""
        try:
            self.refusals.record(run_id, key, answer_prefix(result), self.clock())
        except StoreError as exc:
            self.log(f"run {run_id}: a refusal of it was not counted: {exc}")
        return Answer(result)

    # rule 6: an unknown outcome of this request, at any age

    def unresolved(self, key: str) -> dict | None:
        """The attempt of the newest run that made one, when its outcome is unknown (a
        known outcome's attempt is None, last_attempt)."""
        rows = itertools.takewhile(lambda row: row.outcome != KNOWN, self.index.attempts(key))
        return next((at for _, _, outcome, at in self.finished(rows) if outcome != NO_ATTEMPT),
                    None)

    # the rules over the session: BLOCKED while an unknown outcome waits, max_pending

    def session_rules(self, tool, key: str, rerun: bool, args: bytes, unknown: bool):
        outcome = self.policy.outcome_of(tool, args, unknown)
        needs_approval = outcome == "require_approval" or (rerun and outcome != "deny")
        mutating = tool.spec.side_effect != "read_only"
        if not mutating and not needs_approval:
            return None
        now, pending, oldest = self.clock(), 0, ""
        for row in self.index.unsettled():
            if row.key == key:
                continue
            state = self.inspect(row.run_id)
            if state is None:
                with contextlib.suppress(StoreError):
                    self.index.settle_empty(row, now)
                continue
            if state.terminal:
                self.executor.settle(row, last_attempt(self.proxy, state)[0])
                continue
            same_tool = mutating and row.tool == tool.spec.name
            if state.run.status == WAITING:
                latest = state.latest()
                if latest is None:
                    continue
                live = (latest.status == PENDING and not _expired(latest, now)) or \
                    (latest.status == APPROVED and not _grant_stale(state.run, latest, now))
                if same_tool and latest.kind == INTERRUPTED_KIND:
                    if live:
                        return self.refused(row.run_id, key, blocked_interrupted(
                            tool.spec.name, latest.id, latest.status == APPROVED))
                    self.resume.attach_and_close(row.run_id)
                elif live and latest.status == PENDING:
                    pending += 1
                    oldest = oldest or row.run_id
            elif same_tool and not _lease_live(state.run, self.store.path):
                action = self.resume.recover(tool, row)
                if isinstance(action, AskTask):
                    return action
                if isinstance(action, Pending):
                    return self.refused(row.run_id, key, blocked_interrupted(
                        tool.spec.name, action.approval.id))
                if action is not None:
                    return Answer(in_progress())
        # A call denied anyway is the gate's to deny; max_pending is counted against the
        # oldest waiting run.
        action = self.unknown_block(tool, key) if mutating and outcome != "deny" else None
        if action is None and needs_approval and pending >= self.cfg.max_pending:
            action = self.refused(oldest, key, blocked_pending(self.cfg.max_pending))
        return action

    def unknown_block(self, tool, key: str):
        """Another request to this tool has an unknown outcome with nothing waiting for an
        operator (its re-run met the step limit, its run stopped before asking, or its
        approval expired): ask again in a fresh run of that request, and refuse this one."""
        if self.policy.never_runs(tool):
            return None
        for row, state, outcome, at in self.finished(
                self.index.unknown_for_tool(tool.spec.name, key)):
            if outcome != UNKNOWN or resolved_by_operator(state.run):
                continue
            ask = task_to_ask(self.store._read, at, tool.spec.name)
            if ask is not None:
                return ask
            args = _last_args(state)
            if self.policy.outcome_of(tool, args, unknown=True) == "deny":
                # The class or the rule denies running it again (seed rule 6: short of
                # deny), so no question can be asked: blocking the tool would leave it
                # blocked with nothing for an operator to act on. The operator is told.
                self.log(f"run {row.run_id}: the outcome of this call to {tool.spec.name} is "
                         "unknown, and the policy denies running it again, so no operator "
                         "is asked about it; other calls to the tool are not held back")
                continue
            approval = self.executor.reopen(tool, row.key, args, at)
            if approval is None:
                return Answer(unavailable("ask an operator about an earlier call to this tool "
                                          "whose outcome is unknown"))
            return self.refused(approval.run_id, key,
                                blocked_interrupted(tool.spec.name, approval.id))
        return None


# ==== 22.1 Executing a call, holding it for an approval, and what its attempts came to ====
# A run begun through the gate executes its recorded request at most once, and what that came
# to is recorded before it is answered for; a call waiting on an approval is held at most once;
# then what a run's attempts came to (KNOWN, UNKNOWN, NO_ATTEMPT), as the rules read it.

class Executor:
    """A run through the gate, from its beginning to its end: begun (rule 7; reopen begins
    one to ask about an unknown outcome again), the gate's verdict acted on, the allowed
    request executed once, outside the rules (execute), what that came to recorded and
    answered for under the deciding lock, an unknown outcome asked about at once (rerun),
    and the run ended (denied, finish) with its index row settled (settle, settle_run).
    ``reruns`` and ``repeats`` are the proxy's: the policy reads what a proposal re-runs or
    repeats from them while the gate starts the run."""

    def __init__(self, proxy: Proxy):
        self.proxy, self.hold = proxy, proxy.hold
        self.store, self.index, self.gate, self.limits = proxy.store, proxy.index, proxy.gate, \
            proxy.limits
        self.clock, self.log, self.inspect, self.window = proxy.clock, proxy.log, \
            proxy.inspect, proxy.window
        self.reruns, self.repeats = proxy.reruns, proxy.repeats

    def reopen(self, tool, key: str, args: bytes, at: dict) -> Approval | None:
        """Ask about an unknown outcome again, in a fresh run of that request (``key``: an
        index row's, or an executed request's: never None)."""
        try:
            open_row = self.index.open_row(key)
            state = self.inspect(open_row.run_id) if open_row is not None else None
            if state is not None and not state.terminal:
                self.log(f"error: run {at.get('run_id')}: asking again about an unknown "
                         f"outcome failed: the request's run {open_row.run_id} has not "
                         "finished")
                return None
            action = self.begin(tool, key, args, open_row, open_row is not None and state is None,
                                at, origin="operator")
        except StoreError as exc:
            self.log(f"error: {exc}")
            return None
        if isinstance(action, Execute):      # a re-run is never allowed outright
            action.session.close()
        if isinstance(action, Pending):
            return action.approval
        self.log(f"error: run {at.get('run_id')}: asking again about an unknown outcome "
                 "opened no approval")
        return None

    # rule 7: a new run

    def begin(self, tool, key: str | None, args: bytes, open_row: CallRow | None,
              reuse: bool, prior: dict | None, origin: str = "model",
              repeat: dict | None = None, value: Any = NOT_PARSED):
        run_id = open_row.run_id if reuse else self.proxy.new_run_id()
        if reuse:
            also = lambda: self.index.unsettle(run_id)
        else:                           # an invalid request has a row of its own
            also = lambda: self.index.claim(key or f"invalid:{run_id}", tool.spec.name,
                                            tool.spec.side_effect, run_id,
                                            open_row if key else None, self.clock())
        self.reruns[run_id], self.repeats[run_id] = prior, repeat  # the policy reads them
        try:
            session, verdict = self.gate.start(
                run_id, f"call {tool.spec.name}", self.limits,
                Decision("tool_call", tool.spec.name, args, origin=origin, value=value),
                also=also)
        except (IndexRace, BudgetMoved):
            return Retry()
        except (RunStateError, StoreError, LeaseLost) as exc:
            if self.store.find_run(run_id) is not None:
                return Retry()              # another call began this row's run
            self.log(f"error: run {run_id}: {exc}")
            return Answer(unavailable("start this request" if reuse else "record this request"))
        finally:
            self.reruns.pop(run_id, None)
            self.repeats.pop(run_id, None)
        return self.verdict(session, verdict, tool)

    def verdict(self, session: Session, verdict: Verdict, tool, latest: Approval | None = None):
        """Act on the gate's verdict; ``latest``: the approval a collected run was granted
        (an approved re-run of an unknown outcome, denied at collection, is told so)."""
        if verdict.kind == "allowed":
            return Execute(session, tool, latest.id if latest else "")
        if verdict.kind == "pending":
            self.hold.hint(session.run_id, verdict.approval)
            return Pending(verdict.approval)
        if verdict.kind == "denied":
            return Answer(self.denied(session, verdict.observation,
                                      latest is not None and latest.kind == INTERRUPTED_KIND))
        session.close()
        self.settle_run(session.run_id)
        if verdict.kind == "settled":     # the attempt it asks about has a recorded outcome:
            return Retry()                # the rules now answer it (DUPLICATE within the window)
        return Answer(denied_answer(verdict.run.reason_detail if verdict.run else "the run ended"))

    # after the proposal

    def denied(self, session: Session, obs: dict, rerun: bool = False) -> dict:
        """End a denied run. ``rerun``: an approved re-run of an unknown outcome, denied at
        collection: it ran nothing, and it resolves the unknown outcome as a rejection
        would (resolved_by_operator), so the tool is free again."""
        content = obs.get("content") or {}
        invalid = obs.get("kind") == INVALID_DECISION
        self.finish(session, CLOSE_INVALID if invalid else
                    CLOSE_DENIED_RERUN if rerun else CLOSE_DENIED)
        self.settle_run(session.run_id)
        if invalid:
            return invalid_answer(str(content.get("error", "")))
        return (denied_rerun_answer if rerun else denied_answer)(str(content.get("reason", "")))

    def finish(self, session: Session, why: str) -> None:
        """End a run the proxy has nothing more to do in, with a fail decision."""
        try:
            if session.state == "open":
                session.fail(why)
        except ProxyError as exc:
            self.log(f"run {session.run_id}: closing: {exc}")
        finally:
            session.close()

    def settle(self, row: CallRow, outcome: int) -> None:
        try:
            self.index.settle(row, outcome, self.clock())
        except StoreError as exc:
            self.log(f"error: {exc}")

    def settle_run(self, run_id: str) -> None:
        try:
            row, state = self.index.by_run(run_id), self.inspect(run_id)
        except StoreError as exc:
            self.log(f"error: {exc}")
            return
        if row is not None and state is not None and state.terminal:
            self.settle(row, last_attempt(self.proxy, state)[0])

    async def execute(self, action: Execute) -> dict:
        """Run the allowed request once (outside the rules) and answer with what the gate
        recorded. An outcome that may have taken effect unseen is asked about at once."""
        session, tool, settled = action.session, action.tool, []
        run_id = session.run_id

        def settle_known(obs: dict) -> None:
            """A result completes the run: its index row is settled in the same commit."""
            if obs.get("kind") == TOOL_RESULT and session.state == "ended":
                self.index.settle_run(run_id, KNOWN, self.clock())
                settled.append(True)
        session.on_recorded = settle_known
        try:
            if action.last_approval:        # a collected grant; a new run started in Gate.start
                session.start()
            called = await session.call_started()
        except AttemptSettled as exc:
            self.log(f"{exc}; it is not run again")
            self.settle_run(run_id)
            return None
        except BudgetMoved:                 # nothing started: decide again on the new count
            session.close()
            return None
        except ApprovalExpired:
            self.settle_run(run_id)
            return expired(action.last_approval, self.clock() + self.window(tool))
        except (RunStateError, LeaseLost):
            session.close()
            return in_progress()
        except ProxyError as exc:
            session.close()
            self.log(f"error: {exc}")
            return unavailable("start this request")
        # What the call came to is recorded, and acted on (an unknown outcome asks an
        # operator at once), with no other call deciding in between: a mutating call that
        # decided meanwhile would find the unknown outcome recorded and nothing yet asking
        # about it, and run past it.
        async with self.proxy._deciding():
            return self.recorded(session, tool, called, settled)

    def recorded(self, session: Session, tool, called: tuple, settled: list) -> dict:
        """Record what the tool call came to and answer for it (under the deciding lock)."""
        run_id = session.run_id
        try:
            obs = session.record_outcome(called)
        except LateOutcome as late:
            session.close()
            self.log(f"run {run_id}: {tool.spec.name} returned after its run was taken over; "
                     "its outcome is recorded as a late event")
            return self.answer(tool, late.observation)
        except ProxyError as exc:           # the tool ran: whatever failed, it may have acted
            session.close()
            self.log(f"error: {exc}")
            return unavailable("record the outcome of this request",
                               "It was executed, so it may have taken effect; do not call it "
                               "again to retry.")
        ended = unknown_ending(tool, obs)
        if ended is not None:
            try:
                return self.rerun(session, tool, ended, obs)
            except ProxyError as exc:
                # The run is let go of: the next call to this tool takes it over and
                # asks an operator, so nothing runs again unseen.
                self.log(f"error: run {session.run_id}: asking about the unknown outcome: "
                         f"{exc}")
                session.close()
                return unknown_outcome(ended, error_text(obs), "")
        if obs.get("kind") == TOOL_ERROR:
            self.finish(session, CLOSE_UNRECORDED if _unrecorded(tool, obs) else CLOSE_TOOL_ERROR)
        else:
            session.close()
        if not settled:                     # a result's row was settled as it was recorded
            self.settle_run(run_id)
        return self.answer(tool, obs)

    def answer(self, tool, obs: dict) -> dict:
        """What the model is told of a recorded outcome that is not asked about now: an
        unknown one, an unrecorded answer, or what the tool returned as it was recorded. A
        tool that returned after its run was taken over is answered so too; the run itself
        is the new owner's."""
        ended = unknown_ending(tool, obs)
        if ended is not None:
            return unknown_outcome(ended, error_text(obs), "")
        if _unrecorded(tool, obs):
            return unrecorded_answer(error_text(obs), self.window(tool))
        return result_of(obs)

    def rerun(self, session: Session, tool, ended: str, obs: dict) -> dict:
        """The call may have taken effect: propose the recorded request again in the same
        run, with origin operator, so that it waits on an interruption approval."""
        run_id, text = session.run_id, error_text(obs)
        self.log(f"run {run_id}: {tool.spec.name}: {HOW[ended]}; its outcome is unknown")
        steps = self.store.list_steps(run_id)
        executed = next((s for s in reversed(steps) if s.obs_kind == TOOL_ERROR), None)
        if executed is None:    # the operator cancelled the run as it ran: a late event holds it
            session.close()
            return unknown_outcome(ended, text, "")
        at, args = _attempt(run_id, executed, ended), executed.args or b"{}"
        try:
            step = session.step()
        except ProxyError as exc:
            self.log(f"error: run {run_id}: no step for the re-run: {exc}")
            step = None
        verdict = None
        if step is not None:            # else, or when it ended, asked in a fresh run (reopen)
            self.reruns[run_id] = at
            try:
                verdict = session.propose(Decision("tool_call", tool.spec.name, args,
                                                   origin="operator"))
            except ProxyError as exc:
                self.log(f"error: run {run_id}: proposing the re-run: {exc}")
                session.close()
                return unknown_outcome(ended, text, "")
            finally:
                self.reruns.pop(run_id, None)
        if verdict is not None and verdict.kind == "pending":
            self.hold.hint(run_id, verdict.approval)
            return unknown_outcome(ended, text, verdict.approval.id)
        if verdict is not None and verdict.kind == "denied":
            self.denied(session, verdict.observation)
            return unknown_outcome(ended, text, "")
        session.close()
        self.settle_run(run_id)
        approval = self.reopen(tool, request_key(tool.spec.name, args), args, at)
        return unknown_outcome(ended, text, approval.id if approval else "")


class Hold:
    """An approval a call waits on: the operator told that it waits (hint, and the operator's
    on_pending command), the call held until it is decided, the hold ends, the host cancels
    or the proxy stops (wait), and the answer a call gets while it waits (pending_answer)."""

    def __init__(self, cfg: Config, store: Store, log: Callable[[str], None], clock: Clock,
                 poll: float, stopping: asyncio.Event, notifier: Notifier):
        self.cfg, self.store, self.log, self.clock, self.poll = cfg, store, log, clock, poll
        self.stopping, self.notifier = stopping, notifier

    def hint(self, run_id: str, approval: Approval) -> None:
        """The two lines that tell the operator an approval waits and how to decide it; and
        the operator's on_pending command, started on a thread of its own."""
        tool = approval.request().spec.name
        self.log(f"approval {approval.id} ({approval.kind}) for {tool} waits for an operator: "
                 f"run {run_id}")
        self.log(f"  decide with: {decide_command(self.store.path, run_id, approval.id)}"
                 "   (or reject)")
        path, store, clock = self.store.path, self.store, self.clock
        self.notifier.notify(approval.id, lambda: waiting_doc(
            approval, path, view_of(store, approval), limits_now(store._read, approval,
                                                                 clock())))

    async def wait(self, approval: Approval, progress, cancelled, hold: float) -> bool:
        """Hold until the approval is decided (True), or ``hold`` seconds end, the host
        cancels, or the proxy stops (False). A progress notification about once a second."""
        began = last = time.monotonic()
        while True:
            await asyncio.sleep(self.poll)
            now = time.monotonic()
            if _is_set(cancelled) or self.stopping.is_set() or now - began >= hold:
                return False
            try:
                current = self.store.get_approval(approval.id)
            except StoreError:
                continue
            if current.status != PENDING or _expired(current, self.clock()):
                return True
            if progress is not None and now - last >= PROGRESS_EVERY:
                last = now
                progress(now - began, hold)

    def pending_answer(self, approval: Approval) -> dict:
        if approval.kind == REPEAT_KIND:
            return repeat_pending(approval.id, (repeat_in(approval) or {}).get("at", ""))
        if approval.kind != INTERRUPTED_KIND:
            return pending_approval(approval.id)
        at = _interrupted_attempt(approval)
        if at is not None and at.get("ended") != "cut_off":
            return unknown_outcome(str(at.get("ended")), "", approval.id)
        return interrupted(approval.id)


def host_arguments(name: str, raw: bytes, value: Any = NOT_PARSED,
                   ) -> tuple[bytes, str | None, Any]:
    """The arguments as the gate records them, sends them, and shows them to an operator,
    their request key, and their strict parse, from one parse (``value``, the message's,
    when it was made as the message was read). The arguments are the proxy's own encoding of
    what the host sent (section 4): member order and number literals kept, so the request is
    the one the host made and its canonical form (which the key and the approval hash cover)
    is unchanged, but nothing the host wrote between two tokens survives, so the bytes that
    leave for a server are exactly the recorded request and an approval view hides nothing.
    Arguments the strict parser refuses are kept as they came: they have no key, are
    recorded as INVALID text, and are never sent. The proxy's own encoding of a strict
    parse parses strictly to the same value: the value travels with the arguments."""
    try:
        value = parse_json(raw) if value is NOT_PARSED else value
    except JSONError:
        return raw, None, NOT_PARSED
    return dump_json(value).encode("utf-8"), _request_key_of(name, value), value


def _is_set(event: asyncio.Event | None) -> bool:
    return event is not None and event.is_set()


def _last_args(state: RunState) -> bytes:
    return next((s.args for s in reversed(state.steps)
                 if (s.decision or {}).get("kind") == "tool_call"), None) or b"{}"


def _unrecorded(tool, obs: dict) -> bool:
    """A mutating tool's answer the proxy could not map: an error it recorded itself. A
    result's content is the server's, whatever it says."""
    content = obs.get("content")
    return obs.get("kind") == TOOL_ERROR and tool.spec.side_effect != "read_only" and \
        isinstance(content, dict) and content.get("failure") == "invalid_content"


def last_attempt(proxy: Proxy, state: RunState) -> tuple[int, dict | None]:
    """What the run's last attempt came to: KNOWN, UNKNOWN (with the attempt), or
    NO_ATTEMPT when nothing was executed. An attempt cut off whose tool returned after all,
    with a known outcome recorded as a late event, is KNOWN (section 13)."""
    outcome, at = _last_attempt(proxy, state)
    if outcome == UNKNOWN and late_record(proxy.store._read, at, known=True) is not None:
        return KNOWN, None
    return outcome, at


def late_of(proxy: Proxy, state: RunState) -> LateRecord | None:
    """The known late outcome of the run's last attempt, when what the run itself records
    of that attempt is only that it was cut off (a run that ended rejected, expired or
    cancelled while the cut-off call was still out)."""
    outcome, at = _last_attempt(proxy, state)
    return late_record(proxy.store._read, at, known=True) if outcome == UNKNOWN else None


def execution_of(proxy: Proxy, state: RunState) -> tuple[str, str, float, str] | None:
    """A finished run's known execution: the run that executed it, when (as recorded), the
    moment its window runs from, and its outcome as a DUPLICATE quotes it. The moment is the
    later of the run's end and the recording of any late outcome it knows of: its last
    attempt's (which another run may hold, section 13), and any of its own attempts' (one
    cut off before a re-run in the same run). None when the run knows no known outcome."""
    end = parse_time(state.run.finished_at) if state.run.finished_at else 0.0
    last, own = late_of(proxy, state), newest_late(proxy.store._read, state.run.id)
    moment = end
    for late in (x for x in (last, own) if x is not None):
        with contextlib.suppress(ValueError, TypeError, OverflowError):   # an edited time:
            moment = max(moment, parse_time(late.at))                    # verify reports it
    if last is not None:
        return last.run_id, last.at, moment, known_outcome(last.doc, late=True)
    step = next((s for s in reversed(state.steps) if s.obs_kind in (TOOL_RESULT, TOOL_ERROR)),
                None)
    if step is not None and end:
        return state.run.id, state.run.finished_at, moment, known_outcome(step.observation)
    if own is not None:
        return own.run_id, own.at, moment, known_outcome(own.doc, late=True)
    return None


def newest_late(q: Query, run_id: str) -> LateRecord | None:
    """The newest known late outcome recorded on the run's own steps."""
    for seq, step_id, at, payload in q(
            "SELECT seq, step_id, at, payload_json FROM events WHERE run_id=? AND "
            "type='step.tool_finished' ORDER BY seq DESC", (run_id,)):
        late = _late_of(seq, run_id, step_id, at, payload)
        if late is not None and late.known:
            return late
    return None


def _last_attempt(proxy: Proxy, state: RunState) -> tuple[int, dict | None]:
    by_step = {a.step_id: a for a in state.approvals}      # the latest per step
    for step in reversed(state.steps):
        decision = step.decision or {}
        if decision.get("kind") != "tool_call":
            continue
        cut = _attempt(state.run.id, step, "cut_off")
        previous = step.obs_content.get("previous_status")
        if step.status == "interrupted" and step.obs_kind == INTERRUPTED_OBS and previous:
            if previous == "executing":
                return UNKNOWN, cut
            continue                                      # cut off before its tool ran
        if step.obs_kind == TOOL_RESULT:
            return KNOWN, None
        if step.obs_kind == TOOL_ERROR:
            ended = unknown_ending(proxy.tools.get(decision.get("tool", "")), step.observation)
            return (KNOWN, None) if ended is None else \
                (UNKNOWN, _attempt(state.run.id, step, ended))
        # An operator cancelled the run at this step ("by"): an attempt only if its tool
        # started; else, when it waited on a question about an unknown outcome, that outcome
        # is what the run is about (its cancel resolves it, as a rejection would).
        if step.obs_kind == INTERRUPTED_OBS and ("by" not in step.obs_content or
                                                 _tool_started(proxy.store, state.run.id,
                                                               step.id)):
            return UNKNOWN, cut
        approval = by_step.get(step.id)
        if approval is not None and approval.kind == INTERRUPTED_KIND:
            return UNKNOWN, _interrupted_attempt(approval) or cut
    return NO_ATTEMPT, None


def _tool_started(store: Store, run_id: str, step_id: str) -> bool:
    """Whether the record shows the step's tool call leaving the proxy."""
    return bool(store._read("SELECT 1 FROM events WHERE run_id=? AND step_id=? AND "
                            "type='step.tool_started' LIMIT 1", (run_id, step_id)))


def known_outcome(obs: dict, late: bool = False) -> str:
    """An earlier call's known outcome, as a DUPLICATE quotes it; ``late``: one that arrived
    after the call was cut off (a LateRecord's doc)."""
    if obs.get("kind") == TOOL_RESULT:
        said = "it succeeded (its result arrived after it was cut off): " if late else \
            "it succeeded: "
        return said + clean(result_text(obs), MAX_RESULT_BYTES)
    content = obs.get("content")
    if not late and isinstance(content, dict) and content.get("failure") == "invalid_content":
        return ("the server answered, but its result could not be recorded: " +
                clean(error_text(obs), REASON_BYTES))
    said = "it failed (its answer arrived after it was cut off): " if late else "it failed: "
    return said + clean(error_text(obs), MAX_RESULT_BYTES)


def result_text(obs: dict) -> str:
    """The text the model reads of a result (result_of): the server's text beside
    structured content, else the content itself. Only structured content, an object, has
    text beside it (the upstream client takes no other)."""
    content, text = obs.get("content"), obs.get("text")
    if isinstance(content, dict) and isinstance(text, str):
        return text
    return content if isinstance(content, str) else dump_json(content)


# ==== 23. The host-facing server ====
# The proxy as an MCP server on stdin and stdout, in both protocol eras: the legacy handshake
# (initialize) and the stateless 2026-07-28 era (per-request _meta, server/discover). stdin is
# read as bytes; each call's arguments are parsed once, strictly, and written again in the
# proxy's own encoding before the gate keys and records them. Each call is its own task;
# answers go out in any order. A host told its tools changed: the legacy notice once it is
# initialized, or on a subscriptions/listen of its own (section 25). A host's cancel ends only
# a wait, never an upstream call already running. On EOF or a signal: accept no new call,
# finish the ones in flight, exit.
# While the servers are still loading (section 24) the handshake is answered at once, so the
# host's start-up timeout runs against the proxy's own start and not its slowest server's;
# the requests that need the tools wait, in the order they came, until loading ends.

SERVER_INFO = {"name": "gated-tools", "version": PROXY_VERSION}
# What the proxy offers: tasks (section 23.1) to a host that agreed on 2025-11-25, the
# first version that has them, as its capability (no tasks/list: an id is a bearer token),
# and in 2026-07-28 as the extension; to an older legacy host, what it was offered before.
LEGACY_TASKS = "2025-11-25"
SERVER_ABOUT = {"capabilities": {"tools": {"listChanged": True}}, "serverInfo": SERVER_INFO}
LEGACY_ABOUT = {**SERVER_ABOUT, "capabilities": {**SERVER_ABOUT["capabilities"], "tasks": {
    "cancel": {}, "requests": {"tools": {"call": {}}}}}}
MODERN_ABOUT = {**SERVER_ABOUT, "capabilities": {**SERVER_ABOUT["capabilities"],
                                                 "extensions": {TASKS_EXTENSION: {}}}}
UNCACHED = {"ttlMs": 0, "cacheScope": "private"}      # a modern host keeps no answer to reuse
MAX_INFLIGHT_CALLS = 256               # calls in flight before the host's input waits
READ_AHEAD_BYTES = 2 * MAX_FRAME       # the host's input read ahead of what is served
READ_AHEAD_LINE_COST = 64              # ... counting what each line held costs beyond it
WRITE_ROOM_POLL = 1.0                  # the writer thread's wait for room, between looks
DRAIN_POLL = 0.02                      # how often a drain looks at what is left to write
MAX_OUTPUT_BACKLOG = 4096              # answers queued for the host before its input waits
BACKPRESSURE_POLL = 0.01
NEEDS_TOOLS = ("tools/list", "tools/call", "tasks/get", "tasks/result", "tasks/cancel",
               "tasks/update")
TASK_METHODS = {False: ("tasks/get", "tasks/result", "tasks/cancel"),
                True: ("tasks/get", "tasks/cancel", "tasks/update")}
# Requests held while loading, and their text together. A host that floods the proxy before
# it serves gets an error for each one past these, not memory without bound.
MAX_WAITING = 256
MAX_WAITING_BYTES = MAX_FRAME
STILL_LOADING = "the proxy is still loading its servers: send this request again shortly"
START_FAILED = "the proxy could not start and is exiting; its log says why"
STOPPED_LOADING = "the proxy was stopped before it served"
MAX_HOST_LISTENS = 16                  # a modern host's open subscriptions/listen
META_SUBSCRIPTION = "io.modelcontextprotocol/subscriptionId"


class HostServer:
    """The host's side. ``proxy`` is None while the servers load; ``ready`` hands it over
    and answers what waited, ``refuse`` answers what waited with an error."""

    def __init__(self, proxy: Proxy | None, write: Callable[[bytes], None],
                 log: Callable[[str], None] | None = None):
        self.proxy, self.write = proxy, write
        self.log = log if log is not None else proxy.log
        self.closing = False
        # Each call in flight, with its request's key and the event a cancel naming it sets.
        self.inflight: dict[asyncio.Task, tuple[str, asyncio.Event]] = {}
        self.waiting: list[Message] = []
        self.refusal = ""                # set once loading failed: the answer to later ones
        self.initialized = False         # a legacy host sent notifications/initialized
        self.tasks = False               # a legacy host agreed on a version with tasks
        self.listens: dict[str, Any] = {}    # a modern host's subscriptions/listen, by id

    def ready(self, proxy: Proxy | None) -> None:
        """Loading is done: serve, first the requests that waited, in the order they came."""
        self.proxy = proxy
        waiting, self.waiting = self.waiting, []
        for msg in waiting:
            self.dispatch(msg)

    def refuse(self, reason: str) -> None:
        """Loading failed or was stopped: each request that waited is answered with an
        error, as is every later one: with no proxy, hold refuses each."""
        self.refusal = reason
        self.ready(None)

    def hold(self, msg: Message) -> None:
        if self.refusal:
            raise ProtocolError(self.refusal)
        held = sum(len(m.text) for m in self.waiting) + len(msg.text)
        if len(self.waiting) >= MAX_WAITING or held > MAX_WAITING_BYTES:
            raise ProtocolError(STILL_LOADING)
        self.waiting.append(msg)

    async def shutdown(self) -> None:
        """No new call is admitted; holds end at once; the calls in flight finish and are
        recorded."""
        self.closing = True
        if self.proxy is not None:
            self.proxy.stopping.set()
        following = {} if self.proxy is None else self.proxy.tasks.following
        while self.inflight or following:     # each ends once stopping is set, or records
            await asyncio.wait(set(self.inflight) | {t for t, _ in following.values()})

    def handle(self, line: bytes) -> None:
        """Answer one line from the host. Nothing in it can stop serving: whatever goes wrong
        is answered as an error (when there is a request to answer) and logged."""
        msg = self.read(line)
        if msg is not None:
            self.dispatch(msg)

    async def take(self, line: bytes) -> None:
        """handle(), with a long line parsed on a worker thread so that the event loop goes
        on meanwhile; lines are still taken in order (the next is read once this one is
        routed)."""
        msg = self.read(line) if len(line) <= OFFLOAD_BYTES else \
            await asyncio.to_thread(self.read, line)
        if msg is not None:
            self.dispatch(msg)

    def read(self, line: bytes) -> Message | None:
        """The message on a line, or None when it was answered as not one."""
        try:
            if len(line) > MAX_FRAME:    # cut by the reader: not parsed at all
                raise ProtocolError(f"a message longer than {MAX_FRAME} bytes is not read",
                                    PARSE_ERROR)
            msg = parse_message(line)
            _check_envelope(msg)
        except (JSONError, ProtocolError) as exc:
            self.write(rpc_error(None, error_code(exc), str(exc)))
            return None
        return msg

    async def room(self, backlog: Callable[[], int]) -> None:
        """Wait, before reading more of the host's input, while too many calls are in flight
        or too many answers wait for a host that is not reading them: a host cannot make the
        proxy hold without bound what it asked for (its tasks: MAX_OPEN_TASKS)."""
        while len(self.inflight) >= MAX_INFLIGHT_CALLS or backlog() > MAX_OUTPUT_BACKLOG:
            await asyncio.sleep(BACKPRESSURE_POLL)

    def dispatch(self, msg: Message) -> None:
        try:
            self.route(msg)
        except Exception as exc:
            self.failed(msg, exc)

    def failed(self, msg: Message, exc: Exception) -> None:
        """A request that failed: a protocol error is the host's answer; any other is a
        fault of ours, logged, and the host still gets an answer."""
        if isinstance(exc, ProtocolError):
            self.write(rpc_error(msg.id_value(), error_code(exc), str(exc), exc.data))
            return
        self.log(f"error: handling a {_quote(str(msg.method))} message: "
                 f"{type(exc).__name__}: {sanitize(str(exc))}")
        if msg.method is not None and msg.has_id:
            self.write(rpc_error(msg.id_value(), INTERNAL_ERROR, "internal error"))

    def route(self, msg: Message) -> None:
        if "method" not in msg.doc:
            return                       # a response to nothing we asked: ignored
        if "id" in msg.doc:
            self.request(msg)
        elif msg.method == "notifications/cancelled":
            key = _id_key(msg.raw("requestId", in_params=True))
            for call_key, event in self.inflight.values():
                if call_key == key:
                    event.set()
            # A request cancelled while it waited for loading is never run nor answered.
            self.waiting = [m for m in self.waiting if _id_key(m.raw("id")) != key]
            self.listens.pop(key, None)
        elif msg.method == "notifications/initialized":
            self.initialized = True

    def _era(self, msg: Message) -> bool:
        """Whether the request is of the stateless era; refuses a version we do not speak."""
        meta = msg.params.get("_meta")
        version = meta.get(META_VERSION) if isinstance(meta, dict) else None
        if version is None:
            return False
        if version != MODERN_VERSION:
            raise ProtocolError(f"unsupported protocol version {_quote(str(version))}",
                                UNSUPPORTED_VERSION, {"supported": [MODERN_VERSION],
                                                      "requested": version})
        if not isinstance(meta.get(META_CAPABILITIES), dict):
            raise ProtocolError(f"_meta lacks {META_CAPABILITIES}", INVALID_PARAMS)
        return True

    def request(self, msg: Message) -> None:
        modern, method = self._era(msg), msg.method
        if method in NEEDS_TOOLS and self.proxy is None:
            self.hold(msg)
        elif method == "initialize" and not modern:
            asked = msg.params.get("protocolVersion")
            agreed = asked if asked in LEGACY_VERSIONS else LEGACY_VERSIONS[0]
            self.tasks = agreed == LEGACY_TASKS
            self.reply(msg, {"protocolVersion": agreed,
                             **(LEGACY_ABOUT if self.tasks else SERVER_ABOUT)}, False)
        elif method == "server/discover":
            self.reply(msg, {"supportedVersions": [MODERN_VERSION], **MODERN_ABOUT, **UNCACHED},
                       True)
        elif method == "ping" and not modern:
            self.reply(msg, {}, False)
        elif method == "tools/list":
            tools = self.proxy.listing()
            self.reply(msg, {"tools": tools, **UNCACHED} if modern else {"tools": [
                {**t, "execution": TASK_OPTIONAL} for t in tools] if self.tasks else tools},
                modern)
        elif method == "tools/call":
            self.start_call(msg, modern)
        elif method in TASK_METHODS[modern]:
            task_request(self, msg, modern)
        elif method == "subscriptions/listen" and modern:
            self.listen(msg)
        else:
            raise ProtocolError(f"method {_quote(method)} not found", METHOD_NOT_FOUND)

    def reply(self, msg: Message, result: dict, modern: bool) -> None:
        if modern:
            result = {"resultType": "complete", **result, "_meta": {META_SERVER: SERVER_INFO}}
        self.write(rpc_result(msg.id_value(), result))

    def start_call(self, msg: Message, modern: bool) -> None:
        if self.closing:
            raise ProtocolError("the proxy is shutting down and accepts no new call")
        name = msg.params.get("name")
        tools = self.proxy.tools
        if not isinstance(name, str) or (name not in tools and name not in self.proxy.withheld
                                         and name != self.proxy.cfg.status_tool):
            raise ProtocolError(f"unknown tool {_quote(str(name))}", INVALID_PARAMS)
        _check_call_params(msg)
        args, value = empty_as_object(msg.raw("arguments", in_params=True) or b"",
                                      msg.parsed("arguments"))
        task = msg.params.get("task") if self.tasks and not modern else None
        if task is not None and not isinstance(task, dict):      # the host asks for a task
            raise ProtocolError("params.task is not an object", INVALID_PARAMS)
        key, event = _id_key(msg.raw("id")), asyncio.Event()
        # Ids of calls in flight may repeat (a host's mistake): each call has its own event,
        # and a cancel naming the id reaches every call that carries it. Nothing between the
        # task's creation and its entry can fail: no call runs untracked.
        task = asyncio.create_task(self.run_call(msg, modern, name, args, event, value)
                                   if task is None else self.run_task(msg, name, args, value))
        self.inflight[task] = (key, event)
        task.add_done_callback(self.inflight.pop)

    async def run_call(self, msg: Message, modern: bool, name: str, args: bytes,
                       cancelled: asyncio.Event, value: Any = NOT_PARSED) -> None:
        token = msg.params.get("_meta", {}).get("progressToken")    # _check_call_params
        progress = None if token is None else lambda done, total: self.write(rpc_notification(
            "notifications/progress", {"progressToken": token, "progress": Num(f"{done:.3f}"),
                                       "total": Num(f"{total:.3f}"),
                                       "message": "waiting for an operator's approval"}))
        proxy = self.proxy
        try:
            # Awaited in this task, which nothing cancels: a host's cancel sets ``cancelled``,
            # which ends a hold, never the gate's work or an upstream call.
            if modern and declares_tasks(msg):
                action = await self.call_or_task(msg, name, args, cancelled, value, progress)
                if action is None:
                    return                       # answered with a task
            else:
                action = await proxy.outcome(name, args, progress, cancelled, value)
            result = proxy.answer(action)
        except Exception as exc:            # an answer is owed even when something broke
            result = broken_answer(proxy.log, exc)
        if not cancelled.is_set():             # a cancelled request gets no answer
            self.reply(msg, result, modern)

    async def run_task(self, msg: Message, name: str, args: bytes, value: Any) -> None:
        """2025-11-25: a call that asks for a task is answered one at once (start_task)."""
        try:
            await start_task(self, msg, False, name, args, value, self.proxy.clock())
        except Exception as exc:
            self.failed(msg, exc)

    async def call_or_task(self, msg: Message, name: str, args: bytes, cancelled: asyncio.Event,
                           value: Any, progress) -> "Answer | Pending | None":
        """A 2026-07-28 call that declared tasks: its outcome, or None once it was answered
        with a task (start_task), which it is when it still waits for an operator, or its
        mutating request still executes, once `hold` is over. The outcome goes on in a task
        of its own, which nothing cancels, and the task's follower takes it over."""
        began = self.proxy.clock()
        work = asyncio.ensure_future(self.proxy.outcome(name, args, progress, cancelled, value))
        tool = self.proxy.tools.get(name)
        mutating = tool is not None and tool.spec.side_effect != "read_only"
        await asyncio.wait({work}, timeout=self.proxy.cfg.hold if mutating else None)
        if not cancelled.is_set() and (not work.done() or isinstance(work.result(), Pending)):
            try:
                await start_task(self, msg, True, name, args, value, began,
                                 None if work.done() else work)
                return None
            except ProxyError as exc:       # too many tasks, or the store: answered as today
                if not isinstance(exc, ProtocolError):
                    self.log(f"error: a task was not made: {sanitize(str(exc))}")
        return await work

    # -- the offered tools changed (section 25) --

    def listen(self, msg: Message) -> None:
        """A modern host's subscriptions/listen: acknowledged at once, answered never; a
        tools change is sent on it until the host cancels it. At most MAX_HOST_LISTENS are
        kept: a host cannot make the proxy hold subscriptions without bound."""
        key = _id_key(msg.raw("id"))
        if key not in self.listens and len(self.listens) >= MAX_HOST_LISTENS:
            raise ProtocolError(f"more than {MAX_HOST_LISTENS} subscriptions are open",
                                INVALID_REQUEST)
        wanted = msg.params.get("notifications")
        if isinstance(wanted, dict) and wanted.get("toolsListChanged") is True:
            self.listens[key] = msg.id_value()
        self.write(rpc_notification("notifications/subscriptions/acknowledged",
                                    {"_meta": {META_SUBSCRIPTION: msg.id_value()}}))

    def tools_changed(self) -> None:
        """Tell the host its tools changed: a legacy host once it is initialized, a modern
        one on each subscription that asked for it."""
        legacy = [{}] if self.initialized else []
        for params in legacy + [{"_meta": {META_SUBSCRIPTION: i}} for i in self.listens.values()]:
            self.write(rpc_notification("notifications/tools/list_changed", params))


def _check_envelope(msg: Message) -> None:
    """What JSON-RPC 2.0 and MCP require of every message, before anything acts on it: a
    request, a notification or a response of version "2.0", a method that is a string, an id
    that is a string or a number (never null: MCP), params that are structured, and UTF-8
    everywhere but inside a call's arguments (which the gate records as INVALID instead).
    Anything else is an Invalid Request, answered with id null and acted on by nothing."""
    doc = msg.doc
    if "method" not in doc and ("result" in doc or "error" in doc):
        return                                       # a response: never answered
    for fault, reason in (
            (doc.get("jsonrpc") != "2.0", 'not a JSON-RPC 2.0 message: "jsonrpc" must be "2.0"'),
            ("method" not in doc, "not a JSON-RPC message: no method, result or error"),
            (not isinstance(doc.get("method"), str), "the method is not a string"),
            ("id" in doc and not isinstance(doc["id"], (str, Num)),
             "the id is not a string or a number"),
            ("params" in doc and not isinstance(doc["params"], (dict, list)),
             "params is not an object or an array")):
        if fault:
            raise ProtocolError(reason, INVALID_REQUEST)
    start, end = msg.params_spans.get("arguments", (0, 0))      # the text outside arguments
    if _SURROGATES.search(msg.text, 0, start) or _SURROGATES.search(msg.text, end):
        raise JSONError("not valid UTF-8", msg.text.encode("utf-8", "surrogateescape"), 0)


_INTEGER_LITERAL = re.compile(r"-?(?:0|[1-9][0-9]*)")


def _check_call_params(msg: Message) -> None:
    """tools/call, whose params are an object (start_call found the tool's name in them):
    arguments an object (or absent, or null: no arguments), _meta an object, a progress token
    a string or an integer."""
    args, meta = msg.params.get("arguments"), msg.params.get("_meta", {})
    if args is not None and not isinstance(args, dict):
        raise ProtocolError("tools/call arguments is not an object", INVALID_PARAMS)
    if not isinstance(meta, dict):
        raise ProtocolError("_meta is not an object", INVALID_PARAMS)
    token = meta.get("progressToken", "")          # judged by its literal only
    if not (isinstance(token, str) or
            isinstance(token, Num) and _INTEGER_LITERAL.fullmatch(token.text)):
        raise ProtocolError("the progress token is not a string or an integer", INVALID_PARAMS)


def _id_key(raw: bytes | None) -> str:
    """Request ids compare as JSON values, whatever their spelling."""
    if raw is None:
        return ""
    try:
        return encode_canonical(parse_json(raw, strict=False)).decode()
    except JSONError:
        return raw.decode("utf-8", "replace")


# ==== 23.1 Tasks: a call the host waits on the protocol's way ====
# A host that declares tasks may be answered a task instead of a wait: in 2025-11-25 every
# tools/call that carries params.task (the host decides), in 2026-07-28 a call that declared
# the io.modelcontextprotocol/tasks extension and still waits for an operator, or still
# executes a mutating request, once `hold` is over (the proxy decides). A task is a handle on
# one call of the host, never a second state machine: its row in proxy_tasks holds the
# request as the gate records it, its ttl (approval_ttl and a minute), the holder of the proxy that
# follows it, and once the call has one, its answer: what the identical call is answered,
# through Proxy.outcome, the one path of every call. Until then the task is working; with
# its answer, completed, whatever the answer says (a refusal is completed with its isError
# text: failed is for a JSON-RPC error); cancelled once the host cancelled it before that.
# The row is written, synced, before the host learns the task's id, so any process on the
# store answers for it; the id is random, never derived from a run or an approval. The
# proxy that made a task follows it; when that proxy is gone (its holder file free, or
# removed at its exit), the next proxy to start follows it. A follower executes nothing the
# identical call would not: the gate runs a request at most once, whoever asks.

MISSING_CAPABILITY = -32021
TASK_ID_BYTES = 24                     # random bytes of a task id: a bearer token
TASK_POLL_MS = 1000                    # how often a host is asked to look at a task
TASK_HOLD = 10.0                       # a follower's hold between looks at its task's row
TASK_LOOK, TASK_LOOK_MAX = 1.0, 60.0   # its wait to look again at a call that is not held
MAX_OPEN_TASKS = 64                    # a session's tasks with no answer yet
TASK_TTL_SLACK = 60.0                  # a task's ttl past its approval's: the expiry is told
TASK_TTL_CAP = 7 * 24 * 3600.0         # a task's ttl where approvals never expire
TASK_OPTIONAL = {"taskSupport": "optional"}     # each tool, toward a 2025-11-25 host
TASK_WAITING = "the call waits for an operator's approval"
TASK_WORKING = "the call is being taken through the gate"
HOST_WITHDRAWN = "host_withdrawn"      # a run's reason: the host cancelled its task
HOST_BY = "host"
WITHDRAWN_NOTE = "withdrawn by the host (tasks/cancel) before an operator decided"
_TASK_COLS = "task_id, tool, arguments, request_key, created_at, ttl, follower, answer, " \
             "updated_at, cancelled"
# A session's open tasks, newest first (the partial index proxy_tasks_open).
_OPEN_TASKS_SQL = (f"SELECT {_TASK_COLS} FROM proxy_tasks WHERE session=? AND answer IS NULL "
                   "AND cancelled=0 ORDER BY created_at DESC LIMIT ?")
TaskRow = collections.namedtuple("TaskRow", "id tool args key created ttl follower answer "
                                            "updated cancelled")


def declares_tasks(msg: Message) -> bool:
    """Whether a 2026-07-28 request declared the tasks extension in its own capabilities."""
    meta = msg.params.get("_meta")
    caps = meta.get(META_CAPABILITIES) if isinstance(meta, dict) else None
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    return isinstance(extensions, dict) and isinstance(extensions.get(TASKS_EXTENSION), dict)


def _follower_gone(database: str, follower: str) -> bool:
    """Whether the proxy that follows a task is gone: its holder file free (holder_gone),
    or removed, as a proxy removes its own at a normal exit. A follower that names no file
    (a proxy where flock locks nothing) is never taken for gone: two followers of one task
    could each begin its request again after the other's answer (a repeat the rule asks
    about, for one call of the host), so its task waits for it, or for its ttl."""
    named = HOLDER_IN_OWNER.search(follower)
    if named is None:
        return False
    return holder_gone(database, follower) or \
        not os.path.lexists(f"{database}.{named.group(1)}")


def _task_expired(row: TaskRow, now: float) -> bool:
    """A task past its ttl is gone: no host can read it, and nothing follows it."""
    return row.ttl is not None and row.created + row.ttl <= now


class _TaskCancel:
    """A follower's cancel, as Proxy.outcome and Hold.wait read one: taken by this process
    (set), or by any process on the store, in the task's row, or the task gone past its
    ttl. So a hold ends at once wherever the host's tasks/cancel came."""

    def __init__(self, tasks: "Tasks", task_id: str):
        self.tasks, self.task_id, self.here = tasks, task_id, False

    def set(self) -> None:
        self.here = True

    def is_set(self) -> bool:
        try:
            row = None if self.here else self.tasks.get(self.task_id)
        except StoreError:
            return False                      # read again at the next look
        return row is None or bool(row.cancelled)


class Tasks:
    """proxy_tasks, and the followers this proxy runs: each takes its task's call through
    Proxy.outcome until the call has an answer that is not a wait (final), and records
    it. At most MAX_OPEN_TASKS of a session are open at once."""

    def __init__(self, proxy: "Proxy"):
        self.proxy, self.store, self.session = proxy, proxy.store, proxy.cfg.session
        self.follower = "" if proxy.holder is None else ";" + proxy.holder.ident
        self.following: dict[str, tuple[asyncio.Task, _TaskCancel]] = {}

    def create(self, name: str, args: bytes, key: str | None, began: float) -> TaskRow:
        """A new task for a call, durably: a tasks/get for it resolves before its id is
        given. ``args``: the call's arguments as the gate records them (host_arguments);
        ``began``: when the host's call came, the task's creation (a 2026-07-28 task is made
        once `hold` is over). Its ttl outlasts an approval the call asks for by
        TASK_TTL_SLACK, so that an expiry is told, or is TASK_TTL_CAP where approvals never
        expire. ProtocolError when MAX_OPEN_TASKS of the session are open."""
        now, ttl = self.proxy.clock(), self.proxy.cfg.approval_ttl
        ttl = ttl + TASK_TTL_SLACK if ttl > 0 else TASK_TTL_CAP
        row = TaskRow(secrets.token_urlsafe(TASK_ID_BYTES), name, args, key, began, ttl,
                      self.follower, None, now, 0)
        with self.store.tx() as tx:
            self._forget_expired(tx, now)
            if tx.rows("SELECT COUNT(*) FROM proxy_tasks WHERE session=? AND answer IS NULL "
                       "AND cancelled=0", (self.session,))[0][0] >= MAX_OPEN_TASKS:
                raise ProtocolError(f"{MAX_OPEN_TASKS} tasks of this session are open, the "
                                    "most it may have: wait for one to end", INVALID_REQUEST)
            tx.exec(f"INSERT INTO proxy_tasks (session, {_TASK_COLS}) VALUES "
                    "(?,?,?,?,?,?,?,?,?,?,?)", (self.session, *row))
        return row

    def _forget_expired(self, tx: Tx, now: float) -> None:
        """Delete the session's tasks past their ttl: no host can read them any more."""
        tx.exec("DELETE FROM proxy_tasks WHERE session=? AND created_at<=? AND ttl IS NOT "
                "NULL AND created_at+ttl<=?", (self.session, now, now))

    def get(self, task_id: Any) -> TaskRow | None:
        """A task of this session, unless it is unknown or past its ttl."""
        if not isinstance(task_id, str):
            return None
        rows = self.store._read(f"SELECT {_TASK_COLS} FROM proxy_tasks WHERE task_id=? AND "
                                "session=?", (task_id, self.session))
        row = TaskRow(*rows[0]) if rows else None
        return None if row is None or _task_expired(row, self.proxy.clock()) else row

    def cancel(self, row: TaskRow) -> bool:
        """The host cancels a task that has no answer yet: it is cancelled, and stays so
        whatever comes of its call, and its follower stops (here at once, elsewhere at its
        next look). A request that waits for an approval the policy asked is withdrawn
        (withdraw). False: the task had ended."""
        with self.store.tx() as tx:
            done = tx.exec("UPDATE proxy_tasks SET cancelled=1, updated_at=? WHERE "
                           "task_id=? AND answer IS NULL AND cancelled=0",
                           (self.proxy.clock(), row.id)).rowcount == 1
        if row.id in self.following:
            self.following[row.id][1].set()
        if done:
            self.withdraw(row)
        return done

    def withdraw(self, row: TaskRow) -> None:
        """Withdraw the task's request if it has not executed and waits on a pending
        approval the policy asked (a class, a condition or limit, a repeat): the run ends
        CANCELLED for HOST_WITHDRAWN, and that approval, still pending in the transaction
        that ends the run, is cancelled by the host, which the operator's views say. Not an
        operator's decision, so not a cancel under rule 4: the identical call later is a
        fresh request, asked again. An interruption approval is the operator's alone: the
        task only lets go of it. A request that started runs on, and its outcome is
        recorded as any call's."""
        try:
            open_row = self.proxy.index.open_row(row.key) if row.key else None
            state = self.proxy.inspect(open_row.run_id) if open_row is not None else None
            latest = state.latest() if state is not None else None
            if state is not None and state.run.status == WAITING and latest is not None and \
                    latest.status == PENDING and latest.kind != INTERRUPTED_KIND:
                cancel_run(self.store, state.run.id, HOST_BY, WITHDRAWN_NOTE,
                           self.proxy.clock(), HOST_WITHDRAWN, (WAITING,), latest.id)
        except RunStateError:
            pass                              # it moved on meanwhile: nothing waits to withdraw
        except ProxyError as exc:             # it waits on; the operator decides it
            self.proxy.log(f"error: a cancelled task's request was not withdrawn: {exc}")

    def doc(self, row: TaskRow, modern: bool) -> dict:
        """The task as the host's era spells it; a completed task's answer within it
        (2026-07-28) or from tasks/result (2025-11-25)."""
        status = "cancelled" if row.cancelled else \
            "working" if row.answer is None else "completed"
        doc = {"taskId": row.id, "status": status}
        if status == "working":
            doc["statusMessage"] = self.waiting_on(row)
        doc.update({"createdAt": fmt_time(row.created), "lastUpdatedAt": fmt_time(row.updated),
                    "ttlMs" if modern else "ttl": None if row.ttl is None else
                    int(row.ttl * 1000), "pollIntervalMs" if modern else "pollInterval":
                    TASK_POLL_MS})
        if modern and status == "completed":
            doc["result"] = {**self.answer_of(row), "resultType": "complete"}
        return doc

    def waiting_on(self, row: TaskRow) -> str:
        """What a working task's call waits on, read from its run: never an id, a command,
        the database or the configuration (the seed's rule for what the model reads)."""
        open_row = self.proxy.index.open_row(row.key) if row.key else None
        run = self.store.find_run(open_row.run_id) if open_row is not None else None
        return TASK_WAITING if run is not None and run.status == WAITING else TASK_WORKING

    @staticmethod
    def answer_of(row: TaskRow) -> dict:
        return parse_json(row.answer.encode("utf-8"))

    def follow(self, row: TaskRow, value: Any = NOT_PARSED,
               first: "asyncio.Future | None" = None) -> None:
        """Follow a task here: ``first``, the call's outcome already under way, if any."""
        stop = _TaskCancel(self, row.id)
        task = asyncio.ensure_future(self._follow(row, value, first, stop))
        self.following[row.id] = (task, stop)
        task.add_done_callback(lambda _: self.following.pop(row.id, None))

    async def _follow(self, row: TaskRow, value: Any, first, stop: _TaskCancel) -> None:
        proxy, look = self.proxy, TASK_LOOK
        while first is not None or not (stop.is_set() or proxy.stopping.is_set()):
            try:
                action = await (first if first is not None else proxy.outcome(
                    row.tool, row.args, None, stop, value, TASK_HOLD))
            except Exception as exc:          # an answer is owed even when something broke
                action = Answer(broken_answer(proxy.log, exc))
            first, result = None, self.final(row, action)
            if result is not None:
                self.record(row, result)
                return
            try:
                current = self.get(row.id)
            except StoreError:
                current = row                 # looked at again after the next hold
            if current is None:
                return                        # past its ttl: what it waits on expires alone
            if current.cancelled or stop.here:
                # A cancel that came while the call was being begun withdraws what it began.
                self.withdraw(row)
                return
            if current.answer is not None or proxy.stopping.is_set() or \
                    current.follower != self.follower:
                return                        # answered, or the next proxy to start follows it
            if isinstance(action, Answer):    # executing elsewhere, or the store failed
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proxy.stopping.wait(), look)
                look = min(2 * look, TASK_LOOK_MAX)

    def final(self, row: TaskRow, action: "Answer | Pending") -> dict | None:
        """The task's answer, or None while its call still waits: for an approval the policy
        asked, for the operator's question about an attempt made before the task (the task
        is that question), or for a call that IN_PROGRESS or UNAVAILABLE says to try again.
        A question about an attempt the task itself made (cut off, its proxy killed) ends
        the task with the identical call's answer: the question is another task's."""
        if isinstance(action, Answer):
            return None if answer_prefix(action.result) in ("IN_PROGRESS", "UNAVAILABLE") \
                else action.result
        attempt = asked_attempt(action.approval, self.store._read)
        try:
            own = attempt is not None and parse_time(attempt.get("started_at")) >= row.created
        except (ValueError, TypeError, AttributeError, OverflowError):
            own = False                       # an edited record: the task waits on it
        return self.proxy.hold.pending_answer(action.approval) if own else None

    def record(self, row: TaskRow, result: dict) -> None:
        """The call's answer, the task's: the first one recorded stands."""
        try:
            with self.store.tx() as tx:
                tx.exec("UPDATE proxy_tasks SET answer=?, updated_at=? WHERE task_id=? AND "
                        "answer IS NULL", (dump_json(result), self.proxy.clock(), row.id))
        except StoreError as exc:
            self.proxy.log(f"error: a task's answer was not recorded: {exc}")

    def open_rows(self) -> list[TaskRow]:
        """The session's tasks with no answer, not cancelled and within their ttl, newest
        first."""
        now = self.proxy.clock()
        return [row for row in map(TaskRow._make, self.store._read(
            _OPEN_TASKS_SQL, (self.session, MAX_OPEN_TASKS))) if not _task_expired(row, now)]

    def open_lines(self) -> list[str]:
        """The status tool's lines: each open task's tool and what its call waits on (not
        its id: an id is the host's to read the task with)."""
        return [f"{clean(row.tool, TOOL_NAME_SHOWN)}, working since "
                f"{fmt_time_s(row.created)}: {self.waiting_on(row)}" for row in self.open_rows()]

    def take_over_gone(self) -> None:
        """At start: tasks past their ttl are forgotten, and each open task of this session
        whose proxy is gone is followed from here, claimed first so that two starting
        proxies never both do."""
        with self.store.tx() as tx:
            self._forget_expired(tx, self.proxy.clock())
        for row in self.open_rows():
            if not _follower_gone(self.store.path, row.follower):
                continue
            with self.store.tx() as tx:
                claimed = tx.exec("UPDATE proxy_tasks SET follower=? WHERE task_id=? AND "
                                  "follower=?", (self.follower, row.id, row.follower))
            if claimed.rowcount == 1:
                self.follow(row._replace(follower=self.follower))


async def start_task(host: HostServer, msg: Message, modern: bool, name: str, args: bytes,
                     value: Any, began: float, first: "asyncio.Future | None" = None) -> None:
    """Answer a call with a new task, recorded first, and follow it: ``first``, the
    call's outcome already under way (2026-07-28), else the call from its start. The
    arguments are made the gate's record of them as a call's are (host_arguments, on a
    worker thread when they are long)."""
    args, key, value = await host.proxy._offload(len(args), host_arguments, name, args, value)
    row = host.proxy.tasks.create(name, args, key, began)
    task = host.proxy.tasks.doc(row, modern)
    host.reply(msg, {"resultType": "task", **task} if modern else {"task": task}, modern)
    host.proxy.tasks.follow(row, value, first)


def task_request(host: HostServer, msg: Message, modern: bool) -> None:
    """tasks/get, tasks/cancel, and tasks/result (2025-11-25) or tasks/update
    (2026-07-28), for a task of this session: any process's."""
    if modern and not declares_tasks(msg):
        raise ProtocolError(f"{msg.method} needs the {TASKS_EXTENSION} extension declared "
                            "in the request's client capabilities", MISSING_CAPABILITY,
                            {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}})
    tasks = host.proxy.tasks
    row = tasks.get(msg.params.get("taskId"))
    if row is None:
        raise ProtocolError("no such task", INVALID_PARAMS)
    if msg.method == "tasks/cancel":
        if not tasks.cancel(row) and not modern:
            raise ProtocolError("the task has ended: it cannot be cancelled",
                                INVALID_PARAMS)
        host.reply(msg, {} if modern else tasks.doc(row._replace(
            cancelled=1, updated=host.proxy.clock()), False), modern)
    elif msg.method == "tasks/result":
        key, event = _id_key(msg.raw("id")), asyncio.Event()
        waiter = asyncio.ensure_future(task_result(host, msg, row, event))
        host.inflight[waiter] = (key, event)
        waiter.add_done_callback(host.inflight.pop)
    else:
        host.reply(msg, tasks.doc(row, modern) if msg.method == "tasks/get" else {}, modern)


async def task_result(host: HostServer, msg: Message, row: TaskRow,
                      cancelled: asyncio.Event) -> None:
    """2025-11-25's tasks/result: the call's answer once the task has one, waited for
    until then, but never past the task's ttl, and answered at once when the proxy
    stops; a host's cancel of this request ends the wait unanswered."""
    try:
        await _task_result(host, msg, row, cancelled)
    except Exception as exc:              # an edited answer, a fault of ours: still answered
        host.failed(msg, exc)


async def _task_result(host: HostServer, msg: Message, row: TaskRow,
                       cancelled: asyncio.Event) -> None:
    stopping, tasks = host.proxy.stopping, host.proxy.tasks
    until = float("inf") if row.ttl is None else row.created + row.ttl
    while not cancelled.is_set():
        try:
            row = tasks.get(row.id) or row
        except StoreError:
            pass                          # looked at again at the next poll
        if row.cancelled:
            error = "the task was cancelled: it has no result"
        elif row.answer is not None:
            host.reply(msg, {**tasks.answer_of(row),
                             "_meta": {META_RELATED_TASK: {"taskId": row.id}}}, False)
            return
        elif stopping.is_set():
            error = "the proxy is shutting down: ask for this task's result again"
        elif host.proxy.clock() > until:
            error = "the task's ttl ran out before its call had an answer"
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), APPROVAL_POLL)
            continue
        host.write(rpc_error(msg.id_value(), INVALID_PARAMS, error))
        return


# ==== 24. Serving, pinning and checking ====
# Loading every server as serving does (all at once, each under its connect timeout); serve,
# pin (with the reach check first and a diff of what changed), and check (what each tool
# gets).

async def load_tools(cfg: Config, emit: Callable[[str], None] | None = None,
                     ) -> tuple[list[UpstreamTool], list[Report]]:
    """Load every server as serving does; with ``emit``, every report line is handed to it,
    after a server's failure too.

    Every server is connected, listed and built at once, so start-up takes as long as the
    slowest server, not the sum. The results are taken in configuration order: the reports,
    the names registered and the error a failure gives are those of loading the servers one
    after another. After a failure the servers later in the order are stopped, and every
    server opened is closed."""
    loads = [asyncio.create_task(_load_one(server, cfg.path)) for server in cfg.servers]
    tools, reports, owners = [], [], {}      # owners: each name's server
    failure: MCPError | None = None
    try:
        for server, load in zip(cfg.servers, loads):
            got, report = await load
            reports.append(report)
            tools += got
            for tool in got:            # each name the model sees belongs to one tool
                if tool.spec.name == cfg.status_tool:
                    raise MCPError(
                        f"server {_quote(server.name)}: tool {_quote(tool.remote)} registers "
                        f"as {_quote(tool.spec.name)}, which is the status tool's name: "
                        "rename one, through status_tool or the rule's rename")
                if tool.spec.name in owners:
                    raise MCPError(f"server {_quote(server.name)}: the name "
                                   f"{_quote(tool.spec.name)} is already registered by another "
                                   f"server, {_quote(owners[tool.spec.name])}")
                owners[tool.spec.name] = server.name
    except BaseException as exc:
        for load in loads:
            load.cancel()
        done = await asyncio.gather(*loads, return_exceptions=True)
        await close_tools([t for result in done if isinstance(result, tuple)
                           for t in result[0]])
        if not isinstance(exc, MCPError):
            raise
        failure = exc
        if exc.report is not None:      # the failing server's, as far as it got
            reports.append(exc.report)
    for line in [line for report in reports for line in report.lines()] if emit else []:
        emit(line)
    if failure is not None:
        raise failure
    return tools, reports


def check_rules_pinned(server: ServerConfig, pinned: dict[str, PinnedTool]) -> None:
    """Every tool the server's rules name is in its manifest."""
    unknown = sorted(set(server.rule_map) - set(pinned))
    if unknown:
        raise MCPError(f"mcp: server {_quote(server.name)}: rules name tools the manifest "
                       f"does not pin: {', '.join(unknown)}")


async def _load_one(server: ServerConfig, config_path: str,
                    ) -> tuple[list[UpstreamTool], Report]:
    """Load the server against its manifest, which must exist and parse."""
    pinned, unread = previous_pin(server)
    if unread:
        raise MCPError(f"server {_quote(server.name)}: manifest: {unread}")
    if pinned is None:
        raise MCPError(f"server {_quote(server.name)}: manifest {server.manifest} does not "
                       f"exist: run {_self_command()} pin -config {config_path or 'CONFIG'}")
    return await load_server(server, pinned)


async def close_tools(tools: list[UpstreamTool]) -> None:
    """Close every server the tools came from, all at once: each close may wait out a
    server that does not exit (CLOSE_WAIT per step), and one such server must not hold up
    the others."""
    conns = {id(t.conn): t.conn for t in tools}.values()
    await asyncio.gather(*(conn.close() for conn in conns), return_exceptions=True)


def _hints_text(ann: dict | None) -> str:
    if ann is None:
        return "no annotations"
    flags = [hint[:-len("Hint")] for hint in _MCP_HINTS if ann.get(hint) is True]
    return ",".join(flags) or "claims nothing"


async def cmd_pin(cfg: Config, out: Out) -> int:
    check_reach(cfg)                    # before any server starts, as serving does
    for server in cfg.servers:
        manifest = await pin_server(server, time.time())
        before = previous_pin(server)
        write_manifest(server.manifest, manifest)
        tools = manifest["tools"]
        out.line(f"{sanitize(server.name)}: {len(tools)} tools pinned to "
                 f"{sanitize(server.manifest)}; the hints below are the server's own and "
                 "classify nothing")
        for name, entry in tools.items():
            desc = clean(" ".join(entry["description"].split()), PIN_DESCRIPTION_BYTES)
            out.line(f"  {sanitize(name):<{PIN_NAME_WIDTH}} "
                     f"{_hints_text(entry.get('annotations')):<{PIN_HINTS_WIDTH}} {desc}")
        out.texts(pin_changes(before, tools))
    out.line(f"classify the tools in the configuration's rules, then run: "
             f"{_self_command()} check -config {cfg.path}")
    return 0


# -- what a new pin changed: the operator reads it before trusting the new manifest --
# A description is model input and a schema is what the gate checks, so a change to either is
# shown line by line. Everything printed came from a server and is sanitised; each tool's
# diff is capped, so a hostile server cannot bury the rest of the output.

PIN_DIFF_LINES = 200                 # diff lines shown per tool and field
PIN_WRAP_WIDTH = 88                  # a description is wrapped to this width before diffing


def previous_pin(server: ServerConfig) -> tuple[dict[str, PinnedTool] | None, str]:
    """The manifest a pin replaces, or None with why it is not there or not readable."""
    if not os.path.lexists(server.manifest):
        return None, ""
    try:
        return read_manifest(server.manifest, server.name), ""
    except ConfigError as exc:
        return None, str(exc)


def pin_changes(before: tuple[dict[str, PinnedTool] | None, str], tools: dict) -> list[str]:
    """Lines saying what changed between the replaced manifest and the new one's tools."""
    old, unread = before
    if old is None:
        return [f"  the manifest it replaces could not be read: {sanitize(unread)}"] \
            if unread else ["  first pin: no manifest replaced"]
    lines = [f"  added    {sanitize(n)}" for n in sorted(set(tools) - set(old))]
    lines += [f"  removed  {sanitize(n)}" for n in sorted(set(old) - set(tools))]
    for name in sorted(set(tools) & set(old)):
        entry, pin = tools[name], old[name]
        if not same_digest(entry["description_hash"], pin.description_hash):
            lines.append(f"  changed  {sanitize(name)}: description")
            lines += _diff_lines(_wrapped(pin.description), _wrapped(entry["description"]))
        if not same_digest(entry["schema_hash"], pin.schema_hash):
            lines.append(f"  changed  {sanitize(name)}: input schema")
            lines += _diff_lines(_schema_lines(pin.schema),
                                 _schema_lines(entry["input_schema"].data))
        was, now = _hints_text(pin.annotations), _hints_text(entry.get("annotations"))
        if was != now:
            lines.append(f"  changed  {sanitize(name)}: hints {was} -> {now}")
    if not lines:
        return ["  no change since the manifest it replaces"]
    return ["  changes since the manifest it replaces:"] + lines


def _wrapped(text: str) -> list[str]:
    import textwrap                  # imported here: only pin needs it
    return [line for para in text.split("\n")
            for line in textwrap.wrap(para, PIN_WRAP_WIDTH) or [""]]


def _schema_lines(raw: bytes) -> list[str]:
    try:
        return _pretty(parse_json(raw, strict=False, max_depth=RECORD_DEPTH),
                       cut=False).split("\n")
    except JSONError:
        return [raw.decode("utf-8", "replace")]


def _diff_lines(old: list[str], new: list[str]) -> list[str]:
    """A unified diff of two texts, indented, sanitised and capped."""
    import difflib                   # imported here: only pin needs it
    body = [line.rstrip("\n") for line in
            difflib.unified_diff(old, new, "pinned", "now", n=1, lineterm="")][2:]
    shown = ["      " + sanitize(line) for line in body[:PIN_DIFF_LINES]]
    if len(body) > PIN_DIFF_LINES:
        shown.append(f"      ... {len(body) - PIN_DIFF_LINES} more lines")
    return shown


async def cmd_check(cfg: Config, out: Out, strict: bool = False) -> int:
    """What each server offers and what the policy makes of it, with a line for each tool no
    call to which can run saying how to stop offering it, ending with a summary that names
    every tool a rule classifies but that is refused, and every tool no call to which can
    run. With ``strict`` a refused tool fails the check; one that never runs does not."""
    check_database_file(cfg.database, writer=True)
    check_reach(cfg)
    tools, reports = await load_tools(cfg, out.line)
    try:
        store = Store.open(cfg.database)
        try:
            check_database_file(cfg.database, writer=True)
            CallIndex(store, cfg.session).migrate(time.time())
        finally:
            store.close()
        policy = ProxyPolicy(cfg.policy_map, {t.spec.name: t for t in tools})
        rows, lines = [], []
        for tool in tools:
            # Each offered tool, its class, and what the configuration's policy makes of a
            # call to it. A tool that changes something and is allowed only because no policy
            # or rule said otherwise is marked: that is a default the operator never chose.
            outcome, _ = policy.decide(tool)
            cls = tool.spec.side_effect
            why = ("by its rule" if tool.rule.outcome else
                   "by the policy" if cls in cfg.policy_given else "by the default policy")
            note = "  (a mutating tool allowed by default: set policy or outcome to change it)" \
                if outcome == "allow" and cls != "read_only" and why == "by the default policy" \
                else ""
            rows.append([tool.spec.name, cls, f"-> {outcome}", why + note])
            if policy.never_runs(tool):       # offered, yet every call the model makes is lost
                lines.append(f"{sanitize(tool.spec.name)}: denied on every call: remove its "
                             "rule to stop offering it")
            lines += rule_lines(tool, outcome)
        lines += [f"status tool: {sanitize(cfg.status_tool)}", f"session: {sanitize(cfg.session)}",
                  f"database: {sanitize(cfg.database)}"]
        for line in _table(rows) + lines + check_summary(tools, reports, policy):
            out.line(line)
    finally:
        await close_tools(tools)
    return 1 if strict and any(r.refused for r in reports) else 0


def check_summary(tools: list[UpstreamTool], reports: list[Report], policy: "ProxyPolicy",
                  ) -> list[str]:
    """check's last lines: the counts, then each refusal a rule met and each tool every
    call to which is denied, so that none hides among the lines above."""
    refused = [(r.server, t, why) for r in reports for t, why in r.refused]
    never = [t for t in tools if policy.never_runs(t)]
    unclassified = sum(len(r.unclassified) for r in reports)
    out = [f"summary: {len(tools)} tool(s) offered ({len(never)} of them denied on every "
           f"call), {len(refused)} classified by a rule but refused, {unclassified} "
           "unclassified (no rule)"]
    s = sanitize
    out += [f"REFUSED {s(server)}: {s(tool)}: {s(why)}" for server, tool, why in refused]
    for t in never:
        by = "its rule" if t.rule.outcome == "deny" else \
            f"its class {t.spec.side_effect}, which the policy denies"
        out.append(f"DENIED ON EVERY CALL {s(t.spec.name)}: by {by}")
    return out


async def cmd_serve(cfg: Config, out: Out, stdin, stdout) -> int:
    """Serve the host on stdin and stdout until EOF or a signal. The host is read from the
    start: the handshake is answered while the servers load, and the requests for tools
    wait for loading (section 23). A signal during start-up ends it as cleanly as one while
    serving; a failure to start answers each waiting request with an error, then fails as
    it would have before anything was read. The checks before any server starts are the
    caller's: _serve makes them (check_database_file, check_reach) before it calls this."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    writer = LineWriter(stdout, lambda: loop.call_soon_threadsafe(stop.set))
    host = HostServer(None, writer.write, out.log)
    lines = LineReader(stdin, loop)
    ended = asyncio.Event()              # the host closed its input

    async def feed() -> None:
        line = await lines.next()
        while line is not None:
            if line.strip():
                await host.take(line)
            await host.room(writer.queue.qsize)
            line = await lines.next()
        ended.set()
    reader = asyncio.create_task(feed())
    started, refusal = None, START_FAILED
    try:
        started = await _start_serving(cfg, out, stop)
        refusal = STOPPED_LOADING        # None: a signal while connecting
    finally:
        if started is None:              # failed or stopped: nothing to finish
            host.refuse(refusal)
            reader.cancel()
            await asyncio.to_thread(writer.drain, WRITE_DRAIN)
    if started is None:
        out.log("stopped before serving")
        return 0
    tools, store, proxy = started
    writer.before = store.sync
    out.log(f"serving session {sanitize(cfg.session)} with database {sanitize(cfg.database)}")
    host.ready(proxy)
    drift = DriftWatch(cfg, proxy, tools, out.log, host.tools_changed)
    try:
        await _first_of(stop, ended)
        await host.shutdown()
        await asyncio.to_thread(writer.drain, WRITE_DRAIN)
    finally:
        await drift.close()
        reader.cancel()
        await close_tools(tools)
        proxy.close()
        store.close()
    if writer.failed is not None:
        out.log(f"error: {sanitize(str(writer.failed))}")
        return 1
    return 0


async def _start_serving(cfg: Config, out: Out, stop: asyncio.Event,
                         ) -> tuple[list[UpstreamTool], Store, Proxy] | None:
    """Load the servers, open the store, build the proxy; None when ``stop`` came first
    (then nothing is left open). On a failure, what was opened is closed.

    A database that exists is opened on a worker thread while the servers start, since
    the loop only waits for them meanwhile; a failure to load them still comes first, and
    the store opened beside it is closed. A database that does not exist yet is created
    only once the servers have loaded, so that a start that fails creates nothing."""
    loading = asyncio.create_task(load_tools(cfg, out.log))
    opening = (asyncio.ensure_future(asyncio.to_thread(Store.open, cfg.database))
               if os.path.lexists(cfg.database) else None)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not loading.done():
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            await _close_opened(opening)
            return None
        tools, _ = loading.result()
    except BaseException:
        await _close_opened(opening)
        raise
    store = None
    try:
        store = (Store.open(cfg.database) if opening is None
                 else await asyncio.shield(opening))
        check_database_file(cfg.database, writer=True)
        proxy = Proxy(cfg, store, tools, out.log)
        await proxy.take_over_gone()
    except BaseException:
        if store is None and opening is not None:   # done or not: a store it opened is closed
            opening.add_done_callback(_close_result)
        await close_tools(tools)
        if store is not None:
            store.close()
        raise
    return tools, store, proxy


async def _close_opened(opening: "asyncio.Future[Store] | None") -> None:
    """Close the store a worker thread opened beside a start that is not going on. Its
    thread cannot be stopped, so it is waited for; if this wait is cancelled too, the
    store is closed when the thread has opened it."""
    if opening is not None:
        opening.add_done_callback(_close_result)
        await asyncio.wait({opening})


def _close_result(opened: "asyncio.Future[Store]") -> None:
    if not opened.cancelled() and opened.exception() is None:
        opened.result().close()


async def _first_of(*events: asyncio.Event) -> None:
    """Wait until one of the events is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _fileno(stream) -> int:
    """The stream's descriptor, or -1 when it has none (a test's in-memory stream)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return -1


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``, waiting for room (this thread may wait): the descriptor may
    be non-blocking, set so by the host or another holder of it."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except (BlockingIOError, InterruptedError):
            select.select([], [fd], [], WRITE_ROOM_POLL)


class LineWriter:
    """Messages to the host, written in order by a daemon thread of their own, so that a
    host that stops reading never blocks the event loop (nor, with it, the handling of a
    signal); the host's input is read no further while MAX_OUTPUT_BACKLOG of them wait
    (HostServer.room). A write that fails means the host is gone: ``gone`` is called and
    later messages are dropped; so does a failed sync of the store (Store.sync), which
    runs before each write, so that no answer rests on a commit not on disk; it is kept in
    ``failed`` for serving to report."""

    def __init__(self, stream, gone: Callable[[], None]):
        self.stream, self.gone = stream, gone
        self.before: Callable[[], None] = lambda: None     # Store.sync, once it is open
        self.queue: queue.Queue = queue.Queue()
        self.broken = False
        self.failed: StoreError | None = None
        threading.Thread(target=self._run, daemon=True, name="agentrt-proxy-stdout").start()

    def write(self, data: bytes) -> None:
        self.queue.put(data)

    def _run(self) -> None:
        fd = _fileno(self.stream)
        while True:
            data = self.queue.get()
            try:
                if not self.broken:
                    self.before()      # the commits this message may rest on, synced first
                    if fd < 0:
                        self.stream.write(data)
                        self.stream.flush()
                    else:
                        _write_all(fd, data)
            except (OSError, ValueError, StoreError) as exc:
                self.broken = True
                self.failed = exc if isinstance(exc, StoreError) else None
                self.gone()
            finally:
                self.queue.task_done()

    def drain(self, timeout: float) -> bool:
        """Wait, at most ``timeout``, until every message is written."""
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL)
        return not self.queue.unfinished_tasks


class LineReader:
    """Lines of the host's input, read by a daemon thread of their own, so that a signal can
    end serving while a read is blocked. The descriptor is read directly: a thread blocked
    inside a buffered reader would hold its lock when the interpreter shuts down.

    Lines read but not yet taken are bounded: past READ_AHEAD_BYTES the thread reads no
    more until some are taken, so a host that writes faster than the proxy serves waits,
    instead of the proxy holding its input without bound. Each line counts
    READ_AHEAD_LINE_COST beyond its bytes, what holding it costs, so that a flood of empty
    lines is bounded as a long one is."""

    def __init__(self, stream, loop: asyncio.AbstractEventLoop):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stream, self.loop = stream, loop
        self._ahead = 0
        self._room = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="agentrt-proxy-stdin").start()

    def _run(self) -> None:
        # Only each new chunk is searched for line ends, and a long line is joined once, so
        # that cutting costs the same per byte however long the host's lines are. A line
        # longer than MAX_FRAME is passed on cut (it then fails to parse and is answered so);
        # the rest of it is skipped.
        fd = _fileno(self.stream)
        parts, size, skipping = [], 0, False        # the line being read, and its length
        with contextlib.suppress(OSError, ValueError):      # the input is gone: its end
            while True:
                chunk = (os.read(fd, READ_CHUNK) if fd >= 0
                         else self.stream.readline(READ_CHUNK))
                if not chunk:
                    break
                *ended, tail = chunk.split(b"\n")
                for line in ended:
                    if not skipping:
                        self._put(b"".join(parts) + line + b"\n")
                    parts, size, skipping = [], 0, False
                if tail and not skipping:
                    parts.append(tail)
                    size += len(tail)
                    if size > MAX_FRAME:
                        self._put(b"".join(parts)[:MAX_FRAME + 1])
                        parts, size, skipping = [], 0, True
            if parts and not skipping:      # the end of the input: a last line without its end
                self._put(b"".join(parts))
        self._put(None)

    def _put(self, item: bytes | None) -> None:
        if item is not None:
            with self._room:
                self._room.wait_for(lambda: self._ahead <= READ_AHEAD_BYTES)
                self._ahead += len(item) + READ_AHEAD_LINE_COST
        with contextlib.suppress(RuntimeError):     # the loop is closed: serving ended
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def next(self) -> bytes | None:
        item = await self.queue.get()
        if item is not None:
            with self._room:
                self._ahead -= len(item) + READ_AHEAD_LINE_COST
                self._room.notify()
        return item


# ==== 24.1 wrap: from a host's configuration to a gated one ====
# The host's file is read as the proxy reads its own (owned by this user, strict JSON: a
# repeated key or a comment is refused). Each server entry is translated field by field; an
# entry holding a field or a host variable the proxy cannot express is left out and named,
# never half translated. The proxy configuration is written new (0600), checked for reach
# before anything is written or started, then every server is pinned. Nothing is classified:
# the rules are printed as suggestions read from the server's own hints, which are claims,
# for the operator to paste. A tool the policy would deny on every call is suggested no rule,
# since one would only offer the model a tool it cannot use; it is listed as left out, with
# the rule that offers it. The host's file is rewritten only with -write, after a backup,
# and only while its bytes are still those that were read (an editor saving in between would
# otherwise lose its change, or the proxy would overwrite servers it never saw).

WRAP_HOSTS = ("claude", "vscode", "cursor")
WRAP_ENTRY = "gated"                   # the host's name for the proxy's own entry
WRAP_DATABASE = "proxy.db"             # beside the written configuration
WRAP_BACKUP = ".bak-%Y%m%d-%H%M%S"     # the backup's suffix, local time
WRAP_NAME_LEN = 32                     # a server's name, so that <name>_<tool> fits 64
_HOST_SERVERS = {"claude": "mcpServers", "cursor": "mcpServers", "vscode": "servers"}
_HOST_FIELDS = ("type", "command", "args", "env", "url")
_HOST_FIELD_WHY = {
    "headers": "the proxy sends no headers of its own to an HTTP server",
    "envFile": "the proxy reads no environment file: name the variables in env",
    "cwd": "a stdio server starts in the proxy configuration's directory",
}
_HOST_VARIABLE = re.compile(r"\$\{([^}]*)\}")
_WRAP_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MCP_HINTS = {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False,
              "openWorldHint": True}        # each hint with MCP's default when it is missing
WRAP_NO_WINDOW = "0s"                  # the repeat_window suggested for an idempotent tool
WRAP_OFFER_OUTCOME = "require_approval"  # in the rule that offers a tool wrap left out


# One entry of the host's servers: the proxy's server entry, or None and why there is none.
WrappedEntry = collections.namedtuple("WrappedEntry", "key server why", defaults=("",))


def host_config_paths(host: str, platform: str = sys.platform, environ=None,
                      home: str = "", cwd: str = "") -> list[str]:
    """Where the host keeps its servers, the project's file first where there is one."""
    environ = os.environ if environ is None else environ
    home = home or os.path.expanduser("~")
    cwd = cwd or os.getcwd()
    if platform == "darwin":
        user = os.path.join(home, "Library", "Application Support")
    elif platform.startswith("win"):
        user = environ.get("APPDATA") or os.path.join(home, "AppData", "Roaming")
    else:
        user = environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return {"claude": [os.path.join(user, "Claude", "claude_desktop_config.json")],
            "vscode": [os.path.join(cwd, ".vscode", "mcp.json"),
                       os.path.join(user, "Code", "User", "mcp.json")],
            "cursor": [os.path.join(cwd, ".cursor", "mcp.json"),
                       os.path.join(home, ".cursor", "mcp.json")]}[host]


def read_host_config(host: str, given: str | None) -> tuple[str, bytes, dict]:
    """The file named, or else the first of the host's that exists: its path, its bytes,
    and the document they hold, which keeps the host's servers."""
    paths = [os.path.abspath(given)] if given else host_config_paths(host)
    path = next((p for p in paths if given or os.path.lexists(p)), "")
    if not path:
        raise ConfigError(f"no {host} configuration at {' or '.join(paths)}: name it with "
                          "-host-config PATH")
    raw = read_owned(path)
    try:
        doc = parse_json(raw)
    except JSONError as exc:
        raise ConfigError(f"{path}: not plain JSON ({exc}); comments and trailing commas "
                          "are not read: remove them, or wrap a copy without them") from None
    key = _HOST_SERVERS[host]
    if not isinstance(doc, dict) or not isinstance(doc.get(key), dict) or not doc[key]:
        raise ConfigError(f"{path}: no servers: a {host} configuration keeps them in an "
                          f"object named {_quote(key)}")
    return path, raw, doc


def translate_host(host: str, path: str, doc: dict) -> list[WrappedEntry]:
    """Every server entry of the host's file, translated or with why it is not."""
    found, names = [], set()
    # The host's ${...} variables whose value is known here: VS Code's workspace folder for
    # a workspace's .vscode/mcp.json, and the user's home.
    variables = {"userHome": os.path.expanduser("~")}
    parent = os.path.dirname(path)
    if host == "vscode" and os.path.basename(parent) == ".vscode":
        variables["workspaceFolder"] = os.path.dirname(parent)
    for key, entry in doc[_HOST_SERVERS[host]].items():
        try:
            server = _translate_entry(entry, variables)
        except ConfigError as exc:
            found.append(WrappedEntry(key, None, str(exc)))
            continue
        # The host's name as a proxy server name: letters, digits, _ and - only, short enough
        # that its tools' names fit, and not one already taken.
        name = _unused_name(_WRAP_UNSAFE.sub("_", key)[:WRAP_NAME_LEN] or "server", names)
        names.add(name)
        found.append(WrappedEntry(key, {"name": name, **server}))
    return found


def _translate_entry(entry: Any, variables: dict[str, str]) -> dict:
    if not isinstance(entry, dict):
        raise ConfigError("the entry is not an object")
    for field in entry:
        if field not in _HOST_FIELDS:
            why = _HOST_FIELD_WHY.get(field, "the proxy's configuration has no such field")
            raise ConfigError(f"field {_quote(field)}: {why}")
    kind = entry.get("type", "http" if "url" in entry else "stdio")
    if kind not in ("stdio", "http"):
        raise ConfigError(f"type {_quote(str(kind))}: the proxy reaches a server over stdio "
                          "or streamable HTTP only")
    if ("command" in entry) == ("url" in entry) or (kind == "http") != ("url" in entry):
        raise ConfigError("it needs a command (stdio) or a url (http), not both")
    if kind == "http":
        url = _host_text(entry["url"], "url", variables)
        if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
            raise ConfigError(f"url {_quote(url)} is not an http or https URL")
        return {"endpoint": url}
    command = [_host_text(entry["command"], "command", variables)]
    args = entry.get("args", [])
    if not isinstance(args, list):
        raise ConfigError("args is not an array")
    command += [_host_text(arg, f"args[{i}]", variables) for i, arg in enumerate(args)]
    if not command[0]:
        raise ConfigError("command is empty")
    env, inherit = _host_env(entry.get("env", {}), variables)
    given = {"command": command, "env": env, "inherit_env": inherit}
    return {field: value for field, value in given.items() if value}


def _host_text(value: Any, field: str, variables: dict[str, str]) -> str:
    """A string of the host's with its known variables put in; any other is refused."""
    if not isinstance(value, str):
        raise ConfigError(f"{field} is not a string")

    def known(match: re.Match) -> str:
        if match.group(1) not in variables:
            raise ConfigError(f"{field} holds {_quote(match.group())}, a variable of the "
                              "host's that the proxy does not expand")
        return variables[match.group(1)]
    return _HOST_VARIABLE.sub(known, value)


def _host_env(env: Any, variables: dict[str, str]) -> tuple[list[str], list[str]]:
    """NAME=value entries, and the names passed through: a value that is exactly
    ${env:NAME} of its own name is the proxy's own variable, handed on (inherit_env)."""
    if not isinstance(env, dict):
        raise ConfigError("env is not an object")
    entries, inherit = [], []
    for name, value in env.items():
        if not name or "=" in name:
            raise ConfigError(f"env: {_quote(name)} is not a variable name")
        if value == "${env:" + name + "}":
            inherit.append(name)
            continue
        entries.append(f"{name}={_host_text(value, f'env.{name}', variables)}")
    return entries, inherit


def _unused_name(base: str, taken: set[str] | dict[str, Any]) -> str:
    """``base``, or the first of base-2, base-3, ... not taken, cut to WRAP_NAME_LEN."""
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base[:WRAP_NAME_LEN - len(str(n)) - 1]}-{n}"
    return name


def suggest_class(ann: Any) -> tuple[str, str]:
    """The class a tool's hints suggest, read with MCP's defaults for a missing hint, and
    why. A hint is the server's claim: this is a suggestion, never applied."""
    hints = {hint: _hint(ann, hint, default) for hint, default in _MCP_HINTS.items()}

    def said(hint: str) -> str:
        shown = dump_json(hints[hint])
        return shown if _hint(ann, hint) is not None else f"missing (MCP's default: {shown})"
    if hints["readOnlyHint"]:
        return "read_only", "readOnlyHint is true"
    if hints["destructiveHint"]:
        return "destructive", "not read-only, and destructiveHint is " + said("destructiveHint")
    if not hints["openWorldHint"]:
        return "local_mutation", "not read-only, destructiveHint is false, openWorldHint is false"
    return "remote_mutation", ("not read-only, destructiveHint is false, openWorldHint is " +
                               said("openWorldHint"))


def _hint(ann: Any, hint: str, missing: Any = None) -> Any:
    """A hint as the server claims it, or ``missing`` where it claims none (the hint is
    absent, or not a boolean)."""
    value = ann.get(hint) if isinstance(ann, dict) else None
    return value if isinstance(value, bool) else missing


_STATEFUL_WORD = re.compile(r"(?:^|[^a-z])(?:commit|push|send|post)(?:s|es|ed|ing)?(?:[^a-z]|$)")


def suggests_repeat(name: str, description: Any) -> bool:
    """Whether a tool's name or description says commit, push, send or post: an effect that
    depends on state outside its arguments, so an identical call is often a new one, and its
    rule is suggested `"repeat": "ask"` (section 10)."""
    said = [name, description if isinstance(description, str) else ""]
    return any(_STATEFUL_WORD.search(re.sub(r"([a-z])([A-Z])", r"\1 \2", text).lower())
               for text in said)


def suggests_no_window(ann: Any) -> str:
    """Why a tool's rule is suggested `"repeat_window": "0s"`, or '' when it is not: a
    local_mutation whose server claims idempotentHint true (MCP's default: false) and
    destructiveHint false (default: true). Such a call repeated changes nothing more, yet the
    duplicate rule refuses it: an edit, add and commit loop's second git_add was DUPLICATE
    and staged nothing. The window also holds the seed's rule 4, so the text says that goes
    too; both rest on hints, which the operator reads as claims. (A local_mutation is
    suggested only where destructiveHint is false.)"""
    if suggest_class(ann)[0] != "local_mutation" or not _hint(ann, "idempotentHint"):
        return ""
    return (f'repeat_window "{WRAP_NO_WINDOW}": idempotentHint is true and destructiveHint '
            "is false, so an identical call runs again instead of answering DUPLICATE; this "
            "also turns off, for this tool, the refusal of an identical request rejected or "
            "expired within the window. Both hints are the server's claims: read them")


def suggested_rules(tools: dict, server: str = "", others: Iterable[str] = ()) -> dict[str, dict]:
    """One suggested rule per tool: the class its hints suggest, `"repeat_window": "0s"`
    where suggests_no_window says so, else `"repeat": "ask"` where suggests_repeat says so
    (with no window there is no repeat to ask about), and a `rename` that drops a doubled
    prefix (server `git`'s `git_commit` would register as `git_git_commit`) when no tool
    registers under that name: none of this server's, and none of ``others`` (the names the
    other servers' tools may register under). Each is the server's claim, never applied
    unasked; left_out names those a policy denies on every call."""
    taken = {f"{server}_{name}" for name in tools} | set(others)
    out: dict[str, dict] = {}
    for name, t in tools.items():
        rule: dict[str, Any] = {"side_effect": suggest_class(t.get("annotations"))[0]}
        if suggests_no_window(t.get("annotations")):
            rule["repeat_window"] = WRAP_NO_WINDOW
        elif rule["side_effect"] != "read_only" and \
                suggests_repeat(name, t.get("description")):
            rule["repeat"] = "ask"
        if server and name.startswith(server + "_") and name not in taken:
            rule["rename"] = name
        out[name] = rule
    return out


def left_out(rules: dict[str, dict], server: str, policy: "ProxyPolicy") -> dict[str, dict]:
    """The suggested rules whose tool ``policy`` denies on every call (ProxyPolicy.never_runs),
    each as the rule that offers it with every call asking. Written as suggested, such a rule
    would offer the model a tool it can never use, and it would waste its calls on it."""
    return {name: {**rule, "outcome": WRAP_OFFER_OUTCOME} for name, rule in rules.items()
            if policy.never_runs(rule_tool(server, name, _parse_rule(rule, f"rules.{name}")))}


def _rule_line(name: str, rule: dict) -> str:
    """One rule as a member of "rules", on one line, written inert: a tool name cannot drive
    the terminal that prints it."""
    members = ", ".join(f"{dump_json(k)}: {dump_json(v)}" for k, v in rule.items())
    return _JSON_INERT.sub(_json_escape, f"{dump_json(name)}: {{{members}}}")


def rules_block(rules: dict[str, dict]) -> list[str]:
    """Rules (suggested_rules') as the "rules" member to paste into a server's entry, one
    rule a line."""
    items = [f"    {_rule_line(name, rule)}" for name, rule in rules.items()]
    body = [line + ("," if i < len(items) - 1 else "") for i, line in enumerate(items)]
    return ['  "rules": {', *body, "  }"]


def hints_table(tools: dict) -> list[str]:
    rows = [["TOOL", "SUGGESTED", "readOnly", "destructive", "idempotent", "openWorld", "WHY"]]
    for name, t in tools.items():
        ann = t.get("annotations")
        cls, why = suggest_class(ann)
        window = suggests_no_window(ann)
        claimed = [_hint(ann, hint) for hint in _MCP_HINTS]
        rows.append([name, cls, *("-" if c is None else dump_json(c) for c in claimed),
                     why + ("; " + window if window else "")])
    return ["  " + line for line in _table(rows)]


def host_entry(host: str, config_path: str) -> dict:
    """The host's entry that starts the proxy, with absolute paths."""
    entry: dict[str, Any] = {"command": sys.executable or "python3",
                             "args": [os.path.abspath(__file__), "-config", config_path]}
    return {"type": "stdio", **entry} if host == "vscode" else entry


def write_new_owned(path: str, data: bytes) -> None:
    """Create a file owner-only; an existing one is never replaced."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def gated_host_doc(host: str, doc: dict, wrapped: Iterable[str], entry: dict) -> dict:
    """The host's document with the wrapped servers replaced by the one entry; other
    top-level keys and the servers not wrapped are kept as they are."""
    key = _HOST_SERVERS[host]
    kept = {k: v for k, v in doc[key].items() if k not in set(wrapped)}
    return {**doc, key: {_unused_name(WRAP_ENTRY, kept): entry, **kept}}


def write_host_config(path: str, read: bytes, doc: dict, now: float) -> str:
    """Replace the host's file with ``doc``, keeping a backup of the bytes ``read``; refused
    when the file no longer holds those bytes. Returns the backup's path."""
    _unchanged(path, read)
    backup = path + time.strftime(WRAP_BACKUP, time.localtime(now))
    try:
        write_new_owned(backup, read)
    except FileExistsError:
        raise ConfigError(f"{backup} exists: run wrap again in a second") from None
    replace_file(path, (_pretty(doc, cut=False) + "\n").encode("utf-8"), ".wrap-",
                 stat.S_IMODE(os.stat(path).st_mode), lambda: _unchanged(path, read))
    return backup


def _unchanged(path: str, read: bytes) -> None:
    if not same_digest(sha256_hex(read_owned(path)), sha256_hex(read)):
        raise ConfigError(f"{path} changed since wrap read it: it was not written")


async def cmd_wrap(args, out: Out) -> int:
    """Translate the host's servers and pin each, print the suggested rules and the host's
    entry. Without -write nothing is written: it shows what -write would write. With -write
    it writes the configuration (the suggested rules in it with -rules suggested), the
    manifests, and, once every server is pinned, the host's file."""
    host_path, raw, doc = read_host_config(args.host, args.host_config)
    found = translate_host(args.host, host_path, doc)
    servers = [f.server for f in found if f.server]
    if not servers:
        raise ConfigError(f"{host_path}: no server could be wrapped: " +
                          "; ".join(f"{f.key}: {f.why}" for f in found))
    config_path = os.path.abspath(args.config)
    if os.path.lexists(config_path):
        raise ConfigError(f"{config_path} exists: wrap writes a new configuration; name "
                          "another, or edit that one and run pin")
    top = {"database": WRAP_DATABASE, "session": args.host}
    cfg = parse_config(dump_json({**top, "servers": servers}).encode(), config_path)
    check_reach(cfg)                    # before anything is written or started
    out.line(f"read {sanitize(host_path)}: {len(servers)} server(s) to wrap" +
             ("" if args.write else "; nothing is written without -write"))
    for f in [f for f in found if f.server is None]:
        out.line(f"NOT WRAPPED {sanitize(f.key)}: {sanitize(f.why)}; the host still starts "
                 "it directly, outside the gate")
    pins, rules = await _wrap_pin(cfg, out)
    notify = suggested_on_pending(cfg.database)
    suggested, written = args.rules == "suggested", bool(args.write)
    if notify:
        out.line("a notification for this machine when an approval waits" +
                 (", written into the configuration:" if suggested else
                  ", to paste at the top level of the configuration:"))
        out.line(_JSON_INERT.sub(_json_escape, f'  "on_pending": {dump_json(notify)}'))
    if suggested:
        for server in [s for s in servers if s["name"] in rules]:
            server["rules"] = rules[server["name"]]
        if notify:
            top["on_pending"] = notify
    text = _pretty({**top, "servers": servers}, cut=False) + "\n"
    parse_config(text.encode("utf-8"), config_path)     # what is written loads as written
    if written:
        write_new_owned(config_path, text.encode("utf-8"))
        for server in [s for s in cfg.servers if s.name in pins]:
            write_manifest(server.manifest, pins[server.name])
        out.line(f"wrote {sanitize(config_path)} (0600) and {len(pins)} manifest(s)")
    else:
        out.line(f"-write would write {sanitize(config_path)} (0600):")
        out.line(_JSON_INERT.sub(_json_escape, text.rstrip("\n")))
    if suggested:
        out.line(f"{'it holds' if written else 'it would hold'} the suggested rules, as printed "
                 "above, for every pinned server: they are the servers' own claims; read each "
                 "before you trust it")
    else:
        out.line("it classifies no tool, so none is offered until you paste the rules (or "
                 "wrap again with -rules suggested)")
    entry = host_entry(args.host, config_path)
    out.line(f"the {args.host} entry that starts the proxy instead of the servers it wraps:")
    out.json({_HOST_SERVERS[args.host]: {WRAP_ENTRY: entry}})
    pinned_all = len(pins) == len(servers)
    if not written:
        out.line("nothing was written; run again with -write to write it")
        return 0 if pinned_all else 1
    if not pinned_all:
        out.line(f"{sanitize(host_path)} was not written: pin every server first")
    else:
        gated = gated_host_doc(args.host, doc, [f.key for f in found if f.server], entry)
        backup = write_host_config(host_path, raw, gated, time.time())
        kept = len(found) - len(servers)
        also = f", {kept} not wrapped kept as they were" if kept else ""
        out.line(f"wrote {sanitize(host_path)}: its {len(servers)} wrapped server(s) replaced "
                 f"by the gated entry{also}; the file as it was is {sanitize(backup)}")
    out.line(("read" if suggested else "paste") + " the rules, then run: "
             f"{_self_command()} check -config {sanitize(config_path)}")
    return 0 if pinned_all else 1


def suggested_on_pending(database: str) -> list[str]:
    """An on_pending argv for this machine's notifier, when one is on PATH: notify-send
    (Linux desktops), else osascript (macOS); [] when neither is."""
    notifiers = {"notify-send": ["agentrt-proxy", "an approval waits: run "
                                 f'{_self_command()} -db "{os.path.abspath(database)}" pending'],
                 "osascript": ["-e", 'display notification "an approval waits" with title '
                               '"agentrt-proxy"']}
    for name, args in notifiers.items():
        found = shutil.which(name)
        if found:
            return [os.path.abspath(found), *args]
    return []


async def _wrap_pin(cfg: Config, out: Out) -> tuple[dict[str, dict], dict[str, dict]]:
    """Pin every server (nothing written), then print each one's suggested rules, without
    those the configuration's policy denies on every call (listed as left out); the manifest
    of each server pinned, and the rules printed for it, by name."""
    policy = ProxyPolicy(cfg.policy_map, {})
    pins: dict[str, dict] = {}
    rules: dict[str, dict] = {}
    for server in cfg.servers:
        try:
            pins[server.name] = await pin_server(server, time.time())
        except (ProxyError, OSError) as exc:
            out.line(f"server {_quote(server.name)}: not pinned: {sanitize(str(exc))}; "
                     f"run pin once it starts")
    for server in [s for s in cfg.servers if s.name in pins]:
        tools = pins[server.name]["tools"]
        out.line(f"server {_quote(server.name)}: {len(tools)} tools, to be pinned to "
                 f"{sanitize(server.manifest)}. Suggested rules, from the server's own hints "
                 "(claims, not facts: check each):")
        everything = suggested_rules(tools, server.name, names_elsewhere(pins, server.name))
        dropped = left_out(everything, server.name, policy)
        rules[server.name] = {n: r for n, r in everything.items() if n not in dropped}
        for line in rules_block(rules[server.name]) + hints_table(tools):
            out.line(line)
        if dropped:
            out.line("  left out, so not offered: the policy denies each of these on every "
                     "call; to offer one, each call asking you, add its line to the server's "
                     "rules:")
        for name, rule in dropped.items():
            out.line(f"    {_rule_line(name, rule)}")
    return pins, rules


def names_elsewhere(pins: dict[str, dict], server: str) -> set[str]:
    """The names the other servers' tools may register under: their own, and their tool
    names as a suggested rename would give them."""
    return {n for other, manifest in pins.items() if other != server
            for tool in manifest["tools"] for n in (f"{other}_{tool}", tool)}


# ==== 25. Tools that change while serving ====
# A server may change its tools after the proxy loaded them: the rug pull that pinning
# exists to stop. On a server's notice (legacy notifications/tools/list_changed, unasked;
# 2026-07-28, on the subscriptions/listen the proxy opens when discover declared
# tools.listChanged), and whenever a server's manifest file is replaced (a pin), the proxy
# lists that server again, reads its manifest again, and offers exactly what loading would
# offer now: each tool passes _build against the manifest on disk and the live listing, the
# same hashes, so nothing is ever offered that is not pinned as the server now presents it.
# A tool that changed, and any new tool, is withheld until the operator pins again; a call
# to a withheld tool is DENIED at the door, nothing recorded or executed (an approval given
# before the change is not collected either). Unchanged tools go on; calls already running
# finish and are recorded. The operator is told (a stderr line, and on_pending with kind
# "drift"), the host is told its list changed. One server is listed at most once per
# DRIFT_RELIST_INTERVAL, the notices that arrive meanwhile coalesced into one listing, each
# under the server's connect_timeout and the page caps: a server that floods notices buys a
# bounded rate of listings and nothing else.

DRIFT_RELIST_INTERVAL = 1.0     # at least this long between two listings of one server
DRIFT_MANIFEST_POLL = 1.0       # how often a server's manifest file is looked at
DRIFT_RETRY = 30.0              # a listing that failed is tried again after this
DRIFT_CANCEL_AGAIN = 0.1        # closing: a watch still running is cancelled again after this
DRIFT_SHOWN = 50                # changed tools named in one notice; the rest are counted
DRIFT_NAME_BYTES = 128          # of a tool name a server chose, in a notice
DRIFT_NEW = "a new tool, not in the manifest"


def withheld_answer(why: str) -> dict:
    return prose("DENIED", f"this tool is not offered now: {clean(why, REASON_BYTES)}. It is "
                 "withheld until the operator pins its server's tools again. Nothing was "
                 "executed. Tell the user.", True)


def drift_of(pinned: dict[str, PinnedTool], live: dict[str, LiveTool]) -> dict[str, str]:
    """Each tool whose listing differs from its pin, by the hashes loading compares, and
    how: in name order."""
    out = {name: DRIFT_GONE if name in pinned else DRIFT_NEW for name in set(pinned) ^ set(live)}
    for name in set(pinned) & set(live):
        what = changed_since_pin(pinned[name], live[name])
        if what:
            out[name] = f"{' and '.join(what)} changed since the pin"
    return dict(sorted(out.items()))


def _manifest_stamp(path: str) -> tuple | None:
    """What tells a replaced manifest (pin writes a new file over it) from the one read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class DriftWatch:
    """One ServerWatch per server that registered tools, each a task of its own."""

    def __init__(self, cfg: Config, proxy: Proxy, tools: list[UpstreamTool],
                 log: Callable[[str], None], announce: Callable[[], None]):
        conns = {t.server: t.conn for t in tools}
        self.tasks = [asyncio.create_task(
            ServerWatch(cfg, s, conns[s.name], proxy, log, announce).run())
            for s in cfg.servers if s.name in conns]

    async def close(self) -> None:
        """Cancel the watches and wait for them, at most CLOSE_WAIT: a watch that took a
        cancel for something else (wait_for before Python 3.12 can) is cancelled again, and
        closing never waits on it without bound."""
        deadline = time.monotonic() + CLOSE_WAIT
        pending = {t for t in self.tasks if not t.done()}
        while pending and time.monotonic() < deadline:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=min(
                DRIFT_CANCEL_AGAIN, max(0.0, deadline - time.monotonic())))
        for task in self.tasks:          # what ended them is theirs: retrieved, not raised
            if task.done() and not task.cancelled():
                task.exception()


class ServerWatch:
    """Lists one server again when it says its tools changed or its manifest is replaced,
    at most once per DRIFT_RELIST_INTERVAL."""

    def __init__(self, cfg: Config, server: ServerConfig, conn: Upstream, proxy: Proxy,
                 log: Callable[[str], None], announce: Callable[[], None]):
        self.cfg, self.server, self.conn, self.proxy = cfg, server, conn, proxy
        self.log, self.announce = log, announce
        self.wake = asyncio.Event()
        self.last = time.monotonic()                 # loading listed it just now
        self.stamp = _manifest_stamp(server.manifest)
        self.told: tuple = ()                        # the drift the operator was told of
        self.failed = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.conn.on_tools_changed = lambda: loop.call_soon_threadsafe(self.wake.set)
        if self.conn.change_notices:                 # a notice since connecting
            self.wake.set()
        try:
            await self.conn.listen()
        except (ProxyError, OSError) as exc:
            self.log(f"drift: server {_quote(self.server.name)}: subscriptions/listen not "
                     f"sent: {sanitize(str(exc))}")
        while await self._cause():
            pause = self.last + DRIFT_RELIST_INTERVAL - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)           # the rate bound: notices coalesce
            self.wake.clear()
            self.last = time.monotonic()
            try:
                await self.relist()
            except Exception as exc:      # a fault of ours: withhold rather than go unchecked
                self._withhold_all(f"{type(exc).__name__}: {sanitize(str(exc))}")

    async def _cause(self) -> bool:
        """Wait for a notice, a replaced manifest, or the retry of a failed listing; False
        once the connection is closed (its tools fail as they always did: nothing is sent)."""
        while not self.conn.closed:
            try:
                await asyncio.wait_for(self.wake.wait(), DRIFT_MANIFEST_POLL)
                return not self.conn.closed
            except asyncio.TimeoutError:
                pass
            if _manifest_stamp(self.server.manifest) != self.stamp or \
                    (self.failed and time.monotonic() - self.last >= DRIFT_RETRY):
                return True
        return False

    async def relist(self) -> None:
        server, wait = self.server, self.server.connect_timeout
        self.stamp = _manifest_stamp(server.manifest)
        try:
            live_list = await asyncio.wait_for(self.conn.list_tools(time.monotonic() + wait), wait)
            pinned = read_manifest(server.manifest, server.name)
        except asyncio.TimeoutError:
            return self._withhold_all(f"timed out after {fmt_duration(wait)}")
        except (ProxyError, OSError) as exc:
            return self._withhold_all(sanitize(str(exc)))
        if self.failed:
            self.log(f"drift: server {_quote(server.name)}: listed again")
        self.failed = False
        live = {t.name: t for t in live_list}
        taken = {n: "" for n, t in self.proxy.tools.items() if t.server != server.name}
        built, refusals = register(server, pinned, live, self.conn,
                                   {**taken, self.cfg.status_tool: ""})
        changes = drift_of(pinned, live)
        # A tool offered before and refused now for what the hashes do not cover (the
        # server's hints now dispute its class) is drift too.
        self.tell([*changes.items(), *sorted((key, why) for key, name, why in refusals
                                             if name in self.proxy.order and key not in changes)])
        self.apply([tool for _, tool, _ in built], {name: why for _, name, why in refusals})

    def _withhold_all(self, why: str) -> None:
        self.log(f"drift: server {_quote(self.server.name)}: its tools could not be listed "
                 f"again, so none of them is offered until they are: {why}")
        self.failed, self.told = True, ()
        names = [n for n, t in self.proxy.tools.items() if t.server == self.server.name]
        names += [n for n, v in self.proxy.withheld.items() if v[0] == self.server.name]
        self.apply([], {n: f"its server's tools could not be listed again ({why})" for n in names})

    def tell(self, changes: list[tuple[str, str]]) -> None:
        """The operator hears of each new state of drift once: a flood of notices over one
        change is one notice."""
        key = tuple(changes)
        if key == self.told:
            return
        self.told, q = key, _quote(self.server.name)
        if not changes:
            self.log(f"drift: server {q}: its tools match the manifest again")
            return
        rules = self.server.rule_map
        shown = [{"tool": clean(t, DRIFT_NAME_BYTES),
                  "name": offered_name(self.server.name, t, rules[t]) if t in rules else "",
                  "why": sanitize(why)} for t, why in changes[:DRIFT_SHOWN]]
        more = len(changes) - len(shown)
        pin = f"{_self_command()} pin -config {self.cfg.path}"
        self.log(f"drift: server {q} changed its tools since the pin: " + "; ".join(
            f"{e['tool']}: {e['why']}" for e in shown) + (f"; and {more} more" if more else ""))
        self.log(f"  withheld until pinned again; pin with: {sanitize(pin)}")
        doc = {"kind": "drift", "server": sanitize(self.server.name), "withheld": shown,
               "more": more, "pin": sanitize(pin), "at": fmt_time(time.time())}
        self.proxy.notifier.notify(f"drift of server {self.server.name}", lambda: doc, drift=True)

    def apply(self, offered: list[UpstreamTool], withheld: dict[str, str]) -> None:
        """Make ``offered`` the server's tools in the proxy, the gate and the listing; withhold
        the rest. A tool whose spec changed (a pin since) is the gate's new tool from here on,
        its spec stored first. The operator hears of the names offered anew or changed, and
        of those removed; the host, that its list changed."""
        proxy, server = self.proxy, self.server.name
        before = {n: t.spec for n, t in proxy.tools.items() if t.server == server}
        now: dict[str, UpstreamTool] = {}
        for tool in offered:
            name = tool.spec.name
            held = proxy.gate.tools.get(name)
            if held is None or held.spec != tool.spec:
                try:
                    proxy.store.ensure_spec(tool.spec)
                except ProxyError as exc:
                    withheld[name] = f"its spec could not be recorded: {exc}"
                    continue
                proxy.gate.tools[name] = Tool(tool.spec, tool.call, True)
            now[name] = tool
        proxy.order += [n for n in now if n not in proxy.order]
        tools = {**{n: t for n, t in proxy.tools.items() if t.server != server}, **now}
        proxy.tools.clear()                  # in place: the policy holds this same dict
        proxy.tools.update((n, tools[n]) for n in proxy.order if n in tools)
        proxy.withheld = {n: v for n, v in proxy.withheld.items() if v[0] != server}
        proxy.withheld.update({n: (server, why) for n, why in withheld.items()
                               if n in proxy.order and n not in now})   # names a host may have seen
        added = [n for n, t in now.items() if before.get(n) != t.spec]
        removed = [n for n in before if n not in now]
        for word, names in (("withheld", removed), ("offered", added)):
            if names:
                self.log(f"drift: server {_quote(server)}: {word}: {', '.join(names)}")
        if added or removed:
            self.announce()


# ==== 26. Re-checking recorded calls ====
# `recheck` rebuilds the policy today's configuration gives the proxy and hands it every
# decision the proxy's policy recorded, rebuilt as it was handed then: the request (its
# recorded spec, or with -current-tools the tool's spec as loaded now) and the view of its
# run at that moment. It reports which decisions would now be made otherwise. It opens the
# database read-only, reads no clock, and writes nothing. It covers the gate's policy, not the
# rules applied before it.

RECHECK_LIMIT = 50
RECHECK_TEXT = 240                     # bytes of one value in a report line
RECHECK_SCOPE = (
    "A re-check covers the gate's policy: the policy map, each rule's outcome, its fixed values, "
    "its rename, its conditions, and its limits as counted from the executions recorded before "
    "each decision. It does not cover the rules applied before the policy (the duplicate rule, "
    "the repeat window, max_pending, the refusal of a rejected or expired approval) or any call "
    "refused before the gate; without -current-tools it covers no change to a tool's schema or "
    "denied parameters either.")


@dataclasses.dataclass(repr=False)
class Evaluation:
    """recheck's verdict on one recorded policy evaluation."""
    step_index: int
    step_id: str
    seq: int
    tool: str
    result: str                         # same, different, not_recheckable, not_a_policy_evaluation
    recorded: str
    rechecked: str = ""
    on_resume: bool = False
    detail: str = ""
    recorded_hash: str = ""
    rechecked_hash: str = ""
    policy_id: str = ""

    def judged(self, result: str, detail: str = "") -> Evaluation:
        self.result, self.detail = result, detail
        return self


@dataclasses.dataclass(repr=False)
class RecheckReport:
    """recheck's report on one run."""
    run_id: str
    run_status: str
    policy_id: str
    spec_source: str
    evaluations: list[Evaluation] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def count(self, *results: str) -> int:
        return sum(1 for e in self.evaluations if e.result in results)

    def asked(self) -> set[str]:
        """The policy identities the re-checked decisions were recorded under."""
        return {e.policy_id for e in self.evaluations if e.result in ("same", "different")}

    @property
    def identity(self) -> str:
        asked = self.asked()
        if not asked or not self.policy_id or "" in asked:
            return "unknown"
        return "unchanged" if asked == {self.policy_id} else "changed"

    def as_json(self) -> dict:
        differ, skipped = self.count("different"), self.count("not_recheckable")
        return {"run_id": self.run_id, "run_status": self.run_status, "policy_id": self.policy_id,
                "identity": self.identity, "spec_source": self.spec_source, "notes": self.notes,
                "evaluations": [dataclasses.asdict(e) for e in self.evaluations],
                "same": differ == 0, "differences": differ,
                "rechecked": self.count("same", "different"), "not_recheckable": skipped,
                "complete": skipped == 0}

    def lines(self) -> list[str]:
        asked = sorted(p for p in self.asked() if p)
        identity = {"unchanged": f'policy unchanged: "{self.policy_id}"',
                    "changed": "policy changed: recorded " + ", ".join(f'"{p}"' for p in asked)
                               + f', given "{self.policy_id}"',
                    "unknown": "policy identity unknown"}[self.identity]
        out = [sanitize(f"run {self.run_id} {self.run_status}: {self.count('different')} of "
                        f"{self.count('same', 'different')} re-checked decision(s) differ; "
                        f"{identity}; {self.spec_source} specs")]
        for e in sorted(self.evaluations, key=lambda e: e.result != "different"):
            tool, was, now, why = (clean(str(t or ""), RECHECK_TEXT)    # an edited row
                                   for t in (e.tool, e.recorded, e.rechecked, e.detail))
            where = f"step {e.step_index} seq {e.seq} {tool or '-'}" + \
                (" (on resume)" if e.on_resume else "")
            detail = f": {why}" if e.detail else ""
            said = {"same": f"same      {where}: {was}{detail}",
                    "different": f"DIFFERENT {where}: {was} -> {now or 'none'}{detail}"}
            out.append(said.get(e.result, f"skipped   {where}: {why}"))
        return out + [f"note: {clean(n, RECHECK_TEXT)}" for n in self.notes]


class _RecordedPolicy(ProxyPolicy):
    """The proxy's policy as re-check hands it a recorded request: whether a request re-ran
    an unknown outcome, or repeated an execution, is read from the approval the policy asked
    for next in its step."""

    def __init__(self, cfg: Config, tools: dict, policy_id: str, store: Store):
        super().__init__(cfg.policy_map, tools, None, policy_id)
        self.store = store
        self.following: Approval | None = None
        self.as_of: tuple[int, float] | None = None     # the decision's event and time

    def use_of(self) -> UseOf | None:
        """Limits as they stood when the decision was made: from the executions recorded
        before it."""
        if self.as_of is None:
            return None
        seq, now = self.as_of
        return lambda key, limit: recorded_use(self.store, self.tools, key, limit, seq, now)

    def _asked(self, request: ToolRequest, kind: str) -> Approval | None:
        nxt = self.following
        return nxt if nxt is not None and (nxt.step_id, nxt.kind) == (request.step_id, kind) \
            else None

    def rerun_of(self, request: ToolRequest, view: RunView) -> dict | None:
        at = super().rerun_of(request, view)
        if at is not None:
            return at
        named = _interrupted_attempt(self._asked(request, INTERRUPTED_KIND))
        own = named is not None and (named.get("run_id"), named.get("step_id")) == \
            (request.run_id, request.step_id)
        return None if own else named

    def repeat_of(self, request: ToolRequest, view: RunView) -> dict | None:
        earlier, asked = super().repeat_of(request, view), self._asked(request, REPEAT_KIND)
        return repeat_in(asked) if earlier is None and asked is not None else earlier


def recheck_run(store: Store, run_id: str, policy: _RecordedPolicy,
                current: dict[str, ToolSpec] | None) -> RecheckReport:
    run = store.get_run(run_id)
    whole = RunView(run, sorted(store.list_steps(run_id), key=lambda s: s.idx),
                    store.list_approvals(run_id))
    steps = {s.id: s for s in whole.steps}
    events = store.list_events(run_id)
    report = RecheckReport(run_id, run.status, policy.policy_id,
                           "current" if current is not None else "recorded")
    if run.status not in TERMINAL:
        report.notes.append(f"the run is {run.status}; it was re-checked up to its current state")
    for i, event in enumerate(events):
        seq, _r, step_id, _at, typ, payload, _h = event
        step = steps.get(step_id)
        if typ == "step.policy":
            report.evaluations.append(_recheck_one(store, whole, events, event, step, policy,
                                                   current))
        elif typ == "step.failed" and payload and '"policy error: ' in payload and \
                not (i and events[i - 1][4] == "step.policy" and events[i - 1][2] == step_id):
            report.evaluations.append(Evaluation(
                step.idx if step else -1, step_id, seq, "", "not_recheckable", "error",
                detail="not re-checkable: policy failed; no evaluation recorded: " +
                loads_own(payload).get("detail", "").removeprefix("policy error: ")))
    if not report.evaluations:
        report.notes.append("no policy evaluation is recorded")
    return report


def _approvals_as_of(approvals: list[Approval], events: list, seq: int,
                     count: int) -> list[Approval]:
    """The first ``count`` approvals, each with the status it had at event ``seq``."""
    shown = approvals[:count]
    decided = {d["approval_id"]: d.get("status", PENDING) for d in (  # the last decision
        loads_own(e[5]) for e in events if e[0] < seq and e[4] == "approval.decided")
        if isinstance(d, dict) and isinstance(d.get("approval_id"), str)} if shown else {}
    return [dataclasses.replace(a, status=decided[a.id]) if a.id in decided else
            dataclasses.replace(a, status=PENDING, decided_at="", decided_by="", note="")
            for a in shown]


def _recheck_one(store: Store, whole: RunView, events: list, event: tuple, step: Step | None,
                 policy: _RecordedPolicy, current: dict[str, ToolSpec] | None) -> Evaluation:
    """The decision recorded at ``event`` handed again to ``policy`` as it was handed then:
    the request, and the view of the run at that moment with its approvals as they stood."""
    seq, _r, step_id, at, _t, payload, _h = event
    try:
        rec = loads_own(payload)
    except JSONError:
        return Evaluation(-1, step_id, seq, "", "not_recheckable", "",
                          detail="not re-checkable: the recorded decision is unreadable")
    outcome, kind = rec.get("outcome", ""), rec.get("kind", "")
    decision = (step.decision or {}) if step else {}
    ev = Evaluation(step.idx if step else -1, step_id, seq, decision.get("tool", ""), "",
                    outcome, policy_id=rec.get("policy_id", ""))
    view = rec.get("view")
    if not isinstance(view, dict):
        return ev.judged("not_a_policy_evaluation", "an interrupted side effect's pause"
                         if kind == INTERRUPTED_KIND else "a pause the policy did not make")
    ev.on_resume = view.get("status") == WAITING
    if decision.get("kind") != "tool_call":
        return ev.judged("not_recheckable", "not re-checkable: the step is not a tool call")
    try:
        recorded_spec = store.spec(rec.get("spec_hash", ""))
    except NotFound:
        return ev.judged("not_recheckable", "not re-checkable: no spec is recorded")
    spec = recorded_spec if current is None else current.get(ev.tool)
    if spec is None:
        return ev.judged("different", f"the tool {ev.tool} is no longer offered")
    args = step.args or b"{}"
    request = ToolRequest(whole.run.id, step_id, spec, args)
    n_steps, n_approvals = int(view.get("steps", 0)), int(view.get("approvals", 0))
    then = dataclasses.replace(whole.run, status=view.get("status", RUNNING),
                               step_count=int(view.get("step_count", 0)), reason="",
                               reason_detail="", finished_at="", result_json="")
    handed_view = RunView(then, whole.steps[:n_steps],
                          _approvals_as_of(whole.approvals, events, seq, n_approvals))
    policy.following = next(iter(whole.approvals[n_approvals:]), None)
    policy.as_of = (seq, parse_time(at)) if at else None
    try:
        schema = policy_json(spec.input_schema, False)
        now = policy.evaluate(dataclasses.replace(
            request, spec=dataclasses.replace(spec, input_schema=schema),
            args=policy_json(args)), handed_view)
    except Exception as exc:
        ev.rechecked = "error"
        return ev.judged("different", f"policy failed: {exc}")
    finally:
        policy.following, policy.as_of = None, None
    ev.rechecked = now.outcome
    if now.outcome != outcome:
        return ev.judged("different", now.reason)
    if outcome == "require_approval":
        if now.kind != kind:
            return ev.judged("different", f"asks for approval kind {_quote(now.kind)}, not "
                             f"{_quote(kind)}")
        try:
            spans = member_spans(payload.encode())
            was = approval_hash(kind, spans.get("capability", b"{}"),
                                spans.get("presentation", b"{}"),
                                ToolRequest(whole.run.id, step_id, recorded_spec, args))
            ev.rechecked_hash = approval_hash(now.kind, now.capability.strip(JSON_WS),
                                              now.presentation.strip(JSON_WS), request)
        except (JSONError, TypeError, ValueError) as exc:
            return ev.judged("not_recheckable", f"not re-checkable: {exc}")
        ev.recorded_hash = was
        if was != ev.rechecked_hash:
            return ev.judged("different", "asks for another approval: its capability, "
                             "presentation or tool spec changed")
    return ev.judged("same")


async def cmd_recheck(cfg: Config, args, out: Out) -> int:
    """The recheck command: exit 0 when every run is the same and something was re-checked,
    1 when any differs or nothing was, 2 on a usage error (judged before this)."""
    check_database_file(cfg.database, writer=False)
    store = Store.open_existing(cfg.database, readonly=True)
    tools: list[UpstreamTool] = []
    session, run_ids = args.session or cfg.session, [args.run]
    try:
        if args.current_tools:
            check_reach(cfg)
            tools, _ = await load_tools(cfg, out.log)
        current = {t.spec.name: t.spec for t in tools} if args.current_tools else None
        by_name = {t.spec.name: t for t in tools} if tools else configured_tools(cfg)
        policy = _RecordedPolicy(cfg, by_name, cfg.policy_id(), store)
        if not args.run:
            try:
                rows = store._read("SELECT run_id FROM proxy_calls WHERE session=? ORDER BY id "
                                   "DESC LIMIT ?", (session, args.limit))
            except StoreError as exc:
                raise ProxyError(f"recheck: the database has no index of proxy calls: {exc}") \
                    from None
            run_ids = [r[0] for r in rows if store.find_run(r[0]) is not None]
        reports = [recheck_run(store, run_id, policy, current) for run_id in run_ids]
    finally:
        await close_tools(tools)
        store.close()
    differ = sum(1 for r in reports if r.count("different"))
    rechecked = sum(r.count("same", "different") for r in reports)
    skipped = sum(r.count("not_recheckable") for r in reports)
    if args.json:
        out.json([r.as_json() for r in reports])
    else:
        for line in [line for r in reports for line in (*r.lines(), "")]:
            out.line(line)
        out.line(f"{len(reports)} run(s) re-checked under {cfg.policy_id()}; {rechecked} "
                 f"decision(s) re-checked; {skipped} not re-checkable and skipped; {differ} "
                 "run(s) differ")
        out.line(RECHECK_SCOPE)
    if not reports:
        out.log(f"recheck: no run of session {_quote(session)} was found, so nothing was "
                "re-checked")
        return 1
    if rechecked == 0:
        out.log(f"recheck: no decision of the policy was re-checked ({skipped} not re-checkable)")
        return 1
    return 1 if differ else 0


# ==== 27. Operator commands: the command line and its output ====
# runs, show, events, approve, reject, cancel, verify, pending, inbox. Arguments are checked
# before the database is touched; the database is opened as it is (never created, never
# migrated), read-only except for deciding and cancelling. The one exception: rejecting an
# interruption approval brings the proxy's own tables to this build's version first, as a
# proxy's start does, since the operator's word on the attempt is kept there (decide_approval).
# approve and reject print the approval in full first and bind the decision to the hash of what
# they printed. Text that a model, a server or an operator chose is sanitised before it reaches
# the terminal; so is every field read from the database, which verify exists to distrust: a row
# edited behind the proxy's back must not drive the terminal that reads it. -json output is
# JSON, its controls escaped.

CLI_BAD_TIME_WIDTH = 40              # characters of a stored time that does not parse
_SHELL_SAFE = re.compile(r"[A-Za-z0-9._:@%+=,/-]+")    # an id printed as a shell word unquoted
# JSON may carry DEL, C1 controls and bidirectional characters raw; -json output is read on
# terminals too, so they are written as \u escapes (they can occur only inside strings).
_JSON_INERT = re.compile(f"[\x7f-\x9f{_INVISIBLE}]")
PENDING_ARGS_BYTES = 480             # the one-line summary of a waiting call's arguments
PENDING_KEY_BYTES = 40               # ... the start of each key in it
PENDING_VALUE_BYTES = 60             # ... and of each value, cut on its own
PADDING_RUN = 8                      # a run of one blank character this long is counted
INBOX_POLL = 1.0                     # seconds between the inbox's looks for new approvals
INBOX_LINE_BYTES = 4096              # one answer typed at the inbox (a note included)
# An answer at the inbox is a word or its first letter.
INBOX_ANSWERS = {k: v for v in ("approve", "reject", "skip", "quit") for k in (v, v[0])}
# What came of a cut-off attempt, asked when an interruption approval is rejected; Enter
# alone answers unknown, reject -outcome's default.
INBOX_OUTCOMES = {k: v for v in OPERATOR_OUTCOMES for k in (v, v[0])} | {"": OUTCOME_UNKNOWN}
# What the operator's word on a cut-off attempt comes to, as a decision and `show` say it.
OUTCOME_SAID = {
    OUTCOME_EXECUTED: "it took effect; it still counts toward the tool's limits",
    OUTCOME_NOT_EXECUTED: "it did not take effect; it no longer counts toward the tool's limits",
    OUTCOME_UNKNOWN: "whether it took effect is not known; it still counts toward the tool's "
                     "limits"}

HELP_SCOPE = __doc__.split("Trust boundaries")[0].split("\n", 2)[2].strip()
USAGE_NOTE_COLUMN = 34               # where the notes under a command's line in the help begin
# Each command's entry in the help, by the command: its line, then its notes, each line of the
# entry ending in a line break. The general help lists them all, and `X --help` prints X's
# alone (help_text).
_USAGES = {command: "  python agentrt_proxy.py " + ("\n" + " " * USAGE_NOTE_COLUMN).join(lines)
           + "\n" for command, lines in {
    "serve": ["-config proxy.json          serve the host over stdin and stdout"],
    "pin": ["pin -config proxy.json      pin each server's tools (writes manifests)"],
    "check": ["check -config proxy.json [-strict]",
              "what is offered, refused, unclassified (-strict: a refused", "tool exits 1)"],
    "wrap": ["wrap -host claude|vscode|cursor [-host-config PATH] -config proxy.json",
             "[-write [-rules suggested]]   a new configuration from",
             "the host's servers (without -write: what it would write)"],
    "recheck": ["recheck -config proxy.json [-run ID | -session NAME] [-limit N]",
                "[-current-tools] [-json]   what today's policy decides otherwise"],
    "runs": ["-db DATABASE [-json] runs [-limit N] [-offset N]"],
    "show": ["-db DATABASE [-json] show RUN [-limit N] [-offset N]"],
    "events": ["-db DATABASE [-json] events RUN [-limit N] [-offset N]"],
    "approve": ["-db DATABASE approve [RUN] [-approval ID] [-by WHO] [-note TEXT] [-yes]"],
    "reject": ["-db DATABASE reject  [RUN] [-approval ID] [-by WHO] [-note TEXT] [-yes]",
               "[-outcome executed|not-executed|unknown]   for an interrupted",
               "attempt: what came of it (default unknown); not-executed",
               "stops counting it toward limits"],
    "cancel": ["-db DATABASE cancel  RUN [-by WHO] [-note TEXT]"],
    "verify": ["-db DATABASE [-json] verify [-from N] [-to N] [-head SEQ:HASH]"],
    "pending": ["-db DATABASE [-json] pending     what waits, and the command that decides it"],
    "inbox": ["-db DATABASE inbox [-once] [-by WHO] [-tty-not-required]",
              "decide from a terminal; -tty-not-required reads a pipe"],
    "webhook": ["-db DATABASE webhook -listen 127.0.0.1:PORT -secret-file FILE [-public]"],
    "sign": ["[-json] sign -secret-file FILE -method GET|POST -path PATH",
             "[-body TEXT | -body-file FILE]   headers for one webhook request"],
}.items()}
_USAGE_DATABASE = ("The database is the -db file, else the 'database' of the -config file, "
                   "else\n$AGENTRT_DB.")
_USAGE_FLAGS = "Flags take one dash or two. Exit status: 0 success, 1 failure, 2 usage error."
USAGE = "usage:\n" + "".join(_USAGES.values()) + """
A host starts the proxy as one stdio MCP server, with absolute paths:
  {"command": "python3", "args": ["/path/to/agentrt_proxy.py", "-config", "/path/to/proxy.json"]}
stdout carries only the protocol; everything else, including the operator's hints, goes to
stderr. """ + _USAGE_DATABASE + " " + _USAGE_FLAGS
# The flags given before a command that take a value: the word after one is no command.
_TOP_VALUED = ("-db", "--db", "-config", "--config")


def help_text(argv: list[str]) -> str | None:
    """What a command line asking for help prints, or None when it asks for none. It asks
    with -h or --help anywhere (argparse takes neither as a flag's value), or with help
    first. The help is the named command's own (help X, or the first word past the global
    flags and their values), else the general help, the scope statement first."""
    if argv[:1] == ["help"]:
        named = argv[1:2]
    elif "-h" in argv or "--help" in argv:
        i = 0
        while i < len(argv) and argv[i] not in _USAGES:
            i += 2 if argv[i] in _TOP_VALUED else 1
        named = argv[i:i + 1]
    else:
        return None
    entry = _USAGES.get(named[0]) if named else None
    if entry is None:
        return HELP_SCOPE + "\n\n" + USAGE
    notes = ([_USAGE_DATABASE] if "-db DATABASE" in entry else []) + [_USAGE_FLAGS]
    return "usage:\n" + entry + "\n" + " ".join(notes)


def _flags(parser: argparse.ArgumentParser, *specs: tuple) -> None:
    """Add flags spelled with one dash or two (-limit and --limit)."""
    for name, kwargs in specs:
        parser.add_argument("-" + name, "--" + name, dest=name.replace("-", "_"), **kwargs)


def build_parser() -> argparse.ArgumentParser:

    class _CommandLine(argparse.ArgumentParser):
        """argparse that reports a usage error instead of exiting."""

        def error(self, message: str):
            raise UsageError(message)

    top = _CommandLine(prog="agentrt_proxy.py", add_help=False, allow_abbrev=False)
    _flags(top, ("db", {}), ("config", {}), ("json", {"action": "store_true"}))
    sub = top.add_subparsers(dest="command", parser_class=_CommandLine)
    on, config = {"action": "store_true"}, ("config", {"default": argparse.SUPPRESS})
    offset = ("offset", {"type": int, "default": 0})
    decide = (("approval", {}), ("by", {}), ("note", {"default": ""}), ("yes", on))
    # Each command: its run argument ("?" when it may be left out), then its flags.
    for name, run, flags in (
            ("runs", "", (("limit", {"type": int, "default": CLI_RUNS_LIMIT}), offset)),
            ("show", "run", (("limit", {"type": int, "default": CLI_SHOW_LIMIT}), offset)),
            ("events", "run", (("limit", {"type": int, "default": CLI_EVENTS_LIMIT}), offset)),
            ("approve", "?", decide),
            # what came of an interrupted attempt (section 13)
            ("reject", "?", decide + (("outcome", {"choices": OPERATOR_OUTCOMES}),)),
            ("recheck", "", (config, ("run", {}), ("session", {}),
                             ("limit", {"type": int, "default": RECHECK_LIMIT}),
                             ("current-tools", on))),
            ("serve", "", (config,)), ("pin", "", (config,)),
            ("check", "", (config, ("strict", on))),
            ("wrap", "", (config, ("host", {"choices": WRAP_HOSTS, "required": True}),
                          ("host-config", {}), ("write", on),
                          ("rules", {"choices": ("none", "suggested"), "default": "none"}))),
            ("cancel", "run", (("by", {}), ("note", {"default": ""}))),
            ("verify", "", (("from", {"type": int, "default": 1}),
                            ("to", {"type": int, "default": 0}), ("head", {}))),
            ("pending", "", ()),
            ("inbox", "", (("once", on), ("by", {}), ("tty-not-required", on))),
            ("webhook", "", (("listen", {}), ("secret-file", {}), ("public", on))),
            ("sign", "", (("secret-file", {}), ("method", {}), ("path", {}), ("body", {}),
                          ("body-file", {})))):
        parser = sub.add_parser(name, add_help=False, allow_abbrev=False)
        if run:
            parser.add_argument("run", nargs="?" if run == "?" else None)
        _flags(parser, *flags)
        if name not in _PROXY_COMMANDS or name == "recheck":   # -json after the command too
            _flags(parser, ("json", {"action": "store_true", "default": argparse.SUPPRESS}))
    return top


class Out:
    """Where a command writes: stdout for results, stderr for everything else."""

    def __init__(self, stdout, stderr, stdin=None):
        self.stdout, self.stderr, self.stdin = stdout, stderr, stdin

    def line(self, text: str = "") -> None:
        self.stdout.write(text + "\n")

    def text(self, line: str = "") -> None:
        """A line built from stored fields, sanitised whole: an escape sequence, a carriage
        return or a reordering character in an edited row cannot redraw what the operator
        reads, even from a field a caller forgot (sanitising twice changes nothing)."""
        self.stdout.write(sanitize(line) + "\n")

    def texts(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.text(line)

    def log(self, text: str) -> None:
        self.stderr.write(LOG_PREFIX + sanitize(text) + "\n")

    def json(self, doc: Any) -> None:
        """One JSON document, indented; number literals and embedded records as stored."""
        text = _pretty(read_own(dump_json(doc)), cut=False)
        self.stdout.write(_JSON_INERT.sub(_json_escape, text) + "\n")


def _json_escape(match: re.Match) -> str:
    """A character as JSON \\u escapes (a pair for one beyond the BMP): the same value."""
    return json.encoder.encode_basestring_ascii(match.group())[1:-1]


def _stamp(text: str, millis: bool = False) -> str:
    """A stored time as local time for an operator; '-' when empty."""
    if not text:
        return "-"
    try:
        local = _dt.datetime.fromtimestamp(parse_time(text)).astimezone()
    except (ValueError, TypeError, AttributeError, OverflowError, OSError):
        return "(not a time) " + clean(str(text), CLI_BAD_TIME_WIDTH)
    return local.strftime("%Y-%m-%d %H:%M:%S") + \
        (f".{local.microsecond // 1000:03d}" if millis else "") + local.strftime(" %z")


def _table(rows: list[list[str]]) -> list[str]:
    """Columns aligned on the sanitised cells, so a stored field is measured as printed."""
    rows = [[sanitize(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _pending_id(store: Store, run: Run) -> str:
    if run.status != WAITING:
        return ""
    pending = store.pending_approvals(run.id)
    return pending[0].id if len(pending) == 1 else ""


# ==== 28. Operator views: runs, show, events, verify, pending ====
# What the store holds, read-only, every field sanitised on its way to the terminal. A view
# hides no field: what it cannot show in a line it points to (`show`) in full.

def _run_summary(store: Store, run: Run) -> dict:
    word = _run_word(store, run)
    return {"id": run.id, "goal": run.goal, "status": run.status, "reason": run.reason,
            "reason_detail": run.reason_detail, "why": ended_why(store, run),
            "steps": run.step_count, "created_at": run.created_at,
            "finished_at": run.finished_at, "pending_approval_id": _pending_id(store, run),
            "operator_outcome": word["outcome"] if word else None}


def _run_word(store: Store, run: Run) -> dict | None:
    """The operator's word on the cut-off attempt whose rejection ended ``run``, if any
    (only a rejection records one, and a rejection ends its run)."""
    if run.reason != "approval_rejected":
        return None
    return next(iter(outcomes_of_run(store, run.id).values()), None)


_CLOSED_WHY = {CLOSE_DENIED: "denied by policy", CLOSE_INVALID: "refused: invalid arguments",
               CLOSE_DENIED_RERUN: "approved to run again, then denied by policy: nothing ran",
               CLOSE_TOOL_ERROR: "the tool answered an error",
               CLOSE_UNRECORDED: "executed; its result could not be recorded",
               CLOSE_TAKEN_OVER: "taken over after an interruption"}


def ended_why(store: Store, run: Run) -> str:
    """Why a run ended, in plain words ("denied by policy", "rejected by pat"), beside the
    seed's status and reason; '' for a run not ended."""
    if run.status not in TERMINAL:
        return ""
    if run.status == COMPLETED:
        return "completed"
    if run.reason in ("approval_rejected", "operator_cancelled"):
        by = ""
        for _seq, _run, _step, _at, typ, payload, _hash in store.list_events(run.id, -1, 0):
            if typ in ("approval.decided", "run.finished"):
                with contextlib.suppress(ProxyError, AttributeError):
                    by = str(loads_own(payload).get("by") or by)
        verb = "rejected" if run.reason == "approval_rejected" else "cancelled"
        word = _run_word(store, run)
        return f"{verb} by {by or 'an operator'}" + (f"; attempt {word['outcome']}" if word else "")
    if run.reason == "approval_expired":
        return "its approval expired"
    if run.reason == HOST_WITHDRAWN:
        return WITHDRAWN_NOTE
    return _CLOSED_WHY.get(run.reason_detail) or run.reason_detail or run.reason


def cmd_runs(store: Store, args, out: Out) -> int:
    runs, total = store.list_runs(args.limit, args.offset)
    if args.json:
        out.json({"runs": [_run_summary(store, r) for r in runs], "total": total})
        return 0
    if not runs:
        out.text("no runs")
        return 0
    rows = [["RUN", "STATUS", "REASON", "STEPS", "CREATED", "APPROVAL", "GOAL", "WHY"]]
    for r in runs:
        rows.append([r.id, r.status, r.reason or "-", str(r.step_count), _stamp(r.created_at),
                     _pending_id(store, r) or "-", clean(r.goal, CLI_GOAL_WIDTH),
                     clean(ended_why(store, r), CLI_GOAL_WIDTH) or "-"])
    out.texts(_table(rows))
    _more(out, "run", args.offset, len(runs), total)
    return 0


def _more(out: Out, noun: str, offset: int, count: int, total: int, tally: bool = True) -> None:
    """How many a page left out, and the -offset that shows them."""
    if offset + count < total:
        out.text(f"... {total - offset - count} more {noun}(s): use -offset {offset + count}"
                 + (f" (shown {count} of {total})" if tally else ""))


def _pretty(value: Any, indent: int = 0, cut: bool = True) -> str:
    """Indented JSON of a parsed value, number literals as written. With ``cut``, a string
    over CLI_FIELD_BYTES shows its two ends (for a terminal, never for a file)."""
    pad = "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{dump_json(k)}: {_pretty(v, indent + 1, cut)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, list) and value:
        items = [pad + _pretty(v, indent + 1, cut) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    if cut and isinstance(value, str) and len(value.encode()) > CLI_FIELD_BYTES:
        data = value.encode()
        head = data[:CLI_FIELD_KEEP].decode("utf-8", "ignore")
        tail = data[-CLI_FIELD_KEEP:].decode("utf-8", "ignore")
        value = f"{head}\u2026[{len(data) - len(head.encode()) - len(tail.encode())} " \
                f"bytes omitted]\u2026{tail}"
    return dump_json(value)


def _fields(raw: bytes) -> list[str]:
    """An object's fields, one per key with its own size, pretty and sanitised."""
    if not raw.strip(JSON_WS):
        return ["  (none)"]
    try:
        value = parse_json(raw.strip(JSON_WS), strict=False)
    except JSONError:
        return ["  value (not JSON)", "    " + clean(raw.decode("utf-8", "replace"),
                                                   CLI_FIELD_BYTES)]
    if not isinstance(value, dict):
        value = {"value": value}
    if not value:
        return ["  (no fields)"]
    lines = []
    for key in sorted(value):
        lines.append(f"  {sanitize(key)} ({len(encode_canonical(value[key]))} bytes)")
        lines += ["    " + sanitize(line) for line in _pretty(value[key]).split("\n")]
    return lines


def approval_block(store: Store, approval: Approval, db_path: str,
                   view: ApprovalView | None = None) -> list[str]:
    """Everything an operator must read before deciding, as printed by show, approve, reject,
    the inbox and the webhook's text, from the approval's view (section 13), and its tool's
    limits as they stand now (limits_now). Its facts are waiting_doc's, read as it reads
    them; the arguments, the operator's fixed values and the interrupted attempt in full."""
    view = view or view_of(store, approval)
    approval = view.approval
    state = "WAITING" if approval.status == PENDING else sanitize(str(approval.status)).upper()
    cap, request, problem = _read_approval(approval)
    if request is None:
        return [f"APPROVAL {state}  {sanitize(approval.id)}", f"unread  {sanitize(problem)}"]
    doc = waiting_doc(approval, db_path, view, limits_now(store._read, approval, time.time()))
    lines = ["", f"APPROVAL {state}  {doc['approval_id']}", f"kind          {doc['kind']}"]
    if doc["server"]:
        lines.append(f"server        {doc['server']}")
    if doc["upstream_tool"] and doc["server"]:
        lines.append(f"upstream tool {doc['upstream_tool']}")
    lines += [f"tool          {doc['tool']}", f"side effect   {doc['side_effect']}",
              f"reason        {sanitize(view.reason) or '-'}"]
    # a condition or limit asked; the limits are read as shown, bound to nothing (section 20)
    lines += _asked_lines(doc, "", "asked by      ", "limits now    each limit of the tool as "
                          "it stands as this is shown; collecting the call judges them again")
    if approval.expires_at:
        lines.append(f"expires       {_stamp(approval.expires_at)}")
    lines.append("arguments: the tool call the model made, one field per line "
                 "(each byte count is that field's own size)")
    lines += _fields(request.args)
    for key, title in (("fixed", "fixed values: set by the operator's configuration, not by "
                                 "the model"),
                       ("interrupted", "interrupted attempt: an earlier run of this request "
                                       "whose outcome is unknown")):
        if key in cap:
            lines.append(title)
            lines += _fields(dump_json(cap[key]).encode())
    if doc["late_outcome"]:
        then = "it is not run again" if doc["late_outcome_known"] else \
            "its outcome is still unknown; approving runs it again"
        lines.append(f"LATE OUTCOME  the attempt this approval asks about "
                     f"{doc['late_outcome']}; " + then)
    lines.append("presentation: built by the policy; it may hold text the model chose")
    lines += _fields(approval.presentation)
    if approval.status == PENDING:
        lines.append(f"decide with: {doc['decide']}   (or reject)")
    elif approval.decided_by or approval.note:
        lines.append(f"decided by    {sanitize(approval.decided_by) or '-'}"
                     + (f": {clean(approval.note, CLI_FIELD_BYTES)}" if approval.note else ""))
    lines.append(f"---- end of approval {doc['approval_id']} for tool {doc['tool']} ----")
    # The ids and names are a stored row's, and the command line above is one to paste.
    return [sanitize(line) for line in lines]


def _asked_lines(doc: dict, pad: str, asked: str, limits: str) -> list[str]:
    """The conditions and limits that asked and their figures, then the tool's limits as
    they stand now, each under its title, as a view of a waiting_doc shows them."""
    lines = []
    if doc["asked_by"]:
        lines += [asked + ", ".join(doc["asked_by"])] + [f"{pad}  {f}" for f in doc["figures"]]
    if doc["limits"]:
        lines += [limits] + [f"{pad}  {entry['text']}" for entry in doc["limits"]]
    return lines


def _shell_word(text: str) -> str:
    """A stored id as one shell word: an operator pastes the decide line, and an edited row
    must not add a command to it (run-1; rm -rf ~)."""
    if _SHELL_SAFE.fullmatch(text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _self_command() -> str:
    return f"{sys.executable or 'python3'} {os.path.abspath(__file__)}"


def run_command(db_path: str, verb: str, run_id: str) -> str:
    """The command line that does ``verb`` (show, cancel) to a run, to paste anywhere."""
    return f'{_self_command()} -db "{os.path.abspath(db_path)}" {verb} {_shell_word(run_id)}'


def decide_command(db_path: str, run_id: str, approval_id: str) -> str:
    """The one command line that approves this approval (reject: the same with reject),
    as the stderr hint, `show`, `approve`, `pending` and on_pending print it."""
    return run_command(db_path, "approve", run_id) + f" -approval {_shell_word(approval_id)}"


def _step_row(s: Step) -> dict:
    d, obs = s.decision or {}, s.observation
    return {"index": s.idx, "id": s.id, "status": s.status,
            **({"tool": d["tool"]} if d.get("tool") else {}),
            **({"decision": d.get("kind", "")} if d else {}),
            **({"policy": s.policy.get("outcome", "")} if s.policy else {}),
            **({"observation": s.obs_kind, "summary": obs.get("summary", "")} if obs else {})}


def _approval_row(a: Approval) -> dict:
    tool = ""
    with contextlib.suppress(ProxyError, KeyError, ValueError):
        tool = a.request().spec.name
    return {"id": a.id, "kind": a.kind, "status": a.status, "tool": tool, "hash": a.hash,
            "created_at": a.created_at, "expires_at": a.expires_at,
            "decided_by": a.decided_by, "note": a.note}


def cmd_show(store: Store, args, out: Out) -> int:
    run = _given_run(store, args.run)
    steps, approvals = store.list_steps(run.id), store.list_approvals(run.id)
    page = steps[args.offset:args.offset + args.limit] if args.limit > 0 else steps[args.offset:]
    refusals = RefusalLog.of_run(store, run.id)
    words = outcomes_of_run(store, run.id)
    if args.json:
        out.json({"run": _run_summary(store, run), "steps": [_step_row(s) for s in page],
                  "approvals": [dict(_approval_row(a),
                                     late_outcome=sanitize(view_of(store, a).late_text()),
                                     operator_outcome=words.get(a.id, {}).get("outcome"))
                                for a in approvals],
                  "refusals": refusals})
        return 0
    status = run.status + (f" ({run.reason})" if run.reason else "") + \
        (f": {clean(run.reason_detail, CLI_FIELD_BYTES)}" if run.reason_detail else "")
    finished = f"  finished {_stamp(run.finished_at)}" if run.finished_at else ""
    out.texts((f"run     {run.id}", f"goal    {sanitize(run.goal)}", f"status  {status}",
               f"steps   {run.step_count}", f"created {_stamp(run.created_at)}{finished}"))
    if run.status in TERMINAL:
        out.text(f"ended   {ended_why(store, run)}")
    out.texts(f"outcome {word['outcome']}: {word['by']} said the attempt cut off in run "
              f"{word['run_id']}, step {word['step_id']}: {OUTCOME_SAID.get(word['outcome'], '')}"
              for word in words.values())
    out.texts(f"calls   {line}" for line in refusal_lines(refusals))
    for a in approvals:
        if (a.status == PENDING and run.status == WAITING) or a.status == SETTLED_APPROVAL:
            out.texts(approval_block(store, a, store.path))
    out.text()
    rows = [["STEP", "TOOL", "DECISION", "STATUS", "POLICY", "OBSERVATION", "SUMMARY"]]
    for s in page:
        r = _step_row(s)
        # The step's decision and observation are parsed JSON: any type an edit left there.
        rows.append([str(s.idx), str(r.get("tool", "-")), str(r.get("decision", "-")),
                     s.status, str(r.get("policy", "-")), str(r.get("observation", "-")),
                     clean(str(r.get("summary", "")), CLI_SUMMARY_WIDTH) or "-"])
    out.texts(_table(rows))
    _more(out, "step", args.offset, len(page), len(steps), tally=False)
    return 0


def cmd_events(store: Store, args, out: Out) -> int:
    _given_run(store, args.run)
    rows = store.list_events(args.run, args.limit if args.limit > 0 else -1, args.offset)
    total = store.count_events(args.run)
    refusals = RefusalLog.of_run(store, args.run)
    if args.json:
        out.json({"events": [{"seq": seq, "run_id": run_id, "step_id": step_id, "at": at,
                              "type": typ, "payload": _raw_or_text(payload), "hash": digest}
                             for seq, run_id, step_id, at, typ, payload, digest in rows],
                  "total": total, "refusals": refusals})
        return 0
    for seq, _run, _step, at, typ, payload, _hash in rows:
        over = len(payload.encode()) - CLI_EVENT_PAYLOAD
        text = payload if over <= 0 else \
            truncate(payload, CLI_EVENT_PAYLOAD) + f"...[{over} more bytes]"
        out.text(f"{_stamp(at, millis=True)}  {sanitize(typ):<22} {sanitize(text)}")
    _more(out, "event", args.offset, len(rows), total)
    # counted beside the chain, not in it
    out.texts(f"calls of this request {line}" for line in refusal_lines(refusals))
    return 0


def _raw_or_text(text: str) -> Any:
    """A stored JSON payload embedded as written; anything else as a string."""
    try:
        parse_json(text.encode(), max_depth=RECORD_DEPTH)     # a record wraps its data
        return RawJSON(text.encode())
    except JSONError:
        return text


def _is_terminal(stream) -> bool:
    """A character device that is not /dev/null: someone who can answer a prompt."""
    try:
        st = os.fstat(stream.fileno())
        null = os.stat(os.devnull)
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISCHR(st.st_mode) and (st.st_dev, st.st_ino) != (null.st_dev, null.st_ino)


def _given_run(store: Store, given: str) -> Run:
    """The run an operator named. An approval id where a run id belongs is recognised and
    its run named, so that the id the model was shown leads somewhere."""
    run = store.find_run(given)
    if run is not None:
        return run
    approval = store.find_approval(given)
    if approval is not None:
        raise NotFound(f"{given} is an approval id, not a run id: it is an approval of run "
                       f"{approval.run_id}")
    raise NotFound(f"run {given} not found")


def cmd_verify(store: Store, args, out: Out) -> int:
    head, first, last = args.head, getattr(args, "from"), args.to
    head_seq, head_hash = store.chain_head()
    report = verify_events(store, first, last or head_seq)
    problems = [f"the event chain is broken at seq {report.broken.seq}"] if report.broken else []
    reached = first + report.checked - 1
    if last and not report.broken and reached < last:
        problems.append(f"the chain is shorter than asked: -to {last} was not reached "
                        f"(last seq checked {reached})")
    kept = None
    if head:
        found = store._read("SELECT hash FROM events WHERE seq=?", (head[0],))
        found_hash = found[0][0] if found else ""
        kept = {"seq": head[0], "hash": head[1], "found": found_hash,
                "matches": same_digest(found_hash, head[1])}
        if not kept["matches"]:
            problems.append(f"the chain does not match the head kept: seq {head[0]} has "
                            f"{found_hash or 'no event'}, kept {head[1]}")
    if args.json:
        out.json({"head": {"seq": head_seq, "hash": head_hash}, "from": first, "to": report.last,
                  "hash": report.hash, "checked": report.checked,
                  "intact": report.broken is None,
                  **({"break": dataclasses.asdict(report.broken)} if report.broken else {}),
                  **({"requested": {"to": last, "reached": reached >= last}} if last else {}),
                  **({"kept_head": kept} if kept else {})})
    else:
        out.text(f"head: seq {head_seq} {head_hash}" if head_seq else "head: no events")
        b = report.broken
        if b:
            out.texts((f"broken at seq {b.seq}: {b.detail}", f"  expected {b.expected or '-'}",
                       f"  found    {b.found or '-'}"))
        elif report.checked == 0:
            out.text("intact: no events in the range")
        else:
            out.texts((f"intact: {report.checked} event(s), seq {first} to {reached}",
                       f"last checked: seq {reached} {report.hash}"))
        if kept and kept["matches"]:
            out.text(f"kept head: seq {head[0]} matches")
    for p in problems:
        out.log("error: " + p)
    return 1 if problems else 0


# -- pending: what waits for an operator, and the command that decides it --
# An approval waits when it is pending, not expired, and its run waits for approval. An
# approved interruption grant that the identical call has not yet collected is listed too:
# until it is collected, the rules across calls refuse (BLOCKED) every other call to its tool
# that changes anything, and the operator must be able to see why.

# A run of one blank or escaped character, as padding is written: shown as one with its
# count, so that padding at the start of a value cannot fill the part of it that is shown.
_PADDING = re.compile(r"( |\t|\\[nrtbf]|\\u[0-9a-fA-F]{4}|\\u\{[0-9a-f]+\}|\\x[0-9a-f]{2})"
                      r"\1{%d,}" % (PADDING_RUN - 1))


def _cut(text: str, limit: int) -> tuple[str, int]:
    """Sanitised text, its padding runs counted, cut at ``limit`` bytes, and how many bytes
    of that were left out."""
    text = _PADDING.sub(lambda m: f"[{len(m.group()) // len(m.group(1))} x '{m.group(1)}']",
                        sanitize(text))
    size = len(text.encode("utf-8"))
    if size <= limit:
        return text, 0
    kept = text.encode("utf-8")[:limit].decode("utf-8", "ignore")
    return kept, size - len(kept.encode("utf-8"))


def args_fields(raw: bytes) -> tuple[list[dict], int]:
    """A call's arguments for a one-line view: every field in canonical (sorted) order with
    the start of its key and of its value, each cut on its own with the bytes it left out,
    as many as fit in PENDING_ARGS_BYTES; and how many fields did not fit. A model that pads
    one value, or sends many fields, cannot push another out of view unannounced."""
    try:
        value = parse_json(raw.strip(JSON_WS) or b"{}", strict=False)
    except JSONError as exc:
        text, cut = _cut(raw.decode("utf-8", "replace"), PENDING_VALUE_BYTES)
        return [{"name": "(not JSON)", "value": text, "omitted_bytes": cut,
                 "problem": sanitize(str(exc))}], 0
    if not isinstance(value, dict):
        text, cut = _cut(encode_policy(value).decode(), PENDING_VALUE_BYTES)
        return [{"name": "(not an object)", "value": text, "omitted_bytes": cut}], 0
    fields, used = [], 2
    for n, key in enumerate(sorted(value)):
        name, name_cut = _cut(key, PENDING_KEY_BYTES)
        text, cut = _cut(encode_policy(value[key]).decode(), PENDING_VALUE_BYTES)
        entry = {"name": name, "value": text, "omitted_bytes": cut,
                 **({"name_omitted_bytes": name_cut} if name_cut else {})}
        size = len(_field_text(entry).encode("utf-8")) + 1
        if used + size > PENDING_ARGS_BYTES and fields:
            return fields, len(value) - n
        fields.append(entry)
        used += size
    return fields, 0


def _field_text(f: dict) -> str:
    """One field as compact JSON (`"to":"bob"`), each cut marked with the bytes left out."""
    name = sanitize(_json_str(f["name"])) + (f"\u2026[+{f['name_omitted_bytes']} bytes]"
                                             if f.get("name_omitted_bytes") else "")
    return f"{name}:{f['value']}" + (f"\u2026[+{f['omitted_bytes']} bytes]"
                                     if f["omitted_bytes"] else "")


def args_summary(fields: list[dict], more: int) -> str:
    """A call's arguments on one line, sanitised: every field args_fields gives, with the
    start of its value, then how many fields follow when they do not all fit; `approve`,
    `show` and the inbox show them in full."""
    return "{" + ",".join(_field_text(f) for f in fields) + "}" + (
        f" and {more} more field{'s' if more != 1 else ''} not shown here" if more else "")


def _read_approval(approval: Approval) -> tuple[dict, ToolRequest | None, str]:
    """An approval's capability (the allowance that wraps its arguments; an object, else
    empty) and its request, read one way for every view; when an edit left either unreadable,
    no request and why."""
    try:
        cap = read_own(approval.capability)
        request = approval.request()
    except (ProxyError, KeyError, ValueError, TypeError) as exc:
        return {}, None, str(exc)
    return (cap if isinstance(cap, dict) else {}), request, ""


def waiting_doc(approval: Approval, db_path: str, view: ApprovalView | None = None,
                limits: list[dict] | None = None) -> dict:
    """What the operator is told of a waiting approval: on_pending's stdin, and the core of
    an entry of `pending -json`. Every string is sanitised, since the model's arguments and
    a server's names reach a terminal or a notification through it. ``view`` adds what the
    store knows beyond the row (a late outcome of the attempt it asks about), and ``limits``
    the tool's limits as they stand now (limits_now)."""
    cap, request, problem = _read_approval(approval)
    fields, more = ([{"name": "(not readable)", "omitted_bytes": 0,
                      "value": clean(problem, PENDING_VALUE_BYTES)}], 0) if request is None \
        else args_fields(request.args)
    tool, side = ("", "") if request is None else (request.spec.name, request.spec.side_effect)
    server, upstream, allowed_side = (sanitize(str(cap[key])) if cap.get(key) else ""
                                      for key in ("server", "tool", "side_effect"))
    return {"approval_id": sanitize(approval.id), "run_id": sanitize(approval.run_id),
            "kind": sanitize(approval.kind), "tool": sanitize(tool), "server": server,
            "upstream_tool": upstream, "side_effect": allowed_side or sanitize(side),
            "arguments": args_summary(fields, more), "argument_fields": fields,
            "fields_not_shown": more,
            "arguments_cut": bool(more) or any(f["omitted_bytes"] or f.get("name_omitted_bytes")
                                               for f in fields),
            **approval_facts(approval, view, limits),
            "created_at": sanitize(approval.created_at),
            "expires_at": sanitize(approval.expires_at),
            "read": sanitize(run_command(db_path, "show", approval.run_id)),
            "decide": sanitize(decide_command(db_path, approval.run_id, approval.id))}


def approval_facts(approval: Approval, view: ApprovalView | None,
                   limits: list[dict] | None) -> dict:
    """What every channel tells of an approval beyond its row, sanitised: the conditions and
    limits that asked and their figures, the tool's limits as they stand now (limits_now),
    the earlier execution a repeat approval names (section 10), as one line, and what its
    view adds (a late outcome of the attempt it asks about)."""
    earlier = repeat_in(approval) if approval.kind == REPEAT_KIND else None
    repeat_of = "" if earlier is None else sanitize(
        f"run {earlier.get('run_id')}, finished at {earlier.get('at')}: {earlier.get('outcome')}")
    return {"asked_by": [sanitize(a) for a in asked_by(approval.capability)],
            "figures": _figures(approval), "limits": limits or [], "repeat_of": repeat_of,
            **_late(view)}


def _late(view: ApprovalView | None) -> dict:
    """A late outcome of the attempt an approval asks about, as every channel tells it."""
    late = view.late if view is not None else None
    return {"late_outcome": sanitize(late.text()) if late is not None else "",
            "late_outcome_known": bool(late is not None and late.known)}


def _figures(approval: Approval) -> list[str]:
    """The figures of the conditions and limits that asked, as the presentation gives them
    (section 20)."""
    try:
        pres = read_own(approval.presentation)
    except ProxyError:
        return []
    found = pres.get("figures") if isinstance(pres, dict) else None
    return [clean(f, REASON_BYTES) for f in found if isinstance(f, str)][:MAX_CONDITIONS] \
        if isinstance(found, list) else []


def waiting_now(store: Store, now: float) -> list[Approval]:
    """Every approval that waits on a live run, and every uncollected interruption grant,
    oldest first. Neither a pending approval past its expiry nor a grant
    past the run's grant_ttl waits. An expiry an edit made unreadable is past (_expired); a
    grant's decision time made unreadable counts as not lapsed: the grant is shown."""
    found = []
    for approval in store.waiting_approvals():
        run = store.find_run(approval.run_id)
        if run is None or run.status != WAITING:
            continue
        lapsed = False
        with contextlib.suppress(ValueError, TypeError, OverflowError):
            lapsed = _expired(approval, now) if approval.status == PENDING else \
                _grant_stale(run, approval, now)
        if not lapsed:
            found.append(approval)
    return found


def pending_entry(store: Store, approval: Approval, now: float) -> dict:
    view = view_of(store, approval)
    doc = waiting_doc(approval, store.path, view, limits_now(store._read, approval, now))
    age = 0
    with contextlib.suppress(ValueError, TypeError, OverflowError):
        age = max(0, int(now - parse_time(approval.created_at)))
    doc.update(status=sanitize(approval.status), age_seconds=age,
               blocks_tool=approval.kind == INTERRUPTED_KIND)
    if approval.status == APPROVED:      # decided; it waits for the identical call
        doc.update(decided_by=sanitize(approval.decided_by),
                   decided_at=sanitize(approval.decided_at), expires_at=view.grant_lapses,
                   decide="",
                   cancel=sanitize(run_command(store.path, "cancel", approval.run_id)))
    return doc


def _pending_lines(e: dict) -> list[str]:
    age = fmt_duration(e["age_seconds"])
    expires = _stamp(e["expires_at"]) if e["expires_at"] else "never"
    tool = e["tool"] or "(unknown tool)"
    if e["status"] == PENDING:
        state, said = "WAITING ", f"asked {age} ago, expires {expires}"
        until, last = "an operator decides it", f"  decide with: {e['decide']}   (or reject)"
    else:
        state = "APPROVED"
        said = f"approved by {e['decided_by'] or '-'}, not yet collected (asked {age} ago)"
        until = "the identical call collects this grant"
        last = f"  the grant lapses {expires}; to end it sooner: {e['cancel']}"
    lines = [f"{state}  {e['approval_id']}  {e['kind']}  {tool}  {said}",
             f"  run {e['run_id']}  server {e['server'] or '-'}  upstream tool "
             f"{e['upstream_tool'] or '-'}  side effect {e['side_effect'] or '-'}",
             f"  arguments {e['arguments']}"]
    if e["arguments_cut"]:
        lines.append(f"  NOT ALL SHOWN: read every field in full before deciding: {e['read']}")
    lines += _asked_lines(e, "  ", "  asked by ",
                          "  limits now (collecting the call judges them again):")
    if e["repeat_of"]:
        lines.append(f"  REPEAT: this exact request already executed, {e['repeat_of']}")
    if e["late_outcome"]:
        lines.append(f"  LATE OUTCOME: the attempt it asks about {e['late_outcome']}")
    if e["blocks_tool"]:
        lines.append(f"  BLOCKS every other call to {tool} that changes anything, until {until}")
    return lines + [last]


def cmd_pending(store: Store, args, out: Out) -> int:
    now = time.time()
    entries = [pending_entry(store, a, now) for a in waiting_now(store, now)]
    if args.json:
        out.json({"approvals": entries})
        return 0
    if not entries:
        out.text("no approval waits for an operator")
        return 0
    out.text(f"{len(entries)} waiting, oldest first:")
    out.texts(line for entry in entries for line in _pending_lines(entry))
    return 0


# ==== 29. Operator decisions: approve, reject, cancel ====
# Each is bound to the hash of the approval as printed, and to the view it was printed from:
# a change in between decides nothing and says what changed. None of them executes anything.

def _choose_approval(store: Store, run_id: str | None, wanted: str | None) -> Approval:
    """The approval to decide, from the run, the approval, or both (the approval names its
    run). A run that is not waiting is refused before anything is printed."""
    if run_id and not wanted and store.find_run(run_id) is None and \
            store.find_approval(run_id) is not None:
        run_id, wanted = None, run_id           # the approval id was given as the run
    if wanted:
        approval = store.get_approval(wanted)
        if run_id and approval.run_id != run_id:
            _given_run(store, run_id)
            raise NotFound(f"approval {wanted} is not an approval of run {run_id}; it is an "
                           f"approval of run {approval.run_id}")
        run_id = approval.run_id
        if approval.status == CANCELLED_APPROVAL:
            raise NotPending(f"approval {wanted} is already cancelled: an operator cancelled "
                             f"run {run_id} while it waited")
        if approval.status == SETTLED_APPROVAL:
            raise AttemptSettled(f"approval {wanted} is settled, and nothing runs: "
                                 f"{sanitize(approval.note)}")
        if approval.status != PENDING:
            raise NotPending(f"approval {wanted} is already {approval.status}: approval is "
                             "not pending")
    run = _given_run(store, run_id)
    if run.status != WAITING:
        why = f" ({run.reason})" if run.reason else ""
        already = "already " if run.status in TERMINAL else ""
        raise RunStateError(f"run {run.id} is {already}{run.status}{why}: it has nothing "
                            "waiting for a decision")
    if wanted:
        return approval
    pending = store.pending_approvals(run_id)
    if not pending:
        raise NotPending(f"run {run_id}: no pending approval")
    if len(pending) > 1:
        ids = ", ".join(a.id for a in pending[:CLI_LIST_IDS])
        more = f" and {len(pending) - CLI_LIST_IDS} more" if len(pending) > CLI_LIST_IDS else ""
        raise ProxyError(f"run {run_id} has {len(pending)} pending approvals ({ids}{more}); "
                         "name one with -approval: more than one pending approval")
    return pending[0]


def cmd_decide(store: Store, args, out: Out) -> int:
    verb = args.command
    approval = _choose_approval(store, args.run, args.approval)
    word = operator_word(approval, verb == "approve", getattr(args, "outcome", None))
    # The view is read before the block is printed from the store: anything the block shows
    # that the view does not (a late outcome landing in between) is still in the store at the
    # decision, which is then refused, since what the store records only accumulates.
    view = view_of(store, approval)
    # Under -json stdout carries one JSON document, so the block goes to stderr.
    emit = out.log if args.json else out.text
    for line in approval_block(store, approval, store.path):
        emit(line)
    if not (args.approval or args.yes):
        if args.json or not _is_terminal(out.stdin):
            raise UsageError(f"{verb}: refusing without -approval, -yes, or an interactive "
                             "terminal to confirm at; pass -approval <id> or -yes")
        out.texts(collection_warnings(store, approval))
        out.stdout.write(sanitize(f"{verb} approval {approval.id} of run {approval.run_id}? "
                                  "[y/N] "))
        out.stdout.flush()
        answer = out.stdin.readline()
        if not answer:
            raise UsageError(f"{verb}: no answer at the prompt; pass -approval <id> or -yes")
        if answer.strip().lower() not in ("y", "yes"):
            raise ProxyError(f"{verb}: declined at the prompt")
    try:
        decide_shown(store, out, view, verb == "approve", args.by, args.note, word, args.json)
    except ApprovalChanged as exc:
        raise ProxyError(f"{verb}: approval {approval.id} changed after it was shown ({exc}); "
                         "run the command again and read it before deciding") from None
    return 0


def decide_shown(store: Store, out: Out, view: ApprovalView, approve: bool, by: str,
                 note: str, word: str, as_json: bool = False) -> None:
    """Decide the approval as it was shown (its view, bound to its hash), then say what the
    decision did, as the command and the inbox say it."""
    approval = view.approval
    decided, run = decide_approval(store, approval.run_id, approval.id, approve, by, note,
                                   approval.hash, time.time(), view=view, outcome=word)
    if as_json:
        out.json({"run": _run_summary(store, run), "approval": _approval_row(decided),
                  "next": decision_said(decided, run, word)})
        return
    out.text(f"approval {decided.id}: {decided.status} by {sanitize(by)}")
    out.text(f"run {run.id}: {decision_said(decided, run, word)}")


def collection_warnings(store: Store, approval: Approval) -> list[str]:
    """What a limit will make of collecting the call, as the block says it, said again right
    before the operator answers (the block may have scrolled past): read again, as it stands
    at the question."""
    return [f"WARNING: {entry['text']}" for entry in
            limits_now(store._read, approval, time.time())
            if entry["would_deny"] or entry["asks_again"]]


def decision_said(approval: Approval, run: Run, word: str = "") -> str:
    """What a decision did and what comes of it, in the words every channel says it in (the
    command, the inbox, the webhook), with the operator's word on a cut-off attempt when the
    decision recorded one (operator_word). An approved run stays WAITING_FOR_APPROVAL until
    the identical call collects it: its status alone reads as if nothing happened."""
    if approval.status == APPROVED:
        again = " again" if approval.kind == INTERRUPTED_KIND else ""
        return (f"approved; the next identical call runs it{again}, once; a call the proxy "
                "still holds runs it now")
    if approval.status == REJECTED:
        told = "your note" if approval.note else "that it was rejected"
        said = f"rejected; nothing runs, the model is told {told}"
        if word in OUTCOME_SAID:
            said += f"; the cut-off attempt is recorded as {word}: {OUTCOME_SAID[word]}"
        return said
    why = f" ({run.reason})" if run.reason else ""
    return sanitize(f"{approval.status}; the run is {run.status}{why}")


def cmd_cancel(store: Store, args, out: Out) -> int:
    _given_run(store, args.run)
    run = cancel_run(store, args.run, args.by, args.note, time.time())
    if args.json:
        out.json({"run": _run_summary(store, run)})
    else:
        out.text(f"run {run.id}: {run.status} ({run.reason})")
    return 0


# ==== 30. The inbox: deciding from a terminal ====
# One waiting approval at a time, oldest first, shown in full as `approve` shows it, and
# decided bound to the hash of what was shown. An answer is a line (a letter, then Enter), so
# it works over ssh and through a pipe. While nothing waits, the inbox looks again every
# INBOX_POLL seconds and reads `q` meanwhile. Each look is a read of its own: a proxy that
# restarts, or holds the write lock a moment, is waited out rather than fatal.

class _TypedLines:
    """Lines typed at the inbox. Read from the descriptor itself, so that waiting for one can
    end after a timeout (select) while the inbox looks for new approvals; a stream without
    one (a StringIO) is read a line at a time. A line is at most INBOX_LINE_BYTES."""

    def __init__(self, stream):
        self.stream, self.buf, self.closed = stream, b"", False
        try:
            self.fd: int | None = stream.fileno()
        except (AttributeError, ValueError, OSError):
            self.fd = None

    def discard_typed_ahead(self) -> None:
        """Forget what a terminal's operator typed before this moment: an answer typed ahead
        ("a", Enter, "a", Enter) must not decide an approval that was not yet shown. A pipe
        is a script's answers, in order, and is left alone."""
        if self.fd is None or not os.isatty(self.fd):
            return
        self.buf = b""
        with contextlib.suppress(OSError, ImportError):
            import termios              # POSIX only; where it is missing, nothing is queued
            termios.tcflush(self.fd, termios.TCIFLUSH)

    def read(self, timeout: float | None) -> str | None:
        """One line without its end; None when none came within ``timeout``, or at EOF
        (then ``closed`` is set)."""
        if self.fd is None:
            line = self.stream.readline(INBOX_LINE_BYTES)
            self.closed = not line
            return line.rstrip("\r\n") if line else None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf and len(self.buf) < INBOX_LINE_BYTES and not self.closed:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            try:
                chunk = os.read(self.fd, INBOX_LINE_BYTES)
            except OSError:                  # a terminal hung up: EIO
                chunk = b""
            self.closed = not chunk
            self.buf += chunk
        if not self.buf:                     # closed, and nothing left unread
            return None
        end = self.buf.find(b"\n")
        cut = end if end >= 0 else min(len(self.buf), INBOX_LINE_BYTES)
        line, self.buf = self.buf[:cut], self.buf[cut + (end >= 0):]
        return line.decode("utf-8", "replace").rstrip("\r")


class Inbox:
    """The operator's loop over one database: show, ask, decide, look again."""

    def __init__(self, store: Store, out: Out, by: str, once: bool):
        self.store, self.out, self.by, self.once = store, out, by, once
        self.lines = _TypedLines(out.stdin)
        self.passed: set[str] = set()        # skipped; under -once, every one shown
        self.unreadable = False              # the last look failed (said once)

    def run(self) -> int:
        idle = False
        while True:
            approval = self.next_waiting()
            if approval is not None:
                idle = False
                if not self.offer(approval):
                    return 0
                continue
            if self.once and not self.unreadable:
                self.out.text("nothing more waits" if self.passed else
                              "no approval waits for an operator")
                return 0
            if not idle and not self.unreadable:
                skipped = f" ({len(self.passed)} skipped)" if self.passed else ""
                self.out.text(f"no approval waits{skipped}; looking for new ones every "
                              f"{fmt_duration(INBOX_POLL)}; q then Enter quits")
                idle = True
            answer = self.lines.read(INBOX_POLL)
            if self.lines.closed or INBOX_ANSWERS.get((answer or "").strip().lower()) == "quit":
                return 0

    def next_waiting(self) -> Approval | None:
        """The oldest waiting approval not passed over; None when none, or when the database
        cannot be read now (said once, then looked at again)."""
        try:
            waiting = waiting_now(self.store, time.time())
        except StoreError as exc:
            if not self.unreadable:
                self.out.log(f"inbox: the database cannot be read now ({exc}); "
                             "looking again")
            self.unreadable = True
            return None
        if self.unreadable:
            self.out.log("inbox: the database can be read again")
        self.unreadable = False
        return next((a for a in waiting if a.status == PENDING and a.id not in self.passed),
                    None)

    def offer(self, approval: Approval) -> bool:
        """Show one approval in full and act on the answer; False when the operator quits."""
        view = view_of(self.store, approval)          # read first, as cmd_decide does
        self.out.texts(approval_block(self.store, approval, self.store.path)
                       + collection_warnings(self.store, approval))
        if self.once:
            self.passed.add(approval.id)
        self.lines.discard_typed_ahead()
        verb = self.ask(f"approval {approval.id}: a approve, r reject, s skip, q quit: ",
                        INBOX_ANSWERS, "answer a, r, s or q, then Enter")
        if verb in (None, "quit"):
            return False
        if verb == "skip":
            self.passed.add(approval.id)
            return True
        note, word = "", ""
        if verb == "reject":
            note = self.ask("note for the rejection (the model reads it; Enter for none): ")
            if note is not None and approval.kind == INTERRUPTED_KIND:  # as reject -outcome
                word = self.ask("did the cut-off attempt take effect? e executed, n not "
                                "executed, u unknown (Enter: unknown): ", INBOX_OUTCOMES,
                                "answer e, n or u, then Enter")
            if note is None or word is None:
                return False
        # Decided as it was shown (its view); a refusal is said and the loop goes on: the
        # approval changed, was settled by a late outcome, was decided elsewhere, expired,
        # or the run moved.
        try:
            decide_shown(self.store, self.out, view, verb == "approve", self.by, note.strip(),
                         word)
        except ApprovalChanged as exc:
            self.out.text(f"approval {approval.id} changed after it was shown: nothing was "
                          f"decided ({exc})")
        except ProxyError as exc:
            self.out.text(f"approval {approval.id}: nothing was decided: "
                          f"{_describe_failure(exc, verb)}")
        except (ValueError, TypeError, KeyError) as exc:    # a row edited past reading
            self.out.text(f"approval {approval.id}: nothing was decided: its record could "
                          f"not be read ({type(exc).__name__})")
        return True

    def ask(self, prompt: str, answers: dict | None = None, hint: str = "") -> str | None:
        """The line typed at ``prompt``; with ``answers``, the meaning of the first answer
        that has one, the hint said after each other. None at EOF."""
        while True:
            self.out.stdout.write(sanitize(prompt))
            self.out.stdout.flush()
            line = self.lines.read(None)
            if line is None:
                self.out.line()
                return None
            if answers is None:
                return line
            if line.strip().lower() in answers:
                return answers[line.strip().lower()]
            self.out.text(hint)


def cmd_inbox(store: Store, args, out: Out) -> int:
    if not args.tty_not_required and not _is_terminal(out.stdin):
        raise UsageError("inbox: stdin is not a terminal; pass -tty-not-required to read the "
                         "answers from it anyway")
    return Inbox(store, out, args.by, args.once).run()


# ==== 31. Running a command ====
# Which command runs, against which database, and how a failure is told: one line, naming
# what to do about it, and the exit status of the usage line.

_COMMANDS = {"runs": (cmd_runs, True), "show": (cmd_show, True), "events": (cmd_events, True),
             "approve": (cmd_decide, False), "reject": (cmd_decide, False),
             "cancel": (cmd_cancel, False), "verify": (cmd_verify, True),
             "pending": (cmd_pending, True), "inbox": (cmd_inbox, False)}


def _database_path(args) -> str:
    # A configuration's database is never empty: it is read as serving reads it (owner
    # checked, strict).
    path = args.db or (args.config and load_config(args.config).database) or \
        os.environ.get("AGENTRT_DB")
    if not path:
        raise UsageError("no database was given: pass -db DATABASE, -config FILE, "
                         "or set AGENTRT_DB")
    return path


def _describe_failure(exc: Exception, command: str) -> str:
    """One sentence an operator can act on, for each kind of failure."""
    if isinstance(exc, RunStateError) and command in ("approve", "reject"):
        return f"run is not waiting for approval: {exc}"
    if isinstance(exc, RunStateError) and command == "cancel":
        return f"run is already finished: {exc}"
    if isinstance(exc, NotPending) and not isinstance(exc, AttemptSettled):
        return f"approval is already decided: {exc}"
    if isinstance(exc, StoreError) and "locked" in str(exc) and \
            not isinstance(exc, SchemaVersionError):
        return f"database is locked by another writer: {exc}"
    return str(exc)


def _operator_name() -> str:
    """Who decides, when -by does not say: $USER, else this account's name."""
    if os.environ.get("USER"):
        return os.environ["USER"]
    try:
        import pwd                      # POSIX only; elsewhere -by or $USER names the operator
        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError, AttributeError, OSError):
        return ""


def _check_arguments(args) -> None:
    """Every argument is judged before the database is touched."""
    if args.command in ("runs", "show", "events") and \
            (args.limit < 0 or args.offset < 0):
        raise UsageError("-limit and -offset cannot be negative")
    if args.command in ("approve", "reject") and not (args.run or args.approval):
        raise UsageError(f"{args.command}: name the approval (-approval ID) or its run (RUN)")
    if args.command == "inbox" and args.json:
        raise UsageError("inbox: there is no -json output; pending -json lists what waits")
    if args.command in ("approve", "reject", "cancel", "inbox"):
        args.by = args.by if args.by is not None else _operator_name()
        if not args.by:
            raise UsageError("-by is empty, $USER is unset and this account has no name: "
                             "pass -by WHO")
    if args.command == "verify":
        first, last = getattr(args, "from"), args.to
        if args.head is not None:
            seq, sep, digest = args.head.partition(":")
            if not sep or not seq.isdigit() or int(seq) < 1 or \
                    not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise UsageError("-head is SEQ:HASH: a positive seq and the hash kept for it")
            args.head = int(seq), digest
        head = args.head[0] if args.head else None
        for wrong, message in ((first < 0 or last < 0, "-from and -to cannot be negative"),
                               (last and last < first, "-to is before -from"),
                               (head and last and head > last, "-head is past -to"),
                               (head and head < first, "-head is before -from")):
            if wrong:
                raise UsageError(message)


def open_database(path: str, readonly: bool) -> Store:
    """The database an operator command names, as it is: never created, never migrated."""
    try:
        return Store.open_existing(path, readonly=readonly)
    except NotFound:
        raise ProxyError(f"{path} does not exist: name the database the proxy writes") from None


def run_operator(args, out: Out) -> int:
    handler, readonly = _COMMANDS[args.command]
    _check_arguments(args)
    store = open_database(_database_path(args), readonly)
    try:
        return handler(store, args, out)
    finally:
        store.close()


_PROXY_COMMANDS = ("serve", "pin", "check", "recheck", "wrap")


def run_proxy_command(args, out: Out) -> int:
    if not args.config:
        raise UsageError(f"{args.command}: -config <file> is required")
    if args.command == "recheck":
        if args.run and args.session:
            raise UsageError("recheck: -run and -session are exclusive")
        if args.limit <= 0:
            raise UsageError("recheck: -limit must be positive")
    if args.command == "wrap":          # its configuration does not exist yet
        return asyncio.run(cmd_wrap(args, out))
    cfg = load_config(args.config)
    if args.command == "serve":
        return _serve(cfg, out)
    return asyncio.run({"recheck": lambda: cmd_recheck(cfg, args, out),
                        "pin": lambda: cmd_pin(cfg, out),
                        "check": lambda: cmd_check(cfg, out, args.strict)}[args.command]())


def _serve(cfg: Config, out: Out) -> int:
    check_database_file(cfg.database, writer=True)
    check_reach(cfg)
    return asyncio.run(cmd_serve(cfg, out, getattr(out.stdin, "buffer", out.stdin),
                                 getattr(out.stdout, "buffer", out.stdout)))


# ==== 32. The webhook: the HTTP approval channel ====
# `webhook` serves approve, reject and cancel over HTTP. An operator runs it on purpose, as a
# process of its own; the serving proxy opens no listener. A request is judged in an order
# where each step is paid for only once the one before has passed: the rate (before a byte
# is read), the request's shape and size (every read under one deadline for the whole
# request), the signature (HMAC-SHA256 under a shared secret, a timestamp inside the window,
# a signature never accepted before), then the route. Every route names its run: nothing
# lists runs. Decisions go through decide_approval and cancel_run, bound to the hash the
# caller was shown, and execute nothing. The database is opened for each request, so the
# proxy may restart, or migrate it, underneath. Whoever holds the secret can decide any
# approval of a run whose id they know; the webhook has no users. `sign` prints the headers
# that sign one request, for an operator's script.

WEBHOOK_MAX_BODY = 16 * 1024         # bytes of a request body; a longer one is refused unread
WEBHOOK_RATE = 10.0                  # requests a second, every client together
WEBHOOK_BURST = 20                   # requests at once before the rate applies
WEBHOOK_SKEW = 300                   # seconds a timestamp may differ from our clock, either way
WEBHOOK_LIST_LIMIT = 20              # pending approvals one answer lists
WEBHOOK_MAX_NONCE = 64               # characters of a nonce
WEBHOOK_MIN_SECRET = 32              # bytes of the shared secret, at least
WEBHOOK_MAX_SECRET = 4096            # bytes of the secret file, at most
WEBHOOK_REQUEST_SECONDS = 10.0       # the whole request, first byte to last (slow loris)
# The request line and headers, from the connection's accept: a client that sends no whole
# head by then holds no slot longer, and while every slot is taken the oldest connection
# whose head is not yet whole is dropped for a new one, so idle connections cannot keep an
# operator's signed request out.
WEBHOOK_HEAD_SECONDS = 2.0
WEBHOOK_SLOT_WAIT = 0.5              # seconds a new connection waits for a slot freed for it
WEBHOOK_SEND_SECONDS = 10.0          # the whole answer
WEBHOOK_LINGER_SECONDS = 1.0         # draining a request left unread after a refusal
WEBHOOK_LINGER_BYTES = 64 * 1024
WEBHOOK_MAX_LINE = 8192              # bytes of the request line or of one header line
WEBHOOK_MAX_HEADERS = 32
WEBHOOK_MAX_CONNECTIONS = 16         # connections served at once; more are closed unread
WEBHOOK_BACKLOG = 16
WEBHOOK_RECV = 4096
WEBHOOK_ACCEPT_POLL = 0.5            # seconds between looks at the stop flag
# A signature is remembered while its timestamp could be accepted (2 * WEBHOOK_SKEW at most),
# and the rate bounds how many can be accepted in that time: the set never has to forget one.
WEBHOOK_SEEN_MAX = WEBHOOK_BURST + int(WEBHOOK_RATE * 2 * WEBHOOK_SKEW)

HOOK_TIMESTAMP, HOOK_NONCE, HOOK_SIGNATURE = \
    "X-Approval-Timestamp", "X-Approval-Nonce", "X-Approval-Signature"
_HOOK_SIGNATURE_RE = re.compile(r"v1=[0-9a-f]{64}")      # one spelling: the replay key is exact
_HOOK_TIMESTAMP_RE = re.compile(r"[0-9]{1,12}")
_HOOK_NONCE_RE = re.compile(f"[!-~]{{1,{WEBHOOK_MAX_NONCE}}}")
_HOOK_TOKEN_RE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HOOK_TARGET_RE = re.compile(r"/[!-~]*")
_HOOK_LENGTH_RE = re.compile(r"[0-9]{1,9}")
# Headers read here; a second copy of one is refused, never resolved (which one a proxy in
# front would have used is unknowable: request smuggling).
_HOOK_SINGLE = frozenset({"content-length", "transfer-encoding", "accept", "expect",
                          HOOK_TIMESTAMP.lower(), HOOK_NONCE.lower(), HOOK_SIGNATURE.lower()})
_HOOK_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized",
                 404: "Not Found", 409: "Conflict", 410: "Gone", 413: "Payload Too Large",
                 429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}
_HOOK_JSON, _HOOK_TEXT = "application/json", "text/plain; charset=utf-8"
_DECISION_FIELDS = ("run_id", "approval_id", "hash", "by", "note", "view", "outcome")
_CANCEL_FIELDS = ("run_id", "by", "note")


class WebhookRefusal(ProxyError):
    """A request the webhook answers with an error: its HTTP status and code name."""

    def __init__(self, status: int, code: str, msg: str):
        super().__init__(msg)
        self.status, self.code = status, code


def _bad(msg: str) -> WebhookRefusal:
    return WebhookRefusal(400, "bad_request", msg)


def _unauthorized(msg: str) -> WebhookRefusal:
    return WebhookRefusal(401, "unauthorized", msg)


class TokenBucket:
    """``rate`` requests a second, ``burst`` at once, for the whole server: a flood from any
    number of clients costs one comparison a connection."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = float(burst), clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self.clock()
            self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens < 1:
                return False
            self.tokens -= 1
            return True


class SeenSignatures:
    """Signatures accepted, each until its timestamp leaves the window (replay). Bounded; a
    full set refuses a new one rather than forget one that could be replayed."""

    def __init__(self, limit: int):
        self.limit = limit
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def first_use(self, signature: str, until: float, now: float) -> bool:
        with self._lock:
            if len(self._until) >= self.limit:
                self._until = {s: t for s, t in self._until.items() if t >= now}
            if signature in self._until or len(self._until) >= self.limit:
                return False
            self._until[signature] = until
            return True


def hook_signature(secret: bytes, timestamp: str, nonce: str, method: str, target: str,
                   body: bytes) -> str:
    """The hex HMAC-SHA256 of timestamp, nonce, method and target, a line each, then the body."""
    message = f"{timestamp}\n{nonce}\n{method}\n{target}\n".encode("ascii") + body
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign_request(secret: bytes, method: str, target: str, body: bytes, now: float,
                 nonce: str = "") -> dict:
    """The three headers that let the webhook verify one request."""
    stamp, nonce = str(int(now)), nonce or secrets.token_hex(ID_BYTES)
    return {HOOK_TIMESTAMP: stamp, HOOK_NONCE: nonce,
            HOOK_SIGNATURE: "v1=" + hook_signature(secret, stamp, nonce, method, target, body)}


def read_hook_secret(path: str | None) -> bytes:
    """The shared secret: a regular file of ours, not a link, that nobody else may read or
    write, holding at least WEBHOOK_MIN_SECRET bytes; line ends at its end are not part of it."""
    if not path:
        raise UsageError("-secret-file FILE is required")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)       # O_NONBLOCK: a FIFO put there cannot hang us
    except OSError as exc:
        why = "it is a symbolic link; name the file itself" if os.path.islink(path) else \
            exc.strerror
        raise ConfigError(f"{path}: cannot open the secret file: {why}") from None
    with open(fd, "rb") as f:            # closes fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"{path} must be a regular file of this user's, mode 0600 "
                              f"(it is {stat.filemode(st.st_mode)}): chmod 600 {path}")
        data = f.read(WEBHOOK_MAX_SECRET + 1)       # a regular file: to EOF or the bound
    secret = data.rstrip(b"\r\n")
    if len(data) > WEBHOOK_MAX_SECRET or len(secret) < WEBHOOK_MIN_SECRET:
        raise ConfigError(f"{path} holds {len(secret)} bytes; the secret must hold "
                          f"{WEBHOOK_MIN_SECRET} to {WEBHOOK_MAX_SECRET} (for example: "
                          f"head -c 32 /dev/urandom | base64 > {path})")
    return secret


def parse_listen(text: str | None, public: bool) -> tuple[str, int, int]:
    """(address, port, family) of -listen. Plain HTTP belongs on loopback: any other address
    is refused unless the operator says -public."""
    host, sep, port = (text or "").rpartition(":")
    if not sep or not _HOOK_LENGTH_RE.fullmatch(port) or int(port) > 65535:
        raise UsageError("-listen is ADDRESS:PORT, for example 127.0.0.1:8787")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise UsageError(f"-listen names an IP address, not {sanitize(host)!r}") from None
    if not address.is_loopback and not public:
        raise UsageError(f"-listen {sanitize(text or '')}: not a loopback address; the webhook "
                         "speaks plain HTTP, so it listens elsewhere only with -public, "
                         "behind TLS and a network boundary you control")
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    return str(address), int(port), family


@dataclasses.dataclass(frozen=True, repr=False)
class HookRequest:
    """One HTTP request to the webhook, as read off the socket."""
    method: str
    target: str                     # as sent, query included: what the signature covers
    headers: dict                   # lower-cased name -> value
    body: bytes


# What a webhook request asks for, once its path is read: its action (list, show, approve,
# reject or cancel), its run, the approval it names, and whether show answers in text.
HookRoute = collections.namedtuple("HookRoute", "action run approval as_text",
                                   defaults=("", False))


class _HookReader:
    """One request's bytes from a socket accepted at ``accepted``, every read under one
    deadline for the whole request: a client sending a byte at a time cannot hold a thread
    past it (slow loris). Until the head is whole, the head's own deadline applies."""

    def __init__(self, conn: socket.socket, accepted: float):
        self.conn, self.buf, self.accepted = conn, b"", accepted
        self.deadline = accepted + min(WEBHOOK_HEAD_SECONDS, WEBHOOK_REQUEST_SECONDS)
        self.head_done = False

    def _more(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took longer than its deadline")
        self.conn.settimeout(left)
        data = self.conn.recv(WEBHOOK_RECV)
        if not data:
            raise ConnectionError("the client closed the connection mid-request")
        self.buf += data

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\n", 0, WEBHOOK_MAX_LINE + 1)
            if end >= 0:
                line, self.buf = self.buf[:end], self.buf[end + 1:]
                return line[:-1] if line.endswith(b"\r") else line
            if len(self.buf) > WEBHOOK_MAX_LINE:
                raise _bad(f"a line of the request is over {WEBHOOK_MAX_LINE} bytes")
            self._more()

    def exactly(self, size: int) -> bytes:
        while len(self.buf) < size:
            self._more()
        data, self.buf = self.buf[:size], self.buf[size:]
        return data


def read_hook_request(reader: _HookReader) -> HookRequest:
    """The request line, at most WEBHOOK_MAX_HEADERS headers, then a body of the length
    Content-Length states; a longer one is refused before any of it is read."""
    parts = reader.line().split(b" ")
    if len(parts) != 3 or not _HOOK_TOKEN_RE.fullmatch(parts[0]) or \
            parts[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
        raise _bad("the request line is not METHOD TARGET HTTP/1.1")
    method, target = parts[0].decode("ascii"), parts[1].decode("latin-1")
    if not _HOOK_TARGET_RE.fullmatch(target):
        raise _bad("the request target is not a path of visible ASCII")
    headers: dict[str, str] = {}
    for _ in range(WEBHOOK_MAX_HEADERS + 1):
        line = reader.line()
        if not line:
            break
        name, sep, value = line.partition(b":")
        if not sep or not _HOOK_TOKEN_RE.fullmatch(name):
            raise _bad("a header line is not NAME: VALUE")
        key = name.decode("ascii").lower()
        if key in headers and key in _HOOK_SINGLE:
            raise _bad(f"header {key} is given twice")
        headers.setdefault(key, value.strip(b" \t").decode("latin-1"))
    else:
        raise _bad(f"the request has more than {WEBHOOK_MAX_HEADERS} headers")
    # The head is whole: the body has the rest of the request's deadline.
    reader.head_done, reader.deadline = True, reader.accepted + WEBHOOK_REQUEST_SECONDS
    if "transfer-encoding" in headers:
        raise _bad("a chunked body is not accepted; send Content-Length")
    length = headers.get("content-length", "0")
    if not _HOOK_LENGTH_RE.fullmatch(length):
        raise _bad("Content-Length is not a number")
    if int(length) > WEBHOOK_MAX_BODY:
        raise WebhookRefusal(413, "body_too_large", f"the body is over {WEBHOOK_MAX_BODY} bytes")
    if int(length) and headers.get("expect", "").lower() == "100-continue":
        reader.conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")   # else curl waits a second
    return HookRequest(method, target, headers, reader.exactly(int(length)))


def verify_hook_request(secret: bytes, req: HookRequest, now: float,
                        seen: SeenSignatures) -> None:
    """Refuse a request that is unsigned, signed under another secret or over other bytes,
    timed outside the window either way, or whose signature was accepted before."""
    stamp, nonce, signature = (req.headers.get(h.lower(), "")
                               for h in (HOOK_TIMESTAMP, HOOK_NONCE, HOOK_SIGNATURE))
    if not (stamp and nonce and signature):
        raise _unauthorized(f"{HOOK_TIMESTAMP}, {HOOK_NONCE} and {HOOK_SIGNATURE} are required")
    if not _HOOK_TIMESTAMP_RE.fullmatch(stamp) or abs(now - int(stamp)) > WEBHOOK_SKEW:
        raise _unauthorized(f"{HOOK_TIMESTAMP} is not within {WEBHOOK_SKEW} seconds of this clock")
    if not _HOOK_NONCE_RE.fullmatch(nonce):
        raise _unauthorized(f"{HOOK_NONCE} is 1 to {WEBHOOK_MAX_NONCE} visible characters")
    want = "v1=" + hook_signature(secret, stamp, nonce, req.method, req.target, req.body)
    if not _HOOK_SIGNATURE_RE.fullmatch(signature) or \
            not hmac.compare_digest(want.encode("ascii"), signature.encode("ascii")):
        raise _unauthorized("the signature does not verify")
    if not seen.first_use(signature, int(stamp) + WEBHOOK_SKEW, now):
        raise _unauthorized("this signature was used before: sign each request anew")


# Each route: its method and its path's parts after /runs/RUN, ID standing for an approval's
# id; any query is refused but show's choice of format.
_HOOK_ROUTES = {("GET", "approvals"): "list", ("GET", "approvals", "ID"): "show",
                ("POST", "approvals", "ID", "approve"): "approve",
                ("POST", "approvals", "ID", "reject"): "reject", ("POST", "cancel"): "cancel"}
_HOOK_SHOW_QUERIES = ("", "format=text", "format=json")


def hook_route(req: HookRequest) -> HookRoute:
    """The route a verified request names. Each names its run; any other is not found."""
    path, _, query = req.target.partition("?")
    try:
        parts = [urllib.parse.unquote(p, errors="strict") for p in path.split("/")[1:]]
    except UnicodeDecodeError:
        raise _bad("the path is not UTF-8 once unquoted") from None
    if len(parts) < 3 or parts[0] != "runs" or not all(parts):
        raise WebhookRefusal(404, "not_found", "no such route")
    shape = [req.method] + parts[2:]
    if len(shape) > 2:
        shape[2] = "ID"                 # the approval's id, whatever it is
    action = _HOOK_ROUTES.get(tuple(shape))
    if action is None or query not in (_HOOK_SHOW_QUERIES if action == "show" else ("",)):
        raise WebhookRefusal(404, "not_found", "no such route")
    text = query == "format=text" or "text/plain" in req.headers.get("accept", "").lower()
    return HookRoute(action, parts[1], parts[3] if len(parts) > 3 else "",
                     action == "show" and text)


def _hook_body(raw: bytes, route: HookRoute, fields: tuple) -> dict:
    """A decision's body: an object of strings naming the run (and approval) of its path,
    with the hash shown and an identity. Anything else is refused, not guessed at."""
    try:
        doc = parse_json(raw)           # strict: a repeated "hash" is refused, not resolved
    except JSONError as exc:
        raise _bad(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
        raise _bad(f"the body is an object of strings: {', '.join(fields)}")
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise _bad(f"the body has a field {sanitize(unknown[0])!r} that no decision has")
    missing = [f for f in fields if f not in ("note", "view", "outcome") and not doc.get(f)]
    if missing:
        raise _bad(f"the body lacks {missing[0]}")
    if doc["run_id"] != route.run or doc.get("approval_id", route.approval) != route.approval:
        raise _bad("the body names another run or approval than its path")
    return doc


# Each outcome of the store, in the error table; the first class that matches decides.
_HOOK_OUTCOMES = ((NotFound, 404, "not_found"), (ApprovalExpired, 410, "expired"),
                  (AttemptSettled, 409, "late_outcome"), (NotPending, 409, "not_pending"),
                  (ApprovalChanged, 409, "approval_changed"), (UsageError, 400, "bad_request"),
                  (ApprovalHashMismatch, 409, "approval_hash"), (StoreError, 503, "unavailable"),
                  (RunStateError, 409, "run_not_waiting"))


def _hook_refusal(exc: ProxyError, route: HookRoute) -> WebhookRefusal:
    if isinstance(exc, WebhookRefusal):
        return exc
    for kind, status, code in _HOOK_OUTCOMES:
        if isinstance(exc, kind):
            if kind is RunStateError and route.action == "cancel":
                code = "run_finished"
            return WebhookRefusal(status, code, sanitize(str(exc)))
    return WebhookRefusal(500, "internal", sanitize(str(exc)))


def _hook_json(status: int, doc: dict) -> tuple[int, str, bytes]:
    """Our own encoder; DEL, C1 controls and bidirectional characters as \\u escapes (the
    same value), so an answer read on a terminal cannot drive it."""
    text = _JSON_INERT.sub(_json_escape, dump_json(doc))
    return status, _HOOK_JSON, (text + "\n").encode("utf-8")


def _hook_row(a: Approval) -> dict:
    """An approval's state. Ids and the hash as stored (a caller sends them back); every other
    field of the row sanitised."""
    row = {"id": a.id, "run_id": a.run_id, "hash": a.hash}
    row.update({k: sanitize(str(v)) for k, v in _approval_row(a).items() if k not in row})
    return row


def _hook_record(read: Callable[[], bytes]) -> Any:
    """A recorded JSON value of an approval, or why it could not be read."""
    try:
        data = read()
        return read_own(data) if data.strip(JSON_WS) else {}
    except (ProxyError, KeyError, ValueError) as exc:
        return {"unread": sanitize(str(exc))}


def _hook_view(view: ApprovalView) -> dict:
    """What the view adds to a row: the late outcome of the attempt it asks about, the
    attempt, and the view's digest, which a decision may carry as "view" to be bound to all
    of it."""
    return {**_late(view), "attempt": None if view.attempt is None else
            {sanitize(str(k)): sanitize(str(v)) for k, v in view.attempt.items()},
            "view": view.digest}


def _hook_approval(store: Store, a: Approval) -> dict:
    """One approval in full: its state, everything its hash binds, and its view."""
    view = view_of(store, a)
    # A key the facts give again keeps its place in the row and takes the facts' value.
    return {**_hook_row(a), **_hook_view(view), "arguments": _hook_record(lambda: a.request().args),
            "capability": _hook_record(lambda: a.capability),
            "presentation": _hook_record(lambda: a.presentation),
            **approval_facts(a, view, limits_now(store._read, a, time.time()))}


def _hook_run(run: Run) -> dict:
    return {"id": run.id, "status": sanitize(run.status), "reason": sanitize(run.reason)}


def _approval_under(store: Store, route: HookRoute) -> tuple[Run, Approval]:
    run, approval = store.get_run(route.run), store.get_approval(route.approval)
    if approval.run_id != route.run:
        raise NotFound(f"approval {route.approval} is not an approval of run {route.run}")
    return run, approval


class Webhook:
    """The HTTP approval channel over one database: accepts connections, answers each once,
    and keeps the rate and the signatures seen."""

    def __init__(self, db_path: str, secret: bytes, log: Callable[[str], None],
                 clock: Callable[[], float] = time.time):
        self.db_path, self.secret, self.clock = db_path, secret, clock
        self.bucket = TokenBucket(WEBHOOK_RATE, WEBHOOK_BURST)
        self.seen = SeenSignatures(WEBHOOK_SEEN_MAX)
        self.slots = threading.BoundedSemaphore(WEBHOOK_MAX_CONNECTIONS)
        self._log, self._log_lock = log, threading.Lock()
        self._open: dict[socket.socket, _HookReader] = {}       # by connection, until closed
        self._open_lock = threading.Lock()

    def log(self, text: str) -> None:
        with self._log_lock:
            self._log(text)

    def serve(self, sock: socket.socket, stop: threading.Event) -> None:
        """Accept until ``stop`` is set, then wait (bounded) for the requests in flight."""
        sock.settimeout(WEBHOOK_ACCEPT_POLL)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except socket.timeout:      # the poll: look at the stop flag again
                continue
            except OSError:             # out of descriptors, a reset in accept: back off, not spin
                stop.wait(WEBHOOK_ACCEPT_POLL)
                continue
            if not self.slots.acquire(blocking=False):
                self._drop_stalled()
                if not self.slots.acquire(timeout=WEBHOOK_SLOT_WAIT):
                    conn.close()        # every slot busy with a whole request: dropped unread
                    continue
            with self._open_lock:
                self._open[conn] = _HookReader(conn, time.monotonic())
            threading.Thread(target=self.handle_connection, args=(conn,), daemon=True).start()
        deadline = time.monotonic() + WEBHOOK_REQUEST_SECONDS + WEBHOOK_SEND_SECONDS
        for _ in range(WEBHOOK_MAX_CONNECTIONS):
            if not self.slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break

    def _drop_stalled(self) -> None:
        """Every slot is taken: end the oldest connection that has not sent a whole head
        (its thread then gives its slot back)."""
        with self._open_lock:
            stalled = [reader for reader in self._open.values() if not reader.head_done]
        if stalled:
            with contextlib.suppress(OSError):
                min(stalled, key=lambda reader: reader.accepted).conn.shutdown(socket.SHUT_RDWR)

    def handle_connection(self, conn: socket.socket) -> None:
        """Answer one accepted connection, close it, and give back the slot its caller took."""
        try:
            self._exchange(conn)
        except OSError:
            pass                        # the client went away or ran out its deadline
        except Exception as exc:        # a defect must not pass unseen, nor end the server
            self.log(f"webhook: internal error: {type(exc).__name__}: {exc}")
        finally:
            with self._open_lock:
                self._open.pop(conn, None)
            conn.close()
            self.slots.release()

    def _exchange(self, conn: socket.socket) -> None:
        try:
            if not self.bucket.take():
                # Judged before a byte is read: a flood costs no parsing, no HMAC, no database.
                raise WebhookRefusal(429, "rate_limited", "too many requests: try again later")
            with self._open_lock:       # accepted by serve(), or handed in by a caller
                reader = self._open.setdefault(conn, _HookReader(conn, time.monotonic()))
            req = read_hook_request(reader)
        except WebhookRefusal as refusal:
            self._send(conn, *self._error(refusal))
            _linger(conn)               # the body, or the rest of the head, was left unread
            return
        self._send(conn, *self.answer(req))

    def answer(self, req: HookRequest) -> tuple[int, str, bytes]:
        """Verify, route and act; every refusal an answer from the error table."""
        try:
            verify_hook_request(self.secret, req, self.clock(), self.seen)
            route = hook_route(req)
            store = Store.open_existing(self.db_path, readonly=route.action in ("list", "show"))
        except WebhookRefusal as refusal:
            return self._error(refusal)
        except StoreError as exc:       # the file itself gone or unsafe: not the run's 404
            return self._error(WebhookRefusal(503, "unavailable",
                                              f"the database cannot be opened: {exc}"))
        try:
            return getattr(self, "_do_" + route.action)(store, route, req)
        except ProxyError as exc:
            return self._error(_hook_refusal(exc, route))
        except (ValueError, TypeError, KeyError) as exc:    # a row edited past reading
            self.log(f"webhook: run {route.run}: a record could not be read ({type(exc).__name__})")
            return self._error(WebhookRefusal(500, "internal", "a record of this run could "
                                                               "not be read"))
        finally:
            store.close()

    def _error(self, refusal: WebhookRefusal) -> tuple[int, str, bytes]:
        return _hook_json(refusal.status, {"error": sanitize(str(refusal)), "code": refusal.code})

    def _do_list(self, store: Store, route: HookRoute, req: HookRequest):
        run = store.get_run(route.run)
        # A pending row on a run that no longer waits (edited, or cancelled by an older
        # build) waits for nothing: listed, it would be read as waiting.
        pending = store.pending_approvals(route.run) if run.status == WAITING else []
        return _hook_json(200, {"run_id": route.run, "total": len(pending), "approvals":
                                [dict(_hook_row(a), **_hook_view(view_of(store, a)))
                                 for a in pending[:WEBHOOK_LIST_LIMIT]]})

    def _do_show(self, store: Store, route: HookRoute, req: HookRequest):
        run, approval = _approval_under(store, route)
        if approval.status == PENDING:
            approval.verify()           # a row edited behind the proxy's back is not shown
            if run.status != WAITING:
                raise WebhookRefusal(409, "run_finished" if run.status in TERMINAL else
                                     "run_not_waiting", f"run {run.id} is {run.status}: "
                                     f"approval {approval.id} waits for nothing")
        if approval.status == EXPIRED or \
                (approval.status == PENDING and _expired(approval, self.clock())):
            # Shown without writing: only a decision on it expires it and cancels the run.
            raise WebhookRefusal(410, "expired", f"approval {approval.id} expired at "
                                                 f"{approval.expires_at}")
        if route.as_text:
            text = "\n".join(approval_block(store, approval, store.path)) + "\n"
            return 200, _HOOK_TEXT, text.encode("utf-8")
        return _hook_json(200, {"approval": _hook_approval(store, approval)})

    def _do_approve(self, store: Store, route: HookRoute, req: HookRequest):
        doc = _hook_body(req.body, route, _DECISION_FIELDS)
        approve = route.action == "approve"
        # The operator's word on a cut-off attempt, as reject -outcome takes it (unknown
        # unless given); an outcome on any other decision is refused before it is made.
        word = operator_word(_approval_under(store, route)[1], approve, doc.get("outcome"))
        approval, run = decide_approval(store, route.run, route.approval, approve, doc["by"],
                                        doc.get("note", ""), doc["hash"], self.clock(),
                                        view=doc.get("view", ""), outcome=word)
        said = decision_said(approval, run, word)
        self.log(f"webhook: approval {approval.id} of run {run.id} by {doc['by']}: {said}")
        return _hook_json(202 if approve else 200, {"approval": _hook_row(approval),
                                                    "run": _hook_run(run), "next": said})

    _do_reject = _do_approve

    def _do_cancel(self, store: Store, route: HookRoute, req: HookRequest):
        doc = _hook_body(req.body, route, _CANCEL_FIELDS)
        run = cancel_run(store, route.run, doc["by"], doc.get("note", ""), self.clock())
        self.log(f"webhook: run {run.id}: cancelled by {doc['by']}")
        return _hook_json(200, {"run": _hook_run(run)})

    def _send(self, conn: socket.socket, status: int, ctype: str, body: bytes) -> None:
        head = (f"HTTP/1.1 {status} {_HOOK_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                "X-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n")
        conn.settimeout(WEBHOOK_SEND_SECONDS)      # bounds the whole sendall
        conn.sendall(head.encode("ascii") + body)


def _linger(conn: socket.socket) -> None:
    """After answering a request left unread, drop what the client still sends, for a
    bounded time: closing with unread bytes resets the connection, and the client could
    lose the answer."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        deadline, dropped = time.monotonic() + WEBHOOK_LINGER_SECONDS, 0
        while dropped < WEBHOOK_LINGER_BYTES and time.monotonic() < deadline:
            conn.settimeout(max(0.0, deadline - time.monotonic()))
            data = conn.recv(WEBHOOK_RECV)
            if not data:
                break
            dropped += len(data)


def cmd_webhook(args, out: Out) -> int:
    host, port, family = parse_listen(args.listen, args.public)
    secret = read_hook_secret(args.secret_file)
    path = _database_path(args)
    open_database(path, readonly=True).close()     # refuse now, not per request
    hook = Webhook(path, secret, out.log)
    stop = threading.Event()
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(WEBHOOK_BACKLOG)
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        out.log(f"webhook listening on http://{shown}:{sock.getsockname()[1]} for {path}")
        out.stderr.flush()
        # SIGTERM and SIGINT set ``stop`` (the accept loop looks at it) while serving; only
        # the main thread can set a handler, so served from another thread, none is set.
        on_main = threading.current_thread() is threading.main_thread()
        saved = {s: signal.signal(s, lambda *_: stop.set())
                 for s in ((signal.SIGTERM, signal.SIGINT) if on_main else ())}
        try:
            hook.serve(sock, stop)
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
    out.log("webhook stopped")
    return 0


def cmd_sign(args, out: Out) -> int:
    """Print the headers that sign one request to the webhook, for an operator's script."""
    if args.method not in ("GET", "POST"):
        raise UsageError("sign: -method is GET or POST")
    if not args.path or not _HOOK_TARGET_RE.fullmatch(args.path):
        raise UsageError("sign: -path is the request's path from its /, query included, "
                         "e.g. /runs/RUN/approvals/ID/approve")
    if args.body is not None and args.body_file is not None:
        raise UsageError("sign: -body and -body-file are exclusive")
    body = args.body.encode("utf-8") if args.body is not None else b""
    if args.body_file is not None:
        with open(args.body_file, "rb") as f:
            body = f.read(WEBHOOK_MAX_BODY + 1)
    if len(body) > WEBHOOK_MAX_BODY:
        raise UsageError(f"sign: the body is over {WEBHOOK_MAX_BODY} bytes; the webhook refuses it")
    headers = sign_request(read_hook_secret(args.secret_file), args.method, args.path, body,
                           time.time())
    if args.json:
        out.json(headers)
    else:
        for name, value in headers.items():
            out.line(f"{name}: {value}")
    return 0


_HOOK_COMMANDS = {"webhook": cmd_webhook, "sign": cmd_sign}


# ==== 33. main ====

def main(argv: list[str] | None = None, stdin=None, stdout=None, stderr=None) -> int:
    """Run one command; returns the exit status (0 success, 1 failure, 2 usage error)."""
    argv = sys.argv[1:] if argv is None else argv
    out = Out(stdout or sys.stdout, stderr or sys.stderr, stdin or sys.stdin)
    shown = help_text(argv)
    if shown is not None:
        out.line(shown)
        return 0
    args = None
    try:
        args = build_parser().parse_args(argv)
        if not args.command and args.config and not args.db:
            args.command = "serve"
        if not args.command:
            raise UsageError("no command given")
        if args.command in _PROXY_COMMANDS:
            return run_proxy_command(args, out)
        if args.command in _HOOK_COMMANDS:
            return _HOOK_COMMANDS[args.command](args, out)
        return run_operator(args, out)
    except UsageError as exc:
        out.log(str(exc))
        out.stderr.write(USAGE + "\n")
        return 2
    except BrokenPipeError:             # `runs | head`: the reader went away; end quietly
        # stdout is pointed at /dev/null, so that the interpreter's last flush of what is
        # still buffered does not print a traceback of its own.
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, out.stdout.fileno())
            os.close(fd)
        return 1
    except (ProxyError, ValueError, OSError) as exc:
        out.log("error: " + _describe_failure(exc, getattr(args, "command", "")))
        return 1


if __name__ == "__main__":
    sys.exit(main())
