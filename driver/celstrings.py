"""The CEL string functions Kubernetes adds to every selector's environment.

Since 1.29 Kubernetes' base CEL environment carries cel-go's strings extension at version 2
(``ext.Strings(ext.StringsVersion(2))`` in ``k8s.io/apiserver/pkg/cel/environment``), and the
DRA environment is built on it. The interpreter ``driver.cel`` uses has only CEL's standard
string functions, so a selector as common as NVIDIA's documented
``device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')`` would be a
runtime error in carve's controller while kube-scheduler evaluates it. This module supplies the
extension's functions with the semantics of cel-go's ``ext/strings.go`` (current releases):
indices count code points, not bytes, and a negative index is an error. ``indexOf`` and
``lastIndexOf`` on a list are Kubernetes' lists library (first and last index of an element).
``format`` and ``strings.quote`` are not provided; using them stays the runtime error it was.

Each function raises TypeError or ValueError for bad input; ``driver.cel`` turns that into the
selector's runtime error.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

__all__ = ["STRING_FUNCTIONS"]

# Go's unicode.IsSpace, which cel-go's trim() uses: the Latin-1 spaces plus Unicode's White_Space
_LATIN1_SPACE = frozenset("\t\n\v\f\r \x85\xa0")


def _text(value: object, fn: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{fn}() needs a string, got {type(value).__name__}")
    return value


def _int(value: object, fn: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}() needs an int, got {type(value).__name__}")
    return value


def _char_at(s: object, index: object) -> str:
    text, i = _text(s, "charAt"), _int(index, "charAt")
    if not 0 <= i <= len(text):
        raise ValueError(f"charAt(): index out of range: {i}")
    return text[i : i + 1]


def _index_of(s: object, sub: object, offset: object = 0) -> int:
    if isinstance(s, list):
        return next((i for i, item in enumerate(s) if item == sub), -1)
    text, needle, start = _text(s, "indexOf"), _text(sub, "indexOf"), _int(offset, "indexOf")
    if not needle:
        return start
    if start < 0:
        raise ValueError(f"indexOf(): index out of range: {start}")
    if start >= len(text):
        return -1
    return text.find(needle, start)


def _last_index_of(s: object, sub: object, offset: object = None) -> int:
    if isinstance(s, list):
        return next((i for i in range(len(s) - 1, -1, -1) if s[i] == sub), -1)
    text, needle = _text(s, "lastIndexOf"), _text(sub, "lastIndexOf")
    if offset is None:
        if not needle:
            return len(text)
        end = len(text) - 1
    else:
        end = _int(offset, "lastIndexOf")
        if not needle:
            return end
    if end < 0:
        raise ValueError(f"lastIndexOf(): index out of range: {end}")
    if end >= len(text):
        return -1
    # the last match starting at or before `end`
    return text.rfind(needle, 0, min(end, len(text) - len(needle)) + len(needle))


def _lower_ascii(s: object) -> str:
    text = _text(s, "lowerAscii")
    return "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in text)


def _upper_ascii(s: object) -> str:
    text = _text(s, "upperAscii")
    return "".join(chr(ord(c) - 32) if "a" <= c <= "z" else c for c in text)


def _replace(s: object, old: object, new: object, n: object = -1) -> str:
    text, count = _text(s, "replace"), _int(n, "replace")
    return text.replace(_text(old, "replace"), _text(new, "replace"), count if count >= 0 else -1)


def _split(s: object, sep: object, n: object = -1) -> list[str]:
    text, separator, limit = _text(s, "split"), _text(sep, "split"), _int(n, "split")
    if limit == 0:
        return []
    if not separator:  # Go splits into code points; the last part keeps the rest
        parts = list(text)
        if 0 < limit < len(parts):
            parts = [*parts[: limit - 1], "".join(parts[limit - 1 :])]
        return parts
    return text.split(separator, limit - 1 if limit > 0 else -1)


def _substring(s: object, start: object, end: object = None) -> str:
    text, first = _text(s, "substring"), _int(start, "substring")
    last = len(text) if end is None else _int(end, "substring")
    if not 0 <= first <= last <= len(text):
        raise ValueError(f"substring(): range [{first}:{last}] out of range for {len(text)}")
    return text[first:last]


def _is_space(c: str) -> bool:
    if c <= "\xff":
        return c in _LATIN1_SPACE
    return unicodedata.category(c) in ("Zs", "Zl", "Zp")


def _trim(s: object) -> str:
    text = _text(s, "trim")
    first = 0
    while first < len(text) and _is_space(text[first]):
        first += 1
    last = len(text)
    while last > first and _is_space(text[last - 1]):
        last -= 1
    return text[first:last]


def _join(items: object, sep: object = "") -> str:
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise TypeError("join() needs a list of strings")
    return _text(sep, "join").join(items)


STRING_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "lowerAscii": _lower_ascii,
    "upperAscii": _upper_ascii,
    "replace": _replace,
    "split": _split,
    "substring": _substring,
    "trim": _trim,
    "join": _join,
}
"""Function name -> implementation, for the interpreter's custom functions (receiver first)."""
