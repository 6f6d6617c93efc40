"""Configuration: the fields a file may give are the records' own, less those the loader
fills in itself (the file's path, the classes its policy names, a server's directory).

Specification: DESIGN.md 8 (field names match exactly); the loader refuses an unknown field at
every level, and a field the loader derives is unknown to the file."""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agentrt_proxy as ap  # noqa: E402

RULE = {"side_effect": "read_only", "timeout": "10s"}


def doc(top: dict | None = None, server: dict | None = None, rule: dict | None = None) -> bytes:
    entry = {"name": "bank", "command": ["true"], "manifest": "m.json",
             "rules": {"balance": {**RULE, **(rule or {})}}, **(server or {})}
    return json.dumps({"database": "runs.db", "session": "test", "servers": [entry],
                       **(top or {})}).encode()


@pytest.mark.parametrize("top, server, field", [
    ({"path": "/etc/other.json"}, None, "path"),
    ({"policy_given": ["read_only"]}, None, "policy_given"),
    (None, {"cwd": "/"}, "cwd"),
])
def test_a_field_the_loader_fills_in_is_unknown_to_the_file(tmp_path, top, server, field):
    with pytest.raises(ap.ConfigError, match=f'unknown field "{field}"'):
        ap.parse_config(doc(top, server), str(tmp_path / "proxy.json"))


@pytest.mark.parametrize("where, field, value", [
    ("top", "status_tool", "other_status"),
    ("server", "skip_path_check", True), ("server", "inherit_env", ["HOME"]),
    ("rule", "allow_hint_mismatch", True), ("rule", "repeat", "ask"),
])
def test_each_field_of_the_records_is_read_from_the_file(tmp_path, where, field, value):
    cfg = ap.parse_config(doc(**{where: {field: value}}), str(tmp_path / "proxy.json"))
    got = {"top": lambda: cfg, "server": lambda: cfg.servers[0],
           "rule": lambda: cfg.servers[0].rule_map["balance"]}[where]()
    assert getattr(got, field) == (tuple(value) if isinstance(value, list) else value)
