"""A condition's keyword of one JSON type must come with `type` (DESIGN.md section 9, last
bullet): in JSON Schema `maximum` passes every value that is not a number, so
`{"properties": {"amount": {"maximum": 5}}}` alone allows `"amount": "500"` on a server whose
schema takes a string amount. Such a configuration does not load (serve, check, pin and
recheck alike); `format`, an annotation, is refused anywhere in a condition.
"""

import base64
import json
import os
import sys

import pytest

from proxy_harness import ap, write_config

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDER = os.path.join(HERE, "recording_server.py")
WHERE = 'server "bank": tool "pay": when[0]: if: '
NO_TYPE = ('the schema at {at} uses "{key}", which constrains only {kind}s, and has no type: '
           'a value of any other type passes it unchecked; add "type": "{kind}"')
MIXED = ('the schema at {at} uses "{key}", which constrains only {kind}s, but its type {type} '
         'lets a value of type {others} pass it unchecked; make it "type": "{kind}"')
FORMAT = ('the schema at {at} uses "format", which constrains nothing: the validator treats '
          'it as an annotation, so every value passes it; remove it (to check the form of a '
          'string, give "type": "string" and a pattern)')


def rules(cond_if, outcome="allow"):
    return {"pay": {"side_effect": "remote_mutation", "timeout": "10s",
                    "when": [{"if": cond_if, "outcome": outcome}]}}


def load_error(tmp_path, cond_if) -> str:
    """The message load_config refuses ``cond_if`` with, less the file's name before it."""
    path = write_config(str(tmp_path), rules(cond_if))
    with pytest.raises(ap.ConfigError) as exc:
        ap.load_config(path)
    return str(exc.value).replace(f"config {path}: ", "", 1)


def prop(schema, name="x"):
    return {"properties": {name: schema}}


def no_type(key, kind, at="#/properties/x"):
    return NO_TYPE.format(at=at, key=key, kind=kind)


# Each keyword of one type the validator implements, alone in a nested schema object (or
# first: a condition is compiled in its canonical form, its keys sorted).
FAMILIES = {
    "number": [{"maximum": 5}, {"minimum": 5}, {"exclusiveMaximum": 5},
               {"exclusiveMinimum": 5}, {"multipleOf": 5}],
    "string": [{"pattern": "^a"}, {"minLength": 1}, {"maxLength": 3}],
    "array": [{"items": {"type": "number"}}, {"prefixItems": [{"type": "number"}]},
              {"items": [{"type": "number"}], "additionalItems": False},
              {"contains": {"type": "number"}}, {"minItems": 1}, {"maxItems": 3},
              {"uniqueItems": True}, {"minContains": 2}, {"maxContains": 2}],
    "object": [{"properties": {"a": {"type": "number"}}},
               {"patternProperties": {"^a": {"type": "number"}}},
               {"additionalProperties": False}, {"required": ["a"]}, {"minProperties": 1},
               {"maxProperties": 3}, {"propertyNames": {"type": "string"}},
               {"dependentRequired": {"a": ["b"]}},
               {"dependentSchemas": {"a": {"required": ["b"]}}},
               {"dependencies": {"a": ["b"]}}],
}
REFUSED = [pytest.param(prop(schema), no_type(min(schema), kind), id=f"{kind}-{min(schema)}")
           for kind, schemas in FAMILIES.items() for schema in schemas] + [
    pytest.param(prop({"type": "object", "properties": {"amount": {"maximum": 5}}}, "payment"),
                 no_type("maximum", "number", "#/properties/payment/properties/amount"),
                 id="nested-property"),
    pytest.param(prop({"type": "array", "items": {"minimum": 0}}),
                 no_type("minimum", "number", "#/properties/x/items"), id="items"),
    pytest.param(prop({"type": "string", "not": {"pattern": "^m"}}),
                 no_type("pattern", "string", "#/properties/x/not"), id="not"),
    pytest.param({"anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
                 no_type("required", "object", "#/anyOf/0"), id="anyOf-at-the-root"),
    pytest.param(prop({"allOf": [{"type": "number"}, {"maximum": 5}]}),
                 no_type("maximum", "number", "#/properties/x/allOf/1"), id="allOf"),
    pytest.param(prop({"oneOf": [{"type": "number"}, {"maxLength": 2}]}),
                 no_type("maxLength", "string", "#/properties/x/oneOf/1"), id="oneOf"),
    pytest.param({"$defs": {"small": {"maximum": 5}},
                  "properties": {"amount": {"$ref": "#/$defs/small"}}},
                 no_type("maximum", "number", "#/$defs/small"), id="defs"),
    pytest.param(prop({"if": {"type": "number"}, "then": {"maximum": 5}}),
                 no_type("maximum", "number", "#/properties/x/then"), id="then"),
    pytest.param(prop({"type": "number", "if": {"minimum": 0}, "else": {"type": "number"}}),
                 no_type("minimum", "number", "#/properties/x/if"), id="if-inside"),
    pytest.param(prop({"type": "object", "dependentSchemas": {"a": {"maxProperties": 1}}}),
                 no_type("maxProperties", "object", "#/properties/x/dependentSchemas/a"),
                 id="dependentSchemas-subschema"),
    # The root is exempt only as the arguments: named by a $ref, it checks a nested value.
    pytest.param({"properties": {"child": {"$ref": "#"}}},
                 no_type("properties", "object", "#"), id="root-named-by-ref"),
    pytest.param(prop({"type": ["number", "string"], "maximum": 5}),
                 MIXED.format(at="#/properties/x", key="maximum", kind="number",
                              type='["number","string"]', others="string"),
                 id="multi-type"),
    pytest.param(prop({"type": ["integer", "null", "string"], "minimum": 5}),
                 MIXED.format(at="#/properties/x", key="minimum", kind="number",
                              type='["integer","null","string"]', others="null or string"),
                 id="multi-type-two-others"),
    pytest.param(prop({"type": "string", "maximum": 5}),
                 MIXED.format(at="#/properties/x", key="maximum", kind="number",
                              type='"string"', others="string"),
                 id="another-type"),
    pytest.param(prop({"type": "string", "format": "date"}),
                 FORMAT.format(at="#/properties/x"), id="format"),
    pytest.param({"format": "date"}, FORMAT.format(at="#"), id="format-at-the-root"),
    pytest.param(prop({"type": "array", "items": {"type": "string", "format": "email"}}),
                 FORMAT.format(at="#/properties/x/items"), id="format-nested"),
]


@pytest.mark.parametrize("cond_if, reason", REFUSED)
def test_condition_keyword_of_one_type_needs_type(tmp_path, cond_if, reason):
    assert load_error(tmp_path, cond_if) == WHERE + reason


ACCEPTED = [
    # the root of `if` is the arguments, always an object: its object keywords need no type
    {"properties": {"amount": {"type": "number", "maximum": 5}}, "required": ["amount"],
     "additionalProperties": False, "minProperties": 1,
     "propertyNames": {"type": "string", "maxLength": 10}},
    prop({"type": "integer", "maximum": 5, "multipleOf": 1}),
    prop({"type": ["number", "integer"], "exclusiveMinimum": 0}),
    prop({"type": "string", "pattern": "^a", "minLength": 1, "maxLength": 3}),
    prop({"type": "array", "items": {"type": "number", "minimum": 0}, "maxItems": 3,
          "uniqueItems": True, "contains": {"const": 1}, "maxContains": 1}),
    prop({"type": "object", "properties": {"a": {"type": "number", "maximum": 1}},
          "required": ["a"], "dependencies": {"a": {"type": "object", "required": ["b"]}}}),
    prop({"anyOf": [{"type": "number", "maximum": 5}, {"type": "string", "maxLength": 2}]}),
    {"$defs": {"small": {"type": "number", "maximum": 5}},
     "properties": {"amount": {"$ref": "#/$defs/small"}}},
    # keywords that constrain every type need none
    prop({"enum": [1, "a"]}), prop({"const": {"maximum": 5}}), prop({"not": {"const": 3}}),
    # property names that are keywords are names, not keywords
    {"properties": {"format": {"const": "pdf"}, "maximum": {"type": "number", "maximum": 3}},
     "required": ["format"]},
]


@pytest.mark.parametrize("cond_if", ACCEPTED)
def test_condition_with_type_given_or_at_the_root_is_passed_over(tmp_path, cond_if):
    """Each schema object that gives its type, or is the root, is passed over: the one
    error names the untyped property planted beside them."""
    planted = json.loads(json.dumps(cond_if))
    planted["properties"]["zz"] = {"maximum": 5}
    assert load_error(tmp_path, planted) == WHERE + no_type("maximum", "number",
                                                            "#/properties/zz")


def test_condition_without_type_refused_by_check(tmp_path, cli):
    path = write_config(str(tmp_path), rules(prop({"maximum": 5}, "amount")))
    code, out, err = cli("check", "-config", path)
    assert code == 1 and out == ""
    assert WHERE + no_type("maximum", "number", "#/properties/amount") in err


def test_string_amount_no_longer_passes_a_maximum(tmp_path, harnesses):
    """Through a proxy, on a server whose pay takes any amount (recording_server.py): the
    condition that let "500" through cannot be configured, and with its type it allows
    numbers only; a string amount falls to the class's outcome (remote_mutation asks)."""
    log = os.path.join(str(tmp_path), "recorded.log")
    untyped = {"properties": {"amount": {"maximum": 5}}, "required": ["amount"]}
    server = dict(command=[sys.executable, RECORDER], server_env=[f"RECORDING_LOG={log}"])
    with pytest.raises(ap.ConfigError) as exc:
        harnesses("untyped", rules=rules(untyped), **server)
    assert str(exc.value).endswith(": " + WHERE + no_type("maximum", "number", "#/properties/amount"))

    typed = {"properties": {"amount": {"type": "number", "maximum": 5}}, "required": ["amount"]}
    h = harnesses("typed", rules=rules(typed), **server)

    def paid() -> int:
        with open(log, "rb") as f:
            return sum(b'"tools/call"' in base64.b64decode(line) for line in f)
    r = h.call("bank_pay", {"to": "bob", "amount": "500"})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    assert paid() == 0
    r = h.call("bank_pay", {"to": "bob", "amount": 3})
    assert not h.is_error(r) and paid() == 1, h.text(r)
