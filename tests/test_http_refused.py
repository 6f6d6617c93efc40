"""A server that refuses the connection was sent nothing: the request is NotSent (a known
outcome), named as a failed connect, whatever the request."""

import asyncio
import socket

import agentrt_proxy as ap


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_is_not_sent():
    async def body():
        conn = ap.HttpUpstream("refusing", f"http://127.0.0.1:{closed_port()}/mcp")
        try:
            await conn._post(ap.rpc_request(1, "tools/list", {}), "tools/list", 2.0, 1)
        except ap.ProxyError as exc:
            return exc
        finally:
            await conn.close()
    outcome = asyncio.run(body())
    assert isinstance(outcome, ap.NotSent), outcome
    assert "cannot connect to the server" in str(outcome), outcome
