"""Each byte parsed once (issue 32, section 3): a frame is parsed once, strictly, and the
parsed value travels with the call; no step reads the same bytes again.

Counted, never timed: every read of the JSON engine (scan_count.Scans) during one allowed
mutating tools/call with a 1 MB argument and one allowed read whose answer is 1 MB, through
the in-process proxy. A read of at least the payload's length is a read of the frame's
payload: there is exactly one for each, the host's frame as it arrives and the server's
answer as it is read.
"""

import os
import sys

import pytest

from proxy_harness import ROOT, ProxyHarness, ap
from scan_count import Scans

PAYLOAD = 1024 * 1024
FILES_SERVER = [sys.executable, os.path.join(ROOT, "tests", "files_server.py")]
RULES = {"write_file": {"side_effect": "remote_mutation", "timeout": "30s",
                        "outcome": "allow"},
         "read_file": {"side_effect": "read_only", "timeout": "30s"}}


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
