"""Where xgrammar 0.2.9 lets through what JSON (Schema) forbids, and what the engine does instead.

Each loose spot was found by an output that failed to validate, and each fix is shown by a test
that feeds xgrammar alone and then the fixed grammar the offending text
(tests/test_structured_outputs.py, test_xgrammar_looseness_is_worked_around):

- strings: with minLength/maxLength xgrammar spells a string's characters [^"\\\r\n], which lets raw
  control characters (U+0000-U+001F) through, invalid in JSON (a model wrote \x05 there); and every
  string admits UTF-16 surrogates (U+D800-U+DFFF, bytes ED A0-BF ..), which are no UTF-8: decoded,
  each byte becomes U+FFFD and a 12-character name grew to 14. `strict_json_strings` rewrites the
  grammar's text without them and parses it again. (Strings under a `pattern` are matched by
  xgrammar's regex engine, which excludes control characters; its negated classes and "." still
  admit surrogates, which only a model that writes raw bytes produces.)
- patterns: `a(x[0-9]{1,3})?b` also matches "a12b" (an optional group loses its first character
  before a repetition); the counted form `(...){0,1}` is matched right (`optional_groups_counted`).
- formats: date and date-time allow day 31 in every month, ipv4 leading zeros; they become exact
  patterns (FORMAT_PATTERNS, applied by `schema_for_xgrammar`).

Pure Python, but strict_json_strings takes and returns xgrammar Grammars.
"""

from __future__ import annotations

_STRING_CHAR_REWRITES = {
    '[^\\"\\\\\\r\\n]': '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]',
    '[^\\0-\\x1f\\"\\\\\\r\\n]': '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]',
}

# Patterns that hold exactly the valid values: RFC 3339 dates with the days each month has, leap
# years included, years 0001-9999 (Python's dates have no year 0); dotted quads without leading
# zeros. Fractions of a second get at most 9 digits (a model could write digits to its token budget).
_DAY = "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = f"({_YEAR}-{_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
}


def strict_json_strings(grammar):
    """`grammar` with JSON strings that admit neither control characters nor surrogates."""
    text = original = str(grammar)
    for loose, strict in _STRING_CHAR_REWRITES.items():
        text = text.replace(loose, strict)
    if text == original:
        return grammar
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(text)


def schema_for_xgrammar(node):
    """A copy of a schema for xgrammar: string formats of FORMAT_PATTERNS become their patterns
    (where the schema gives no pattern of its own), and patterns are spelled as
    optional_groups_counted says."""
    if isinstance(node, list):
        return [schema_for_xgrammar(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: schema_for_xgrammar(v) for k, v in node.items()}
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in node:
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    if isinstance(out.get("pattern"), str):
        out["pattern"] = optional_groups_counted(out["pattern"])
    return out


def optional_groups_counted(pattern: str) -> str:
    """`(...)?` spelled `(...){0,1}`; escapes and character classes are left as they are."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]" or pattern[i + 1:i + 3] == "^]":  # a leading ']' is a member
                j = i + 2 if pattern[i + 1] == "]" else i + 3
                out.append(pattern[i:j])
                i = j
                continue
        elif c == ")" and pattern[i + 1:i + 2] == "?" and pattern[i + 2:i + 3] != "?":
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)
