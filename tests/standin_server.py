"""A stand-in for a git server and a filesystem server over stdio, for the README's recipes
(test_policy_limits.py). Standard library only.

    STANDIN_LEDGER=/tmp/ledger python3 tests/standin_server.py

Two tools, each appending one line (the tool and its arguments, as JSON) to the file named
by STANDIN_LEDGER before it answers, so that a test counts what reached the server:

    git_commit  {repo_path, message}     no annotations
    write_file  {path, content}          no annotations

With STANDIN_KIND=filesystem, memory, git or everything it offers instead the tools (names
and hints) of that server, for the first-week story; with STANDIN_TOOLS (a JSON array of
tools, as tools/list gives them) it offers exactly those, for a test that needs hints of its
own (both in test_wrap_suggestions.py).

It speaks the legacy handshake only, answering each request in order as soon as it is read.
Not a test module: pytest collects nothing here.
"""

import json
import os
import sys

SERVER_INFO = {"name": "standin", "version": "1.0.0"}
VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
METHOD_NOT_FOUND, INVALID_PARAMS = -32601, -32602


def strings(*names):
    return {"type": "object", "properties": {n: {"type": "string"} for n in names},
            "required": list(names), "additionalProperties": False}


TOOLS = [
    {"name": "git_commit", "description": "Records the staged changes with a message.",
     "inputSchema": strings("repo_path", "message")},
    {"name": "write_file", "description": "Writes a file.",
     "inputSchema": strings("path", "content")},
]
READ = {"readOnlyHint": True}
LOCAL = {"readOnlyHint": False, "destructiveHint": False, "openWorldHint": False}
# STANDIN_KIND: the tools of one of the servers a new user starts with, by their names and
# hints (not their behaviour: every tool appends its line and answers "<tool> done").
KINDS = {
    "filesystem": [
        {"name": "read_file", "description": "Reads a file.", "annotations": READ,
         "inputSchema": strings("path")},
        {"name": "list_directory", "description": "Lists a directory.", "annotations": READ,
         "inputSchema": strings("path")},
        {"name": "write_file", "description": "Writes a file.", "annotations": LOCAL,
         "inputSchema": strings("path", "content")}],
    "memory": [
        {"name": "read_graph", "description": "Reads the knowledge graph.",
         "annotations": READ, "inputSchema": strings()},
        {"name": "create_entities", "description": "Adds entities to the graph.",
         "annotations": LOCAL, "inputSchema": strings("name")}],
    "git": [
        {"name": "git_status", "description": "Shows the working tree status.",
         "annotations": READ, "inputSchema": strings("repo_path")},
        {"name": "git_add", "description": "Stages files.", "annotations": LOCAL,
         "inputSchema": strings("repo_path", "files")},
        {"name": "git_commit", "description": "Records the staged changes with a message.",
         "annotations": LOCAL, "inputSchema": strings("repo_path", "message")}],
    "everything": [
        {"name": "echo", "description": "Echoes the message.", "annotations": READ,
         "inputSchema": strings("message")},
        {"name": "add", "description": "Adds two numbers.", "annotations": READ,
         "inputSchema": strings("a", "b")}],
}
TOOLS = KINDS.get(os.environ.get("STANDIN_KIND", ""), TOOLS)
if "STANDIN_TOOLS" in os.environ:
    TOOLS = json.loads(os.environ["STANDIN_TOOLS"])


def answer(method: str, params: dict) -> dict:
    if method == "initialize":
        asked = params.get("protocolVersion")
        return {"protocolVersion": asked if asked in VERSIONS else VERSIONS[0],
                "capabilities": {"tools": {"listChanged": False}}, "serverInfo": SERVER_INFO}
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        name, args = params.get("name"), params.get("arguments") or {}
        if name not in {t["name"] for t in TOOLS}:
            raise LookupError(INVALID_PARAMS, f"unknown tool {name}")
        with open(os.environ["STANDIN_LEDGER"], "a") as f:
            f.write(json.dumps({"tool": name, "arguments": args}, sort_keys=True) + "\n")
        return {"content": [{"type": "text", "text": f"{name} done"}], "isError": False}
    raise LookupError(METHOD_NOT_FOUND, f"method {method} not found")


def serve(inp, out) -> None:
    for line in iter(inp.readline, b""):
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict) or "id" not in msg or "method" not in msg:
            continue
        try:
            reply = {"jsonrpc": "2.0", "id": msg["id"],
                     "result": answer(msg["method"], msg.get("params") or {})}
        except LookupError as exc:
            reply = {"jsonrpc": "2.0", "id": msg["id"],
                     "error": {"code": exc.args[0], "message": exc.args[1]}}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
