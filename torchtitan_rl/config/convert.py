"""Typed conversion between config dataclass trees and plain data (TOML tables, CLI strings).

Every failure raises ``ConfigError`` naming the full dotted key, what was expected and what was given;
an unknown key also names the closest valid key, and a key that moved says where it went (a config
class lists those in ``moved_keys``). Conversion is strict: TOML already carries types, so a string
is never silently turned into a number, and a bool is never accepted as an int.

Polymorphic fields: a field annotated with a config class whose ``polymorphic`` class attribute is
true (e.g. the job's ``task``) holds any subclass of it. Its table names the concrete class in a
``type`` key, an import path ``package.module:Class`` of a `Configurable` (or of its Config):

    [task]
    type = "examples.alphabet_sort:AlphabetSortTask"
    max_turns = 2
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import importlib
import importlib.util
import pathlib
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


TYPE_KEY = "type"


def is_polymorphic(tp: Any) -> bool:
    return is_config_class(tp) and bool(getattr(tp, "polymorphic", False))


def type_path_of(config: Any) -> str:
    """The ``type`` value naming ``config``'s class (its owner's, for a Configurable's Config)."""
    cls = getattr(type(config), "_owner", None) or type(config)
    return f"{cls.__module__}:{cls.__qualname__}"


MOVED_MODULES = {"torchtitan_rl.examples": "examples"}
"""Old module -> where its classes live now: import paths written into saved configs and
checkpoints (``task.type``) by earlier versions keep resolving."""


def current_type_path(type_path: str) -> str:
    """``type_path`` with a moved module (MOVED_MODULES) replaced by its new name."""
    for old, new in MOVED_MODULES.items():
        if type_path == old or type_path.startswith((f"{old}.", f"{old}:")):
            return new + type_path[len(old):]
    return type_path


def import_config_class(type_path: Any, base: type, path: str) -> type:
    """The config class named by ``type_path``, checked to be a subclass of ``base``."""
    if not isinstance(type_path, str) or not type_path:
        raise ConfigError(f"{path}: expected an import path 'package.module:Class', got "
                          f"{type_path!r}")
    short_names = getattr(base, "short_type_names", {})
    type_path = short_names.get(type_path, type_path)
    type_path = current_type_path(type_path)
    if _looks_like_a_file(type_path):
        raise ConfigError(f"{path}: {type_path!r} is a file path; expected an import path "
                          f"'package.module:Class'{_dotted_form(type_path)}")
    module_name, _, qualname = type_path.partition(":")
    if not qualname:
        module_name, _, qualname = type_path.rpartition(".")
    if not module_name or module_name.startswith(".") or not qualname:
        near = difflib.get_close_matches(type_path, list(short_names), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else (
            f" or one of {', '.join(map(repr, short_names))}" if short_names else "")
        raise ConfigError(f"{path}: expected an import path 'package.module:Class'"
                          f"{'' if near else hint}, got {type_path!r}{hint if near else ''}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(f"{e.name}.")):
            raise ConfigError(_import_failed(path, type_path, e)) from e  # one of its imports
        raise ConfigError(f"{path}: cannot import {type_path!r} ({e})"
                          f"{_near_module(module_name)}") from None
    except Exception as e:  # the module's own code raised: one line, its traceback kept as cause
        raise ConfigError(_import_failed(path, type_path, e)) from e
    for part in qualname.split("."):
        if not hasattr(obj, part):
            near = difflib.get_close_matches(
                part, [n for n in dir(obj) if not n.startswith("_")], n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{path}: cannot import {type_path!r} ({getattr(obj, '__name__', obj)}"
                              f" has no {part!r}{hint})")
        obj = getattr(obj, part)
    config_cls = getattr(obj, "Config", obj)
    owner = getattr(config_cls, "_owner", None)
    if isinstance(obj, type) and config_cls is not obj and owner is not None and owner is not obj:
        # A subclass that inherits its parent's Config would build the parent: not what was named.
        raise ConfigError(
            f"{path}: {type_path!r} has no Config of its own (it inherits "
            f"{owner.__qualname__}.Config, which builds {owner.__qualname__}); declare one in "
            f"the class: @dataclasses.dataclass(kw_only=True, slots=True) class "
            f"Config({owner.__qualname__}.Config): pass")
    if not (isinstance(config_cls, type) and issubclass(config_cls, base)):
        raise ConfigError(f"{path}: {type_path!r} is not a {base.__qualname__} (its Config must "
                          f"subclass {base.__module__}.{base.__qualname__})")
    return config_cls


def _looks_like_a_file(type_path: str) -> bool:
    """Whether ``type_path`` names a file (``examples/task.py:Task``, ``task.py``), not a module."""
    module = type_path.partition(":")[0]
    return "/" in module or "\\" in module or module.endswith(".py")


def _dotted_form(type_path: str) -> str:
    """``; did you mean 'pkg.mod:Class'?`` for a file path relative to the working directory
    (the form Python imports it by); "" when no class is named to suggest a whole path for."""
    file, _, qualname = type_path.partition(":")
    where = pathlib.Path(file.replace("\\", "/")).with_suffix("")
    if where.is_absolute() and where.is_relative_to(pathlib.Path.cwd()):
        where = where.relative_to(pathlib.Path.cwd())
    module = ".".join(part for part in where.parts if part not in ("", ".", "/"))
    if not qualname:
        return f" (the module {module!r}, then ':' and the class, e.g. '{module}:MyTask')"
    return f"; did you mean '{module}:{qualname}'?"


def import_function(path: str, key: str) -> Any:
    """The function a ``package.module:function`` setting names (ConfigError naming ``key``)."""
    if _looks_like_a_file(path):
        raise ConfigError(f"{key}: {path!r} is a file path; expected an import path "
                          f"'package.module:function'{_dotted_form(path)}")
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ConfigError(f"{key}: 'package.module:function' expected, got {path!r}")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key} = {path!r}: {e}") from e


def _near_module(module_name: str) -> str:
    """``; did you mean 'pkg.near'?`` for the first part of ``module_name`` that does not exist,
    from the modules beside it (or top-level ones); "" when nothing is close."""
    import pkgutil

    parts = module_name.split(".")
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        candidate = ".".join(parts[:depth + 1])
        if importlib.util.find_spec(candidate) is not None:
            continue
        try:
            where = importlib.import_module(prefix).__path__ if prefix else None
        except (ImportError, AttributeError):
            return ""
        names = [m.name for m in pkgutil.iter_modules(where)]
        near = difflib.get_close_matches(parts[depth], names, n=1, cutoff=0.6)
        if not near:
            return ""
        return f"; did you mean {'.'.join([*parts[:depth], near[0]])!r}?"
    return ""


def _import_failed(path: str, type_path: str, error: BaseException) -> str:
    """One line for a module that raised on import: the exception's last line and where (the
    innermost frame), clipped; the CLI writes the whole traceback to the run's log file."""
    import traceback

    if isinstance(error, SyntaxError):  # its own file and line, not importlib's frame
        where = f" ({pathlib.Path(error.filename or '?').name}:{error.lineno})"
        message = error.msg or ""
    else:
        # The innermost frame of the user's code (the task module, not json or importlib).
        frames = [f for f in traceback.extract_tb(error.__traceback__)
                  if not f.filename.startswith("<frozen")]
        own = [f for f in frames if not _is_library_file(f.filename)] or frames
        where = f" ({pathlib.Path(own[-1].filename).name}:{own[-1].lineno})" if own else ""
        message = " ".join(str(error).split())
    if len(message) > 160:
        message = message[:157].rstrip() + "..."
    last = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return f"{path}: importing {type_path!r} raised {last}{where}"


def _is_library_file(filename: str) -> bool:
    import sysconfig

    path = pathlib.Path(filename)
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return "site-packages" in path.parts or stdlib in path.parents


def moved_key_hint(cls: type, key: str) -> str | None:
    """What to write instead of ``key``, when ``cls`` lists it as moved or removed."""
    return (getattr(cls, "moved_keys", None) or {}).get(key)


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
        if _NONE_TYPE in args and _is_none_text(value):  # TOML has no null: "none" says it
            return None
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
            hint = moved_key_hint(cls, key)
            if hint is not None:
                raise ConfigError(f"{key_path}: {hint}")
            valid = [f"{path}.{name}" if path else name for name in fields]
            raise unknown_key_error(key_path, valid)
        tp, _ = fields[key]
        sub_base = getattr(base, key, None) if base is not None else None
        if is_polymorphic(tp) and isinstance(value, dict):
            value = dict(value)
            concrete = (import_config_class(value.pop(TYPE_KEY), tp, f"{key_path}.{TYPE_KEY}")
                        if TYPE_KEY in value else type(sub_base) if sub_base is not None else tp)
            kept = sub_base if type(sub_base) is concrete else None
            kwargs[key] = dataclass_from_data(concrete, value, key_path, base=kept)
        elif is_config_class(tp) and isinstance(value, dict) and sub_base is not None:
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
    """A config tree as plain TOML-able data. TOML has no null: a ``None`` field is omitted
    where its default is None, and written ``"none"`` (which reads back as None) where the
    default is a value, so ``--print-config`` loads back to an equal config."""
    if is_config_class(type(value)):
        out = {}
        if is_polymorphic(type(value)) and getattr(type(value), "_owner", None) is not None:
            out[TYPE_KEY] = type_path_of(value)
        for name, tp, field in resolved_fields(type(value)):
            v = getattr(value, name)
            if v is not None:
                out[name] = to_data(v)
            elif _default_of(field) is not None and _reads_none_text_as_none(tp):
                out[name] = "none"
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_data(v) for k, v in value.items() if v is not None}
    return value


def _is_none_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("none", "null")


def _reads_none_text_as_none(tp: Any) -> bool:
    """Whether ``from_data(tp, "none")`` is None (an optional type no member of which takes the
    string)."""
    try:
        return from_data(tp, "none", "") is None
    except ConfigError:
        return False


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def leaf_paths(cls: type, prefix: str = "", instance: Any = None) -> dict[str, Any]:
    """Every scalar/list leaf of a config class as ``{dotted.path: type}`` (for the CLI). With
    ``instance``, a polymorphic field contributes the leaves of the class it holds, plus its
    ``type`` key."""
    out: dict[str, Any] = {}
    if is_polymorphic(cls):
        out[f"{prefix}.{TYPE_KEY}" if prefix else TYPE_KEY] = str
        if instance is not None:
            cls = type(instance)
    for name, tp, _ in resolved_fields(cls):
        path = f"{prefix}.{name}" if prefix else name
        inner = [a for a in get_args(tp) if a is not _NONE_TYPE] if get_origin(tp) in (
            Union,
            types.UnionType,
        ) else [tp]
        if len(inner) == 1 and is_config_class(inner[0]):
            child = getattr(instance, name, None) if instance is not None else None
            out.update(leaf_paths(inner[0], path, child))
        else:
            out[path] = tp
    return out


def moved_paths(cls: type, prefix: str = "") -> dict[str, str]:
    """``{dotted.path: hint}`` of every moved or removed key in a config class tree."""
    out = {f"{prefix}.{k}" if prefix else k: v
           for k, v in (getattr(cls, "moved_keys", None) or {}).items()}
    for name, tp, _ in resolved_fields(cls):
        if is_config_class(tp):
            out.update(moved_paths(tp, f"{prefix}.{name}" if prefix else name))
    return out


def polymorphic_type_paths(cls: type, prefix: str = "") -> list[str]:
    """The dotted ``type`` keys of every polymorphic field in a config class tree."""
    out: list[str] = []
    for name, tp, _ in resolved_fields(cls):
        path = f"{prefix}.{name}" if prefix else name
        if is_polymorphic(tp):
            out.append(f"{path}.{TYPE_KEY}")
        elif is_config_class(tp):
            out += polymorphic_type_paths(tp, path)
    return out
