"""Flags and their environment twins, declared once for every carve binary.

A DaemonSet or Deployment is configured through its environment as often as through its
arguments, so each flag is declared once (name, default, help, how its text is parsed, an example
of a good value) and read, first found wins, from:

1. the command line (`--resync-period=30s`);
2. a deprecated spelling of the flag still on the command line (`--resync-seconds=30`);
3. its twin `CARVE_<FLAG>` (dashes as underscores: `CARVE_RESYNC_PERIOD`);
4. a conventional variable it also honours (`KUBECONFIG`, `NODE_NAME`, `POD_NAMESPACE`, ...);
5. the twin of a deprecated spelling, or a deprecated variable (`CARVE_RESYNC_SECONDS`);
6. the default, which is text parsed exactly like user input, so `--help` shows what applies.

Every value is parsed the same way wherever it came from, so a bad one is refused the same way:
a `UsageError` naming the flag (or the variable it came from) with an example of a good value,
and the binary exits 2 before it touches anything. Deprecated spellings keep an operator's old
manifest running; each use is returned as a note that the binary logs as a warning once logging
is configured (the log format is itself a flag, so it cannot be logged while parsing).

The flags both binaries share (kubeconfig, driver name, ops HTTP address, log format and level,
resync period) are declared here, so they cannot drift apart between the binaries again.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from driver.contract import DEFAULT_DRIVER_NAME, Contract

T = TypeVar("T")


class UsageError(ValueError):
    """A flag or environment value the binary cannot run with; the binary exits 2."""


# -- value syntaxes ------------------------------------------------------------------------------
# Each raises ValueError with a short reason; `CommandLine.parse` adds the flag and an example.

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '1.5h', '250ms' -> seconds; a bare number is seconds, so the old
    `--resync-seconds=30` spelling reads the same through `--resync-period`."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError("not a duration (250ms, 30s, 5m or 1.5h)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def optional_duration(text: str) -> float | None:
    """An empty value means "off"."""
    return parse_duration(text) if text.strip() else None


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean (true or false)")


def nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def required(text: str) -> str:
    if not text.strip():
        raise ValueError("is required")
    return text.strip()


def optional_text(text: str) -> str | None:
    return text.strip() or None


def path(text: str) -> Path:
    return Path(nonempty(text))


def optional_path(text: str) -> Path | None:
    return Path(text.strip()) if text.strip() else None


def one_of(*choices: str) -> Callable[[str], str]:
    """A parser that accepts exactly one of `choices` (case-sensitive: they are API words)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text

    return parse


def comma_set(text: str) -> frozenset[str] | None:
    """'a, b,,c' -> {'a', 'b', 'c'}; empty means "not set" (the binary's own default applies)."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    return names or None


def http_address_value(text: str) -> str:
    """'' (disabled) or '[host]:port' with a numeric port (0 picks a free one)."""
    if not text:
        return ""
    _, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError("not a [host]:port address")
    return text


def driver_name_value(text: str) -> str:
    """A DNS subdomain: every finalizer, gate and class name is derived from it."""
    return Contract(text.strip()).driver


def log_level_value(text: str) -> str:
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"):
        raise ValueError("not a log level (debug, info, warning or error)")
    return level


# -- declarations --------------------------------------------------------------------------------


def env_twin(name: str) -> str:
    """`resync-period` -> `CARVE_RESYNC_PERIOD`."""
    return "CARVE_" + name.upper().replace("-", "_")


@dataclass(frozen=True)
class Flag(Generic[T]):
    """One setting: `--<name>` on the command line, `CARVE_<NAME>` in the environment.

    `example` is a good value, shown in every error about this flag. `also_env` are conventional
    variables read after the twin (not deprecated: the downward API and kubectl set them).
    `deprecated_flags` are old spellings (each with its own twin) and `deprecated_env` old
    variables; both still work and are reported. A `switch` may be given bare (`--cleanup`).
    """

    name: str
    help: str
    default: str
    parse: Callable[[str], T]
    example: str
    also_env: tuple[str, ...] = ()
    deprecated_flags: tuple[str, ...] = ()
    deprecated_env: tuple[str, ...] = ()
    switch: bool = False
    metavar: str = ""  # what --help shows for the value; the flag's own name when empty

    @property
    def option(self) -> str:
        return f"--{self.name}"

    @property
    def env(self) -> str:
        return env_twin(self.name)

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


@dataclass(frozen=True)
class Parsed:
    """Parsed values by flag, plus what was spelled the deprecated way (to log as warnings)."""

    values: Mapping[str, object]
    deprecations: tuple[str, ...] = ()

    def __getitem__(self, flag: Flag[T]) -> T:
        return cast(T, self.values[flag.name])


@dataclass(frozen=True)
class _Raw:
    text: str
    source: str  # "--flag", "ENV_VAR" or "default"


@dataclass(frozen=True)
class CommandLine:
    """A binary's flags; `parse` turns argv and the environment into `Parsed` values."""

    prog: str
    description: str
    flags: tuple[Flag[Any], ...]
    _by_name: Mapping[str, Flag[Any]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name: dict[str, Flag[Any]] = {}
        spellings: set[str] = set()
        for f in self.flags:
            for spelling in (f.name, *f.deprecated_flags):
                if spelling in spellings:
                    raise ValueError(f"{self.prog}: flag --{spelling} is declared twice")
                spellings.add(spelling)
            by_name[f.name] = f
        object.__setattr__(self, "_by_name", by_name)

    def parser(self) -> argparse.ArgumentParser:
        """The argparse view: every value stays text (default None), parsed later by `parse`,
        so that the environment and the default go through the same checks as the flag."""
        p = argparse.ArgumentParser(prog=self.prog, description=self.description)
        for f in self.flags:
            kw: dict[str, Any] = {"default": None, "metavar": f.metavar or f.dest.upper()}
            if f.switch:
                kw.update(nargs="?", const="true", metavar="BOOL")
            p.add_argument(f.option, dest=f.dest, help=_help(f), **kw)
            for old in f.deprecated_flags:
                p.add_argument(
                    f"--{old}",
                    dest=_alias_dest(f, old),
                    help=f"deprecated spelling of {f.option}",
                    **kw,
                )
        return p

    def parse(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Parsed:
        """Values for every flag; raises UsageError for a bad value (argparse itself exits 2
        for an unknown flag or --help)."""
        ns = self.parser().parse_args(list(argv))
        environ: Mapping[str, str] = os.environ if env is None else env
        values: dict[str, object] = {}
        notes: list[str] = []
        for f in self.flags:
            raw = _pick(f, vars(ns), environ, notes)
            try:
                values[f.name] = f.parse(raw.text)
            except ValueError as e:
                raise UsageError(_bad_value(f, raw, e)) from None
        return Parsed(values, tuple(notes))


def _alias_dest(f: Flag[Any], old: str) -> str:
    return f"{f.dest}__deprecated__{old.replace('-', '_')}"


def _help(f: Flag[Any]) -> str:
    env = " / ".join((f.env, *f.also_env))
    default = f" (default {f.default})" if f.default else ""
    return f"{f.help} [env {env}]{default}"


def _pick(f: Flag[Any], given: Mapping[str, Any], env: Mapping[str, str], notes: list[str]) -> _Raw:
    if given.get(f.dest) is not None:
        for old in f.deprecated_flags:
            if given.get(_alias_dest(f, old)) is not None:
                notes.append(f"--{old} is deprecated and ignored: {f.option} is also given")
        return _Raw(given[f.dest], f.option)
    for old in f.deprecated_flags:
        if given.get(_alias_dest(f, old)) is not None:
            notes.append(_deprecated(f"--{old}", f))
            return _Raw(given[_alias_dest(f, old)], f"--{old}")
    for name in (f.env, *f.also_env):
        if name in env:
            return _Raw(env[name], name)
    for name in (*(env_twin(old) for old in f.deprecated_flags), *f.deprecated_env):
        if name in env:
            notes.append(_deprecated(name, f))
            return _Raw(env[name], name)
    return _Raw(f.default, "default")


def _deprecated(spelling: str, f: Flag[Any]) -> str:
    return f"{spelling} is deprecated: use {f.option} or {f.env} (e.g. {f.option}={f.example})"


def _bad_value(f: Flag[Any], raw: _Raw, error: ValueError) -> str:
    example = f"e.g. {f.option}={f.example}"
    if raw.source.startswith("--"):
        where = f"{raw.source}={raw.text!r}" if raw.text else raw.source
    elif raw.source == "default":
        where = f.option
    else:
        where = f"{raw.source}={raw.text!r} ({f.option})"
    if str(error) == "is required":
        return f"{f.option} is required; {example}, or set {' or '.join((f.env, *f.also_env))}"
    return f"{where}: {error}; {example}"


# -- the flags both binaries share ---------------------------------------------------------------

KUBECONFIG: Flag[str | None] = Flag(
    "kubeconfig",
    "kubeconfig file; the in-cluster config when unset",
    "",
    optional_text,
    example="/etc/carve/kubeconfig",
    also_env=("KUBECONFIG",),
)
DRIVER_NAME: Flag[str] = Flag(
    "driver-name",
    "DRA driver name; every finalizer, gate, class and CDI vendor carve uses derives from it",
    DEFAULT_DRIVER_NAME,
    driver_name_value,
    example=DEFAULT_DRIVER_NAME,
)
LOG_FORMAT: Flag[str] = Flag(
    "log-format", "log lines as json or text", "json", one_of("json", "text"), example="text"
)
LOG_LEVEL: Flag[str] = Flag(
    "log-level", "debug, info, warning or error", "info", log_level_value, example="debug"
)
LOGGING: tuple[Flag[Any], ...] = (LOG_FORMAT, LOG_LEVEL)


def http_address(*, deprecated: tuple[str, ...] = ()) -> Flag[str]:
    """The ops endpoints' address (/metrics, /healthz, /readyz); '' disables them."""
    return Flag(
        "http-address",
        "[host]:port for /metrics, /healthz and /readyz ('' disables them)",
        ":8080",
        http_address_value,
        example="127.0.0.1:8080",
        deprecated_flags=deprecated,
        metavar="ADDRESS",
    )


def duration(
    name: str, help_: str, default: str, *, deprecated: tuple[str, ...] = ()
) -> Flag[float]:
    """A period in seconds, written like 250ms, 30s, 10m or 1.5h (a bare number is seconds)."""
    return Flag(
        name,
        help_,
        default,
        parse_duration,
        example=default,
        deprecated_flags=deprecated,
        metavar="DURATION",
    )


def resync_period(default: str, help_: str, *, deprecated: tuple[str, ...] = ()) -> Flag[float]:
    """How often a binary re-examines everything although nothing told it to."""
    return duration("resync-period", help_, default, deprecated=deprecated)


def switch(name: str, help_: str, default: bool = False) -> Flag[bool]:
    """A boolean that may be given bare (`--name`) or with a value (`--name=false`)."""
    return Flag(
        name,
        help_,
        "true" if default else "false",
        parse_bool,
        example="false" if default else "true",
        switch=True,
    )
