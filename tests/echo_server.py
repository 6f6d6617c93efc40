"""A trivial MCP server over stdio for the benchmark, standard library only.

    python tests/echo_server.py        # serves until stdin closes

One tool, ``echo {text}``, marked read-only, answers ``text`` unchanged. It speaks the legacy
handshake only (``initialize``; ``server/discover`` and every other unknown method get
-32601) and answers each request in order, as soon as it is read, so that what a benchmark
times around it is the client and whatever stands between the client and this process.
"""

import json
import sys

SERVER_INFO = {"name": "echo", "version": "1.0.0"}
VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
PARSE_ERROR = -32700
TOOL = {
    "name": "echo",
    "description": "Answers its text unchanged.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}},
                    "required": ["text"], "additionalProperties": False},
    "annotations": {"readOnlyHint": True},
}


def echo(name: str, args: dict) -> dict:
    if name != "echo" or not isinstance(args.get("text"), str):
        raise LookupError(INVALID_PARAMS, "unknown tool or no text")
    return {"content": [{"type": "text", "text": args["text"]}], "isError": False}


def answer(method: str, params: dict, tools: tuple = (TOOL,), call=echo,
           info: dict = SERVER_INFO) -> dict:
    """A request's result; ``call(name, arguments)`` answers tools/call, and raises
    LookupError(code, message) for an error answer."""
    if method == "initialize":
        asked = params.get("protocolVersion")
        return {"protocolVersion": asked if asked in VERSIONS else VERSIONS[0],
                "capabilities": {"tools": {"listChanged": False}}, "serverInfo": info}
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": list(tools)}
    if method == "tools/call":
        return call(params.get("name"), params.get("arguments") or {})
    raise LookupError(METHOD_NOT_FOUND, f"method {method} not found")


def frame(reply: dict) -> bytes:
    """One answer as this server writes it: json.dumps's default form, one line."""
    return json.dumps(reply).encode() + b"\n"


def serve(inp, out, answer=answer) -> None:
    for line in iter(inp.readline, b""):
        try:
            msg = json.loads(line)
        except ValueError:
            reply = {"jsonrpc": "2.0", "id": None,
                     "error": {"code": PARSE_ERROR, "message": "parse error"}}
        else:
            if not isinstance(msg, dict) or "id" not in msg or "method" not in msg:
                continue                      # a notification or an answer: nothing owed
            try:
                reply = {"jsonrpc": "2.0", "id": msg["id"],
                         "result": answer(msg["method"], msg.get("params") or {})}
            except LookupError as exc:
                reply = {"jsonrpc": "2.0", "id": msg["id"],
                         "error": {"code": exc.args[0], "message": exc.args[1]}}
        out.write(frame(reply))
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
