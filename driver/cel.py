"""CEL device selectors evaluated in the Kubernetes device environment.

DeviceClasses and claim requests pick devices with CEL expressions over ``device.driver``,
``device.attributes["<domain>"].<name>`` and ``device.capacity["<domain>"].<name>``. The
controller must judge them exactly as kube-scheduler would, or it would allocate devices the
scheduler considers unsuitable. The CEL core comes from ``common-expression-language`` (Rust
interpreter, compile once, ~10 us per evaluation); the Kubernetes extensions (``quantity``,
``semver`` and their receiver methods, and the strings extension of ``driver.celstrings``) are
added here as custom functions.

CEL has no user-defined types in that library, so quantities and versions travel through the
interpreter as one-entry maps (``{"@carve.quantity": "<canonical decimal>"}``). The canonical
form makes ``==`` agree with numeric equality (``quantity("1Gi") == quantity("1024Mi")``).

Nothing here raises to the caller: every failure (too long, syntax, unknown attribute, type
mismatch, non-boolean result) becomes a :class:`CelError` value naming the expression, so a bad
selector in one claim can never take the controller down.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum
from functools import total_ordering
from typing import Any

import cel

from driver.celstrings import STRING_FUNCTIONS
from driver.quantity import parse_quantity

MAX_EXPRESSION_LENGTH = 10 * 1024
"""Kubernetes' CELSelectorExpressionMaxLength."""

_QUANTITY_KEY = "@carve.quantity"
_SEMVER_KEY = "@carve.semver"


# ---------------------------------------------------------------------------------------------
# Values


@total_ordering
@dataclass(frozen=True)
class Semver:
    """A semantic version (semver 2.0.0) as Kubernetes version attributes carry it."""

    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: str = ""

    _PATTERN = re.compile(
        r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
        r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
        r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
    )

    @classmethod
    def parse(cls, text: str, *, normalize: bool = False) -> Semver:
        """Parse strictly, or leniently (``v`` prefix, missing minor/patch) when ``normalize``.

        The lenient mode mirrors Kubernetes' ``semver(s, true)``.
        """
        candidate = text
        if normalize:
            candidate = candidate.removeprefix("v")
            core, sep, rest = _split_core(candidate)
            parts = core.split(".")
            while len(parts) < 3:
                parts.append("0")
            parts = [p.lstrip("0") or "0" if p.isdigit() else p for p in parts]
            candidate = ".".join(parts) + sep + rest
        m = cls._PATTERN.match(candidate)
        if m is None:
            raise ValueError(f"invalid semantic version {text!r}")
        pre = tuple(m.group(4).split(".")) if m.group(4) else ()
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)), pre, m.group(5) or "")

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + self.build
        return text

    def _key(self) -> tuple[int, int, int, int, tuple[tuple[int, int, str], ...]]:
        # A release sorts after its pre-releases; numeric identifiers sort before alphanumeric.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, 0 if self.prerelease else 1, pre)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Semver):
            return NotImplemented
        return self._key() < other._key()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Semver):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _split_core(text: str) -> tuple[str, str, str]:
    for i, ch in enumerate(text):
        if ch in "-+":
            return text[:i], ch, text[i + 1 :]
    return text, "", ""


AttributeValue = bool | int | str | Semver
"""What a ResourceSlice device attribute holds (``bool``, ``int``, ``string``, ``version``)."""


@dataclass(frozen=True, slots=True, eq=False)  # slots: a fleet holds one per published device
class CelDevice:
    """The facts about one device that selectors may read.

    Names are fully qualified (``domain/name``); :meth:`of` qualifies bare names with the
    driver's domain, as Kubernetes does. :attr:`attributes` is a sorted tuple so a device is
    hashable and two devices with the same facts compare equal, which the result cache relies
    on, however their facts are split between ``own`` and ``shared``.

    The attributes are held in two parts because most of them are the GPU's, not the device's:
    ``shared`` (one tuple per GPU, see :meth:`sharing`) and ``own``, the rest, which for a MIG
    placement is the same on every GPU of a model and so is one tuple for the whole fleet.
    Together they are exactly the device's published attributes; names never repeat across
    the two.
    """

    driver: str
    own: tuple[tuple[str, AttributeValue], ...]
    capacity: tuple[tuple[str, Decimal], ...]
    shared: tuple[tuple[str, AttributeValue], ...] = ()

    @classmethod
    def of(
        cls,
        driver: str,
        attributes: Mapping[str, AttributeValue],
        capacity: Mapping[str, Decimal] | None = None,
    ) -> CelDevice:
        # A fleet publishes the same names, values and capacity maps on every GPU of a model:
        # share them, so a device's facts cost its own few values only (1,000 nodes x 8 GPUs
        # hold over a million facts, most of them equal).
        attrs = sorted(
            _attribute_fact(_qualified(driver, k), v, _fact_type(v)) for k, v in attributes.items()
        )
        caps = sorted(_capacity_fact(_qualified(driver, k), v) for k, v in (capacity or {}).items())
        return cls(driver, tuple(attrs), _shared_capacity(tuple(caps)))

    @property
    def attributes(self) -> tuple[tuple[str, AttributeValue], ...]:
        """Every attribute, sorted by name: what selectors see."""
        if not self.shared:
            return self.own
        if not self.own:
            return self.shared
        return tuple(sorted(self.shared + self.own))

    def sharing(self, shared: tuple[tuple[str, AttributeValue], ...]) -> CelDevice:
        """The same device with ``shared`` held by reference and only the rest as its own.

        ``shared`` is what the caller found common to a GPU's devices (:func:`common_facts`);
        a device that does not carry all of it exactly (an override, a missing name) keeps
        every attribute as its own, so the view never changes.
        """
        if not shared or self.shared:
            return self
        mine = dict(self.own)
        if any(not _same_fact(mine.get(name, _MISSING), value) for name, value in shared):
            return self
        names = {name for name, _ in shared}
        own = tuple(item for item in self.own if item[0] not in names)
        return CelDevice(self.driver, _shared_attributes(own), self.capacity, shared)

    def attribute(self, qualified_name: str) -> AttributeValue | None:
        for name, value in self.shared:
            if name == qualified_name:
                return value
        for name, value in self.own:
            if name == qualified_name:
                return value
        return None

    def __eq__(self, other: object) -> bool:
        # Every result-cache hit lands here (the key is built afresh per look-up): keep it short.
        if self is other:
            return True
        if not isinstance(other, CelDevice):
            return NotImplemented
        mine, theirs = self.attributes, other.attributes
        return (
            self.driver == other.driver
            and self.capacity == other.capacity
            and mine == theirs
            and _typed(mine) == _typed(theirs)
        )

    def __hash__(self) -> int:
        return hash((self.driver, self.attributes, self.capacity))


def common_facts(
    devices: Iterable[CelDevice],
) -> tuple[tuple[str, AttributeValue], ...]:
    """The attributes every one of ``devices`` carries with exactly the same value (type and
    semver build included, which ``==`` alone would not tell apart): the GPU-level facts
    (``productName``, ``pciBusID``, ``parentUUID``, ...) to hold once with
    :meth:`CelDevice.sharing`."""
    # name -> the (name, value) pair itself, so the result reuses the interned pairs
    common: dict[str, tuple[str, AttributeValue]] | None = None
    for device in devices:
        if common is None:
            common = {item[0]: item for item in device.attributes}
            continue
        mine = dict(device.attributes)
        common = {k: i for k, i in common.items() if _same_fact(mine.get(k, _MISSING), i[1])}
    return tuple(common[name] for name in sorted(common)) if common else ()


_MISSING = object()


def _fact_type(value: object) -> object:
    """What tells equal-comparing values apart: ``1`` from ``True``, and a semver's build
    metadata (which :class:`Semver` ordering ignores but selectors can read as a string)."""
    if isinstance(value, Semver):
        return (Semver, value.build)
    return type(value)


def _same_fact(a: object, b: object) -> bool:
    return a is b or (_fact_type(a) == _fact_type(b) and a == b)


def _typed(facts: tuple[tuple[str, AttributeValue], ...]) -> tuple[object, ...]:
    return tuple(_fact_type(v) for _, v in facts)


def _shared_attributes(
    facts: tuple[tuple[str, AttributeValue], ...],
) -> tuple[tuple[str, AttributeValue], ...]:
    return _interned_attributes(_typed(facts), facts)


@functools.lru_cache(maxsize=1 << 14)
def _interned_attributes(
    types: tuple[object, ...], facts: tuple[tuple[str, AttributeValue], ...]
) -> tuple[tuple[str, AttributeValue], ...]:
    # types is part of the key: (("a", 1),) == (("a", True),), but a selector tells them apart.
    return facts


def qualify(driver: str, name: str) -> str:
    """``name`` with the driver's domain when it has none (unqualified names are the driver's)."""
    return name if "/" in name else f"{driver}/{name}"


@functools.lru_cache(maxsize=4096)
def _qualified(driver: str, name: str) -> str:
    return sys.intern(qualify(driver, name))


@functools.lru_cache(maxsize=1 << 16)  # kind: 1 and True, and semver builds, stay apart
def _attribute_fact(name: str, value: AttributeValue, kind: object) -> tuple[str, AttributeValue]:
    return (name, value)


@functools.lru_cache(maxsize=1 << 12)
def _capacity_fact(name: str, value: Decimal) -> tuple[str, Decimal]:
    return (name, value)


@functools.lru_cache(maxsize=1 << 12)
def _shared_capacity(
    facts: tuple[tuple[str, Decimal], ...],
) -> tuple[tuple[str, Decimal], ...]:
    return facts


# ---------------------------------------------------------------------------------------------
# Errors


class CelErrorKind(StrEnum):
    TOO_LONG = "expression too long"
    SYNTAX = "syntax error"
    RUNTIME = "runtime error"
    NOT_BOOLEAN = "result is not a boolean"


@dataclass(frozen=True)
class CelError:
    """Why a selector could not be judged; ``message`` is ready for an event or condition."""

    expression: str
    kind: CelErrorKind
    detail: str

    @property
    def message(self) -> str:
        shown = self.expression if len(self.expression) <= 200 else self.expression[:197] + "..."
        return f"CEL selector {shown!r}: {self.kind.value}: {self.detail}"


# ---------------------------------------------------------------------------------------------
# Kubernetes functions


class _CelTypeError(TypeError):
    pass


def _quantity_value(d: Decimal) -> dict[str, str]:
    return {_QUANTITY_KEY: str(d.normalize())}


def _semver_value(v: Semver) -> dict[str, str]:
    return {_SEMVER_KEY: str(v)}


def _decode(value: object) -> Decimal | Semver | None:
    if isinstance(value, dict) and len(value) == 1:
        if _QUANTITY_KEY in value:
            return Decimal(value[_QUANTITY_KEY])
        if _SEMVER_KEY in value:
            return Semver.parse(value[_SEMVER_KEY])
    return None


def _describe(value: object) -> str:
    decoded = _decode(value)
    if isinstance(decoded, Decimal):
        return "quantity"
    if isinstance(decoded, Semver):
        return "semver"
    return type(value).__name__


def _as_quantity(value: object, fn: str) -> Decimal:
    decoded = _decode(value)
    if isinstance(decoded, Decimal):
        return decoded
    if isinstance(value, int) and not isinstance(value, bool):
        return Decimal(value)
    raise _CelTypeError(f"{fn}() needs a quantity, got {_describe(value)}")


def _comparable_pair(a: object, b: object, fn: str) -> tuple[Any, Any]:
    da, db = _decode(a), _decode(b)
    if isinstance(da, Decimal) and isinstance(db, Decimal):
        return da, db
    if isinstance(da, Semver) and isinstance(db, Semver):
        return da, db
    raise _CelTypeError(f"{fn}() cannot compare {_describe(a)} with {_describe(b)}")


def _fn_quantity(text: object) -> dict[str, str]:
    if not isinstance(text, str):
        raise _CelTypeError(f"quantity() needs a string, got {type(text).__name__}")
    return _quantity_value(parse_quantity(text))


def _fn_is_quantity(text: object) -> bool:
    try:
        _fn_quantity(text)
    except (ValueError, TypeError):
        return False
    return True


def _fn_semver(text: object, normalize: object = False) -> dict[str, str]:
    if not isinstance(text, str):
        raise _CelTypeError(f"semver() needs a string, got {type(text).__name__}")
    return _semver_value(Semver.parse(text, normalize=bool(normalize)))


def _fn_is_semver(text: object, normalize: object = False) -> bool:
    try:
        _fn_semver(text, normalize)
    except (ValueError, TypeError):
        return False
    return True


def _fn_compare_to(a: object, b: object) -> int:
    x, y = _comparable_pair(a, b, "compareTo")
    return -1 if x < y else (1 if x > y else 0)


def _fn_is_greater_than(a: object, b: object) -> bool:
    x, y = _comparable_pair(a, b, "isGreaterThan")
    return bool(x > y)


def _fn_is_less_than(a: object, b: object) -> bool:
    x, y = _comparable_pair(a, b, "isLessThan")
    return bool(x < y)


def _fn_add(a: object, b: object) -> dict[str, str]:
    return _quantity_value(_as_quantity(a, "add") + _as_quantity(b, "add"))


def _fn_sub(a: object, b: object) -> dict[str, str]:
    return _quantity_value(_as_quantity(a, "sub") - _as_quantity(b, "sub"))


def _fn_is_integer(q: object) -> bool:
    d = _as_quantity(q, "isInteger")
    return d == d.to_integral_value()


def _fn_as_integer(q: object) -> int:
    d = _as_quantity(q, "asInteger")
    if d != d.to_integral_value() or abs(d) >= 2**63:
        raise _CelTypeError(f"asInteger(): {d} is not an int64")
    return int(d)


def _fn_as_approximate_float(q: object) -> float:
    return float(_as_quantity(q, "asApproximateFloat"))


def _fn_sign(q: object) -> int:
    d = _as_quantity(q, "sign")
    return (d > 0) - (d < 0)


def _semver_part(index: int, fn: str) -> Callable[[object], int]:
    def part(v: object) -> int:
        decoded = _decode(v)
        if not isinstance(decoded, Semver):
            raise _CelTypeError(f"{fn}() needs a semver, got {_describe(v)}")
        return (decoded.major, decoded.minor, decoded.patch)[index]

    return part


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _fn_quantity,
    "isQuantity": _fn_is_quantity,
    "semver": _fn_semver,
    "isSemver": _fn_is_semver,
    "compareTo": _fn_compare_to,
    "isGreaterThan": _fn_is_greater_than,
    "isLessThan": _fn_is_less_than,
    "add": _fn_add,
    "sub": _fn_sub,
    "isInteger": _fn_is_integer,
    "asInteger": _fn_as_integer,
    "asApproximateFloat": _fn_as_approximate_float,
    "sign": _fn_sign,
    "major": _semver_part(0, "major"),
    "minor": _semver_part(1, "minor"),
    "patch": _semver_part(2, "patch"),
    **STRING_FUNCTIONS,  # lowerAscii(), split(), ...: Kubernetes' strings extension
}


# ---------------------------------------------------------------------------------------------
# Compilation and evaluation

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'")
# Constructs whose result can depend on attributes the source never names literally.
_WHOLE_MAP = re.compile(r"\b(size|exists|exists_one|all|map|filter|keys|values)\b|\+|\]\s*[=!]=")


@dataclass(frozen=True)
class CompiledSelector:
    """A parsed selector plus what it can read, so results can be shared between devices."""

    expression: str
    program: Any = field(compare=False, repr=False)
    referenced: frozenset[str] | None
    """Names (identifiers and string literals) in the source, or None if it may read any."""


def _referenced_names(expression: str) -> frozenset[str] | None:
    if _WHOLE_MAP.search(expression):
        return None
    names: set[str] = set()
    for token in _TOKEN.findall(expression):
        names.add(token[1:-1] if token[0] in "\"'" else token)
    return frozenset(names)


def compile_selector(expression: str) -> CompiledSelector | CelError:
    """Parse once; the result is reused for every device."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        return CelError(
            expression,
            CelErrorKind.TOO_LONG,
            f"{len(expression)} characters, the limit is {MAX_EXPRESSION_LENGTH}",
        )
    try:
        program = cel.compile(expression)
    except Exception as exc:  # the binding raises ValueError, but any failure is a syntax error
        return CelError(expression, CelErrorKind.SYNTAX, _first_line(str(exc)))
    return CompiledSelector(expression, program, _referenced_names(expression))


def _first_line(text: str) -> str:
    text = text.replace("Failed to parse expression", "cannot parse").strip()
    return text.splitlines()[0] if text else "unknown error"


def _encode_attribute(value: AttributeValue) -> object:
    if isinstance(value, Semver):
        return _semver_value(value)
    return value


def _domains(names: tuple[tuple[str, object], ...]) -> frozenset[str]:
    return frozenset(name.rpartition("/")[0] for name, _ in names)


@dataclass(frozen=True)
class _Facts:
    """A device reduced to what one selector can read; the cache key besides the expression.

    Domains stay listed even when none of their names are kept, so a missing attribute reports
    the attribute, not its domain.
    """

    device: CelDevice
    attribute_domains: frozenset[str]
    capacity_domains: frozenset[str]


def _activation(facts: _Facts) -> dict[str, object]:
    device = facts.device
    attributes: dict[str, dict[str, object]] = {d: {} for d in facts.attribute_domains}
    for name, value in device.attributes:
        domain, _, short = name.rpartition("/")
        attributes.setdefault(domain, {})[short] = _encode_attribute(value)
    capacity: dict[str, dict[str, object]] = {d: {} for d in facts.capacity_domains}
    for name, amount in device.capacity:
        domain, _, short = name.rpartition("/")
        capacity.setdefault(domain, {})[short] = _quantity_value(amount)
    return {
        "device": {
            "driver": device.driver,
            "attributes": attributes,
            "capacity": capacity,
            "allowMultipleAllocations": False,
        }
    }


def _project(device: CelDevice, referenced: frozenset[str] | None) -> _Facts:
    """Drop facts the selector cannot read, so devices differing only there share a result."""
    # Shared and own parts unsorted: neither the domains nor what is kept depend on the order,
    # and the kept few are sorted below (no merged tuple per look-up on the decision path).
    attributes = device.shared + device.own
    attribute_domains = _domains(attributes)
    capacity_domains = _domains(device.capacity)
    if referenced is None:
        return _Facts(device, attribute_domains, capacity_domains)

    def keep(name: str) -> bool:
        domain, _, short = name.rpartition("/")
        via_driver = domain == device.driver and "driver" in referenced
        return short in referenced and (domain in referenced or via_driver)

    projected = CelDevice(
        device.driver if "driver" in referenced else "",
        tuple(sorted(item for item in attributes if keep(item[0]))),
        tuple(item for item in device.capacity if keep(item[0])),
    )
    return _Facts(projected, attribute_domains, capacity_domains)


def _runtime_detail(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"no such key {exc.args[0]!r} (attribute or capacity missing on this device)"
    text = str(exc)
    if "Python function call failed:" in text:
        text = text.split("Python function call failed:", 1)[1]
        text = text.split(". Check function arguments", 1)[0].strip()
        for prefix in ("_CelTypeError: ", "ValueError: ", "TypeError: "):
            text = text.removeprefix(prefix)
    return _first_line(text)


def evaluate(selector: CompiledSelector, device: CelDevice) -> bool | CelError:
    """One evaluation, uncached."""
    return _evaluate(selector, _project(device, None))


def _evaluate(selector: CompiledSelector, facts: _Facts) -> bool | CelError:
    try:
        result = selector.program.execute(cel.Context(_activation(facts), _FUNCTIONS))
    except Exception as exc:  # every interpreter failure is the expression's problem
        return CelError(selector.expression, CelErrorKind.RUNTIME, _runtime_detail(exc))
    if not isinstance(result, bool):
        return CelError(
            selector.expression, CelErrorKind.NOT_BOOLEAN, f"got {type(result).__name__}"
        )
    return result


class SelectorEvaluator:
    """Compiles each expression once and caches results per (expression, relevant facts).

    A device is reduced to the facts the expression names before the cache look-up, so
    thousands of GPUs of one model share one evaluation unless the selector reads a per-device
    attribute such as ``uuid``. The cache is bounded; when full it is simply cleared (results
    are cheap to recompute and stale entries are impossible because keys carry all inputs).
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        self._compiled: dict[str, CompiledSelector | CelError] = {}
        self._results: dict[tuple[str, _Facts], bool | CelError] = {}
        self._max_entries = max_entries
        self.evaluations = 0
        """How many times the interpreter actually ran (for tests and benchmarks)."""

    def compile(self, expression: str) -> CompiledSelector | CelError:
        compiled = self._compiled.get(expression)
        if compiled is None:
            compiled = compile_selector(expression)
            self._compiled[expression] = compiled
        return compiled

    def matches(self, expression: str, device: CelDevice) -> bool | CelError:
        compiled = self.compile(expression)
        if isinstance(compiled, CelError):
            return compiled
        key = (expression, _project(device, compiled.referenced))
        result = self._results.get(key)
        if result is None:
            if len(self._results) >= self._max_entries:
                self._results.clear()
            self.evaluations += 1
            result = _evaluate(compiled, key[1])
            self._results[key] = result
        return result

    def matches_all(self, expressions: tuple[str, ...], device: CelDevice) -> bool | CelError:
        """All selectors in order, stopping at the first false or error (as Kubernetes does)."""
        for expression in expressions:
            result = self.matches(expression, device)
            if result is not True:
                return result
        return True
