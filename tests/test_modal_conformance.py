"""What the control plane does not exercise, checked against modal's real classes: every attribute and
method the product uses on a modal object exists on the installed `modal`'s class, and every call's
arguments bind to its real signature (issue 41). Nothing is listed by hand: the product's files that
import modal are read (ast), and the modal objects in them are followed from where they are made
(`modal.Queue.from_name(...)`, `@app.function`, `fn.spawn(...)`, ...) through assignments,
attributes, properties, return annotations and the product's own helpers' parameters."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import modal
import modal.experimental

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("app", "coordination", "trainer", "producers", "deploy")


def product_files() -> list[Path]:
    """The product's modules that import modal."""
    out = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "modal" or n.startswith("modal.") for n in names):
                    out.append(path)
                    break
    return out


def modal_type(annotation) -> type | None:
    """The modal class a return annotation names ('_Queue', 'modal.functions.FunctionCall[Any]', a class)."""
    if isinstance(annotation, type):
        text = f"{annotation.__module__}.{annotation.__qualname__}"
    elif isinstance(annotation, str):
        text = annotation
    else:
        text = str(annotation)
    m = re.match(r"\s*([\w.]+)", text)
    if not m:
        return None
    dotted = m.group(1)
    name = dotted.split(".")[-1].lstrip("_")
    for space in (modal, modal.experimental):
        found = getattr(space, name, None)
        if isinstance(found, type):
            return found
    module, _, attr = dotted.rpartition(".")
    if module.startswith("modal"):
        try:
            found = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            found = None
        if isinstance(found, type):
            return found
    return None


@dataclass(frozen=True)
class MappingOf:
    """A dict literal whose values are all the same modal object (`{1: train, 2: train_2_nodes}`)."""

    of: tuple


@dataclass
class Use:
    where: str
    owner: object  # the modal class, module or object the name is looked up on
    name: str
    call: ast.Call | None = None


@dataclass
class Scan:
    """Types of names (per function scope), of `self.x` (per class) and of functions' parameters."""

    names: dict = field(default_factory=dict)  # (scope, name) -> modal class or object
    attrs: dict = field(default_factory=dict)  # (class, attr) -> modal class
    params: dict = field(default_factory=dict)  # (function name, parameter) -> modal class
    returns: dict = field(default_factory=dict)  # function or property name -> modal class
    uses: list = field(default_factory=list)


class Reader(ast.NodeVisitor):
    """One pass over a module: types what it can, records each use of a modal object's member."""

    def __init__(self, path: Path, scan: Scan, functions: dict[str, ast.FunctionDef]) -> None:
        self.path, self.scan, self.functions = path, scan, functions
        self.scope: list[str] = []
        self.klass: str | None = None
        self.aliases: dict[str, object] = {}  # `import modal.exception` / `from modal.x import Y` names

    # ---- what an expression is

    def value(self, node) -> object | None:
        """A modal module, class, function or instance (as its class wrapped in a tuple)."""
        if isinstance(node, ast.Name):
            if node.id == "modal":
                return modal
            if node.id in self.aliases:
                return self.aliases[node.id]
            for depth in range(len(self.scope), -1, -1):
                key = (tuple(self.scope[:depth]), node.id)
                if key in self.scan.names:
                    return self.scan.names[key]
            fn = self.scope[-1] if self.scope else None
            if self.klass and f"{self.klass}.{fn}" in self.functions:
                fn = f"{self.klass}.{fn}"
            if (fn, node.id) in self.scan.params:
                return self.scan.params[fn, node.id]
            return None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and self.klass:
                t = self.scan.attrs.get((self.klass, node.attr)) or self.scan.returns.get(f"{self.klass}.{node.attr}")
                return t
            owner = self.value(node.value)
            if owner is None:
                return None
            target = owner[0] if isinstance(owner, tuple) else owner
            self.scan.uses.append(Use(self.where(node), target, node.attr))
            member = getattr(target, node.attr, None)
            if member is None:
                return None
            if isinstance(owner, tuple) and not callable(member):
                return None
            return member
        if isinstance(node, ast.Call):
            return self.called(node)
        if isinstance(node, ast.Dict) and node.values:
            found = {self.value(v) for v in node.values}
            one = found.pop() if len(found) == 1 else None
            return MappingOf(one) if isinstance(one, tuple) else None
        if isinstance(node, ast.IfExp):  # `modal.FunctionCall.from_id(i) if i else None`
            return self.value(node.body) or self.value(node.orelse)
        if isinstance(node, ast.Subscript):
            container = self.value(node.value)
            return container.of if isinstance(container, MappingOf) else None
        return None

    def called(self, node: ast.Call) -> object | None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in self.functions:
            self.bind_params(func.id, node)
            return self.scan.returns.get(func.id)
        if isinstance(func, ast.Name) and f"{func.id}.__init__" in self.functions:  # a product class
            self.bind_params(f"{func.id}.__init__", node, skip_self=True)
            return None
        if isinstance(func, ast.Attribute):
            owner = self.value(func.value)
            if owner is not None:
                target = owner[0] if isinstance(owner, tuple) else owner
                member = getattr(target, func.attr, None)
                if isinstance(member, type) and member.__module__.startswith("modal"):  # `modal.App(...)`
                    self.scan.uses.append(Use(self.where(node), target, func.attr))
                    self.scan.uses.append(Use(self.where(node), member, "__init__", node))
                    return (member,)
                self.scan.uses.append(Use(self.where(node), target, func.attr, node))
                return self.result_of(member)
            method = f"{self.klass}.{func.attr}"
            if isinstance(func.value, ast.Name) and func.value.id == "self" and method in self.functions:
                self.bind_params(method, node, skip_self=True)
                return self.scan.returns.get(method)
            return None
        callee = self.value(func)
        if callee is None:
            return None
        if isinstance(callee, type) and callee.__module__.startswith("modal"):
            self.scan.uses.append(Use(self.where(node), callee, "__init__", node))
            return (callee,)
        if callable(callee) and getattr(callee, "__module__", "").startswith("modal"):
            self.scan.uses.append(Use(self.where(node), callee, "__call__", node))
            return self.result_of(callee)
        return None

    def result_of(self, member) -> object | None:
        if member is None or not callable(member):
            return None
        try:
            t = modal_type(inspect.signature(member).return_annotation)
        except (TypeError, ValueError):
            return None
        return (t,) if t is not None else None

    def bind_params(self, name: str, call: ast.Call, skip_self: bool = False) -> None:
        fn = self.functions[name]
        params = [a.arg for a in fn.args.args][1 if skip_self else 0 :]
        for param, arg in zip(params, call.args):
            t = self.value(arg)
            if isinstance(t, tuple):
                self.scan.params[name, param] = t
        kw = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        for k in call.keywords:
            if k.arg in kw:
                t = self.value(k.value)
                if isinstance(t, tuple):
                    self.scan.params[name, k.arg] = t

    def where(self, node) -> str:
        return f"{self.path.relative_to(ROOT)}:{node.lineno}"

    # ---- statements

    def visit_Import(self, node):
        for a in node.names:
            if a.name.startswith("modal.") and a.asname:
                self.aliases[a.asname] = importlib.import_module(a.name)

    def visit_ImportFrom(self, node):
        if node.module and (node.module == "modal" or node.module.startswith("modal.")):
            module = importlib.import_module(node.module)
            for a in node.names:
                found = getattr(module, a.name, None)
                if found is None:
                    self.scan.uses.append(Use(self.where(node), module, a.name))
                else:
                    self.aliases[a.asname or a.name] = found

    def visit_ClassDef(self, node):
        saved, self.klass = self.klass, node.name
        self.generic_visit(node)
        self.klass = saved

    def visit_FunctionDef(self, node):
        decorated = None
        for d in node.decorator_list:
            t = self.value(d.func if isinstance(d, ast.Call) else d)
            if isinstance(d, ast.Call):
                self.value(d)
            if t is modal.App.function:  # `@app.function(...)`
                decorated = (modal.Function,)
        if decorated:
            self.scan.names[tuple(self.scope), node.name] = decorated
        if node.returns is not None:
            t = self.value(node.returns) if not isinstance(node.returns, ast.Constant) else None
            if isinstance(t, type):
                self.scan.returns[node.name] = (t,)
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        t = self.value(node.value)
        for target in node.targets:
            if t is None:
                continue
            if isinstance(target, ast.Name):
                self.scan.names[tuple(self.scope), target.id] = t
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and self.klass:
                if target.value.id == "self" and isinstance(t, tuple):
                    self.scan.attrs[self.klass, target.attr] = t
        self.generic_visit(node)

    def visit_Return(self, node):
        if node.value is not None and self.scope:
            t = self.value(node.value)
            if isinstance(t, tuple):
                key = f"{self.klass}.{self.scope[-1]}" if self.klass else self.scope[-1]
                self.scan.returns[key] = t
        self.generic_visit(node)

    def visit_Call(self, node):
        self.value(node)
        self.generic_visit(node)


def scan_product() -> Scan:
    scan = Scan()
    files = product_files()
    trees = {p: ast.parse(p.read_text()) for p in files}
    # the product's functions by name (module level), and methods as Class.name (a class's constructor
    # is how its name is called): their parameters are typed where they are called
    functions = {}
    for t in trees.values():
        for n in t.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[n.name] = n
            elif isinstance(n, ast.ClassDef):
                for m in n.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        functions[f"{n.name}.{m.name}"] = m
    for _ in range(4):  # parameters and returns typed in one pass reach their uses in the next
        scan.uses = []
        for path, tree in trees.items():
            Reader(path, scan, functions).visit(tree)
    return scan


def has_member(owner, name: str) -> bool:
    """`owner.name` exists: an attribute, or a field a dataclass or a class declares (set per instance)."""
    if hasattr(owner, name):
        return True
    return isinstance(owner, type) and any(name in getattr(k, "__annotations__", {}) for k in owner.__mro__)


def check_call(use: Use) -> str | None:
    member = getattr(use.owner, use.name, None) if use.name not in ("__init__", "__call__") else use.owner
    if use.call is None or member is None or not callable(member):
        return None
    if any(isinstance(a, ast.Starred) for a in use.call.args) or any(k.arg is None for k in use.call.keywords):
        return None  # *args / **kwargs: the shape is not known here
    try:
        sig = inspect.signature(member)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and not (use.name == "__init__"):
        sig = sig.replace(parameters=params[1:])
    try:
        sig.bind(*range(len(use.call.args)), **{k.arg: None for k in use.call.keywords})
    except TypeError as exc:
        return f"{use.where}: {getattr(use.owner, '__name__', use.owner)}.{use.name}{sig}: {exc}"
    return None


def test_every_member_the_product_uses_on_a_modal_object_exists_with_a_compatible_signature():
    scan = scan_product()
    uses = scan.uses
    owners = {getattr(u.owner, "__name__", str(u.owner)) for u in uses}
    # the scan found the objects a campaign uses (so an empty scan cannot pass)
    assert {"Queue", "Dict", "Volume", "Function", "FunctionCall", "Secret", "Image", "App"} <= owners, owners
    missing = [
        f"{u.where}: {getattr(u.owner, '__name__', u.owner)} has no {u.name!r}"
        for u in uses
        if u.name not in ("__init__", "__call__") and not has_member(u.owner, u.name)
    ]
    wrong = [w for u in uses if (w := check_call(u))]
    assert not missing and not wrong, "\n".join(missing + wrong)
    names = {(getattr(u.owner, "__name__", ""), u.name) for u in uses}
    # what a campaign cannot run without, each found by the scan
    for expected in [
        ("Queue", "from_name"),
        ("Queue", "put_many"),
        ("Dict", "put"),
        ("Function", "spawn"),
        ("Function", "with_options"),
        ("FunctionCall", "get"),
        ("FunctionCall", "from_id"),
        ("FunctionCall", "cancel"),
        ("Volume", "commit"),
    ]:
        assert expected in names, f"the scan did not find {expected}: {sorted(names)}"


def test_the_check_fails_on_a_member_modal_lacks_or_a_call_that_does_not_bind(tmp_path):
    """The checker itself: a made-up method and a wrong keyword are found."""
    src = tmp_path / "bad.py"
    src.write_text(
        "import modal\n"
        "q = modal.Queue.from_name('x', create_if_missing=True)\n"
        "q.put_many([1], partition_key='p')\n"
        "q.no_such_method()\n"
        "f = modal.FunctionCall.from_id('fc-1')\n"
        "f.get(1, 2, 3)\n"
    )

    class Outside(Reader):  # (a file outside the repository)
        def where(self, node) -> str:
            return f"bad.py:{node.lineno}"

    scan = Scan()
    Outside(src, scan, {}).visit(ast.parse(src.read_text()))
    missing = [u for u in scan.uses if not has_member(u.owner, u.name) and u.name not in ("__init__", "__call__")]
    wrong = [w for u in scan.uses if (w := check_call(u))]
    assert [u.name for u in missing] == ["no_such_method"]
    assert len(wrong) == 2 and "partition_key" in wrong[0] and "get" in wrong[1], wrong
