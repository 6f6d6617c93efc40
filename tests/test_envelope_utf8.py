"""A message's bytes must be UTF-8 everywhere but inside a call's arguments (which the gate
records as INVALID instead): a bad byte before, after or without arguments is a Parse error
answered with id null; one inside them reaches the method."""
import json

import agentrt_proxy as ap


def _answers(line: bytes) -> list:
    out: list = []
    host = ap.HostServer(None, out.append, lambda text: None)
    host.handle(line)
    return [json.loads(x) for x in out]


def test_a_bad_byte_outside_arguments_is_a_parse_error_wherever_it_stands():
    for params in (b'{"x":"\xff","arguments":{}}', b'{"arguments":{},"x":"\xff"}',
                   b'{"x":"\xff"}', b'{"arguments":{}},"x":"\xff"'):
        line = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":%s}' % params
        assert [(a["id"], a["error"]["code"]) for a in _answers(line)] == \
            [(None, ap.PARSE_ERROR)], params


def test_a_bad_byte_inside_arguments_reaches_the_method():
    line = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"arguments":{"a":"\xff"}}}'
    assert _answers(line) == [{"jsonrpc": "2.0", "id": 1, "result": {}}]
