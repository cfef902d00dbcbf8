"""The generic section mechanism of zmpi.config: `ConfigError`, type coercion and checks,
"auto", and `_Section`, the mixin every config section is built on.

A section is a frozen dataclass whose fields are type-checked (`_coerce`) and validated
(`_validate`) on construction. `_Section` also handles the DeepSpeed keys zmpi accepts without
a field (`_ALWAYS`, `_INERT`), "auto" values (`_AUTO_DEFAULT`), unknown-key errors that suggest
the closest key, the notes printed once by the engine, `to_dict` and a re-validating `replace`.
This module imports no MPI.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import fields

__all__ = ["ConfigError", "AUTO", "parse_json"]


class ConfigError(ValueError):
    """A config problem; `key` is the dotted path of the offending key ('' for the root)."""

    def __init__(self, key: str, msg: str):
        self.key, self.msg = key, msg
        super().__init__(f"{key}: {msg}" if key else msg)

    def __reduce__(self):  # picklable, e.g. to send across ranks
        return (ConfigError, (self.key, self.msg))

    def prefixed(self, prefix: str) -> ConfigError:
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.msg)


def parse_json(text: str, where: str | None = None):
    """The JSON value in `text`, stricter than json.loads: a key repeated in one object
    (json.loads keeps the last silently), a number that is not finite (NaN, Infinity,
    1e400) and an integer of more digits than Python converts (4,300: a ValueError from
    json.loads) are ConfigErrors naming the key, as is invalid or too deeply nested JSON.
    `where` (a file name) starts the messages that name no key."""
    prefix = f"{where}: " if where else ""

    def unique(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(key, "given twice in one object: give it once")
            seen[key] = value
        return seen

    try:
        value = json.loads(text, object_pairs_hook=unique, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ConfigError("", f"{prefix}not valid JSON: {e.msg} at line {e.lineno} column "
                              f"{e.colno}") from None
    except RecursionError:
        raise ConfigError("", f"{prefix}JSON nested too deeply") from None
    _check_finite(value, "")
    return value


class _LongInteger(str):
    """An integer literal of more digits than int() converts, kept as its text by
    `_parse_int` so that `_check_finite` can name its key."""


def _parse_int(text: str):
    try:
        return int(text)
    except ValueError:  # beyond sys.get_int_max_str_digits()
        return _LongInteger(text)


def _check_finite(value, key: str) -> None:
    """ConfigError naming the first number in `value` (parsed JSON) that is not finite, or
    an integer too long to convert (`_LongInteger`)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    if isinstance(value, _LongInteger):
        raise ConfigError(key, f"an integer of {len(value.lstrip('-')):,} digits, beyond any "
                          "value zmpi takes")
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        _check_finite(v, f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else k)


def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return f"list of {len(args)} numbers"
    if args:  # X | None
        return " or ".join(_type_name(a) for a in args)
    return "object" if dataclasses.is_dataclass(tp) else tp.__name__


def _coerce(key: str, value, tp):
    """Check `value` against the annotation `tp`; return it normalised (int->float, list->tuple,
    dict->section, integral float->int as DeepSpeed's "5e8" bucket sizes need). Booleans are
    neither ints nor floats."""
    bad = ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} ({value!r})")
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_coerce(f"{key}[{i}]", v, a)
                     for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if args:  # Optional[X], written X | None
        if value is None:
            return None
        try:
            return _coerce(key, value, next(a for a in args if a is not type(None)))
        except ConfigError as e:  # a mismatch here names the full type, 'int or null'
            raise (bad if e.key == key else e) from None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            try:
                return tp.from_dict(value)
            except ConfigError as e:
                raise e.prefixed(key) from None
        raise bad
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
        raise bad
    if tp is float and not math.isfinite(value):  # JSON's Infinity, NaN
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    return value


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(key, msg)


AUTO = "auto"


class _Section:
    """Mixin for the frozen dataclasses below: type checks on construction, then `_validate`.

    Besides its fields, a section accepts DeepSpeed keys that zmpi handles without a field:
    `_ALWAYS` maps a key to (the value zmpi always behaves as, what that is); another value is
    an error. `_INERT` maps a key to why it has no effect in zmpi; any value is accepted and
    `notes()` lists it. `_AUTO_DEFAULT`: fields whose "auto" means zmpi's default. Everything
    else is an unknown key.
    """

    _ALWAYS: dict = {}
    _INERT: dict = {}
    _AUTO_DEFAULT: tuple = ()
    _COUNTS: tuple = ()  # int fields that refuse any float, 32.0 too (a count, not a "5e8")
    _own_notes: tuple = ()

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self._COUNTS and isinstance(value, float):
                raise ConfigError(f.name, f"expected {_type_name(hints[f.name])}, got float "
                                          f"({value!r})")
            object.__setattr__(self, f.name, _coerce(f.name, value, hints[f.name]))
        self._validate()

    def _validate(self) -> None:
        pass

    def _at_least(self, lo, *keys, strict=False, note=""):
        """Check that each (non-None) field in `keys` is >= lo (> lo if strict)."""
        for k in keys:
            v = getattr(self, k)
            if v is not None and not (v > lo if strict else v >= lo):
                raise ConfigError(k, f"must be {'>' if strict else '>='} {lo}{note}, got {v}")

    @classmethod
    def _check_keys(cls, d, allowed) -> None:
        if not isinstance(d, Mapping):
            raise ConfigError("", f"expected object, got {type(d).__name__} ({d!r})")
        for k in d:
            if k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(str(k), f"unknown key; {hint}allowed keys: {', '.join(allowed)}")

    @classmethod
    def from_dict(cls, d: Mapping):
        """Build from a JSON-style dict; missing keys take their defaults."""
        cls._check_keys(d, [f.name for f in fields(cls)] + list(cls._ALWAYS) + list(cls._INERT))
        kwargs, notes = cls._special_keys(d)
        obj = cls(**kwargs)
        object.__setattr__(obj, "_own_notes", tuple(notes))
        return obj

    @classmethod
    def _special_keys(cls, d: Mapping) -> tuple[dict, list[str]]:
        """(the field values of `d`, notes): `_ALWAYS` keys checked, `_INERT` keys noted,
        "auto" resolved to the default where `_AUTO_DEFAULT` allows it."""
        kwargs, notes = {}, []
        for k, v in d.items():
            if k in cls._INERT:
                notes.append(f"{k}: accepted without effect ({cls._INERT[k]})")
            elif k in cls._ALWAYS:
                want, behaviour = cls._ALWAYS[k]
                _check(v == want or v == AUTO, k, f"zmpi always {behaviour} (only {want!r} is "
                       f"supported), got {v!r}")
            elif isinstance(v, str) and v == AUTO:
                _check(k in cls._AUTO_DEFAULT, k, "'auto' has nothing to be derived from "
                       "here; give a value (zmpi train fills optimizer, scheduler, "
                       "gradient_clipping and fp16/bf16 'auto' values from its flags)")
                notes.append(f"{k}: 'auto' is zmpi's default, "
                             f"{next(f.default for f in fields(cls) if f.name == k)!r}")
            else:
                kwargs[k] = v
        return kwargs, notes

    def notes(self) -> list[str]:
        """What this section (and its subsections, as dotted paths) accepted without effect or
        resolved from "auto": one line each, for the engine to print once."""
        out = list(self._own_notes)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Section):
                out += [f"{f.name}.{n}" for n in v.notes()]
        return out

    def _idle(self, keys, why: str) -> list[str]:
        """A note naming those of `keys` set away from their defaults, which have no effect
        under the rest of this section (`why`): for `notes()`."""
        defaults = {f.name: f.default for f in fields(self)}
        idle = [k for k in keys if getattr(self, k) != defaults[k]]
        return [f"{', '.join(idle)}: no effect {why}"] if idle else []

    def to_dict(self) -> dict:
        """JSON-ready dict that `from_dict` maps back to an equal object (None keys omitted)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Section):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            if v is not None:
                out[f.name] = v
        return out

    def replace(self, **kw):
        """A copy with fields replaced and re-validated; a dict for a section updates it."""
        for k, v in kw.items():
            cur = getattr(self, k, None)
            if isinstance(cur, _Section) and isinstance(v, Mapping):
                try:
                    kw[k] = cur.replace(**v)
                except ConfigError as e:
                    raise e.prefixed(k) from None
        try:
            new = dataclasses.replace(self, **kw)
        except TypeError as e:  # unknown field name
            raise ConfigError("", str(e)) from None
        names = {f.name for f in fields(self)}
        for k, v in vars(self).items():  # what from_dict recorded: notes, "auto" batch keys
            if k not in names:
                object.__setattr__(new, k, v)
        return new
