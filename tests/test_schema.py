"""Section 6 of agentrt_proxy: the JSON Schema validator for MCP tools' inputSchema.

A schema is compiled when its tool loads (``compile_schema(raw_bytes)``): a keyword the
validator does not implement, a reference outside the document, or a malformed keyword value
is refused then with ``SchemaError``. Arguments are checked as raw bytes
(``Schema.check(raw_args_bytes)``): bytes the strict parser refuses raise ``JSONError``; a
mismatch raises ``SchemaError`` whose message lists ``at '<JSON pointer>': <detail>`` joined
by ``"; "``.

Schemas and arguments are written here as JSON text, never built with Python's json, because
the validator judges number literals exactly (1 == 1.0, 0.3 is a multiple of 0.1, 1e10000 is
larger than 10) and Python floats would change the question being asked.

One JSON Pointer walk (RFC 6901) serves a schema's local $ref and a limit's sum: an array
index with more digits than any index of its array names nothing, and is never converted
to an integer.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import agentrt_proxy as ap  # noqa: E402
from agentrt_proxy import JSONError, SchemaError, compile_schema  # noqa: E402


# ---- helpers -------------------------------------------------------------------------------

class StackOverflow(Exception):
    """A RecursionError out of the validator, re-raised without its thousand frames (pytest
    takes half a minute to format those)."""


def _deep(fn, *args):
    try:
        return fn(*args)
    except RecursionError:
        raise StackOverflow("the validator crashed with RecursionError") from None


def _b(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8")


def compiled(schema: str | bytes) -> ap.Schema:
    """Compile a schema that must be accepted."""
    return compile_schema(_b(schema))


def accepted(schema: str | bytes, args: str | bytes):
    """Check arguments that must be accepted; returns what check returned."""
    got = compiled(schema).check(_b(args))
    assert got == ap.parse_json(_b(args)), "check must return the parsed arguments"
    return got


def check_refusal(schema: str | bytes, args: str | bytes) -> str:
    """The message of the SchemaError that checking ``args`` must raise."""
    s = compiled(schema)
    try:
        s.check(_b(args))
    except SchemaError as exc:
        return str(exc)
    raise AssertionError(f"arguments {args!r} were accepted by {schema!r}")


def compile_refusal(schema: str | bytes) -> str:
    """The message of the SchemaError that compiling ``schema`` must raise.
    Any other exception propagates: a crash is not a refusal."""
    try:
        compile_schema(_b(schema))
    except SchemaError as exc:
        return str(exc)
    raise AssertionError(f"schema {schema!r} compiled, but must be refused")


def refused_somewhere(schema: str | bytes, args: str | bytes) -> str:
    """A SchemaError from compiling the schema or from checking ``args``; never acceptance,
    never another exception."""
    try:
        s = compile_schema(_b(schema))
    except SchemaError as exc:
        return str(exc)
    try:
        s.check(_b(args))
    except SchemaError as exc:
        return str(exc)
    raise AssertionError(f"arguments {args!r} were accepted by {schema!r}")


def failures(message: str) -> list[str]:
    return message.split("; ")


def at(pointer: str, detail: str) -> str:
    return f"at '{pointer}': {detail}"


# ---- realistic schemas, as real MCP servers emit them -------------------------------------

# FastMCP / pydantic: title everywhere, $defs with $ref, Optional[...] as anyOf with null,
# defaults, no additionalProperties.
PYDANTIC = r'''{
  "$defs": {
    "Address": {
      "properties": {
        "street": {"title": "Street", "type": "string"},
        "zip": {"anyOf": [{"pattern": "^[0-9]{5}$", "type": "string"}, {"type": "null"}],
                "default": null, "title": "Zip"}
      },
      "required": ["street"],
      "title": "Address",
      "type": "object"
    },
    "Priority": {"enum": ["low", "normal", "high"], "title": "Priority", "type": "string"}
  },
  "properties": {
    "title": {"minLength": 1, "title": "Title", "type": "string"},
    "priority": {"$ref": "#/$defs/Priority", "default": "normal"},
    "address": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": null},
    "tags": {"default": [], "items": {"type": "string"}, "title": "Tags", "type": "array"},
    "count": {"default": 1, "minimum": 1, "title": "Count", "type": "integer"},
    "ratio": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": null, "title": "Ratio"}
  },
  "required": ["title"],
  "title": "create_ticketArguments",
  "type": "object"
}'''

# zod-to-json-schema (the TypeScript SDK): draft-07 $schema, additionalProperties false,
# .positive() as a numeric exclusiveMinimum.
ZOD = r'''{
  "type": "object",
  "properties": {
    "amount": {"type": "number", "exclusiveMinimum": 0},
    "to": {"type": "string", "minLength": 1},
    "memo": {"type": "string", "maxLength": 140},
    "currency": {"type": "string", "enum": ["USD", "EUR"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}
  },
  "required": ["amount", "to", "currency"],
  "additionalProperties": false,
  "$schema": "http://json-schema.org/draft-07/schema#"
}'''

# @modelcontextprotocol/server-filesystem write_file.
WRITE_FILE = ('{"type":"object","properties":{"path":{"type":"string"},"content":{"type":"string"}},'
              '"required":["path","content"],"additionalProperties":false}')

# @modelcontextprotocol/server-filesystem edit_file: an array of objects, so failures are deep.
EDIT_FILE = r'''{
  "type": "object",
  "properties": {
    "path": {"type": "string"},
    "edits": {"type": "array", "items": {
      "type": "object",
      "properties": {
        "oldText": {"type": "string", "description": "Text to search for - must match exactly"},
        "newText": {"type": "string", "description": "Text to replace with"}
      },
      "required": ["oldText", "newText"],
      "additionalProperties": false
    }},
    "dryRun": {"type": "boolean", "default": false, "description": "Preview changes"}
  },
  "required": ["path", "edits"],
  "additionalProperties": false,
  "$schema": "http://json-schema.org/draft-07/schema#"
}'''


@pytest.mark.parametrize("args", [
    '{"title":"Fix the login page"}',
    '{"title":"x","priority":"high","address":{"street":"Main St","zip":"12345"},'
    '"tags":["ui","bug"],"count":3,"ratio":0.5}',
    '{"title":"x","address":null,"ratio":null,"count":2.0}',
    '{"title":"x","address":{"street":"Main St","zip":null}}',
    '{"title":"x","address":{"street":"Main St"}}',
    '{"title":"x","extra":"pydantic emits no additionalProperties, so extra names pass"}',
])
def test_pydantic_schema_accepts(args):
    accepted(PYDANTIC, args)


@pytest.mark.parametrize("args, pointer, detail", [
    ('{}', "", 'missing property "title"'),
    ('{"title":""}', "/title", "minLength: got 0 characters, want 1"),
    ('{"title":5}', "/title", "got integer, want string"),
    ('{"title":"x","priority":"urgent"}', "/priority",
     'value must be one of "low", "normal", "high"'),
    ('{"title":"x","address":{"zip":"12345"}}', "/address", "does not match any schema of anyOf"),
    ('{"title":"x","address":{"street":"s","zip":"1234"}}', "/address",
     "does not match any schema of anyOf"),
    ('{"title":"x","count":0}', "/count", "minimum: got 0, want 1"),
    ('{"title":"x","count":1.5}', "/count", "got number, want integer"),
    ('{"title":"x","tags":["a",2]}', "/tags/1", "got integer, want string"),
    ('{"title":"x","ratio":"0.5"}', "/ratio", "does not match any schema of anyOf"),
    ('[]', "", "got array, want object"),
])
def test_pydantic_schema_refuses(args, pointer, detail):
    assert at(pointer, detail) in check_refusal(PYDANTIC, args)


@pytest.mark.parametrize("args", [
    '{"amount":10,"to":"bob","currency":"USD"}',
    '{"amount":0.01,"to":"b","currency":"EUR","memo":"","tags":[]}',
    '{"amount":1e-10000,"to":"b","currency":"EUR","tags":["a","b","c","d","e"]}',
    '{"currency":"USD","to":"bob","amount":99999999999999999999999999999}',
])
def test_zod_schema_accepts(args):
    accepted(ZOD, args)


@pytest.mark.parametrize("args, pointer, detail", [
    ('{"amount":"10","to":"bob","currency":"USD"}', "/amount", "got string, want number"),
    ('{"amount":10,"currency":"USD"}', "", 'missing property "to"'),
    ('{"amount":0,"to":"bob","currency":"USD"}', "/amount", "exclusiveMinimum: got 0, want 0"),
    ('{"amount":-0.0,"to":"bob","currency":"USD"}', "/amount",
     "exclusiveMinimum: got -0.0, want 0"),
    ('{"amount":-5,"to":"bob","currency":"USD"}', "/amount", "exclusiveMinimum: got -5, want 0"),
    ('{"amount":1,"to":"bob","currency":"USD","y":1}', "", 'additional properties "y" not allowed'),
    ('{"amount":1,"to":"bob","currency":"GBP"}', "/currency", 'value must be one of "USD", "EUR"'),
    ('{"amount":1,"to":"","currency":"USD"}', "/to", "minLength: got 0 characters, want 1"),
    ('{"amount":1,"to":"b","currency":"USD","memo":"' + "m" * 141 + '"}', "/memo",
     "maxLength: got 141 characters, want 140"),
    ('{"amount":1,"to":"b","currency":"USD","tags":["1","2","3","4","5","6"]}', "/tags",
     "maxItems: got 6 items, want 5"),
    ('{"amount":1,"to":"b","currency":"USD","tags":["1",2]}', "/tags/1",
     "got integer, want string"),
    ('{"amount":true,"to":"b","currency":"USD"}', "/amount", "got boolean, want number"),
])
def test_zod_schema_refuses(args, pointer, detail):
    assert at(pointer, detail) in check_refusal(ZOD, args)


def test_zod_schema_lists_every_failure():
    msg = check_refusal(ZOD, '{"amount":"10","y":1}')
    assert sorted(failures(msg)) == sorted([
        at("/amount", "got string, want number"),
        at("", 'additional properties "y" not allowed'),
        at("", 'missing property "to"'),
        at("", 'missing property "currency"'),
    ])


@pytest.mark.parametrize("args", [
    '{"path":"/tmp/notes.txt","content":"hello"}',
    '{"content":"","path":""}',
    '{"path":"/tmp/\u65e5\u672c.txt","content":"line\\nline\\u0000"}',
])
def test_write_file_schema_accepts(args):
    accepted(WRITE_FILE, args)


@pytest.mark.parametrize("args, pointer, detail", [
    ('{"path":"/tmp/a"}', "", 'missing property "content"'),
    ('{}', "", 'missing property "path"'),
    ('{"path":"/tmp/a","content":"x","mode":"0777"}', "", 'additional properties "mode" not allowed'),
    ('{"path":5,"content":"x"}', "/path", "got integer, want string"),
    ('{"path":"/tmp/a","content":null}', "/content", "got null, want string"),
    ('{"path":"/tmp/a","content":["x"]}', "/content", "got array, want string"),
    ('["/tmp/a","x"]', "", "got array, want object"),
    ('"/tmp/a"', "", "got string, want object"),
])
def test_write_file_schema_refuses(args, pointer, detail):
    assert at(pointer, detail) in check_refusal(WRITE_FILE, args)


def test_write_file_schema_empty_args_name_both_missing_properties():
    assert failures(check_refusal(WRITE_FILE, "{}")) == [
        at("", 'missing property "path"'), at("", 'missing property "content"')]


@pytest.mark.parametrize("args, pointer, detail", [
    (None, None, None),
    ('{"path":"a","edits":[{"oldText":"x","newText":5}]}', "/edits/0/newText",
     "got integer, want string"),
    ('{"path":"a","edits":[{"oldText":"x","newText":"y"},{"oldText":"x"}]}', "/edits/1",
     'missing property "newText"'),
    ('{"path":"a","edits":[{"oldText":"x","newText":"y","old":"z"}]}', "/edits/0",
     'additional properties "old" not allowed'),
    ('{"path":"a","edits":[],"dryRun":"yes"}', "/dryRun", "got string, want boolean"),
])
def test_edit_file_schema(args, pointer, detail):
    if args is None:
        accepted(EDIT_FILE, '{"path":"a","edits":[{"oldText":"x","newText":"y"}],"dryRun":true}')
        return
    assert at(pointer, detail) in check_refusal(EDIT_FILE, args)


# ---- a corpus per keyword --------------------------------------------------------------------
# (schema, args, None) when accepted; (schema, args, (pointer, detail)) when refused.

def _ok(schema, args, id_):
    return pytest.param(schema, args, None, id=id_)


def _no(schema, args, pointer, detail, id_):
    return pytest.param(schema, args, (pointer, detail), id=id_)


KEYWORD_CORPUS = [
    # type
    _ok('{"type":"string"}', '"a"', "type-string"),
    _no('{"type":"string"}', "1", "", "got integer, want string", "type-string-int"),
    _ok('{"type":"number"}', "1.5", "type-number"),
    _ok('{"type":"number"}', "7", "type-number-int"),
    _no('{"type":"number"}', '"1"', "", "got string, want number", "type-number-str"),
    _ok('{"type":"integer"}', "7", "type-integer"),
    _ok('{"type":"integer"}', "1.0", "type-integer-1.0"),
    _ok('{"type":"integer"}', "1e2", "type-integer-1e2"),
    _ok('{"type":"integer"}', "1E+2", "type-integer-1E+2"),
    _ok('{"type":"integer"}', "100e-2", "type-integer-100e-2"),
    _ok('{"type":"integer"}', "1.5e1", "type-integer-1.5e1"),
    _ok('{"type":"integer"}', "-0", "type-integer-minus-zero"),
    _no('{"type":"integer"}', "1.5", "", "got number, want integer", "type-integer-1.5"),
    _no('{"type":"integer"}', "1e-2", "", "got number, want integer", "type-integer-1e-2"),
    _no('{"type":"integer"}', "true", "", "got boolean, want integer", "type-integer-bool"),
    _ok('{"type":"boolean"}', "false", "type-boolean"),
    _no('{"type":"boolean"}', "0", "", "got integer, want boolean", "type-boolean-0"),
    _ok('{"type":"null"}', "null", "type-null"),
    _no('{"type":"null"}', "false", "", "got boolean, want null", "type-null-false"),
    _ok('{"type":"object"}', "{}", "type-object"),
    _no('{"type":"object"}', "[]", "", "got array, want object", "type-object-array"),
    _ok('{"type":"array"}', "[]", "type-array"),
    _no('{"type":"array"}', "{}", "", "got object, want array", "type-array-object"),
    _ok('{"type":["string","null"]}', "null", "type-list-null"),
    _ok('{"type":["string","integer"]}', "2.0", "type-list-integer"),
    _no('{"type":["string","integer"]}', "2.5", "", "got number, want string or integer",
        "type-list-refused"),
    # properties
    _ok('{"properties":{"a":{"type":"string"}}}', '{"a":"x","b":1}', "properties"),
    _ok('{"properties":{"a":{"type":"string"}}}', "5", "properties-non-object"),
    _no('{"properties":{"a":{"type":"string"}}}', '{"a":1}', "/a", "got integer, want string",
        "properties-refused"),
    # required
    _ok('{"required":["a"]}', '{"a":null}', "required"),
    _ok('{"required":["a"]}', '"not an object"', "required-non-object"),
    _no('{"required":["a"]}', '{"b":1}', "", 'missing property "a"', "required-missing"),
    # additionalProperties
    _ok('{"properties":{"a":true},"additionalProperties":false}', '{"a":1}', "additional-false"),
    _no('{"properties":{"a":true},"additionalProperties":false}', '{"a":1,"b":2}', "",
        'additional properties "b" not allowed', "additional-false-refused"),
    _no('{"properties":{"a":true},"additionalProperties":false}', '{"b":1,"c":2}', "",
        'additional properties "b", "c" not allowed', "additional-false-two"),
    _ok('{"additionalProperties":{"type":"integer"}}', '{"x":1,"y":2}', "additional-schema"),
    _no('{"additionalProperties":{"type":"integer"}}', '{"x":1,"y":"2"}', "/y",
        "got string, want integer", "additional-schema-refused"),
    _ok('{"additionalProperties":true}', '{"x":1}', "additional-true"),
    # patternProperties
    _ok('{"patternProperties":{"^s_":{"type":"string"}}}', '{"s_a":"x","n":1}', "pattern-props"),
    _no('{"patternProperties":{"^s_":{"type":"string"}}}', '{"s_a":1}', "/s_a",
        "got integer, want string", "pattern-props-refused"),
    _no('{"patternProperties":{"id":{"type":"integer"}}}', '{"user_id_x":"a"}', "/user_id_x",
        "got string, want integer", "pattern-props-unanchored"),
    _no('{"properties":{"s_a":{"minLength":2}},"patternProperties":{"^s_":{"type":"string"}}}',
        '{"s_a":"x"}', "/s_a", "minLength: got 1 characters, want 2",
        "pattern-props-and-properties-both-apply"),
    # items (2020-12 schema form) and prefixItems
    _ok('{"items":{"type":"integer"}}', "[1,2,3]", "items"),
    _ok('{"items":{"type":"integer"}}', '"not an array"', "items-non-array"),
    _no('{"items":{"type":"integer"}}', '[1,"a"]', "/1", "got string, want integer",
        "items-refused"),
    _ok('{"prefixItems":[{"type":"string"},{"type":"integer"}]}', '["a",1,null]', "prefix"),
    _ok('{"prefixItems":[{"type":"string"},{"type":"integer"}]}', '["a"]', "prefix-short"),
    _no('{"prefixItems":[{"type":"string"},{"type":"integer"}]}', '["a","b"]', "/1",
        "got string, want integer", "prefix-refused"),
    _no('{"prefixItems":[{"type":"string"}],"items":{"type":"integer"}}', '["a",1,"c"]', "/2",
        "got string, want integer", "prefix-then-items"),
    _ok('{"prefixItems":[{"type":"string"}],"items":false}', '["a"]', "prefix-items-false"),
    _no('{"prefixItems":[{"type":"string"}],"items":false}', '["a",1]', "",
        "array has 2 items, at most 1 allowed", "prefix-items-false-refused"),
    # draft-07 array-form items with additionalItems
    _ok('{"items":[{"type":"string"},{"type":"integer"}]}', '["a",1,{}]', "tuple"),
    _no('{"items":[{"type":"string"},{"type":"integer"}]}', '[1]', "/0",
        "got integer, want string", "tuple-refused"),
    _no('{"items":[{"type":"string"}],"additionalItems":false}', '["a","b"]', "",
        "array has 2 items, at most 1 allowed", "tuple-additional-false"),
    _no('{"items":[{"type":"string"}],"additionalItems":{"type":"integer"}}', '["a",1,"b"]', "/2",
        "got string, want integer", "tuple-additional-schema"),
    _ok('{"items":{"type":"string"},"additionalItems":false}', '["a","b"]',
        "additionalItems-ignored-without-tuple"),
    # enum
    _ok('{"enum":["a","b"]}', '"b"', "enum"),
    _no('{"enum":["a","b"]}', '"c"', "", 'value must be one of "a", "b"', "enum-refused"),
    _ok('{"enum":[1,"1"]}', "1.0", "enum-number-exact"),
    _no('{"enum":[1]}', "true", "", "value must be one of 1", "enum-bool-is-not-1"),
    _no('{"enum":[0]}', "false", "", "value must be one of 0", "enum-bool-is-not-0"),
    _ok('{"enum":[{"a":1,"b":[1,2]}]}', '{"b":[1.0,2e0],"a":1}', "enum-object-order"),
    _no('{"enum":[[1,2]]}', "[2,1]", "", "value must be one of [1,2]", "enum-array-order"),
    _ok('{"enum":[null]}', "null", "enum-null"),
    # const
    _ok('{"const":1}', "1.0", "const-1.0"),
    _ok('{"const":1}', "1e0", "const-1e0"),
    _ok('{"const":100}', "1E2", "const-1E2"),
    _no('{"const":1}', '"1"', "", "value must be 1", "const-string"),
    _no('{"const":1}', "1.0000000000000000000001", "", "value must be 1", "const-exact"),
    _no('{"const":9007199254740993}', "9007199254740992", "", "value must be 9007199254740993",
        "const-beyond-float"),
    _ok('{"const":{"a":[true,null]}}', '{"a":[true,null]}', "const-object"),
    _no('{"const":{"a":1}}', '{"a":1,"b":2}', "", 'value must be {"a":1}', "const-object-extra"),
    # minimum / maximum / exclusive bounds (2020-12 numeric form)
    _ok('{"minimum":5}', "5", "minimum-equal"),
    _no('{"minimum":5}', "4.999", "", "minimum: got 4.999, want 5", "minimum-refused"),
    _ok('{"maximum":10}', "10.0", "maximum-equal"),
    _no('{"maximum":10}', "10.5", "", "maximum: got 10.5, want 10", "maximum-refused"),
    _no('{"maximum":0.3}', "0.30000000000000001", "", "maximum: got 0.30000000000000001, want 0.3",
        "maximum-exact-not-float"),
    _ok('{"exclusiveMinimum":5}', "5.0000001", "exclusiveMinimum"),
    _no('{"exclusiveMinimum":5}', "5", "", "exclusiveMinimum: got 5, want 5",
        "exclusiveMinimum-refused"),
    _no('{"exclusiveMinimum":5}', "5.0", "", "exclusiveMinimum: got 5.0, want 5",
        "exclusiveMinimum-5.0"),
    _ok('{"exclusiveMaximum":5}', "4.9", "exclusiveMaximum"),
    _no('{"exclusiveMaximum":5}', "5", "", "exclusiveMaximum: got 5, want 5",
        "exclusiveMaximum-refused"),
    _ok('{"minimum":1,"maximum":3}', '"strings are not bounded"', "bounds-non-number"),
    # draft-04 boolean form
    _ok('{"minimum":5,"exclusiveMinimum":true}', "6", "draft04-exclusiveMinimum"),
    _no('{"minimum":5,"exclusiveMinimum":true}', "5", "", "exclusiveMinimum: got 5, want 5",
        "draft04-exclusiveMinimum-refused"),
    _ok('{"minimum":5,"exclusiveMinimum":false}', "5", "draft04-exclusiveMinimum-false"),
    _no('{"minimum":5,"exclusiveMinimum":false}', "4", "", "minimum: got 4, want 5",
        "draft04-exclusiveMinimum-false-refused"),
    _no('{"exclusiveMaximum":true,"maximum":5}', "5", "", "exclusiveMaximum: got 5, want 5",
        "draft04-exclusiveMaximum-refused"),
    _ok('{"maximum":5,"exclusiveMaximum":false}', "5", "draft04-exclusiveMaximum-false"),
    # multipleOf
    _ok('{"multipleOf":0.1}', "0.3", "multipleOf-0.3-of-0.1"),
    _ok('{"multipleOf":0.01}', "19.99", "multipleOf-money"),
    _no('{"multipleOf":0.1}', "0.35", "", "multipleOf: got 0.35, want a multiple of 0.1",
        "multipleOf-refused"),
    _ok('{"multipleOf":4}', "1e2", "multipleOf-1e2"),
    _no('{"multipleOf":2}', "7", "", "multipleOf: got 7, want a multiple of 2",
        "multipleOf-odd"),
    _ok('{"multipleOf":1.5}', "-4.5", "multipleOf-negative-value"),
    # minLength / maxLength, in code points
    _ok('{"minLength":2,"maxLength":2}', '"ab"', "length"),
    _no('{"minLength":2}', '"a"', "", "minLength: got 1 characters, want 2", "minLength"),
    _no('{"minLength":2}', '"\u00e9"', "", "minLength: got 1 characters, want 2",
        "minLength-two-bytes"),
    _ok('{"maxLength":1}', '"\U0001f600"', "maxLength-four-bytes"),
    _ok('{"maxLength":1}', r'"\ud83d\ude00"', "maxLength-surrogate-pair-escape"),
    _no('{"maxLength":1}', '"ab"', "", "maxLength: got 2 characters, want 1", "maxLength"),
    _ok('{"minLength":5}', "5", "length-non-string"),
    # pattern, an unanchored search
    _ok('{"pattern":"[0-9]"}', '"ab1c"', "pattern-unanchored"),
    _no('{"pattern":"[0-9]"}', '"abc"', "", 'does not match pattern "[0-9]"', "pattern-refused"),
    _ok('{"pattern":"^[a-z]+$"}', '"abc"', "pattern-anchored"),
    _no('{"pattern":"^[a-z]+$"}', '"abc1"', "", 'does not match pattern "^[a-z]+$"',
        "pattern-anchored-refused"),
    _ok('{"pattern":"^x"}', "1", "pattern-non-string"),
    # minItems / maxItems
    _ok('{"minItems":1,"maxItems":2}', "[1,2]", "items-count"),
    _no('{"minItems":2}', "[1]", "", "minItems: got 1 items, want 2", "minItems"),
    _no('{"maxItems":2}', "[1,2,3]", "", "maxItems: got 3 items, want 2", "maxItems"),
    # uniqueItems
    _ok('{"uniqueItems":true}', '[1,"1",true,null,[1],{"a":1}]', "unique"),
    _ok('{"uniqueItems":true}', "[1,true]", "unique-1-true"),
    _ok('{"uniqueItems":true}', "[0,false]", "unique-0-false"),
    _no('{"uniqueItems":true}', "[1,1.0]", "/1", "uniqueItems: a repeated item", "unique-1-1.0"),
    _no('{"uniqueItems":true}', "[[1],[1e0]]", "/1", "uniqueItems: a repeated item",
        "unique-nested-arrays"),
    _no('{"uniqueItems":true}', '["a","b","a"]', "/2", "uniqueItems: a repeated item",
        "unique-strings"),
    _ok('{"uniqueItems":false}', "[1,1]", "unique-false"),
    # minProperties / maxProperties
    _ok('{"minProperties":1,"maxProperties":1}', '{"a":1}', "properties-count"),
    _no('{"minProperties":1}', "{}", "", "minProperties: got 0 properties, want 1",
        "minProperties"),
    _no('{"maxProperties":1}', '{"a":1,"b":2}', "", "maxProperties: got 2 properties, want 1",
        "maxProperties"),
    # allOf / anyOf / oneOf / not
    _ok('{"allOf":[{"type":"integer"},{"minimum":3}]}', "3", "allOf"),
    _no('{"allOf":[{"type":"integer"},{"minimum":3}]}', "2", "", "minimum: got 2, want 3",
        "allOf-refused"),
    _ok('{"anyOf":[{"type":"string"},{"type":"null"}]}', "null", "anyOf"),
    _no('{"anyOf":[{"type":"string"},{"type":"null"}]}', "5", "",
        "does not match any schema of anyOf", "anyOf-refused"),
    _ok('{"oneOf":[{"type":"integer"},{"minimum":0}]}', "-1", "oneOf"),
    _no('{"oneOf":[{"type":"integer"},{"minimum":0}]}', "5", "",
        "matches 2 schemas of oneOf, want exactly one", "oneOf-two"),
    _no('{"oneOf":[{"type":"string"},{"type":"null"}]}', "5", "",
        "matches 0 schemas of oneOf, want exactly one", "oneOf-none"),
    _ok('{"not":{"type":"string"}}', "5", "not"),
    _no('{"not":{"type":"string"}}', '"a"', "", "matches a schema it must not match",
        "not-refused"),
    # if / then / else
    _ok('{"if":{"type":"string"},"then":{"minLength":2}}', '"ab"', "if-then"),
    _no('{"if":{"type":"string"},"then":{"minLength":2}}', '"a"', "",
        "minLength: got 1 characters, want 2", "if-then-refused"),
    _ok('{"if":{"type":"string"},"then":{"minLength":2}}', "1", "if-without-else"),
    _ok('{"then":false,"else":false}', "1", "then-else-without-if"),
    # $ref with $defs and definitions
    _ok('{"$defs":{"pos":{"type":"integer","minimum":1}},"properties":{"n":{"$ref":"#/$defs/pos"}}}',
        '{"n":1}', "ref-defs"),
    _no('{"$defs":{"pos":{"type":"integer","minimum":1}},"properties":{"n":{"$ref":"#/$defs/pos"}}}',
        '{"n":0}', "/n", "minimum: got 0, want 1", "ref-defs-refused"),
    _no('{"definitions":{"s":{"type":"string"}},"items":{"$ref":"#/definitions/s"}}', '["a",1]',
        "/1", "got integer, want string", "ref-definitions"),
    _no('{"$defs":{"a/b":{"type":"string"}},"$ref":"#/$defs/a~1b"}', "1", "",
        "got integer, want string", "ref-escape-slash"),
    _no('{"$defs":{"c~d":{"type":"string"}},"$ref":"#/$defs/c~0d"}', "1", "",
        "got integer, want string", "ref-escape-tilde"),
    _no('{"$defs":{"a~1b":{"type":"string"},"a/b":{"type":"integer"}},"$ref":"#/$defs/a~01b"}',
        "1", "", "got integer, want string", "ref-escape-order"),
    _no('{"$defs":{"a b":{"type":"string"}},"$ref":"#/$defs/a%20b"}', "1", "",
        "got integer, want string", "ref-percent-escape"),
    _no('{"prefixItems":[{"type":"string"}],"items":{"$ref":"#/prefixItems/0"}}', '["a",1]', "/1",
        "got integer, want string", "ref-into-array"),
    _no('{"type":"object","properties":{"child":{"$ref":"#"}},"additionalProperties":false}',
        '{"child":{"child":{"x":1}}}', "/child/child", 'additional properties "x" not allowed',
        "ref-root-recursion"),
    _ok('{"type":"object","properties":{"child":{"$ref":"#"}},"additionalProperties":false}',
        '{"child":{"child":{}}}', "ref-root-recursion-ok"),
    # boolean schemas
    _ok("true", '{"anything":[1,"2",null]}', "bool-true"),
    _no("false", "{}", "", "no value is allowed here", "bool-false"),
    _no('{"properties":{"a":false}}', '{"a":1}', "/a", "no value is allowed here",
        "bool-false-property"),
    _ok('{"properties":{"a":false}}', '{"b":1}', "bool-false-property-absent"),
    # propertyNames
    _ok('{"propertyNames":{"pattern":"^[a-z]+$"}}', '{"ab":1}', "propertyNames"),
    _no('{"propertyNames":{"pattern":"^[a-z]+$"}}', '{"ab":1,"Ab":2}', "",
        'property name "Ab" is not allowed', "propertyNames-refused"),
    _no('{"propertyNames":{"maxLength":3}}', '{"long_name":1}', "",
        'property name "long_name" is not allowed', "propertyNames-maxLength"),
    # contains / minContains / maxContains
    _ok('{"contains":{"type":"integer"}}', '["a",1]', "contains"),
    _no('{"contains":{"type":"integer"}}', '["a"]', "", "contains: 0 items match, want at least 1",
        "contains-refused"),
    _no('{"contains":{"type":"integer"},"minContains":2}', '["a",1]', "",
        "contains: 1 items match, want at least 2", "minContains"),
    _no('{"contains":{"type":"integer"},"maxContains":1}', "[1,2]", "",
        "contains: 2 items match, want at most 1", "maxContains"),
    _ok('{"contains":{"type":"integer"},"minContains":0}', "[]", "minContains-0"),
    # dependentRequired / dependencies / dependentSchemas
    _ok('{"dependentRequired":{"card":["cvv"]}}', "{}", "dependentRequired-absent"),
    _ok('{"dependentRequired":{"card":["cvv"]}}', '{"card":1,"cvv":2}', "dependentRequired"),
    _no('{"dependentRequired":{"card":["cvv"]}}', '{"card":1}', "",
        'property "cvv" is required with "card"', "dependentRequired-refused"),
    _no('{"dependencies":{"card":["cvv"]}}', '{"card":1}', "",
        'property "cvv" is required with "card"', "dependencies-array"),
    _no('{"dependencies":{"card":{"required":["cvv"]}}}', '{"card":1}', "",
        'missing property "cvv"', "dependencies-schema"),
    _no('{"dependentSchemas":{"card":{"properties":{"cvv":{"type":"string"}}}}}',
        '{"card":1,"cvv":123}', "/cvv", "got integer, want string", "dependentSchemas"),
    # annotations are ignored
    _ok('{"$schema":"https://json-schema.org/draft/2020-12/schema","$comment":"c","title":"t",'
        '"description":"d","default":5,"examples":[5],"format":"email","readOnly":true,'
        '"writeOnly":true,"deprecated":true,"type":"string"}', '"not an email"', "annotations"),
]


@pytest.mark.parametrize("schema, args, refusal", KEYWORD_CORPUS)
def test_keyword_corpus(schema, args, refusal):
    if refusal is None:
        accepted(schema, args)
        return
    pointer, detail = refusal
    assert at(pointer, detail) in failures(check_refusal(schema, args))


# ---- refused schemas -------------------------------------------------------------------------

NOT_IMPLEMENTED = "a keyword this validator does not implement"
OUTSIDE = "is outside the schema; only references within the schema are resolved"

REFUSED_SCHEMAS = [
    # keywords the validator does not implement
    ('{"type":"string","nullable":true}', f'schema at # uses "nullable", {NOT_IMPLEMENTED}'),
    ('{"unevaluatedProperties":false}', f'uses "unevaluatedProperties", {NOT_IMPLEMENTED}'),
    ('{"unevaluatedItems":false}', f'uses "unevaluatedItems", {NOT_IMPLEMENTED}'),
    ('{"$dynamicRef":"#meta"}', f'uses "$dynamicRef", {NOT_IMPLEMENTED}'),
    ('{"$recursiveRef":"#"}', f'uses "$recursiveRef", {NOT_IMPLEMENTED}'),
    ('{"$anchor":"a"}', f'uses "$anchor", {NOT_IMPLEMENTED}'),
    ('{"x-custom":1}', f'uses "x-custom", {NOT_IMPLEMENTED}'),
    ('{"discriminator":{"propertyName":"kind"}}', f'uses "discriminator", {NOT_IMPLEMENTED}'),
    ('{"properties":{"a":{"type":"string","nullable":true}}}',
     f'schema at #/properties/a uses "nullable", {NOT_IMPLEMENTED}'),
    ('{"properties":{"a/b~c":{"x-y":1}}}',
     f'schema at #/properties/a~1b~0c uses "x-y", {NOT_IMPLEMENTED}'),
    ('{"$defs":{"unused":{"nullable":true}}}',
     f'schema at #/$defs/unused uses "nullable", {NOT_IMPLEMENTED}'),
    ('{"anyOf":[true,{"nullable":true}]}', 'schema at #/anyOf/1 uses "nullable"'),
    ('{"items":[true,{"x-custom":1}]}', 'schema at #/items/1 uses "x-custom"'),
    # references outside the document, or nowhere
    ('{"$ref":"http://example.com/schema.json"}',
     f'$ref "http://example.com/schema.json" {OUTSIDE}'),
    ('{"$ref":"other.json#/x"}', f'$ref "other.json#/x" {OUTSIDE}'),
    ('{"$ref":"file:///etc/passwd"}', f'$ref "file:///etc/passwd" {OUTSIDE}'),
    ('{"properties":{"a":{"$ref":"https://evil.example/a.json#"}}}',
     f'$ref "https://evil.example/a.json#" {OUTSIDE}'),
    ('{"$defs":{"unused":{"$ref":"other.json"}}}', f'$ref "other.json" {OUTSIDE}'),
    ('{"$ref":"#/$defs/missing","$defs":{}}', '$ref "#/$defs/missing" does not resolve'),
    ('{"$ref":"#/definitions/a"}', '$ref "#/definitions/a" does not resolve'),
    ('{"$defs":{"a~b":true},"$ref":"#/$defs/a~1b"}', '$ref "#/$defs/a~1b" does not resolve'),
    ('{"allOf":[true],"$ref":"#/allOf/1"}', '$ref "#/allOf/1" does not resolve'),
    ('{"$ref":"#anchor"}', '$ref "#anchor" is not a JSON pointer'),
    ('{"$ref":5}', "#/$ref is not a string"),
    # patterns that do not compile
    ('{"pattern":"("}', "#/pattern: pattern does not compile"),
    ('{"properties":{"a":{"pattern":"[a-"}}}', "#/properties/a/pattern: pattern does not compile"),
    ('{"patternProperties":{"(":true}}', "#/patternProperties: pattern does not compile"),
    ('{"pattern":5}', "#/pattern is not a string"),
    # malformed keyword values
    ('{"type":"str"}', "#/type names a type that does not exist"),
    ('{"type":"int"}', "#/type names a type that does not exist"),
    ('{"type":["string","int"]}', "#/type names a type that does not exist"),
    ('{"type":[]}', "#/type names a type that does not exist"),
    ('{"type":5}', "#/type names a type that does not exist"),
    ('{"required":"a"}', "#/required is not an array of strings"),
    ('{"required":["a",1]}', "#/required is not an array of strings"),
    ('{"multipleOf":0}', "#/multipleOf is not a positive number"),
    ('{"multipleOf":0.0}', "#/multipleOf is not a positive number"),
    ('{"multipleOf":-1}', "#/multipleOf is not a positive number"),
    ('{"multipleOf":"2"}', "#/multipleOf is not a positive number"),
    ('{"minimum":"5"}', "#/minimum is not a number"),
    ('{"maximum":true}', "#/maximum is not a number"),
    ('{"exclusiveMinimum":"0"}', "#/exclusiveMinimum is not a number"),
    ('{"minLength":-1}', "#/minLength is not a non-negative integer"),
    ('{"minLength":1.5}', "#/minLength is not a non-negative integer"),
    ('{"properties":{"path":{"minLength":"two"}}}',
     "#/properties/path/minLength is not a non-negative integer"),
    ('{"maxItems":true}', "#/maxItems is not a non-negative integer"),
    ('{"minContains":-2}', "#/minContains is not a non-negative integer"),
    ('{"enum":"a"}', "#/enum is not an array"),
    ('{"uniqueItems":"yes"}', "#/uniqueItems is not a boolean"),
    ('{"allOf":[]}', "#/allOf is not a non-empty array of schemas"),
    ('{"anyOf":{}}', "#/anyOf is not a non-empty array of schemas"),
    ('{"oneOf":[true,5]}', "schema at #/oneOf/1 is not an object or boolean"),
    ('{"properties":[]}', "#/properties is not an object"),
    ('{"properties":{"a":5}}', "schema at #/properties/a is not an object or boolean"),
    ('{"properties":{"a":"string"}}', "schema at #/properties/a is not an object or boolean"),
    ('{"items":"string"}', "schema at #/items is not an object or boolean"),
    ('{"not":null}', "schema at #/not is not an object or boolean"),
    ('{"additionalProperties":"no"}', "schema at #/additionalProperties is not an object or boolean"),
    ('{"dependentRequired":{"a":"b"}}', "#/dependentRequired/a is not an array of strings"),
    ('{"dependencies":{"a":5}}', "schema at #/dependencies/a is not an object or boolean"),
    # a nested $id
    ('{"properties":{"a":{"$id":"https://evil.example/","type":"string"}}}',
     "#/properties/a/$id: an $id inside the schema is not supported"),
    ('{"$defs":{"a":{"$id":"a.json"}}}', "an $id inside the schema is not supported"),
    # not an object or boolean schema, or not JSON
    ("[]", "input schema is not an object"),
    ('"object"', "input schema is not an object"),
    ("5", "input schema is not an object"),
    ("null", "input schema is not an object"),
    ("{", "input schema is not JSON"),
    ('{"type":"object",}', "input schema is not JSON"),
    ('{"maximum":1e10001}', "input schema is not JSON"),
]


@pytest.mark.parametrize("schema, reason", REFUSED_SCHEMAS, ids=[s for s, _ in REFUSED_SCHEMAS])
def test_refused_schema(schema, reason):
    assert reason in compile_refusal(schema)


@pytest.mark.parametrize("schema", [
    '{"$id":"https://example.com/tool.json","type":"object"}',
    '{"$schema":"http://json-schema.org/draft-07/schema#","definitions":{"a":true}}',
    '{"properties":{"$id":{"type":"string"},"nullable":{"type":"boolean"},"$ref":true}}',
    '{"const":{"nullable":true,"$ref":"http://x"},"enum":[{"x-custom":1}]}',
    '{"default":{"$id":"x"},"examples":[{"$ref":5}]}',
    '{"minLength":1.0,"maxLength":1e2,"minimum":-1e-5,"multipleOf":1e-300}',
    "true",
    "false",
    "{}",
])
def test_accepted_schema(schema):
    s = compiled(schema)
    assert isinstance(s, ap.Schema)


# Refusals the code does not make: each compiles, or crashes, where the specification demands
# SchemaError ("a malformed keyword value ... is refused when compiled", "an unresolvable local
# $ref ... is refused", "nothing is ever passed silently").
@pytest.mark.parametrize("schema", [
    pytest.param('{"type":{"a":1}}', id="type-object-value"),
    pytest.param('{"type":["string",[]]}', id="type-list-in-list"),
    pytest.param('{"allOf":[true,true,true],"$ref":"#/allOf/\u00b2"}', id="ref-superscript-index"),
    pytest.param('{"allOf":[{"type":"string"},{"type":"integer"}],"$ref":"#/allOf/\u0661"}',
                 id="ref-arabic-index"),
    pytest.param('{"allOf":[{"type":"string"},{"type":"integer"}],"$ref":"#/allOf/01"}',
                 id="ref-leading-zero-index"),
    pytest.param('{"required":["a"],"$ref":"#/required"}', id="ref-to-required"),
    pytest.param('{"$defs":{"a":{"type":"string"}},"$ref":"#/$defs"}', id="ref-to-defs-map"),
    pytest.param('{"default":{"nullable":true,"x-custom":1},"$ref":"#/default"}',
                 id="ref-to-default"),
    pytest.param('{"properties":{"a":{"type":"string"},"b":{"$ref":"#/properties/a/type"}}}',
                 id="ref-to-string"),
])
def test_refused_schema_without_a_crash(schema):
    assert compile_refusal(schema)


@pytest.mark.parametrize("schema, args", [
    pytest.param('{"required":["a"],"properties":{"x":{"$ref":"#/required"}}}', '{"x":1}',
                 id="ref-to-required"),
    pytest.param('{"$defs":{"a":{"type":"string"}},"$ref":"#/$defs"}', "5", id="ref-to-defs-map"),
])
def test_reference_to_a_non_schema_is_never_accepted_or_a_crash(schema, args):
    # Either stage may refuse; what is demanded is a SchemaError, never acceptance, never a crash.
    refused_somewhere(schema, args)


def test_ref_percent_encoded_utf8_resolves():
    schema = '{"$defs":{"caf\u00e9":{"type":"string"}},"$ref":"#/$defs/caf%C3%A9"}'
    assert at("", "got integer, want string") in check_refusal(schema, "5")


def test_ref_raw_non_ascii_resolves():
    schema = '{"$defs":{"caf\u00e9":{"type":"string"}},"$ref":"#/$defs/caf\u00e9"}'
    assert at("", "got integer, want string") in check_refusal(schema, "5")


# ---- $ref cycles that consume no input ---------------------------------------------------------



@pytest.mark.parametrize("schema, args", [
    pytest.param('{"$ref":"#"}', "{}", id="self"),
    pytest.param('{"$ref":"#"}', "5", id="self-scalar"),
    pytest.param('{"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"}',
                 "{}", id="mutual"),
    pytest.param('{"$defs":{"a":{"$ref":"#/$defs/a"}},"properties":{"x":{"$ref":"#/$defs/a"}}}',
                 '{"x":1}', id="self-under-property"),
    pytest.param('{"allOf":[{"$ref":"#"}]}', "{}", id="allOf"),
    pytest.param('{"anyOf":[{"$ref":"#"}]}', "{}", id="anyOf"),
    pytest.param('{"type":"object","$ref":"#"}', "{}", id="self-with-sibling"),
    pytest.param('{"not":{"$ref":"#"}}', "{}", id="not"),
    pytest.param('{"oneOf":[{"$ref":"#"},true]}', "{}", id="oneOf"),
    pytest.param('{"anyOf":[{"$ref":"#"},true]}', "{}", id="anyOf-with-true"),
    pytest.param('{"if":{"$ref":"#"},"else":true}', "{}", id="if"),
])
def test_ref_cycle_without_input_is_refused(schema, args):
    refused_somewhere(schema, args)


def test_ref_cycle_message_names_the_cycle():
    msg = refused_somewhere('{"$ref":"#"}', "{}")
    assert "refers to itself" in msg or "cycle" in msg or "without end" in msg


@pytest.mark.parametrize("args", [
    '{"child":{"child":{"child":{}}}}',
    '{"children":[{"children":[]},{"children":[{"children":[]}]}]}',
])
def test_recursion_that_consumes_input_is_accepted(args):
    schema = ('{"type":"object","properties":{"child":{"$ref":"#"},'
              '"children":{"type":"array","items":{"$ref":"#"}}},"additionalProperties":false}')
    accepted(schema, args)


RECURSIVE_ARRAY = '{"type":"array","items":{"$ref":"#"}}'


def test_deep_recursive_input_is_not_a_crash():
    depth = ap.MAX_DEPTH
    args = "[" * depth + "]" * depth
    try:
        got = _deep(compiled(RECURSIVE_ARRAY).check, _b(args))
    except SchemaError:
        return  # a refusal is acceptable; a crash is not
    assert got == ap.parse_json(_b(args))


def test_deep_recursive_invalid_input_is_refused():
    depth = ap.MAX_DEPTH - 1
    args = "[" * depth + "5" + "]" * depth
    pointer = "/0" * depth
    assert _deep(check_refusal, RECURSIVE_ARRAY, args) == at(pointer, "got integer, want array")


def test_shallow_recursive_input_names_the_deep_pointer():
    args = "[[[[5]]]]"
    assert at("/0/0/0/0", "got integer, want array") in check_refusal(RECURSIVE_ARRAY, args)


def test_long_ref_chain_is_not_a_crash():
    n = 600
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    schema = json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})
    _deep(refused_somewhere, schema, "5")


# ---- edge cases --------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, args, refusal", [
    ('{"maximum":10}', "1e10000", "maximum: got 1e10000, want 10"),
    ('{"minimum":-10}', "-1e10000", "minimum: got -1e10000, want -10"),
    ('{"exclusiveMinimum":0}', "1e-10000", None),
    ('{"exclusiveMaximum":0}', "1e-10000", "exclusiveMaximum: got 1e-10000, want 0"),
    ('{"maximum":1e-10000}', "0.0", None),
    ('{"type":"integer"}', "1e10000", None),
    ('{"type":"integer"}', "1e-10000", "got number, want integer"),
    ('{"type":"integer","maximum":1e9999}', "1" + "0" * 9999, None),
    ('{"exclusiveMaximum":1e9999}', "1" + "0" * 9999,
     "exclusiveMaximum: got " + "1" + "0" * 9999),
    ('{"multipleOf":1e-300}', "1", None),
    ('{"multipleOf":1e-300}', "3e-300", None),
    ('{"multipleOf":1e-300}', "1e10000", None),
    ('{"multipleOf":1e-300}', "1.5e-300", "multipleOf: got 1.5e-300, want a multiple of 1e-300"),
    ('{"multipleOf":1e-300}', "1e-10000", "multipleOf: got 1e-10000, want a multiple of 1e-300"),
    ('{"multipleOf":1e10000}', "2e10000", None),
    ('{"multipleOf":1e10000}', "2", "multipleOf: got 2, want a multiple of 1e10000"),
    ('{"const":1e10000}', "1" + "0" * 9990 + "e10", None),
    ('{"enum":[1e-10000]}', "0", "value must be one of 1e-10000"),
], ids=lambda v: v[:40] if isinstance(v, str) else None)
def test_huge_and_tiny_numbers(schema, args, refusal):
    if refusal is None:
        accepted(schema, args)
    else:
        assert at("", refusal) in check_refusal(schema, args)


@pytest.mark.parametrize("args", [
    b'{"a":1e10001}', b'{"a":-1e-10001}', b'{"a":1' + b"0" * 10_000 + b"}",
])
def test_numbers_beyond_the_parser_bounds_are_json_errors(args):
    with pytest.raises(JSONError):
        compiled("true").check(args)


@pytest.mark.parametrize("args", [
    b'{"a":1,"a":2}', b'{"a":NaN}', b'{"a":Infinity}', b'{"a":1,}', b'{"a":01}',
    b'{"a":"\\ud800"}', b'{"a":"\xff"}', b"{'a':1}", b'{"a":1} x', b"[" * 300 + b"]" * 300,
])
def test_args_the_strict_parser_refuses_are_json_errors(args):
    # Even the schema that accepts everything: parsing is strict before validation starts.
    with pytest.raises(JSONError):
        compiled("true").check(args)


def test_check_returns_the_parsed_arguments_with_literals_kept():
    got = compiled(ZOD).check(b'{"amount":1.50,"to":"b","currency":"EUR"}')
    assert got["amount"] == ap.Num("1.50")
    assert got["to"] == "b"


def test_empty_object_args_against_required():
    assert failures(check_refusal('{"type":"object","required":["a","b"]}', "{}")) == [
        at("", 'missing property "a"'), at("", 'missing property "b"')]
    accepted('{"type":"object","properties":{"a":{"type":"string"}}}', "{}")


@pytest.mark.parametrize("schema, args, refusal", [
    ('{"minLength":3}', '"\u65e5\u672c"', "minLength: got 2 characters, want 3"),
    ('{"maxLength":2}', '"\u65e5\u672c"', None),
    ('{"maxLength":2}', '"\U0001f600\U0001f600"', None),
    ('{"minLength":2}', '"\\ud83d\\ude00"', "minLength: got 1 characters, want 2"),
    ('{"maxLength":1}', '"\u00e9"', None),
    ('{"maxLength":1}', '"\\u00e9"', None),
    ('{"maxLength":1}', '"e\u0301"', "maxLength: got 2 characters, want 1"),
    ('{"const":"\u00e9"}', '"\\u00e9"', None),
    ('{"enum":["\u00e9"]}', '"e\u0301"', 'value must be one of "\u00e9"'),
    ('{"pattern":"^.{3}$"}', '"\u65e5\u672c\u8a9e"', None),
])
def test_non_ascii_strings(schema, args, refusal):
    if refusal is None:
        accepted(schema, args)
    else:
        assert at("", refusal) in check_refusal(schema, args)


def test_unique_items_nested_objects_in_different_key_order():
    schema = '{"type":"array","uniqueItems":true}'
    args = '[{"a":[1,{"x":1,"y":"z"}],"b":null},{"b":null,"a":[1.0,{"y":"z","x":1e0}]}]'
    assert failures(check_refusal(schema, args)) == [at("/1", "uniqueItems: a repeated item")]
    accepted(schema, '[{"a":[1,{"x":1,"y":"z"}]},{"a":[1,{"x":2,"y":"z"}]}]')
    accepted(schema, '[{"a":[1,2]},{"a":[2,1]}]')


def test_additional_properties_schema_applies_only_to_unmatched_names():
    schema = ('{"properties":{"name":{"type":"string"}},'
              '"patternProperties":{"^n_":{"type":"integer"}},'
              '"additionalProperties":{"type":"boolean"}}')
    accepted(schema, '{"name":"x","n_1":1,"flag":true}')
    # name and n_1 are not booleans, and must not be judged by additionalProperties.
    assert check_refusal(schema, '{"name":"x","n_1":1,"flag":"yes"}') == \
        at("/flag", "got string, want boolean")


def test_pattern_properties_with_additional_properties_false():
    schema = '{"patternProperties":{"^x-":{"type":"string"}},"additionalProperties":false}'
    accepted(schema, '{"x-a":"1","x-b":"2"}')
    accepted(schema, "{}")
    assert check_refusal(schema, '{"x-a":"1","y":"2"}') == \
        at("", 'additional properties "y" not allowed')
    assert check_refusal(schema, '{"x-a":1}') == at("/x-a", "got integer, want string")
    # the pattern is a search, but it is not a match for "ax-"
    assert check_refusal(schema, '{"ax-":"1"}') == at("", 'additional properties "ax-" not allowed')


def test_prefix_items_with_items_false():
    schema = '{"type":"array","prefixItems":[{"type":"string"},{"type":"integer"}],"items":false}'
    accepted(schema, '["a",1]')
    accepted(schema, '["a"]')
    accepted(schema, "[]")
    assert check_refusal(schema, '["a",1,null]') == at("", "array has 3 items, at most 2 allowed")
    assert at("/1", "got string, want integer") in check_refusal(schema, '["a","b"]')


def test_one_of_matching_two_is_refused():
    schema = '{"oneOf":[{"type":"number"},{"type":"integer"}]}'
    assert check_refusal(schema, "3") == at("", "matches 2 schemas of oneOf, want exactly one")
    accepted(schema, "3.5")
    assert check_refusal(schema, '"3"') == at("", "matches 0 schemas of oneOf, want exactly one")


def test_not():
    schema = '{"type":"object","properties":{"mode":{"not":{"enum":["0777","777"]}}}}'
    accepted(schema, '{"mode":"0644"}')
    assert check_refusal(schema, '{"mode":"0777"}') == \
        at("/mode", "matches a schema it must not match")
    assert check_refusal('{"not":true}', "null") == at("", "matches a schema it must not match")
    accepted('{"not":false}', "null")


IF_THEN_ELSE = ('{"type":"object",'
                '"if":{"properties":{"kind":{"const":"card"}},"required":["kind"]},'
                '"then":{"required":["number"]},'
                '"else":{"required":["iban"]}}')


@pytest.mark.parametrize("args, refusal", [
    ('{"kind":"card","number":"4111"}', None),
    ('{"kind":"card"}', 'missing property "number"'),
    ('{"kind":"card","iban":"DE00"}', 'missing property "number"'),
    ('{"kind":"bank","iban":"DE00"}', None),
    ('{"kind":"bank"}', 'missing property "iban"'),
    ('{"kind":"bank","number":"4111"}', 'missing property "iban"'),
    ('{}', 'missing property "iban"'),
])
def test_if_then_else_both_branches(args, refusal):
    if refusal is None:
        accepted(IF_THEN_ELSE, args)
    else:
        assert check_refusal(IF_THEN_ELSE, args) == at("", refusal)


def test_deep_nesting_errors_name_the_deep_pointer():
    schema = ('{"type":"object","properties":{"a":{"type":"array","items":{"type":"object",'
              '"properties":{"b":{"type":"integer","maximum":3}},"required":["b"]}}}}')
    accepted(schema, '{"a":[{"b":1},{"b":3.0}]}')
    assert check_refusal(schema, '{"a":[{"b":"x"}]}') == at("/a/0/b", "got string, want integer")
    assert check_refusal(schema, '{"a":[{"b":1},{"b":4}]}') == at("/a/1/b", "maximum: got 4, want 3")
    assert check_refusal(schema, '{"a":[{"b":1},{"c":4}]}') == at("/a/1", 'missing property "b"')


@pytest.mark.parametrize("key, pointer", [
    ("a/b", "/a~1b"),
    ("c~d", "/c~0d"),
    ("~1", "/~01"),
    ("/~/", "/~1~0~1"),
    ("", "/"),
    ("sp ace", "/sp ace"),
])
def test_pointer_escapes_slash_and_tilde(key, pointer):
    k = json.dumps(key)
    schema = '{"properties":{%s:{"type":"string"}}}' % k
    assert check_refusal(schema, '{%s:1}' % k) == at(pointer, "got integer, want string")


def test_pointer_escapes_nested_keys():
    schema = '{"properties":{"a/b":{"properties":{"c~d":{"items":{"type":"string"}}}}}}'
    assert check_refusal(schema, '{"a/b":{"c~d":["x",2]}}') == \
        at("/a~1b/c~0d/1", "got integer, want string")


def test_additional_property_names_are_quoted_inert():
    # A name chosen by the model reaches the message; it must not be able to drive a terminal.
    schema = '{"additionalProperties":false}'
    msg = check_refusal(schema, '{"a\\u001b[31m\\nb":1}')
    assert "\x1b" not in msg and "\n" not in msg
    assert msg.startswith("at '': additional properties \"a")


def test_failures_are_joined_and_capped():
    schema = '{"items":{"type":"integer"}}'
    msg = check_refusal(schema, "[" + ",".join(['"x"'] * 10) + "]")
    parts = failures(msg)
    assert parts[:8] == [at(f"/{i}", "got string, want integer") for i in range(8)]
    assert parts[8:] == ["and 2 more"]
    assert len(failures(check_refusal(schema, '["x","y"]'))) == 2


def test_boolean_root_schemas():
    for args in ("{}", "[]", '"s"', "0", "null", "true"):
        accepted("true", args)
        assert check_refusal("false", args) == at("", "no value is allowed here")


def test_a_compiled_schema_checks_many_times_the_same_way():
    s = compiled(WRITE_FILE)
    for _ in range(3):
        s.check(b'{"path":"a","content":"b"}')
        with pytest.raises(SchemaError, match="missing property"):
            s.check(b'{"path":"a"}')


# ---- JSON Schema patterns are ECMA-262 -------------------------------------------------------

def test_pattern_dollar_does_not_match_before_a_trailing_newline():
    assert check_refusal('{"type":"string","pattern":"^[a-z]+$"}', '"abc\\n"') == \
        at("", 'does not match pattern "^[a-z]+$"')


def test_pattern_digit_class_is_ascii():
    # \d is [0-9] in ECMA-262; Python's default would also match other scripts' digits.
    schema = '{"pattern":"^\\\\d+$"}'
    accepted(schema, '"123"')
    assert at("", "does not match pattern") in check_refusal(schema, '"\u0661\u0662"')


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
