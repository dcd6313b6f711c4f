"""Typed conversion between config dataclass trees and plain data (TOML tables, CLI strings).

Every failure raises ``ConfigError`` naming the full dotted key, what was expected and what was given;
an unknown key also names the closest valid key. Conversion is strict: TOML already carries types, so
a string is never silently turned into a number, and a bool is never accepted as an int.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from torchtitan_rl.config.errors import ConfigError

_NONE_TYPE = type(None)


@functools.cache
def resolved_fields(cls: type) -> tuple[tuple[str, Any, dataclasses.Field], ...]:
    """(name, resolved type, field) for every init field of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], f)
        for f in dataclasses.fields(cls)
        if f.init and not f.name.startswith("_")
    )


def is_config_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def type_name(tp: Any) -> str:
    """A short human name for a type hint: ``float``, ``list[int]``, ``'hot_swap' | 'drain'``."""
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in get_args(tp))}]"
    if tp is _NONE_TYPE:
        return "None"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(repr(m.value) for m in tp)
    return getattr(tp, "__qualname__", repr(tp))


def _type_error(path: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(
        f"{path}: expected {type_name(tp)}, got {value!r} ({type(value).__name__})"
    )


def closest_key(key: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return matches[0] if matches else None


def unknown_key_error(path: str, valid_paths: list[str], where: str = "") -> ConfigError:
    hint = closest_key(path, valid_paths)
    suffix = f"; did you mean '{hint}'?" if hint else ""
    return ConfigError(f"unknown config key '{path}'{where}{suffix}")


def from_data(tp: Any, value: Any, path: str) -> Any:
    """Convert a TOML value (already typed) to ``tp``, raising ConfigError naming ``path``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and _NONE_TYPE in args:
            return None
        errors = []
        for arg in args:
            if arg is _NONE_TYPE:
                continue
            try:
                return from_data(arg, value, path)
            except ConfigError as e:
                errors.append(e)
        raise _type_error(path, tp, value)
    if origin is Literal:
        if value in get_args(tp) and not (isinstance(value, bool) and True not in get_args(tp)):
            return value
        raise ConfigError(
            f"{path}: expected one of {', '.join(repr(a) for a in get_args(tp))}, got {value!r}"
        )
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, tp, value)
        args = get_args(tp)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],)
        item_tp = args[0] if args else Any
        items = [from_data(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(path, tp, value)
        _, val_tp = get_args(tp) or (str, Any)
        return {str(k): from_data(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if is_config_class(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{path}: expected a table for {tp.__qualname__}, got {value!r} "
                f"({type(value).__name__})"
            )
        return dataclass_from_data(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        for member in tp:
            if value == member.value or value == member.name:
                return member
        raise _type_error(path, tp, value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, tp, value)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _type_error(path, tp, value)


def dataclass_from_data(cls: type, data: dict[str, Any], path: str = "", base: Any = None) -> Any:
    """Build ``cls`` from a table; keys absent from ``data`` come from ``base`` (or the defaults)."""
    fields = {name: (tp, f) for name, tp, f in resolved_fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else key
        if key not in fields:
            valid = [f"{path}.{name}" if path else name for name in fields]
            raise unknown_key_error(key_path, valid)
        tp, _ = fields[key]
        sub_base = getattr(base, key, None) if base is not None else None
        if is_config_class(tp) and isinstance(value, dict) and sub_base is not None:
            kwargs[key] = dataclass_from_data(tp, value, key_path, base=sub_base)
        else:
            kwargs[key] = from_data(tp, value, key_path)
    try:
        if base is not None:
            return dataclasses.replace(base, **kwargs)
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a missing required field, or a __post_init__ check
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def parse_cli_value(tp: Any, text: str, path: str) -> Any:
    """Parse one CLI string as ``tp`` (the CLI is the only place strings become numbers)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not _NONE_TYPE]
        if text.lower() in ("none", "null") and len(args) < len(get_args(tp)):
            return None
        for arg in args:
            try:
                return parse_cli_value(arg, text, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {text!r}")
    if origin is Literal:
        for choice in get_args(tp):
            if str(choice) == text:
                return choice
        raise ConfigError(
            f"{path}: expected one of {', '.join(repr(a) for a in get_args(tp))}, got {text!r}"
        )
    if origin in (list, tuple):
        item_tp = (get_args(tp) or (str,))[0]
        items = [s for s in (p.strip() for p in text.split(",")) if s]
        parsed = [parse_cli_value(item_tp, s, f"{path}[{i}]") for i, s in enumerate(items)]
        return parsed if origin is list else tuple(parsed)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return from_data(tp, text, path)
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{path}: expected bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{path}: expected int, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{path}: expected float, got {text!r}") from None
    if tp is str or tp is Any:
        return text
    raise ConfigError(f"{path}: type {type_name(tp)} cannot be set from the command line")


def to_data(value: Any) -> Any:
    """A config tree as plain TOML-able data. ``None`` fields are omitted (TOML has no null)."""
    if is_config_class(type(value)):
        out = {}
        for name, _, _ in resolved_fields(type(value)):
            v = getattr(value, name)
            if v is not None:
                out[name] = to_data(v)
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_data(v) for k, v in value.items() if v is not None}
    return value


def leaf_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every scalar/list leaf of a config class as ``{dotted.path: type}`` (for the CLI)."""
    out: dict[str, Any] = {}
    for name, tp, _ in resolved_fields(cls):
        path = f"{prefix}.{name}" if prefix else name
        inner = [a for a in get_args(tp) if a is not _NONE_TYPE] if get_origin(tp) in (
            Union,
            types.UnionType,
        ) else [tp]
        if len(inner) == 1 and is_config_class(inner[0]):
            out.update(leaf_paths(inner[0], path))
        else:
            out[path] = tp
    return out
