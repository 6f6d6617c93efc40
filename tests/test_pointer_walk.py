"""One JSON Pointer walk (RFC 6901) serves a schema's local $ref and a limit's sum: an array
index with more digits than any index of its array names nothing, and is never converted to
an integer (a digit string past Python's conversion limit would raise ValueError instead of
the refusal a schema or a configuration gets)."""

import pytest

from proxy_harness import ap

LONG_INDEX = "1" + "1" * 5000        # past int()'s default limit of 4,300 digits


def test_a_ref_to_an_index_longer_than_any_is_refused_as_not_resolving():
    raw = ('{"items": [{}], "$ref": "#/items/%s"}' % LONG_INDEX).encode()
    with pytest.raises(ap.SchemaError, match="does not resolve"):
        ap.compile_schema(raw)


def test_a_condition_with_such_a_ref_is_a_configuration_error():
    doc = ap.parse_json(('[{"if": {"items": [{}], "$ref": "#/items/%s"}, "outcome": "deny"}]'
                         % LONG_INDEX).encode())
    with pytest.raises(ap.ConfigError, match="does not resolve"):
        ap.parse_conditions(doc, "t")


def test_a_ref_and_a_sum_still_reach_what_they_name():
    schema = ap.compile_schema(b'{"$defs": {"a": {"prefixItems": [{"type": "integer"}]}}, '
                               b'"$ref": "#/$defs/a/prefixItems/0"}')
    assert schema.test(ap.Num("3"), ap.MAX_SCHEMA_EVALUATIONS)[0]
    assert not schema.test("x", ap.MAX_SCHEMA_EVALUATIONS)[0]
    limit = ap.parse_limits(ap.parse_json(b'[{"sum": "/a~1b/1", "max": 9, "per": "1h"}]'),
                            "t")[0]
    value = ap.parse_json(b'{"a/b": [1, 2.5]}')
    assert ap.counted_value(limit, value) == (ap.to_units(ap.Num("2.5")), "")
    assert ap.counted_value(limit, ap.parse_json(b'{"a/b": [1]}')) == (0, "/a~1b/1 is missing")
    long = ap.parse_limits(ap.parse_json(('[{"sum": "/a/%s", "max": 9, "per": "1h"}]'
                                          % LONG_INDEX).encode()), "t")[0]
    assert ap.counted_value(long, ap.parse_json(b'{"a": [1]}'))[1].endswith("is missing")
