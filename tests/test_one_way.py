"""Three things the proxy does one way, each in one function that every caller uses: replacing
a file whole (the manifest, the host's configuration), telling whether a tool drifted from its
pin (loading, drift), and taking empty or null arguments as the empty object (the host's call,
the upstream call)."""

import os
import stat

import pytest

import agentrt_proxy as ap

SCHEMA = b'{"type":"object"}'


def _pin(description: str, schema: bytes) -> ap.PinnedTool:
    return ap.PinnedTool("t", description, schema, ap.sha256_hex(schema),
                         ap.hash_string(description), None)


def test_replace_file_is_whole_or_nothing(tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(b"old")

    def refuse():
        raise ap.ConfigError("changed")
    with pytest.raises(ap.ConfigError):
        ap.replace_file(str(path), b"new", ".x-", 0o640, refuse)
    assert path.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["f.json"]          # no temporary file is left
    ap.replace_file(str(path), b"new", ".x-", 0o640)
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["f.json"]
    ap.write_manifest(str(path), {"server": "s", "tools": {}})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("description, schema, changed", [
    ("d", SCHEMA, []),
    ("other", SCHEMA, ["the description"]),
    ("d", b'{"type":"object","x":1}', ["the input schema"]),
    ("other", b'{"type":"object","x":1}', ["the description", "the input schema"])])
def test_loading_and_drift_ask_one_question(description, schema, changed):
    pin = _pin("d", SCHEMA)
    live = ap.LiveTool("t", description, schema, None)
    assert ap.changed_since_pin(pin, live) == changed
    drift = ap.drift_of({"t": pin}, {"t": live})
    assert drift == ({"t": f"{' and '.join(changed)} changed since the pin"} if changed else {})
    server = ap.ServerConfig("s", default_timeout=5.0)
    rule = ap.Rule(side_effect="read_only")
    if not changed:
        ap._build(server, pin, live, rule, None)
        return
    with pytest.raises(ap.ConfigError) as refused:
        ap._build(server, pin, live, rule, None)
    # The schema is what loading names first when both changed.
    first = "the input schema" if "the input schema" in changed else "the description"
    assert str(refused.value).startswith(f"{first} changed since the pin")


@pytest.mark.parametrize("args, value, want", [
    (b"", ap.NOT_PARSED, (b"{}", {})),
    (b" \n", ap.NOT_PARSED, (b"{}", {})),
    (b"null", None, (b"{}", {})),
    (b" null\t", ap.NOT_PARSED, (b"{}", {})),
    (b' {"a":1} ', {"a": 1}, (b'{"a":1}', {"a": 1})),
    (b" [1] ", ap.NOT_PARSED, (b"[1]", ap.NOT_PARSED)),
    (b"{", ap.NOT_PARSED, (b"{", ap.NOT_PARSED))])
def test_empty_and_null_arguments_are_the_empty_object(args, value, want):
    assert ap.empty_as_object(args, value) == want
