"""The strict parser's engine and the text cap, measured in what they do, never timed.

- The nesting pre-check keeps no stack per character of a string: a 4 MB string holding
  brackets costs memory of the order of the frame (the regex it replaced kept about 120
  bytes a character).
- Unpaired surrogate escapes are found in the text: a backslash that is itself escaped
  begins no escape.
- Capping a text finds the cut in one pass: the characters encoded do not grow with the
  text's length.
"""

import json
import tracemalloc

import pytest

import agentrt_proxy as ap

FRAMES_BEYOND_JSON = 2      # peak memory a parse may add past json.loads's own, in frames
BRACKETS = 2_000_000


@pytest.mark.parametrize("frame", [
    pytest.param(b'{"s":"' + b"[{" * BRACKETS + b'"}', id="string-of-brackets"),
    pytest.param(b'{"s":"' + b'[\\"{' * (BRACKETS // 2) + b'"}', id="brackets-and-escapes"),
    pytest.param(b'{"s":"' + b"[{" * BRACKETS + b'",}', id="refused-after-it"),
])
def test_a_long_string_holding_brackets_costs_memory_linear_in_the_frame(frame):
    def peak(parse) -> int:
        tracemalloc.start()
        try:
            try:
                parse(frame)
            except ValueError as exc:           # JSONError, and json's own
                assert "trailing comma" in exc.msg or "double quotes" in exc.msg, exc.msg
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    ours, theirs = peak(ap.parse_json), peak(json.loads)
    assert ours <= theirs + FRAMES_BEYOND_JSON * len(frame), \
        f"{ours} bytes for a {len(frame)}-byte frame (json.loads: {theirs})"


def test_too_deep_beside_long_strings_of_brackets_is_found_where_it_is():
    frame = b'["' + b"[" * 1000 + b'",' + b"[" * 256 + b"]" * 256 + b"]"
    with pytest.raises(ap.JSONError) as info:
        ap.parse_json(frame)
    assert info.value.msg == "nested deeper than 256 levels"
    assert info.value.pos == len(b'["' + b"[" * 1000 + b'",') + 255


@pytest.mark.parametrize("raw, pos", [
    (b'"\\\\\\ud800"', 3),                 # an escaped backslash, then a lone escape
    (b'"\\\\\\\\\\udc00x"', 5),
    (b'["\\\\ud800", "\\ud800"]', 13),      # the first is text after an escaped backslash
])
def test_a_lone_surrogate_escape_after_escaped_backslashes_is_refused(raw, pos):
    with pytest.raises(ap.JSONError) as info:
        ap.parse_json(raw)
    assert info.value.msg.startswith("unpaired surrogate \\u")
    assert info.value.pos == pos


@pytest.mark.parametrize("raw, text", [
    (b'"\\\\ud800"', "\\ud800"),
    (b'"\\\\\\\\ud83d\\ude00"', "\\\\ud83d\\ude00".replace("\\ude00", "\ude00")),
])
def test_text_after_an_escaped_backslash_is_no_escape(raw, text):
    if "\ude00" in text:          # a lone low escape after the text: refused
        with pytest.raises(ap.JSONError):
            ap.parse_json(raw)
    else:
        assert ap.parse_json(raw) == text


def capped(text: str, limit: int) -> tuple[bytes, bool]:
    """cap_text's text as the record holds it: a JSON string in policy form."""
    shown, cut = ap.cap_text(text, limit)
    return ap.encode_policy(shown), cut


@pytest.mark.parametrize("unit", ["a", "\n", '"', "\u00e9", "\U0001f600", "\x85", "\u2028"])
def test_capping_a_text_encodes_a_bounded_prefix_once(unit, monkeypatch):
    encoded = [0]
    real = ap._wire_str

    def counted(text):
        encoded[0] += len(text)
        return real(text)
    monkeypatch.setattr(ap, "_wire_str", counted)
    limit = 4096
    text = unit * 1_000_000
    content, cut = capped(text, limit)
    assert cut and len(content) <= limit
    assert encoded[0] <= 2 * limit, f"{encoded[0]} characters encoded to cap at {limit}"
    kept = ap.parse_json(content)
    assert kept.endswith(ap.TRUNCATION_MARKER)
    assert text.startswith(kept[:-len(ap.TRUNCATION_MARKER)])
    one_more = kept[:-len(ap.TRUNCATION_MARKER)] + unit + ap.TRUNCATION_MARKER
    assert ap._wire_len(one_more) > limit           # the longest prefix that fits
