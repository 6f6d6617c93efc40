"""The scripted stdio MCP server for tests (not a test file), and the helpers that pin, load
and call it through the upstream client.

SCRIPT is the server (conftest.py's ``script`` fixture writes it to a temporary directory):
newline-delimited JSON-RPC whose every answer, and every misbehaviour, is chosen by a JSON
spec file the test writes (and may rewrite between the pin and the load, since each
connection starts the server afresh). The server logs every line it receives, verbatim, so a
test can see what the proxy sent. Every wait has a deadline.
"""

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import sys
import time

from proxy_harness import ap


MIB16 = 16 * 1024 * 1024
CANCEL_WAIT = 10.0      # for a server to see a cancellation: a wait, never what is judged
MARKER = "\n[truncated]"


READ_SCHEMA = {"type": "object", "required": ["path"],
               "properties": {"path": {"type": "string"}}}
WRITE_SCHEMA = {"type": "object", "required": ["path", "text"],
                "properties": {"path": {"type": "string"}, "text": {"type": "string"},
                               "force": {"type": "boolean"}}}
RO = {"side_effect": "read_only", "timeout": "1s"}
BANK_RULES = {"balance": {"side_effect": "read_only", "timeout": "5s"},
              "pay": {"side_effect": "remote_mutation", "timeout": "5s"},
              "refund": {"side_effect": "destructive", "timeout": "5s"}}


# -- the scripted stdio server -------------------------------------------------------------------

SCRIPT = r'''
import base64, json, os, subprocess, sys, time

spec = json.load(open(sys.argv[1]))
out = sys.stdout.buffer


def send_raw(data):
    out.write(data + b"\n")
    out.flush()


def send(obj):
    send_raw(json.dumps(obj).encode())


def answer(ident, result_raw):
    send_raw(b'{"jsonrpc":"2.0","id":' + json.dumps(ident).encode() + b',"result":' +
             result_raw + b"}")


def error(ident, code, message):
    send({"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message}})


if spec.get("pidfile"):
    with open(spec["pidfile"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(spec["pidfile"] + ".tmp", spec["pidfile"])
if spec.get("envfile"):
    with open(spec["envfile"], "w") as f:
        json.dump(dict(os.environ), f)
if spec.get("grandchild"):
    code = ("import os, signal, sys, time\n"
            "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
            "    signal.signal(s, signal.SIG_IGN)\n"
            "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
            "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
            "while True: time.sleep(1)\n")
    subprocess.Popen([sys.executable, "-c", code, spec["grandchild"]],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    end = time.monotonic() + 10
    while not os.path.exists(spec["grandchild"]) and time.monotonic() < end:
        time.sleep(0.01)
if "stderr" in spec:
    sys.stderr.write(spec["stderr"])
    sys.stderr.flush()
if spec.get("exit_at_start"):
    sys.exit(3)


def tools_page(cursor):
    how = spec.get("list", "tools")
    if how == "tools":
        return json.dumps({"tools": spec.get("tools", [])}).encode()
    if how == "endless":
        return json.dumps({"tools": [], "nextCursor": str(int(cursor or "0") + 1)}).encode()
    if how == "repeat":
        return json.dumps({"tools": [], "nextCursor": "same"}).encode()
    if how == "many":
        total, per = spec["many"], spec.get("per_page", 100)
        start = int(cursor or "0")
        end = min(total, start + per)
        page = {"tools": [{"name": "t%04d" % i, "inputSchema": {"type": "object"}}
                          for i in range(start, end)]}
        if end < total:
            page["nextCursor"] = str(end)
        return json.dumps(page).encode()
    if how == "pages":
        return spec["pages"][int(cursor or "0")].encode()
    if how == "huge":
        return b'{"tools":[],"padding":"' + b"x" * spec["huge"] + b'"}'
    raise SystemExit("bad list spec")


pending_asks, asked = None, {}
for line in sys.stdin.buffer:
    if not line.strip():
        continue
    if spec.get("log"):
        with open(spec["log"], "ab") as f:
            f.write(line if line.endswith(b"\n") else line + b"\n")
    msg = json.loads(line)
    if "method" not in msg and "id" in msg and pending_asks is not None:
        asked[msg["id"]] = msg              # the client's answer to one of our requests
        if len(asked) == 4:
            text = json.dumps(asked, sort_keys=True)
            answer(pending_asks, json.dumps({"content": [{"type": "text",
                                                          "text": text}]}).encode())
            pending_asks, asked = None, {}
        continue
    if "method" not in msg or "id" not in msg:
        continue
    method, ident, params = msg["method"], msg["id"], msg.get("params") or {}
    if method == "server/discover":
        if spec.get("modern"):
            answer(ident, json.dumps({"supportedVersions": ["2026-07-28"],
                                      "capabilities": {"tools": {}},
                                      "serverInfo": {"name": "s", "version": "1"},
                                      "ttlMs": 0, "cacheScope": "private"}).encode())
        elif spec.get("discover") != "never":
            error(ident, -32601, "not here")
    elif method == "initialize":
        if spec.get("initialize") == "never":
            continue
        answer(ident, json.dumps({"protocolVersion": spec.get("version", "2025-06-18"),
                                  "capabilities": {"tools": {}},
                                  "serverInfo": {"name": "s", "version": "1"}}).encode())
    elif method == "tools/list":
        how = spec.get("list_behaviour")
        if how == "never":
            continue
        if how == "exit":
            sys.stderr.write(spec.get("list_reason", "") + "\n")
            sys.stderr.flush()
            os._exit(4)
        if how == "error":
            error(ident, -32603, spec["list_error"])
            continue
        answer(ident, tools_page(params.get("cursor")))
    elif method == "tools/call":
        how = spec.get("calls", {}).get(params.get("name"), "echo")
        if how == "never":
            continue
        if how == "exit":
            os._exit(0)
        if how == "garbage":
            send_raw(b"this is not JSON-RPC")
            continue
        if how == "asks":
            send({"jsonrpc": "2.0", "method": "notifications/message",
                  "params": {"level": "info", "data": "hello"}})
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
            for i, m in enumerate(["sampling/createMessage", "elicitation/create",
                                   "roots/list", "ping"]):
                send({"jsonrpc": "2.0", "id": "s%d" % i, "method": m, "params": {}})
            pending_asks = ident
            continue
        if how == "echo":
            text = json.dumps(params.get("arguments"), sort_keys=True)
            answer(ident, json.dumps({"content": [{"type": "text", "text": text}]}).encode())
        elif "raw" in how:
            answer(ident, how["raw"].encode())
        elif "raw_b64" in how:
            answer(ident, base64.b64decode(how["raw_b64"]))
        elif "text_size" in how:
            answer(ident, json.dumps({"content": [{"type": "text",
                                                   "text": "x" * how["text_size"]}]}).encode())
        elif "error" in how:
            error(ident, how["error"]["code"], how["error"]["message"])
        else:
            answer(ident, json.dumps(how["result"]).encode())
    elif method == "ping":
        answer(ident, b"{}")
    else:
        error(ident, -32601, "not here")
'''


def rule(**doc) -> ap.Rule:
    """A rule in the operator's JSON form, read as the configuration reads it."""
    return ap._parse_rule(ap.parse_json(json.dumps(doc).encode()), "test rule")


class Scripted:
    """One scripted server: its spec file, what it received, and ServerConfigs for it."""

    def __init__(self, script: str, tmp, name="fs", **spec):
        self.script, self.dir, self.name = script, str(tmp), name
        self.spec_path = os.path.join(self.dir, f"{name}.spec.json")
        self.log = os.path.join(self.dir, f"{name}.received")
        self.pidfile = os.path.join(self.dir, f"{name}.pid")
        self.manifest = os.path.join(self.dir, f"{name}.manifest.json")
        self.spec: dict = {}
        self.set(**spec)

    def set(self, **spec):
        spec.setdefault("log", self.log)
        spec.setdefault("pidfile", self.pidfile)
        self.spec = spec
        with open(self.spec_path, "w") as f:
            json.dump(spec, f)

    def change(self, **changes):
        self.set(**{**self.spec, **changes})

    def tool(self, name, **changes):
        """Change one listed tool (None removes a key)."""
        tools = []
        for t in self.spec["tools"]:
            if t["name"] == name:
                t = {k: v for k, v in {**t, **changes}.items() if v is not None}
            tools.append(t)
        self.change(tools=tools)

    def server(self, rules=None, connect_timeout=5.0, default_timeout=2.0, env=(),
               inherit=(), command=None) -> ap.ServerConfig:
        return ap.ServerConfig(
            name=self.name,
            command=tuple(command or (sys.executable, self.script, self.spec_path)),
            env=tuple(env), inherit_env=tuple(inherit), connect_timeout=connect_timeout,
            default_timeout=default_timeout, manifest=self.manifest,
            rules=tuple(sorted((k, rule(**v)) for k, v in (rules or {}).items())))

    def received(self) -> list[dict]:
        try:
            with open(self.log, "rb") as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def received_raw(self) -> list[bytes]:
        try:
            with open(self.log, "rb") as f:
                return [line for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def methods(self) -> list[str]:
        return [m.get("method") for m in self.received()]

    def pid(self) -> int:
        with open(self.pidfile) as f:
            return int(f.read())


def tool_entry(name, schema=None, description="", annotations=None, **extra):
    t = {"name": name, "description": description,
         "inputSchema": {"type": "object"} if schema is None else schema}
    if annotations is not None:
        t["annotations"] = annotations
    t.update(extra)
    return t


def arun(coro, timeout=30.0):
    """Run one coroutine on a fresh loop, under a deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def pin(server: ap.ServerConfig) -> dict:
    """Pin, write the manifest as the pin command does, and read it back."""
    manifest = await ap.pin_server(server, time.time())
    ap.write_manifest(server.manifest, manifest)
    return ap.read_manifest(server.manifest, server.name)


@contextlib.asynccontextmanager
async def loaded(server: ap.ServerConfig, pinned: dict):
    tools, report = await ap.load_server(server, pinned)
    try:
        yield {t.spec.name: t for t in tools}, report
    finally:
        await ap.close_tools(tools)


def process_gone(pid: int) -> bool:
    """True when the process no longer runs (exited, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def wait_gone(pid: int, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process_gone(pid):
            return True
        time.sleep(0.02)
    return process_gone(pid)


def results_server(script, tmp_path, calls, names=None):
    names = names or list(calls)
    return Scripted(script, tmp_path, tools=[tool_entry(n, READ_SCHEMA) for n in names],
                    calls=calls)


async def call_mapped(s, name, args=b'{"path":"p"}', cap=None, rules=None):
    pinned = await pin(s.server())
    rules = rules or {n: RO for n in pinned}
    async with loaded(s.server(rules), pinned) as (tools, _):
        t = tools[f"fs_{name}"]
        if cap is not None:
            t = dataclasses.replace(t, max_content=cap)
        return await t.call(args)


BAD_CALLS = {
    "never": "never",
    "huge": {"text_size": 5_000_000},
    "badutf8": {"raw_b64": base64.b64encode(
        b'{"content":[{"type":"text","text":"ok \xff\xfe bytes \xc3"}]}').decode()},
    "crash": "exit",
    "fine": "echo",
}
