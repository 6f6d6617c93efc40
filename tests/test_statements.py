"""An allowed call in few SQLite statements, recording exactly what it recorded before.

- A run a transaction moves is returned as a fresh read finds it, and a read of a run
  inside this thread's open transaction sees that transaction's writes.
- A new run's first step reads no steps (a run with no step counted has none).
- A run id already taken is refused and nothing is written.
- The call index's claim is a compare-and-set without a read: the open row the caller read
  is closed only while it is still open, and a key that has an open row takes no second one.
- The key's open row and its newest closed rows are one statement.
"""


import pytest

from proxy_harness import ap

RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}


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
