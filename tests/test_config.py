"""Configuration: strict loading, defaults, relative paths, ownership, the reach check, and the
policy's identity.

Specification: proxy-seed.md "Configuration" and "Re-checking recorded calls" (the policy's
identity); DESIGN.md 1, 2 and 8; reference/proxy.md 11 (loading, fields, validation, owner
checks, database check, reach check) and 13.1 (Config.PolicyID); test rows 36-39, 45-47 and 49
of reference/proxy.md 17.2, plus a corpus of bad configurations, each with the error it gives.
"""

import copy
import hashlib
import io
import json
import os
import re
import stat
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402

FAKE_SERVER = os.path.join(ROOT, "fake_payment_server.py")
POSIX = os.name == "posix"
RULES = {
    "balance": {"side_effect": "read_only", "timeout": "10s"},
    "pay": {"side_effect": "remote_mutation", "timeout": "10s"},
    "refund": {"side_effect": "destructive", "timeout": "10s"},
}
DEFAULT_POLICY = {"read_only": "allow", "local_mutation": "allow",
                  "remote_mutation": "require_approval", "destructive": "deny"}


# ---- helpers ----

def server(**fields) -> dict:
    """One server entry for the fake payment server; fields override or add (None removes)."""
    entry = {"name": "bank", "command": [sys.executable, FAKE_SERVER], "manifest": "m.json",
             "rules": copy.deepcopy(RULES)}
    entry.update(fields)
    return {k: v for k, v in entry.items() if v is not None}


def config_doc(**top) -> dict:
    doc = {"database": "runs.db", "session": "test", "servers": [server()]}
    doc.update(top)
    return {k: v for k, v in doc.items() if v is not None}


def with_rule(**rule_fields) -> dict:
    """A configuration whose pay rule has these fields added."""
    rules = copy.deepcopy(RULES)
    rules["pay"].update(rule_fields)
    return config_doc(servers=[server(rules=rules)])


def write(path, content, mode=0o600) -> str:
    path = str(path)
    if isinstance(content, str):
        data = content.encode()
    elif isinstance(content, bytes):
        data = content
    else:
        data = json.dumps(content, indent=2).encode()
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def load_error(path: str) -> str:
    with pytest.raises(ap.ConfigError) as info:
        ap.load_config(path)
    return str(info.value)


def run_main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def bank_config(directory, **top) -> str:
    """A configuration the fake payment server can serve, in ``directory``: database
    store.sqlite and manifest pins.json (names that do not themselves say "database" or
    "manifest", so a message that names the file's role is seen to do so)."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    doc = config_doc(database="store.sqlite", servers=[server(
        manifest="pins.json", env=[f"FAKE_PAYMENTS_LEDGER={directory}/ledger"])])
    doc.update(top)
    return write(os.path.join(directory, "proxy.json"), doc)


def pin(path: str) -> None:
    code, out, err = run_main("pin", "-config", path)
    assert code == 0, err
    assert "3 tools pinned" in out


# ---- row 36 ----

def test_config_refuses_unknown_fields(tmp_path):
    path = write(tmp_path / "proxy.json", config_doc())
    cfg = ap.load_config(path)
    assert cfg.session == "test" and [s.name for s in cfg.servers] == ["bank"]

    refused = {
        "unknown top-level key": (config_doc(hold_for="1s"), ['"hold_for"']),
        "unknown server key": (config_doc(servers=[server(root="/srv")]), ['"root"']),
        "unknown rule key": (with_rule(ask=True), ['"ask"', '"pay"']),
        "policy outcome maybe": (config_doc(policy={"destructive": "maybe"}),
                                 ["policy", "destructive", '"maybe"']),
        "policy outcome abort": (config_doc(policy={"remote_mutation": "abort"}),
                                 ["policy", "remote_mutation", '"abort"']),
        "hold as a number": (config_doc(hold=15), ["hold"]),
        "rule outcome ask": (with_rule(outcome="ask"), ['"pay"', "outcome", '"ask"']),
    }
    for what, (doc, names) in refused.items():
        write(path, doc)
        msg = load_error(path)
        assert path in msg, what
        for name in names:
            assert name in msg, f"{what}: {name!r} not in {msg!r}"
    write(path, json.dumps(config_doc()).encode() + b" {}")
    msg = load_error(path)
    assert path in msg and re.search(r"trailing|after the (value|configuration)", msg), msg


# ---- row 37 ----

@pytest.mark.parametrize("session", ["", "a b", "../x", "a.b", "x;rm", "é", "a" * 65,
                                     "a\n", "a/b", " a"])
def test_config_refuses_an_unsafe_session_name(tmp_path, session):
    path = write(tmp_path / "proxy.json", config_doc(session=session))
    msg = load_error(path)
    assert "session" in msg and path in msg


@pytest.mark.parametrize("session", ["a", "laptop", "A-b_9", "a" * 64])
def test_config_accepts_a_safe_session_name(tmp_path, session):
    path = write(tmp_path / "proxy.json", config_doc(session=session))
    assert ap.load_config(path).session == session


# ---- row 38 ----

def test_config_defaults_and_relative_paths(tmp_path):
    path = write(tmp_path / "proxy.json", config_doc())
    cfg = ap.load_config(path)
    assert cfg.database in (str(tmp_path / "runs.db"), os.path.realpath(tmp_path / "runs.db"))
    manifest = cfg.servers[0].manifest
    assert os.path.isabs(manifest) and manifest.endswith("/m.json")
    assert os.path.dirname(manifest) in (str(tmp_path), os.path.realpath(tmp_path))
    assert cfg.hold == 15
    assert cfg.repeat_window == 600
    assert cfg.max_pending == 5
    assert cfg.approval_ttl == 24 * 3600 and cfg.grant_ttl == 24 * 3600
    assert cfg.status_tool == "gate_status"
    assert cfg.lease_ttl == 30
    assert cfg.policy_map == DEFAULT_POLICY
    # A command is not a path of the proxy's: it is not resolved.
    assert cfg.servers[0].command == (sys.executable, FAKE_SERVER)

    # A class left out keeps its default; max_pending 0 means the default.
    write(path, config_doc(policy={"remote_mutation": "deny"}, max_pending=0))
    cfg = ap.load_config(path)
    assert cfg.policy_map == dict(DEFAULT_POLICY, remote_mutation="deny")
    assert cfg.max_pending == 5


def test_config_relative_paths_resolve_against_the_file_whatever_the_cwd(tmp_path,
                                                                        monkeypatch):
    conf = tmp_path / "conf"
    elsewhere = tmp_path / "elsewhere"
    conf.mkdir()
    elsewhere.mkdir()
    absolute_db = str(tmp_path / "abs" / "runs.db")
    write(conf / "proxy.json", config_doc(database="data/runs.db", servers=[
        server(name="bank", manifest="pins/bank.json"),
        server(name="other", manifest="../shared/other.json"),
        server(name="third", manifest=str(tmp_path / "abs" / "third.json"))]))
    write(conf / "abs.json", config_doc(database=absolute_db))
    for cwd in (elsewhere, tmp_path, conf, "/"):
        monkeypatch.chdir(cwd)
        for given in (str(conf / "proxy.json"), os.path.relpath(conf / "proxy.json")):
            cfg = ap.load_config(given)
            assert os.path.normpath(cfg.database) == str(conf / "data" / "runs.db"), cwd
            assert [os.path.normpath(s.manifest) for s in cfg.servers] == [
                str(conf / "pins" / "bank.json"), str(tmp_path / "shared" / "other.json"),
                str(tmp_path / "abs" / "third.json")]
        assert ap.load_config(os.path.relpath(conf / "abs.json")).database == absolute_db


def test_config_serving_creates_the_database_beside_the_file(tmp_path, monkeypatch):
    """End to end: pin and check run from another directory write the manifest and create the
    database in the configuration's directory, never in the working directory."""
    conf = tmp_path / "conf"
    path = bank_config(conf)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rel = os.path.relpath(path)
    pin(rel)
    code, out, err = run_main("check", "-config", rel)
    assert code == 0, err
    assert os.path.isfile(conf / "pins.json") and os.path.isfile(conf / "store.sqlite")
    assert os.listdir(cwd) == []
    assert f"database: {conf / 'store.sqlite'}" in out
    if POSIX:
        assert stat.S_IMODE(os.stat(conf / "store.sqlite").st_mode) == 0o600


@pytest.mark.parametrize("text,seconds", [("15s", 15), ("10m", 600), ("1h30m", 5400),
                                          ("0s", 0), ("300ms", 0.3), ("1m30s", 90),
                                          ("1h", 3600), ("1.5s", 1.5)])
def test_config_durations_parse_as_the_seed_says(tmp_path, text, seconds):
    path = write(tmp_path / "proxy.json", config_doc(
        hold=text, repeat_window=text, approval_ttl=text, grant_ttl=text,
        servers=[server(default_timeout=text, rules={
            "pay": {"side_effect": "remote_mutation", "timeout": text, "repeat_window": text}})]))
    cfg = ap.load_config(path)
    assert cfg.hold == pytest.approx(seconds)
    assert cfg.repeat_window == pytest.approx(seconds)
    assert cfg.approval_ttl == pytest.approx(seconds)
    assert cfg.grant_ttl == pytest.approx(seconds)
    assert cfg.servers[0].default_timeout == pytest.approx(seconds)
    rule = cfg.servers[0].rule_map["pay"]
    assert rule.timeout == pytest.approx(seconds)
    assert rule.repeat_window == pytest.approx(seconds)


def test_config_lease_ttl_has_a_floor_of_three_seconds(tmp_path):
    path = tmp_path / "proxy.json"
    for ok, seconds in (("3s", 3), ("10s", 10), ("1m", 60)):
        write(path, config_doc(lease_ttl=ok))
        assert ap.load_config(str(path)).lease_ttl == seconds
    for short in ("1s", "2999ms", "2.5s", "100ms"):
        write(path, config_doc(lease_ttl=short))
        msg = load_error(str(path))
        assert "lease_ttl" in msg and "3s" in msg and str(path) in msg


# ---- the corpus of bad configurations ----

def _raw(doc: dict, marker: str, literal: str) -> bytes:
    """``doc`` as JSON with the string "<marker>" replaced by a raw literal."""
    return json.dumps(doc).replace(json.dumps(marker), literal).encode()


GOOD = json.dumps(config_doc())
_S = json.dumps(server())
_RULES_RAW = json.dumps(RULES)

# (id, content, fragments that must all appear in the error besides the file's path)
CORPUS = [
    # a repeated key, at every level
    ("repeated top-level key", GOOD.replace('"session": "test"',
                                            '"session": "test", "session": "prod"'),
     ["duplicate key", '"session"']),
    ("repeated key via an escape", GOOD.replace('"session": "test"',
                                                '"session": "test", "sess\\u0069on": "prod"'),
     ["duplicate key", '"session"']),
    ("repeated policy key", GOOD[:-1] + ', "policy": {"destructive": "deny", '
                                        '"destructive": "allow"}}',
     ["duplicate key", '"destructive"']),
    ("repeated server key", GOOD.replace('"name": "bank"', '"name": "bank", "name": "shop"'),
     ["duplicate key", '"name"']),
    ("repeated rule name", GOOD.replace('"pay": {', '"pay": {"side_effect": "read_only"}, '
                                                    '"pay": {'),
     ["duplicate key", '"pay"']),
    ("repeated rule key", GOOD.replace('"side_effect": "remote_mutation"',
                                       '"side_effect": "remote_mutation", '
                                       '"side_effect": "read_only"'),
     ["duplicate key", '"side_effect"']),
    ("repeated fixed key", GOOD.replace('"side_effect": "remote_mutation"',
                                        '"side_effect": "remote_mutation", "fixed": '
                                        '{"currency": "EUR", "currency": "USD"}'),
     ["duplicate key", '"currency"']),
    ("repeated key inside a fixed value", GOOD.replace(
        '"side_effect": "remote_mutation"',
        '"side_effect": "remote_mutation", "fixed": {"meta": {"k": 1, "k": 2}}'),
     ["duplicate key", '"k"']),
    # an unknown field, at every level (field names are case-sensitive)
    ("unknown top-level field", config_doc(hold_for="1s"), ["unknown", '"hold_for"']),
    ("top-level field in another case", config_doc(Hold="1s"), ["unknown", '"Hold"']),
    ("unknown server field", config_doc(servers=[server(root="/srv")]), ["unknown", '"root"']),
    ("unknown rule field", with_rule(condition="amount < 10"),
     ["unknown", '"condition"', '"pay"']),
    ("unknown policy class", config_doc(policy={"harmless": "allow"}),
     ["policy", '"harmless"']),
    # wrong types
    ("top level not an object", b"[]", ["object"]),
    ("hold a number", config_doc(hold=15), ["hold"]),
    ("session a number", config_doc(session=7), ["session"]),
    ("database a number", config_doc(database=1), ["database"]),
    ("servers an object", config_doc(servers={}), ["servers"]),
    ("server not an object", config_doc(servers=["bank"]), ["servers[0]"]),
    ("command a string", config_doc(servers=[server(command="x")]), ["command"]),
    ("env a string", config_doc(servers=[server(env="A=1")]), ["env"]),
    ("inherit_env a string", config_doc(servers=[server(inherit_env="HOME")]),
     ["inherit_env"]),
    ("skip_path_check a string", config_doc(servers=[server(skip_path_check="yes")]),
     ["skip_path_check"]),
    ("rules an array", config_doc(servers=[server(rules=[])]), ["rules"]),
    ("rule an array", config_doc(servers=[server(rules={"pay": []})]), ['"pay"']),
    ("deny a string", with_rule(deny="x"), ["deny", '"pay"']),
    ("fixed an array", with_rule(fixed=[]), ["fixed", '"pay"']),
    ("policy an array", config_doc(policy=[]), ["policy"]),
    ("max_pending 1.5", config_doc(max_pending=1.5), ["max_pending"]),
    ("max_pending -1", config_doc(max_pending=-1), ["max_pending"]),
    ("max_pending a string", config_doc(max_pending="5"), ["max_pending"]),
    ("max_pending true", config_doc(max_pending=True), ["max_pending"]),
    ("max_pending past the number bound",
     _raw(config_doc(max_pending="@N@"), "@N@", "1e-10000000"),
     ["not usable JSON", "1e-10000000"]),
    # durations
    ("lease_ttl 1s", config_doc(lease_ttl="1s"), ["lease_ttl", "1s", "3s"]),
    ("lease_ttl 2s", config_doc(lease_ttl="2s"), ["lease_ttl", "2s", "3s"]),
    # both or neither of command and endpoint; the manifest; names
    ("both command and endpoint",
     config_doc(servers=[server(endpoint="http://127.0.0.1:9/mcp")]),
     ['"bank"', "command", "endpoint"]),
    ("neither command nor endpoint", config_doc(servers=[server(command=None)]),
     ['"bank"', "command", "endpoint"]),
    ("empty command", config_doc(servers=[server(command=[])]),
     ['"bank"', "command", "endpoint"]),
    ("no manifest, a name that is not a file name",
     config_doc(servers=[server(name="../bank", manifest=None)]),
     ['"../bank"', "manifest is required"]),
    ("empty manifest", config_doc(servers=[server(manifest="")]), ['"bank"', "manifest"]),
    ("a server name used twice", config_doc(servers=[server(), server(manifest="n.json")]),
     ["servers[1]", '"bank"']),
    ("server without a name", config_doc(servers=[server(name=None)]),
     ["servers[0]", "name"]),
    ("no database", config_doc(database=None), ["database"]),
    ("empty database", config_doc(database=""), ["database"]),
    ("no servers", config_doc(servers=[]), ["server"]),
    ("no session", config_doc(session=None), ["session"]),
    # outcomes
    ("policy outcome maybe", config_doc(policy={"destructive": "maybe"}),
     ["policy", "destructive", '"maybe"']),
    ("policy outcome abort", config_doc(policy={"read_only": "abort"}),
     ["policy", "read_only", '"abort"']),
    ("policy outcome empty", config_doc(policy={"read_only": ""}), ["policy", "read_only"]),
    ("policy outcome a number", config_doc(policy={"read_only": 1}), ["policy", "read_only"]),
    ("rule outcome ask", with_rule(outcome="ask"), ['"pay"', "outcome", '"ask"']),
    ("rule outcome abort", with_rule(outcome="abort"), ['"pay"', "outcome", '"abort"']),
    # the status tool's name
    ("status_tool with a space", config_doc(status_tool="gate status"),
     ["status_tool", '"gate status"']),
    ("status_tool with a dot", config_doc(status_tool="gate.status"),
     ["status_tool", '"gate.status"']),
    ("status_tool too long", config_doc(status_tool="s" * 65), ["status_tool"]),
    # env and inherit_env
    ("env entry without =", config_doc(servers=[server(env=["A"])]), ["env", '"A"']),
    ("env entry starting with =", config_doc(servers=[server(env=["=A"])]), ["env", '"=A"']),
    ("inherit_env with =", config_doc(servers=[server(inherit_env=["A=1"])]),
     ["inherit_env", '"A=1"']),
    # not JSON
    ("not JSON", b'{"database": "runs.db", "session": ', ["JSON"]),
    ("empty file", b"", ["JSON"]),
    ("byte order mark", b"\xef\xbb\xbf" + GOOD.encode(), ["JSON"]),
    ("invalid UTF-8", GOOD.replace('"test"', '"t\\u00e9st"').encode().replace(b"\\u00e9",
                                                                              b"\xff"),
     ["UTF-8"]),
    ("lone surrogate", GOOD.replace('"runs.db"', '"runs\\ud800.db"'), ["surrogate"]),
    ("trailing object", GOOD + " {}", [r"re:trailing|after the (value|configuration)"]),
    ("trailing text", GOOD + "x", [r"re:trailing|after the (value|configuration)"]),
    ("a comment", GOOD + " // the bank", [r"re:trailing|after the (value|configuration)"]),
]

DURATION_FIELDS = {
    "hold": lambda v: config_doc(hold=v),
    "repeat_window": lambda v: config_doc(repeat_window=v),
    "approval_ttl": lambda v: config_doc(approval_ttl=v),
    "grant_ttl": lambda v: config_doc(grant_ttl=v),
    "lease_ttl": lambda v: config_doc(lease_ttl=v),
    "connect_timeout": lambda v: config_doc(servers=[server(connect_timeout=v)]),
    "default_timeout": lambda v: config_doc(servers=[server(default_timeout=v)]),
    "timeout": lambda v: with_rule(timeout=v),
    "repeat_window (rule)": lambda v: with_rule(repeat_window=v),
}
for _field, _make in DURATION_FIELDS.items():
    _name = _field.split()[0]
    for _bad in ("5", "1d", "-1s", "1m1h", "", "15", "1.5", "s", "15 s", "1h-30m"):
        CORPUS.append((f"{_field} {_bad!r}", _make(_bad),
                       [_name] + ([f"re:{re.escape(_bad)}"] if _bad else [])))
    CORPUS.append((f"{_field} a number", _make(15), [_name]))

def _corpus_params():
    params = [pytest.param(content, frags, id=name) for name, content, frags in CORPUS]
    for digits in ("١٥s", "１５s"):
        params.append(pytest.param(config_doc(hold=digits), ["hold"], id=f"hold {digits!r}"))
    return params


@pytest.mark.parametrize("content,fragments", _corpus_params())
def test_config_corpus_of_bad_configurations(tmp_path, content, fragments):
    path = write(tmp_path / "proxy.json", content)
    msg = load_error(path)
    assert path in msg, msg
    for frag in fragments:
        if frag.startswith("re:"):
            assert re.search(frag[3:], msg), f"/{frag[3:]}/ not in {msg!r}"
        else:
            assert frag in msg, f"{frag!r} not in {msg!r}"
    assert "\n" not in msg
    # The command line refuses it the same way, before doing anything else.
    code, out, err = run_main("check", "-config", path)
    assert code == 1 and out == ""
    assert err.startswith("agentrt-proxy: error: ") and path in err
    assert not os.path.exists(tmp_path / "runs.db")


# ---- files: what is read is a regular file the current user owns and only it can write ----

def _directory(tmp_path):
    os.mkdir(tmp_path / "proxy.json")
    return str(tmp_path / "proxy.json")


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "proxy.json", 0o600)
    return str(tmp_path / "proxy.json")


def _mode(mode):
    return lambda tmp_path: write(tmp_path / "proxy.json", config_doc(), mode)


def _other_owner(tmp_path):
    path = write(tmp_path / "proxy.json", config_doc())
    try:
        os.chown(path, 65534, -1)
    except (PermissionError, AttributeError):
        pytest.skip("cannot give a file to another user (not root)")
    return path


@pytest.mark.skipif(not POSIX, reason="POSIX modes and owners")
@pytest.mark.parametrize("make,fragments", [
    pytest.param(_directory, ["not a regular file"], id="a directory"),
    pytest.param(_fifo, ["not a regular file"], id="a fifo"),
    pytest.param(_mode(0o620), ["-rw--w----", "chmod go-w"], id="mode 0620"),
    pytest.param(_mode(0o602), ["-rw-----w-", "chmod go-w"], id="mode 0602"),
    pytest.param(_mode(0o666), ["-rw-rw-rw-", "chmod go-w"], id="mode 0666"),
    pytest.param(_mode(0o660), ["-rw-rw----", "chmod go-w"], id="mode 0660"),
    pytest.param(_other_owner, ["65534", "current user", "-rw-------"], id="owned by another"),
])
def test_config_file_is_read_only_when_safe(tmp_path, make, fragments):
    path = make(tmp_path)
    msg = load_error(path)
    assert path in msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    code, _, err = run_main("check", "-config", path)
    assert code == 1 and path in err


@pytest.mark.skipif(not POSIX, reason="POSIX modes")
@pytest.mark.parametrize("mode", [0o600, 0o400, 0o644, 0o640, 0o604, 0o700])
def test_config_file_others_may_read(tmp_path, mode):
    path = write(tmp_path / "proxy.json", config_doc(), mode)
    assert ap.load_config(path).session == "test"


def test_config_missing_file_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "absent.json")
    assert path in load_error(path)
    code, _, err = run_main("check", "-config", path)
    assert code == 1 and path in err


# ---- row 39 ----

@pytest.mark.skipif(not POSIX, reason="POSIX only")
def test_config_refuses_files_others_can_write(tmp_path):
    path = bank_config(tmp_path)
    pin(path)
    code, _, err = run_main("check", "-config", path)
    assert code == 0, err

    os.chmod(path, 0o666)
    msg = load_error(path)
    assert path in msg and "-rw-rw-rw-" in msg
    code, _, err = run_main("check", "-config", path)
    assert code == 1 and path in err
    os.chmod(path, 0o600)

    manifest = str(tmp_path / "pins.json")
    os.chmod(manifest, 0o664)
    code, _, err = run_main("check", "-config", path)
    assert code == 1 and "manifest" in err and manifest in err, err
    os.chmod(manifest, 0o600)

    database = str(tmp_path / "store.sqlite")
    assert os.path.isfile(database)
    os.chmod(database, 0o646)
    code, _, err = run_main("check", "-config", path)
    assert code == 1 and "database" in err and database in err, err
    os.chmod(database, 0o600)

    code, _, err = run_main("check", "-config", path)
    assert code == 0, err


@pytest.mark.skipif(not POSIX, reason="POSIX only")
def test_config_refuses_manifest_and_database_of_another_user(tmp_path):
    path = bank_config(tmp_path)
    pin(path)
    code, _, err = run_main("check", "-config", path)
    assert code == 0, err
    manifest, database = str(tmp_path / "pins.json"), str(tmp_path / "store.sqlite")
    try:
        os.chown(manifest, 65534, -1)
    except PermissionError:
        pytest.skip("cannot give a file to another user (not root)")
    code, _, err = run_main("check", "-config", path)
    assert code == 1 and "manifest" in err and manifest in err and "65534" in err, err
    os.chown(manifest, os.getuid(), -1)

    for name in (database, database + "-wal", database + "-shm"):
        if os.path.exists(name):
            os.chown(name, 65534, -1)
    code, _, err = run_main("check", "-config", path)
    assert code == 1 and "database" in err and database in err, err


# ---- rows 45 and 46: the reach check ----

def _reach_config(directory, args, skip=False, name="proxy.json", **fields) -> str:
    """A configuration in ``directory`` whose one stdio server takes ``args``."""
    entry = server(command=[sys.executable, FAKE_SERVER, *args], manifest="m.json",
                   skip_path_check=skip or None, **fields)
    return write(os.path.join(str(directory), name), config_doc(servers=[entry]))


def _refusal(path: str) -> str:
    cfg = ap.load_config(path)
    with pytest.raises(ap.ConfigError) as info:
        ap.check_reach(cfg)
    return str(info.value)


def test_config_refuses_a_server_that_reaches_the_proxys_files(tmp_path):
    d = tmp_path / "proxy"
    d.mkdir()
    elsewhere = tmp_path / "sandbox"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(d)
    cfg_path = str(d / "proxy.json")
    db = str(d / "runs.db")
    refused = [str(d), str(d) + "/", str(link), str(link) + "/", f"--root={d}", str(tmp_path),
               db, "/", cfg_path, str(d / "m.json"), f"{d}/../proxy", f"--db={db}"]
    for arg in refused:
        path = _reach_config(d, [arg])
        msg = _refusal(path)
        assert "skip_path_check" in msg, msg
        assert json.dumps(arg) in msg or arg in msg, f"the argument is not named: {msg}"
        assert re.search(re.escape(str(d)) + r"/(proxy\.json|runs\.db|m\.json)", msg), msg
        assert '"bank"' in msg

    for args in ([str(elsewhere), "--flag", "not-a-path"], [f"--root={elsewhere}"], []):
        ap.check_reach(ap.load_config(_reach_config(d, args)))
    ap.check_reach(ap.load_config(_reach_config(d, [str(d), "/"], skip=True)))

    # The database, once it exists, and a hard link to the configuration are refused too.
    open(db, "wb").close()
    os.chmod(db, 0o600)
    assert "skip_path_check" in _refusal(_reach_config(d, [db]))
    hard = elsewhere / "copy.json"
    _reach_config(d, [str(hard)])
    os.link(cfg_path, hard)
    assert "skip_path_check" in _refusal(cfg_path)
    os.unlink(hard)
    os.unlink(db)

    # An endpoint server is not checked: it has no arguments to read.
    write(cfg_path, config_doc(servers=[server(command=None, endpoint=f"http://127.0.0.1:9{d}")]))
    ap.check_reach(ap.load_config(cfg_path))

    # Pin, serving and check refuse at open, before any server is started.
    bank = bank_config(tmp_path / "served")
    doc = json.loads(open(bank).read())
    doc["servers"][0]["command"].append(str(tmp_path / "served"))
    write(bank, doc)
    code, out, err = run_main("pin", "-config", bank)
    assert code == 1 and "skip_path_check" in err and "pinned" not in out, err
    assert not os.path.exists(tmp_path / "served" / "pins.json")
    doc["servers"][0]["skip_path_check"] = True
    write(bank, doc)
    pin(bank)
    del doc["servers"][0]["skip_path_check"]
    write(bank, doc)
    code, out, err = run_main("check", "-config", bank)
    assert code == 1 and "skip_path_check" in err, err
    code, out, err = run_main("-config", bank)
    assert code == 1 and "skip_path_check" in err and out == "", err
    assert not os.path.exists(tmp_path / "served" / "store.sqlite")
    doc["servers"][0]["command"][-1] = str(elsewhere)
    write(bank, doc)
    code, out, err = run_main("check", "-config", bank)
    assert code == 0, err
    doc["servers"][0]["command"][-1] = str(tmp_path / "served")
    doc["servers"][0]["skip_path_check"] = True
    write(bank, doc)
    code, out, err = run_main("check", "-config", bank)
    assert code == 0, err


def _case_insensitive(directory) -> bool:
    probe = os.path.join(str(directory), "CaseProbe")
    open(probe, "w").close()
    try:
        return os.path.exists(os.path.join(str(directory), "caseprobe"))
    finally:
        os.unlink(probe)


def test_config_reach_check_reads_common_spellings(tmp_path, monkeypatch):
    home = tmp_path / "home"
    d = home / "proxy"
    d.mkdir(parents=True)
    (home / "sandbox").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    write(d / "proxy.json", config_doc())     # the configuration file exists

    refused = ["~", "~/", "~/proxy", "~/proxy/", "~/proxy/runs.db", f"-r{d}", f"--root:{d}",
               f"file://{d}", f"file://{d}/", f"--root=file://{d}", f"FILE://{d}",
               "--root=~/proxy", "-r~/proxy", f"file://{d}/proxy.json", f"--root:file://{d}",
               f"-rfile://{d}"]
    if _case_insensitive(tmp_path):
        refused.append(str(d).upper())
    for arg in refused:
        msg = _refusal(_reach_config(d, [arg]))
        assert "skip_path_check" in msg, (arg, msg)

    accepted = [str(elsewhere), str(elsewhere) + "/", "~/sandbox", f"--root={elsewhere}",
                f"--root:{elsewhere}", f"-r{elsewhere}", f"file://{elsewhere}",
                f"--root=file://{elsewhere}", "--flag", "not-a-path", "-v", "-p8080",
                "--port=8080", "http://localhost:8080/x", "a:b", "--", "-", "~nobody",
                "~nobody/proxy"]
    path = _reach_config(d, accepted)
    ap.check_reach(ap.load_config(path))
    for arg in accepted:
        ap.check_reach(ap.load_config(_reach_config(d, [arg])))

    # Relative arguments are relative to the configuration's directory, where a stdio server
    # starts, whatever the proxy's own working directory.
    for where in (home, elsewhere, d):
        monkeypatch.chdir(where)
        for arg in (".", "./", "../proxy", "--root=.", "proxy.json", "-r.", "runs.db"):
            assert "skip_path_check" in _refusal(_reach_config(d, [arg])), (where, arg)
        ap.check_reach(ap.load_config(_reach_config(d, ["../sandbox", "--root=../sandbox",
                                                        "sandbox", "proxy"])))


SIDECAR_SPELLINGS = {
    "itself": lambda path, home: path,
    "after =": lambda path, home: f"--wal={path}",
    "after :": lambda path, home: f"--wal:{path}",
    "file URL": lambda path, home: f"file://{path}",
    "file URL after =": lambda path, home: f"--wal=file://{path}",
    "short flag": lambda path, home: f"-w{path}",
    "leading ~": lambda path, home: "~/" + os.path.relpath(path, home),
    "leading ~ after =": lambda path, home: "--wal=~/" + os.path.relpath(path, home),
}


@pytest.mark.parametrize("spelling", sorted(SIDECAR_SPELLINGS))
@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_config_refuses_a_server_that_reaches_the_databases_sidecars(tmp_path, monkeypatch,
                                                                      suffix, spelling):
    """A server that writes the database's WAL, shared memory or journal rewrites committed
    rows, so it may forge an approval: each is refused like the database, in every spelling,
    before it exists (SQLite makes it later) and once it does."""
    home = tmp_path / "home"
    d = home / "proxy"
    d.mkdir(parents=True)
    (home / "sandbox").mkdir()
    monkeypatch.setenv("HOME", str(home))
    spell = SIDECAR_SPELLINGS[spelling]
    sidecar = str(d / "runs.db") + suffix
    arg = spell(sidecar, str(home))
    path = _reach_config(d, [arg])

    msg = _refusal(path)                              # neither the database nor it exists
    assert "skip_path_check" in msg and "runs.db" + suffix in msg, msg
    write(d / "runs.db", b"")
    msg = _refusal(path)                              # the database exists, its sidecar not
    assert "skip_path_check" in msg and "runs.db" + suffix in msg, msg
    write(sidecar, b"")
    msg = _refusal(path)                              # both exist
    assert "skip_path_check" in msg and "runs.db" + suffix in msg, msg

    # A file of the same name elsewhere, and a name that only starts the same, are not it.
    for other in (str(home / "sandbox" / "runs.db") + suffix, sidecar + "x"):
        ap.check_reach(ap.load_config(_reach_config(d, [spell(other, str(home))])))
    ap.check_reach(ap.load_config(_reach_config(d, [arg], skip=True)))


# ---- row 47 ----

def test_config_refuses_what_could_read_two_ways(tmp_path):
    path = str(tmp_path / "proxy.json")
    good = json.dumps(config_doc())
    for what, raw, frag in (
            ("repeated session", good.replace('"session": "test"',
                                              '"session": "test", "session": "prod"'),
             '"session"'),
            ("repeated rule", good.replace('"balance": {', '"pay": {"side_effect": "read_only"},'
                                                          ' "balance": {'), '"pay"'),
    ):
        write(path, raw.encode())
        msg = load_error(path)
        assert "duplicate key" in msg and frag in msg and path in msg, (what, msg)
    write(path, config_doc(lease_ttl="1s"))
    assert "lease_ttl 1s" in load_error(path)
    write(path, _raw(config_doc(max_pending="@N@"), "@N@", "1e-10000000"))
    assert "not usable JSON" in load_error(path)
    write(path, config_doc(lease_ttl="3s"))
    assert ap.load_config(path).lease_ttl == 3

    # A manifest with a repeated key is refused when it is opened.
    bank = bank_config(tmp_path / "bank")
    pin(bank)
    manifest = str(tmp_path / "bank" / "pins.json")
    text = open(manifest).read()
    assert text.count('"server": "bank"') == 1
    write(manifest, text.replace('"server": "bank"', '"server": "bank", "server": "shop"')
          .encode())
    code, out, err = run_main("check", "-config", bank)
    assert code == 1 and "duplicate key" in err and manifest in err, err
    assert not os.path.exists(tmp_path / "bank" / "store.sqlite")

    # A database path that is a symbolic link is refused, never followed.
    pin(bank)
    real = tmp_path / "bank" / "real.sqlite"
    os.symlink(real, tmp_path / "bank" / "store.sqlite")
    code, out, err = run_main("check", "-config", bank)
    assert code == 1 and "symbolic link" in err, err
    assert not os.path.exists(real)
    code, out, err = run_main("recheck", "-config", bank)
    assert code == 1 and "symbolic link" in err, err


# ---- row 49 ----

def _policy_id(tmp_path, doc) -> str:
    return ap.load_config(write(tmp_path / "proxy.json", doc)).policy_id()


def test_config_policy_id_covers_what_the_policy_decides_from(tmp_path):
    base_doc = config_doc(servers=[server(env=["A=1"])])
    base = _policy_id(tmp_path, base_doc)
    assert re.fullmatch(r"agentrt-proxy/sha256:[0-9a-f]{64}", base)

    # Exactly the SHA-256 of the canonical JSON of what the seed names.
    expect = {"policy": DEFAULT_POLICY, "servers": [{"name": "bank", "rules": {
        tool: {"side_effect": rule["side_effect"]} for tool, rule in RULES.items()}}]}
    digest = hashlib.sha256(ap.canonical_json(json.dumps(expect).encode())).hexdigest()
    assert base == "agentrt-proxy/sha256:" + digest

    def variant(change):
        doc = copy.deepcopy(base_doc)
        change(doc)
        return _policy_id(tmp_path, doc)

    def rule(tool):
        return lambda doc: doc["servers"][0]["rules"][tool]

    def set_rule(tool, **fields):
        return lambda doc: doc["servers"][0]["rules"][tool].update(fields)

    def set_server(**fields):
        return lambda doc: doc["servers"][0].update(fields)

    def set_top(**fields):
        return lambda doc: doc.update(fields)

    unchanged = {
        "description": set_rule("pay", description="Pays, in other words."),
        "timeout": set_rule("pay", timeout="20s"),
        "deny": set_rule("pay", deny=["currency"]),
        "rule repeat_window": set_rule("pay", repeat_window="0s"),
        "allow_hint_mismatch": set_rule("pay", allow_hint_mismatch=True),
        "terminal": set_rule("pay", terminal=True),
        "hold": set_top(hold="30s"),
        "session": set_top(session="laptop"),
        "database": set_top(database="/elsewhere/other.db"),
        "repeat_window": set_top(repeat_window="1m"),
        "max_pending": set_top(max_pending=2),
        "approval_ttl": set_top(approval_ttl="1h"),
        "grant_ttl": set_top(grant_ttl="1h"),
        "lease_ttl": set_top(lease_ttl="1m"),
        "status_tool": set_top(status_tool="bank_status"),
        "explicit default": set_top(policy={"remote_mutation": "require_approval",
                                            "read_only": "allow"}),
        "command": set_server(command=["node", "server.js", "/srv"]),
        "endpoint": lambda doc: (doc["servers"][0].pop("command"),
                                 doc["servers"][0].update(endpoint="http://127.0.0.1:8080/mcp")),
        "env": set_server(env=["B=2"], inherit_env=["LANG"]),
        "timeouts": set_server(connect_timeout="5s", default_timeout="3s"),
        "manifest": set_server(manifest="other.json"),
        "skip_path_check": set_server(skip_path_check=True),
        "rule order": lambda doc: doc["servers"][0].update(
            rules=dict(reversed(list(doc["servers"][0]["rules"].items())))),
    }
    for what, change in unchanged.items():
        assert variant(change) == base, what

    changed = {
        "policy": set_top(policy={"remote_mutation": "deny"}),
        "policy read_only": set_top(policy={"read_only": "require_approval"}),
        "class": set_rule("pay", side_effect="destructive"),
        "outcome": set_rule("pay", outcome="allow"),
        "outcome equal to the class's": set_rule("pay", outcome="require_approval"),
        "rename": set_rule("pay", rename="send_money"),
        "rename to the same visible name": set_rule("pay", rename="bank_pay"),
        "fixed": set_rule("pay", fixed={"currency": "EUR"}),
        "server name": set_server(name="shop"),
        "removing a rule": lambda doc: doc["servers"][0]["rules"].pop("refund"),
        "adding a rule": lambda doc: doc["servers"][0]["rules"].update(
            audit={"side_effect": "read_only"}),
        "adding a server": lambda doc: doc["servers"].append(server(name="shop",
                                                                    manifest="s.json")),
    }
    seen = {base}
    for what, change in changed.items():
        got = variant(change)
        assert got != base, what
        assert got not in seen, f"{what} collides with another variant"
        seen.add(got)

    # Fixed values: canonical (key order and spacing do not matter), literals kept.
    a = variant(set_rule("pay", fixed={"meta": {"a": 1, "b": 2}}))
    raw = json.dumps(config_doc(servers=[server(env=["A=1"])]))
    raw = raw.replace('"side_effect": "remote_mutation"',
                      '"side_effect": "remote_mutation", "fixed": {"meta": {"b" : 2,"a":1}}')
    assert _policy_id(tmp_path, raw.encode()) == a
    one = _policy_id(tmp_path, raw.replace('"b" : 2', '"b": 2.0').encode())
    assert one != a

    # The same servers in another order keep the identity (servers are sorted by name).
    two = copy.deepcopy(base_doc)
    two["servers"].append(server(name="aaa", manifest="a.json"))
    three = copy.deepcopy(two)
    three["servers"].reverse()
    assert _policy_id(tmp_path, two) == _policy_id(tmp_path, three) != base


def test_config_errors_are_sanitized(tmp_path):
    """Text from the file is escaped before it reaches the operator's terminal."""
    hostile = "\x1b[2J\u202e"
    for doc in (config_doc(**{hostile: 1}), config_doc(session="a" + hostile),
                config_doc(servers=[server(env=[hostile])]),
                config_doc(status_tool=hostile)):
        path = write(tmp_path / "proxy.json", doc)
        msg = load_error(path)
        assert "\x1b" not in msg and "\u202e" not in msg, msg
        code, out, err = run_main("check", "-config", path)
        assert code == 1 and "\x1b" not in err and "\u202e" not in err


# ---- Configuration, faults found in review ---------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

from proxy_harness import DEFAULT_RULES, ProxyHarness, write_config  # noqa: E402


def test_duration_with_non_ascii_digits_is_refused(tmp_path):
    """0a2b80f: durations were matched with \\d, which takes any Unicode digit, so a rule's
    timeout of "\\uff11\\uff10s" (full-width digits) was read as 10 s. Durations take ASCII
    digits only."""
    for text in ("\uff11\uff10s", "\u0661\u0660s", "1\u0660m"):
        with pytest.raises(ValueError):
            ap.parse_duration(text)
    path = write_config(str(tmp_path), {"balance": {"side_effect": "read_only",
                                                    "timeout": "\uff11\uff10s"}})
    with pytest.raises(ap.ConfigError):
        ap.load_config(path)


def _command(*argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, err.getvalue()


def test_stdio_server_whose_arguments_reach_the_database_is_refused(tmp_path):
    """d891c0c (reach check): a stdio server started with an argument naming the directory
    that holds the configuration, the manifest and the database could rewrite the policy
    or forge an approval; serving and checking refuse such a configuration (proxy-seed.md,
    "What it is and is not")."""
    path = write_config(str(tmp_path))
    assert _command("pin", "-config", path)[0] == 0
    assert _command("check", "-config", path)[0] == 0
    with open(path) as f:
        doc = json.load(f)
    doc["servers"][0]["command"].append(f"--root={tmp_path}")
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)
    code, err = _command("check", "-config", path)
    assert code != 0 and "reaches" in err, (code, err)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the database to another user")
def test_database_owned_by_another_user_is_refused(tmp_path):
    """d891c0c (database owner check): a database another user owns (who could forge
    approvals in it) was served from; check and serve refuse it."""
    path = write_config(str(tmp_path))
    assert _command("pin", "-config", path)[0] == 0
    assert _command("check", "-config", path)[0] == 0
    os.chown(tmp_path / "runs.db", 65534, 65534)
    code, err = _command("check", "-config", path)
    assert code != 0 and "owned by uid 65534" in err, (code, err)


def test_policy_decisions_record_the_configurations_policy_identity(tmp_path):
    """d891c0c (policy identity): the proxy's decisions recorded no identity of the policy
    that made them. Each records agentrt-proxy/sha256:<hex> of what the policy decides from
    (proxy-seed.md, "The policy's identity"): a rule's timeout leaves it unchanged, a rule's
    side effect changes it."""
    h = ProxyHarness(tmp_path)
    try:
        h.call("bank_balance", {"account": "A-1"})
        run = h.runs()[-1]
        policy = [json.loads(e[5]) for e in h.store.list_events(run.id)
                  if e[4] == "step.policy"]
    finally:
        h.close()
    assert policy and all(re.fullmatch(r"agentrt-proxy/sha256:[0-9a-f]{64}",
                                       p.get("policy_id", "")) for p in policy), policy
    recorded = policy[0]["policy_id"]

    def identity(change):
        rules = json.loads(json.dumps(DEFAULT_RULES))
        change(rules)
        sub = tmp_path / f"v{len(os.listdir(tmp_path))}"
        sub.mkdir()
        return ap.load_config(write_config(str(sub), rules)).policy_id()

    assert identity(lambda r: None) == recorded
    assert identity(lambda r: r["pay"].update(timeout="99s")) == recorded
    assert identity(lambda r: r["pay"].update(side_effect="destructive")) != recorded


def test_reach_check_reads_an_argument_that_is_no_url_as_a_plain_argument(tmp_path):
    """An argument that looks like a URL with an unclosed IPv6 host ("file://[x") is a plain
    argument to the reach check, not a crash of pin, check or serve."""
    d = tmp_path / "proxy"
    d.mkdir()
    for arg in ("file://[x", "--root=file://[::1"):
        ap.check_reach(ap.load_config(_reach_config(d, [arg])))
