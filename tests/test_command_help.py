"""Each command's own help: `wrap --help`, `check -h`, `-db D runs --help`, `help pin` print
that command's usage and flags on stdout, exit 0; the general help (`-h` alone) starts with
the scope statement and lists every command (DESIGN.md section 2).
"""

import argparse

import pytest

from conftest import ap

SCOPE = "The proxy governs only calls that go through it"
COMMANDS = ("serve", "pin", "check", "wrap", "recheck", "runs", "show", "events", "approve",
            "reject", "cancel", "verify", "pending", "inbox", "webhook", "sign")
NO_DATABASE = ("serve", "pin", "check", "wrap", "recheck", "sign")
ENTRY = "  python agentrt_proxy.py "


def own_flags(command: str) -> set[str]:
    """The one-dash spelling of each flag build_parser gives ``command`` (-json aside: every
    operator command takes it, and the usage gives it before the command)."""
    top = ap.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {s for action in sub.choices[command]._actions for s in action.option_strings
            if not s.startswith("--") and s != "-json"}


def usage_line(out: str) -> str:
    """The first line of the usage entry: what follows `usage:`."""
    lines = out.splitlines()
    return lines[lines.index("usage:") + 1]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_command_help_prints_its_own_usage_and_flags(cli, command, flag):
    before = [] if command in NO_DATABASE else ["-db", "proxy.db"]
    code, out, err = cli(*before, command, flag)
    assert (code, err) == (0, ""), err
    assert SCOPE not in out and out.startswith("usage:\n"), out
    words = usage_line(out).split()
    assert words[:2] == ["python", "agentrt_proxy.py"], out
    assert command in words or (command == "serve" and "-config" in words), out
    for name in own_flags(command):
        assert name in out.split("\n\n")[0].replace("[", " ").replace("]", " ").split(), \
            (name, out)
    # this command's entry alone
    assert [line for line in out.splitlines() if line.startswith(ENTRY)] == \
        [usage_line(out)], out


def test_wrap_and_check_help_name_their_flags(cli):
    for argv in (["wrap", "--help"], ["wrap", "-h"], ["wrap", "-host", "claude", "--help"],
                 ["wrap", "--help", "-host", "claude"], ["help", "wrap"]):
        code, out, err = cli(*argv)
        assert (code, err) == (0, ""), argv
        for name in ("-host", "-host-config", "-config", "-write", "-rules"):
            assert name in out, (argv, out)
        assert SCOPE not in out and "check -config" not in out, (argv, out)
    code, out, err = cli("check", "--help")
    assert (code, err) == (0, "")
    assert "-strict" in out and "-config" in out and "wrap -host" not in out, out


def test_help_names_the_command_after_the_global_flags_or_none(cli):
    """The command is the first word past the global flags (and their values); without one,
    the help is the general one, the scope statement first and every command listed."""
    # -db's value is a file that happens to be named like a command
    code, out, _ = cli("-db", "runs", "--json", "events", "RUN", "--help")
    assert code == 0 and " events RUN " in usage_line(out) + " ", out
    code, out, _ = cli("--db=proxy.db", "cancel", "-h")
    assert code == 0 and " cancel " in usage_line(out), out
    for argv in (["-h"], ["--help"], ["help"], ["help", "nonsense"],
                 ["-config", "p.json", "--help"], ["-db", "pending", "-json", "-h"]):
        code, out, err = cli(*argv)
        assert (code, err) == (0, ""), argv
        assert out.index(SCOPE) < out.index("usage:"), argv
        assert out.rstrip("\n").endswith(ap.USAGE), argv
        for command in ("pin -config", "check -config", "wrap -host", "recheck -config",
                        " runs ", "webhook -listen", "sign -secret-file"):
            assert command in out, (argv, command)
