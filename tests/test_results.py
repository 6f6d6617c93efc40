"""What the host gets for a result, and what is recorded of it.

A result returns the server's text blocks as text, as the model would read them straight
from the server, with the server's structured content beside it as structuredContent when
both fit the cap; both are recorded. Past the cap the text alone is returned and recorded.

- A DUPLICATE of a structured result quotes the text the model read.
- An observation keeps the exact bytes of its content member, as the record holds them
  (line breaks written again by the encoder), so that a terminal tool's result is never
  parsed out of the record just built; one read back from a record is parsed as before.
"""

import json

from proxy_harness import ProxyHarness, ap
from scan_count import Scans
from test_rules_cost import InstantServer, instant_proxy

PAY_ALLOW = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
             "refund": {"side_effect": "destructive", "timeout": "10s"}}


def recorded_observation(h: ProxyHarness) -> dict:
    """The stored observation of the newest run's step, read as plain JSON."""
    [[text]] = h.store._read("SELECT observation_json FROM steps ORDER BY rowid DESC LIMIT 1")
    return json.loads(text)


def test_structured_result_returns_the_servers_text_with_structured_content_beside(tmp_path):
    h = ProxyHarness(tmp_path, rules=PAY_ALLOW)
    try:
        r = h.call("bank_pay", {"to": "bob", "amount": 25, "mode": "structured"})
        assert not h.is_error(r), r
        assert r["content"] == [{"type": "text", "text": "paid 25.00 to bob"}]
        assert r["structuredContent"] == {"paid": 25, "to": "bob"}
        obs = recorded_observation(h)
        assert obs["text"] == "paid 25.00 to bob"
        assert obs["content"] == {"paid": 25, "to": "bob"}
        assert h.payments() == 1
    finally:
        h.close()


def test_text_result_is_returned_as_the_text_the_server_sent(tmp_path):
    h = ProxyHarness(tmp_path, rules=PAY_ALLOW)
    try:
        r = h.call("bank_pay", {"to": "amy", "amount": 3})
        assert r["content"] == [{"type": "text", "text": "paid 3.00 to amy"}]
        assert "structuredContent" not in r
        obs = recorded_observation(h)
        assert obs["content"] == "paid 3.00 to amy" and "text" not in obs
    finally:
        h.close()


def tool(cap: int = ap.MAX_CONTENT_BYTES) -> ap.UpstreamTool:
    spec = ap.ToolSpec("fs_read_text_file", "reads", b'{"type":"object"}', "read_only", 5.0,
                       True)
    return ap.UpstreamTool(spec, "fs", "read_text_file", ap.Rule(side_effect="read_only"),
                           None, max_content=cap)


def answer(result: dict) -> ap.Message:
    return ap.parse_message(json.dumps({"jsonrpc": "2.0", "id": 1, "result": result}).encode())


FILE = 'first line\n\t"quoted" second line\n\u00e9\u2028end'


def test_a_file_read_reads_as_the_file_not_as_escaped_json():
    # The filesystem server answers a read with the file as text and again as
    # structuredContent {"content": <the file>}: the model reads the file.
    msg = answer({"content": [{"type": "text", "text": FILE}],
                  "structuredContent": {"content": FILE}})
    obs = ap._observe("fs_read_text_file", 5.0, ap.map_result(tool(), msg))
    out = ap.result_of(obs.doc)
    assert out["content"] == [{"type": "text", "text": FILE}]
    assert out["structuredContent"] == {"content": FILE}
    assert obs.doc["text"] == FILE
    assert '"text":' in obs.json_text                       # the text is in the stored record


def test_structured_content_that_does_not_fit_with_the_text_leaves_the_text():
    text = "t" * 600
    structured = {"k": "s" * 600}
    msg = answer({"content": [{"type": "text", "text": text}], "structuredContent": structured})
    result = ap.map_result(tool(cap=1000), msg)
    assert result.text is None
    assert json.loads(result.content) == text
    assert "structured content of" in result.summary and "dropped" in result.summary
    out = ap.result_of(ap._observe("fs_read_text_file", 5.0, result).doc)
    assert out["content"][0]["text"] == text and "structuredContent" not in out
    # the two together within the cap: both kept
    result = ap.map_result(tool(cap=1400), msg)
    assert result.text == text and json.loads(result.content) == structured


def test_an_error_with_structured_content_tells_the_model_the_servers_text():
    msg = answer({"content": [{"type": "text", "text": "no such file"}],
                  "structuredContent": {"error": {"code": "ENOENT"}}, "isError": True})
    try:
        ap.map_result(tool(), msg)
    except ap.ToolFailure as exc:
        assert str(exc).endswith("error: no such file"), str(exc)
    else:
        raise AssertionError("an isError result must be a failure")


def test_structured_content_that_is_not_an_object_leaves_the_text():
    # Recorded but never handed to the host as structuredContent, it would make the record
    # say the model was given what it was not: the text stands alone.
    for structured in ("SC-STRING", [1, 2, 3], 7, True):
        msg = answer({"content": [{"type": "text", "text": "REAL TEXT"}],
                      "structuredContent": structured})
        result = ap.map_result(tool(), msg)
        obs = ap._observe("fs_read_text_file", 5.0, result).doc
        out = ap.result_of(obs)
        assert out["content"] == [{"type": "text", "text": "REAL TEXT"}], structured
        assert "structuredContent" not in out
        assert obs["content"] == "REAL TEXT" and "text" not in obs


def test_a_content_block_of_a_strange_type_is_an_answer_that_ran():
    # A type that is a list once crashed the mapping; the call had run, and was reported as
    # having had no answer at all.
    msg = answer({"content": [{"type": ["x"]}, {"type": {"a": 1}}, {"type": 7}]})
    result = ap.map_result(tool(), msg)
    assert json.loads(result.content) == "[content omitted]\n[content omitted]\n[content omitted]"


class Crashing:
    name = "fs"

    def offers_tasks(self, support):
        return False

    async def call_tool(self, remote, args, timeout, on_task=None):
        return ap.parse_message(b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}')


def test_an_answer_that_cannot_be_mapped_counts_as_executed(monkeypatch):
    import asyncio
    spec = ap.ToolSpec("fs_write", "writes", b'{"type":"object"}', "local_mutation", 5.0, True)
    up = ap.UpstreamTool(spec, "fs", "write", ap.Rule(side_effect="local_mutation"), Crashing())

    def broken(tool, reply):
        raise TypeError("a mapping bug")
    monkeypatch.setattr(ap, "map_result", broken)
    obs = asyncio.run(ap._call_tool(up, b"{}")).doc
    assert obs["kind"] == ap.TOOL_ERROR
    assert obs["content"]["failure"] == "invalid_content", obs
    assert ap._unrecorded(up, obs)


def test_the_cap_holds_for_the_text_as_written_not_only_as_read():
    # U+0085 and U+2028 are written as six-byte escapes in every frame and record: a text
    # within the cap as characters could be three times over it as written.
    for ch in ("\u0085", "\u2028", "\x9b"):
        msg = answer({"content": [{"type": "text", "text": ch * 5000}]})
        result = ap.map_result(tool(cap=4096), msg)
        obs = ap._observe("fs_read_text_file", 5.0, result)
        frame = ap.dump_json(ap.result_of(obs.doc))
        assert len(frame.encode()) <= 4096 + 200, (repr(ch), len(frame))
        assert "truncated" in result.summary


# ---- Mapping an upstream answer to a result (reference/mcp.md 11.2) -------------------------

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

from proxy_harness import ALLOW_PAY  # noqa: E402
from scripted_server import (BAD_CALLS, MARKER, RO, arun, call_mapped, loaded,  # noqa: E402
                             pin, results_server)


def test_call_structured_and_text_results(script, tmp_path):
    s = results_server(script, tmp_path, {
        "structured": {"result": {"content": [{"type": "text", "text": "2 lines"}],
                                  "structuredContent": {"ok": True, "lines": 2}}},
        "mixed": {"result": {"content": [
            {"type": "text", "text": "first"},
            {"type": "image", "data": "aGk=", "mimeType": "image/png"},
            {"type": "text", "text": "last"}]}},
        "others": {"result": {"content": [
            {"type": "audio", "data": "aGk=", "mimeType": "audio/wav"},
            {"type": "resource_link", "uri": "file:///x", "name": "x"},
            {"type": "resource", "resource": {"uri": "file:///x", "text": "t"}}]}},
        "nothing": {"result": {"content": []}}})

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server({n: RO for n in pinned}), pinned) as (tools, _):
            r = await tools["fs_structured"].call(b'{"path":"p"}')
            assert r.content == b'{"lines":2,"ok":true}'
            assert r.summary == "fs/structured: 21 bytes"
            r = await tools["fs_mixed"].call(b'{"path":"p"}')
            assert json.loads(r.content) == "first\n[image omitted]\nlast"
            r = await tools["fs_others"].call(b'{"path":"p"}')
            assert json.loads(r.content) == ("[audio omitted]\n[resource link omitted]\n"
                                             "[embedded resource omitted]")
            r = await tools["fs_nothing"].call(b'{"path":"p"}')
            assert r.content == b'""'
    arun(body())


def test_call_is_error_becomes_an_error(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": {"result": {
        "content": [{"type": "text", "text": "no such file"}], "isError": True}}})
    with pytest.raises(ap.ToolFailure) as info:
        arun(call_mapped(s, "read_file"))
    assert str(info.value) == "fs/read_file: 14 bytes, error: no such file"


def test_call_oversized_content_is_truncated(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": {"text_size": 500}})
    r = arun(call_mapped(s, "read_file", cap=64))
    assert len(r.content) == 64
    assert json.loads(r.content) == "x" * 49 + MARKER
    assert r.summary == "fs/read_file: 64 bytes, truncated"


def capped(text: str, limit: int) -> tuple[bytes, bool]:
    """cap_text's text as the record holds it: a JSON string in policy form."""
    shown, cut = ap.cap_text(text, limit)
    return ap.encode_policy(shown), cut


def test_call_cap_counts_encoded_bytes():
    content, cut = capped("\x01" * 16, 100)
    assert (len(content), cut) == (98, False)
    assert json.loads(content) == "\x01" * 16
    for text in ("\x01" * 40, "世" * 60, "é\x02" * 30, "a" * 99 + "世"):
        content, cut = capped(text, 100)
        assert cut and len(content) <= 100, (text, content)
        decoded = json.loads(content)            # valid JSON: no split character
        assert decoded.endswith(MARKER)
        assert text.startswith(decoded[:-len(MARKER)])
    content, cut = capped("x" * 500, 64)
    assert len(content) == 64 and cut


def test_cap_text_never_exceeds_the_cap():
    inputs = ["x" * 300, "\x01" * 300, "世" * 300, "\"\\" * 150, "\u2028a" * 150,
              "🙂b" * 150, "a\nb\tc\x7f<>&" * 30]
    for text in inputs:
        for cap in range(200):
            content, cut = capped(text, cap)
            assert len(content) <= max(cap, 15), (text[:10], cap, content)
            decoded = json.loads(content)
            assert cut and decoded.endswith(MARKER)
            prefix = decoded[:-len(MARKER)]
            assert text.startswith(prefix)
            # The cap holds as written (frames and records escape U+2028 and C1 controls).
            assert ap._wire_len(decoded) <= max(cap, 15), (text[:10], cap, content)
            # The longest prefix that fits as written: one more character would not.
            longer = ap._wire_len(text[:len(prefix) + 1] + MARKER)
            assert longer > max(cap, 15), (text[:10], cap, prefix)


def test_call_oversized_structured_content_falls_back_to_text(script, tmp_path):
    big = {"items": ["v" * 20] * 8}
    big_len = len(json.dumps(big, separators=(",", ":")))
    s = results_server(script, tmp_path, {
        "with_text": {"result": {"content": [{"type": "text", "text": "see the items"}],
                                 "structuredContent": big}},
        "alone": {"result": {"content": [], "structuredContent": big}},
        "small": {"result": {"content": [{"type": "text", "text": "{\"k\": 1}"}],
                             "structuredContent": {"k": 1}}}})

    async def body():
        pinned = await pin(s.server())
        async with loaded(s.server({n: RO for n in pinned}), pinned) as (tools, _):
            tools = {k: dataclasses.replace(t, max_content=64) for k, t in tools.items()}
            r = await tools["fs_with_text"].call(b'{"path":"p"}')
            assert r.content == b'"see the items"'
            assert r.summary == (f"fs/with_text: 15 bytes, truncated, structured content of "
                                 f"{big_len} bytes dropped for the text")
            r = await tools["fs_alone"].call(b'{"path":"p"}')
            assert json.loads(r.content) == "[structured content dropped: too large]"
            assert "truncated" in r.summary and "dropped" in r.summary
            r = await tools["fs_small"].call(b'{"path":"p"}')
            assert r.content == b'{"k":1}' and r.summary == "fs/small: 7 bytes"
    arun(body())


def test_call_structured_content_that_cannot_be_encoded_is_ignored(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": {"raw": (
        '{"content":[{"type":"text","text":"fallback"}],"structuredContent":{"v":1e400}}')}})
    r = arun(call_mapped(s, "read_file"))
    assert r.content == b'"fallback"'
    assert r.summary == "fs/read_file: 10 bytes"


def test_call_input_required_is_refused(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": {"result": {
        "resultType": "input_required", "inputRequests": {}}}})
    with pytest.raises(ap.ToolFailure, match="asked for more input") as info:
        arun(call_mapped(s, "read_file"))
    assert str(info.value).startswith("fs_read_file: the server asked for more input")


def test_call_structured_content_keeps_its_numbers(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": {"raw": (
        '{"content":[],"structuredContent":{"id":123456789012345678901234567890,'
        '"n":9007199254740993,"f":0.1,"s":"<b>"}}')}})
    r = arun(call_mapped(s, "read_file"))
    # Keys sorted, no HTML escaping in recorded content, every digit kept (the reference
    # writes the 30-digit id as 1.2345678901234567890123456789e+29; its literal is the same
    # number).
    assert re.fullmatch(rb'\{"f":0\.1,"id":(123456789012345678901234567890|'
                        rb'1\.2345678901234567890123456789e\+29),"n":9007199254740993,'
                        rb'"s":"<b>"\}', r.content), r.content


def test_call_invalid_utf8_in_a_result_becomes_replacement_characters(script, tmp_path):
    s = results_server(script, tmp_path, {"read_file": BAD_CALLS["badutf8"]})
    r = arun(call_mapped(s, "read_file"))
    assert json.loads(r.content) == "ok \ufffd\ufffd bytes \ufffd"


# ---- What is recorded of a result: its record's own bytes ------------------------------------

CONTENTS = [
    b'{"a":1}',
    b'{"a": 1,\n  "b": "x\xe2\x80\xa8y"}',          # a line end of every reader, twice
    b'[1,\r\n2.50, "\xc2\x85"]',
    b'"text"',
    {"error": "no answer", "tool": "bank_pay"},
]


@pytest.mark.parametrize("content", CONTENTS, ids=range(len(CONTENTS)))
def test_an_observations_kept_content_is_its_records_own_bytes(content):
    obs = ap._obs(ap.TOOL_RESULT, content, "a summary")
    recorded = ap.member_spans(obs.json_text.encode())["content"]
    assert ap._content_bytes(obs) == recorded
    read_back = obs._replace(content=None)                    # read back: parsed, as before
    assert ap._content_bytes(read_back) == recorded
    for brk in (b"\n", b"\r", b"\xc2\x85", b"\xe2\x80\xa8"):
        assert brk not in recorded
    assert obs.doc == ap.read_own(obs.json_text) and obs.content_hash == obs.doc["content_hash"]


def test_a_terminal_tools_result_is_its_recorded_content(tmp_path):
    rules = dict(PAY_ALLOW, balance=dict(PAY_ALLOW["balance"], terminal=True))
    h = ProxyHarness(tmp_path, rules=rules)
    proxy = instant_proxy(h, InstantServer())
    try:
        result = h.run(proxy.call("bank_balance", b'{"account":"A-1"}'))
        assert not result.get("isError"), result
        run = h.store.list_runs(1)[0][0]
        step = h.store.list_steps(run.id)[0]
        raw = h.store._read("SELECT observation_json FROM steps WHERE id=?", (step.id,))[0][0]
        assert run.status == ap.COMPLETED
        assert run.result_json.encode() == ap.member_spans(raw.encode())["content"]
    finally:
        proxy.close()
        h.close()


# ---- A duplicate's answer quotes the result the model read -----------------------------------

PAY = "bank_pay"


@pytest.fixture
def make(harnesses):
    return harnesses


def test_a_duplicate_of_a_structured_result_quotes_the_text_the_model_read(make):
    h = make(rules={"pay": {"side_effect": "remote_mutation", "timeout": "10s",
                            "outcome": "allow"}})
    args = {"to": "bob", "amount": 5, "mode": "structured"}
    first = h.call(PAY, args)
    assert h.text(first) == "paid 5.00 to bob" and "structuredContent" in first, first
    r = h.call(PAY, args)
    assert h.prefix(r) == "DUPLICATE", h.text(r)
    assert h.text(r).endswith("The earlier call's outcome: it succeeded: paid 5.00 to bob"), \
        h.text(r)


# ---- Results, faults found in review ---------------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

def test_is_error_answer_with_deep_structured_content_is_a_known_failure():
    """Review 2, j_maperr.py: an isError answer whose structuredContent is nested past 256
    levels made map_result raise JSONError, recorded as a panic: an unknown outcome
    (no_answer) that blocks the tool. The server answered that it failed: a known failure."""
    spec = ap.ToolSpec("bank_pay", "", b'{"type":"object"}', "remote_mutation", 5.0, True)
    tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"), None)
    deep = b"[" * 300 + b"1" + b"]" * 300
    line = (b'{"jsonrpc":"2.0","id":1,"result":{"isError":true,"content":[{"type":"text",'
            b'"text":"declined"}],"structuredContent":{"x":' + deep + b"}}}")
    msg = ap.parse_message(line, ap.UPSTREAM_DEPTH)

    async def answer(args, value=None):
        return ap.map_result(tool, msg)

    obs = asyncio.run(ap._call_tool(ap.Tool(spec, answer), b"{}"))[0]
    assert obs["kind"] == ap.TOOL_ERROR
    assert "panic" not in json.dumps(obs["content"]), obs["content"]
    assert ap.unknown_ending(tool, obs) is None


def _mapped(result: bytes) -> dict:
    """The observation the gate records for an upstream answer with this result."""
    spec = ap.ToolSpec("bank_pay", "", b'{"type":"object"}', "remote_mutation", 5.0, True)
    tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"), None)
    msg = ap.parse_message(b'{"jsonrpc":"2.0","id":1,"result":' + result + b"}",
                           ap.UPSTREAM_DEPTH)

    async def answer(args, value=None):
        return ap.map_result(tool, msg)

    return asyncio.run(ap._call_tool(ap.Tool(spec, answer), b"{}"))[0]


def test_structured_content_past_a_float_is_ignored_for_the_text():
    """93356a0: structuredContent holding a number beyond a 64-bit float was handed on, so the
    gate refused it as content it cannot record and the payment was UNRECORDED. mcp.md 8.4:
    structured content that will not encode is ignored and the text stands."""
    obs = _mapped(b'{"content":[{"type":"text","text":"paid"}],"structuredContent":'
                  b'{"x":1e400}}')
    assert obs["kind"] == ap.TOOL_RESULT, obs
    assert obs["content"] == "paid"


def test_bad_bytes_in_a_result_read_as_replacement_characters():
    """93356a0: a byte that is not UTF-8 inside a server's result made the whole result
    "not JSON", a failure without an answer (an unknown outcome). The server answered: the
    bad byte reads as U+FFFD."""
    obs = _mapped(b'{"content":[{"type":"text","text":"paid \xff to bob"}]}')
    assert obs["kind"] == ap.TOOL_RESULT, obs
    assert obs["content"] == "paid \ufffd to bob"


def test_structured_result_with_fractional_numbers_is_passed_on_as_recorded(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would):
    structured content is recorded, and what the host gets is what was recorded: a structured
    result with fractional numbers (25.50) is passed on as recorded, and the identical call is
    answered again."""
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


def test_a_large_server_answer_is_read_in_bounded_time(monkeypatch):
    # The same cost from the other side: a server's answer with 600,000 zeros in its
    # structuredContent (1.2 MB; a frame may hold 16 MiB). It is read (parse_message, its
    # spans), mapped (map_result parses the result, its spans, then the structured content
    # again and encodes it, to drop it for being past the 64 KiB cap) and observed, all on
    # the event loop. The faulty code spends about six parses of it (5.7 measured), the
    # fixed one about one; a 16 MiB answer cost the faulty code a minute or more.
    """The hardened proxy's review, finding 3: one host message of under 1 MB keeps the event
    loop busy for seconds: the arguments are parsed about seven times, at microseconds a value.
    A server's answer costs the same way. Judged by a count, never by a time: the reads of the
    JSON engine over the answer's structured content."""
    structured = b'{"v":[' + b",".join([b"0"] * 600_000) + b"]}"
    line = (b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"paid"}],'
            b'"structuredContent":' + structured + b"}}\n")
    assert len(line) < ap.MAX_FRAME
    spec = ap.ToolSpec("bank_pay", "pays", b'{"type":"object"}', "remote_mutation", 5.0, True)
    tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"), None)
    # Counted in reads of it or of its structured content: the fixed code reads the
    # answer in one pass; the faulty code parsed it, or its structured content, three times
    # or more.
    scans = Scans(monkeypatch)
    msg = ap.parse_message(line, ap.UPSTREAM_DEPTH)
    obs = ap._observe("bank_pay", 5.0, ap.map_result(tool, msg))
    assert obs[0]["kind"] == ap.TOOL_RESULT
    parses = scans.at_least(len(structured))
    assert len(parses) == 1, f"the answer or its structured content read {len(parses)} times"


class ClaimsInvalidContent(InstantServer):
    """A server whose result's own structured content reads like the proxy's record of an
    answer it could not map: a result, which the model must get as the server sent it."""

    def offers_tasks(self, support):
        return False

    async def call_tool(self, remote, args, timeout, on_task=None):
        self.calls += 1
        return answer({"content": [{"type": "text", "text": "done"}],
                       "structuredContent": {"failure": "invalid_content", "ok": True}})


def test_a_result_whose_content_names_a_failure_is_the_result_not_unrecorded(tmp_path):
    h = ProxyHarness(tmp_path, rules=PAY_ALLOW)
    proxy = instant_proxy(h, ClaimsInvalidContent())
    try:
        r = h.run(proxy.call("bank_pay", b'{"to":"bob","amount":1}'))
        assert not r.get("isError"), r
        assert r["content"] == [{"type": "text", "text": "done"}], r
        assert r["structuredContent"] == {"failure": "invalid_content", "ok": True}
        assert recorded_observation(h)["kind"] == ap.TOOL_RESULT
    finally:
        proxy.close()
        h.close()
