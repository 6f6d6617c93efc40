"""Section 6 of agentrt_proxy: what checking arguments against a compiled schema may cost.

Two ways a hostile party made checking slow, on the event loop, before anything ran:
long number literals (each keyword converted them to an exact fraction again), and a small
pinned schema whose $ref/allOf fan-out made one value be checked 2^31 times. Numbers are now
compared from their literal text, a schema's fan-out is bounded when it loads, and each call
has a budget of subschema evaluations; spending it is a refusal (INVALID), never an acceptance.

What the costs are judged by is counted, never timed, so that a busy machine judges them as
an idle one does: the exact conversions of a number made (none: the exact_numbers fixture
refuses each, so a check that makes one fails at once), the subschemas whose fan-out is
worked out when a schema loads (each once), and the budget's refusal itself.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import agentrt_proxy as ap  # noqa: E402
from agentrt_proxy import SchemaError, compile_schema  # noqa: E402


FAN_OUT_LOOKS = 1000                            # a walk, not a count: stopped there
LONG = "1." + "7" * 9992 + "e-9999"             # 10,000 characters: the parser's bound
LONG_ARGS = ("[" + ",".join([LONG] * 100) + "]").encode()   # about 1 MB
ENUM_20 = "[" + ",".join(f"{i}.5e-3" for i in range(20)) + "]"


def _outcome(fn, *args):
    try:
        return fn(*args)
    except SchemaError as exc:
        return exc


def _refusal(schema: str, args: bytes) -> str:
    s = compile_schema(schema.encode())
    out = _outcome(s.check, args)
    assert isinstance(out, SchemaError), f"accepted: {schema[:80]}"
    return str(out)


def _objects(doc) -> int:
    """The JSON objects in a document: its subschemas, when it is a schema."""
    if isinstance(doc, dict):
        return 1 + sum(_objects(v) for v in doc.values())
    if isinstance(doc, list):
        return sum(_objects(v) for v in doc)
    return 0


def chain(levels: int, root: str = '{"$ref":"#/$defs/l0"}') -> str:
    """Each level an allOf of two $refs to the level below: 2^(levels+1) - 1 evaluations
    of one value, in a schema of about 40 bytes a level. ``root`` refers to the top level
    as {"$ref":"#/$defs/l0"}; the levels are added to it under $defs."""
    defs = {f"l{i}": {"allOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]}
            for i in range(levels)}
    defs[f"l{levels}"] = {"type": "object"}
    return root[:-1] + ',"$defs":' + json.dumps(defs, separators=(",", ":")) + "}"


# ---- long number literals ------------------------------------------------------------------

def test_schema_long_literals_cost_is_bounded(exact_numbers):
    # Before: an exact fraction of each literal for each keyword (1.1 s for minimum plus
    # multipleOf, 7.6 s for the enum, on an idle 2-core machine).
    msg = _refusal('{"items":{"minimum":0,"multipleOf":1e-10000}}', LONG_ARGS)
    assert "at '/0': multipleOf: got 1.777" in msg
    msg = _refusal('{"items":{"enum":%s}}' % ENUM_20, LONG_ARGS)
    assert msg.startswith("at '/0': value must be one of 0.5e-3, 1.5e-3")
    assert exact_numbers == []


def test_schema_long_literals_every_numeric_keyword_is_bounded(exact_numbers):
    schema = ('{"items":{"type":"integer","minimum":1.7777e-9999,"maximum":1.78e-9999,'
              '"exclusiveMinimum":0,"exclusiveMaximum":1,"multipleOf":7e-10000,'
              '"const":1.7e-9999},"uniqueItems":true}')
    msg = _refusal(schema, LONG_ARGS)
    first = msg.split("; ")[0]
    assert first == "at '/0': got number, want integer"
    assert exact_numbers == []


def test_to_plain_of_long_literals_is_cheap(exact_numbers, monkeypatch):
    value = ap.parse_json(LONG_ARGS)
    plain = ap.to_plain(value)              # before: an exact fraction of each, 0.4 s
    assert exact_numbers == []
    monkeypatch.undo()                      # a long integer literal is converted, the slow way
    assert plain[0] == 0.0 and isinstance(plain[0], float)
    assert ap.loads_own(b"[12, -0, 1.5, 1e2, 0.07e2, " + b"9" * 9000 + b"]") == \
        [12, 0, 1.5, 100.0, 7.0, 10 ** 9000 - 1]


@pytest.mark.parametrize("schema, args, refusal", [
    # the magnitudes are equal and only the last of 10,000 digits decides
    ('{"maximum":%s}' % LONG, "1." + "7" * 9991 + "8e-9999", "maximum: got 1.777"),
    ('{"maximum":%s}' % LONG, LONG, None),
    ('{"exclusiveMaximum":%s}' % LONG, LONG, "exclusiveMaximum: got 1.777"),
    ('{"minimum":%s}' % LONG, "1." + "7" * 9991 + "6e-9999", "minimum: got 1.777"),
    ('{"minimum":%s}' % LONG, "17" + "7" * 9991 + "e-10000", None),
    ('{"minimum":%s}' % LONG, "0.2e-9998", None),
    ('{"minimum":%s}' % LONG, "0.1e-9998", "minimum: got 0.1e-9998"),
    ('{"minimum":%s}' % LONG, "-1.8e-9999", "minimum: got -1.8e-9999"),
    ('{"maximum":-1e-9999}', "-0.9e-9999", "maximum: got -0.9e-9999, want -1e-9999"),
    ('{"maximum":-1e-9999}', "-1.1e-9999", None),
    ('{"minimum":-0}', "0.0e5", None),
    ('{"exclusiveMinimum":-0}', "0", "exclusiveMinimum: got 0, want -0"),
    # multipleOf decided from digits and exponents, however far apart the exponents are
    ('{"multipleOf":3}', "1" * 9000, None),
    ('{"multipleOf":3}', "1" * 9001, "multipleOf: got 111"),
    ('{"multipleOf":7}', "7e9999", None),
    ('{"multipleOf":7}', "1e9999", "multipleOf: got 1e9999, want a multiple of 7"),
    ('{"multipleOf":0.25}', "0.75e0", None),
    ('{"multipleOf":0.25}', "25e-2", None),
    ('{"multipleOf":0.25}', "0.3", "multipleOf: got 0.3, want a multiple of 0.25"),
    ('{"multipleOf":2.5}', "1", "multipleOf: got 1, want a multiple of 2.5"),
    ('{"multipleOf":2.5}', "1e4", None),
    ('{"multipleOf":0.1}', "0.3", None),
    ('{"multipleOf":0.1}', "1e-2", "multipleOf: got 1e-2, want a multiple of 0.1"),
    ('{"multipleOf":1e-10000}', "1e10000", None),
    ('{"multipleOf":1e10000}', "1e-10000", "multipleOf: got 1e-10000, want a multiple of 1e10000"),
    ('{"multipleOf":123456789e-9990}', "246913578e9990", None),
    ('{"multipleOf":123456789e-9990}', "246913579e9990", "multipleOf: got 246913579e9990"),
    ('{"multipleOf":7}', "0", None),
    ('{"multipleOf":7}', "-0.0e-5", None),
    ('{"multipleOf":7}', "-14", None),
], ids=lambda v: v[:30] if isinstance(v, str) else None)
def test_long_and_far_apart_numbers_compare_exactly(schema, args, refusal):
    s = compile_schema(schema.encode())
    if refusal is None:
        s.check(args.encode())
    else:
        with pytest.raises(SchemaError) as exc:
            s.check(args.encode())
        assert str(exc.value).startswith("at '': " + refusal)


# ---- equality across spellings: enum, const, uniqueItems; what counts as an integer ----------

ONE_SPELLINGS = ["1", "1.0", "10e-1", "0.1e1", "1E0", "100e-2", "1.000e+0", "0.00001e5"]
NOT_ONE = ["1.0000001", "10", "0.1", "1e1", "-1", "2", "0.99999", "11e-1", "1e-10000"]


@pytest.mark.parametrize("spelling", ONE_SPELLINGS)
@pytest.mark.parametrize("keyword", ["enum", "const"])
def test_equal_numbers_across_spellings(keyword, spelling):
    for want in ONE_SPELLINGS:
        schema = f'{{"enum":[0,{want},3]}}' if keyword == "enum" else f'{{"const":{want}}}'
        compile_schema(schema.encode()).check(spelling.encode())
    nested = f'{{"{keyword}":' + ("[[{\"a\":[1e0]}]]" if keyword == "enum" else
                                  "[{\"a\":[1e0]}]") + "}"
    compile_schema(nested.encode()).check(f'[{{"a":[{spelling}]}}]'.encode())


@pytest.mark.parametrize("other", NOT_ONE)
@pytest.mark.parametrize("keyword", ["enum", "const"])
def test_unequal_numbers_are_refused(keyword, other):
    schema = '{"enum":[1]}' if keyword == "enum" else '{"const":1}'
    with pytest.raises(SchemaError):
        compile_schema(schema.encode()).check(other.encode())


@pytest.mark.parametrize("args, repeated", [
    ("[1, 1.0]", True), ("[1, 10e-1]", True), ("[100e-2, 1E0]", True), ("[0, -0]", True),
    ("[0.0, -0.0e5]", True), ("[[1], [1.0]]", True), ('[{"a":1}, {"a":1e0}]', True),
    ('[{"a":1,"b":[2]}, {"b":[20e-1],"a":1}]', True), ("[1e-9998, 10e-9999]", True),
    ("[%s, %s]" % ("1." + "7" * 9000 + "e-9999", "17." + "7" * 8999 + "e-10000"), True),
    ("[%s, %s]" % ("1." + "7" * 9000 + "e-9999", "17." + "7" * 8999 + "e-9999"), False),
    ("[%s, %s]" % (LONG, "0.2e-9998"), False),
    ("[1, 10]", False), ('[1, "1"]', False), ("[true, 1]", False), ("[false, 0]", False),
    ("[null, 0]", False), ("[[1], [1, 1]]", False), ('[{"a":1}, {"a":1,"b":1}]', False),
    ('[{"a":1}, {"b":1}]', False), ("[1e-10000, 1e-9999]", False), ('["a", "b"]', False),
    ("[[], {}]", False), ("[[0], [-0.0]]", True), ("[0.1, 0.10000000000000001]", False),
], ids=lambda v: v[:30] if isinstance(v, str) else None)
def test_unique_items_equality_across_spellings(args, repeated):
    s = compile_schema(b'{"uniqueItems":true}')
    if repeated:
        with pytest.raises(SchemaError, match="uniqueItems: a repeated item"):
            s.check(args.encode())
    else:
        s.check(args.encode())


@pytest.mark.parametrize("literal, integer", [
    ("1", True), ("1.0", True), ("1e2", True), ("1.5e1", True), ("1e-2", False),
    ("-0", True), ("0.0", True), ("-0.0e-5", True), ("0e-10000", True),
    ("12345678901234567890e-10", False), ("12345678900000000000e-10", True),
    ("1.5", False), ("2.50e1", True), ("10000e-4", True), ("10001e-4", False),
    ("1e10000", True), ("1e-10000", False), ("-7.000", True), ("-7.001", False),
    (LONG, False), ("1" + "0" * 9990 + "e-9990", True), ("1" + "0" * 9989 + "1e-9990", False),
], ids=lambda v: v[:30] if isinstance(v, str) else None)
def test_type_integer_is_decided_from_the_literal(literal, integer):
    s = compile_schema(b'{"type":"integer"}')
    if integer:
        s.check(literal.encode())
    else:
        with pytest.raises(SchemaError, match="got number, want integer"):
            s.check(literal.encode())
    assert ap.Num(literal).is_integer() is integer


# ---- fan-out refused when the schema loads ------------------------------------------------

def test_schema_fan_out_refused_at_load(monkeypatch):
    """The fan-out is worked out once a subschema (memoised, in the walk that measures
    chains): a count over 32 levels, never the 2^32 checks it stands for. A build that walks
    the graph instead stops at FAN_OUT_LOOKS looks, and fails."""
    schema = chain(31)
    assert len(schema) < 2100                      # about 2 KB
    looks = []
    walk = ap.Schema._chain

    def counted(self, at, longest, fan):
        looks.append(at)
        if len(looks) > FAN_OUT_LOOKS:
            raise AssertionError(f"{len(looks)} looks at the schema's fan-out")
        return walk(self, at, longest, fan)
    monkeypatch.setattr(ap.Schema, "_chain", counted)
    with pytest.raises(SchemaError) as exc:
        compile_schema(schema.encode())
    subschemas = _objects(json.loads(schema))
    # a look from each subschema, and one along each reference or combinator
    assert len(looks) <= 3 * subschemas, f"{len(looks)} looks at {subschemas} subschemas"
    msg = str(exc.value)
    assert re.match(r"the schema at #\S* makes one value be checked against more than "
                    rf"{ap.MAX_SCHEMA_FAN_OUT} subschemas", msg), msg


def test_schema_fan_out_at_18_levels_is_refused_at_load_too():
    with pytest.raises(SchemaError, match="more than .* subschemas"):
        compile_schema(chain(18).encode())


def test_schema_fan_out_under_the_limit_loads_and_checks():
    s = compile_schema(chain(8).encode())           # 511 evaluations of one value
    s.check(b"{}")
    with pytest.raises(SchemaError, match="got array, want object"):
        s.check(b"[]")


def test_schema_fan_out_counts_every_combinator():
    # anyOf, oneOf, not, if/then/else, dependentSchemas each count as evaluations
    def level(below: str) -> dict:
        ref = {"$ref": below}
        return {"anyOf": [ref], "oneOf": [ref], "not": ref, "if": ref, "then": ref,
                "else": ref, "dependentSchemas": {"a": ref}}
    defs = {"d0": {"type": "string"}}
    for i in range(1, 9):           # 7 children a level, 8 levels: 7^8, far past the limit
        defs[f"d{i}"] = level(f"#/$defs/d{i - 1}")
    schema = json.dumps({"$defs": defs, "$ref": "#/$defs/d8"})
    with pytest.raises(SchemaError, match="more than .* subschemas"):
        compile_schema(schema.encode())


# ---- the per-call budget --------------------------------------------------------------------

LEVEL_0 = '{"$ref":"#/$defs/l0"}'
BUDGET_SCHEMA = chain(9, '{"type":"array","items":%s}' % LEVEL_0)   # 1,023 evaluations an item
BUDGET_ARGS = ("[" + ",".join(["{}"] * 2000) + "]").encode()


def test_schema_budget_answers_invalid():
    s = compile_schema(BUDGET_SCHEMA.encode())
    s.check(b"[{}, {}, {}]")                        # a few items are well inside the budget
    out = _outcome(s.check, BUDGET_ARGS)
    assert isinstance(out, SchemaError), "2,000 items x 1,023 evaluations were accepted"
    msg = str(out)
    # it ran out in one of the levels, checking one of the items
    assert re.fullmatch(r"checking these arguments against the schema at #/\$defs/l\d/\S+ "
                        rf"exceeded {ap.MAX_SCHEMA_EVALUATIONS} evaluations "
                        r"\(at the value '/\d+'\)", msg), msg


def test_schema_budget_is_per_call():
    s = compile_schema(BUDGET_SCHEMA.encode())
    for _ in range(3):
        with pytest.raises(SchemaError, match="exceeded"):
            s.check(BUDGET_ARGS)
        s.check(b"[{}]")                            # a fresh budget each call


@pytest.mark.parametrize("wrap", ["not", "anyOf", "oneOf", "if"])
def test_schema_budget_spent_inside_a_combinator_is_never_an_acceptance(wrap):
    # A spent budget inside "not" must not read as "the subschema failed, so not passes".
    inner = '{"items":%s}' % LEVEL_0
    schema = {"not": f'{{"not":{{"not":{inner}}}}}', "anyOf": f'{{"anyOf":[{inner}]}}',
              "oneOf": f'{{"oneOf":[{inner}]}}',
              "if": f'{{"if":{inner},"then":true,"else":true}}'}[wrap]
    s = compile_schema(chain(9, schema).encode())
    with pytest.raises(SchemaError, match="exceeded"):
        s.check(BUDGET_ARGS)


def test_schema_budget_counts_boolean_subschemas_and_uniqueness():
    # true subschemas and uniqueItems do work for every item: they are charged too
    many = ("[" + ",".join(str(i) for i in range(100_000)) + "]").encode()
    schema = {"allOf": [{"items": True, "uniqueItems": True}] * 8}
    s = compile_schema(json.dumps({"$defs": {"x": schema}, "allOf": [{"$ref": "#/$defs/x"}] * 4}
                                  ).encode())
    out = _outcome(s.check, many)
    assert isinstance(out, SchemaError) and "exceeded" in str(out)


def test_schema_budget_leaves_room_for_large_real_arguments():
    # 100,000 numbers against a plain array schema, and 10,000 records of five fields
    numbers = ("[" + ",".join(f"{i}.5" for i in range(100_000)) + "]").encode()
    compile_schema(b'{"type":"array","items":{"type":"number","minimum":0}}').check(numbers)
    record = ('{"type":"object","required":["id","name","price","tags","ok"],'
              '"additionalProperties":false,"properties":{"id":{"type":"integer"},'
              '"name":{"type":"string","maxLength":100},"price":{"type":"number"},'
              '"tags":{"type":"array","items":{"type":"string"}},"ok":{"type":"boolean"}}}')
    rows = ",".join(f'{{"id":{i},"name":"n{i}","price":{i}.25,"tags":["a","b"],"ok":true}}'
                    for i in range(10_000))
    compile_schema(('{"type":"array","uniqueItems":true,"items":%s}' % record).encode()) \
        .check(f"[{rows}]".encode())


def test_schema_budget_through_the_gate_is_an_invalid_reason(tmp_path):
    calls = []

    async def tool(args, value=None):
        calls.append(args)
        return ap.ToolResult(b"{}", "done")

    spec = ap.ToolSpec("costly", "costly schema", BUDGET_SCHEMA.encode(), "read_only", 5.0, True)
    store = ap.Store.open(str(tmp_path / "runs.db"))
    gate = ap.Gate(store, [ap.Tool(spec, tool)], ap.SideEffectPolicy())
    try:
        reason = gate.check_args(gate.tools["costly"], BUDGET_ARGS)
        assert reason.startswith("arguments do not match schema: checking these arguments "
                                 "against the schema at #/$defs/"), reason
        s = gate.begin("run-1", "call costly", ap.Limits(3, 3, 3, 3600.0, 3600.0))
        assert s.step() is not None
        v = s.propose(ap.Decision("tool_call", "costly", BUDGET_ARGS, origin="model"))
        assert v.kind == "denied" and v.observation["kind"] == "invalid_decision"
        assert "exceeded" in v.observation["content"]["error"]
        assert calls == []
    finally:
        gate.close()
        store.close()


def test_schema_multiple_of_with_too_many_digits_is_refused_at_load():
    digits = "3" * (ap.MAX_MULTIPLE_OF_DIGITS + 1)
    with pytest.raises(SchemaError, match="multipleOf .* significant digits"):
        compile_schema(f'{{"multipleOf":{digits}}}'.encode())
    # trailing and leading zeros are not significant
    compile_schema(f'{{"multipleOf":0.000{digits[1:]}000e10}}'.encode())


# ---- Pattern work, faults found in review ----------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

def test_pattern_work_is_bounded_per_call_not_only_per_string(monkeypatch):
    # A 27-character pattern, a pinned schema of 120 bytes, 40 KB of arguments. Unanchored,
    # {1,1000} keeps up to a thousand threads alive; the states are too big for the memo to
    # keep, so every string pays again. The whole check may spend what the call's budget
    # allows, in instruction visits: the faulty code let each string spend MAX_PATTERN_WORK
    # (about 8 s for the call on an idle core).
    """The hardened proxy's review, finding 1: matching a schema pattern is not charged to the
    call's evaluation budget. Each string may spend MAX_PATTERN_WORK instruction visits
    (seconds), and the per-pattern memo empties after PATTERN_MEMO_STATES held instructions, so
    an array of short strings against one small pinned pattern keeps the event loop busy for
    many seconds. Judged by a count, never by a time: the instruction visits the patterns were
    allowed."""
    schema = {"type": "object", "properties": {"s": {"type": "array", "items": {
        "type": "string", "pattern": "[a-z]{1,1000}$"}}}}
    compiled = ap.compile_schema(json.dumps(schema).encode())
    args = json.dumps({"s": ["a" * 1000 + "!"] * 40}).encode()
    assert len(args) < 50_000
    allowed = []                    # per string: the visits it spent, or all it was allowed
    search_costed = ap.Pattern.search_costed

    def counted(self, text, limit):
        allowed.append(limit)
        found, work = search_costed(self, text, limit)
        allowed[-1] = work
        return found, work
    monkeypatch.setattr(ap.Pattern, "search_costed", counted)
    with pytest.raises(ap.SchemaError):
        compiled.check(args)
    budget = ap.MAX_SCHEMA_EVALUATIONS * ap.PATTERN_VISITS_PER_EVALUATION
    assert allowed and sum(allowed) <= budget, f"{sum(allowed)} visits over {len(allowed)} " \
        f"strings, the call's budget {budget}"
