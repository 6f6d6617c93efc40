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
no limits or policy over a conversation's history. The duplicate rule refuses a deliberate
identical repeat of a mutating call inside the window, not only a retry. Results are capped and
flattened. The pin covers what a server presents, not what it does.

What it keeps: an approval bound by hash to the exact request, durable across restarts, with
the policy evaluated again when the request is collected; a mutating call whose outcome is
unknown is not run again without an operator's approval; the audit record is committed with
each state change, in a SHA-256 hash chain; an identical mutating call is not executed twice
within the window.

Trust boundaries
----------------
- Bytes from the host (the model's arguments) and from upstream servers (results, schemas,
  descriptions) are hostile. They are parsed by the strict parser of section 3, never by
  Python's lenient ``json``; text from them is sanitised (section 5) before it reaches a
  terminal or the model's prose answers.
- The database, the configuration and the manifests are trusted only while no one else can
  write them: the store refuses files others can write, symbolic links, and schemas holding
  triggers or views.
- The operator decides approvals outside the host, from a shell; a decision is bound to the
  hash of exactly what the operator was shown.

Sections, in dependency order
-----------------------------
 1. Constants and limits
 2. Errors
 3. Strict JSON
 4. Canonical JSON and request keys
 5. Sanitising
 6. Schema validation
 7. Policy
 8. The store
 9. The gate
10. Operator commands
11. main
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import datetime as _dt
import hashlib
import hmac
import json
import os
import re
import secrets
import sqlite3
import stat
import sys
import threading
import time
import unicodedata
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Awaitable, Callable, Iterable

# ==== 1. Constants and limits ====
# Every bound the proxy enforces is named here; bodies use these names, never bare numbers.

MAX_DEPTH = 256                      # nesting of arrays and objects in any JSON we accept
MAX_NUMBER_LITERAL = 10_000          # bytes in one number literal
MAX_EXPONENT = 10_000                # absolute value of a number's written exponent
MAX_EXPONENT_DIGITS = 5              # exponent digits (after leading zeros) before we refuse
NUMBER_SHOWN = 24                    # bytes of a refused literal quoted in the error
MAX_RESULT_BYTES = 64 * 1024         # a result or quoted result shown to the model
MAX_POLICY_ID_BYTES = 256            # a policy identity
MAX_SCHEMA_ERRORS = 8                # schema failures listed in one message

SCHEMA_VERSION = 1                   # the runtime tables this build writes
BUSY_TIMEOUT_MS = 5000               # SQLite busy_timeout on every connection
WAL_SWITCH_SECONDS = 5.0             # how long to retry switching to WAL while busy
WAL_SWITCH_STEP = 0.005
DEFAULT_LEASE_TTL = 30.0             # seconds a run's lease lasts without renewal
LEASE_RENEW_FRACTION = 3             # the heartbeat renews every ttl / this
RECORD_DEADLINE = 10.0               # seconds a tool's outcome may take to be recorded
DEFAULT_APPROVAL_TTL = 24 * 3600.0
DEFAULT_GRANT_TTL = 24 * 3600.0

MAX_PAGE_TEXT = 65_536               # characters of one column an operator page reads
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
INTERRUPTED_REASON = "interrupted while executing; outcome unknown"
INTERRUPTED_NOTICE = (
    "This tool call started, and the process running it stopped before its outcome was "
    "recorded, so whether it took effect is unknown. Approving runs it again with these "
    "arguments; rejecting ends the run.")

SIDE_EFFECTS = ("read_only", "local_mutation", "remote_mutation", "destructive")
OUTCOMES = ("allow", "require_approval", "deny", "abort")
DEFAULT_POLICY = {"read_only": "allow", "local_mutation": "allow",
                  "remote_mutation": "require_approval", "destructive": "deny"}

RUNNING, WAITING = "RUNNING", "WAITING_FOR_APPROVAL"
COMPLETED, FAILED, CANCELLED = "COMPLETED", "FAILED", "CANCELLED"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})

PENDING, APPROVED, REJECTED, EXPIRED = "pending", "approved", "rejected", "expired"

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


class LeaseLost(ProxyError):
    """This process no longer holds the lease of the run it was working on."""


class NotPending(ProxyError):
    """The approval was already decided or has expired."""


class ApprovalExpired(NotPending):
    """The approval, or the grant it became, expired before it was used."""


class ApprovalHashMismatch(ProxyError):
    """The approval's stored hash is not the hash of its stored contents."""


class ApprovalChanged(ProxyError):
    """The approval is not the one the operator was shown."""


class UsageError(ProxyError):
    """A command line that cannot be carried out as written."""


# ==== 3. Strict JSON ====
# A parser over bytes that refuses everything Python's json lets through: repeated keys,
# unpaired surrogate escapes, NaN and Infinity, leading zeros, "\u+123", raw control
# characters, trailing commas. It keeps each number's literal text, because 10, 10.0 and 1e1
# are different requests. Checks run in a fixed order and the first failing one is reported:
# depth, UTF-8, syntax, surrogates, repeated keys, number bounds.

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_STRING_CHUNK = re.compile(r'[^"\\\x00-\x1f]*')
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_BRACKETS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[\[{]|[\]}]', re.DOTALL)
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f",
                   "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = (("true", True), ("false", False), ("null", None))


@dataclasses.dataclass(frozen=True, slots=True)
class Num:
    """A JSON number, kept as the literal text it was written with."""
    text: str

    def exact(self) -> Fraction:
        """The number's exact value (bounded by the literal limits of this section)."""
        return Fraction(Decimal(self.text))

    def is_integer(self) -> bool:
        return self.exact().denominator == 1


class _Parser:
    """One parse of one document. Refusals found during the walk that are not syntax errors
    are remembered (first of each kind) and raised afterwards in the fixed order."""

    def __init__(self, raw: bytes, text: str, strict: bool):
        self.raw, self.src, self.strict = raw, text, strict
        self.surrogate: tuple[str, int] | None = None
        self.duplicate: tuple[str, int] | None = None
        self.number: tuple[str, int] | None = None

    def fail(self, reason: str, pos: int) -> JSONError:
        """The error for a fault at character ``pos`` of the decoded text."""
        return JSONError(reason, self.raw, len(self.src[:pos].encode("utf-8", "surrogatepass")))

    def syntax(self, reason: str, pos: int) -> JSONError:
        return self.fail("not valid JSON: " + reason, pos)

    def skip_ws(self, pos: int) -> int:
        return _WS.match(self.src, pos).end()

    def value(self, pos: int) -> tuple[int, Any]:
        src = self.src
        if pos >= len(src):
            raise self.syntax("unexpected end of input", pos)
        ch = src[pos]
        if ch == "{":
            return self.obj(pos + 1)
        if ch == "[":
            return self.array(pos + 1)
        if ch == '"':
            return self.string(pos + 1)
        if ch == "-" or "0" <= ch <= "9":
            return self.num(pos)
        for word, val in _LITERALS:
            if src.startswith(word, pos):
                return pos + len(word), val
        raise self.syntax(f"unexpected character {_show_char(ch)}", pos)

    def obj(self, pos: int) -> tuple[int, dict]:
        out: dict[str, Any] = {}
        pos = self.skip_ws(pos)
        if pos < len(self.src) and self.src[pos] == "}":
            return pos + 1, out
        while True:
            if pos >= len(self.src):
                raise self.syntax("unexpected end of input", pos)
            if self.src[pos] != '"':
                reason = "trailing comma" if self.src[pos] == "}" and out else \
                    f"expected a string key, found {_show_char(self.src[pos])}"
                raise self.syntax(reason, pos)
            key_at = pos
            pos, key = self.string(pos + 1)
            pos = self.skip_ws(pos)
            if pos >= len(self.src) or self.src[pos] != ":":
                raise self.syntax("expected ':' after an object key", pos)
            pos, val = self.value(self.skip_ws(pos + 1))
            if key in out and self.duplicate is None:
                self.duplicate = (f"duplicate key {_quote(key)}", key_at)
            out[key] = val
            pos = self.skip_ws(pos)
            if pos < len(self.src) and self.src[pos] == ",":
                pos = self.skip_ws(pos + 1)
                continue
            if pos < len(self.src) and self.src[pos] == "}":
                return pos + 1, out
            raise self.syntax("expected ',' or '}' in an object", pos)

    def array(self, pos: int) -> tuple[int, list]:
        out: list[Any] = []
        pos = self.skip_ws(pos)
        if pos < len(self.src) and self.src[pos] == "]":
            return pos + 1, out
        while True:
            if pos < len(self.src) and self.src[pos] == "]":
                raise self.syntax("trailing comma", pos)
            pos, val = self.value(pos)
            out.append(val)
            pos = self.skip_ws(pos)
            if pos < len(self.src) and self.src[pos] == ",":
                pos = self.skip_ws(pos + 1)
                continue
            if pos < len(self.src) and self.src[pos] == "]":
                return pos + 1, out
            raise self.syntax("expected ',' or ']' in an array", pos)

    def string(self, pos: int) -> tuple[int, str]:
        """Parse from just after the opening quote to just after the closing one."""
        src, parts = self.src, []
        while True:
            end = _STRING_CHUNK.match(src, pos).end()
            parts.append(src[pos:end])
            pos = end
            if pos >= len(src):
                raise self.syntax("unterminated string", pos)
            ch = src[pos]
            if ch == '"':
                return pos + 1, "".join(parts)
            if ch != "\\":
                raise self.syntax(f"control character U+{ord(ch):04X} in a string", pos)
            pos, piece = self.escape(pos)
            parts.append(piece)

    def escape(self, pos: int) -> tuple[int, str]:
        """Decode the escape at ``pos`` (a backslash); surrogate pairs combine."""
        src = self.src
        kind = src[pos + 1:pos + 2]
        if kind in _SIMPLE_ESCAPES:
            return pos + 2, _SIMPLE_ESCAPES[kind]
        if kind != "u" or not _HEX4.fullmatch(src, pos + 2, pos + 6):
            raise self.syntax("invalid escape", pos)
        code = int(src[pos + 2:pos + 6], 16)
        if 0xD800 <= code <= 0xDBFF and src[pos + 6:pos + 8] == "\\u" \
                and _HEX4.fullmatch(src, pos + 8, pos + 12):
            low = int(src[pos + 8:pos + 12], 16)
            if 0xDC00 <= low <= 0xDFFF:
                return pos + 12, chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))
        if 0xD800 <= code <= 0xDFFF:
            if self.surrogate is None:
                self.surrogate = (f"unpaired surrogate {src[pos:pos + 6]}", pos)
            return pos + 6, "\ufffd"
        return pos + 6, chr(code)

    def num(self, pos: int) -> tuple[int, Num]:
        m = _NUMBER.match(self.src, pos)
        end = m.end() if m else pos
        nxt = self.src[end:end + 1]
        if not m or (nxt and nxt in "0123456789.eE+-"):
            zero = m and m.group().lstrip("-") == "0" and nxt.isdigit()
            raise self.syntax("leading zero in a number" if zero else "malformed number", pos)
        lit = m.group()
        if self.number is None:
            problem = _number_problem(lit)
            if problem:
                self.number = (problem, pos)
        return end, Num(lit)


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
    Needs no validity: this check runs first, so absurd nesting is refused cheaply."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return None
    depth = 0
    for m in _BRACKETS.finditer(raw):
        tok = m.group()
        if tok in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return m.start()
        elif tok in (b"]", b"}"):
            depth -= 1
    return None


def parse_json(raw: bytes, strict: bool = True) -> Any:
    """Parse exactly one JSON value from ``raw``.

    Objects become dicts, arrays lists, numbers ``Num``. With ``strict`` false (only for
    documents we canonicalise but do not judge, such as an upstream's schema) a repeated key
    keeps its last value and an unpaired surrogate escape becomes U+FFFD.
    """
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    at = _depth_exceeds(raw, MAX_DEPTH)
    if at is not None:
        raise JSONError(f"nested deeper than {MAX_DEPTH} levels", raw, at)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONError("not valid UTF-8", raw, exc.start) from None
    p = _Parser(raw, text, strict)
    pos = p.skip_ws(0)
    if pos >= len(text):
        raise p.syntax("no value", pos)
    pos, value = p.value(pos)
    pos = p.skip_ws(pos)
    if pos != len(text):
        raise p.syntax("data after the value", pos)
    for found in (p.surrogate, p.duplicate) if strict else ():
        if found:
            raise p.fail(*found)
    if p.number:
        raise p.fail(*p.number)
    return value


def check_json(raw: bytes) -> None:
    """Refuse what the strict parser refuses; accept everything else."""
    parse_json(raw)


# ==== 4. Canonical JSON and request keys ====
# One spelling for each value: keys sorted by UTF-8 bytes, no insignificant whitespace,
# strings escaped one fixed way, number literals verbatim. Hashes and request keys are taken
# over this form, so key order and escape spelling never matter and literals always do.

_CANON_ESCAPE = re.compile('[\x00-\x1f"\\\\<>&\u2028\u2029]')
_POLICY_ESCAPE = re.compile('[\x00-\x1f"\\\\]')
_NAMED_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f",
                  "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(m: re.Match) -> str:
    ch = m.group()
    return _NAMED_ESCAPES.get(ch) or f"\\u{ord(ch):04x}"


def _encode(value: Any, out: list[str], escaper: re.Pattern) -> None:
    if isinstance(value, str):
        out.append('"' + escaper.sub(_escape_char, value) + '"')
    elif isinstance(value, Num):
        out.append(value.text)
    elif isinstance(value, dict):
        out.append("{")
        # Python orders str by code point, which for scalar values is UTF-8 byte order.
        for i, key in enumerate(sorted(value)):
            if i:
                out.append(",")
            out.append('"' + escaper.sub(_escape_char, key) + '":')
            _encode(value[key], out, escaper)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, out, escaper)
        out.append("]")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif value is None:
        out.append("null")
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")


def encode_canonical(value: Any) -> bytes:
    """The canonical bytes of an already parsed value."""
    out: list[str] = []
    _encode(value, out, _CANON_ESCAPE)
    return "".join(out).encode("utf-8")


def canonical_json(raw: bytes) -> bytes:
    """The canonical form of ``raw``; raises JSONError for anything the strict parser refuses."""
    return encode_canonical(parse_json(raw))


def policy_json(raw: bytes, strict: bool = True) -> bytes:
    """The canonical form without HTML escaping: what a policy is handed. Never hashed."""
    out: list[str] = []
    _encode(parse_json(raw, strict), out, _POLICY_ESCAPE)
    return "".join(out).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_hash(raw: bytes) -> str:
    """Hash of the canonical form, or of the bytes themselves when they are not JSON."""
    try:
        return sha256_hex(canonical_json(raw))
    except JSONError:
        return sha256_hex(raw)


def request_key(tool: str, raw_args: bytes) -> str | None:
    """SHA-256 over the tool name, a zero byte and the canonical arguments; None when the
    arguments have no canonical form (such a call never matches another)."""
    try:
        canon = canonical_json(raw_args)
    except JSONError:
        return None
    return sha256_hex(tool.encode("utf-8") + b"\x00" + canon)


def dump_json(value: Any) -> str:
    """Compact JSON text of a value built by this module (dicts keep their order, raw JSON
    fragments wrapped in ``Raw`` are embedded as they are)."""
    out: list[str] = []
    _dump(value, out)
    return "".join(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Raw:
    """Bytes already checked as JSON, embedded verbatim when a record is written."""
    data: bytes


def _dump(value: Any, out: list[str]) -> None:
    if isinstance(value, Raw):
        out.append(value.data.decode("utf-8"))
    elif isinstance(value, Num):
        out.append(value.text)
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + json.dumps(key, ensure_ascii=False) + ":")
            _dump(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _dump(item, out)
        out.append("]")
    elif isinstance(value, float):
        raise TypeError("floats are not written into records; use Num or int")
    else:
        out.append(json.dumps(value, ensure_ascii=False))


def to_plain(value: Any) -> Any:
    """A parsed value with numbers made Python numbers, for display and simple reads."""
    if isinstance(value, Num):
        exact = value.exact()
        return int(exact) if exact.denominator == 1 and "." not in value.text \
            and "e" not in value.text.lower() else float(value.text)
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


def loads_own(text: str | bytes) -> Any:
    """Parse a record this module wrote, with numbers as plain Python numbers."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return to_plain(parse_json(text, strict=False))


# ==== 5. Sanitising ====
# Text a model, a server or an operator chose can reach a terminal or a model's prose. It is
# made inert: invalid UTF-8 becomes U+FFFD (one per run of bad bytes), CR and LF become
# spaces, C0, DEL and C1 controls are written \xHH, bidirectional and invisible characters
# \u{hhhh}, and a run of combining marks keeps its first four.

_INVISIBLE = ("\u202a-\u202e\u2066-\u2069\u061c\u200e\u200f\u200b-\u200d\u2060-\u2064"
              "\ufeff\u00ad\u180e\u2028\u2029\U000e0000-\U000e007f")
_NEEDS_WORK = re.compile(f"[\x00-\x1f\x7f-\x9f{_INVISIBLE}\ud800-\udfff]")
_INVISIBLE_RE = re.compile(f"[{_INVISIBLE}]")
_BAD_BYTES = re.compile("[\udc80-\udcff]+")
MAX_COMBINING = 4


def _decode_lossy(data: bytes) -> str:
    """Decode UTF-8, one U+FFFD for each maximal run of invalid bytes."""
    return _BAD_BYTES.sub("\ufffd", data.decode("utf-8", "surrogateescape"))


def _has_combining(text: str) -> bool:
    return not text.isascii() and any(unicodedata.combining(c) or
                                      unicodedata.category(c)[0] == "M" for c in text)


def sanitize(text: str | bytes) -> str:
    """Make text safe to print on a terminal or quote to a model. Does not bound length."""
    if isinstance(text, bytes):
        text = _decode_lossy(text)
    if not _NEEDS_WORK.search(text) and not _has_combining(text):
        return text
    # Lone surrogates in a str stand for bytes that were not UTF-8.
    text = re.sub("[\ud800-\udfff]+", "\ufffd", text)
    out: list[str] = []
    marks = 0
    for ch in text:
        if unicodedata.category(ch)[0] == "M":
            marks += 1
            if marks <= MAX_COMBINING:
                out.append(ch)
            continue
        if marks > MAX_COMBINING:
            out.append(f"[+{marks - MAX_COMBINING} combining marks dropped]")
        marks = 0
        code = ord(ch)
        if ch in "\r\n":
            out.append(" ")
        elif code < 0x20 or 0x7F <= code <= 0x9F:
            out.append(f"\\x{code:02x}")
        elif _INVISIBLE_RE.match(ch):
            out.append(f"\\u{{{code:04x}}}")
        else:
            out.append(ch)
    if marks > MAX_COMBINING:
        out.append(f"[+{marks - MAX_COMBINING} combining marks dropped]")
    return "".join(out)


def truncate(text: str, limit: int) -> str:
    """At most ``limit`` UTF-8 bytes without splitting a character; '…' marks a cut."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore") + "\u2026"


def clean(text: str | bytes, limit: int) -> str:
    """Sanitise, then bound to ``limit`` bytes: every piece of chosen text in a prose answer."""
    return truncate(sanitize(text), limit)


# ==== 6. Schema validation ====
# A small JSON Schema validator (draft-07 and 2020-12 keywords real servers use). A schema is
# compiled when its tool loads: a keyword we do not implement, a reference outside the
# document, or a malformed keyword refuses the tool then, so nothing is ever passed silently.
# Validation errors name the JSON pointer of the failing value.

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
_COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties",
                     "maxProperties", "minContains", "maxContains"})
_OTHER_KEYWORDS = frozenset({"type", "required", "items", "enum", "const", "pattern",
                             "uniqueItems", "$ref", "dependentRequired", "dependencies", "$id"})
SCHEMA_KEYWORDS = (_ANNOTATIONS | _SUBSCHEMA_MAPS | _SUBSCHEMA_LISTS | _SUBSCHEMA_ONE |
                   _NUMERIC | _COUNTS | _OTHER_KEYWORDS)
_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})


def _pointer(path: Iterable[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, Num):
        return "integer" if value.is_integer() else "number"
    return {dict: "object", list: "array", str: "string"}[type(value)]


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: numbers by exact value, objects without regard to order."""
    if isinstance(a, Num) and isinstance(b, Num):
        return a.exact() == b.exact()
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _hashable(value: Any) -> Any:
    """A form of a JSON value that hashes equal exactly when the values are _equal."""
    if isinstance(value, Num):
        return ("n", value.exact())
    if isinstance(value, list):
        return ("a", tuple(_hashable(v) for v in value))
    if isinstance(value, dict):
        return ("o", tuple(sorted((k, _hashable(v)) for k, v in value.items())))
    return (type(value).__name__, value)


class Schema:
    """A compiled tool input schema. ``check`` takes the raw argument bytes."""

    def __init__(self, raw: bytes):
        try:
            self.root = parse_json(raw, strict=False)
        except JSONError as exc:
            raise SchemaError(f"input schema is not JSON: {exc}") from None
        if not isinstance(self.root, (dict, bool)):
            raise SchemaError("input schema is not an object")
        self.raw = raw
        self._patterns: dict[str, re.Pattern] = {}
        self._compile(self.root, ())

    # -- compiling: every keyword is known and well formed, every $ref resolves locally --

    def _compile(self, node: Any, at: tuple) -> None:
        where = "#" + _pointer(at)
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise SchemaError(f"schema at {where} is not an object or boolean")
        for key, val in node.items():
            if key not in SCHEMA_KEYWORDS:
                raise SchemaError(f"schema at {where} uses {_quote(key)}, "
                                  "a keyword this validator does not implement")
            self._keyword(key, val, at + (key,))

    def _keyword(self, key: str, val: Any, at: tuple) -> None:
        where = "#" + _pointer(at)
        if key in _ANNOTATIONS or key == "const":
            return
        if key in _SUBSCHEMA_MAPS:
            if not isinstance(val, dict):
                raise SchemaError(f"{where} is not an object")
            for name, sub in val.items():
                if key == "patternProperties":
                    self._regex(name, where)
                self._compile(sub, at + (name,))
        elif key in _SUBSCHEMA_LISTS:
            if not isinstance(val, list) or (key != "prefixItems" and not val):
                raise SchemaError(f"{where} is not a non-empty array of schemas")
            for i, sub in enumerate(val):
                self._compile(sub, at + (i,))
        elif key in _SUBSCHEMA_ONE:
            self._compile(val, at)
        elif key == "items":
            for i, sub in enumerate(val) if isinstance(val, list) else [(None, val)]:
                self._compile(sub, at if i is None else at + (i,))
        elif key in _NUMERIC:
            if key.startswith("exclusive") and isinstance(val, bool):
                return  # draft-04 spelling: a flag on minimum/maximum
            if not isinstance(val, Num) or (key == "multipleOf" and val.exact() <= 0):
                raise SchemaError(f"{where} is not a {'positive ' if key == 'multipleOf' else ''}number")
        elif key in _COUNTS:
            if not isinstance(val, Num) or not val.is_integer() or val.exact() < 0:
                raise SchemaError(f"{where} is not a non-negative integer")
        else:
            self._other(key, val, at, where)

    def _other(self, key: str, val: Any, at: tuple, where: str) -> None:
        if key == "enum":
            if not isinstance(val, list):
                raise SchemaError(f"{where} is not an array")
        elif key == "type":
            names = val if isinstance(val, list) else [val]
            if not names or any(n not in _TYPES for n in names):
                raise SchemaError(f"{where} names a type that does not exist")
        elif key == "required":
            if not isinstance(val, list) or not all(isinstance(n, str) for n in val):
                raise SchemaError(f"{where} is not an array of strings")
        elif key == "pattern":
            if not isinstance(val, str):
                raise SchemaError(f"{where} is not a string")
            self._regex(val, where)
        elif key == "uniqueItems":
            if not isinstance(val, bool):
                raise SchemaError(f"{where} is not a boolean")
        elif key == "$ref":
            if not isinstance(val, str):
                raise SchemaError(f"{where} is not a string")
            self._resolve(val)
        elif key == "$id":
            if at != ("$id",):
                raise SchemaError(f"{where}: an $id inside the schema is not supported")
        elif key in ("dependentRequired", "dependencies"):
            if not isinstance(val, dict):
                raise SchemaError(f"{where} is not an object")
            for name, dep in val.items():
                if isinstance(dep, list) and all(isinstance(n, str) for n in dep):
                    continue
                if key == "dependencies":
                    self._compile(dep, at + (name,))
                else:
                    raise SchemaError(f"{where}/{name} is not an array of strings")

    def _regex(self, pattern: str, where: str) -> re.Pattern:
        found = self._patterns.get(pattern)
        if found is None:
            try:
                found = re.compile(pattern, re.ASCII)
            except (re.error, RecursionError, OverflowError) as exc:
                raise SchemaError(f"{where}: pattern does not compile: {exc}") from None
            self._patterns[pattern] = found
        return found

    def _resolve(self, ref: str) -> Any:
        """The subschema a local reference names. Anything else is refused: no URL is loaded."""
        if not ref.startswith("#"):
            raise SchemaError(f"$ref {_quote(ref)} is outside the schema; "
                              "only references within the schema are resolved")
        node = self.root
        frag = ref[1:]
        if frag and not frag.startswith("/"):
            raise SchemaError(f"$ref {_quote(ref)} is not a JSON pointer")
        for part in frag.split("/")[1:] if frag else []:
            part = _unquote_url(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaError(f"$ref {_quote(ref)} does not resolve")
        return node

    # -- validating --

    def check(self, raw: bytes) -> Any:
        """Parse strict JSON arguments and validate them; returns the parsed value.
        Raises JSONError for bytes that are not usable JSON, SchemaError for a mismatch."""
        value = parse_json(raw)
        errors: list[tuple[str, str]] = []
        self._validate(self.root, value, [], errors, set())
        if errors:
            shown = "; ".join(f"at '{p}': {d}" for p, d in errors[:MAX_SCHEMA_ERRORS])
            more = len(errors) - MAX_SCHEMA_ERRORS
            raise SchemaError(shown + (f"; and {more} more" if more > 0 else ""))
        return value

    def _validate(self, node: Any, value: Any, path: list, errors: list, active: set) -> None:
        if node is True:
            return
        if node is False:
            errors.append((_pointer(path), "no value is allowed here"))
            return
        # A $ref chain that comes back to where it started without consuming input would
        # recurse forever; it is a refusal, never an acceptance.
        token = (id(node), len(path), id(value))
        if token in active:
            errors.append((_pointer(path), "the schema refers to itself without end"))
            return
        active.add(token)
        try:
            for key, val in node.items():
                check = _CHECKS.get(key)
                if check:
                    check(self, node, val, value, path, errors, active)
        finally:
            active.discard(token)

    def _sub_ok(self, node: Any, value: Any, path: list, active: set) -> bool:
        errs: list = []
        self._validate(node, value, path, errs, active)
        return not errs


def _unquote_url(part: str) -> str:
    return re.sub("%([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), part)


def _fail(errors: list, path: list, detail: str) -> None:
    errors.append((_pointer(path), detail))


def _show(value: Any) -> str:
    return truncate(sanitize(encode_canonical(value).decode("utf-8")), NUMBER_SHOWN * 4)


def _k_type(s, node, want, value, path, errors, active):
    names = want if isinstance(want, list) else [want]
    kind = _kind(value)
    if kind in names or (kind == "integer" and "number" in names):
        return
    _fail(errors, path, f"got {kind}, want {' or '.join(names)}")


def _k_enum(s, node, options, value, path, errors, active):
    if not any(_equal(value, o) for o in options):
        _fail(errors, path, "value must be one of " + ", ".join(_show(o) for o in options))


def _k_const(s, node, const, value, path, errors, active):
    if not _equal(value, const):
        _fail(errors, path, f"value must be {_show(const)}")


_RANGE = (("minimum", lambda v, b: v < b), ("exclusiveMinimum", lambda v, b: v <= b),
          ("maximum", lambda v, b: v > b), ("exclusiveMaximum", lambda v, b: v >= b))


def _k_range(s, node, _unused, value, path, errors, active):
    if not isinstance(value, Num):
        return
    v = value.exact()
    for key, outside in _RANGE:
        bound = node.get(key)
        if bound is True:  # draft-04 spelling: the flag makes minimum or maximum exclusive
            bound = node.get("minimum" if key == "exclusiveMinimum" else "maximum")
        if isinstance(bound, Num) and outside(v, bound.exact()):
            _fail(errors, path, f"{key}: got {value.text}, want {bound.text}")


def _k_multiple(s, node, m, value, path, errors, active):
    if isinstance(value, Num) and (value.exact() / m.exact()).denominator != 1:
        _fail(errors, path, f"multipleOf: got {value.text}, want a multiple of {m.text}")


def _k_length(s, node, _unused, value, path, errors, active):
    if not isinstance(value, str):
        return
    n = len(value)
    if "minLength" in node and n < node["minLength"].exact():
        _fail(errors, path, f"minLength: got {n} characters, want {node['minLength'].text}")
    if "maxLength" in node and n > node["maxLength"].exact():
        _fail(errors, path, f"maxLength: got {n} characters, want {node['maxLength'].text}")


def _k_pattern(s, node, pattern, value, path, errors, active):
    if isinstance(value, str) and not s._regex(pattern, "pattern").search(value):
        _fail(errors, path, f"does not match pattern {_quote(pattern)}")


def _k_count(kind: type, low: str, high: str, noun: str):
    def check(s, node, _unused, value, path, errors, active):
        if not isinstance(value, kind):
            return
        n = len(value)
        if low in node and n < node[low].exact():
            _fail(errors, path, f"{low}: got {n} {noun}, want {node[low].text}")
        if high in node and n > node[high].exact():
            _fail(errors, path, f"{high}: got {n} {noun}, want {node[high].text}")
    return check


def _k_required(s, node, names, value, path, errors, active):
    if isinstance(value, dict):
        for name in names:
            if name not in value:
                _fail(errors, path, f"missing property {_quote(name)}")


def _k_properties(s, node, _unused, value, path, errors, active):
    """properties, patternProperties and additionalProperties together, as they interact."""
    if not isinstance(value, dict):
        return
    props = node.get("properties", {})
    patterns = node.get("patternProperties", {})
    extra = node.get("additionalProperties", True)
    unexpected = []
    for name, item in value.items():
        matched = False
        if name in props:
            matched = True
            s._validate(props[name], item, path + [name], errors, active)
        for pat, sub in patterns.items():
            if s._regex(pat, "patternProperties").search(name):
                matched = True
                s._validate(sub, item, path + [name], errors, active)
        if not matched:
            if extra is False:
                unexpected.append(name)
            elif extra is not True:
                s._validate(extra, item, path + [name], errors, active)
    if unexpected:
        names = ", ".join(_quote(n) for n in unexpected)
        _fail(errors, path, f"additional properties {names} not allowed")


def _k_property_names(s, node, sub, value, path, errors, active):
    if isinstance(value, dict):
        for name in value:
            if not s._sub_ok(sub, name, path, active):
                _fail(errors, path, f"property name {_quote(name)} is not allowed")


def _k_items(s, node, _unused, value, path, errors, active):
    """prefixItems, items (either draft's form) and additionalItems together."""
    if not isinstance(value, list):
        return
    items = node.get("items", True)
    if isinstance(items, list):            # draft-07 tuple form
        prefix, rest = items, node.get("additionalItems", True)
    else:
        prefix, rest = node.get("prefixItems", []), items
    for i, item in enumerate(value):
        sub = prefix[i] if i < len(prefix) else rest
        if sub is False and i >= len(prefix):
            _fail(errors, path, f"array has {len(value)} items, at most {len(prefix)} allowed")
            return
        s._validate(sub, item, path + [i], errors, active)


def _k_contains(s, node, sub, value, path, errors, active):
    if not isinstance(value, list):
        return
    n = sum(1 for i, item in enumerate(value) if s._sub_ok(sub, item, path + [i], active))
    low = node["minContains"].exact() if "minContains" in node else 1
    if n < low:
        _fail(errors, path, f"contains: {n} items match, want at least {low}")
    if "maxContains" in node and n > node["maxContains"].exact():
        _fail(errors, path, f"contains: {n} items match, want at most {node['maxContains'].text}")


def _k_unique(s, node, flag, value, path, errors, active):
    if flag and isinstance(value, list):
        seen: set = set()
        for i, item in enumerate(value):
            h = _hashable(item)
            if h in seen:
                _fail(errors, path + [i], "uniqueItems: a repeated item")
                return
            seen.add(h)


def _k_all_of(s, node, subs, value, path, errors, active):
    for sub in subs:
        s._validate(sub, value, path, errors, active)


def _k_any_of(s, node, subs, value, path, errors, active):
    if not any(s._sub_ok(sub, value, path, active) for sub in subs):
        _fail(errors, path, "does not match any schema of anyOf")


def _k_one_of(s, node, subs, value, path, errors, active):
    n = sum(1 for sub in subs if s._sub_ok(sub, value, path, active))
    if n != 1:
        _fail(errors, path, f"matches {n} schemas of oneOf, want exactly one")


def _k_not(s, node, sub, value, path, errors, active):
    if s._sub_ok(sub, value, path, active):
        _fail(errors, path, "matches a schema it must not match")


def _k_if(s, node, cond, value, path, errors, active):
    branch = node.get("then") if s._sub_ok(cond, value, path, active) else node.get("else")
    if branch is not None:
        s._validate(branch, value, path, errors, active)


def _k_ref(s, node, ref, value, path, errors, active):
    s._validate(s._resolve(ref), value, path, errors, active)


def _k_dependent(s, node, deps, value, path, errors, active):
    if not isinstance(value, dict):
        return
    for name, dep in deps.items():
        if name not in value:
            continue
        if isinstance(dep, list):
            for need in dep:
                if need not in value:
                    _fail(errors, path, f"property {_quote(need)} is required with {_quote(name)}")
        else:
            s._validate(dep, value, path, errors, active)


# Each keyword that constrains a value, once: keywords read together (the bounds, the
# property family, the item family) hang on the one keyword that is always looked up.
_CHECKS: dict[str, Callable] = {
    "type": _k_type, "enum": _k_enum, "const": _k_const,
    "minimum": None, "maximum": None, "multipleOf": _k_multiple,
    "pattern": _k_pattern, "required": _k_required,
    "propertyNames": _k_property_names, "contains": _k_contains, "uniqueItems": _k_unique,
    "allOf": _k_all_of, "anyOf": _k_any_of, "oneOf": _k_one_of, "not": _k_not, "if": _k_if,
    "$ref": _k_ref, "dependentRequired": _k_dependent, "dependencies": _k_dependent,
    "dependentSchemas": _k_dependent,
}


def _first_of(keys: tuple[str, ...], check: Callable) -> Callable:
    """Run ``check`` once per schema node, from whichever of ``keys`` comes first in it."""
    def run(s, node, val, value, path, errors, active, _keys=keys):
        first = next(k for k in node if k in _keys)
        if first == run.key:
            check(s, node, val, value, path, errors, active)
    return run


for _keys, _check in (
        (("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), _k_range),
        (("minLength", "maxLength"), _k_length),
        (("minItems", "maxItems"), _k_count(list, "minItems", "maxItems", "items")),
        (("minProperties", "maxProperties"),
         _k_count(dict, "minProperties", "maxProperties", "properties")),
        (("properties", "patternProperties", "additionalProperties"), _k_properties),
        (("items", "prefixItems", "additionalItems"), _k_items)):
    for _key in _keys:
        _runner = _first_of(_keys, _check)
        _runner.key = _key
        _CHECKS[_key] = _runner
del _keys, _check, _key, _runner


def compile_schema(raw: bytes) -> Schema:
    """Compile a tool's input schema, refusing what this validator cannot check."""
    return Schema(raw)
