"""Each byte parsed once (issue 32, section 3): a frame is parsed once, strictly, and the
parsed value travels with the call; no step reads the same bytes again.

Counted, never timed: every read of the JSON engine (scan_count.Scans) during one allowed
mutating tools/call with a 1 MB argument and one allowed read whose answer is 1 MB, through
the in-process proxy. A read of at least the payload's length is a read of the frame's
payload: there is exactly one for each, the host's frame as it arrives and the server's
answer as it is read.

- A call's arguments are parsed once: the host's arguments, parsed strictly for their
  request key, travel with the call as the strict parse of the proxy's own encoding of
  them, which every later reader reads (the schema check, the policy's copy, the record,
  the request sent). A fixed parameter is written into a copy, never into that value.
- A frame's spans are found while it is parsed, and a record's members come from the one
  parse that reads it; a record that is not an object is unreadable.
"""

import json
import os
import sys

import pytest

from proxy_harness import ROOT, ProxyHarness, ap
from scan_count import Scans
from test_rules_cost import InstantServer, instant_proxy

PAYLOAD = 1024 * 1024
FILES_SERVER = [sys.executable, os.path.join(ROOT, "tests", "files_server.py")]
RULES = {"write_file": {"side_effect": "remote_mutation", "timeout": "30s",
                        "outcome": "allow"},
         "read_file": {"side_effect": "read_only", "timeout": "30s"},
         "list_entries": {"side_effect": "read_only", "timeout": "30s"}}


def files_harness(tmp_path) -> ProxyHarness:
    served = tmp_path / "served"
    served.mkdir()
    return ProxyHarness(tmp_path, rules=RULES, command=FILES_SERVER,
                        server_env=[f"FILES_ROOT={served}"], names=("files",))


def test_a_large_argument_and_a_large_answer_are_each_read_once(tmp_path, monkeypatch):
    h = files_harness(tmp_path)
    try:
        scans = Scans(monkeypatch)
        content = "x" * PAYLOAD
        wrote = h.call("files_write_file", {"path": "big.txt", "content": content})
        assert not h.is_error(wrote), h.text(wrote)
        assert h.text(wrote) == f"wrote {PAYLOAD} characters"
        assert len(scans.at_least(PAYLOAD)) == 1, \
            f"the argument was read {len(scans.at_least(PAYLOAD))} times"
        scans.clear()
        read = h.call("files_read_file", {"path": "big.txt"})
        assert not h.is_error(read), h.text(read)
        assert len(scans.at_least(PAYLOAD)) == 1, \
            f"the answer was read {len(scans.at_least(PAYLOAD))} times"
    finally:
        h.close()


def test_a_capped_answer_is_recorded_from_the_parse_that_read_it(tmp_path, monkeypatch):
    """A text answer past the cap: the server's frame is read once, and the capped text the
    gate records, hashes and answers with is the value cut from that read, never its own
    bytes read again."""
    h = files_harness(tmp_path)
    try:
        text = ('{"k": "v"}\n' * (2 * ap.MAX_CONTENT_BYTES // 11))
        (tmp_path / "served" / "page.txt").write_text(text)
        scans = Scans(monkeypatch)
        read = h.call("files_read_file", {"path": "page.txt"})
        assert not h.is_error(read), h.text(read)
        assert h.text(read).startswith('{"k": "v"}') and h.text(read).endswith(ap.TRUNCATION_MARKER)
        big = scans.at_least(ap.MAX_CONTENT_BYTES // 2)
        assert len(big) == 1, f"{len(big)} reads of the answer's size"
    finally:
        h.close()


def test_structured_content_is_recorded_from_the_frames_one_read(tmp_path, monkeypatch):
    """The server's structured content is read once, with the frame that carries it: the
    gate records, hashes and answers with that read's value (its members sorted, as the
    record keeps them), never reading the content's own bytes again, nor the bytes it
    records."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import files_server
    listing = files_server.listing(500, "entry")
    size = len(json.dumps(listing))           # the frame carries it twice: as text and as is
    h = files_harness(tmp_path)
    try:
        scans = Scans(monkeypatch)
        answer = h.call("files_list_entries", {"count": 500, "prefix": "entry"})
        assert not h.is_error(answer), h.text(answer)
        assert answer["structuredContent"] == json.loads(json.dumps(listing))
        assert list(answer["structuredContent"]["entries"][0]) == ["name", "size", "type"]
        assert 2 * size < scans.total() < 2 * size + size // 4, \
            f"{scans.total()} characters read for a frame of about {2 * size}"
    finally:
        h.close()


class _Files:
    """map_result's view of a tool: its names and its cap."""
    spec = ap.ToolSpec("files_list_entries", "", b"{}", "read_only", 30.0)
    server, remote, max_content = "files", "list_entries", ap.MAX_CONTENT_BYTES


@pytest.mark.parametrize("judged", ["params", "result"])
def test_structured_content_is_always_the_results_whatever_the_frame_was_read_for(judged):
    """The value a frame's read carries is a result member's only when the read judged the
    result: a frame read for its params never hands its params' member as the result's."""
    frame = (b'{"jsonrpc":"2.0","id":1,"params":{"structuredContent":{"evil":1}},'
             b'"result":{"content":[],"structuredContent":{"b":2,"a":1}}}')
    result = ap.map_result(_Files, ap.parse_message(frame, ap.UPSTREAM_DEPTH, judged))
    assert result.content == b'{"a":1,"b":2}'
    assert ap._observe("files_list_entries", 30.0, result).doc["content"] == \
        {"a": ap.Num("1"), "b": ap.Num("2")}


FAULTS = [b'{"a":1,"a":2}', b'{"a":"\\ud800"}', b'{"a":"\xff"}', b'{"a":1e999999}',
          b'{"a":[1e400]}', b'{"a":' + b"[" * ap.MAX_DEPTH + b"]" * ap.MAX_DEPTH + b"}"]


@pytest.mark.parametrize("args", FAULTS, ids=range(len(FAULTS)))
def test_arguments_the_strict_parser_refuses_are_never_taken_from_the_message(args):
    """The message's one read hands on the arguments' value only when parse_json of their
    bytes would give it: any fault of the strict parser's in them, and they are parsed on
    their own (for the exact refusal), as before."""
    frame = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t",' \
            b'"arguments":' + args + b',"_meta":{"k":1,"k":2}}}'
    msg = ap.parse_message(frame)
    assert msg.parsed("arguments") is ap.NOT_PARSED
    with pytest.raises(ap.JSONError):
        ap.parse_json(msg.raw("arguments", in_params=True))
    fine = ap.parse_message(frame.replace(args, b'{"a":[1.50,"\\u00e9"]}'))
    assert fine.parsed("arguments") == ap.parse_json(b'{"a":[1.50,"\\u00e9"]}')
    assert fine.parsed("_meta") is ap.NOT_PARSED            # its own repeated key


# -- a call's arguments, parsed once -----------------------------------------------------------

PAY_ALLOW = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"},
             "refund": {"side_effect": "destructive", "timeout": "10s"}}

ARGUMENTS = [
    b'{"account":"A-1"}',
    b'{ "account" : "A-\\u00e9",\r\n "n": [1.50, -0, 2E+3, {"x": null}] }',
    b'{"t":"a\xe2\x80\xa8b\\ud83d\\ude00"}',
    b'{"big":123456789012345678901234567890}',
]


@pytest.mark.parametrize("raw", ARGUMENTS, ids=range(len(ARGUMENTS)))
def test_host_arguments_carry_the_strict_parse_of_their_recorded_bytes(raw):
    args, key, value = ap.host_arguments("bank_pay", raw)
    assert key is not None
    assert value == ap.parse_json(args) == ap.parse_json(raw)
    assert ap.dump_json(value).encode() == args
    assert ap.host_arguments("bank_pay", raw, value) == (args, key, value)


def one_call(h, upstream, name, args):
    """One call through a proxy in front of ``upstream``; the proxy and store closed."""
    proxy = instant_proxy(h, upstream)
    try:
        return h.run(proxy.call(name, args))
    finally:
        proxy.close()
        h.close()


def test_a_calls_arguments_are_parsed_once(tmp_path, monkeypatch):
    h = ProxyHarness(tmp_path, rules=PAY_ALLOW)
    args = b'{"to":"bob","amount":1}'
    parsed: list[bytes] = []
    real = ap.parse_json

    def counted(raw, *a, **k):
        parsed.append(bytes(raw))
        return real(raw, *a, **k)
    monkeypatch.setattr(ap, "parse_json", counted)
    result = one_call(h, InstantServer(), "bank_pay", args)
    assert not result["isError"], result
    assert parsed.count(args) == 1, parsed


class Recording(InstantServer):
    def __init__(self):
        super().__init__()
        self.sent: list[bytes] = []

    def offers_tasks(self, support):
        return False

    async def call_tool(self, remote, args, timeout, on_task=None):
        self.sent.append(args)
        return await super().call_tool(remote, args, timeout)


def test_a_fixed_parameter_is_written_into_a_copy_of_the_arguments(tmp_path):
    rules = dict(PAY_ALLOW, pay=dict(PAY_ALLOW["pay"], fixed={"currency": "EUR"}))
    h = ProxyHarness(tmp_path, rules=rules)
    upstream = Recording()
    args = b'{"to":"bob","amount":1}'
    result = one_call(h, upstream, "bank_pay", args)
    assert not result["isError"], result
    assert upstream.sent == [b'{"to":"bob","amount":1,"currency":"EUR"}']


# -- a frame's spans, recorded while it is parsed --

FRAMES = [
    b'{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"name":"t","arguments":{"a":1}}}',
    b' { "id" : "x\\u00e9" , "params" : { "name" : "t" ,\t"arguments" : { } } , "z" : [1, {"b": 2}] } ',
    b'{"id":-1.5e3,"result":{"content":[{"type":"text","text":"a\\"b"}],"isError":false},"x":null}',
    b'{"a":true,"b":false,"c":null,"d":"","e":{},"f":[],"g":{"h":{"i":{"j":1}}}}',
    b'{"k\\u0041":{"in":"\\ud83d\\ude00"},"kA":{"in":2},"params":[1,2]}',      # a repeated key
    b'{"params":{"arguments":"\xff\xfe not UTF-8","name":"n"},"id":1}',
    b'{"a":{"b":1},"a":5,"c":{"d":{"e":2}}}',                                # a dict dropped
    b'{"id":0,"result":{"x":"\\n\\t","y":12345678901234567890,"z":[{"q":"}"}]}}',
    b'{}',
]


@pytest.mark.parametrize("frame", FRAMES, ids=range(len(FRAMES)))
def test_a_frames_spans_are_found_while_it_is_parsed(frame):
    msg = ap.parse_message(frame)
    members = [(msg.spans, msg.doc)]
    members += [(msg.inner[name], msg.doc[name]) for name in msg.inner]
    for name, (a, _) in msg.spans.items():
        assert (name in msg.inner) == (msg.text[a] == "{"), name
    params = msg.doc.get("params")
    assert msg.params_spans == (msg.inner["params"] if isinstance(params, dict) else {})
    if b"\xff" in frame:
        return                                     # its arguments are not JSON text alone
    for spans, doc in members:                     # each span is its value, exactly
        assert set(spans) == set(doc)
        for name, (a, b) in spans.items():
            value = ap.parse_json(msg.text[a:b].encode(), strict=False, bounds=False)
            assert ap.encode_canonical(value) == ap.encode_canonical(doc[name])


RECORDS = [
    b'{"kind":"tool_call","tool":"bank_pay","args":{"to":"bob","amount":1.50},"origin":"model"}',
    b'{"kind":"tool_call","tool":"t","args":{"a":{"b":[1,{"c":"\\u00e9\\n"}]},"z":1e400},'
    b'"origin":"model"}',
    b'{"kind":"complete","result":"done","args":{}}',
    b'{"kind":"fail","message":"x"}',
    b' { "kind" : "tool_call" , "args" : [ 1 , 2 ] } ',
]


@pytest.mark.parametrize("raw", RECORDS, ids=range(len(RECORDS)))
def test_a_records_members_come_from_the_one_parse_that_reads_it(raw):
    doc, members = ap.read_members(raw)
    assert ap.encode_canonical(doc) == ap.encode_canonical(ap.read_own(raw))
    for name, member in members.items():                       # each its value's bytes
        assert ap.read_own(member) == doc[name]
    row = ("step", "run", 0, "done", raw.decode(), "", "", "", "", "", "", "")
    step = ap._step_from_row(row)
    assert step.decision == ap.loads_own(raw)
    assert step.args == members.get("args", b"")


def test_a_record_that_is_not_an_object_is_unreadable():
    with pytest.raises(ap.JSONError, match="expected an object"):
        ap.read_members(b'["kind"]')
    row = ("step", "run", 0, "done", '["kind"]', "", "", "", "", "", "", "")
    with pytest.raises(ap.StoreError, match="cannot be read"):
        ap._step_from_row(row)
