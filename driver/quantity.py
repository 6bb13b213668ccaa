"""Kubernetes quantities ("40Gi", "500m", "1e3") as exact numbers: the one parser carve has.

The controller reads them from pods, claims and ResourceSlices, the CEL library from
selectors, the slice reader from counters; all need the same answer the apiserver gives, and
the pure core must not import the Kubernetes client to get it. The grammar is the API's
(k8s.io/apimachinery resource.Quantity): a signed decimal, then a binary suffix (Ki..Ei), a
decimal suffix (n..E) or a decimal exponent.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["parse_quantity", "whole_quantity"]

_QUANTITY = re.compile(
    r"(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<dec>[numkMGTPE])|[eE](?P<exp>[+-]?\d+))?"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text: str) -> Decimal:
    """The exact value of a quantity string; ValueError naming the text if it is not one."""
    if not isinstance(text, str) or not (m := _QUANTITY.fullmatch(text.strip())):
        raise ValueError(f"invalid quantity {text!r}")
    try:
        number = Decimal(m["num"])
    except InvalidOperation as err:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"invalid quantity {text!r}") from err
    if m["bin"]:
        return number * (1 << _BINARY[m["bin"]])
    if m["dec"]:
        return number * Decimal(10) ** _DECIMAL[m["dec"]]
    if m["exp"]:
        return number * Decimal(10) ** int(m["exp"])
    return number


def whole_quantity(value: object) -> int:
    """A quantity that counts whole units (bytes, engines, counters): a string in any form the
    apiserver may hand back ("40Gi", "42949672960", "1e3") or an int. Fractions are refused,
    since a counter of half a unit means the object is not what carve published."""
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {value!r}: not a number")
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise ValueError(f"invalid quantity {value!r}")
    number = parse_quantity(value)
    if number != number.to_integral_value():
        raise ValueError(f"quantity {value!r} is not a whole number")
    return int(number)
