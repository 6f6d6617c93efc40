"""Regression tests for what a review found when it tried the proxy as a hostile model and a
hostile server would (each fails on the code before its fix):

- a CR between two tokens of a host's arguments reached a server that reads with universal
  newlines, which read two messages from one frame and ran a tool the policy denies;
- every frame the proxy writes is its own compact encoding, and the bytes sent are exactly
  the recorded request, for every JSON whitespace byte and for U+2028/U+2029;
- a server's answer with CR between its tokens cannot forge a frame to the host;
- arguments nested 255 or 256 levels are executed and recorded, and leave every command and
  the rules working (their records wrap them deeper); 257 levels are INVALID;
- structured content nested 256 levels is recorded; any failure after the tool returned is
  UNRECORDED and counts as executed.
"""

import json
import os
import sys

import pytest

from proxy_harness import ProxyHarness, ap

HERE = os.path.dirname(os.path.abspath(__file__))
NEWLINE_SERVER = [sys.executable, os.path.join(HERE, "newline_server.py")]
NEWLINE_RULES = {"look": {"side_effect": "read_only", "timeout": "5s"},
                 "erase": {"side_effect": "destructive", "timeout": "5s"}}
ALLOW_PAY = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow",
                     "repeat_window": "0s"},
             "refund": {"side_effect": "destructive", "timeout": "10s"}}
SMUGGLED = (b'{"jsonrpc":"2.0","id":99,"method":"tools/call",'
            b'"params":{"name":"erase","arguments":{}}}')
# JSON's whitespace, and the other characters some reader takes for a line end.
WHITESPACE = [b" ", b"\t", b"\r", b"\n"]
LINE_ENDS_IN_STRINGS = ["\u2028", "\u2029", "\u0085"]


def newline_harness(tmp_path, rules=None, **top) -> ProxyHarness:
    return ProxyHarness(tmp_path, rules=rules or NEWLINE_RULES, command=NEWLINE_SERVER,
                        names=("nl",), server_env=[f"NEWLINE_LOG={tmp_path}/received"], **top)


def received(tmp_path) -> list[dict]:
    """What the newline server read, message by message."""
    try:
        with open(os.path.join(str(tmp_path), "received"), encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def calls(tmp_path) -> list[str]:
    return [m["name"] for m in received(tmp_path) if m["method"] == "tools/call"]


def ledger(tmp_path) -> list[bytes]:
    try:
        with open(os.path.join(str(tmp_path), "ledger"), "rb") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def nested_args(depth: int, key: str = "x") -> bytes:
    """An arguments object nested ``depth`` levels (the object itself is the first)."""
    return b'{"%s":' % key.encode() + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def compact_outside_strings(frame: bytes) -> bool:
    """No whitespace byte outside strings, and no raw line end of any reader anywhere."""
    if any(brk in frame for brk in (b"\r", b"\n", "\u2028".encode(), "\u2029".encode(),
                                    "\u0085".encode())):
        return False
    in_string = escaped = False
    for byte in frame:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b" \t":
            return False
    return True


def host_frames_are_own_encoding(h: ProxyHarness) -> None:
    for frame in h.out:
        assert frame.endswith(b"\n") and compact_outside_strings(frame[:-1]), frame[:200]
        assert isinstance(json.loads(frame), dict)


# -- finding 1: request smuggling ---------------------------------------------------------------

@pytest.mark.parametrize("sep", [b"\r", b"\r\n", b"\n"])
def test_carriage_return_in_arguments_smuggles_no_second_call(tmp_path, sep):
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


def test_server_answer_with_cr_between_tokens_forges_no_frame_to_the_host(tmp_path):
    h = newline_harness(tmp_path)
    try:
        r = h.call("nl_look", {"crafted": "cr"}, timeout=20)
        assert not h.is_error(r), h.text(r)
        assert h.text(r).startswith("ok\r\n")
        host_frames_are_own_encoding(h)
        answers = [json.loads(f) for f in h.out]
        assert [a.get("id") for a in answers] == [h.next_id]      # one answer, ours
        assert not any("method" in a for a in answers)
    finally:
        h.close()


# -- findings 2 and 8: arguments nested to the bound ----------------------------------------------

@pytest.mark.parametrize("depth", [255, 256])
def test_arguments_nested_to_the_bound_execute_and_are_recorded(tmp_path, depth):
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
    h = newline_harness(tmp_path)
    try:
        r = h.call("nl_look", raw_args=nested_args(257))
        assert h.prefix(r) == "INVALID" and h.is_error(r), h.text(r)
        assert calls(tmp_path) == []
    finally:
        h.close()


@pytest.mark.parametrize("depth", [255, 256])
def test_deep_arguments_waiting_for_approval_poison_nothing(tmp_path, depth, cli):
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


# -- finding 3: content nested to the bound, and failures after the tool returned -----------------

ERASE_ALLOWED = {"look": {"side_effect": "read_only", "timeout": "5s"},
                 "erase": {"side_effect": "destructive", "timeout": "5s", "outcome": "allow"}}


def test_structured_content_nested_256_levels_is_recorded_and_returned(tmp_path):
    h = newline_harness(tmp_path, rules=ERASE_ALLOWED)
    try:
        r = h.call("nl_erase", {"structured_depth": 256})
        assert not h.is_error(r), h.text(r)
        assert "structuredContent" in r
        [run] = h.runs()
        assert run.status == ap.COMPLETED
        assert h.prefix(h.call("nl_erase", {"structured_depth": 256})) == "DUPLICATE"
        assert calls(tmp_path) == ["erase"]
    finally:
        h.close()


def test_structured_content_past_the_bound_is_unrecorded_and_counts(tmp_path):
    h = newline_harness(tmp_path, rules=ERASE_ALLOWED)
    try:
        r = h.call("nl_erase", {"structured_depth": 257})
        assert h.prefix(r) == "UNRECORDED", h.text(r)
        assert h.prefix(h.call("nl_erase", {"structured_depth": 257})) == "DUPLICATE"
        assert calls(tmp_path) == ["erase"]
    finally:
        h.close()


def test_failure_after_the_tool_returned_is_unrecorded_not_unexecuted(tmp_path, monkeypatch):
    h = newline_harness(tmp_path, rules=ERASE_ALLOWED)
    real = ap._obs

    def broken(kind, content, summary):
        if kind == ap.TOOL_RESULT:
            raise ValueError("the observation would not encode")
        return real(kind, content, summary)
    try:
        monkeypatch.setattr(ap, "_obs", broken)
        r = h.call("nl_erase", {"n": 1})
        monkeypatch.setattr(ap, "_obs", real)
        assert h.prefix(r) == "UNRECORDED", h.text(r)
        assert "Nothing was executed" not in h.text(r)
        r = h.call("nl_erase", {"n": 1})
        assert h.prefix(r) == "DUPLICATE", h.text(r)
        assert calls(tmp_path) == ["erase"]
    finally:
        h.close()


def test_structured_result_with_fractional_numbers_is_passed_on_as_recorded(tmp_path):
    h = ProxyHarness(tmp_path, rules=ALLOW_PAY)
    try:
        r = h.call("bank_pay", raw_args=b'{"to":"bob","amount":25.50,"mode":"structured"}')
        assert not h.is_error(r), h.text(r)
        raw = [f for f in h.out if b"structuredContent" in f][0]
        assert b'"paid":25.5' in raw
        again = h.call("bank_pay", raw_args=b'{"to":"bob","amount":25.50,"mode":"structured"}')
        assert not h.is_error(again), h.text(again)
    finally:
        h.close()


# -- the host's input: nothing in a line stops serving ---------------------------------------------

def test_a_line_past_the_frame_limit_is_answered_and_serving_goes_on(tmp_path):
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


def test_a_fault_while_routing_a_message_is_answered_not_fatal(tmp_path, monkeypatch):
    h = ProxyHarness(tmp_path)
    try:
        def broken():
            raise RuntimeError("listing failed")
        monkeypatch.setattr(h.proxy, "listing", broken)
        msg = h.request("tools/list")
        assert msg["error"]["code"] == ap.INTERNAL_ERROR
        monkeypatch.undo()
        assert "tools" in h.request("tools/list")["result"]
    finally:
        h.close()


# -- edited rows: a hash that is not ASCII, a value that is not text --------------------------------

def test_an_edited_approval_hash_that_is_not_ascii_is_refused_not_fatal(tmp_path, cli):
    import sqlite3
    rules = dict(ALLOW_PAY, pay={"side_effect": "remote_mutation", "timeout": "10s"})
    h = ProxyHarness(tmp_path, rules=rules)
    try:
        assert h.prefix(h.call("bank_pay", {"to": "bob", "amount": 3})) == "PENDING_APPROVAL"
        [approval] = h.pending()
        conn = sqlite3.connect(h.cfg.database)
        conn.execute("UPDATE approvals SET hash=? WHERE id=?",
                     ("\u202e" + approval.hash[1:], approval.id))
        conn.commit()
        conn.close()
        code, out, err = cli("-db", h.cfg.database, "approve", approval.run_id,
                             "-approval", approval.id, "-by", "op")
        assert code == 1 and "Traceback" not in err and "\u202e" not in out + err, out + err
        assert h.store.get_approval(approval.id).status == ap.PENDING
    finally:
        h.close()


def test_verify_reports_an_event_whose_fields_are_not_text(tmp_path, cli):
    import sqlite3
    h = ProxyHarness(tmp_path)
    try:
        assert not h.is_error(h.call("bank_balance", {"account": "A-1"}))
    finally:
        h.close()
    conn = sqlite3.connect(h.cfg.database)
    conn.execute("UPDATE events SET payload_json=? WHERE seq=2", (b"\x1b[31m{}",))
    conn.execute("UPDATE events SET hash=? WHERE seq=3", (12345,))
    conn.commit()
    conn.close()
    code, out, err = cli("-db", h.cfg.database, "verify")
    assert code == 1 and "Traceback" not in err, out + err
    assert "\x1b" not in out + err


# -- the parser: a string that never ends fails at once ----------------------------------------------

class ReadCounted:
    """A compiled pattern of the parser whose match() counts the characters it read: up to
    the end of its match, or, when it fails, to the end of the text (all it may have read)."""

    def __init__(self, pattern, read: list):
        self.pattern, self.read = pattern, read

    def match(self, text, pos=0, *rest):
        m = self.pattern.match(text, pos, *rest)
        self.read[0] += m.end() - pos + 1 if m else len(text) - pos
        return m

    def __getattr__(self, name):
        return getattr(self.pattern, name)


STRING_PATTERNS = ("_PLAIN_STRING", "_PLAIN_KEY", "_ESCAPED_STRING", "_STRING_CHUNK",
                   "_SCALAR_THEN")
# A failed parse is read again, piece by piece, to report exactly what is wrong; a message's
# spans are read too: parse_message reads an unterminated string about five times.
READS_PER_CHARACTER = 8
UNTERMINATED = [b"A" * 26, b"A" * 100_000, b"a\\n" * 50_000, b"\\u0041" * 20_000]


@pytest.mark.parametrize("body", UNTERMINATED,
                         ids=["26 A", "100,000 A", "50,000 escapes", "20,000 u-escapes"])
def test_an_unterminated_string_is_refused_in_linear_time(body, monkeypatch):
    """Counted in the characters the parser's patterns read, never timed: at most
    READS_PER_CHARACTER times the document, however many pieces the string is read in."""
    read = [0]
    for name in STRING_PATTERNS:
        monkeypatch.setattr(ap, name, ReadCounted(getattr(ap, name), read))
    for parse, doc in ((ap.parse_json, b'{"s":"' + body),
                       (ap.parse_message, b'{"jsonrpc":"2.0","id":1,"method":"ping",'
                                          b'"params":{"s":"' + body)):
        read[0] = 0
        with pytest.raises(ap.JSONError):
            parse(doc)
        assert read[0] <= READS_PER_CHARACTER * len(doc), \
            f"{parse.__name__}: {read[0]} characters read for {len(doc)}"


def test_the_host_input_waits_while_answers_are_not_read(tmp_path):
    h = ProxyHarness(tmp_path)
    backlog = [ap.MAX_OUTPUT_BACKLOG + 1]
    try:
        async def drain_later():
            await ap.asyncio.sleep(0.2)
            backlog[0] = 0
        async def scenario():
            drainer = ap.asyncio.ensure_future(drain_later())
            await h.host.room(lambda: backlog[0])
            drained = drainer.done()            # room() came back only once it was drained
            await drainer
            return drained
        assert h.run(scenario())
    finally:
        h.close()


@pytest.mark.parametrize("depth", [255, 256])
def test_the_approval_view_shows_arguments_nested_to_the_bound(tmp_path, depth):
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
