"""Read a config dataclass tree from its source files, without importing them.

Why: ``--help`` must be fast, and every config class lives next to the component it configures
(``Rollouter.Config`` in rollout/rollouter.py, which imports torch, vLLM or Monarch): importing the
job's config tree takes ~6 s on a 2-core CPU. The field docstrings (the string literal under each
field) exist only in the source anyway. So this module parses the modules with `ast`, follows
their imports by file (importlib's finders locate files without executing them), and evaluates
defaults that are literals, arithmetic, module constants, enum members, ``field(default=...)``
and ``field(default_factory=...)`` (a class, or a function or lambda returning ``Cls(key=...)``).

What it cannot evaluate raises `SourceSchemaError`; the help then falls back to importing the
classes (config/help.py). tests/config/test_config_help.py checks that this reader and the
imported classes agree on every option of the job's tree.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.machinery
import importlib.util
import inspect
import operator
import pathlib
import sys
from typing import Any


class SourceSchemaError(Exception):
    """Something in the source this reader does not evaluate (the caller falls back to imports)."""


MISSING = object()
"""The default of a field that has none (a required field)."""

_BUILTINS = {"int", "float", "str", "bool", "list", "dict", "tuple", "set", "frozenset",
             "object", "type", "bytes"}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitOr: operator.or_, ast.BitAnd: operator.and_}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}


@dataclasses.dataclass(eq=False)
class SourceModule:
    name: str
    tree: ast.Module
    namespace: dict[str, ast.AST]
    is_package: bool


@dataclasses.dataclass(eq=False)
class SourceClass:
    module: SourceModule
    node: ast.ClassDef
    qualname: str
    owner: SourceClass | None = None
    """The class this one is nested in (a Configurable's ``Config`` -> the Configurable)."""


@dataclasses.dataclass(frozen=True)
class External:
    path: str
    """A name from a module this reader does not parse (typing, dataclasses, enum, C modules)."""


@dataclasses.dataclass
class SourceField:
    name: str
    annotation: ast.expr
    value: ast.expr | None
    module: SourceModule
    """Where the annotation and default are written (a base class's module for inherited ones)."""
    doc: str


@dataclasses.dataclass
class Instance:
    cls: SourceClass
    values: dict[str, Any]
    """A config class's default values: leaf values, or nested Instances."""


class SourceIndex:
    """Parsed modules by name, and name resolution across their imports."""

    def __init__(self) -> None:
        self._modules: dict[str, SourceModule | None] = {}
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def _spec(self, name: str) -> importlib.machinery.ModuleSpec | None:
        if name not in self._specs:
            parent, _, last = name.rpartition(".")
            if not parent:  # a top-level name: the finders locate it without importing it
                spec = sys.modules[name].__spec__ if name in sys.modules else (
                    importlib.util.find_spec(name))
            else:
                parent_spec = self._spec(parent)
                locations = parent_spec.submodule_search_locations if parent_spec else None
                spec = (importlib.machinery.PathFinder.find_spec(last, list(locations))
                        if locations else None)
            self._specs[name] = spec
        return self._specs[name]

    def module(self, name: str) -> SourceModule | None:
        """The parsed module, or None when it has no Python source (stdlib C modules, missing)."""
        if name not in self._modules:
            spec = self._spec(name)
            origin = spec.origin if spec is not None else None
            if origin is None or not origin.endswith(".py") or _is_stdlib(origin):
                self._modules[name] = None
            else:
                try:
                    tree = ast.parse(pathlib.Path(origin).read_text(), filename=origin)
                except SyntaxError as e:  # importing it says so in one line (help falls back)
                    raise SourceSchemaError(f"{name}: {e}") from None
                self._modules[name] = SourceModule(
                    name=name, tree=tree, namespace=_namespace(tree.body),
                    is_package=spec.submodule_search_locations is not None)
        return self._modules[name]

    def resolve(self, module: SourceModule, node: ast.expr) -> Any:
        """What ``node`` (a Name or dotted Attribute) names in ``module``: a SourceClass, a
        SourceModule, a FunctionDef (with its module), an (module, expr) alias, an External, or
        a builtin's name."""
        if isinstance(node, ast.Name):
            return self._lookup(module, node.id)
        if isinstance(node, ast.Attribute):
            return self._member(self.resolve(module, node.value), node.attr)
        raise SourceSchemaError(f"{module.name}: cannot resolve {ast.unparse(node)}")

    def _lookup(self, module: SourceModule, name: str) -> Any:
        target = module.namespace.get(name)
        if target is None:
            if name in _BUILTINS or name == "None":
                return name
            raise SourceSchemaError(f"{module.name}: name {name!r} is not defined")
        if isinstance(target, ast.ClassDef):
            return SourceClass(module=module, node=target, qualname=name)
        if isinstance(target, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return (module, target)
        if isinstance(target, ast.ImportFrom):
            source = _absolute(module, target)
            original = next(a.name for a in target.names if (a.asname or a.name) == name)
            return self._from_module(source, original)
        if isinstance(target, ast.Import):
            alias = next(a for a in target.names if (a.asname or a.name.split(".")[0]) == name)
            full = alias.name if alias.asname else alias.name.split(".")[0]
            return self.module(full) or External(full)
        assert isinstance(target, ast.expr)
        return (module, target)  # a module-level alias or constant

    def _from_module(self, module_name: str, name: str) -> Any:
        module = self.module(module_name)
        if module is None:
            return External(f"{module_name}.{name}")
        if name in module.namespace:
            return self._lookup(module, name)
        if module.is_package and self.module(f"{module_name}.{name}") is not None:
            return self.module(f"{module_name}.{name}")
        raise SourceSchemaError(f"{module_name} defines no {name!r}")

    def _member(self, base: Any, attr: str) -> Any:
        if isinstance(base, External):
            return External(f"{base.path}.{attr}")
        if isinstance(base, SourceModule):
            return self._from_module(base.name, attr)
        if isinstance(base, SourceClass):
            for stmt in base.node.body:
                if isinstance(stmt, ast.ClassDef) and stmt.name == attr:
                    return SourceClass(module=base.module, node=stmt,
                                       qualname=f"{base.qualname}.{attr}", owner=base)
                target, value = _assigned(stmt)
                if target == attr and isinstance(value, (ast.Name, ast.Attribute)):
                    # ``Config = GeneratorConfig``: a Config defined elsewhere, owned here
                    named = self.resolve(base.module, value)
                    if isinstance(named, SourceClass):
                        return dataclasses.replace(named, owner=base)
            return ("member", base, attr)  # an enum member or a class attribute
        raise SourceSchemaError(f"cannot take .{attr} of {base!r}")

    def class_at(self, type_path: str) -> SourceClass:
        """The class an import path ``package.module:Class`` (or ``package.module.Class``) names;
        a Configurable's nested ``Config`` when it has one (as config/convert.py imports it)."""
        module_name, _, qualname = type_path.partition(":")
        if not qualname:
            module_name, _, qualname = type_path.rpartition(".")
        module = self.module(module_name)
        if module is None:  # not on the path as source: importing it will say why
            raise SourceSchemaError(f"cannot find the source of {module_name!r}")
        target: Any = module
        for part in qualname.split("."):
            target = self._member(target, part)
        if not isinstance(target, SourceClass):
            raise SourceSchemaError(f"{type_path!r} is not a class")
        nested = self._member(target, "Config")
        return nested if isinstance(nested, SourceClass) else target

    def bases(self, cls: SourceClass) -> list[Any]:
        return [self.resolve(cls.module, b) for b in cls.node.bases]

    def is_dataclass(self, cls: SourceClass) -> bool:
        if any(self._is_dataclass_decorator(cls.module, d) for d in cls.node.decorator_list):
            return True
        return any(isinstance(b, SourceClass) and self.is_dataclass(b) for b in self.bases(cls))

    def _is_dataclass_decorator(self, module: SourceModule, node: ast.expr) -> bool:
        target = node.func if isinstance(node, ast.Call) else node
        return self._names(module, target, "dataclasses.dataclass")

    def _names(self, module: SourceModule, node: ast.expr, path: str) -> bool:
        """Whether ``node`` names the external ``path`` (e.g. ``typing.ClassVar``)."""
        try:
            resolved = self.resolve(module, node)
        except SourceSchemaError:
            return False
        return isinstance(resolved, External) and resolved.path == path

    def class_var(self, cls: SourceClass, name: str) -> Any:
        """A class attribute's literal value (searching the bases), or None."""
        for stmt in cls.node.body:
            target, value = _assigned(stmt)
            if target == name and value is not None:
                return self.value(cls.module, value)
        for base in self.bases(cls):
            if isinstance(base, SourceClass):
                found = self.class_var(base, name)
                if found is not None:
                    return found
        return None

    def fields(self, cls: SourceClass) -> list[SourceField]:
        """The init fields, in dataclass order (bases first), as `resolved_fields` lists them."""
        out: dict[str, SourceField] = {}
        for base in reversed(self.bases(cls)):
            if isinstance(base, SourceClass):
                for f in self.fields(base):
                    out[f.name] = f
        if not any(self._is_dataclass_decorator(cls.module, d) for d in cls.node.decorator_list):
            return list(out.values())
        body = cls.node.body
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name = stmt.target.id
            if name.startswith("_") or self._is_class_var(cls.module, stmt.annotation):
                continue
            if _field_kwarg(stmt.value, "init") is not None and not self.value(
                    cls.module, _field_kwarg(stmt.value, "init")):
                continue
            doc = ""
            if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and isinstance(
                    body[i + 1].value, ast.Constant) and isinstance(body[i + 1].value.value, str):
                doc = inspect.cleandoc(body[i + 1].value.value)
            out[name] = SourceField(name=name, annotation=stmt.annotation, value=stmt.value,
                                    module=cls.module, doc=doc)
        return list(out.values())

    def _is_class_var(self, module: SourceModule, annotation: ast.expr) -> bool:
        node = annotation.value if isinstance(annotation, ast.Subscript) else annotation
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith("ClassVar")
        return self._names(module, node, "typing.ClassVar")

    def enum_values(self, cls: SourceClass) -> list[Any] | None:
        """An Enum class's member values in order, or None when ``cls`` is not an Enum."""
        if not any(isinstance(b, External) and b.path.startswith("enum.")
                   for b in self.bases(cls)):
            return None
        values = []
        for stmt in cls.node.body:
            target, value = _assigned(stmt)
            if target and not target.startswith("_") and value is not None:
                values.append(self.value(cls.module, value))
        return values

    def value(self, module: SourceModule, node: ast.expr) -> Any:
        """A default written as a literal, arithmetic, a constant, an enum member or a list (of
        those, or of config classes called with keywords)."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = [self._built(module, e) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {self.value(module, k): self.value(module, v)
                    for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.value(module, node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](self.value(module, node.left),
                                          self.value(module, node.right))
        if isinstance(node, (ast.Name, ast.Attribute)):
            resolved = self.resolve(module, node)
            if isinstance(resolved, tuple) and isinstance(resolved[-1], ast.expr):
                return self.value(*resolved)
            if isinstance(resolved, tuple) and resolved[0] == "member":
                _, enum_cls, attr = resolved
                for stmt in enum_cls.node.body:
                    target, value = _assigned(stmt)
                    if target == attr and value is not None:
                        return self.value(enum_cls.module, value)
            if resolved == "None":
                return None
        raise SourceSchemaError(f"{module.name}: cannot evaluate {ast.unparse(node)}")

    def instance(self, cls: SourceClass,
                 overrides: dict[str, tuple[SourceModule, ast.expr]] | None = None) -> Instance:
        """``cls()``'s values (``cls(**overrides)`` with overrides written in source)."""
        overrides = overrides or {}
        values: dict[str, Any] = {}
        for f in self.fields(cls):
            if f.name in overrides:
                values[f.name] = self._built(*overrides[f.name])
            elif f.value is None:
                values[f.name] = MISSING
            elif _is_field_call(self, f.module, f.value):
                default = _field_kwarg(f.value, "default")
                factory = _field_kwarg(f.value, "default_factory")
                if default is not None:
                    values[f.name] = self.value(f.module, default)
                elif factory is not None:
                    values[f.name] = self._factory(f.module, factory)
                else:
                    values[f.name] = MISSING
            else:
                values[f.name] = self.value(f.module, f.value)
        return Instance(cls=cls, values=values)

    def _built(self, module: SourceModule, node: ast.expr) -> Any:
        """An override value: a config class called with keywords, or a plain value."""
        if isinstance(node, ast.Call) and not node.args:
            target = self.resolve(module, node.func)
            if isinstance(target, SourceClass) and self.is_dataclass(target):
                return self.instance(target, {kw.arg: (module, kw.value) for kw in node.keywords
                                              if kw.arg is not None})
        return self.value(module, node)

    def _factory(self, module: SourceModule, node: ast.expr) -> Any:
        if isinstance(node, ast.Lambda):
            return self._built(module, node.body)
        target = self.resolve(module, node)
        if target in ("list", "dict", "tuple", "set"):
            return {"list": [], "dict": {}, "tuple": (), "set": set()}[target]
        if isinstance(target, SourceClass) and self.is_dataclass(target):
            return self.instance(target)
        if isinstance(target, tuple) and isinstance(target[1], ast.FunctionDef):
            fn_module, fn = target
            returns = [s for s in fn.body if isinstance(s, ast.Return) and s.value is not None]
            if len(returns) == 1 and not fn.args.args:
                return self._built(fn_module, returns[0].value)
        raise SourceSchemaError(f"{module.name}: cannot evaluate factory {ast.unparse(node)}")


def _namespace(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Top-level bindings (including those under ``if``/``try``; later ones win)."""
    out: dict[str, ast.AST] = {}
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out[stmt.name] = stmt
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                out[alias.asname or alias.name.split(".")[0]] = stmt
        elif isinstance(stmt, (ast.If, ast.Try)):
            nested = stmt.body + stmt.orelse + [s for h in getattr(stmt, "handlers", [])
                                                for s in h.body]
            out.update(_namespace(nested))
        else:
            target, value = _assigned(stmt)
            if target is not None and value is not None:
                out[target] = value
    return out


def _assigned(stmt: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(
            stmt.targets[0], ast.Name):
        return stmt.targets[0].id, stmt.value
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return stmt.target.id, stmt.value
    return None, None


def _absolute(module: SourceModule, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _is_field_call(index: SourceIndex, module: SourceModule, node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and index._names(module, node.func, "dataclasses.field")


def _field_kwarg(node: ast.expr | None, name: str) -> ast.expr | None:
    if isinstance(node, ast.Call):
        for kw in node.keywords:
            if kw.arg == name:
                return kw.value
    return None


def _is_stdlib(origin: str) -> bool:
    stdlib = pathlib.Path(inspect.getfile(inspect)).parent
    path = pathlib.Path(origin)
    return stdlib in path.parents and "site-packages" not in path.parts
