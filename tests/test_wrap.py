"""wrap: from a host's configuration (Claude Desktop, VS Code, Cursor) to a gated one.

Each host's file, written as people keep them (several servers, env objects, args, a remote
server, keys of the host's own), becomes a proxy configuration that check accepts once the
printed rules are pasted; -write keeps a backup and refuses a file changed underneath it; a
host configuration whose servers reach the proxy's files is refused before anything is
written or started; the class suggested from the hints follows MCP's defaults.
"""

import json
import os
import re
import select
import shutil
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT, ap
from mcp_http_server import MCPHTTPServer

PYTHON = sys.executable
FAKE_SERVER = os.path.join(ROOT, "fake_payment_server.py")
ECHO_SERVER = os.path.join(ROOT, "tests", "echo_server.py")
PROXY = os.path.join(ROOT, "agentrt_proxy.py")
RPC_DEADLINE = 30.0
SUGGESTED = {"balance": "read_only", "pay": "remote_mutation", "refund": "destructive",
             "echo": "read_only"}


# ---- helpers ----

def write_host(path, doc, mode=0o600) -> str:
    path = str(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    os.chmod(path, mode)
    return path


def read_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pasted_rules(out: str) -> dict:
    """The rules wrap printed, per server name, parsed as the operator would paste them."""
    rules, lines, i = {}, out.split("\n"), 0
    while i < len(lines):
        m = re.match(r'server "([^"]+)": \d+ tools, to be pinned', lines[i])
        if m:
            assert lines[i + 1] == '  "rules": {', lines[i + 1]
            end = lines.index("  }", i + 1)
            rules[m.group(1)] = json.loads("{" + "\n".join(lines[i + 1:end + 1]) + "}")["rules"]
            i = end
        i += 1
    return rules


def shown_config(out: str) -> dict:
    """The configuration a dry run of wrap shows it would write."""
    start = out.index("\n", out.index("-write would write ")) + 1
    return json.loads(out[start:out.index("\n}\n", start) + 2])


def paste(config_path: str, rules: dict) -> None:
    with open(config_path) as f:
        doc = json.load(f)
    for server in doc["servers"]:
        server["rules"] = rules[server["name"]]
    with open(config_path, "w") as f:
        json.dump(doc, f, indent=2)


def wrapped_and_checked(cli, config_path: str, out: str) -> str:
    """Before the rules nothing is offered; with them pasted, check accepts the file."""
    code, _, err = cli("check", "-config", config_path)
    assert code == 1 and "no tool registered" in err, err
    rules = pasted_rules(out)
    for server_rules in rules.values():
        for tool, rule in server_rules.items():
            asks = {"repeat": "ask"} if tool == "pay" else {}    # "Sends a payment"
            assert rule == {"side_effect": SUGGESTED[tool], **asks}, (tool, rule)
    paste(config_path, rules)
    code, checked, err = cli("check", "-config", config_path)
    assert code == 0, err
    return checked


def claude_desktop(tmp_path) -> dict:
    return {
        "globalShortcut": "Alt+Space",
        "mcpServers": {
            "bank": {"command": PYTHON, "args": [FAKE_SERVER],
                     "env": {"FAKE_PAYMENTS_LEDGER": str(tmp_path / "ledger"),
                             "FAKE_PAYMENTS_ERA": "legacy"}},
            "bank-modern": {"command": PYTHON, "args": [FAKE_SERVER],
                            "env": {"FAKE_PAYMENTS_ERA": "modern",
                                    "FAKE_PAYMENTS_LEDGER": str(tmp_path / "ledger2")}},
            "echo tools": {"command": PYTHON, "args": ["-u", ECHO_SERVER]},
        },
    }


# ---- Claude Desktop ----

def dry_wrap(tmp_path, cli, host_file: str, config_dir: str):
    """A Claude Desktop file of claude_desktop(), wrapped without -write into a new
    directory: (host file, its bytes before, the directory, the config path, the output)."""
    host = write_host(tmp_path / host_file, claude_desktop(tmp_path))
    before = read_bytes(host)
    d = tmp_path / config_dir
    d.mkdir()
    config = str(d / "proxy.json")
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config)
    assert code == 0, err
    return host, before, d, config, out


def test_wrap_claude_desktop_config_becomes_one_check_accepts(tmp_path, cli):
    host, before, proxy_dir, config, out = dry_wrap(
        tmp_path, cli, "Claude/claude_desktop_config.json", "proxy")
    assert os.listdir(proxy_dir) == [] and "nothing was written" in out   # a dry run
    doc = shown_config(out)
    assert doc["session"] == "claude" and doc["database"] == "proxy.db"
    by_name = {s["name"]: s for s in doc["servers"]}
    assert set(by_name) == {"bank", "bank-modern", "echo_tools"}
    assert by_name["bank"] == {"name": "bank", "command": [PYTHON, FAKE_SERVER],
                               "env": [f"FAKE_PAYMENTS_LEDGER={tmp_path / 'ledger'}",
                                       "FAKE_PAYMENTS_ERA=legacy"]}
    assert by_name["echo_tools"] == {"name": "echo_tools", "command": [PYTHON, "-u", ECHO_SERVER]}
    assert all("rules" not in s for s in doc["servers"])       # nothing classified
    # The hints table explains each suggestion.
    assert re.search(r"refund\s+destructive\s+-\s+-\s+-\s+-\s+not read-only, and "
                     r"destructiveHint is missing \(MCP's default: true\)", out), out
    assert re.search(r"pay\s+remote_mutation\s+-\s+false", out), out
    # The host entry, printed, starts this proxy with absolute paths; the file is untouched.
    start = out.index('{\n  "mcpServers"')
    entry = json.loads(out[start:out.index("\n}\n", start) + 2])
    assert entry == {"mcpServers": {"gated": {"command": PYTHON,
                                              "args": [PROXY, "-config", config]}}}
    assert read_bytes(host) == before
    # -write writes what the dry run showed, every server pinned to its default manifest.
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write")
    assert code == 0, err
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o600
    with open(config) as f:
        assert json.load(f) == doc
    for name in by_name:
        assert os.path.exists(proxy_dir / f"{name}.manifest.json"), name
    checked = wrapped_and_checked(cli, config, out)
    for tool, cls in (("bank_balance", "read_only"), ("bank-modern_pay", "remote_mutation"),
                      ("echo_tools_echo", "read_only")):
        assert re.search(rf"{tool}\s+{cls}", checked), (tool, checked)
    assert "bank_refund" not in checked      # destructive, denied on every call: left out


def test_wrap_write_keeps_a_backup_and_the_gated_entry_serves(tmp_path, cli):
    host = write_host(tmp_path / "Claude" / "claude_desktop_config.json",
                      claude_desktop(tmp_path), mode=0o644)
    original = read_bytes(host)
    config = str(tmp_path / "proxy.json")
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write")
    assert code == 0, err
    backups = [n for n in os.listdir(tmp_path / "Claude") if ".bak-" in n]
    assert len(backups) == 1 and re.fullmatch(
        r"claude_desktop_config\.json\.bak-\d{8}-\d{6}", backups[0]), backups
    backup = tmp_path / "Claude" / backups[0]
    assert read_bytes(backup) == original
    assert stat.S_IMODE(os.stat(backup).st_mode) == 0o600       # it may hold credentials
    assert stat.S_IMODE(os.stat(host).st_mode) == 0o644         # the host's own mode kept
    with open(host) as f:
        now = json.load(f)
    assert now["globalShortcut"] == "Alt+Space"
    assert now["mcpServers"] == {"gated": {"command": PYTHON, "args": [PROXY, "-config", config]}}
    assert "replaced by the gated entry" in out and str(backup) in out
    paste(config, pasted_rules(out))
    gated = now["mcpServers"]["gated"]
    tools = list_tools([gated["command"], *gated["args"]], str(tmp_path))
    assert set(tools) >= {"bank_balance", "bank-modern_pay", "echo_tools_echo", "gate_status"}


def list_tools(argv, cwd) -> list:
    """Start the proxy as the host would and list its tools, every read with a deadline."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=cwd)
    try:
        send(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"}}})
        assert answer(proc, 1)["result"]["protocolVersion"] == "2025-06-18"
        send(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        send(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        return [t["name"] for t in answer(proc, 2)["result"]["tools"]]
    finally:
        proc.stdin.close()
        try:
            proc.wait(RPC_DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def send(proc, msg) -> None:
    proc.stdin.write((json.dumps(msg) + "\n").encode())
    proc.stdin.flush()


def answer(proc, ident):
    deadline = time.monotonic() + RPC_DEADLINE
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no answer to {ident}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        assert line, "the proxy closed its output: " + proc.stderr.read().decode()
        msg = json.loads(line)
        if msg.get("id") == ident:
            return msg


def test_wrap_write_refuses_a_file_changed_underneath_it(tmp_path, cli, monkeypatch):
    host = write_host(tmp_path / "claude_desktop_config.json", claude_desktop(tmp_path))
    before = read_bytes(host)
    real_pin = ap.pin_server

    async def pin_and_edit(server, now):
        # The host's own editor saves while wrap pins the servers.
        with open(host, "a") as f:
            f.write("\n")
        return await real_pin(server, now)
    monkeypatch.setattr(ap, "pin_server", pin_and_edit)
    config = str(tmp_path / "proxy.json")
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write")
    assert code == 1 and "changed since wrap read it" in err and "not written" in err, err
    assert read_bytes(host) == before + b"\n" * 3          # the editor's bytes, all kept
    assert json.loads(read_bytes(host))["mcpServers"].keys() == {"bank", "bank-modern",
                                                                 "echo tools"}
    assert not [n for n in os.listdir(tmp_path) if ".bak-" in n]


def test_write_host_config_refuses_stale_bytes(tmp_path):
    host = write_host(tmp_path / "mcp.json", {"mcpServers": {"a": {"command": "x"}}})
    stale = read_bytes(host).replace(b'"x"', b'"y"')
    with pytest.raises(ap.ConfigError, match="changed since wrap read it"):
        ap.write_host_config(host, stale, {"mcpServers": {}}, time.time())
    assert json.loads(read_bytes(host)) == {"mcpServers": {"a": {"command": "x"}}}
    assert os.listdir(tmp_path) == ["mcp.json"]


# ---- VS Code ----

def test_wrap_vscode_workspace_config(tmp_path, cli, monkeypatch):
    workspace = tmp_path / "project"
    (workspace / "tools").mkdir(parents=True)
    shutil.copy(FAKE_SERVER, workspace / "tools" / "bank.py")
    monkeypatch.setenv("FAKE_PAYMENTS_ERA", "modern")
    with MCPHTTPServer(era="legacy", mode="json", ledger=str(tmp_path / "http-ledger")) as srv:
        host = write_host(workspace / ".vscode" / "mcp.json", {
            "inputs": [{"type": "promptString", "id": "api-key", "description": "API key",
                        "password": True}],
            "servers": {
                "bank": {"type": "stdio", "command": PYTHON,
                         "args": ["${workspaceFolder}/tools/bank.py"],
                         "env": {"FAKE_PAYMENTS_ERA": "${env:FAKE_PAYMENTS_ERA}",
                                 "FAKE_PAYMENTS_LEDGER": "${workspaceFolder}/ledger"}},
                "echo": {"type": "stdio", "command": PYTHON, "args": [ECHO_SERVER]},
                "payments.remote": {"type": "http", "url": srv.url},
                "github": {"type": "stdio", "command": "npx",
                           "args": ["-y", "@modelcontextprotocol/server-github"],
                           "env": {"GITHUB_PERSONAL_ACCESS_TOKEN": "${input:api-key}"}},
            },
        })
        monkeypatch.chdir(workspace)                 # found where VS Code keeps it
        config = str(tmp_path / "gate" / "proxy.json")
        os.makedirs(os.path.dirname(config))
        code, out, err = cli("wrap", "-host", "vscode", "-config", config)
        assert code == 0, err
        assert f"read {host}" in out and not os.path.exists(config)
        doc = shown_config(out)
        by_name = {s["name"]: s for s in doc["servers"]}
        assert by_name["bank"] == {
            "name": "bank", "command": [PYTHON, f"{workspace}/tools/bank.py"],
            "env": [f"FAKE_PAYMENTS_LEDGER={workspace}/ledger"],
            "inherit_env": ["FAKE_PAYMENTS_ERA"]}
        assert by_name["payments_remote"] == {"name": "payments_remote", "endpoint": srv.url}
        assert "github" not in by_name
        assert re.search(r'NOT WRAPPED github: env\.GITHUB_PERSONAL_ACCESS_TOKEN holds '
                         r'"\$\{input:api-key\}", a variable of the host', out), out
        start = out.index('{\n  "servers": {\n    "gated"')
        entry = json.loads(out[start:out.index("\n}\n", start) + 2])
        assert entry == {"servers": {"gated": {"type": "stdio", "command": PYTHON,
                                               "args": [PROXY, "-config", config]}}}
        # -write keeps inputs and the server it could not wrap, beside the gated entry.
        code, out, err = cli("wrap", "-host", "vscode", "-config", config, "-write")
        assert code == 0, err
        checked = wrapped_and_checked(cli, config, out)
        assert re.search(r"payments_remote_pay\s+remote_mutation", checked), checked
        now = json.load(open(host))
        assert now["inputs"][0]["id"] == "api-key"
        assert list(now["servers"]) == ["gated", "github"]
        assert "1 not wrapped kept as they were" in out


# ---- Cursor ----

def test_wrap_cursor_global_config(tmp_path, cli, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                     # no project file: the global one
    with MCPHTTPServer(era="modern", mode="sse", ledger=str(tmp_path / "http-ledger")) as srv:
        host = write_host(home / ".cursor" / "mcp.json", {"mcpServers": {
            "payments": {"url": srv.url},
            "bank": {"command": PYTHON, "args": [FAKE_SERVER],
                     "env": {"FAKE_PAYMENTS_LEDGER": str(tmp_path / "ledger")}},
            "echo": {"command": PYTHON, "args": [ECHO_SERVER], "env": {}},
            "legacy-sse": {"type": "sse", "url": "http://127.0.0.1:9/sse"},
        }})
        config = str(tmp_path / "proxy.json")
        code, out, err = cli("wrap", "-host", "cursor", "-config", config)
        assert code == 0, err
        assert f"read {host}" in out and not os.path.exists(config)
        doc = shown_config(out)
        assert [s["name"] for s in doc["servers"]] == ["payments", "bank", "echo"]
        assert doc["servers"][0] == {"name": "payments", "endpoint": srv.url}
        assert doc["servers"][2] == {"name": "echo", "command": [PYTHON, ECHO_SERVER]}
        assert 'NOT WRAPPED legacy-sse: type "sse"' in out
        code, out, err = cli("wrap", "-host", "cursor", "-config", config, "-write")
        assert code == 0, err
        checked = wrapped_and_checked(cli, config, out)
        assert re.search(r"payments_balance\s+read_only", checked), checked


# ---- refusals ----

def test_wrap_refuses_a_host_config_that_reaches_the_proxys_files(tmp_path, cli):
    gate = tmp_path / "gate"
    gate.mkdir()
    config = str(gate / "proxy.json")
    for reach in (str(gate), f"--root={tmp_path}", str(gate / "proxy.db"), ".",
                  os.path.dirname(PROXY)):
        host = write_host(tmp_path / "claude_desktop_config.json", {"mcpServers": {
            "echo": {"command": PYTHON, "args": [ECHO_SERVER]},
            "files": {"command": PYTHON, "args": [FAKE_SERVER, reach],
                      "env": {"FAKE_PAYMENTS_LEDGER": str(tmp_path / "ledger")}}}})
        before = read_bytes(host)
        code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                             "-write")
        assert code == 1 and "reaches" in err and '"files"' in err, (reach, err)
        assert os.listdir(gate) == [], reach           # no configuration, no manifest
        assert read_bytes(host) == before
        assert not os.path.exists(tmp_path / "ledger")    # no server was started
    assert "agentrt_proxy.py" in err


def test_wrap_refuses_to_replace_a_configuration(tmp_path, cli):
    host = write_host(tmp_path / "claude_desktop_config.json",
                      {"mcpServers": {"echo": {"command": PYTHON, "args": [ECHO_SERVER]}}})
    config = tmp_path / "proxy.json"
    config.write_text("{}")
    code, _, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", str(config))
    assert code == 1 and "exists" in err, err
    assert config.read_text() == "{}"


@pytest.mark.parametrize("entry,why", [
    ({"command": "x", "envFile": "${workspaceFolder}/.env"}, 'field "envFile"'),
    ({"url": "https://x/mcp", "headers": {"Authorization": "Bearer t"}}, 'field "headers"'),
    ({"type": "sse", "url": "https://x/sse"}, 'type "sse"'),
    ({"url": "ws://x/mcp"}, "not an http or https URL"),
    ({"command": "x", "url": "https://x/mcp"}, "not both"),
    ({"command": "x", "args": "--root /"}, "args is not an array"),
    ({"command": "x", "args": [1]}, "args[0] is not a string"),
    ({"command": "x", "env": {"PORT": 8080}}, "env.PORT is not a string"),
    ({"command": "${input:cmd}"}, 'command holds "${input:cmd}"'),
    ({"command": "x", "args": ["${env:ROOT}"]}, 'args[0] holds "${env:ROOT}"'),
    ({"command": "x", "env": {"A": "${env:B}"}}, 'env.A holds "${env:B}"'),
    ({"command": "x", "disabled": True}, 'field "disabled"'),
    ("npx server", "not an object"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_wrap_leaves_out_an_entry_it_cannot_translate(entry, why):
    found = ap.translate_host("cursor", "/x/mcp.json", {"mcpServers": {"s": entry}})
    assert found[0].server is None and why in found[0].why, found


def test_wrap_with_nothing_to_wrap_writes_nothing(tmp_path, cli):
    host = write_host(tmp_path / "mcp.json", {"servers": {
        "remote": {"type": "sse", "url": "https://x/sse"}}})
    code, _, err = cli("wrap", "-host", "vscode", "-host-config", host, "-config",
                       str(tmp_path / "proxy.json"))
    assert code == 1 and "no server could be wrapped" in err and "remote" in err, err
    assert not os.path.exists(tmp_path / "proxy.json")


def test_wrap_refuses_a_host_file_with_comments(tmp_path, cli):
    host = tmp_path / "mcp.json"
    host.write_text('{\n  // mine\n  "servers": {}\n}\n')
    os.chmod(host, 0o600)
    code, _, err = cli("wrap", "-host", "vscode", "-host-config", str(host), "-config",
                       str(tmp_path / "proxy.json"))
    assert code == 1 and "comments" in err, err


# ---- where each host keeps its file; the suggestion ----

def test_host_config_paths_per_platform():
    env = {"APPDATA": r"C:\Users\me\AppData\Roaming", "XDG_CONFIG_HOME": "/xdg"}
    paths = {(host, plat): ap.host_config_paths(host, plat, env, "/home/me", "/work/p")
             for host in ap.WRAP_HOSTS for plat in ("darwin", "win32", "linux")}
    mac = "/home/me/Library/Application Support"
    assert paths["claude", "darwin"] == [f"{mac}/Claude/claude_desktop_config.json"]
    assert paths["claude", "win32"][0].startswith(r"C:\Users\me\AppData\Roaming")
    assert paths["claude", "win32"][0].endswith("claude_desktop_config.json")
    assert paths["claude", "linux"] == ["/xdg/Claude/claude_desktop_config.json"]
    assert paths["vscode", "darwin"] == ["/work/p/.vscode/mcp.json",
                                         f"{mac}/Code/User/mcp.json"]
    assert paths["vscode", "linux"][1] == "/xdg/Code/User/mcp.json"
    assert paths["cursor", "linux"] == ["/work/p/.cursor/mcp.json", "/home/me/.cursor/mcp.json"]
    assert ap.host_config_paths("claude", "linux", {}, "/home/me", "/") == [
        "/home/me/.config/Claude/claude_desktop_config.json"]


@pytest.mark.parametrize("ann,cls", [
    (None, "destructive"),
    ({}, "destructive"),
    ({"readOnlyHint": True}, "read_only"),
    ({"readOnlyHint": True, "destructiveHint": True}, "read_only"),
    ({"readOnlyHint": False}, "destructive"),
    ({"destructiveHint": False}, "remote_mutation"),
    ({"destructiveHint": False, "openWorldHint": False}, "local_mutation"),
    ({"destructiveHint": False, "openWorldHint": True}, "remote_mutation"),
    ({"openWorldHint": False}, "destructive"),
    ({"readOnlyHint": "yes"}, "destructive"),              # not a boolean: as if missing
    ({"destructiveHint": 0, "openWorldHint": False}, "destructive"),
    ({"idempotentHint": True}, "destructive"),
])
def test_suggested_class_reads_the_hints_with_mcps_defaults(ann, cls):
    assert ap.suggest_class(ann)[0] == cls


def test_suggested_rules_are_inert_json():
    tools = {"x\x1b[2J\u202e": {"annotations": {"readOnlyHint": True}}}
    lines = ap.rules_block(ap.suggested_rules(tools))
    text = "\n".join(lines)
    assert "\x1b" not in text and "\u202e" not in text
    assert json.loads("{" + text + "}") == {"rules": {"x\x1b[2J\u202e": {
        "side_effect": "read_only"}}}


@pytest.mark.parametrize("name, description, asks", [
    ("git_commit", "Records the staged changes.", True),
    ("push", "", True),
    ("sendMessage", "", True),
    ("create_comment", "Posts a comment on an issue.", True),
    ("notify", "Sends a notification.", True),
    ("write_file", "Writes a file.", False),
    ("postpone_task", "Delays a task.", False),
    ("list_commits", "Lists commits.", True),    # the name says it; a read-only tool gets none
])
def test_suggested_rules_ask_about_a_repeat_of_a_stateful_tool(name, description, asks):
    assert ap.suggests_repeat(name, description) is asks
    tools = {name: {"annotations": {"destructiveHint": False}, "description": description},
             "read_" + name: {"annotations": {"readOnlyHint": True}, "description": description}}
    rules = json.loads("{" + "\n".join(ap.rules_block(ap.suggested_rules(tools))) + "}")["rules"]
    assert rules[name].get("repeat") == ("ask" if asks else None), rules
    assert "repeat" not in rules["read_" + name]


def test_wrap_without_write_writes_nothing_and_write_then_works(tmp_path, cli):
    host, before, gate, config, out = dry_wrap(tmp_path, cli, "claude_desktop_config.json",
                                               "gate")
    assert os.listdir(gate) == [] and read_bytes(host) == before
    assert "nothing is written without -write" in out and "-write would write" in out
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write")
    assert code == 0, err                              # not "exists": the dry run wrote none
    assert sorted(os.listdir(gate)) == ["bank-modern.manifest.json", "bank.manifest.json",
                                        "echo_tools.manifest.json", "proxy.json"]


def test_wrap_write_rules_suggested_writes_exactly_the_printed_rules(tmp_path, cli):
    host = write_host(tmp_path / "claude_desktop_config.json", claude_desktop(tmp_path))
    config = str(tmp_path / "gate" / "proxy.json")
    os.makedirs(os.path.dirname(config))
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write", "-rules", "suggested")
    assert code == 0, err
    printed = pasted_rules(out)
    with open(config) as f:
        written = {s["name"]: s["rules"] for s in json.load(f)["servers"]}
    assert written == printed and printed["bank"]["pay"] == {"side_effect": "remote_mutation",
                                                             "repeat": "ask"}
    assert "the servers' own claims; read each before you trust it" in out
    code, checked, err = cli("check", "-config", config)
    assert code == 0, err
    assert re.search(r"bank_pay\s+remote_mutation", checked), checked


def test_wrap_rules_suggested_without_write_shows_them_in_the_configuration(tmp_path, cli):
    host = write_host(tmp_path / "claude_desktop_config.json", claude_desktop(tmp_path))
    config = str(tmp_path / "proxy.json")
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-rules", "suggested")
    assert code == 0 and not os.path.exists(config), err
    shown = {s["name"]: s["rules"] for s in shown_config(out)["servers"]}
    assert shown == pasted_rules(out)


def test_wrap_suggests_a_rename_that_drops_a_doubled_prefix():
    tools = {"git_commit": {"annotations": {"destructiveHint": False, "openWorldHint": False},
                            "description": "Records changes."},
             "git_status": {"annotations": {"readOnlyHint": True}},
             "log": {"annotations": {"readOnlyHint": True}}}
    rules = ap.suggested_rules(tools, "git")
    assert rules["git_commit"] == {"side_effect": "local_mutation", "repeat": "ask",
                                   "rename": "git_commit"}
    assert rules["git_status"] == {"side_effect": "read_only", "rename": "git_status"}
    assert rules["log"] == {"side_effect": "read_only"}
    # A rename that another tool's registered name already takes is not suggested.
    clash = ap.suggested_rules({"git_log": {"annotations": {"readOnlyHint": True}},
                                "log": {"annotations": {"readOnlyHint": True}}}, "git")
    assert clash["git_log"] == {"side_effect": "read_only"}


def _notifier(tmp_path, monkeypatch, name: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    program = bin_dir / name
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return str(program)


def test_wrap_prints_an_on_pending_line_for_the_machines_notifier(tmp_path, cli, monkeypatch):
    program = _notifier(tmp_path, monkeypatch, "notify-send")
    host = write_host(tmp_path / "claude_desktop_config.json", claude_desktop(tmp_path))
    config = str(tmp_path / "gate" / "proxy.json")
    os.makedirs(os.path.dirname(config))
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config)
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith('  "on_pending": '))
    argv = json.loads("{" + line + "}")["on_pending"]
    db = str(tmp_path / "gate" / "proxy.db")
    assert argv == [program, "agentrt-proxy", f'an approval waits: run {PYTHON} {PROXY} -db '
                                              f'"{db}" pending'], argv
    assert "to paste at the top level" in out
    assert "on_pending" not in shown_config(out)
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write", "-rules", "suggested")
    assert code == 0, err
    with open(config) as f:
        assert json.load(f)["on_pending"] == argv
    assert "written into the configuration" in out
    code, _, err = cli("check", "-config", config)
    assert code == 0, err


def test_wrap_suggests_osascript_where_there_is_no_notify_send(tmp_path, cli, monkeypatch):
    real_which = ap.shutil.which
    monkeypatch.setattr(ap.shutil, "which",
                        lambda name: None if name == "notify-send" else real_which(name))
    program = _notifier(tmp_path, monkeypatch, "osascript")
    assert ap.suggested_on_pending(str(tmp_path / "x.db")) == [
        program, "-e", 'display notification "an approval waits" with title "agentrt-proxy"']


def test_suggested_rules_print_as_the_readme_shows_them():
    tools = {"pay": {"annotations": {"destructiveHint": False}, "description": "Sends it."}}
    assert ap.rules_block(ap.suggested_rules(tools)) == ['  "rules": {',
                                                         '    "pay": {"side_effect": '
                                                         '"remote_mutation", "repeat": "ask"}',
                                                         "  }"]


def test_suggested_rename_never_takes_another_servers_name():
    """Found in review: server `evil` offering `evil_bank_pay` was suggested the rename
    `evil_bank_pay`, the name server `evil_bank`'s `pay` registers under."""
    pins = {"evil": {"tools": {"evil_bank_pay": {"annotations": {"readOnlyHint": True}}}},
            "evil_bank": {"tools": {"pay": {"annotations": {"readOnlyHint": True}}}}}
    rules = ap.suggested_rules(pins["evil"]["tools"], "evil",
                               ap.names_elsewhere(pins, "evil"))
    assert rules == {"evil_bank_pay": {"side_effect": "read_only"}}
