"""One classifier of how a tool call ended (_observe), for every way a call can end.

Each test makes a call end one way, through the code a call really takes (UpstreamTool.call
over a stand-in connection, or a scripted server that dies mid-call, then _call_tool), and
checks the class its observation records (``ending``) and what unknown_ending and the gate's
own reader (_known_outcome) read from it. Nothing reads the error's text."""

from __future__ import annotations

import asyncio

import pytest
from scripted_server import Scripted, arun, loaded, pin, tool_entry

import agentrt_proxy as ap

SPEC = ap.ToolSpec("bank_pay", "", b'{"type":"object"}', "remote_mutation", 5.0, True)
READ_SPEC = ap.ToolSpec("bank_balance", "", b'{"type":"object"}', "read_only", 5.0, True)
IS_ERROR = (b'{"jsonrpc":"2.0","id":1,"result":{"isError":true,"content":[{"type":"text",'
            b'"text":"card declined"}]}}')
RPC_ERROR = b'{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"it broke"}}'


class Conn:
    """An upstream connection whose tools/call comes to ``outcome``: a message's bytes are
    answered as parsed, an exception is raised."""

    def __init__(self, outcome):
        self.outcome = outcome

    def offers_tasks(self, support):
        return False

    async def call_tool(self, remote: str, args: bytes, timeout: float,
                        on_task=None) -> ap.Message:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        msg = ap.parse_message(self.outcome, ap.UPSTREAM_DEPTH)
        if msg.doc.get("error") is not None:       # as Upstream.request turns it
            raise ap.ProtocolError(str(msg.doc["error"]["message"]))
        return msg


def upstream(outcome, spec=SPEC, **rule) -> ap.UpstreamTool:
    return ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect=spec.side_effect, **rule),
                           Conn(outcome))


def observed(call, spec=SPEC, args=b"{}") -> dict:
    return asyncio.run(ap._call_tool(ap.Tool(spec, call), args)).doc


def verdict(tool, obs: dict):
    """(the recorded ending, unknown_ending's reading, the gate's own reading)."""
    content = obs["content"] if isinstance(obs["content"], dict) else {}
    return content.get("ending"), ap.unknown_ending(tool, obs), ap._known_outcome(obs)


def test_a_result_is_known():
    tool = upstream(b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text",'
                    b'"text":"paid"}]}}')
    obs = observed(tool.call)
    assert obs["kind"] == ap.TOOL_RESULT
    assert ap.unknown_ending(tool, obs) is None and ap._known_outcome(obs)


def test_an_iserror_result_is_an_answer():
    tool = upstream(IS_ERROR)
    obs = observed(tool.call)
    assert "card declined" in obs["content"]["error"]
    assert verdict(tool, obs) == ("answered", None, True)


def test_a_tools_own_error_answer_is_an_answer():
    async def declines(args, *rest):
        raise ap.ToolFailure("card declined")
    assert verdict(upstream(None), observed(declines)) == ("answered", None, True)


@pytest.mark.parametrize("why", [ap.NotSent("the connection to bank is closed"),
                                 ap.NotSent("cannot connect to the server: refused")])
def test_nothing_sent_is_known(why):
    tool = upstream(why)
    assert verdict(tool, observed(tool.call)) == ("not_sent", None, True)


def test_a_refusal_before_sending_is_nothing_sent():
    tool = upstream(AssertionError("nothing may be sent"), deny=("currency",))
    obs = observed(tool.call, args=b'{"currency":"EUR"}')
    assert "denied by the operator" in obs["content"]["error"]
    assert verdict(tool, obs) == ("not_sent", None, True)


def test_a_timeout_is_unknown():
    tool = upstream(asyncio.TimeoutError())
    assert verdict(tool, observed(tool.call)) == ("timed_out", "timed_out", False)


@pytest.mark.parametrize("lost", [ap.UpstreamError("the server's input is closed"),
                                  ConnectionResetError(104, "Connection reset by peer"),
                                  BrokenPipeError(32, "Broken pipe")])
def test_a_connection_lost_mid_call_is_unknown(lost):
    tool = upstream(lost)
    assert verdict(tool, observed(tool.call)) == ("no_answer", "no_answer", False)


def test_a_protocol_error_answer_is_unknown():
    """The seed: a protocol error may have taken effect."""
    tool = upstream(RPC_ERROR)
    assert verdict(tool, observed(tool.call)) == ("no_answer", "no_answer", False)


def test_a_tools_own_bug_is_unknown():
    async def panics(args, *rest):
        raise KeyError("x")
    assert verdict(upstream(None), observed(panics)) == ("no_answer", "no_answer", False)


def test_an_unreadable_answer_is_known_and_executed():
    async def unusable(args, *rest):
        return ap.ToolResult(b'{"a": NaN}', "s")
    tool = upstream(None)
    obs = observed(unusable)
    assert verdict(tool, obs) == ("invalid_content", None, True)
    assert ap._unrecorded(tool, obs)


def test_an_answer_that_cannot_be_mapped_is_known_and_executed():
    async def unmappable(args, *rest):
        raise ap.AnswerUnreadable("bank_pay: server bank answered, and its answer could not "
                                  "be read (ValueError)")
    tool = upstream(None)
    assert verdict(tool, observed(unmappable)) == ("invalid_content", None, True)


def test_a_cancelled_call_is_cut_off():
    obs = ap._observe("bank_pay", 5.0, asyncio.CancelledError()).doc
    assert obs["kind"] == ap.INTERRUPTED_OBS
    assert obs["content"]["ending"] == "cut_off"
    assert obs["content"]["failure"] == "cancelled"
    assert not ap._known_outcome(obs)


def test_a_read_only_tools_endings_are_never_unknown():
    tool = upstream(asyncio.TimeoutError(), spec=READ_SPEC)
    obs = observed(tool.call, spec=READ_SPEC)
    assert obs["content"]["ending"] == "timed_out"
    assert ap.unknown_ending(tool, obs) is None


def test_the_server_crashing_mid_call_is_unknown(script, tmp_path):
    s = Scripted(script, tmp_path, tools=[tool_entry("crash", {"type": "object"})],
                 calls={"crash": "exit"})

    async def crash():
        pinned = await pin(s.server())
        rules = {"crash": {"side_effect": "remote_mutation", "timeout": "5s"}}
        async with loaded(s.server(rules), pinned) as (tools, _):
            tool = tools["fs_crash"]
            return tool, await ap._call_tool(ap.Tool(tool.spec, tool.call), b"{}")
    tool, observation = arun(crash())
    obs = observation.doc
    assert verdict(tool, obs) == ("no_answer", "no_answer", False)


@pytest.mark.parametrize("content", [
    {"error": "bank/pay: 22 bytes, error: card declined", "failure": "error",
     "tool": "bank_pay"},
    {"error": "bank_pay: nothing was sent to server \"bank\": closed", "failure": "error",
     "tool": "bank_pay"},
    {"error": "content is not usable JSON: NaN", "failure": "invalid_content",
     "tool": "bank_pay"},
    {"error": "anything", "tool": "bank_pay"},
    "not an object"])
def test_a_record_without_its_ending_is_unknown(content):
    """Recorded before the ending was: nobody knows how it ended, so an operator is asked."""
    obs = {"kind": ap.TOOL_ERROR, "content": content, "summary": "s"}
    assert ap.unknown_ending(upstream(None), obs) == "no_answer"
    assert not ap._known_outcome(obs)


def test_an_ending_nobody_wrote_is_unknown():
    obs = {"kind": ap.TOOL_ERROR, "content": {"ending": "answered!", "error": "x"}}
    assert ap.unknown_ending(upstream(None), obs) == "no_answer"
    assert not ap._known_outcome(obs)
