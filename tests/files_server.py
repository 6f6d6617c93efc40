"""An MCP server over stdio with large payloads, for the benchmark; standard library only.

    FILES_ROOT=/some/dir python tests/files_server.py        # serves until stdin closes

Three tools, served by tests/echo_server.py's handshake and loop (each request answered as
soon as it is read):

    write_file {path, content}   writes ``content`` to ``path`` under FILES_ROOT (no sync)
                                 and answers with its length: a large argument
    read_file {path}             answers the file's text as one text block: a large answer
    list_entries {count, prefix} answers ``count`` directory-like entries as structured
                                 content ({"entries": [{"name", "type", "size"}, ...]}) and,
                                 as the protocol asks of a tool with an output schema, the same
                                 document serialised in a text block

A path is a plain file name: anything with a separator, or starting with a dot, is refused.
"""

import functools
import json
import os
import sys

from echo_server import INVALID_PARAMS, answer, serve

SERVER_INFO = {"name": "files", "version": "1.0.0"}
MAX_ENTRIES = 100_000
ENTRY_SIZE_STEP = 37                  # each entry's size differs, so that no two look alike
_NAME = {"type": "string"}
TOOLS = [
    {"name": "write_file", "description": "Writes a file's text.",
     "inputSchema": {"type": "object", "properties": {"path": _NAME, "content": _NAME},
                     "required": ["path", "content"], "additionalProperties": False},
     "annotations": {"readOnlyHint": False, "destructiveHint": False}},
    {"name": "read_file", "description": "Answers a file's text.",
     "inputSchema": {"type": "object", "properties": {"path": _NAME}, "required": ["path"],
                     "additionalProperties": False},
     "annotations": {"readOnlyHint": True}},
    {"name": "list_entries", "description": "Answers a listing of count entries.",
     "inputSchema": {"type": "object",
                     "properties": {"count": {"type": "integer", "minimum": 0,
                                              "maximum": MAX_ENTRIES}, "prefix": _NAME},
                     "required": ["count", "prefix"], "additionalProperties": False},
     "outputSchema": {"type": "object", "properties": {"entries": {"type": "array"}},
                      "required": ["entries"]},
     "annotations": {"readOnlyHint": True}},
]


def file_path(args: dict, root: str) -> str:
    name = args.get("path")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise LookupError(INVALID_PARAMS, "path must be a plain file name")
    return os.path.join(root, name)


def listing(count: int, prefix: str) -> dict:
    return {"entries": [{"name": f"{prefix}-{i:06d}.txt", "type": "file",
                         "size": i * ENTRY_SIZE_STEP} for i in range(count)]}


def call(name: str, args: dict, root: str) -> dict:
    """A tools/call's result, the files under ``root``."""
    if name == "write_file" and isinstance(args.get("content"), str):
        with open(file_path(args, root), "w", encoding="utf-8") as f:
            f.write(args["content"])
        said = f"wrote {len(args['content'])} characters"
    elif name == "read_file":
        with open(file_path(args, root), encoding="utf-8") as f:
            said = f.read()
    elif name == "list_entries" and isinstance(args.get("count"), int) and \
            0 <= args["count"] <= MAX_ENTRIES and isinstance(args.get("prefix"), str):
        doc = listing(args["count"], args["prefix"])
        return {"content": [{"type": "text", "text": json.dumps(doc)}],
                "structuredContent": doc, "isError": False}
    else:
        raise LookupError(INVALID_PARAMS, "unknown tool or bad arguments")
    return {"content": [{"type": "text", "text": said}], "isError": False}


def call_safely(name: str, args: dict) -> dict:
    """call, in FILES_ROOT; a file that cannot be read or written is an error answer."""
    try:
        return call(name, args, os.environ.get("FILES_ROOT", "."))
    except OSError as exc:
        raise LookupError(INVALID_PARAMS, str(exc)) from None


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer,
          functools.partial(answer, tools=TOOLS, call=call_safely, info=SERVER_INFO))
