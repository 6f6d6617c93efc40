"""A hostile host: a generated corpus of frames sent over real pipes to a real proxy.

Each frame is tagged with what must happen to it: the JSON-RPC 2.0 answer it deserves (matched
by id; answers with id null are matched as a multiset), whether the upstream receives exactly
one call for it or nothing, and, for a call that executes, that the upstream's frame is the
proxy's own compact encoding of arguments equal as JSON to the ones the host sent. The
upstream (recording_server.py) logs every line it reads, byte for byte, so a CR, a raw U+2028
or a second frame hidden inside the first is seen even when its own parser would have
swallowed it. After every chunk a valid call and a ping must still be answered, and closing
stdin must end the proxy with exit code 0.

    python3 -m pytest -q -s tests/test_hostile_host.py                    # about 2,000 frames
    HOSTILE_FRAMES=10000 HOSTILE_SEED=7 python3 -m pytest -q -s tests/test_hostile_host.py
"""

from __future__ import annotations

import base64
import dataclasses
import decimal
import itertools
import json
import os
import random
import subprocess
import threading
import time
from typing import Any

import pytest

from process_helpers import PROXY, PYTHON

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDER = os.path.join(HERE, "recording_server.py")

SEED = int(os.environ.get("HOSTILE_SEED", "20261130"))
FRAMES = int(os.environ.get("HOSTILE_FRAMES", "2500"))
CHUNK = int(os.environ.get("HOSTILE_CHUNK", "300"))
BARRIER_TIMEOUT = 30.0          # seconds for a chunk to be read and its closing echo and ping
                                # answered (a sound proxy needs about one)
EXIT_TIMEOUT = 20.0             # seconds from closing stdin to the proxy's exit
SHOWN = 300                     # characters of a frame's repr in a failure message
MAX_FAILURES_SHOWN = 60
FRAME_LIMIT = 16 * 1024 * 1024  # the proxy's frame limit (DESIGN.md section 4)
HUGE_LINE = 20 * 1024 * 1024
MAX_DEPTH = 256                 # "nesting past 256 levels" is refused (proxy-seed.md)

PARSE, INVALID_REQUEST, NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
SERVER = "rec"
TOOLS = {t: f"{SERVER}_{t}" for t in ("echo", "note", "pay", "wipe")}
REFUSALS = ("PENDING_APPROVAL", "BLOCKED", "DENIED", "INVALID", "DUPLICATE", "REJECTED",
            "EXPIRED", "UNAVAILABLE", "UNKNOWN_OUTCOME", "INTERRUPTED", "IN_PROGRESS",
            "UNRECORDED")

RULES = {
    "echo": {"side_effect": "read_only", "timeout": "10s"},
    "note": {"side_effect": "local_mutation", "timeout": "10s", "repeat_window": "0s",
             "outcome": "allow"},
    "pay": {"side_effect": "remote_mutation", "timeout": "10s"},
    "wipe": {"side_effect": "destructive", "timeout": "10s"},
}


# ---- strict JSON, for what the upstream received and what the proxy answered ----

class Lit:
    """A number literal, kept as its text: 1.0 and 1 are different, as the gate says."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other):
        return type(other) is Lit and other.text == self.text

    def __hash__(self):
        return hash(("lit", self.text))

    def __repr__(self):
        return f"Lit({self.text[:40]})"


class NotStrict(ValueError):
    pass


def _pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise NotStrict(f"repeated key {k!r}")
        out[k] = v
    return out


def _constant(name):
    raise NotStrict(f"{name} is not JSON")


_STRICT = json.JSONDecoder(object_pairs_hook=_pairs, parse_float=Lit, parse_int=Lit,
                           parse_constant=_constant, strict=True)


def strict_loads(data: bytes | str) -> Any:
    """JSON as RFC 8259 has it: UTF-8, no control characters in strings, no repeated key,
    no NaN; numbers kept as their literal text. Raises ValueError."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    value, end = _STRICT.raw_decode(text)
    if end != len(text) or text[:1].isspace():
        raise NotStrict("whitespace or data around the value")
    return value


def compact_violation(text: str) -> str | None:
    """Why a line is not a compact encoding: whitespace outside strings, or a raw CR, LF,
    U+2028 or U+2029 anywhere (a line splitter may cut the frame at any of them)."""
    for ch, name in (("\r", "CR"), ("\n", "LF"), ("\u2028", "U+2028"), ("\u2029", "U+2029")):
        at = text.find(ch)
        if at >= 0:
            return f"raw {name} at offset {at}"
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in " \t":
            return f"whitespace {ch!r} outside a string at offset {i}"
    return None


def id_key(value: Any) -> tuple | None:
    """Ids compare as JSON values: 1e2 and 100 are one id, "1" and 1 are not."""
    if isinstance(value, Lit):
        try:
            return ("num", decimal.Decimal(value.text))
        except decimal.InvalidOperation:
            return ("num?", value.text)
    if isinstance(value, str):
        return ("str", value)
    if value is None:
        return None
    return ("other", repr(value))


def show(data: bytes) -> str:
    r = repr(data)
    return r if len(r) <= SHOWN else r[:SHOWN] + f"... ({len(data)} bytes)"


# ---- rendering frames, with a marker at every gap between tokens ----

# Private-use characters mark where whitespace may go (one per region) and where a byte that
# is not UTF-8 goes; they are replaced after rendering.
GAP = {"envelope": "\ue010", "params": "\ue011", "arguments": "\ue012"}
BAD_BYTE = "\ue020"
BAD_BYTE_UTF8 = BAD_BYTE.encode()


def _quote(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def render(value: Any, region: str = "envelope") -> str:
    """Compact JSON of value with GAP markers; Lit is written as its literal, a str subclass
    Verbatim as it is."""
    g = GAP[region]
    if isinstance(value, Verbatim):
        return str(value)
    if isinstance(value, dict):
        parts = []
        for k, v in value.items():
            inner = region
            if region == "envelope" and k == "params":
                inner = "params"
            elif region == "params" and k == "arguments":
                inner = "arguments"
            key = str(k) if isinstance(k, Verbatim) else _quote(k)
            parts.append(f"{g}{key}{g}:{g}{render(v, inner)}{g}")
        return "{" + ",".join(parts) + "}" if parts else "{" + g + "}"
    if isinstance(value, list):
        if not value:
            return "[" + g + "]"
        return "[" + ",".join(f"{g}{render(v, region)}{g}" for v in value) + "]"
    if isinstance(value, Lit):
        return value.text
    if isinstance(value, str):
        return _quote(value)
    return json.dumps(value)


class Verbatim(str):
    """Text placed into a frame as it is (an odd escape, a raw character, a bad token)."""


def finish(text: str, fill: dict | None = None, rng: random.Random | None = None) -> bytes:
    """Replace gap markers: those of region r with fill[r] at a random subset of its gaps
    (all gaps when rng is None), the rest with nothing; then BAD_BYTE with 0xFF."""
    fill = fill or {}
    out = []
    for ch in text:
        region = _GAP_REGION.get(ch)
        if region is None:
            out.append(ch)
        elif region in fill and (rng is None or rng.random() < 0.35):
            out.append(fill[region])
    data = "".join(out).encode("utf-8")
    return data.replace(BAD_BYTE_UTF8, b"\xff")


_GAP_REGION = {v: k for k, v in GAP.items()}


def ensure_gap(text: str, region: str, fill: str, rng: random.Random) -> str:
    """Put fill at one gap of region for certain, so a frame meant to carry it does."""
    marks = [i for i, ch in enumerate(text) if ch == GAP[region]]
    if not marks:
        return text
    i = rng.choice(marks)
    return text[:i] + fill + text[i + 1:]


# ---- the cases ----

@dataclasses.dataclass
class Case:
    family: str
    line: bytes                       # sent as it is, then LF (an LF inside splits it)
    key: tuple | None = None          # the id an answer must carry
    results: frozenset = frozenset()  # result kinds allowed in the answer with that id
    errors: frozenset = frozenset()   # error codes allowed in the answer with that id
    null: frozenset = frozenset()     # error codes allowed in an answer with id null instead
    required: bool = True             # an answer (with the id, or null) is owed
    n: int | None = None              # the call's counter, to find it at the upstream
    upstream: str = "zero"            # "one", "zero", or "if_exec"
    tool: str | None = None           # the upstream tool name for "one" and "if_exec"
    args: Any = None                  # the arguments as the strict parse reads them
    slots: list | None = None         # for a line an LF splits: (codes, owed) per piece


def split_slots(line: bytes) -> list[tuple[frozenset, bool]]:
    """What each piece of a line an LF splits is owed, with id null: a parse error for a
    piece that is not JSON, an Invalid Request for one that is JSON but no request (a piece
    that happens to look like a response is owed nothing)."""
    out = []
    for piece in line.split(b"\n"):
        if not piece.strip(b" \t\r"):
            continue
        try:
            value = strict_loads(piece.strip(b" \t\r"))
        except ValueError:
            out.append((frozenset({PARSE}), True))
            continue
        response = isinstance(value, dict) and ("result" in value or "error" in value)
        out.append((frozenset({INVALID_REQUEST}), not response))
    return out


EXEC = frozenset({"exec"})


class Corpus:
    """Frames of every family, deterministic from the seed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.counter = itertools.count(1)
        self.ids = itertools.count(1)
        self.used: set = set()          # id keys used in the current chunk

    # -- ids and calls --

    def new_id(self):
        """A fresh id: a string or an integer, never reused."""
        i = next(self.ids)
        return f"h-{i}" if i % 3 else Lit(str(10_000_000 + i))

    def args(self, tool: str = "echo", plain: bool = False, **extra) -> dict:
        n = next(self.counter)
        out = {"n": Lit(str(n))}
        out["text" if tool == "note" else "s"] = "plain text" if plain else self.text()
        out.update(extra)
        return out

    def text(self) -> str:
        pool = "abc xyz \u00e9\u4e2d\U0001f600\"\\/<>&\t\n\u2028\u2029\u0085\x7f\x01"
        return "".join(self.rng.choice(pool) for _ in range(self.rng.randint(0, 12)))

    def envelope(self, ident, method: str, params=None) -> dict:
        msg = {"jsonrpc": "2.0", "id": ident, "method": method}
        if params is not None:
            msg["params"] = params
        return msg

    def call(self, ident, tool: str, args: Any, **extra_params) -> dict:
        params = {"name": TOOLS[tool], "arguments": args}
        params.update(extra_params)
        return self.envelope(ident, "tools/call", params)

    @staticmethod
    def n_of(args: Any) -> int | None:
        n = args.get("n") if isinstance(args, dict) else None
        return int(n.text) if isinstance(n, Lit) and n.text.isdigit() else None

    def exec_case(self, family: str, line: bytes, ident, tool: str, args: dict) -> Case:
        return Case(family, line, key=id_key(ident), results=EXEC, n=self.n_of(args),
                    upstream="one", tool=tool, args=strict_loads(finish(render(args,
                                                                               "arguments"))))

    def refused_case(self, family: str, line: bytes, ident, args: Any, kinds) -> Case:
        return Case(family, line, key=id_key(ident), results=frozenset(kinds),
                    n=self.n_of(args))

    def valid_call(self, family: str, tool: str = "echo", plain: bool = False) -> Case:
        ident, args = self.new_id(), self.args(tool, plain)
        return self.exec_case(family, finish(render(self.call(ident, tool, args))), ident,
                              tool, args)

    def ping(self, family: str = "ping") -> Case:
        ident = self.new_id()
        return Case(family, finish(render(self.envelope(ident, "ping"))), key=id_key(ident),
                    results=frozenset({"empty"}))

    # -- families --

    def truncated(self) -> list[Case]:
        """A valid call (to wipe, so that any execution is plain) cut at every position."""
        ident = self.new_id()
        full = finish(render(self.call(ident, "wipe", {
            "n": Lit(str(next(self.counter))), "s": Verbatim('"a\\u00e9\\\\\\"\u00e9\U0001f600"'),
            "v": Lit("-1.5e3"), "b": True, "z": None, "l": [Lit("1"), "x"]})))
        cuts = range(1, len(full)) if self.rng.random() < 0.5 else \
            sorted(self.rng.sample(range(1, len(full)), 12))
        out = []
        for cut in cuts:
            line = full[:cut]
            if not line.strip():
                continue
            out.append(Case("truncated", line, null=frozenset({PARSE})))
        return out

    BAD_JSON = [
        b'{"jsonrpc":"2.0","id":1,"method":ping}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping",}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"},',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"}}',
        b'{"jsonrpc":"2.0","id":1,,"method":"ping"}',
        b'{"jsonrpc":"2.0" "id":1,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":Infinity,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":-Infinity,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":01,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":-01,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1.,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":.5,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":+1,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":0x10,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1e,"method":"ping"}',
        b"{'jsonrpc':'2.0','id':1,'method':'ping'}",
        b'{"jsonrpc":"2.0","id":1,"method":"ping"} /* c */',
        b'{"jsonrpc":"2.0","id":1,/* c */"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"} // c',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"} {"jsonrpc":"2.0","id":2,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1,"method":"p\\ing"}',
        b'{"jsonrpc":"2.0","id":1,"method":"p\\u00"}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"',
        b'{jsonrpc:"2.0",id:1,method:"ping"}',
        b'{"jsonrpc":"2.0","id":tru,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":True,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"}\x00',
        b'\x00{"jsonrpc":"2.0","id":1,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"]',
        b'"just a string',
        b'}',
        b']',
        b':',
        b'\\',
    ]
    BAD_CALL_ARGS = [
        b'{"n":1,}', b'{"n":NaN}', b'{"n":Infinity}', b'{"n":007}', b"{'n':1}",
        b'{"n":1 /* c */}', b'{"n":1,"s":"x"', b'{"n":1}}', b'{"n"::1}', b'{"n":1 "s":2}',
        b'{"n":[1,]}', b'{"n":-}', b'{"n":1.e5}', b'{"n":"a\\x41"}', b'{"n":undefined}',
    ]

    def invalid_json(self) -> list[Case]:
        out = [Case("invalid-json", line, null=frozenset({PARSE})) for line in self.BAD_JSON]
        for args in self.BAD_CALL_ARGS:
            ident = self.new_id()
            line = finish(render(self.call(ident, "wipe", Verbatim(args.decode()))))
            out.append(Case("invalid-json-arguments", line, key=id_key(ident),
                            null=frozenset({PARSE})))
        # A byte-order mark: the text is no longer what RFC 8259 calls JSON-RPC's input.
        # A ping either way, so that a parser allowed to skip it (RFC 8259 section 8.1) may.
        ident = self.new_id()
        line = b"\xef\xbb\xbf" + finish(render(self.envelope(ident, "ping")))
        out.append(Case("bom", line, key=id_key(ident), results=frozenset({"empty"}),
                        null=frozenset({PARSE})))
        ident = self.new_id()
        line = b"\xef\xbb\xbf" + finish(render(self.call(ident, "wipe", {"n": Lit("1")})))
        out.append(Case("bom", line, null=frozenset({PARSE}), key=id_key(ident),
                        results=frozenset({"refused"})))
        return out

    CONTROLS = [chr(c) for c in range(0x20)] + ["\x7f", "\u2028", "\u2029", "\u0085"]
    JSON_WS = (" ", "\t", "\r")

    def characters(self) -> list[Case]:
        """Each control character, DEL, U+2028, U+2029 and U+0085: escaped and raw inside
        strings, and outside strings, in the envelope, in params and in the arguments."""
        out = []
        for ch in self.CONTROLS:
            out += self._char_in_strings(ch)
            out += self._char_outside_strings(ch)
        return out

    def _char_in_strings(self, ch: str) -> list[Case]:
        out = []
        code = ord(ch)
        # Escaped, inside the arguments: a valid call that must execute, equal as JSON.
        ident, args = self.new_id(), self.args(s=Verbatim(f'"a\\u{code:04x}b"'))
        out.append(self.exec_case("char-escaped-arguments", finish(render(
            self.call(ident, "echo", args))), ident, "echo", args))
        # Escaped, inside the id: echoed as the same string.
        ident = Verbatim(f'"e{next(self.ids)}\\u{code:04x}"')
        key = ("str", json.loads(str(ident)))
        out.append(Case("char-escaped-id", finish(render(self.envelope(ident, "ping"))),
                        key=key, results=frozenset({"empty"})))
        # Raw, inside the arguments' strings.
        ident, args = self.new_id(), self.args(s=Verbatim(f'"a{ch}b"'))
        line = finish(render(self.call(ident, "echo", args)))
        if code < 0x20:
            out.append(Case("char-raw-arguments-string", line, key=id_key(ident),
                            results=frozenset({"invalid"}), null=frozenset({PARSE}),
                            n=self.n_of(args)) if ch != "\n" else
                       Case("char-raw-arguments-string", line, slots=split_slots(line),
                            n=self.n_of(args)))
        else:
            out.append(self.exec_case("char-raw-arguments-string", line, ident, "echo", args))
        # Raw, inside a key of the arguments.
        ident = self.new_id()
        args = self.args()
        args[Verbatim(f'"k{ch}"')] = "v"
        line = finish(render(self.call(ident, "echo", args)))
        if code < 0x20:
            out.append(Case("char-raw-arguments-key", line, key=id_key(ident),
                            results=frozenset({"invalid"}), null=frozenset({PARSE}),
                            n=self.n_of(args)) if ch != "\n" else
                       Case("char-raw-arguments-key", line, slots=split_slots(line),
                            n=self.n_of(args)))
        else:
            out.append(self.exec_case("char-raw-arguments-key", line, ident, "echo", args))
        # Raw, inside the envelope's id string.
        ident = Verbatim(f'"r{next(self.ids)}{ch}"')
        line = finish(render(self.envelope(ident, "ping")))
        if code < 0x20:
            out.append(Case("char-raw-id", line, slots=split_slots(line)))
        else:
            out.append(Case("char-raw-id", line, key=("str", json.loads(str(ident))),
                            results=frozenset({"empty"})))
        return out

    def _char_outside_strings(self, ch: str) -> list[Case]:
        out = []
        for region in ("envelope", "params", "arguments"):
            ident, args = self.new_id(), self.args()
            text = ensure_gap(render(self.call(ident, "echo", args)), region, ch, self.rng)
            line = finish(text, {region: ch}, self.rng)
            fam = f"char-outside-{region}"
            if ch in self.JSON_WS:
                out.append(self.exec_case(fam, line, ident, "echo", args))
            elif ch == "\n":
                pieces = [p for p in line.split(b"\n") if p.strip()]
                if len(pieces) == 1:          # only at the edges: still one valid frame
                    out.append(self.exec_case(fam, line, ident, "echo", args))
                else:
                    out.append(Case(fam, line, slots=split_slots(line), n=self.n_of(args)))
            elif region == "arguments":
                out.append(Case(fam, line, key=id_key(ident), results=frozenset({"invalid"}),
                                null=frozenset({PARSE}), n=self.n_of(args)))
            else:
                out.append(Case(fam, line, key=id_key(ident), null=frozenset({PARSE}),
                                n=self.n_of(args)))
        return out

    def whitespace(self) -> list[Case]:
        """Valid calls (echo and note) with JSON whitespace between many of their tokens."""
        out = []
        for _ in range(6):
            tool = self.rng.choice(("echo", "note"))
            ws = "".join(self.rng.choice(self.JSON_WS) for _ in range(self.rng.randint(1, 3)))
            ident, args = self.new_id(), self.args(tool)
            if tool == "echo":
                args["x"] = {"deep": [Lit("1.0"), Lit("-0"), Lit("1E+2"), "\u2028", None,
                                      {"k": Lit("123456789012345678901234567890")}]}
            text = render(self.call(ident, tool, args))
            for region in GAP:
                text = ensure_gap(text, region, ws, self.rng)
            line = finish(text, {r: ws for r in GAP}, self.rng)
            out.append(self.exec_case("whitespace", line, ident, tool, args))
        return out

    SMUGGLED = '{"jsonrpc":"2.0","id":99,"method":"tools/call","params":{"name":"%s","arguments":{}}}'

    def smuggling(self) -> list[Case]:
        """A read-only call whose arguments hold a whole frame for wipe or pay, set off by
        CR (or another character a line splitter may cut at) used as JSON whitespace."""
        out = []
        variants = [("\r", "\r"), ("\r", ""), ("", "\r"), ("\r\r", "\r\r"), ("\t\r", "\r\t"),
                    (" \r ", " \r "), ("\r", "\r ")]
        for before, after in variants:
            for target in ("wipe", "pay"):
                inner = Verbatim(self.SMUGGLED % target)
                ident, args = self.new_id(), self.args()
                args["x"] = inner
                text = render(self.call(ident, "echo", args))
                text = text.replace(inner, f"{before}{inner}{after}")
                out.append(self.exec_case("smuggling-cr", finish(text), ident, "echo", args))
        # The frame as a string value broken by a raw U+2028 / U+2029 / U+0085, and the
        # frame after a CR that sits in whitespace of the envelope, not the arguments.
        for sep in ("\u2028", "\u2029", "\u0085"):
            ident, args = self.new_id(), self.args()
            args["x"] = Verbatim(json.dumps(sep + self.SMUGGLED % "wipe" + sep,
                                            ensure_ascii=False))
            out.append(self.exec_case("smuggling-line-separator", finish(render(
                self.call(ident, "echo", args))), ident, "echo", args))
            ident, args = self.new_id(), self.args()
            args["x"] = Verbatim(json.dumps(self.SMUGGLED % "pay").replace(
                '\\"params', f'{sep}\\"params'))
            out.append(self.exec_case("smuggling-line-separator", finish(render(
                self.call(ident, "echo", args))), ident, "echo", args))
        # ...and one object with a second frame's members merged in after a CR: a repeated
        # "jsonrpc", "id", "method" and "params" in the envelope, never a wipe.
        ident, args = self.new_id(), self.args()
        line = finish(render(self.call(ident, "echo", args)))[:-1] + b"\r," + \
            finish(render(self.call(ident, "wipe", {})))[1:]
        out.append(Case("smuggling-envelope", line, key=id_key(ident), results=frozenset({"exec", "refused"}),
                        errors=frozenset({INVALID_REQUEST, PARSE}),
                        null=frozenset({INVALID_REQUEST, PARSE}), n=self.n_of(args),
                        upstream="if_exec", tool="echo",
                        args=strict_loads(finish(render(args, "arguments")))))
        return out

    def wrong_types(self) -> list[Case]:
        out = []
        # The envelope: -32600, with the id when the id itself is sound (JSON-RPC 2.0
        # section 5: null only when the id could not be detected).
        for bad in ({"drop": "jsonrpc"}, {"jsonrpc": "1.0"}, {"jsonrpc": Lit("2")},
                    {"jsonrpc": Lit("2.0")}, {"jsonrpc": None}, {"jsonrpc": "2.0 "},
                    {"method": Lit("5")}, {"method": None}, {"method": {"a": "b"}},
                    {"method": ["ping"]}, {"method": True}):
            for inner in ("ping", "call"):
                ident = self.new_id()
                args = self.args()
                msg = self.call(ident, "echo", args) if inner == "call" else \
                    self.envelope(ident, "ping")
                if "drop" in bad:
                    del msg[bad["drop"]]
                else:
                    msg.update(bad)
                out.append(Case("wrong-type-envelope", finish(render(msg)), key=id_key(ident),
                                errors=frozenset({INVALID_REQUEST}),
                                null=frozenset({INVALID_REQUEST}),
                                n=self.n_of(args) if inner == "call" else None))
        # The id: an object, an array, a boolean or null can never be echoed: -32600, null.
        for bad_id in ({"a": Lit("1")}, [Lit("1")], True, False, None, {}, []):
            for inner in ("ping", "call"):
                args = self.args()
                msg = self.call(bad_id, "echo", args) if inner == "call" else \
                    self.envelope(bad_id, "ping")
                out.append(Case("wrong-type-id", finish(render(msg)),
                                null=frozenset({INVALID_REQUEST}),
                                n=self.n_of(args) if inner == "call" else None))
        # params not structured: an Invalid Request, or an Invalid params for tools/call.
        for bad_params in ("x", Lit("5"), True, None):
            ident = self.new_id()
            msg = self.envelope(ident, "tools/call", bad_params)
            out.append(Case("wrong-type-params", finish(render(msg)), key=id_key(ident),
                            errors=frozenset({INVALID_REQUEST, INVALID_PARAMS}),
                            null=frozenset({INVALID_REQUEST})))
        ident = self.new_id()
        msg = self.envelope(ident, "tools/call", [TOOLS["echo"], {"n": Lit("1")}])
        out.append(Case("wrong-type-params", finish(render(msg)), key=id_key(ident),
                        errors=frozenset({INVALID_PARAMS})))
        # tools/call params that are not a CallToolRequest: -32602 (mcp-protocol.md section 6,
        # "a request that is not a valid CallToolRequest"), nothing executed.
        for name in (Lit("5"), None, ["rec_echo"], {"n": "rec_echo"}, True, "rec_nope", "",
                     "rec_echo ", "REC_ECHO", "echo"):
            ident, args = self.new_id(), self.args()
            msg = self.call(ident, "echo", args)
            msg["params"]["name"] = name
            out.append(Case("wrong-type-name", finish(render(msg)), key=id_key(ident),
                            errors=frozenset({INVALID_PARAMS}), n=self.n_of(args)))
        ident = self.new_id()
        msg = self.envelope(ident, "tools/call", {"arguments": self.args()})
        out.append(Case("wrong-type-name", finish(render(msg)), key=id_key(ident),
                        errors=frozenset({INVALID_PARAMS})))
        # (null arguments are no arguments, sent as {}: reference/mcp.md 8.1, and
        # test_null_arguments_are_sent_as_an_empty_object; so not among these.)
        for bad_args in ([Lit("1")], [], "{}", Lit("5"), True):
            ident = self.new_id()
            msg = self.call(ident, "echo", bad_args)
            out.append(Case("wrong-type-arguments", finish(render(msg)), key=id_key(ident),
                            errors=frozenset({INVALID_PARAMS})))
        for meta in (Lit("5"), "m", [], True, None):
            ident, args = self.new_id(), self.args()
            msg = self.call(ident, "echo", args, _meta=meta)
            out.append(Case("wrong-type-meta", finish(render(msg)), key=id_key(ident),
                            errors=frozenset({INVALID_PARAMS}), n=self.n_of(args)))
        for token in ({"t": Lit("1")}, [Lit("1")], True, Lit("1.5")):
            ident, args = self.new_id(), self.args()
            msg = self.call(ident, "echo", args, _meta={"progressToken": token})
            out.append(Case("wrong-type-progress-token", finish(render(msg)),
                            key=id_key(ident), errors=frozenset({INVALID_PARAMS}),
                            n=self.n_of(args)))
        # A valid progress token is fine: the call executes.
        ident, args = self.new_id(), self.args()
        line = finish(render(self.call(ident, "echo", args, _meta={"progressToken": "tok"})))
        out.append(self.exec_case("progress-token", line, ident, "echo", args))
        # Arguments a strict schema refuses: INVALID, never executed.
        for bad in ({"n": "5"}, {"n": Lit("1.5")}, {"text": "t"}, {"n": Lit("1"), "text": Lit("5")},
                    {"n": Lit("1"), "extra": "x"}, {"n": [Lit("1")]}, {"n": None}):
            ident = self.new_id()
            bad = dict(bad)
            bad.setdefault("text", "t")
            if "n" in bad and isinstance(bad["n"], Lit) and bad["n"].text == "1":
                bad["n"] = Lit(str(next(self.counter)))
            out.append(Case("schema-invalid", finish(render(self.call(ident, "note", bad))),
                            key=id_key(ident), results=frozenset({"invalid"}),
                            n=self.n_of(bad)))
        return out

    def odd_ids(self) -> list[Case]:
        out = []
        digits = "".join(self.rng.choice("0123456789") for _ in range(9_999))
        self.used = set()
        candidates = [Lit("9" + digits), Lit("-8" + digits), Lit("1e400"), Lit("-1E+400"),
                      Lit("-0"), Lit("1.5"), Lit("2.50"), Lit("1e-400"), Lit("1e999999999"),
                      Lit("-1e-999999999"), "", "x" * (1024 * 1024),
                      Verbatim('"q\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f"'),
                      Verbatim('"\\u2028\\u2029"'), "\u2028\u2029\u0085",
                      Verbatim('"\\ud83d\\ude00"'), "\U0001f600", Lit("9007199254740993"),
                      Lit("-9223372036854775809"), Lit("18446744073709551616")]
        for ident in candidates:
            if isinstance(ident, Verbatim):
                key = ("str", json.loads(str(ident)))
            else:
                key = id_key(ident)
            if key in self.used:
                continue
            self.used.add(key)
            kind = self.rng.choice(("ping", "call", "unknown"))
            if kind == "ping":
                out.append(Case("odd-id", finish(render(self.envelope(ident, "ping"))),
                                key=key, results=frozenset({"empty"})))
            elif kind == "unknown":
                out.append(Case("odd-id", finish(render(self.envelope(ident, "nope/x"))),
                                key=key, errors=frozenset({NOT_FOUND})))
            else:
                args = self.args()
                out.append(self.exec_case("odd-id", finish(render(
                    self.call(ident, "echo", args))), ident, "echo", args))
                out[-1].key = key
        return out

    def nesting(self) -> list[Case]:
        out = []
        for depth in (MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, MAX_DEPTH + 2):
            for kind in ("object", "array"):
                ident, args = self.new_id(), self.args()
                inner: Any = {} if kind == "object" else []
                # args is level 1, its member "x" level 2: depth - 2 more levels inside x
                for _ in range(depth - 2):
                    inner = {"d": inner} if kind == "object" else [inner]
                args["x"] = inner
                line = finish(render(self.call(ident, "echo", args)))
                if depth <= MAX_DEPTH:
                    out.append(self.exec_case(f"nesting-{depth}", line, ident, "echo", args))
                else:
                    out.append(Case(f"nesting-{depth}", line, key=id_key(ident),
                                    results=frozenset({"invalid"}), n=self.n_of(args)))
        # The envelope far deeper: refused as a whole, never routed, never executed.
        for depth in (2_000, 100_000):
            ident = f"deep-{next(self.ids)}"
            line = (b'{"jsonrpc":"2.0","id":"%s","method":"tools/call","params":{"name":'
                    b'"rec_wipe","arguments":{"x":' % ident.encode() + b"[" * depth +
                    b"]" * depth + b"}}}")
            out.append(Case("nesting-envelope", line, key=("str", ident),
                            results=frozenset({"refused", "invalid"}),
                            errors=frozenset({PARSE, INVALID_REQUEST, INVALID_PARAMS}),
                            null=frozenset({PARSE, INVALID_REQUEST})))
        for depth in (5_000, 200_000):
            out.append(Case("nesting-envelope", b"[" * depth + b"]" * depth,
                            null=frozenset({PARSE, INVALID_REQUEST})))
            out.append(Case("nesting-envelope", b'{"a":' * depth + b"1" + b"}" * depth,
                            null=frozenset({PARSE, INVALID_REQUEST})))
        return out

    def bad_text(self) -> list[Case]:
        """Invalid UTF-8, unpaired surrogates, huge exponents, repeated keys."""
        out = []
        for raw in (BAD_BYTE, "\ue021", "\ue022"):
            ident, args = self.new_id(), self.args(s=Verbatim(f'"a{BAD_BYTE}b"'))
            line = finish(render(self.call(ident, "echo", args)))
            if raw == "\ue021":                 # a truncated multi-byte sequence
                line = line.replace(b"\xff", b"\xe4\xb8")
            elif raw == "\ue022":               # an overlong encoding of '/'
                line = line.replace(b"\xff", b"\xc0\xaf")
            out.append(Case("utf8-in-arguments-string", line, key=id_key(ident),
                            results=frozenset({"invalid"}), null=frozenset({PARSE}),
                            n=self.n_of(args)))
        ident = self.new_id()
        args = self.args()
        args[Verbatim(f'"k{BAD_BYTE}"')] = "v"
        out.append(Case("utf8-in-arguments-key", finish(render(self.call(ident, "echo", args))),
                        key=id_key(ident), results=frozenset({"invalid"}),
                        null=frozenset({PARSE}), n=self.n_of(args)))
        for where in ("id", "method", "outside"):
            ident, args = self.new_id(), self.args()
            msg = self.call(ident, "echo", args)
            if where == "id":
                msg["id"] = Verbatim(f'"i{BAD_BYTE}"')
            elif where == "method":
                msg["method"] = Verbatim(f'"tools/call{BAD_BYTE}"')
            text = render(msg)
            if where == "outside":
                text = text.replace(",", "," + BAD_BYTE, 1)
            out.append(Case(f"utf8-{where}", finish(text), null=frozenset({PARSE}),
                            key=id_key(ident) if where != "id" else None,
                            n=self.n_of(args)))
        for esc in ("\\ud800", "\\udc00", "\\ud800x", "\\ud83d\\u0041", "\\udfff\\ud800"):
            ident, args = self.new_id(), self.args(s=Verbatim(f'"{esc}"'))
            out.append(Case("surrogate-in-arguments", finish(render(
                self.call(ident, "echo", args))), key=id_key(ident),
                results=frozenset({"invalid"}), n=self.n_of(args)))
        ident, args = self.new_id(), self.args()
        args[Verbatim('"\\ud800"')] = "v"
        out.append(Case("surrogate-in-arguments", finish(render(self.call(ident, "echo", args))),
                        key=id_key(ident), results=frozenset({"invalid"}), n=self.n_of(args)))
        for lit in ("1e999999999", "-1e999999999", "1e400", "1" * 10_001, "1e-999999999"):
            ident, args = self.new_id(), self.args(v=Lit(lit))
            out.append(Case("huge-number-in-arguments", finish(render(
                self.call(ident, "echo", args))), key=id_key(ident),
                results=frozenset({"invalid"}), n=self.n_of(args)))
        # A repeated key inside the arguments: INVALID, never executed, whichever value wins.
        for dup in (b'"n"', b'"s"', b'"\\u0073"'):
            ident, args = self.new_id(), self.args()
            n = self.n_of(args)
            line = finish(render(self.call(ident, "echo", args)))
            first = b'%s:"dup",' % dup if dup != b'"n"' else b'"n":%d,' % (n + 10**9)
            line = line.replace(b'"arguments":{', b'"arguments":{' + first, 1)
            out.append(Case("repeated-key-in-arguments", line, key=id_key(ident),
                            results=frozenset({"invalid"}), n=n))
        ident, args = self.new_id(), self.args()
        line = finish(render(self.call(ident, "echo", {**args, "x": {"a": Lit("1")}})))
        line = line.replace(b'"x":{"a":1}', b'"x":{"a":1,"a":2}')
        out.append(Case("repeated-key-in-arguments", line, key=id_key(ident),
                        results=frozenset({"invalid"}), n=self.n_of(args)))
        # A repeated key in the envelope: an answer, never a wipe.
        for member, second in (("name", b'"rec_wipe"'), ("params", b'{"name":"rec_wipe",'
                                                                   b'"arguments":{}}'),
                               ("method", b'"ping"'), ("jsonrpc", b'"1.0"')):
            ident, args = self.new_id(), self.args()
            line = finish(render(self.call(ident, "echo", args)))
            assert line.endswith(b"}}}")
            if member == "name":
                line = line[:-2] + b',"name":' + second + b"}}"
            else:
                line = line[:-1] + b',"%s":' % member.encode() + second + b"}"
            out.append(Case("repeated-key-in-envelope", line, key=id_key(ident),
                            results=frozenset({"exec", "empty", "refused", "invalid"}),
                            errors=frozenset({PARSE, INVALID_REQUEST, INVALID_PARAMS}),
                            null=frozenset({PARSE, INVALID_REQUEST}), n=self.n_of(args),
                            upstream="if_exec", tool="echo",
                            args=strict_loads(finish(render(args, "arguments")))))
        return out

    def huge_line(self) -> list[Case]:
        """A valid call longer than the frame limit: an error or nothing, never executed."""
        ident = self.new_id()
        args = self.args(s="A" * (HUGE_LINE - 200))
        line = finish(render(self.call(ident, "echo", args)))
        assert len(line) > FRAME_LIMIT
        return [Case("huge-line", line, key=id_key(ident),
                     errors=frozenset({PARSE, INVALID_REQUEST, INTERNAL_OR_LIMIT}),
                     null=frozenset({PARSE, INVALID_REQUEST, INTERNAL_OR_LIMIT}),
                     required=False, n=self.n_of(args))]

    def unterminated(self) -> list[Case]:
        """A short frame ending inside a string of a few dozen characters: a parser that
        backtracks on it takes exponential time, and every other frame waits."""
        ident = self.new_id()
        line = finish(render(self.call(ident, "echo", self.args())))
        line = line[:line.rindex(b"}}}")] + b',"x":"' + b"A" * 40
        return [Case("unterminated-string", line, null=frozenset({PARSE}))]

    def methods(self) -> list[Case]:
        out = []
        for method in ("nope", "tools/call2", "TOOLS/CALL", "tools/list/", "resources/list",
                       "prompts/get", "rpc.discover", "", "\u2028", "tools/call\u0000",
                       "sampling/createMessage", "notifications/cancelled"):
            ident = self.new_id()
            out.append(Case("unknown-method", finish(render(self.envelope(ident, method, {}))),
                            key=id_key(ident), errors=frozenset({NOT_FOUND})))
        for batch in ([self.envelope(self.new_id(), "ping")],
                      [self.call(self.new_id(), "wipe", {"n": Lit("1")}),
                       self.call(self.new_id(), "echo", self.args())], [], [Lit("1")]):
            out.append(Case("batch", finish(render(batch)),
                            null=frozenset({INVALID_REQUEST})))
        for value in ("x", Lit("1"), None, True):
            out.append(Case("not-an-object", finish(render(value)),
                            null=frozenset({INVALID_REQUEST})))
        # Responses to nothing, and notifications: no answer at all.
        for msg in ({"jsonrpc": "2.0", "id": self.new_id(), "result": {}},
                    {"jsonrpc": "2.0", "id": self.new_id(), "error": {"code": Lit("-1"),
                                                                     "message": "x"}},
                    {"jsonrpc": "2.0", "id": None, "error": {"code": Lit("-32700"),
                                                             "message": "x"}},
                    {"jsonrpc": "2.0", "id": self.new_id(), "result": {"tools": []},
                     "error": {"code": Lit("1"), "message": "both"}},
                    {"jsonrpc": "2.0", "method": "notifications/initialized"},
                    {"jsonrpc": "2.0", "method": "notifications/nope", "params": {"a": []}},
                    {"jsonrpc": "2.0", "method": "tools/call",
                     "params": {"name": TOOLS["wipe"], "arguments": {}}},
                    {"jsonrpc": "2.0", "method": "tools/call",
                     "params": {"name": TOOLS["echo"], "arguments": self.args()}},
                    {"jsonrpc": "2.0", "method": "ping"}):
            out.append(Case("no-answer", finish(render(msg)), required=False,
                            n=self.n_of(msg.get("params", {}).get("arguments"))))
        out.append(self.ping())
        ident = self.new_id()
        out.append(Case("tools-list", finish(render(self.envelope(ident, "tools/list"))),
                        key=id_key(ident), results=frozenset({"listing"})))
        return out

    def refused(self) -> list[Case]:
        out = []
        for tool, kinds in (("pay", {"refused"}), ("wipe", {"refused"})):
            ident, args = self.new_id(), self.args()
            out.append(self.refused_case(f"refused-{tool}", finish(render(
                self.call(ident, tool, args))), ident, args, kinds))
            ident, args = self.new_id(), self.args()
            text = render(self.call(ident, tool, args))
            line = finish(text, {r: "\r" for r in GAP}, self.rng)
            out.append(self.refused_case(f"refused-{tool}", line, ident, args, kinds))
        return out

    def cancels(self) -> list[Case]:
        """notifications/cancelled for unknown ids, odd requestIds, and calls in flight;
        notifications/progress from the host. None of them is answered."""
        out = []
        for rid in (Lit("424242"), "nobody", None, {"a": Lit("1")}, [Lit("1")], True,
                    Lit("7e999999999"), Lit("7.5"), "no-such-request", "x" * 10_000):
            # (never the id of a request of the corpus: a cancel for one would cancel it)
            msg = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": rid, "reason": "r"}}
            out.append(Case("cancel-unknown", finish(render(msg)), required=False))
        out.append(Case("cancel-unknown", finish(render({
            "jsonrpc": "2.0", "method": "notifications/cancelled", "params": []})),
            required=False))
        out.append(Case("cancel-unknown", finish(render({
            "jsonrpc": "2.0", "method": "notifications/cancelled"})), required=False))
        for _ in range(3):
            ident, args = self.new_id(), self.args()
            call = self.exec_case("cancel-in-flight", finish(render(
                self.call(ident, "echo", args))), ident, "echo", args)
            call.required, call.upstream = False, "if_exec"
            msg = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": ident}}
            call.line += b"\n" + finish(render(msg))     # the cancel right behind its call
            out.append(call)
        for token in ("tok", Lit("1"), {"a": Lit("1")}, None, Lit("1e999999999")):
            msg = {"jsonrpc": "2.0", "method": "notifications/progress",
                   "params": {"progressToken": token, "progress": Lit("1"),
                              "total": Lit("2")}}
            out.append(Case("progress-from-host", finish(render(msg)), required=False))
        return out

    def flood(self) -> list[Case]:
        """Many notifications at once, interleaved with a few real calls."""
        out = []
        for i in range(60):
            if i % 15 == 0:
                out.append(self.valid_call("flood-call"))
            rid = self.rng.choice((Lit(str(i)), f"f{i}", None, [Lit("1")]))
            method = self.rng.choice(("notifications/cancelled", "notifications/progress"))
            params = {"requestId": rid} if method.endswith("cancelled") else \
                {"progressToken": rid, "progress": Lit(str(i))}
            out.append(Case("flood", finish(render({"jsonrpc": "2.0", "method": method,
                                                    "params": params})), required=False))
        return out

    FAMILIES = ("truncated", "invalid_json", "characters", "whitespace", "smuggling",
                "wrong_types", "odd_ids", "nesting", "bad_text", "methods", "refused",
                "cancels", "flood")

    def chunks(self, total: int, size: int) -> list[list[Case]]:
        """The corpus, in chunks of about size frames, each family in every few chunks."""
        cases: list[Case] = []
        rounds = 0
        while len(cases) < total:
            for family in self.FAMILIES:
                cases += getattr(self, family)()
            for _ in range(20):
                cases.append(self.valid_call("valid", self.rng.choice(("echo", "note"))))
            rounds += 1
        self.rng.shuffle(cases)
        cases = cases[:max(total, 1)]
        for once in self.huge_line() + self.unterminated():
            cases.insert(self.rng.randrange(len(cases)), once)
        out = [cases[i:i + size] for i in range(0, len(cases), size)]
        return self._dedupe_ids(out)

    def _dedupe_ids(self, chunks: list[list[Case]]) -> list[list[Case]]:
        """An id used twice within one chunk (the odd ids repeat across rounds) moves the
        later frame on to the next chunk."""
        result, carry = [], []
        for chunk in chunks + [[]]:
            seen, kept, later = set(), [], []
            for c in carry + chunk:
                if c.key is not None and c.key in seen:
                    later.append(c)
                    continue
                if c.key is not None:
                    seen.add(c.key)
                kept.append(c)
            if kept:
                result.append(kept)
            carry = later
        while carry:
            result.append(carry[:1])
            carry = carry[1:]
        return result


INTERNAL_OR_LIMIT = -32603


# ---- the proxy, as a process ----

class HostileDir:
    """proxy.json (0600) against recording_server.py, pinned once; a log per process."""

    def __init__(self, tmp):
        self.tmp = str(tmp)
        self.config = os.path.join(self.tmp, "proxy.json")
        self.logs = 0
        self.log = self.next_log()
        code, out, err = self.run("pin", "-config", self.config)
        assert code == 0, f"pin failed: {code}\n{out}\n{err}"

    def next_log(self) -> str:
        self.logs += 1
        self.log = os.path.join(self.tmp, f"upstream-{self.logs}.log")
        server = {"name": SERVER, "command": [PYTHON, RECORDER],
                  "env": [f"RECORDING_LOG={self.log}"], "manifest": "rec.manifest.json",
                  "rules": RULES}
        doc = {"database": "runs.db", "session": "hostile", "hold": "0s",
               "max_pending": 1_000_000, "servers": [server]}
        with open(self.config, "w") as f:
            json.dump(doc, f, indent=2)
        os.chmod(self.config, 0o600)
        return self.log

    def run(self, *argv: str) -> tuple[int, str, str]:
        p = subprocess.run([PYTHON, PROXY, *argv], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=120, cwd=self.tmp)
        return p.returncode, p.stdout, p.stderr

    def upstream_lines(self, log: str) -> list[bytes]:
        try:
            with open(log, "rb") as f:
                return [base64.b64decode(x) for x in f.read().split(b"\n") if x]
        except FileNotFoundError:
            return []


class Outcome:
    """What one chunk's proxy did."""

    def __init__(self):
        self.answers: dict[tuple, list[dict]] = {}
        self.nulls: list[dict] = []
        self.bad_output: list[bytes] = []
        self.crash = self.hang = None
        self.eof = False
        self.stderr = ""
        self.upstream: list[bytes] = []


def read_answers(stdout, out: Outcome, cond: threading.Condition) -> None:
    for line in iter(stdout.readline, b""):
        try:
            msg = strict_loads(line.rstrip(b"\n"))
            if not isinstance(msg, dict):
                raise NotStrict("not an object")
        except ValueError:
            with cond:
                out.bad_output.append(line)
            continue
        with cond:
            if "method" in msg:
                pass                       # progress notifications and the like
            elif "id" not in msg or msg["id"] is None:
                out.nulls.append(msg)
            else:
                out.answers.setdefault(id_key(msg["id"]), []).append(msg)
            cond.notify_all()
    with cond:
        out.eof = True
        cond.notify_all()


def write_frames(stdin, lines: list[bytes], broken: list) -> None:
    try:
        for line in lines:
            stdin.write(line + b"\n")
        stdin.flush()
    except (BrokenPipeError, OSError) as exc:
        broken.append(repr(exc))


def drive(d: HostileDir, cases: list[Case]) -> Outcome:
    """One proxy for one chunk: the frames, then a valid echo and a ping, then EOF. A proxy
    that has not read everything and answered the last two by the deadline is hung; one that
    closes its output or exits before EOF, or exits non-zero, crashed."""
    log = d.next_log()
    out = Outcome()
    err_path = log + ".stderr"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([PYTHON, PROXY, "-config", d.config], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, cwd=d.tmp)
    cond = threading.Condition()
    reader = threading.Thread(target=read_answers, args=(proc.stdout, out, cond), daemon=True)
    reader.start()
    broken: list = []
    code = None
    try:
        writer = threading.Thread(target=write_frames, daemon=True,
                                  args=(proc.stdin, [c.line for c in cases], broken))
        writer.start()
        deadline = time.monotonic() + BARRIER_TIMEOUT
        writer.join(BARRIER_TIMEOUT)
        last = [c.key for c in cases[-2:]]            # the barrier: an echo and a ping
        with cond:
            while not all(k in out.answers for k in last) and not out.eof and \
                    time.monotonic() < deadline:
                cond.wait(max(0.0, deadline - time.monotonic()))
            answered, eof = all(k in out.answers for k in last), out.eof
        if writer.is_alive():
            out.hang = f"it stopped reading its input ({BARRIER_TIMEOUT} s)"
        elif not answered and not eof:
            out.hang = f"no answer to the closing echo and ping within {BARRIER_TIMEOUT} s"
        if out.hang:
            proc.kill()                    # this pid only; its child sees EOF and exits
        else:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            code = proc.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            out.hang = out.hang or f"it did not exit within {EXIT_TIMEOUT} s of EOF"
        reader.join(EXIT_TIMEOUT)
        if not out.hang and (eof or broken or code != 0):
            out.crash = f"exit code {code}; output closed before EOF: {eof}; write: {broken}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        try:
            proc.stdin.close()
        except OSError:
            pass
    with open(err_path, "rb") as f:
        out.stderr = f.read().decode("utf-8", "replace")
    out.upstream = d.upstream_lines(log)
    return out


# ---- judging one chunk ----

def result_kind(result: Any) -> str:
    if not isinstance(result, dict):
        return "not-an-object"
    if result == {}:
        return "empty"
    if "tools" in result:
        return "listing"
    if "protocolVersion" in result:
        return "initialized"
    content = result.get("content")
    text = "".join(b.get("text", "") for b in content if isinstance(b, dict)) \
        if isinstance(content, list) else ""
    head = text.split(":", 1)[0]
    if head == "INVALID":
        return "invalid"
    if head in REFUSALS:
        return "refused"
    if result.get("isError") is True:
        return "error-result"
    return "exec"


def describe(msg: dict) -> str:
    if "error" in msg:
        e = msg["error"]
        return f"error {e.get('code')!r} {str(e.get('message'))[:120]!r}" \
            if isinstance(e, dict) else f"error {e!r}"
    r = msg.get("result")
    content = r.get("content") if isinstance(r, dict) else None
    if isinstance(content, list):
        text = "".join(b.get("text", "") for b in content if isinstance(b, dict))
        return f"result {text[:120]!r} isError={r.get('isError')}"
    return f"result {str(r)[:120]}"


def code_of(msg: dict):
    e = msg.get("error")
    c = e.get("code") if isinstance(e, dict) else None
    return int(c.text) if isinstance(c, Lit) and c.text.lstrip("-").isdigit() else c


def upstream_calls(lines: list[bytes], report) -> tuple[dict, int, int]:
    """Every upstream line must be one compact, strict JSON object. Returns the tools/call
    frames by the arguments' counter, the number of pay/wipe calls and of smuggled frames."""
    by_n: dict[int, list[tuple[str, Any]]] = {}
    forbidden = smuggled = 0
    for line in lines:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            report("upstream", line, "the upstream received bytes that are not UTF-8")
            text = line.decode("utf-8", "replace")
        pieces = [p for p in text.splitlines() if p.strip()]
        if len(pieces) > 1:
            for piece in pieces[1:]:
                try:
                    inner = json.loads(piece)
                except ValueError:
                    continue
                if isinstance(inner, dict) and "method" in inner:
                    smuggled += 1
                    report("smuggled", line, f"a line splitter would read a second frame "
                                             f"here: {piece[:120]!r}")
        bad = compact_violation(text)
        if bad:
            report("upstream", line, f"not the proxy's compact encoding: {bad}")
        try:
            msg = strict_loads(text.strip(" \t\r\n"))
        except ValueError as exc:
            report("upstream", line, f"not strict JSON: {exc}")
            try:
                msg = json.loads(text, parse_float=Lit, parse_int=Lit)
            except ValueError:
                continue
        if not isinstance(msg, dict):
            report("upstream", line, "not a JSON object")
            continue
        if msg.get("method") != "tools/call":
            continue
        params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
        name, args = params.get("name"), params.get("arguments")
        if name in ("pay", "wipe"):
            forbidden += 1
            report("upstream", line, f"the upstream was asked to run {name}")
        n = Corpus.n_of(args)
        if n is None:
            report("upstream", line, "a tools/call no case sent (no counter)")
            continue
        by_n.setdefault(n, []).append((name, args))
    return by_n, forbidden, smuggled


class Verdict:
    def __init__(self):
        self.failures: list[tuple[str, str, str]] = []       # family, frame, problem
        self.by_family: dict[str, int] = {}
        self.frames = self.crashes = self.hangs = self.smuggled = self.forbidden = 0

    def fail(self, family: str, line: bytes, problem: str) -> None:
        self.by_family[family] = self.by_family.get(family, 0) + 1
        self.failures.append((family, show(line), problem))


def judge(cases: list[Case], out: Outcome, v: Verdict, seed: int, index: int) -> None:
    v.frames += len(cases)
    if out.crash:
        v.crashes += 1
        v.fail("crash", b"", f"chunk {index} (seed {seed}): {out.crash}; stderr tail:\n"
                             f"{out.stderr[-2000:]}")
    if out.hang:
        v.hangs += 1
        v.fail("hang", b"", f"chunk {index} (seed {seed}): {out.hang}; stderr tail:\n"
                            f"{out.stderr[-2000:]}")
    for line in out.bad_output:
        v.fail("proxy-output", line, "the proxy wrote a line that is not strict JSON")
    by_n, forbidden, smuggled = upstream_calls(
        out.upstream, lambda fam, line, problem: v.fail(fam, line, problem))
    v.forbidden += forbidden
    v.smuggled += smuggled
    answers = {k: list(msgs) for k, msgs in out.answers.items()}
    owed_null: list[Case] = []
    executed: set[int] = set()
    for c in cases:
        got = answers.pop(c.key, []) if c.key is not None else []
        kind = None
        if len(got) > 1:
            v.fail(c.family, c.line, f"answered {len(got)} times: "
                                     f"{[describe(m) for m in got]}")
        if got:
            msg = got[0]
            if msg.get("jsonrpc") != "2.0" or ("result" in msg) == ("error" in msg):
                v.fail(c.family, c.line, f"not a JSON-RPC 2.0 response: {describe(msg)}")
            if "error" in msg:
                if code_of(msg) not in c.errors:
                    v.fail(c.family, c.line, f"answered {describe(msg)}; expected "
                                             f"{_expected(c)}")
            else:
                kind = result_kind(msg["result"])
                if kind not in c.results:
                    v.fail(c.family, c.line, f"answered {describe(msg)} ({kind}); expected "
                                             f"{_expected(c)}")
        elif c.null or c.slots:
            owed_null.append(c)
        elif c.required and not (out.hang or out.crash):   # reported once, above
            v.fail(c.family, c.line, f"no answer; expected {_expected(c)}")
        if c.n is None:
            continue
        calls = by_n.pop(c.n, [])
        want = {"one": 1, "zero": 0}.get(c.upstream)
        if c.upstream == "if_exec":
            want = 1 if kind == "exec" else (None if not got else 0)
        if want is None:
            if len(calls) > 1:
                v.fail(c.family, c.line, f"the upstream received {len(calls)} calls")
        elif len(calls) > want or (len(calls) < want and not (out.hang or out.crash)):
            v.fail(c.family, c.line, f"the upstream received {len(calls)} calls for it, "
                                     f"expected {want} (answer: "
                                     f"{describe(got[0]) if got else 'none'})")
        for name, args in calls[:1]:
            if want and (name != c.tool or args != c.args):
                v.fail(c.family, c.line, f"the upstream received {name} with arguments "
                                         f"{str(args)[:200]}, not {c.tool} with "
                                         f"{str(c.args)[:200]}")
        if calls:
            executed.add(c.n)
    for key, msgs in answers.items():
        for msg in msgs:
            v.fail("unexpected-answer", b"", f"an answer to id {str(key)[:80]} that no frame "
                                             f"expects: {describe(msg)}")
    for n, calls in by_n.items():
        v.fail("upstream", b"", f"the upstream received {len(calls)} call(s) with counter "
                                f"{n} that no case allows: {calls[0][0]}")
    if not (out.hang or out.crash):
        _judge_nulls(owed_null, out.nulls, v)


def _expected(c: Case) -> str:
    parts = []
    if c.results:
        parts.append("result " + "/".join(sorted(c.results)))
    if c.errors:
        parts.append("error " + "/".join(str(x) for x in sorted(c.errors)))
    if c.null:
        parts.append("id-null error " + "/".join(str(x) for x in sorted(c.null)))
    if not c.required:
        parts.append("or nothing")
    return " or ".join(parts) or "no answer"


def _judge_nulls(owed: list[Case], got: list[dict], v: Verdict) -> None:
    """Answers with id null cannot be told apart by id: they must be assignable to the frames
    that may get one (each answer's code allowed by its frame; every frame that must be
    answered answered). Both Hall conditions, over sets of codes, decide that exactly."""
    codes = sorted({x for c in owed for x in c.null} | {code_of(m) for m in got},
                   key=str)
    slots = [slot for c in owed for slot in (c.slots or [(c.null, c.required)])]
    for m in got:
        if "error" not in m:
            v.fail("id-null", b"", f"an answer with id null that is not an error: "
                                   f"{describe(m)}")
    problems = []
    for r in range(1, len(codes) + 1):
        for subset in itertools.combinations(codes, r):
            s = set(subset)
            answers = sum(1 for m in got if code_of(m) in s)
            may = sum(1 for allowed, _ in slots if allowed & s)
            must = sum(1 for allowed, req in slots if req and allowed <= s)
            if answers > may:
                problems.append(f"{answers} id-null answers with codes in {sorted(s, key=str)}"
                                f" but only {may} frames may get one")
            if must > answers:
                problems.append(f"{must} frames are owed an id-null error with a code in "
                                f"{sorted(s, key=str)} but {answers} came")
    if problems:
        fams: dict[str, int] = {}
        for c in owed:
            fams[c.family] = fams.get(c.family, 0) + len(c.slots or [0])
        got_codes: dict = {}
        for m in got:
            got_codes[code_of(m)] = got_codes.get(code_of(m), 0) + 1
        v.fail("id-null", b"", "; ".join(problems[:4]) + f". Frames owed one, by family: "
                               f"{fams}; id-null answers by code: {got_codes}")


# ---- the test ----

def barrier(corpus: Corpus) -> list[Case]:
    return [corpus.valid_call("barrier-echo", plain=True), corpus.ping("barrier-ping")]


def initialize_case(corpus: Corpus) -> list[Case]:
    ident = corpus.new_id()
    msg = corpus.envelope(ident, "initialize", {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "hostile", "version": "1"}})
    return [Case("initialize", finish(render(msg)), key=id_key(ident),
                 results=frozenset({"initialized"})),
            Case("initialize", b'{"jsonrpc":"2.0","method":"notifications/initialized"}',
                 required=False)]


def before_handshake(corpus: Corpus) -> list[Case]:
    """Requests before initialize: a ping is answered; anything else gets one answer, a
    result or an error (MCP says initialize comes first, JSON-RPC owes an answer), and a call
    reaches the upstream only if it was answered as executed."""
    out = [corpus.ping("before-handshake")]
    for tool in ("echo", "wipe"):
        c = corpus.valid_call("before-handshake", tool)
        c.results = frozenset({"exec", "refused"}) if tool == "echo" else frozenset({"refused"})
        c.errors = frozenset({INVALID_REQUEST, -32002, -32000, INTERNAL_OR_LIMIT})
        c.upstream = "if_exec" if tool == "echo" else "zero"
        out.append(c)
    ident = corpus.new_id()
    out.append(Case("before-handshake", finish(render(corpus.envelope(ident, "tools/list"))),
                    key=id_key(ident), results=frozenset({"listing"}),
                    errors=frozenset({INVALID_REQUEST, -32002, -32000})))
    return out


def run_corpus(tmp_path, seed: int, frames: int, chunk: int) -> Verdict:
    print(f"\nhostile host: seed {seed} (HOSTILE_SEED), {frames} frames (HOSTILE_FRAMES), "
          f"chunks of {chunk}")
    corpus = Corpus(seed)
    chunks = corpus.chunks(frames, chunk)
    d = HostileDir(tmp_path)
    v = Verdict()
    started = time.monotonic()
    for i, cases in enumerate(chunks):
        head = before_handshake(corpus) if i == 0 else []
        cases = head + initialize_case(corpus) + cases + barrier(corpus)
        out = drive(d, cases)
        judge(cases, out, v, seed, i)
    # A proxy that is never sent initialize still answers a ping, and answers a call once.
    cases = before_handshake(corpus) + [corpus.ping("never-initialized")]
    out = drive(d, cases)
    judge(cases, out, v, seed, len(chunks))
    print(f"hostile host: {v.frames} frames sent in {len(chunks) + 1} processes in "
          f"{time.monotonic() - started:.1f} s; crashes {v.crashes}, hangs {v.hangs}, "
          f"smuggled frames {v.smuggled}, pay/wipe calls upstream {v.forbidden}, "
          f"failures {len(v.failures)}")
    for fam, count in sorted(v.by_family.items()):
        print(f"  {fam}: {count}")
    return v


def summary(v: Verdict, seed: int) -> str:
    shown = []
    per_family: dict[str, int] = {}
    for fam, frame, problem in v.failures:
        per_family[fam] = per_family.get(fam, 0) + 1
        if per_family[fam] <= 3 and len(shown) < MAX_FAILURES_SHOWN:
            shown.append(f"[{fam}] {problem}\n    frame: {frame}")
    return (f"seed {seed}: {len(v.failures)} failures in {len(v.by_family)} families "
            f"({v.crashes} crashes, {v.hangs} hangs, {v.smuggled} smuggled frames, "
            f"{v.forbidden} pay/wipe calls upstream)\n" + "\n".join(shown))


def test_hostile_host_corpus(tmp_path):
    v = run_corpus(tmp_path, SEED, FRAMES, CHUNK)
    assert not v.failures, summary(v, SEED)


def test_smuggled_frame_never_reaches_the_upstream(tmp_path):
    """The critical case alone: a read-only call whose arguments carry a whole wipe frame
    behind a CR. One echo call upstream, in compact form, and no wipe."""
    corpus = Corpus(SEED)
    d = HostileDir(tmp_path)
    cases = initialize_case(corpus) + corpus.smuggling() + barrier(corpus)
    out = drive(d, cases)
    v = Verdict()
    judge(cases, out, v, SEED, 0)
    print(f"\nsmuggling: {len(cases)} frames, smuggled frames {v.smuggled}, "
          f"pay/wipe calls upstream {v.forbidden}")
    assert v.smuggled == 0 and v.forbidden == 0 and not v.failures, summary(v, SEED)


def test_nesting_at_the_limit(tmp_path):
    """Arguments nested 256 levels execute; 257 are INVALID and reach no upstream."""
    corpus = Corpus(SEED)
    d = HostileDir(tmp_path)
    cases = initialize_case(corpus) + corpus.nesting() + barrier(corpus)
    out = drive(d, cases)
    v = Verdict()
    judge(cases, out, v, SEED, 0)
    assert not v.failures, summary(v, SEED)


@pytest.mark.parametrize("ws", [" ", "\t", "\r"])
def test_whitespace_is_executed_once_in_compact_form(tmp_path, ws):
    """A valid call with JSON whitespace everywhere executes exactly once, and the upstream
    receives the proxy's own compact encoding of equal arguments."""
    corpus = Corpus(SEED)
    d = HostileDir(tmp_path)
    cases = initialize_case(corpus)
    for tool in ("echo", "note"):
        ident, args = corpus.new_id(), corpus.args(tool, plain=True)
        line = finish(render(corpus.call(ident, tool, args)), {r: ws for r in GAP})
        cases.append(corpus.exec_case("whitespace", line, ident, tool, args))
    cases += barrier(corpus)
    out = drive(d, cases)
    v = Verdict()
    judge(cases, out, v, SEED, 0)
    assert not v.failures, summary(v, SEED)


# ---- A hostile model and a hostile host, faults found in review ------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import signal  # noqa: E402

from process_helpers import ProcessDir, _cmdline, child_pids  # noqa: E402
from proxy_harness import (ALLOW_PAY, NEWLINE_SERVER, ProxyHarness, ap, calls,  # noqa: E402
                           compact_outside_strings, host_frames_are_own_encoding,
                           newline_harness, received)
from scan_count import Scans  # noqa: E402


SMUGGLED = (b'{"jsonrpc":"2.0","id":99,"method":"tools/call",'
            b'"params":{"name":"erase","arguments":{}}}')


# JSON's whitespace, and the other characters some reader takes for a line end.
WHITESPACE = [b" ", b"\t", b"\r", b"\n"]
LINE_ENDS_IN_STRINGS = ["\u2028", "\u2029", "\u0085"]


def ledger(tmp_path) -> list[bytes]:
    try:
        with open(os.path.join(str(tmp_path), "ledger"), "rb") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def nested_args(depth: int, key: str = "x") -> bytes:
    """An arguments object nested ``depth`` levels (the object itself is the first)."""
    return b'{"%s":' % key.encode() + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("sep", [b"\r", b"\r\n", b"\n"])
def test_carriage_return_in_arguments_smuggles_no_second_call(tmp_path, sep):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    request smuggling. A CR between two tokens of a host's arguments reached a server that reads
    with universal newlines, which read two messages from one frame and ran a tool the policy
    denies."""
    h = newline_harness(tmp_path)
    try:
        args = b'{"x":' + sep + SMUGGLED + sep + b"}"
        r = h.call("nl_look", raw_args=args, timeout=20)
        assert not h.is_error(r), h.text(r)
        assert calls(tmp_path) == ["look"], received(tmp_path)
        step = [s for run in h.runs() for s in h.store.list_steps(run.id)][0]
        sent = [m["raw"] for m in received(tmp_path) if m["method"] == "tools/call"][0]
        sent_args = json.dumps(json.loads(sent)["params"]["arguments"],
                               separators=(",", ":")).encode()
        assert sent_args == step.args, (sent, step.args)
        assert b"\r" not in step.args and b"\n" not in step.args
        assert ap.canonical_json(step.args) == ap.canonical_json(args)
        host_frames_are_own_encoding(h)
    finally:
        h.close()


@pytest.mark.parametrize("ws", WHITESPACE, ids=["space", "tab", "cr", "lf"])
def test_arguments_sent_are_the_recorded_request_for_every_whitespace_byte(tmp_path, ws):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): every
    frame the proxy writes is its own compact encoding, and the bytes sent are exactly the
    recorded request, for every JSON whitespace byte."""
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY)
    try:
        args = (b"{" + ws + b'"to"' + ws + b":" + ws + b'"b o\\tb"' + ws + b"," + ws +
                b'"amount"' + ws + b":" + ws + b"25.50" + ws + b"}")
        r = h.call("bank_pay", raw_args=args)
        assert not h.is_error(r), h.text(r)
        [paid] = ledger(tmp_path)
        step = [s for run in h.runs() for s in h.store.list_steps(run.id)][0]
        assert paid == step.args                    # byte for byte what was recorded
        assert paid == b'{"to":"b o\\tb","amount":25.50}'
        assert compact_outside_strings(paid)
        assert ap.canonical_json(paid) == ap.canonical_json(args)
        host_frames_are_own_encoding(h)
    finally:
        h.close()


@pytest.mark.parametrize("char", LINE_ENDS_IN_STRINGS, ids=["u2028", "u2029", "u0085"])
def test_line_end_characters_in_argument_strings_are_escaped_as_recorded(tmp_path, char):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    bytes sent are exactly the recorded request for U+2028/U+2029 (and U+0085) in argument
    strings: escaped, as recorded."""
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY)
    try:
        args = ('{"to":"bo' + char + 'b","amount":5}').encode()
        r = h.call("bank_pay", raw_args=args)
        assert not h.is_error(r), h.text(r)
        [paid] = ledger(tmp_path)
        step = [s for run in h.runs() for s in h.store.list_steps(run.id)][0]
        assert paid == step.args
        assert paid == b'{"to":"bo\\u%04xb","amount":5}' % ord(char)
        assert ap.canonical_json(paid) == ap.canonical_json(args)
        assert ap.request_key("bank_pay", paid) == ap.request_key("bank_pay", args)
    finally:
        h.close()


def test_approved_request_is_sent_as_the_approval_recorded_it(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    bytes sent are exactly the recorded request: arguments with CR and tab between their tokens
    are sent, once approved, as the approval recorded them."""
    rules = dict(ALLOW_PAY, pay={"side_effect": "remote_mutation", "timeout": "10s"})
    h = ProxyHarness(tmp_path, rules=rules)
    try:
        args = b'{\r"to":\t"bob",\r"amount":\r7}'
        assert h.prefix(h.call("bank_pay", raw_args=args)) == "PENDING_APPROVAL"
        [approval] = h.pending()
        shown = approval.request().args
        assert shown == b'{"to":"bob","amount":7}'
        h.decide(approval)
        r = h.call("bank_pay", raw_args=args)
        assert not h.is_error(r), h.text(r)
        assert ledger(tmp_path) == [shown]
    finally:
        h.close()


@pytest.mark.parametrize("depth", [255, 256])
def test_arguments_nested_to_the_bound_execute_and_are_recorded(tmp_path, depth):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    findings 2 and 8: arguments nested 255 or 256 levels are executed and recorded."""
    h = newline_harness(tmp_path)
    try:
        r = h.call("nl_look", raw_args=nested_args(depth))
        assert not h.is_error(r) and h.prefix(r) != "UNAVAILABLE", h.text(r)
        assert calls(tmp_path) == ["look"]
        [run] = h.runs()
        assert run.status == ap.COMPLETED
        step = h.store.list_steps(run.id)[0]
        assert step.args == nested_args(depth) and step.obs_kind == ap.TOOL_RESULT
    finally:
        h.close()


def test_arguments_nested_past_the_bound_are_invalid_and_not_sent(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    findings 2 and 8: 257 levels are INVALID, and nothing is sent."""
    h = newline_harness(tmp_path)
    try:
        r = h.call("nl_look", raw_args=nested_args(257))
        assert h.prefix(r) == "INVALID" and h.is_error(r), h.text(r)
        assert calls(tmp_path) == []
    finally:
        h.close()


@pytest.mark.parametrize("depth", [255, 256])
def test_deep_arguments_waiting_for_approval_poison_nothing(tmp_path, depth, cli):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    findings 2 and 8: arguments nested 255 or 256 levels leave every command and the rules
    working (their records wrap them deeper)."""
    rules = {"look": {"side_effect": "read_only", "timeout": "5s"},
             "erase": {"side_effect": "destructive", "timeout": "5s",
                       "outcome": "require_approval"}}
    h = newline_harness(tmp_path, rules=rules, max_pending=10)
    db = h.cfg.database
    try:
        deep = nested_args(depth)
        assert h.prefix(h.call("nl_erase", raw_args=deep)) == "PENDING_APPROVAL"
        [approval] = h.pending()
        status = h.call("gate_status", {})
        assert h.prefix(status) == "GATE_STATUS" and approval.id in h.text(status)
        code, out, err = cli("-db", db, "show", approval.run_id)
        assert code == 0, err
        code, out, err = cli("-db", db, "-json", "show", approval.run_id)
        assert code == 0 and json.loads(out)["approvals"][0]["id"] == approval.id, err
        # Another mutating request still asks, and the rules still read every run.
        assert h.prefix(h.call("nl_erase", {"other": 1})) == "PENDING_APPROVAL"
        code, out, err = cli("-db", db, "approve", approval.run_id, "-approval", approval.id,
                             "-by", "op")
        assert code == 0, out + err
        r = h.call("nl_erase", raw_args=deep)
        assert not h.is_error(r), h.text(r)
        assert calls(tmp_path) == ["erase"]
        assert h.prefix(h.call("nl_erase", raw_args=deep)) == "DUPLICATE"
    finally:
        h.close()
    again = ProxyHarness(tmp_path, rules=rules, command=NEWLINE_SERVER, names=("nl",),
                         server_env=[f"NEWLINE_LOG={tmp_path}/received"], pin=False,
                         max_pending=10)
    try:                                            # a restart reads the records too
        assert again.prefix(again.call("gate_status", {})) == "GATE_STATUS"
        assert again.prefix(again.call("nl_erase", raw_args=deep)) == "DUPLICATE"
        [other] = again.pending()
        code, out, err = cli("-db", db, "reject", other.run_id, "-approval", other.id,
                             "-by", "op",
                             "-note", "no")
        assert code == 0, out + err
    finally:
        again.close()


@pytest.mark.parametrize("depth", [255, 256])
def test_the_approval_view_shows_arguments_nested_to_the_bound(tmp_path, depth):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    findings 2 and 8: the approval view shows arguments nested to the bound, never an unread
    placeholder."""
    rules = {"look": {"side_effect": "read_only", "timeout": "5s"},
             "erase": {"side_effect": "destructive", "timeout": "5s",
                       "outcome": "require_approval"}}
    h = newline_harness(tmp_path, rules=rules)
    try:
        assert h.prefix(h.call("nl_erase", raw_args=nested_args(depth))) == "PENDING_APPROVAL"
        [approval] = h.pending()
        block = ap.approval_block(h.store, approval, h.cfg.database)
        assert not any(line.startswith("unread") for line in block), block[:4]
        assert any(line.strip().startswith("x (") for line in block), block
    finally:
        h.close()


def test_arguments_nested_300_deep_are_recorded_invalid(tmp_path):
    """Review 2, a_deep.py: arguments nested past the envelope's depth (300 levels) were
    refused as a parse error (-32700) with nothing recorded; they are arguments the runtime
    refuses, so the gate records the call as INVALID."""
    h = ProxyHarness(tmp_path)
    try:
        deep = b"[" * 300 + b"]" * 300
        h.send(b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"bank_pay",'
               b'"arguments":{"to":"bob","amount":1,"x":' + deep + b"}}}")

        async def answered():
            while not h.out:
                await asyncio.sleep(0.005)
        h.run(answered(), timeout=30)
        msg = json.loads(h.out[-1])
        assert "result" in msg, f"refused as a message, nothing recorded: {msg}"
        r = msg["result"]
        assert msg["id"] == 7 and h.prefix(r) == "INVALID" and h.is_error(r), h.text(r)
        runs = h.runs()
        assert len(runs) == 1 and runs[0].status == ap.FAILED
        assert h.payments() == 0
    finally:
        h.close()


def test_a_line_past_the_frame_limit_is_answered_and_serving_goes_on(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    host's input: nothing in a line stops serving. A line past the frame limit is answered with
    a parse error, and serving goes on."""
    from process_helpers import ProcessDir, text
    d = ProcessDir(tmp_path)
    try:
        p = d.start()
        p.send_line(b'{"jsonrpc":"2.0","id":7,"method":"ping","params":{"pad":"' +
                    b"x" * (20 * 1024 * 1024) + b'"}}\n')
        r = p.call("bank_balance", {"account": "A-1"}, timeout=60)
        assert text(r) == "account A-1 holds 120.00 EUR", text(r)
        errors = [json.loads(line) for line in p.raw_lines if b'"id":null' in line]
        assert errors and errors[0]["error"]["code"] == -32700, p.raw_lines
        p.stop()
    finally:
        d.cleanup()


def _read_line(stream, timeout: float) -> bytes:
    """One line from a pipe, or b'' at the deadline."""
    box: list = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else b""


def _end(proc: subprocess.Popen) -> None:
    """End a proxy this test started, and the fake server it started, by their pids."""
    if proc.poll() is None:
        servers = [c for c in child_pids(proc.pid) if b"fake_payment_server" in _cmdline(c)]
        for pid in [proc.pid] + servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    for f in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError, ValueError):
            if f is not None:
                f.close()


INITIALIZE = (b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":'
              b'"2025-06-18","capabilities":{},"clientInfo":{"name":"host","version":"1"}}}\n')


def test_host_that_stops_reading_does_not_hang_the_proxy_after_stdin_eof(tmp_path):
    """Review 2, b_pipe.py: a host that closed its end of the proxy's stdout (stopped
    reading) and then closed stdin left the proxy running forever. A closed host pipe ends
    serving: the proxy exits once stdin is closed."""
    d = ProcessDir(tmp_path)
    with open(os.path.join(d.tmp, "proxy.stderr"), "wb") as err:
        proc = subprocess.Popen([PYTHON, PROXY, "-config", d.config], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, cwd=d.tmp)
    try:
        proc.stdin.write(INITIALIZE)
        proc.stdin.flush()
        assert b'"result"' in _read_line(proc.stdout, 30)
        proc.stdout.close()                          # the host stops reading
        proc.stdin.write(b'{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{}}\n')
        proc.stdin.flush()
        # Its answer meets the closed pipe; the proxy may end there (a host that is gone).
        # Nothing else shows that it tried, so wait, bounded, for that exit, then close.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)
        with contextlib.suppress(OSError):
            proc.stdin.close()                       # and ends the session
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        assert code is not None, "the proxy still runs 10 s after stdin closed"
    finally:
        _end(proc)


# A failed parse is read again, piece by piece, to report exactly what is wrong, and a
# message's member values are read one by one: parse_message reads an unterminated string
# about three times.
READS_PER_CHARACTER = 4
UNTERMINATED = [b"A" * 26, b"A" * 100_000, b"a\\n" * 50_000, b"\\u0041" * 20_000]


@pytest.mark.parametrize("body", UNTERMINATED,
                         ids=["26 A", "100,000 A", "50,000 escapes", "20,000 u-escapes"])
def test_an_unterminated_string_is_refused_in_linear_time(body, monkeypatch):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    parser: a string that never ends fails at once.

    Counted in the characters the JSON engine reads (the runtime's scanner and its string
    reader), never timed: at most READS_PER_CHARACTER times the document."""
    scans = Scans(monkeypatch)
    for parse, doc in ((ap.parse_json, b'{"s":"' + body),
                       (ap.parse_message, b'{"jsonrpc":"2.0","id":1,"method":"ping",'
                                          b'"params":{"s":"' + body)):
        scans.clear()
        with pytest.raises(ap.JSONError):
            parse(doc)
        assert 0 < scans.total() <= READS_PER_CHARACTER * len(doc), \
            f"{parse.__name__}: {scans.total()} characters read for {len(doc)}"
