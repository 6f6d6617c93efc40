"""What the host gets for a result, and what is recorded of it.

A result returns the server's text blocks as text, as the model would read them straight
from the server, with the server's structured content beside it as structuredContent when
both fit the cap; both are recorded. Past the cap the text alone is returned and recorded.
"""

import json

from proxy_harness import ProxyHarness, ap

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

    async def call_tool(self, remote, args, timeout):
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
