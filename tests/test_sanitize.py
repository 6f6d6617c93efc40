"""Sanitising and bounding text a model, a server or an operator chose.

Specification: reference/core.md 14.1 (Sanitize) and reference/proxy.md 8.2 (clean: sanitise,
then cut to at most n UTF-8 bytes on a character boundary, appending U+2026 when cut).
"""

import random
import unicodedata

import pytest

from agentrt_proxy import clean, sanitize, truncate

# ---------------------------------------------------------------------------------------------
# Shared tables
# ---------------------------------------------------------------------------------------------

ELLIPSIS = "\u2026"
ACUTE = "\u0301"                      # a combining mark (Mn)

# (input, output): controls, each one written \xHH with two lower-case digits.
CONTROLS = [
    pytest.param("\t", "\\x09", id="TAB"),
    pytest.param("\x1b", "\\x1b", id="ESC"),
    pytest.param("\x07", "\\x07", id="BEL"),
    pytest.param("\x00", "\\x00", id="NUL"),
    pytest.param("\x0b", "\\x0b", id="VT"),
    pytest.param("\x0c", "\\x0c", id="FF"),
    pytest.param("\x1f", "\\x1f", id="last-C0"),
    pytest.param("\x7f", "\\x7f", id="DEL"),
    pytest.param("\x80", "\\x80", id="first-C1"),
    pytest.param("\x85", "\\x85", id="NEL"),
    pytest.param("\x9b", "\\x9b", id="CSI"),
    pytest.param("\x9f", "\\x9f", id="last-C1"),
]

# Every invisible or bidirectional range of 14.1, at both ends: written \u{hhhh}.
INVISIBLE = [0x202A, 0x202E, 0x2066, 0x2069, 0x061C, 0x200E, 0x200F, 0x200B, 0x200D,
             0x2060, 0x2064, 0xFEFF, 0x00AD, 0x180E, 0x2028, 0x2029, 0xE0000, 0xE0001,
             0xE007F]

# Neighbours of those ranges and of the control ranges, passed through verbatim.
VERBATIM = [" ", "~", "\xa0", "\xac", "\xae", "\u061b", "\u061d", "\u200a", "\u2010",
            "\u2027", "\u202f", "\u205f", "\u2065", "\u206a", "\ufefe", "\uff00", "\U000e0080",
            "\ufffd", "\u00e9", "\u65e5", "\U0001f642"]

# (bytes, output): each maximal run of invalid bytes becomes one U+FFFD.
INVALID_BYTES = [
    pytest.param(b"a\xffb", "a\ufffdb", id="ff"),
    pytest.param(b"a\xfeb", "a\ufffdb", id="fe"),
    pytest.param(b"a\xff\xfeb", "a\ufffdb", id="two-bytes-one-run"),
    pytest.param(b"a\xe2\x82", "a\ufffd", id="truncated-multibyte-at-end"),
    pytest.param(b"\xe2\x82x", "\ufffdx", id="truncated-multibyte"),
    pytest.param(b"\xed\xa0\x80", "\ufffd", id="encoded-surrogate"),
    pytest.param(b"\xc0\xaf", "\ufffd", id="overlong"),
    pytest.param(b"\xf4\x90\x80\x80", "\ufffd", id="beyond-10ffff"),
    pytest.param(b"\xff\xe2\x82\xed\xa0\x80\xc0\xaf", "\ufffd", id="mixed-run"),
    pytest.param(b"\xff\xc3\xa9\xff", "\ufffd\u00e9\ufffd", id="runs-split-by-valid"),
    pytest.param(b"\xef\xbf\xbd\xff", "\ufffd\ufffd", id="real-fffd-then-bad"),
    pytest.param(b"\x1b\xff\n", "\\x1b\ufffd ", id="then-escaped"),
]

# (input, output): combining-mark runs keep their first four.
COMBINING = [
    pytest.param("e" + ACUTE * 4, "e" + ACUTE * 4, id="four-kept"),
    pytest.param("e" + ACUTE * 5 + "x", "e" + ACUTE * 4 + "[+1 combining marks dropped]x",
                 id="five"),
    pytest.param("e" + ACUTE * 6 + "x", "e" + ACUTE * 4 + "[+2 combining marks dropped]x",
                 id="six"),
    pytest.param("e" + ACUTE * 6, "e" + ACUTE * 4 + "[+2 combining marks dropped]",
                 id="six-at-end"),
    pytest.param("e" + ACUTE * 6 + "\n", "e" + ACUTE * 4 + "[+2 combining marks dropped] ",
                 id="six-then-newline"),
    pytest.param("a" + ACUTE * 3 + "b" + ACUTE * 3, "a" + ACUTE * 3 + "b" + ACUTE * 3,
                 id="two-short-runs"),
    pytest.param("a" + ACUTE * 5 + "b" + ACUTE * 7,
                 "a" + ACUTE * 4 + "[+1 combining marks dropped]b" + ACUTE * 4
                 + "[+3 combining marks dropped]", id="two-long-runs"),
    pytest.param("\u0915" + "\u0903\u20dd\u0301\u0903\u20dd\u0301",
                 "\u0915\u0903\u20dd\u0301\u0903[+2 combining marks dropped]",
                 id="Mc-Me-Mn-mixed"),
    pytest.param(ACUTE * 6, ACUTE * 4 + "[+2 combining marks dropped]", id="no-base"),
]

# Text that needs nothing: the same object comes back.
CLEAN_TEXT = ["", "plain ascii", "caf\u00e9 \u65e5\u672c \U0001f642", "\\u001b[2J",
              "\\x1b and \\u{202e} as typed", "\u00e9" + " tab\\t"]

# (text, n, clean(text, n)).
BOUNDED = [
    pytest.param("abc", 3, "abc", id="fits-exactly"),
    pytest.param("abcd", 3, "abc" + ELLIPSIS, id="ascii-cut"),
    pytest.param("ab\u00e9cd", 3, "ab" + ELLIPSIS, id="two-byte-not-split"),
    pytest.param("ab\u00e9cd", 4, "ab\u00e9" + ELLIPSIS, id="two-byte-kept"),
    pytest.param("\u65e5\u672c\u8a9e", 4, "\u65e5" + ELLIPSIS, id="three-byte-4"),
    pytest.param("\u65e5\u672c\u8a9e", 5, "\u65e5" + ELLIPSIS, id="three-byte-5"),
    pytest.param("\u65e5\u672c\u8a9e", 6, "\u65e5\u672c" + ELLIPSIS, id="three-byte-6"),
    pytest.param("\u65e5\u672c\u8a9e", 9, "\u65e5\u672c\u8a9e", id="three-byte-fits"),
    pytest.param("\U0001f642\U0001f642", 7, "\U0001f642" + ELLIPSIS, id="four-byte"),
    pytest.param("\u00e9", 1, ELLIPSIS, id="nothing-fits"),
    pytest.param("abc", 0, ELLIPSIS, id="zero"),
]


# ---------------------------------------------------------------------------------------------
# Sanitize (core.md 14.1)
# ---------------------------------------------------------------------------------------------

def test_line_breaks_become_spaces():
    assert sanitize("line one\nline two\r\nline three") == "line one line two  line three"


def test_lone_carriage_return_becomes_a_space():
    assert sanitize("a\rb") == "a b"


@pytest.mark.parametrize("char, escaped", CONTROLS)
def test_control_written_as_hex_byte(char, escaped):
    assert sanitize("<" + char + ">") == "<" + escaped + ">"


@pytest.mark.parametrize("code", INVISIBLE, ids=lambda c: f"U+{c:04X}")
def test_invisible_and_bidi_written_as_code_point(code):
    assert sanitize("<" + chr(code) + ">") == f"<\\u{{{code:04x}}}>"


def test_tag_character_written_with_five_hex_digits():
    assert sanitize("x\U000e0001y") == "x\\u{e0001}y"


def test_short_code_points_padded_to_four_digits():
    assert sanitize("\u00ad\u061c") == "\\u{00ad}\\u{061c}"


@pytest.mark.parametrize("char", VERBATIM, ids=lambda c: f"U+{ord(c):04X}")
def test_neighbours_of_escaped_ranges_pass_verbatim(char):
    assert sanitize("<" + char + ">") == "<" + char + ">"


def test_escape_sequence_is_made_inert():
    assert sanitize("x\x1b[2J\u202ey") == "x\\x1b[2J\\u{202e}y"


def test_escape_sequence_typed_as_text_is_untouched():
    text = "literal \\u001b[2J and \\x1b"
    assert sanitize(text) == "literal \\u001b[2J and \\x1b"


@pytest.mark.parametrize("raw, text", INVALID_BYTES)
def test_each_run_of_invalid_bytes_becomes_one_replacement(raw, text):
    assert sanitize(raw) == text


def test_lone_surrogates_in_a_str_become_one_replacement():
    assert sanitize("a\ud800\udfffb") == "a\ufffdb"


def test_valid_utf8_bytes_are_decoded():
    assert sanitize("caf\u00e9 \U0001f642".encode()) == "caf\u00e9 \U0001f642"


@pytest.mark.parametrize("text, out", COMBINING)
def test_combining_mark_runs_keep_four(text, out):
    assert sanitize(text) == out


@pytest.mark.parametrize("text", CLEAN_TEXT)
def test_fast_path_returns_the_same_object(text):
    assert sanitize(text) is text


def test_no_length_bound():
    text = "a" * 100_000 + "\n"
    assert sanitize(text) == "a" * 100_000 + " "


HOSTILE_POOL = ["a", " ", "\n", "\r", "\t", "\x1b", "\x00", "\x7f", "\x85", "\x9b", "\u202e",
                "\u2066", "\u200b", "\ufeff", "\u2028", "\U000e0041", ACUTE, "\u20dd",
                "\u0903", "\u00e9", "\U0001f642", "\ud800"]
FORBIDDEN = {chr(c) for c in range(0x20)} | {chr(c) for c in range(0x7F, 0xA0)} | {
    chr(c) for c in [0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069,
                     0x061C, 0x200E, 0x200F, 0x200B, 0x200C, 0x200D, 0x2060, 0x2061, 0x2062,
                     0x2063, 0x2064, 0xFEFF, 0x00AD, 0x180E, 0x2028, 0x2029]
} | {chr(c) for c in range(0xE0000, 0xE0080)} | {chr(c) for c in range(0xD800, 0xE000)}


def longest_mark_run(text: str) -> int:
    best = run = 0
    for ch in text:
        run = run + 1 if unicodedata.category(ch).startswith("M") else 0
        best = max(best, run)
    return best


def test_random_hostile_text_comes_out_inert():
    rng = random.Random(141)
    for _ in range(500):
        text = "".join(rng.choice(HOSTILE_POOL) for _ in range(rng.randrange(30)))
        out = sanitize(text)
        assert not FORBIDDEN & set(out), (text, out)
        assert longest_mark_run(out) <= 4, (text, out)


# ---------------------------------------------------------------------------------------------
# clean and truncate (proxy.md 8.2)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, n, out", BOUNDED)
def test_clean_cuts_on_a_character_boundary(text, n, out):
    assert clean(text, n) == out


@pytest.mark.parametrize("text, n, out", BOUNDED)
def test_truncate_cuts_on_a_character_boundary(text, n, out):
    assert truncate(text, n) == out


def test_clean_sanitises_before_cutting():
    # "\x1b\x1b" sanitises to the 8 characters \x1b\x1b; the cut then counts those.
    assert clean("\x1b\x1b", 6) == "\\x1b\\x" + ELLIPSIS


def test_clean_reads_invalid_bytes():
    assert clean(b"ab\xff\xfecd\n", 100) == "ab\ufffdcd "


def test_truncate_does_not_sanitise():
    assert truncate("\x1b[2J\n", 100) == "\x1b[2J\n"


def test_clean_bounds_random_text():
    rng = random.Random(82)
    pool = HOSTILE_POOL[:-1] + ["\u65e5", "b"]
    for _ in range(500):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(40)))
        n = rng.randrange(60)
        full, out = sanitize(text), clean(text, n)
        if len(full.encode()) <= n:
            assert out == full
            continue
        kept = out[:-1]
        assert out.endswith(ELLIPSIS) and full.startswith(kept), (text, n, out)
        assert len(kept.encode()) <= n < len(full[:len(kept) + 1].encode()), (text, n, out)


# ---- The log, faults found in review ---------------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

import io  # noqa: E402

import agentrt_proxy as ap  # noqa: E402


def test_log_lines_are_sanitised():
    """6e5e37a: text in the proxy's log lines (server names, errors a server wrote) reached
    the operator's terminal raw, escape sequences and line breaks included (mcp.md 9.5)."""
    out, err = io.StringIO(), io.StringIO()
    ap.Out(out, err).log('server "x\x1b]0;pwned\x07": error: a\nagentrt-proxy: forged line')
    text = err.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert text.count("\n") == 1 and text.endswith("\n"), repr(text)
