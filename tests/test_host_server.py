"""The host-facing server (reference/mcp.md, the host side): both protocol eras, ping,
unknown methods and tools, the listing the host is offered, lines that are not requests,
and lines that come while calls are in flight. In-process (tests/proxy_harness.py), with the
fake payment server behind the proxy; every wait has a deadline.
"""

import json

import pytest

from proxy_harness import ProxyHarness, ap
from scripted_server import BANK_RULES


# ==== the host side: both eras =================================================================

@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = ProxyHarness(tmp_path_factory.mktemp("host"))
    yield h
    h.close()


META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "1"}}


def test_host_modern_era(host):
    r = host.request("server/discover", {"_meta": META})
    res = r["result"]
    assert "2026-07-28" in res["supportedVersions"]
    assert res["resultType"] == "complete"
    assert "tools" in res["capabilities"]
    assert "agentrt" not in json.dumps(res).lower()
    r = host.request("tools/list", {"_meta": META})["result"]
    assert r["resultType"] == "complete" and "ttlMs" in r and "cacheScope" in r
    assert [t["name"] for t in r["tools"]] == ["bank_balance", "bank_pay", "bank_refund",
                                              "gate_status"]
    r = host.request("tools/call", {"name": "bank_balance", "arguments": {"account": "A-9"},
                                    "_meta": META})["result"]
    assert r["resultType"] == "complete" and r["isError"] is False
    assert r["content"][0]["text"] == "account A-9 holds 120.00 EUR"
    # ping is gone from the 2026-07-28 era.
    assert host.request("ping", {"_meta": META})["error"]["code"] == -32601
    for version in ("2099-01-01", "2025-06-18"):
        err = host.request("tools/list", {"_meta": {**META,
                           "io.modelcontextprotocol/protocolVersion": version}})["error"]
        assert err["code"] == -32022
        assert "2026-07-28" in err["data"]["supported"]
        assert err["data"]["requested"] == version


@pytest.mark.parametrize("asked,answered", [
    ("2024-11-05", "2024-11-05"), ("2025-03-26", "2025-03-26"),
    ("2025-06-18", "2025-06-18"), ("2025-11-25", "2025-11-25"),
    ("2026-07-28", "2025-11-25"), ("1999-01-01", "2025-11-25")])
def test_host_legacy_initialize_each_version(host, asked, answered):
    r = host.request("initialize", {"protocolVersion": asked, "capabilities": {},
                                    "clientInfo": {"name": "host", "version": "1"}})["result"]
    assert r["protocolVersion"] == answered
    assert "tools" in r["capabilities"]
    assert "agentrt" not in r["serverInfo"]["name"].lower()
    assert "agentrt" not in json.dumps(r).lower()
    host.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
    r = host.request("tools/list", {})["result"]
    assert "resultType" not in r
    assert r["tools"][-1]["name"] == "gate_status"


def test_host_ping_unknown_method_and_unknown_tool(host):
    assert host.request("ping")["result"] == {}
    err = host.request("resources/list", {})["error"]
    assert err["code"] == -32601
    err = host.request("tools/call", {"name": "nope", "arguments": {}})["error"]
    assert err["code"] == -32602 and "nope" in err["message"]


def test_host_tools_list_has_no_output_schema(host):
    tools = host.request("tools/list", {})["result"]["tools"]
    for t in tools:
        assert "outputSchema" not in t
        # annotations from the operator's class (DESIGN 4), never the server's hints
        assert t["annotations"] in list(ap.CLASS_ANNOTATIONS.values()), t
        assert t["inputSchema"]["type"] == "object"
        assert "agentrt" not in json.dumps(t).lower()


def test_host_garbage_lines_get_parse_errors_and_serving_goes_on(host):
    garbage = [b"this is not json", b"{\"jsonrpc\":", b"\xff\xfe\x00garbage", b"{]",
               b'{"jsonrpc":"2.0","id":1,"method":"ping"} trailing']
    for line in garbage:
        before = len(host.out)
        host.send(line)
        answers = [json.loads(a) for a in host.out[before:]]
        assert len(answers) == 1, (line, answers)
        assert answers[0]["id"] is None and answers[0]["error"]["code"] == -32700
    # Valid JSON that is not a request object: answered with an error, never a crash.
    for line in (b"[]", b"42", b'"text"'):
        before = len(host.out)
        host.send(line)
        answers = [json.loads(a) for a in host.out[before:]]
        assert len(answers) == 1 and "error" in answers[0] and answers[0]["id"] is None
    r = host.call("bank_balance", {"account": "A-1"})
    assert host.text(r) == "account A-1 holds 120.00 EUR"


def test_host_garbage_between_calls_in_flight(harnesses):
    """Garbage lines while a call is held upstream: each gets its parse error, the call
    still answers, and its run is recorded."""
    rules = {**json.loads(json.dumps(BANK_RULES)),
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
    h = harnesses(rules=rules)
    ident = h.request("tools/call", {"name": "bank_pay",
                                     "arguments": {"to": "kim", "amount": 7, "mode": "slow"}},
                      wait=False)
    for line in (b"garbage", b"\xc3\x28", b"{"):
        h.send(line)
    # Each call is its own task: a read answers while the slow payment is still running.
    r = h.call("bank_balance", {"account": "A-2"})
    assert h.text(r) == "account A-2 holds 120.00 EUR"
    assert ident not in [json.loads(line).get("id") for line in h.out]
    msg = h.answer(ident, timeout=15)
    assert msg["result"]["content"][0]["text"] == "paid 7.00 to kim"
    errors = [json.loads(a) for a in h.out if b'"error"' in a]
    assert [e["error"]["code"] for e in errors] == [-32700] * 3
    assert h.payments() == 1 and h.runs()[0].status == ap.COMPLETED


# ---- The host-facing server, faults found in review ------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

def test_json_that_is_not_a_message_gets_invalid_request(tmp_path):
    """93356a0: a host line that is JSON but not an object ([1]) was answered as a parse
    error (-32700); it is valid JSON that is not a request: -32600."""
    h = ProxyHarness(tmp_path)
    try:
        for line in (b"[1]", b"1", b'"x"'):
            h.out.clear()
            h.send(line)
            assert h.out, f"no answer to {line!r}"
            msg = json.loads(h.out[-1])
            assert msg["id"] is None and msg["error"]["code"] == -32600, (line, msg)
    finally:
        h.close()


def test_modern_request_without_client_capabilities_is_invalid_params(tmp_path):
    """Review 2, m_proto.py (6e5e37a): a 2026-07-28 request whose _meta named the protocol
    version but lacked io.modelcontextprotocol/clientCapabilities was served; that field is
    required, and its absence gets -32602 (mcp-protocol.md 5)."""
    h = ProxyHarness(tmp_path)
    try:
        msg = h.request("tools/list", {"_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28"}}, timeout=10)
        assert "error" in msg and msg["error"]["code"] == -32602, msg
    finally:
        h.close()


def test_a_fault_while_routing_a_message_is_answered_not_fatal(tmp_path, monkeypatch):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    host's input: nothing in a line stops serving. A fault while routing a message is answered
    with an internal error, never fatal."""
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


def test_the_host_input_waits_while_answers_are_not_read(tmp_path):
    """The hostile review (the proxy tried as a hostile model and a hostile server would): the
    host's input waits while answers are not read: room() comes back only once the backlog past
    MAX_OUTPUT_BACKLOG is drained."""
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


def test_a_large_call_does_not_stop_the_proxy_answering(tmp_path):
    """The hardened proxy's review, finding 3: one host message of under 1 MB (an array of small
    values) keeps the event loop busy for seconds: the arguments are parsed about seven times,
    at microseconds a value, before the proxy can answer anything else. A ping sent after the
    call is answered before it. Judged by an order, never by a time: the answers written before
    a ping's."""
    h = ProxyHarness(tmp_path)
    try:
        args = b'{"account":"A","x":[' + b",".join([b"0"] * 450_000) + b"]}"
        assert len(args) < 1_000_000
        ident = h.request("tools/call", raw_params=b'{"name":"bank_balance","arguments":' +
                          args + b"}", wait=False)
        h.request("ping", timeout=120)
        before = [json.loads(raw).get("id") for raw in h.out]
        assert h.prefix(h.answer(ident, timeout=120)["result"]) == "INVALID"
        assert ident not in before, "the ping was answered only after the call"
    finally:
        h.close()
