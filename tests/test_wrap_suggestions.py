"""wrap's suggestions beyond a tool's class: a repeat_window of 0s for a local mutation its
server calls idempotent and not destructive (git_add twice in ten minutes was DUPLICATE and
staged nothing), printed with why and written with -write -rules suggested; and the README's
git recipe, as written, lets the edit, add and commit loop stage twice.

A tool the policy denies on every call is not suggested a rule, so it is not offered: wrap
lists it as left out with the rule that offers it, and check marks a classified one with how
to stop offering it.

check ends with a summary naming each refusal, and -strict fails on one. The new user's first
week, replayed end to end from the command line: a host's file of five servers wrapped with
the suggested rules, checked, served, read, asked, approved, repeated with `ask`, audited.
"""

import json
import os
import re
import sys

from conftest import ROOT, ap
from proxy_harness import ProxyHarness

PYTHON = sys.executable
STANDIN = os.path.join(ROOT, "tests", "standin_server.py")
README = os.path.join(ROOT, "README.md")


def schema(*names):
    return {"type": "object", "properties": {n: {"type": "string"} for n in names},
            "required": list(names), "additionalProperties": False}


LOCAL = {"readOnlyHint": False, "destructiveHint": False, "openWorldHint": False}
# A git server's tools, each with the hints a test needs (tests/standin_server.py offers them).
GIT_TOOLS = [
    {"name": "git_status", "description": "Shows the working tree status.",
     "annotations": {"readOnlyHint": True}, "inputSchema": schema("repo_path")},
    {"name": "git_add", "description": "Stages files.",
     "annotations": {**LOCAL, "idempotentHint": True}, "inputSchema": schema("repo_path", "files")},
    {"name": "git_checkout", "description": "Switches branches.", "annotations": LOCAL,
     "inputSchema": schema("repo_path", "branch")},
    {"name": "git_commit", "description": "Records the staged changes with a message.",
     "annotations": LOCAL, "inputSchema": schema("repo_path", "message")},
]


def write_host(tmp_path, tools) -> tuple[str, str]:
    """A Claude Desktop file starting the stand-in git server with ``tools``; its ledger."""
    ledger = str(tmp_path / "git.ledger")
    host = tmp_path / "claude_desktop_config.json"
    host.write_text(json.dumps({"mcpServers": {"git": {
        "command": PYTHON, "args": [STANDIN],
        "env": {"STANDIN_TOOLS": json.dumps(tools), "STANDIN_LEDGER": ledger}}}}))
    os.chmod(host, 0o600)
    return str(host), ledger


def printed_rules(out: str) -> dict:
    """The "rules" member wrap printed for the one server, as the operator would paste it."""
    start = out.index('  "rules": {\n')
    return json.loads("{" + out[start:out.index("\n  }\n", start) + 4] + "}")["rules"]


def hints_row(out: str, tool: str) -> str:
    return next(line for line in out.splitlines() if re.match(rf"  {tool}\s+[a-z_]+\s", line))


def staged(ledger: str) -> int:
    with open(ledger) as f:
        return sum(json.loads(line)["tool"] == "git_add" for line in f)


# ---- 1. repeat_window 0s for an idempotent local mutation ----

# Each hint read with MCP's defaults (destructiveHint true, idempotentHint false when missing).
WINDOW_CASES = [
    ({**LOCAL, "idempotentHint": True}, True),
    ({"destructiveHint": False, "openWorldHint": False, "idempotentHint": True}, True),
    (LOCAL, False),                                               # idempotentHint: false
    ({**LOCAL, "idempotentHint": "yes"}, False),                  # not a boolean: false
    ({"openWorldHint": False, "idempotentHint": True}, False),    # destructive by default
    ({**LOCAL, "destructiveHint": True, "idempotentHint": True}, False),
    ({"destructiveHint": False, "idempotentHint": True}, False),  # remote_mutation
    ({"readOnlyHint": True, "idempotentHint": True}, False),      # read_only: no window
    (None, False),
]


def test_wrap_suggests_no_window_for_an_idempotent_local_mutation():
    for ann, window in WINDOW_CASES:
        tools = {"stage": {"annotations": ann, "description": "Stages files."}}
        rule = ap.suggested_rules(tools)["stage"]
        table = " ".join(ap.hints_table(tools))
        if window:
            assert rule == {"side_effect": "local_mutation", "repeat_window": "0s"}, ann
            assert "idempotentHint is true" in table and "destructiveHint is false" in table
        else:
            assert "repeat_window" not in rule and "repeat_window" not in table, ann


def test_wrap_prints_the_window_with_why_and_that_it_turns_off_rule_4(tmp_path, cli):
    host, _ = write_host(tmp_path, GIT_TOOLS)
    config = str(tmp_path / "gate" / "proxy.json")
    os.makedirs(os.path.dirname(config))
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config)
    assert code == 0, err
    rules = printed_rules(out)
    assert rules["git_add"] == {"side_effect": "local_mutation", "repeat_window": "0s",
                                "rename": "git_add"}, rules
    assert "repeat_window" not in rules["git_checkout"] and \
        "repeat_window" not in rules["git_commit"], rules
    assert rules["git_commit"]["repeat"] == "ask"
    # beside the rule, in its row of the hints table: why, what else it turns off, and whose
    # claim it rests on
    row = hints_row(out, "git_add")
    assert 'repeat_window "0s"' in row, row
    assert "idempotentHint is true and destructiveHint is false" in row, row
    assert "DUPLICATE" in row and "rejected or expired" in row, row
    assert "the server's claims" in row, row
    assert "repeat_window" not in hints_row(out, "git_checkout")


def test_wrap_write_rules_suggested_writes_the_window_and_add_stages_twice(tmp_path, cli,
                                                                          harnesses):
    host, ledger = write_host(tmp_path, GIT_TOOLS)
    config = str(tmp_path / "gate" / "proxy.json")
    os.makedirs(os.path.dirname(config))
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write", "-rules", "suggested")
    assert code == 0, err
    with open(config) as f:
        (server,) = json.load(f)["servers"]
    assert server["rules"]["git_add"]["repeat_window"] == "0s", server["rules"]
    assert server["rules"] == printed_rules(out)
    # Served with the rules as written: the second identical git_add stages again, while an
    # identical git_checkout keeps the duplicate rule.
    h = harnesses(rules=server["rules"], names=("git",), command=[PYTHON, STANDIN],
                  server_env=[f"STANDIN_TOOLS={json.dumps(GIT_TOOLS)}",
                              f"STANDIN_LEDGER={ledger}"])
    add = {"repo_path": "/r", "files": "notes.txt"}
    for _ in range(2):
        r = h.call("git_add", add)
        assert not h.is_error(r), h.text(r)
    assert staged(ledger) == 2
    checkout = {"repo_path": "/r", "branch": "main"}
    assert not h.is_error(h.call("git_checkout", checkout))
    assert h.prefix(h.call("git_checkout", checkout)) == "DUPLICATE"


def recipe(name):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    marker = f"<!-- recipe: {name} -->\n```json\n"
    assert text.count(marker) == 1, name
    return json.loads(text.split(marker, 1)[1].split("```", 1)[0])


def test_readme_recipe_git_add_commit_loop(harnesses, tmp_path):
    """The README's git recipe as written: git_add runs each time the loop stages, and
    git_commit, gated by the policy, asks."""
    doc = recipe("git-add-commit-loop")
    (server,) = doc["servers"]
    assert server["rules"]["git_add"]["repeat_window"] == "0s"
    ledger = str(tmp_path / "git.ledger")
    h = harnesses(rules=server["rules"], names=(server["name"],), command=[PYTHON, STANDIN],
                  server_env=["STANDIN_KIND=git", f"STANDIN_LEDGER={ledger}"],
                  policy=doc["policy"])
    add = {"repo_path": "/r", "files": "notes.txt"}
    for _ in range(2):
        r = h.call("git_git_add", add)
        assert not h.is_error(r), h.text(r)
    assert staged(ledger) == 2
    r = h.call("git_git_commit", {"repo_path": "/r", "message": "fix typo"})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)


# ---- 2. a tool denied on every call is not offered ----

DENIED_TOOLS = GIT_TOOLS + [
    # destructive by MCP's default (destructiveHint missing), though it claims idempotence
    {"name": "git_reset", "description": "Resets the current HEAD.",
     "annotations": {"openWorldHint": False, "idempotentHint": True},
     "inputSchema": schema("repo_path")},
    {"name": "clean", "description": "Removes untracked files.",       # no hints at all
     "inputSchema": schema("repo_path")},
]
LEFT_OUT = {"git_reset": {"side_effect": "destructive", "rename": "git_reset",
                          "outcome": "require_approval"},
            "clean": {"side_effect": "destructive", "outcome": "require_approval"}}


def left_out_lines(out: str) -> dict:
    """The rules wrap lists as left out, one JSON member a line under its heading."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  left out"))
    found = {}
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        found.update(json.loads("{" + line + "}"))
    return found


def checked(cli, config) -> tuple[str, dict]:
    code, out, err = cli("check", "-config", config)
    assert code == 0, err
    return out, {line.split()[0]: line for line in out.splitlines() if line.startswith("git_")}


def test_wrap_leaves_out_a_tool_the_policy_denies_on_every_call(tmp_path, cli):
    host, _ = write_host(tmp_path, DENIED_TOOLS)
    config = str(tmp_path / "gate" / "proxy.json")
    os.makedirs(os.path.dirname(config))
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config)
    assert code == 0, err
    rules = printed_rules(out)
    assert set(rules) == {"git_status", "git_add", "git_checkout", "git_commit"}, rules
    assert hints_row(out, "git_reset").split()[1] == "destructive"    # still explained
    assert hints_row(out, "clean").split()[1] == "destructive"
    head = next(line for line in out.splitlines() if line.startswith("  left out"))
    assert "denies" in head and "on every call" in head and "not offered" in head, head
    assert left_out_lines(out) == LEFT_OUT, out
    # Written: exactly the printed rules, so neither is offered, and check counts them
    # unclassified, none denied on every call.
    code, out, err = cli("wrap", "-host", "claude", "-host-config", host, "-config", config,
                         "-write", "-rules", "suggested")
    assert code == 0, err
    with open(config) as f:
        doc = json.load(f)
    assert doc["servers"][0]["rules"] == rules
    text, lines = checked(cli, config)
    assert "summary: 4 tool(s) offered (0 of them denied on every call), 0 classified by a " \
           "rule but refused, 2 unclassified (no rule)" in text, text
    assert "git_reset" not in lines and "git_git_reset" not in lines, lines
    # The rule listed with it offers it, each call asking.
    doc["servers"][0]["rules"]["git_reset"] = LEFT_OUT["git_reset"]
    with open(config, "w") as f:
        json.dump(doc, f)
    text, lines = checked(cli, config)
    assert re.fullmatch(r"git_reset\s+destructive\s+-> require_approval\s+by its rule",
                        lines["git_reset"]), lines
    assert "(0 of them denied on every call)" in text, text


def test_left_out_names_what_the_given_policy_denies():
    tools = {t["name"]: t for t in DENIED_TOOLS}
    policy = ap.ProxyPolicy({**ap.DEFAULT_POLICY, "local_mutation": "deny"}, {})
    everything = ap.suggested_rules(tools, "git")
    assert set(everything) == set(tools)
    dropped = ap.left_out(everything, "git", policy)
    assert set(dropped) == set(tools) - {"git_status"}
    assert dropped["git_add"] == {**everything["git_add"], "outcome": "require_approval"}
    # A policy that denies nothing leaves nothing out.
    allow = ap.ProxyPolicy({c: "allow" for c in ap.DEFAULT_POLICY}, {})
    assert ap.left_out(everything, "git", allow) == {}


MARK = "denied on every call: remove its rule to stop offering it"


def test_check_marks_a_tool_denied_on_every_call_with_how_to_stop_offering_it(harnesses, cli):
    allowed_sometimes = {"if": {"properties": {"amount": {"type": "number", "maximum": 5}},
                                "required": ["amount"]}, "outcome": "allow"}
    h = harnesses(rules={
        "balance": {"side_effect": "read_only", "timeout": "10s"},
        "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "deny",
                "when": [allowed_sometimes]},                  # a condition may allow it
        "refund": {"side_effect": "destructive", "timeout": "10s"}})
    code, out, err = cli("check", "-config", h.config_path, "-strict")
    assert code == 0, err                         # -strict fails on a refusal only
    marked = [line for line in out.splitlines() if MARK in line]
    assert marked == [f"bank_refund: {MARK}"], out


# ---- 3. check's summary, and the five-server story end to end ----

def _checked(tmp_path, cli, rules, *flags):
    from proxy_harness import write_config
    h = ProxyHarness(tmp_path, rules=rules)          # pins the manifest, then closes
    h.close()
    return cli("check", "-config", write_config(str(tmp_path), rules), *flags)


def test_check_ends_with_a_summary_naming_each_refusal(tmp_path, cli):
    """check hid a refused tool among a hundred lines; -strict fails on one."""
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s",
                     "rename": "bank_balance"},                      # taken: refused
             "refund": {"side_effect": "destructive", "timeout": "10s"}}
    code, out, err = _checked(tmp_path, cli, rules)
    assert code == 0, err
    lines = out.splitlines()
    summary = lines.index(next(l for l in lines if l.startswith("summary: ")))
    assert lines[summary] == ("summary: 2 tool(s) offered (1 of them denied on every call), "
                              "1 classified by a rule but refused, 0 unclassified (no rule)")
    assert lines[summary + 1].startswith('REFUSED bank: pay: the name "bank_balance" is '
                                         'already taken'), lines[summary + 1]
    assert lines[summary + 2] == ("DENIED ON EVERY CALL bank_refund: by its class "
                                  "destructive, which the policy denies")
    code, _, _ = cli("check", "-config", str(tmp_path / "proxy.json"), "-strict")
    assert code == 1


def test_check_strict_passes_when_nothing_is_refused(tmp_path, cli):
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "deny"}}
    code, out, err = _checked(tmp_path, cli, rules, "-strict")
    assert code == 0, err
    assert "DENIED ON EVERY CALL bank_pay: by its rule" in out
    assert "summary: 2 tool(s) offered (1 of them denied on every call), 0 classified by a " \
           "rule but refused, 1 unclassified (no rule)" in out, out


def test_first_week_five_servers_wrap_check_serve_ask_approve_repeat_audit(tmp_path, cli):
    """The new user's story, replayed: a Claude Desktop file with five servers (stand-ins for
    filesystem, memory, git and everything, and the fake payment server), wrapped with the
    suggested rules, checked, served to a host, read, asked, approved, repeated with `ask`,
    and audited, from the command line as the user met it."""
    import os
    import re
    import sys
    from conftest import ROOT
    from process_helpers import ProxyProcess, text, prefix
    standin = os.path.join(ROOT, "tests", "standin_server.py")
    ledger = str(tmp_path / "standin.ledger")

    def stand_in(kind):
        return {"command": sys.executable, "args": [standin],
                "env": {"STANDIN_KIND": kind, "STANDIN_LEDGER": ledger}}
    host = tmp_path / "Claude" / "claude_desktop_config.json"
    host.parent.mkdir()
    host.write_text(json.dumps({"mcpServers": {
        "filesystem": stand_in("filesystem"), "memory": stand_in("memory"),
        "git": stand_in("git"), "everything": stand_in("everything"),
        "bank": {"command": sys.executable,
                 "args": [os.path.join(ROOT, "fake_payment_server.py")],
                 "env": {"FAKE_PAYMENTS_LEDGER": str(tmp_path / "bank.ledger")}}}}))
    gate = tmp_path / "gate"
    gate.mkdir()
    config = str(gate / "proxy.json")
    # wrap: a dry run writes nothing; -write -rules suggested writes the printed rules.
    code, out, err = cli("wrap", "-host", "claude", "-host-config", str(host), "-config",
                         config)
    assert code == 0 and os.listdir(gate) == [], err
    code, out, err = cli("wrap", "-host", "claude", "-host-config", str(host), "-config",
                         config, "-write", "-rules", "suggested")
    assert code == 0, err
    with open(config) as f:
        rules = {s["name"]: s["rules"] for s in json.load(f)["servers"]}
    assert rules["git"]["git_commit"] == {"side_effect": "local_mutation", "repeat": "ask",
                                          "rename": "git_commit"}
    assert "refund" not in rules["bank"]         # denied on every call: left out
    assert '"refund": {"side_effect": "destructive", "outcome": "require_approval"}' in out
    # check: every tool named, nothing refused, none offered only to be denied.
    code, out, err = cli("check", "-config", config, "-strict")
    assert code == 0, err
    assert "0 classified by a rule but refused" in out, out
    assert "(0 of them denied on every call)" in out, out

    class Dir:                                   # what ProxyProcess needs of a directory
        tmp, procs = str(gate), []
    Dir.config = config
    p = ProxyProcess(Dir, "host")
    try:
        p.initialize()
        listed = {t["name"] for t in p.request("tools/list", {})["result"]["tools"]}
        assert {"filesystem_read_file", "git_commit", "git_status", "memory_read_graph",
                "everything_echo", "bank_pay", "gate_status"} <= listed, listed
        assert "bank_refund" not in listed
        # read
        assert text(p.call("filesystem_read_file", {"path": "/notes.txt"})) == \
            "read_file done"
        # ask, approve from a shell, collect once
        pay = {"to": "landlord", "amount": 950}
        r = p.call("bank_pay", pay)
        assert prefix(r) == "PENDING_APPROVAL", text(r)
        (aid,) = re.findall(r"approval ([0-9a-f]{32})", text(r))
        code, out, err = cli("-db", str(gate / "proxy.db"), "approve", "-approval", aid,
                             "-by", "pat")
        assert code == 0, err
        assert text(p.call("bank_pay", pay)) == "paid 950.00 to landlord"
        # repeat with ask: a second identical commit asks, naming the first; approved, it runs
        commit = {"repo_path": "/r", "message": "fix typo"}
        assert text(p.call("git_commit", commit)) == "git_commit done"
        r = p.call("git_commit", commit)
        assert prefix(r) == "PENDING_APPROVAL" and "already executed" in text(r), text(r)
        code, out, err = cli("-db", str(gate / "proxy.db"), "pending")
        assert "  repeat  git_commit" in out and "REPEAT: this exact request already " \
            "executed" in out, out
        (aid,) = re.findall(r"approval ([0-9a-f]{32})", text(r))
        code, out, err = cli("-db", str(gate / "proxy.db"), "approve", "-approval", aid,
                             "-by", "pat")
        assert code == 0, err
        assert text(p.call("git_commit", commit)) == "git_commit done"
        with open(ledger) as f:
            commits = [json.loads(line) for line in f if '"git_commit"' in line]
        assert len(commits) == 2
        # a rejected repeat is refused again, and the trail keeps it
        r = p.call("git_commit", commit)
        (aid,) = re.findall(r"approval ([0-9a-f]{32})", text(r))
        code, out, err = cli("-db", str(gate / "proxy.db"), "reject", "-approval", aid,
                             "-by", "pat", "-note", "enough commits")
        assert code == 0, err
        for _ in range(3):
            r = p.call("git_commit", commit)
            assert prefix(r) == "REJECTED" and "enough commits" in text(r), text(r)
        p.stop()
    finally:
        p.kill()
    code, out, err = cli("-db", str(gate / "proxy.db"), "-json", "runs")
    whys = [(r["goal"], r["why"]) for r in json.loads(out)["runs"]]
    assert ("call git_commit", "rejected by pat") in whys, whys
    rejected = next(r["id"] for r in json.loads(out)["runs"] if r["why"] == "rejected by pat")
    code, out, err = cli("-db", str(gate / "proxy.db"), "show", rejected)
    assert "ended   rejected by pat" in out and "refused 3 time(s) as REJECTED" in out, out
