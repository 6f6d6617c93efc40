"""The Pythons the proxy runs on: 3.9 to 3.13, and an older one refused in one line.

The module, demo.py and fake_payment_server.py each check the interpreter before anything
else, with the same line: the version found, the version needed, where to get one. .ci/run
runs this file on every version it finds; the README's first screen names the same range.
Importing the module does no work a command may not need: http.client and fractions stay
unimported until a command needs them.
"""

from __future__ import annotations

import ast
import asyncio
import glob
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402
from process_helpers import PYTHON  # noqa: E402

PROGRAMS = ("agentrt_proxy.py", "demo.py", "fake_payment_server.py")
OLD_MINORS = (7, 8)            # old enough to refuse, new enough to compile the files
RUN_TIMEOUT = 30.0
README_SCREEN = 40             # lines of the README a reader sees before scrolling
SIMULATED_OLD = "(3, 8, 18, 'final', 0)"
OLDEST_PARSED = (3, 7)         # the check can run only where the whole file compiles


def interpreter(minor: int) -> str | None:
    """A working python3.<minor>: on PATH, else under pyenv. None when there is none."""
    name = "python3.%d" % minor
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = [shutil.which(name)] + sorted(
        glob.glob(os.path.join(root, "versions", "3.%d.*" % minor, "bin", name)), reverse=True)
    for path in filter(None, found):
        try:
            done = subprocess.run([path, "-c", "import sys; print(sys.version_info[1])"],
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == str(minor):
            return path
    return None


def check_refusal(done: subprocess.CompletedProcess, program: str, version: str, exe: str):
    assert done.returncode == 1, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith("%s needs Python 3.9 or newer; this is Python %s (%s). Get one: "
                           % (program, version, exe)), line
    for where in ("/usr/bin/python3 from the Command Line Tools", "xcode-select --install",
                  "brew install python", "https://www.python.org/downloads/"):
        assert where in line, (where, line)


OLD = [pytest.param(minor, id="3.%d" % minor) for minor in OLD_MINORS]


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("minor", OLD)
def test_an_older_python_gets_one_line_naming_both_versions(minor, program):
    exe = interpreter(minor)
    if exe is None:
        pytest.skip("no python3.%d on PATH or under pyenv" % minor)
    version = subprocess.run([exe, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, timeout=RUN_TIMEOUT).stdout.strip()
    done = subprocess.run([exe, os.path.join(ROOT, program), "-h"], cwd=ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    check_refusal(done, program, version, exe)


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_check_refuses_an_older_version_on_this_python(program):
    # Runs everywhere, old interpreter found or not: the file is run with version_info
    # set to an older one, so the same check must stop it before anything else happens.
    path = os.path.join(ROOT, program)
    code = ("import sys; sys.version_info = %s; p = %r; "
            "exec(compile(open(p).read(), p, 'exec'), {'__name__': '__main__', '__file__': p})"
            % (SIMULATED_OLD, path))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    check_refusal(done, program, platform.python_version(), sys.executable)


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_files_use_no_syntax_an_older_python_cannot_compile(program):
    # A walrus, a match or a positional-only parameter anywhere would turn the one line into
    # a SyntaxError on the very interpreters the check is for.
    with open(os.path.join(ROOT, program)) as f:
        ast.parse(f.read(), program, feature_version=OLDEST_PARSED)


def test_this_python_is_one_of_the_tested_versions():
    assert ap.MIN_PYTHON == (3, 9)
    assert (3, 9) <= sys.version_info[:2] <= (3, 13), sys.version


def ci_versions() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        m = re.search(r"^VERSIONS=\(([0-9. ]+)\)$", f.read(), re.M)
    assert m, ".ci/run names no VERSIONS=(...)"
    return m.group(1).split()


def test_ci_covers_every_version_from_the_oldest_supported():
    versions = ci_versions()
    assert versions[0] == "%d.%d" % ap.MIN_PYTHON
    assert versions == ["3.%d" % m for m in range(9, 9 + len(versions))]


def test_the_readme_first_screen_names_the_tested_versions():
    with open(os.path.join(ROOT, "README.md")) as f:
        screen = " ".join("".join(f.readlines()[:README_SCREEN]).split())
    versions = ci_versions()
    assert "Python %s to %s" % (versions[0], versions[-1]) in screen
    assert re.search(r"3\.9 is past its end of life.*macOS still ships it", screen), screen
    assert "3.11 or newer" not in screen


@pytest.mark.parametrize("popen_group", [
    pytest.param(False, id="new-session"),
    pytest.param(True, id="process_group", marks=pytest.mark.skipif(
        sys.version_info < (3, 11), reason="Popen(process_group=) arrived in Python 3.11")),
])
def test_a_stdio_server_runs_in_a_process_group_of_its_own(monkeypatch, popen_group):
    # Its own group is what lets close() kill what the server started as well; before
    # Python 3.11 the group comes from a new session.
    monkeypatch.setattr(ap, "POPEN_PROCESS_GROUP", popen_group)
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()"]

    async def body():
        conn = ap.StdioUpstream("groups", argv, ap.child_env((), ()))
        await conn.start()
        pid = conn.proc.pid
        try:
            return pid, os.getpgid(pid)
        finally:
            await conn.close()
    pid, group = asyncio.run(body())
    assert group == pid
    assert group != os.getpgrp()


# -- run as a module: the interpreter's cached compiled form, never the current directory --

def module_run(tmp_path, *flags: str, env_extra: dict | None = None):
    """``python3 <flags> -m agentrt_proxy -h`` from a directory holding an impostor module
    named like one the proxy imports; the proxy's own directory on PYTHONPATH."""
    (tmp_path / "secrets.py").write_text("raise SystemExit('IMPOSTOR RAN')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH",)}
    env.update(PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1", **(env_extra or {}))
    return subprocess.run([sys.executable, *flags, "-m", "agentrt_proxy", "-h"],
                          cwd=str(tmp_path), env=env, capture_output=True,
                          timeout=RUN_TIMEOUT)


def test_module_run_without_a_safe_path_is_refused_before_any_import(tmp_path):
    done = module_run(tmp_path)
    assert done.returncode == 1, done
    assert b"IMPOSTOR" not in done.stdout + done.stderr
    assert ap.SAFE_MODULE_RUN.encode() in done.stderr
    assert done.stdout == b""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P and PYTHONSAFEPATH are 3.11's")
@pytest.mark.parametrize("how", ["-P", "PYTHONSAFEPATH"])
def test_module_run_with_a_safe_path_serves_and_never_imports_the_current_directory(
        tmp_path, how):
    done = module_run(tmp_path, *(["-P"] if how == "-P" else []),
                      env_extra={"PYTHONSAFEPATH": "1"} if how != "-P" else None)
    assert done.returncode == 0, done
    assert b"IMPOSTOR" not in done.stdout + done.stderr
    assert done.stdout.startswith(b"What it governs")


def test_script_run_never_imports_the_current_directory(tmp_path):
    (tmp_path / "secrets.py").write_text("raise SystemExit('IMPOSTOR RAN')\n")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "agentrt_proxy.py"), "-h"],
                          cwd=str(tmp_path), capture_output=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0 and b"IMPOSTOR" not in done.stdout + done.stderr, done


# -- importing the module: no work a command may not need --------------------------------------

def test_import_leaves_http_client_and_fractions_unimported():
    p = subprocess.run([PYTHON, "-c", "import agentrt_proxy, sys; "
                        "print('http.client' in sys.modules, 'fractions' in sys.modules)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"], p.stdout
