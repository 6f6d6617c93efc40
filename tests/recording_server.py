"""A tiny MCP server over stdio that records every line it is sent (test_hostile_host.py).

    RECORDING_LOG=/tmp/x.log python3 tests/recording_server.py

Each line read from stdin, split on LF only and with its exact bytes, is appended base64
encoded (one per line) to the file named by RECORDING_LOG, and flushed before it is answered,
so a test can see precisely what the proxy forwarded: a CR or U+2028 it passed through, or a
second frame hidden inside the first, would be seen here even though this server's own parse
treats them as whitespace. It speaks only the legacy handshake (server/discover is answered
-32601) and offers four tools:

    echo  readOnlyHint true; answers with the arguments it got, as JSON text
    note  no annotations; a strict schema (additionalProperties false, typed properties)
    pay   a remote mutation: destructiveHint false, openWorldHint true
    wipe  destructiveHint true

Standard library only. Not a test module: pytest collects nothing here.
"""

import base64
import json
import os
import sys

PERMISSIVE = {"type": "object", "properties": {
    "n": {"type": "integer"}, "s": {"type": "string"}, "v": {"type": "number"}, "x": {}}}
STRICT = {"type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
          "required": ["n"], "additionalProperties": False}

TOOLS = [
    {"name": "echo", "description": "Answers with its arguments.", "inputSchema": PERMISSIVE,
     "annotations": {"readOnlyHint": True}},
    {"name": "note", "description": "Writes a note in a local file.", "inputSchema": STRICT},
    {"name": "pay", "description": "Sends a payment.", "inputSchema": PERMISSIVE,
     "annotations": {"readOnlyHint": False, "destructiveHint": False, "openWorldHint": True}},
    {"name": "wipe", "description": "Deletes everything.", "inputSchema": PERMISSIVE,
     "annotations": {"readOnlyHint": False, "destructiveHint": True}},
]
METHOD_NOT_FOUND, INVALID_PARAMS = -32601, -32602


def record(log, line: bytes) -> None:
    if log is not None:
        log.write(base64.b64encode(line) + b"\n")
        log.flush()


def answer(msg: dict):
    """The result or (code, message) error for one request."""
    method, params = msg.get("method"), msg.get("params") or {}
    if method == "initialize":
        return {"protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}}, "serverInfo": {"name": "rec", "version": "1"}}
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        name, args = params.get("name"), params.get("arguments")
        if name == "echo":
            return {"content": [{"type": "text", "text": json.dumps(args, sort_keys=True)}]}
        if name in ("note", "pay", "wipe"):
            return {"content": [{"type": "text", "text": f"{name} done"}]}
        return (INVALID_PARAMS, f"unknown tool {name!r}")
    return (METHOD_NOT_FOUND, f"method {method!r} not found")


def main() -> None:
    path = os.environ.get("RECORDING_LOG")
    log = open(path, "ab") if path else None
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        record(log, line.rstrip(b"\n"))
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict) or "method" not in msg or "id" not in msg:
            continue                                 # notifications and responses
        got = answer(msg)
        reply = {"jsonrpc": "2.0", "id": msg["id"]}
        if isinstance(got, tuple):
            reply["error"] = {"code": got[0], "message": got[1]}
        else:
            reply["result"] = got
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
