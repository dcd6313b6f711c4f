"""``--help``: every option of the config tree with its type, default and docstring, by section.

    model options:
      --model.size 'tiny' | 'demo' | 'small'  (default: tiny; TOML: demo)
          With an empty `path`: the project's own random model of this size, ...

``--help SECTION`` (``--help trainer``, ``--help generator.sampling``) shows that section and its
subsections only (``job``: the job's own fields; a dotted option, e.g. ``--help sampling.top_p``:
that option); the full help starts with an index of the sections.

Fast by construction: the options are read from the source files (config/source_schema.py), so
``--help`` imports neither torch nor vLLM nor Monarch (~0.3 s instead of ~6 s). The polymorphic
``task`` shows the options of the task class that ``--task.type`` or the TOML's ``[task] type``
names. Should the source reader meet something it cannot evaluate, the help imports the classes
instead (`live_sections`): slower, same text; a test holds the two to agreement.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import logging
import shutil
import textwrap
from collections.abc import Iterable
from typing import Any, get_args, get_origin

from torchtitan_rl.config import source_schema as ss

logger = logging.getLogger(__name__)

ROOT_CONFIG = "torchtitan_rl.controller.job:RLJob.Config"
"""The job's root config class, by import path (read from source, never imported for help)."""

TASK_TYPE_DOC = ("The task class, an import path `package.module:Class` whose Config subclasses "
                 "torchtitan_rl.task.TaskConfig, or a task this package ships: 'reasoning_gym', "
                 "'textarena' (docs/environments.md); the task's own options follow it (name one "
                 "with --task.type or a TOML's [task] type to list them).")


@dataclasses.dataclass
class Option:
    path: str
    type: str
    default: str
    doc: str = ""
    toml: str | None = None
    """The value the TOML file sets, shown beside the default."""


@dataclasses.dataclass
class Section:
    path: str
    """Dotted prefix of its options ("" for the job's own fields)."""
    doc: str
    options: list[Option] = dataclasses.field(default_factory=list)


ROOT_SECTION = "job"
"""How ``--help`` names the section of the root config's own fields (its dotted prefix is "")."""


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def help_topic(argv: list[str]) -> str | None:
    """The section ``--help SECTION`` (or ``--help=SECTION``, ``-h SECTION``) asks for; None for
    the whole help. A token after ``--help`` that starts with ``-`` is the next option."""
    for i, arg in enumerate(argv):
        if arg.startswith("--help="):
            return arg.partition("=")[2] or None
        if arg in ("-h", "--help") and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return None


def select(sections: list[Section], topic: str) -> list[Section]:
    """The sections ``--help topic`` shows: the section named ``topic`` and its subsections, or
    the one option whose dotted path is ``topic``. Raises ConfigError (one line listing the
    sections) for anything else."""
    from torchtitan_rl.config.errors import ConfigError

    name = topic.strip().strip(".")
    if name == ROOT_SECTION:
        return [s for s in sections if s.path == ""]
    chosen = [s for s in sections if s.path == name or s.path.startswith(name + ".")]
    if chosen:
        return chosen
    for section in sections:
        for option in section.options:
            if option.path == name:
                return [dataclasses.replace(section, options=[option])]
    raise ConfigError(f"--help {topic}: no such section; the sections are "
                      f"{', '.join(section_names(sections))}")


def section_names(sections: list[Section]) -> list[str]:
    return [s.path or ROOT_SECTION for s in sections]


def show(value: Any) -> str:
    """A value as one would type it on the command line."""
    if value is ss.MISSING:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return show(value.value)
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple)):
        return ",".join(show(v) for v in value) if value else "[]"
    return repr(value)


# ---- the tree, read from source -----------------------------------------------------------------
TaskTypes = str | dict[str, str] | None
"""The classes polymorphic fields take, by path (``{"task": ..., "task.episodes": ...}``); a
string is the job's task's."""


def _by_path(task_types: TaskTypes) -> dict[str, str]:
    if task_types is None:
        return {}
    return {"task": task_types} if isinstance(task_types, str) else dict(task_types)


def static_sections(root: str, task_types: TaskTypes) -> list[Section]:
    """The option sections of ``root`` read from source; ``task_types`` pick the polymorphic
    fields' classes. Raises SourceSchemaError when the source holds what the reader cannot
    evaluate."""
    index = ss.SourceIndex()
    root_cls = index.class_at(root)
    sections: dict[str, Section] = {}
    _static_walk(index, index.instance(root_cls), "", "", sections, _by_path(task_types))
    return _ordered(sections)


def _static_walk(index: ss.SourceIndex, instance: ss.Instance, prefix: str, doc: str,
                 sections: dict[str, Section], types: dict[str, str]) -> None:
    section = sections.setdefault(prefix, Section(path=prefix, doc=doc))
    for field in index.fields(instance.cls):
        path = f"{prefix}.{field.name}" if prefix else field.name
        child_cls = _config_class(index, field.module, field.annotation)
        value = instance.values.get(field.name, ss.MISSING)
        if child_cls is None:
            section.options.append(Option(path=path, doc=field.doc, default=show(value),
                                          type=_type_text(index, field.module, field.annotation)))
            continue
        if index.class_var(child_cls, "polymorphic"):
            # --task.type (or a TOML's [task] type) picks the job's task, --task.episodes.type
            # an agent task's episode task; a polymorphic field nobody named shows its `type`.
            concrete = index.class_at(types[path]) if path in types else None
            child_doc = field.doc or _class_doc(child_cls)
            sub = sections.setdefault(path, Section(path=path, doc=child_doc))
            sub.options.append(Option(path=f"{path}.type", type="str", doc=TASK_TYPE_DOC,
                                      default="required"))
            child = index.instance(concrete) if concrete is not None else value
        else:
            child = value
        if not isinstance(child, ss.Instance):
            child = index.instance(child_cls)
        _static_walk(index, child, path, field.doc or _class_doc(child.cls), sections, types)


def _config_class(index: ss.SourceIndex, module: ss.SourceModule,
                  node: ast.expr) -> ss.SourceClass | None:
    """The config class an annotation names (``X`` or ``X | None``), else None."""
    parts = _union_parts(node)
    inner = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)]
    if len(inner) != 1 or not isinstance(inner[0], (ast.Name, ast.Attribute)):
        return None
    target = index.resolve(module, inner[0])
    if isinstance(target, ss.SourceClass) and index.is_dataclass(target):
        return target
    return None


def _union_parts(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_parts(node.left) + _union_parts(node.right)
    return [node]


def _type_text(index: ss.SourceIndex, module: ss.SourceModule, node: ast.expr) -> str:
    """The annotation as `convert.type_name` prints the resolved type."""
    if isinstance(node, ast.Constant):
        if node.value is None:
            return "None"
        if isinstance(node.value, str):
            return _type_text(index, module, ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return " | ".join(_type_text(index, module, p) for p in _union_parts(node))
    if isinstance(node, ast.Subscript):
        origin = index.resolve(module, node.value)
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        name = origin.path.rsplit(".", 1)[-1] if isinstance(origin, ss.External) else origin
        if name == "Literal":
            return " | ".join(repr(index.value(module, a)) for a in args)
        if name == "Optional":
            return f"{_type_text(index, module, args[0])} | None"
        if name == "Union":
            return " | ".join(_type_text(index, module, a) for a in args)
        if name == "Annotated":
            return _type_text(index, module, args[0])
        texts = ["Ellipsis" if isinstance(a, ast.Constant) and a.value is Ellipsis
                 else _type_text(index, module, a) for a in args]
        return f"{str(name).lower()}[{', '.join(texts)}]"
    target = index.resolve(module, node)
    if isinstance(target, str):
        return target
    if isinstance(target, tuple) and isinstance(target[-1], ast.expr):
        return _type_text(index, *target)
    if isinstance(target, ss.SourceClass):
        values = index.enum_values(target)
        if values is not None:
            return " | ".join(repr(v) for v in values)
        return target.qualname
    if isinstance(target, ss.External):
        return target.path.rsplit(".", 1)[-1]
    raise ss.SourceSchemaError(f"{module.name}: cannot name the type {ast.unparse(node)}")


def _class_doc(cls: ss.SourceClass) -> str:
    """A section's doc when its field has none: the first paragraph of the owner's docstring,
    else the class's, else (for a component's nested Config) its module's."""
    for node in (cls.owner.node if cls.owner else None, cls.node,
                 cls.module.tree if cls.owner else None):
        doc = ast.get_docstring(node) if node is not None else None
        if doc:
            return doc.split("\n\n")[0]
    return ""


# ---- the tree, imported (fallback; and what tests compare the source reader with) ---------------
def live_sections(root: str, task_types: TaskTypes) -> list[Section]:
    """The same sections from the imported classes (docstrings still read from source)."""
    import importlib

    from torchtitan_rl.config.convert import (
        import_config_class,
        is_config_class,
        is_polymorphic,
        resolved_fields,
        type_name,
    )

    module_name, _, qualname = root.partition(":")
    root_cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        root_cls = getattr(root_cls, part)
    index = ss.SourceIndex()
    sections: dict[str, Section] = {}
    types = _by_path(task_types)

    def docs_of(cls: type, name: str) -> str:
        for klass in cls.__mro__:
            if name in klass.__dict__.get("__annotations__", {}):
                source = index.class_at(f"{klass.__module__}:{klass.__qualname__}")
                return next((f.doc for f in index.fields(source) if f.name == name), "")
        return ""

    def walk(instance: Any, prefix: str, doc: str) -> None:
        section = sections.setdefault(prefix, Section(path=prefix, doc=doc))
        for name, tp, _ in resolved_fields(type(instance)):
            path = f"{prefix}.{name}" if prefix else name
            inner = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (
                __import__("typing").Union, __import__("types").UnionType) else [tp]
            value = getattr(instance, name)
            field_doc = docs_of(type(instance), name)
            if not (len(inner) == 1 and is_config_class(inner[0])):
                section.options.append(Option(path=path, type=type_name(tp), doc=field_doc,
                                              default=show(value)))
                continue
            child = value if value is not None else inner[0]()
            if is_polymorphic(inner[0]):
                sub = sections.setdefault(path, Section(path=path, doc=field_doc))
                sub.options.append(Option(path=f"{path}.type", type="str", doc=TASK_TYPE_DOC,
                                          default="required"))
                if path in types:  # as in _static_walk
                    child = import_config_class(types[path], inner[0], f"{path}.type")()
            cls_doc = _class_doc(index.class_at(f"{type(child).__module__}:"
                                                f"{type(child).__qualname__}"))
            walk(child, path, field_doc or cls_doc)

    walk(root_cls(), "", "")
    return _ordered(sections)


def _ordered(sections: dict[str, Section]) -> list[Section]:
    return [s for s in sections.values() if s.options]


# ---- rendering -----------------------------------------------------------------------------------
def _width(width: int | None) -> int:
    return width or max(60, min(110, shutil.get_terminal_size((100, 24)).columns))


def render(sections: list[Section], *, usage: str, description: str,
           global_options: Iterable[tuple[str, str]], width: int | None = None) -> str:
    """The whole help: usage, description, an index of the sections, the global options, then
    every section."""
    width = _width(width)
    lines = [*textwrap.wrap(usage, width, subsequent_indent="    ", break_on_hyphens=False),
             "", *textwrap.wrap(description, width), "",
             "sections (--help SECTION shows one with its subsections, e.g. --help trainer):",
             *textwrap.wrap(", ".join(section_names(sections)), width, initial_indent="  ",
                            subsequent_indent="  ", break_on_hyphens=False),
             "", "options:"]
    for flag, text in global_options:
        lines += _entry(flag, text, width)
    lines += render_sections(sections, width=width)
    return "\n".join(lines) + "\n"


def render_sections(sections: list[Section], *, width: int | None = None) -> list[str]:
    """Each section's header, doc and options (each preceded by a blank line)."""
    width = _width(width)
    lines: list[str] = []
    for section in sections:
        lines += ["", f"{section.path or ROOT_SECTION} options:"]
        if section.doc:
            lines += textwrap.wrap(" ".join(section.doc.split()), width, initial_indent="  ",
                                   subsequent_indent="  ")
        for option in section.options:
            shown = f"default: {option.default}"
            if option.toml is not None:
                shown += f"; TOML: {option.toml}"
            lines += _entry(f"--{option.path} {option.type}  ({shown})", option.doc, width)
    return lines


def _entry(head: str, doc: str, width: int) -> list[str]:
    out = [f"  {head}"]
    if doc:
        out += textwrap.wrap(" ".join(doc.split()), width, initial_indent="      ",
                             subsequent_indent="      ")
    return out


def print_help(argv: list[str], *, usage: str, description: str,
               global_options: Iterable[tuple[str, str]]) -> None:
    """Write the help for ``argv`` to stdout; a bad TOML file is one ``error:`` line, exit 2 (the
    command lines of train and eval)."""
    import sys

    from torchtitan_rl.config.errors import ConfigError

    try:
        sys.stdout.write(help_text(argv, usage=usage, description=description,
                                   global_options=global_options))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def help_text(argv: list[str], *, usage: str, description: str,
              global_options: Iterable[tuple[str, str]], root: str = ROOT_CONFIG) -> str:
    """The help for ``argv``: its ``--config`` TOML's values beside the defaults, and the options
    of the task that ``--task.type`` or the TOML names; only the asked section for ``--help
    SECTION``. Raises ConfigError for a bad TOML file or an unknown section."""
    sections = sections_for(argv, root=root)
    topic = help_topic(argv)
    if topic is not None:
        return "\n".join(render_sections(select(sections, topic))[1:]) + "\n"
    return render(sections, usage=usage, description=description, global_options=global_options)


def sections_for(argv: list[str], *, root: str = ROOT_CONFIG) -> list[Section]:
    """The option sections of ``root`` for a command line: the task's options when
    ``--task.type`` or the ``--config`` TOML names one, each option's TOML value beside its
    default. Raises ConfigError for a bad TOML file."""
    from torchtitan_rl.config.manager import load_toml

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    args, rest = parser.parse_known_args(argv)
    data = load_toml(args.config) if args.config else {}
    types = _toml_types(data)
    for index, arg in enumerate(rest):  # --<path>.type X or --<path>.type=X
        name, equals, value = arg.partition("=")
        if name.startswith("--") and name.endswith(".type"):
            if not equals:
                value = rest[index + 1] if index + 1 < len(rest) else ""
            types[name[2:-len(".type")]] = value
    try:
        sections = static_sections(root, types)
    except ss.SourceSchemaError as e:
        logger.debug("help: reading the config from source failed (%s); importing it", e)
        sections = live_sections(root, types)
    for section in sections:
        for option in section.options:
            value = _lookup(data, option.path)
            if value is not _ABSENT:
                option.toml = show(value)
    return sections


_ABSENT = object()


def _toml_types(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Every table's ``type`` key in a TOML, by the table's path."""
    types: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            path = f"{prefix}.{key}" if prefix else key
            if isinstance(value.get("type"), str):
                types[path] = value["type"]
            types.update(_toml_types(value, path))
    return types


def _lookup(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node
