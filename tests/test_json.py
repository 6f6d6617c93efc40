"""Strict JSON, canonical form, PolicyJSON and request keys.

Specification: reference/core.md 9.1 (canonical form and hashes), 9.2 (PolicyJSON), 9.3 (the
boundary check); reference/proxy.md 5.1 (request key) and rows 42-43 of 17.2.

Every refusal is a row of a table: the bytes, the reason the error must start with (most rows
give the whole message) and the byte offset it must point at. The checks run in a fixed order
and the first failure wins: depth, UTF-8, syntax, surrogates, repeated keys, number bounds.
"""

import hashlib
import json
import random
from dataclasses import dataclass

import pytest

from agentrt_proxy import (JSONError, canonical_json, check_json, content_hash, parse_json,
                           policy_json, request_key)

# ---------------------------------------------------------------------------------------------
# Shared tables
# ---------------------------------------------------------------------------------------------

DEPTH = "nested deeper than 256 levels"
UTF8 = "not valid UTF-8"
SYNTAX = "not valid JSON: "
SURROGATE = "unpaired surrogate "
TOO_LONG = " is longer than 10000 characters"
EXPONENT = " has an exponent beyond \u00b110000"

ONES_10001 = b"1" * 10_001
# Nested in a container, a literal that overflows a 64-bit float is refused by the decoding
# pass (step 5) before the length check (step 6); this fraction tests length alone.
FRACTION_10001 = b"0." + b"1" * 9_999
FRACTION_SHOWN = "number 0." + "1" * 22 + "..."
LONG_EXPONENT = "1e-" + "0" * 20 + "10001"          # 28 bytes: shown cut to 24 + "..."

# (input bytes, reason prefix, byte offset), one row per kind of refusal.
BAD = [
    # 1. depth, counted on the raw bytes before anything else
    pytest.param(b"[" * 257 + b"]" * 257, DEPTH, 256, id="257-arrays"),
    pytest.param(b'{"a":' * 257 + b"1" + b"}" * 257, DEPTH, 1280, id="257-objects"),
    pytest.param(b"[" * 300 + b"]" * 300, DEPTH, 256, id="300-arrays"),
    # 2. UTF-8
    pytest.param(b"\xff", UTF8, 0, id="byte-ff"),
    pytest.param(b'"\xfe"', UTF8, 1, id="byte-fe"),
    pytest.param(b'"\xe2\x82"', UTF8, 1, id="truncated-multibyte"),
    pytest.param(b'"\xed\xa0\x80"', UTF8, 1, id="encoded-surrogate"),
    pytest.param(b'"\xc0\xaf"', UTF8, 1, id="overlong"),
    pytest.param(b'{"\xc3":1}', UTF8, 2, id="lead-byte-then-quote"),
    pytest.param(b'"ok \xf4\x90\x80\x80"', UTF8, 4, id="beyond-10ffff"),
    # 3. syntax: what Python's json lets through
    pytest.param(b"NaN", SYNTAX + "unexpected character 'N'", 0, id="NaN"),
    pytest.param(b"Infinity", SYNTAX + "unexpected character 'I'", 0, id="Infinity"),
    pytest.param(b"-Infinity", SYNTAX + "malformed number", 0, id="-Infinity"),
    pytest.param(b"[1,NaN]", SYNTAX + "unexpected character 'N'", 3, id="NaN-nested"),
    pytest.param(b"00", SYNTAX + "leading zero in a number", 0, id="00"),
    pytest.param(b"01", SYNTAX + "leading zero in a number", 0, id="01"),
    pytest.param(b"-01", SYNTAX + "leading zero in a number", 0, id="-01"),
    pytest.param(b'{"n":01}', SYNTAX + "leading zero in a number", 5, id="01-nested"),
    pytest.param(b'"\\u+123"', SYNTAX + "invalid escape", 1, id="u-plus-123"),
    pytest.param(b'"\\u12"', SYNTAX + "invalid escape", 1, id="short-u-escape"),
    pytest.param(b'"\\x41"', SYNTAX + "invalid escape", 1, id="x-escape"),
    pytest.param(b'"\\U0041"', SYNTAX + "invalid escape", 1, id="capital-U-escape"),
    pytest.param(b'"a\tb"', SYNTAX + "control character U+0009 in a string", 2, id="raw-tab"),
    pytest.param(b'"a\nb"', SYNTAX + "control character U+000A in a string", 2, id="raw-newline"),
    pytest.param(b'"\x00"', SYNTAX + "control character U+0000 in a string", 1, id="raw-nul"),
    pytest.param(b'"\x1f"', SYNTAX + "control character U+001F in a string", 1, id="raw-1f"),
    pytest.param(b"[1,]", SYNTAX + "trailing comma", 3, id="trailing-comma-array"),
    pytest.param(b'{"a":1,}', SYNTAX + "trailing comma", 7, id="trailing-comma-object"),
    pytest.param(b"\xef\xbb\xbf{}", SYNTAX + "unexpected character U+FEFF", 0, id="BOM"),
    # 3. syntax: what no JSON parser should accept
    pytest.param(b"{'a':1}", SYNTAX + "expected a string key", 1, id="single-quoted-key"),
    pytest.param(b"'a'", SYNTAX + "unexpected character", 0, id="single-quoted-string"),
    pytest.param(b"/* c */ 1", SYNTAX + "unexpected character '/'", 0, id="block-comment"),
    pytest.param(b"1 // c", SYNTAX + "data after the value", 2, id="line-comment"),
    pytest.param(b"", SYNTAX + "no value", 0, id="empty"),
    pytest.param(b" \t\r\n", SYNTAX + "no value", 4, id="whitespace-only"),
    pytest.param(b"1 2", SYNTAX + "data after the value", 2, id="two-values"),
    pytest.param(b"{} {}", SYNTAX + "data after the value", 3, id="two-objects"),
    pytest.param(b'{"a":1} trailing', SYNTAX + "data after the value", 8, id="trailing-text"),
    pytest.param(b'"abc', SYNTAX + "unterminated string", 4, id="unterminated-string"),
    pytest.param(b"[", SYNTAX + "unexpected end of input", 1, id="unterminated-array"),
    pytest.param(b"[1", SYNTAX + "expected ',' or ']'", 2, id="unterminated-array-after-item"),
    pytest.param(b"{", SYNTAX + "unexpected end of input", 1, id="unterminated-object"),
    pytest.param(b'{"a":', SYNTAX + "unexpected end of input", 5, id="unterminated-member"),
    pytest.param(b'{"a":1', SYNTAX + "expected ',' or '}'", 6,
                 id="unterminated-object-after-member"),
    pytest.param(b'{"a"', SYNTAX + "expected ':' after an object key", 4, id="key-without-colon"),
    pytest.param(b'{"a" 1}', SYNTAX + "expected ':' after an object key", 5, id="key-then-value"),
    pytest.param(b"[1 2]", SYNTAX + "expected ',' or ']'", 3, id="missing-comma"),
    pytest.param(b"[,1]", SYNTAX + "unexpected character ','", 1, id="leading-comma"),
    pytest.param(b"\x0c1", SYNTAX + "unexpected character U+000C", 0, id="form-feed-as-space"),
    pytest.param(b"\xc2\xa01", SYNTAX + "unexpected character U+00A0", 0, id="nbsp-as-space"),
    pytest.param(b"+1", SYNTAX + "unexpected character '+'", 0, id="plus-sign"),
    pytest.param(b".5", SYNTAX + "unexpected character '.'", 0, id="no-integer-part"),
    pytest.param(b"1.", SYNTAX + "malformed number", 0, id="no-fraction-digits"),
    pytest.param(b"1e", SYNTAX + "malformed number", 0, id="no-exponent-digits"),
    pytest.param(b"-", SYNTAX + "malformed number", 0, id="lone-minus"),
    pytest.param(b"True", SYNTAX + "unexpected character 'T'", 0, id="True"),
    pytest.param(b"nul", SYNTAX + "unexpected character 'n'", 0, id="cut-literal"),
    # 4. surrogate escapes, reported as written
    pytest.param(b'"\\ud800"', SURROGATE + "\\ud800", 1, id="lone-high"),
    pytest.param(b'"\\udc00x"', SURROGATE + "\\udc00", 1, id="lone-low"),
    pytest.param(b'"\\uDBFF"', SURROGATE + "\\uDBFF", 1, id="lone-high-upper-case"),
    pytest.param(b'"\\udfff"', SURROGATE + "\\udfff", 1, id="lone-low-last"),
    pytest.param(b'{"s":"\\ud800"}', SURROGATE + "\\ud800", 6, id="lone-high-nested"),
    pytest.param(b'{"\\ud800":1}', SURROGATE + "\\ud800", 2, id="lone-high-in-key"),
    pytest.param(b'"\\ud800\\u0041"', SURROGATE + "\\ud800", 1, id="high-then-not-low"),
    pytest.param(b'"\\ud800\\ud800"', SURROGATE + "\\ud800", 1, id="high-then-high"),
    pytest.param(b'"\\ud800 \\udc00"', SURROGATE + "\\ud800", 1, id="high-space-low"),
    pytest.param(b'"\\udc00\\ud800"', SURROGATE + "\\udc00", 1, id="low-then-high"),
    # 5. repeated keys
    pytest.param(b'{"a":1,"a":2}', 'duplicate key "a"', 7, id="duplicate"),
    pytest.param(b'{"x":{"a":1,"a":1}}', 'duplicate key "a"', 12, id="duplicate-nested"),
    pytest.param(b'{"a":1,"\\u0061":2}', 'duplicate key "a"', 7, id="duplicate-by-escape"),
    pytest.param(b'[{"a":1},{"b":1,"b":2}]', 'duplicate key "b"', 16, id="duplicate-in-array"),
    # 6. number bounds (positive huge exponents only at top level: see the overflow tests)
    pytest.param(b"1e99999", "number 1e99999" + EXPONENT, 0, id="1e99999"),
    pytest.param(b"1e10001", "number 1e10001" + EXPONENT, 0, id="1e10001"),
    pytest.param(b"1e-10001", "number 1e-10001" + EXPONENT, 0, id="1e-10001"),
    pytest.param(b"1E+10001", "number 1E+10001" + EXPONENT, 0, id="1E+10001"),
    pytest.param(b"1e100000", "number 1e100000" + EXPONENT, 0, id="1e100000"),
    pytest.param(b"1e9223372036854775807", "number 1e9223372036854775807" + EXPONENT, 0,
                 id="1e-int64-max"),
    pytest.param(b"0.1e-9223372036854775808", "number 0.1e-9223372036854775808" + EXPONENT, 0,
                 id="0.1e-int64-min-24-bytes-shown-whole"),
    pytest.param(b"0.1e-92233720368547758080", "number 0.1e-9223372036854775808..." + EXPONENT,
                 0, id="25-bytes-shown-cut"),
    pytest.param(LONG_EXPONENT.encode(), f"number {LONG_EXPONENT[:24]}...{EXPONENT}", 0,
                 id="leading-zeros-then-10001"),
    pytest.param(b'{"n":1e-10000000}', "number 1e-10000000" + EXPONENT, 5, id="1e-10000000"),
    pytest.param(b"[1e-99999]", "number 1e-99999" + EXPONENT, 1, id="tiny-nested"),
    pytest.param(ONES_10001, "number " + "1" * 24 + "..." + TOO_LONG, 0, id="10001-digits"),
    pytest.param(b"-" + b"1" * 10_000, "number -" + "1" * 23 + "..." + TOO_LONG, 0,
                 id="minus-10000-digits"),
    pytest.param(b"0." + b"0" * 9_999, "number 0." + "0" * 22 + "..." + TOO_LONG, 0,
                 id="10001-byte-fraction"),
    pytest.param(b"[" + FRACTION_10001 + b"]", FRACTION_SHOWN + TOO_LONG, 1,
                 id="10001-digits-nested"),
    pytest.param(b"[" + ONES_10001 + b"]", "number " + "1" * 24 + " is beyond the range", 1,
                 id="10001-digits-nested-overflow"),
]

# (input bytes, winning reason prefix, byte offset): two faults, the earlier check wins.
ORDER = [
    pytest.param(b"[" * 257 + b"\xff" + b"]" * 257, DEPTH, 256, id="depth-over-utf8"),
    pytest.param(b"[" * 257, DEPTH, 256, id="depth-over-syntax"),
    pytest.param(b'{"a":1,"a":' + b"[" * 256 + b"]" * 256 + b"}", DEPTH, 266,
                 id="depth-over-duplicate"),
    pytest.param(b"[\xff", UTF8, 1, id="utf8-over-syntax"),
    pytest.param(b'{"a":1,"a":"\xff"}', UTF8, 12, id="utf8-over-duplicate"),
    pytest.param(b'["\\ud800",]', SYNTAX + "trailing comma", 10, id="syntax-over-surrogate"),
    pytest.param(b'{"a":1,"a":2,}', SYNTAX + "trailing comma", 13,
                 id="syntax-after-duplicate"),
    pytest.param(b'{"a":1,"a":2} x', SYNTAX + "data after the value", 14,
                 id="trailing-data-after-duplicate"),
    pytest.param(b"[1e99999,]", SYNTAX + "trailing comma", 9, id="syntax-over-number"),
    pytest.param(b'{"a":1,"a":"\\ud800"}', SURROGATE + "\\ud800", 12,
                 id="surrogate-over-duplicate"),
    pytest.param(b'{"a":"\\udc00","a":1}', SURROGATE + "\\udc00", 6,
                 id="surrogate-before-duplicate"),
    pytest.param(b'[1e-99999,"\\ud800"]', SURROGATE + "\\ud800", 11,
                 id="surrogate-over-number"),
    pytest.param(b'{"a":1e-99999,"a":1}', 'duplicate key "a"', 14,
                 id="duplicate-over-earlier-number"),
    pytest.param(b'{"a":1,"a":1e-99999}', 'duplicate key "a"', 7,
                 id="duplicate-over-number-in-it"),
    pytest.param(b'{"a":' + FRACTION_10001 + b',"a":1}', 'duplicate key "a"', 10_007,
                 id="duplicate-over-long-number"),
    pytest.param(b'["\\udc00","\\ud800"]', SURROGATE + "\\udc00", 2, id="first-surrogate"),
    pytest.param(b'{"b":1,"a":1,"b":2,"a":2}', 'duplicate key "b"', 13, id="first-duplicate"),
    pytest.param(b"[1e-99999," + FRACTION_10001 + b"]", "number 1e-99999" + EXPONENT, 1,
                 id="first-number-exponent"),
    pytest.param(b"[" + FRACTION_10001 + b",1e-99999]", FRACTION_SHOWN + TOO_LONG, 1,
                 id="first-number-length"),
]

# (input bytes, canonical bytes): inputs at the edge of every bound, all accepted.
ACCEPTED = [
    pytest.param(b"[" * 256 + b"]" * 256, b"[" * 256 + b"]" * 256, id="256-arrays"),
    pytest.param(b'{"a":' * 256 + b"1" + b"}" * 256, b'{"a":' * 256 + b"1" + b"}" * 256,
                 id="256-objects"),
    pytest.param(b'"' + b"[" * 300 + b'"', b'"' + b"[" * 300 + b'"', id="brackets-in-string"),
    pytest.param(b'["\\"' + b"{" * 300 + b'"]', b'["\\"' + b"{" * 300 + b'"]',
                 id="brackets-after-escaped-quote"),
    pytest.param(b"1" * 10_000, b"1" * 10_000, id="10000-digits"),
    pytest.param(b"-" + b"1" * 9_999, b"-" + b"1" * 9_999, id="minus-9999-digits"),
    pytest.param(b"1e10000", b"1e10000", id="1e10000"),
    pytest.param(b"1E-10000", b"1E-10000", id="1E-10000"),
    pytest.param(b"1e-00010000", b"1e-00010000", id="exponent-leading-zeros-stripped"),
    pytest.param(b"1e+0000000000", b"1e+0000000000", id="exponent-all-zeros"),
    pytest.param(b"1e400", b"1e400", id="1e400-top-level"),
    pytest.param(b"[1e308]", b"[1e308]", id="1e308-nested"),
    pytest.param(b"[1e-400]", b"[1e-400]", id="underflow-nested"),
    pytest.param(b'{"a":{"a":1},"b":[{"a":1},{"a":2}]}', b'{"a":{"a":1},"b":[{"a":1},{"a":2}]}',
                 id="same-key-in-different-objects"),
    pytest.param(b'"\\ud83d\\ude42"', "\"\U0001f642\"".encode(), id="surrogate-pair"),
    pytest.param(b'"\\uD83D\\uDE42"', "\"\U0001f642\"".encode(), id="surrogate-pair-upper"),
    pytest.param(b'"\x7f"', b'"\x7f"', id="raw-DEL"),
    pytest.param(b" \t\r\n1 \t\r\n", b"1", id="json-whitespace"),
    pytest.param(b"-0", b"-0", id="minus-zero"),
]

# Numbers that overflow float64 nested in a container: core.md 9.3 step 5 refuses them
# (with a message whose text is reference-specific); core.md 18 point 4 names the quirk.
NESTED_OVERFLOW = [
    pytest.param(b"[1e400]", id="array"),
    pytest.param(b'{"n":1e400}', id="object"),
    pytest.param(b"[-1e309]", id="negative"),
    pytest.param(b'{"a":[1e10000]}', id="at-the-exponent-bound"),
]

# (input, canonical bytes): core.md 9.1's examples, verified against TestContentHash_Golden.
CANONICAL_GOLDEN = [
    (b'{"b":1,"a":2}', b'{"a":2,"b":1}'),
    (b' { "spaced" : [ 1 , 2 ] } ', b'{"spaced":[1,2]}'),
    (b'{"n":1.50,"m":[1e5,2E-5,-0.0]}', b'{"m":[1e5,2E-5,-0.0],"n":1.50}'),
    (b'"quote \\" backslash \\\\ slash \\/"', b'"quote \\" backslash \\\\ slash /"'),
    (b'"<script>&amp;</script>"', b'"\\u003cscript\\u003e\\u0026amp;\\u003c/script\\u003e"'),
    (b'"\\u00e9"', '"\u00e9"'.encode()),
    (b'"\\ud83d\\ude42"', '"\U0001f642"'.encode()),
    (b'"\\u2028\\u2029"', b'"\\u2028\\u2029"'),
    ('{"B":1,"a":2,"_":3,"\u00e9":4,"e":5,"\U0001f600":6,"\u65e5":7}'.encode(),
     '{"B":1,"_":3,"a":2,"e":5,"\u00e9":4,"\u65e5":7,"\U0001f600":6}'.encode()),
    (b'{"tool":"push","args":{"n":7}}', b'{"args":{"n":7},"tool":"push"}'),
    (b"null", b"null"),
    (b"{}", b"{}"),
]

# (input, canonical bytes): the escaping rules of 9.1 one at a time.
CANONICAL_ESCAPES = [
    pytest.param(b'"\\u0001\\u001F"', b'"\\u0001\\u001f"', id="C0-lower-hex"),
    pytest.param(b'"\\u0000"', b'"\\u0000"', id="NUL"),
    pytest.param(b'"\\u0008\\u000c\\u000A\\u000d\\u0009"', b'"\\b\\f\\n\\r\\t"',
                 id="named-escapes"),
    pytest.param(b'"\\u000b"', b'"\\u000b"', id="vertical-tab"),
    pytest.param(b'"\\u0022\\u005c"', b'"\\"\\\\"', id="quote-backslash"),
    pytest.param(b'"\\u003C\\u003E\\u0026"', b'"\\u003c\\u003e\\u0026"', id="html"),
    pytest.param('"\u2028\u2029"'.encode(), b'"\\u2028\\u2029"', id="raw-line-separators"),
    pytest.param(b'"\\u007f"', b'"\x7f"', id="DEL-raw"),
    pytest.param(b'"\\u0080"', '"\x80"'.encode(), id="C1-raw"),
    pytest.param(b'"\\/"', b'"/"', id="solidus"),
    pytest.param(b'{"<":1}', b'{"\\u003c":1}', id="keys-escaped-too"),
    pytest.param('{"\U0001f600":1,"\uff61":2}'.encode(), '{"\uff61":2,"\U0001f600":1}'.encode(),
                 id="keys-by-utf8-not-utf16"),
]

# Number literals that must come out exactly as written (core.md 9.1, 18 point 1).
LITERALS = ["1.0", "1e0", "1E+2", "-0", "-0.0", "1250.50", "1e-400", "0.10", "1e-5",
            "123456789012345678901234567890", "9007199254740993"]

# (input, PolicyJSON bytes): core.md 9.2's examples.
POLICY_GOLDEN = [
    (b'"\\u003c\\u003e\\u0026"', b'"<>&"'),
    (b"[10, 10.0, 1e1, -0, 1E+2]", b"[10,10.0,1e1,-0,1E+2]"),
    (b'{"b": {"d": 1, "c": [true, null]}, "a": "\\ud83d\\ude42"}',
     '{"a":"\U0001f642","b":{"c":[true,null],"d":1}}'.encode()),
    ('{ "z": {"b": 1.50, "a": "make && rm <x> \u2028 \u00e9 \\u00e9 \u65e5\u672c"}, "n": 1e3 }'
     .encode(),
     '{"n":1e3,"z":{"a":"make && rm <x> \u2028 \u00e9 \u00e9 \u65e5\u672c","b":1.50}}'.encode()),
    (b'"\\u0001\\n\\"\\\\"', b'"\\u0001\\n\\"\\\\"'),
]

HASH_OF = {
    b"{}": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
    b"1": "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b",
    b'{"tool":"push","args":{"n":7}}':
        "9772f8a7199f50b80af49123800a5c7a49e3d97b35a3444f4aa482963cf04333",
    b'{ "args" : { "n" : 7 } , "tool" : "\\u0070ush" }':
        "9772f8a7199f50b80af49123800a5c7a49e3d97b35a3444f4aa482963cf04333",
    b"null": "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",
}
HASH_A1 = "015abd7f5cc57a2dd94b7590f04ad8084273905ee33ec5cebeae62276a97f862"   # {"a":1}
HASH_NULL = HASH_OF[b"null"]


def refusal(raw: bytes) -> JSONError:
    with pytest.raises(JSONError) as info:
        parse_json(raw)
    return info.value


# ---------------------------------------------------------------------------------------------
# The boundary check (core.md 9.3)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, reason, pos", BAD)
def test_refusal_reason_and_position(raw, reason, pos):
    err = refusal(raw)
    assert err.msg.startswith(reason), err.msg
    assert err.pos == pos


@pytest.mark.parametrize("raw, reason, pos", ORDER)
def test_first_failing_check_wins(raw, reason, pos):
    err = refusal(raw)
    assert err.msg.startswith(reason), err.msg
    assert err.pos == pos


@pytest.mark.parametrize("raw, reason, pos", BAD + ORDER)
def test_check_json_refuses(raw, reason, pos):
    with pytest.raises(JSONError) as info:
        check_json(raw)
    assert info.value.msg.startswith(reason)


@pytest.mark.parametrize("raw, reason, pos", BAD + ORDER)
def test_canonical_json_refuses(raw, reason, pos):
    with pytest.raises(JSONError) as info:
        canonical_json(raw)
    assert info.value.msg.startswith(reason)


@pytest.mark.parametrize("raw, reason, pos", BAD + ORDER)
def test_policy_json_refuses(raw, reason, pos):
    with pytest.raises(JSONError) as info:
        policy_json(raw)
    assert info.value.msg.startswith(reason)


@pytest.mark.parametrize("raw, reason, pos", BAD + ORDER)
def test_refused_arguments_have_no_request_key(raw, reason, pos):
    assert request_key("pay", raw) is None


@pytest.mark.parametrize("raw, canonical", ACCEPTED)
def test_accepted_at_the_bounds(raw, canonical):
    check_json(raw)
    assert canonical_json(raw) == canonical


@pytest.mark.parametrize("raw", NESTED_OVERFLOW)
def test_float64_overflow_nested_is_refused(raw):
    with pytest.raises(JSONError):
        check_json(raw)


@pytest.mark.parametrize("raw", NESTED_OVERFLOW)
def test_float64_overflow_nested_has_no_request_key(raw):
    assert request_key("pay", raw) is None


def test_duplicate_key_message_cannot_drive_a_terminal():
    err = refusal(b'{"\\u001b[2J":1,"\\u001b[2J":2}')
    assert err.msg.startswith("duplicate key ")
    assert "\x1b" not in err.msg


# ---------------------------------------------------------------------------------------------
# JSONError
# ---------------------------------------------------------------------------------------------

MULTILINE = b'{\n  "k": "\xc3\xa9", x\n}'      # 'x' is byte 15: line 2, byte column 14


def test_json_error_is_a_value_error():
    assert isinstance(refusal(MULTILINE), ValueError)


def test_json_error_fields_on_a_multi_line_input():
    err = refusal(MULTILINE)
    assert err.msg.startswith(SYNTAX)
    assert (err.pos, err.lineno, err.colno) == (15, 2, 14)
    assert err.msg in str(err)


def test_json_error_position_of_a_duplicate_on_line_three():
    err = refusal(b'{\n "a": 1,\n  "a": 2\n}')
    assert (err.msg, err.pos, err.lineno, err.colno) == ('duplicate key "a"', 13, 3, 3)


def test_json_error_position_counts_bytes_before_invalid_utf8():
    err = refusal(b'["\xe6\x97\xa5",\n"\xff"]')
    assert (err.msg, err.pos, err.lineno, err.colno) == (UTF8, 9, 2, 2)


# ---------------------------------------------------------------------------------------------
# Canonical form (core.md 9.1)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, canonical", CANONICAL_GOLDEN)
def test_canonical_golden(raw, canonical):
    assert canonical_json(raw) == canonical


@pytest.mark.parametrize("raw, canonical", CANONICAL_ESCAPES)
def test_canonical_escaping(raw, canonical):
    assert canonical_json(raw) == canonical


@pytest.mark.parametrize("literal", LITERALS)
def test_canonical_keeps_number_literals(literal):
    raw = f'{{"n": {literal} , "m" : [ {literal} ]}}'.encode()
    assert canonical_json(raw) == f'{{"m":[{literal}],"n":{literal}}}'.encode()


@pytest.mark.parametrize("literal", LITERALS)
def test_parse_keeps_number_literals(literal):
    assert parse_json(literal.encode()).text == literal


@pytest.mark.parametrize("raw, reason", [
    (b'{"a":2,"a":1}', 'duplicate key "a"'),
    (b'{"a":1} trailing', SYNTAX + "data after the value"),
    (b"", SYNTAX + "no value"),
])
def test_public_canonical_json_refuses_what_the_internal_step_tolerates(raw, reason):
    with pytest.raises(JSONError) as info:
        canonical_json(raw)
    assert info.value.msg == reason


@pytest.mark.parametrize("raw, digest", HASH_OF.items())
def test_content_hash_golden(raw, digest):
    assert content_hash(raw) == digest


@pytest.mark.parametrize("raw, digest", HASH_OF.items())
def test_golden_hash_is_sha256_of_canonical_form(raw, digest):
    assert hashlib.sha256(canonical_json(raw)).hexdigest() == digest


def test_content_hash_of_bytes_that_are_not_json_is_their_sha256():
    assert content_hash(b"not json") == hashlib.sha256(b"not json").hexdigest()


@pytest.mark.parametrize("raw, digest", [
    pytest.param(b'{"a":2,"a":1}', HASH_A1, id="repeated-key-keeps-last"),
    pytest.param(b'{"a":1} trailing', HASH_A1, id="trailing-data-ignored"),
    pytest.param(b"", HASH_NULL, id="empty"),
    pytest.param(b" \n\t ", HASH_NULL, id="whitespace"),
])
def test_content_hash_uses_the_internal_canonical_step(raw, digest):
    assert content_hash(raw) == digest


# ---------------------------------------------------------------------------------------------
# PolicyJSON (core.md 9.2)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, policy", POLICY_GOLDEN)
def test_policy_json_golden(raw, policy):
    assert policy_json(raw) == policy


@pytest.mark.parametrize("raw, policy", POLICY_GOLDEN)
def test_policy_json_same_from_canonical_form(raw, policy):
    assert policy_json(canonical_json(raw)) == policy


def test_policy_json_for_a_schema_keeps_the_last_repeated_key():
    assert policy_json(b'{"a":2, "a":1}', strict=False) == b'{"a":1}'


# ---------------------------------------------------------------------------------------------
# Request keys (proxy.md 5.1; 17.2 rows 42 and 43)
# ---------------------------------------------------------------------------------------------

BASE_ARGS = b'{"account":"a-1","amount":10,"items":[1,2],"rate":1.5}'


def test_request_key_is_sha256_of_tool_zero_byte_canonical_args():
    expected = hashlib.sha256(b"push\x00" + b'{"args":{"n":7},"tool":"push"}').hexdigest()
    assert request_key("push", b'{"tool":"push","args":{"n":7}}') == expected


def test_canonical_by_literal():
    """Row 42, TestRequestKey_CanonicalByLiteral."""
    key = request_key("bank_pay", BASE_ARGS)
    same = [
        b'{"rate":1.5,"items":[1,2],"amount":10,"account":"a-1"}',
        b'{ "account" : "a-1" ,\n\t"amount": 10, "items": [ 1 , 2 ], "rate": 1.5 }\n',
        b'{"\\u0061ccount":"\\u0061-1","amount":10,"items":[1,2],"r\\u0061te":1.5}',
    ]
    different = [
        ("bank_pay", b'{"account":"A-1","amount":10,"items":[1,2],"rate":1.5}'),
        ("bank_pay", b'{"account":"a-1 ","amount":10,"items":[1,2],"rate":1.5}'),
        ("bank_pay", b'{"account":"a-1","amount":10.0,"items":[1,2],"rate":1.5}'),
        ("bank_pay", b'{"account":"a-1","amount":1e1,"items":[1,2],"rate":1.5}'),
        ("bank_pay", b'{"account":"a-1","amount":10,"items":[1,2],"rate":1.50}'),
        ("bank_pay", b'{"account":"a-1","amount":"10","items":[1,2],"rate":1.5}'),
        ("bank_pay", b'{"account":"a-1","amount":10,"items":[2,1],"rate":1.5}'),
        ("bank_pay", b'{"account":"a-1","amount":-10,"items":[1,2],"rate":1.5}'),
        ("bank_refund", BASE_ARGS),
    ]
    assert key is not None and len(key) == 64
    assert [request_key("bank_pay", raw) for raw in same] == [key] * len(same)
    keys = [request_key(tool, raw) for tool, raw in different]
    assert None not in keys
    assert len(set(keys + [key])) == len(keys) + 1


NO_COLLISION_PAIRS = [
    ("-0", "0"), ("-0.0", "0e5"), ("1.0", "1"), ("0.10", "0.1"), ("1e+2", "100"),
    ("1E2", "100"), (str(2**53 + 1), str(2**53)), ("1250.5", "1250.50"),
]
NO_KEY = [
    b'{"n":1e9223372036854775807}', b'{"n":0.1e-9223372036854775808}', b'{"n":1e-10000000}',
    b'{"n":1e99999}', b'{"a":1,"a":2}', b'{"s":"\\ud800"}', b'{"s":"\\udc00"}',
    b'{"s":"\xff"}', b'{"s":"\xfe"}', b'{"n":1}x', b'{"n":00}',
]


def test_no_collisions():
    """Row 43, TestRequestKey_NoCollisions."""
    pairs = [(f'{{"n":{a}}}'.encode(), f'{{"n":{b}}}'.encode()) for a, b in NO_COLLISION_PAIRS]
    pairs += [(b'{"x":null}', b"{}"), (b"[1,2]", b"[2,1]"), (b'{"a":[1,2]}', b'{"a":[2,1]}')]
    for left, right in pairs:
        kl, kr = request_key("t", left), request_key("t", right)
        assert kl is not None and kr is not None, (left, right)
        assert kl != kr, (left, right)
    assert [request_key("t", raw) for raw in NO_KEY] == [None] * len(NO_KEY)


# ---------------------------------------------------------------------------------------------
# Random values: the canonical form is a function of the value alone
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Number:
    """A generated number, kept as the literal it is written with."""
    text: str


STRING_POOL = ["a", "Z", " ", "0", '"', "\\", "/", "<", ">", "&", "\x00", "\x08", "\t", "\n",
               "\x0c", "\r", "\x1b", "\x1f", "\x7f", "\x80", "\u00e9", "\u00df", "\u65e5",
               "\u2028", "\u2029", "\ufeff", "\ufffd", "\uff61", "\U0001f642", "\U0001f600",
               "\U0010ffff", "\u0301"]
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n",
                 "\r": "\\r", "\t": "\\t"}
CANONICAL_NAMED = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n",
                   "\r": "\\r", "\t": "\\t"}
HTML_SAFE = {"<", ">", "&", "\u2028", "\u2029"}
WHITESPACE = ["", "", " ", "\t", "\n", "\r\n  "]


def random_number(rng: random.Random) -> Number:
    def digits(n: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(n))

    text = rng.choice(["", "-"])
    text += "0" if rng.random() < 0.3 else str(rng.randrange(1, 10)) + digits(rng.randrange(20))
    if rng.random() < 0.5:
        text += "." + digits(rng.randrange(1, 6))
    if rng.random() < 0.4:    # exponents stay small: nested float64 overflow is its own test
        text += rng.choice("eE") + rng.choice(["", "+", "-"]) + "0" * rng.randrange(3)
        text += str(rng.randrange(100))
    return Number(text)


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(STRING_POOL) for _ in range(rng.randrange(8)))


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["null", "true", "false", "number", "string"]
    if depth < 4:
        kinds += ["array", "object"] * (3 if depth == 0 else 1)
    kind = rng.choice(kinds)
    if kind == "array":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == "object":
        return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(5))}
    if kind == "number":
        return random_number(rng)
    if kind == "string":
        return random_string(rng)
    return {"null": None, "true": True, "false": False}[kind]


def u_escape(code: int, rng: random.Random) -> str:
    hex4 = f"{code:04x}"
    return "\\u" + (hex4.upper() if rng.random() < 0.5 else hex4)


def spell_char(ch: str, rng: random.Random) -> str:
    """One of the valid spellings of ``ch`` inside a JSON string, chosen at random."""
    code = ord(ch)
    options = [ch] if ch not in '"\\' and code >= 0x20 else []
    if ch in SHORT_ESCAPES:
        options.append(SHORT_ESCAPES[ch])
    if code > 0xFFFF:
        code -= 0x10000
        high, low = 0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)
        options.append(u_escape(high, rng) + u_escape(low, rng))
    else:
        options.append(u_escape(code, rng))
    return rng.choice(options)


def spell(value, rng: random.Random) -> str:
    """JSON text for ``value`` with random whitespace, key order and escape spellings."""
    def ws() -> str:
        return rng.choice(WHITESPACE)

    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, Number):
        return value.text
    if isinstance(value, str):
        return '"' + "".join(spell_char(ch, rng) for ch in value) + '"'
    if isinstance(value, list):
        return "[" + ws() + ",".join(ws() + spell(v, rng) + ws() for v in value) + "]"
    keys = list(value)
    rng.shuffle(keys)
    members = [ws() + spell(k, rng) + ws() + ":" + ws() + spell(value[k], rng) + ws() for k in keys]
    return "{" + ws() + ",".join(members) + "}"


def expected_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in CANONICAL_NAMED:
            out.append(CANONICAL_NAMED[ch])
        elif ord(ch) < 0x20 or ch in HTML_SAFE:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def expected_canonical(value) -> str:
    """core.md 9.1, written independently of the module."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, Number):
        return value.text
    if isinstance(value, str):
        return expected_string(value)
    if isinstance(value, list):
        return "[" + ",".join(expected_canonical(v) for v in value) + "]"
    keys = sorted(value, key=lambda k: k.encode("utf-8"))
    members = [expected_string(k) + ":" + expected_canonical(value[k]) for k in keys]
    return "{" + ",".join(members) + "}"


RANDOM_VALUES = [random_value(random.Random(20_240_917 + i)) for i in range(300)]


def spellings(index: int, count: int) -> list[bytes]:
    rng = random.Random(index)
    return [spell(RANDOM_VALUES[index], rng).encode() for _ in range(count)]


def test_random_values_canonical_form_follows_the_rules():
    for i, value in enumerate(RANDOM_VALUES):
        raw = spellings(i, 1)[0]
        assert canonical_json(raw) == expected_canonical(value).encode(), raw


def test_random_values_canonical_form_is_idempotent():
    for i in range(len(RANDOM_VALUES)):
        canon = canonical_json(spellings(i, 1)[0])
        assert canonical_json(canon) == canon, canon


def test_random_values_canonical_form_ignores_key_order_whitespace_and_escapes():
    for i in range(len(RANDOM_VALUES)):
        first, *others = spellings(i, 4)
        assert all(canonical_json(raw) == canonical_json(first) for raw in others), first


def test_random_values_canonical_form_keeps_the_value():
    for i in range(len(RANDOM_VALUES)):
        raw = spellings(i, 1)[0]
        assert json.loads(canonical_json(raw)) == json.loads(raw), raw


def test_random_values_policy_json_keeps_the_value():
    for i in range(len(RANDOM_VALUES)):
        raw = spellings(i, 1)[0]
        assert json.loads(policy_json(raw)) == json.loads(raw), raw


def test_random_values_are_not_all_trivial():
    containers = [v for v in RANDOM_VALUES if isinstance(v, (list, dict)) and v]
    assert len(containers) > 100
