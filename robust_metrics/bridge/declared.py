"""Configuration declared as dataclasses, read from YAML by one generic reader.

Each field of a declared dataclass says what its key takes: the annotation gives the type (str,
int, float, bool, `Duration`, `HttpUrl`, a `Literal` of choices, `re.Pattern`, a nested
dataclass, `Mapping[str, X]`, `tuple[X, ...]`, `X | None`), the default gives the default, and
`setting(...)` adds bounds, the YAML spelling of the key, secrets and the odd hook. `read` walks a
YAML mapping against the dataclass and refuses what the declaration does not allow, naming the
exact path (`rules[1].actions[0].for: expected a duration ...`); what involves several fields is
checked in the dataclass's own `__post_init__`, which raises `Refused` with the path below it. A
value whose shape the declaration cannot say (an action, whose options depend on its `type`; a
scheduler block, whose keys are its adapter's) is read by its class's `from_yaml(raw, where)`.

Conventions that hold for every key read this way:
- A duration (`Duration`) is Prometheus-style (`250ms`, `30s`, `5m`, `1h`, `1d`) or a plain
  number of seconds. Its key is spelled without a unit (`timeout`, `for`, `poll`); the same key
  with `_s` appended (`timeout_s`, `for_s`) is accepted as an alias, never both at once.
- A secret key `K` (`setting(secret=True)`) is given as `K`, `K_file` or `K_env`
  (`configuration.resolve_secret`).
- `key: null` means the key is not given, except for a bool, a number, a duration or a choice,
  which must be given a value.
- A key `section.name` is read from the nested mapping `section`, whose unknown keys are refused
  like any other.

Only the standard library (and `configuration`) is used: no runtime dependency.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from robust_metrics.configuration import ConfigError, resolve_secret

__all__ = ["Duration", "HttpUrl", "Refused", "Where", "mapping", "read", "setting"]

_DURATION_MARK = "duration"
_URL_MARK = "http(s) URL"
# Seconds, written as a Prometheus duration or a plain number of seconds.
Duration = Annotated[float, _DURATION_MARK]
# An http:// or https:// URL.
HttpUrl = Annotated[str, _URL_MARK]

T = TypeVar("T")


class Refused(ConfigError):
    """Raised by a declared dataclass's `__post_init__`: `key` is the path below the object being
    read ('' for the object itself); `read` puts the object's own path in front."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


@dataclass(frozen=True)
class Where:
    """What a `parse` hook or a `from_yaml` is told: the path of its value and the folder
    relative paths resolve against (the configuration file's)."""

    path: str
    base: Path
    key: str = ""  # the last key of the path: a field's spelling, or a mapping's key


@dataclass(frozen=True)
class _Spec:
    key: str | None = None
    minimum: float | None = 0
    above: float | None = None
    maximum: float | None = None
    secret: bool = False
    expect: str | None = None
    nonempty: str | None = None
    parse: Callable[[Any, Where], Any] | None = None
    internal: bool = False
    given: bool = False


_DEFAULT_SPEC = _Spec()


def setting(default: Any = MISSING, *, factory: Callable[[], Any] | None = None,
            key: str | None = None, minimum: float | None = 0, above: float | None = None,
            maximum: float | None = None, secret: bool = False, expect: str | None = None,
            nonempty: str | None = None, parse: Callable[[Any, Where], Any] | None = None,
            internal: bool = False, given: bool = False) -> Any:
    """A declared field. `key`: its YAML spelling when not the field's name (`listen.port` reads
    `port` of the `listen` mapping); `minimum` (default 0), `above` and `maximum`: bounds of a
    number or duration; `secret`: read through `resolve_secret`; `expect`: what a string value is
    said to be when it is not one; `nonempty`: the list must have an element, and says of what;
    `parse(value, where)`: read the value by hand (it sees the default when the key is absent);
    `internal`: not a key of the file; `given`: not a key either, `read` fills it with the names of
    the fields whose keys the file gives (for a check that a default cannot make)."""
    spec = _Spec(key, minimum, above, maximum, secret, expect, nonempty, parse, internal or given,
                 given)
    if given:
        return dataclasses.field(default=frozenset(), repr=False, compare=False,
                                 metadata={"setting": spec})
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"setting": spec})
    return dataclasses.field(default=default, metadata={"setting": spec})


# ----------------------------------------------------------------------------- the reader
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _join(path: str, key: str) -> str:
    if not key:
        return path
    return f"{path}{key}" if not path or key.startswith("[") else f"{path}.{key}"


def mapping(value: Any, path: str) -> Mapping[str, Any]:
    """`value` as a mapping with string keys; None is an empty one."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be strings, got {key!r}")
    return value


def _spec(f: dataclasses.Field[Any]) -> _Spec:
    spec = f.metadata.get("setting", _DEFAULT_SPEC)
    assert isinstance(spec, _Spec)
    return spec


def _strip(hint: Any) -> tuple[Any, str | None]:
    """(the type under an `Annotated`, its mark)."""
    if get_origin(hint) is Annotated:
        base, *marks = get_args(hint)
        return base, next((m for m in marks if isinstance(m, str)), None)
    return hint, None


def _spellings(name: str, hint: Any, spec: _Spec) -> tuple[str, tuple[str, ...]]:
    """(section, spellings of the key in it): the first spelling is the documented one."""
    key = spec.key or (name[:-2] if name.endswith("_s") and _strip(hint)[1] == _DURATION_MARK
                       else name)
    section, _, key = key.rpartition(".")
    if spec.secret:
        return section, (key, f"{key}_file", f"{key}_env")
    if _strip(hint)[1] == _DURATION_MARK:
        return section, (key, f"{key}_s")
    return section, (key,)


def _nullable(hint: Any) -> bool:
    """Whether `key: null` means the key is not given (see the module's docstring)."""
    base, mark = _strip(hint)
    return mark != _DURATION_MARK and base not in (bool, int, float) and get_origin(
        base) is not Literal


def read(cls: type[T], raw: Any, path: str = "", base: Path = Path("."), *,
         also: tuple[str, ...] = ()) -> T:
    """Read the declared dataclass `cls` from the YAML value `raw` found at `path` (relative paths
    resolve against `base`). `also`: keys the caller reads itself, allowed here."""
    data = mapping(raw, path or "config")
    hints = get_type_hints(cls, include_extras=True)
    fields = [f for f in dataclasses.fields(cls) if f.init and not _spec(f).internal]
    layout = {f.name: _spellings(f.name, hints[f.name], _spec(f)) for f in fields}
    sections: dict[str, Mapping[str, Any]] = {"": data}
    allowed: dict[str, set[str]] = {"": set(also)}
    for section, spellings in layout.values():
        if section and section not in sections:
            sections[section] = mapping(data.get(section), _join(path, section))
            allowed[""].add(section)
        allowed.setdefault(section, set()).update(spellings)
    for section, keys in allowed.items():
        unknown = sorted(set(sections[section]) - keys)
        if unknown:
            raise ConfigError(f"{_join(path, section) or 'config'}: unknown key(s) "
                              f"{', '.join(unknown)} (allowed: {', '.join(sorted(keys))})")

    values: dict[str, Any] = {f.name: frozenset(n for n, (section, spellings) in layout.items()
                                                 if any(k in sections[section] for k in spellings))
                              for f in dataclasses.fields(cls) if _spec(f).given}
    for f in fields:
        spec, hint = _spec(f), hints[f.name]
        section, spellings = layout[f.name]
        holder, where = sections[section], _join(path, section)
        if spec.secret:
            values[f.name] = resolve_secret(holder, spellings[0], where or "config", base)
            continue
        given = [k for k in spellings if k in holder]
        if len(given) > 1:
            raise ConfigError(f"{where or 'config'}: give `{given[0]}` or `{given[1]}`, not both")
        value = holder[given[0]] if given else None
        absent = not given or (value is None and _nullable(hint))
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if absent and has_default:
            if spec.parse is None:
                continue
            value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        spelled = given[0] if given else spellings[0]
        values[f.name] = _convert(value, hint, spec, _join(where, spelled), base, spelled)
    try:
        return cls(**values)
    except Refused as exc:
        where = _join(path, exc.key)
        raise ConfigError(f"{where}: {exc.message}" if where else exc.message) from None


def _convert(value: Any, hint: Any, spec: _Spec, path: str, base: Path, key: str = "") -> Any:
    if spec.parse is not None:
        return spec.parse(value, Where(path, base, key))
    hint, mark = _strip(hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _convert(value, hint, spec, path, base, key)
    if isinstance(hint, type) and hasattr(hint, "from_yaml"):  # a class that reads itself
        return hint.from_yaml(value, Where(path, base, key))
    if mark == _DURATION_MARK:
        return _bounded(_duration(value, path), spec, path, duration=True)
    if mark == _URL_MARK:
        if not isinstance(value, str) or not value.startswith(("http://", "https://")):
            raise ConfigError(f"{path}: expected an http(s) URL, got {value!r}")
        return value
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: choose one of {', '.join(map(str, args))}, "
                              f"not {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                hint is int and not isinstance(value, int)):
            kind = "an integer" if hint is int else "a number"
            raise ConfigError(f"{path}: expected {kind}, got {value!r}")
        return _bounded(hint(value), spec, path)
    if hint is str:
        if not isinstance(value, str):
            quote = " (quote it in YAML)" if isinstance(value, int | float) else ""
            raise ConfigError(f"{path}: {spec.expect or 'expected a string'}, "
                              f"got {value!r}{quote}")
        return value
    if hint is re.Pattern or origin is re.Pattern:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a regular expression string")
        try:
            return re.compile(value)
        except re.error as exc:
            raise ConfigError(f"{path}: bad regular expression: {exc}") from None
    if origin is Mapping or origin is dict:
        return {k: _convert(v, args[1], spec, _join(path, k), base, k)
                for k, v in mapping(value, path).items()}
    if origin in (tuple, list, frozenset):
        items = [] if value is None else value
        if not isinstance(items, list) or (spec.nonempty and not items):
            raise ConfigError(f"{path}: expected a {'non-empty ' if spec.nonempty else ''}list"
                              f"{f' of {spec.nonempty}' if spec.nonempty else ''}, got {value!r}")
        return origin(_convert(v, args[0], spec, f"{path}[{i}]", base)
                      for i, v in enumerate(items))
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return read(hint, value, path, base)
    raise TypeError(f"{path}: no reader for the declared type {hint!r}")  # a declaration's bug


def _duration(value: Any, path: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(value) if isinstance(value, str) else None
    if not match:
        raise ConfigError(f"{path}: expected a duration such as 30s, 5m or 1h (or a number of "
                          f"seconds), got {value!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _bounded(value: float, spec: _Spec, path: str, *, duration: bool = False) -> Any:
    if spec.above is not None and value <= spec.above:
        raise ConfigError(f"{path}: must be {'longer than' if duration else '>'} "
                          f"{spec.above:g}, got {value:g}")
    if spec.minimum is not None and value < spec.minimum:
        raise ConfigError(f"{path}: must be >= {spec.minimum:g}, got {value:g}")
    if spec.maximum is not None and value > spec.maximum:
        raise ConfigError(f"{path}: must be <= {spec.maximum:g}, got {value:g}")
    return value
