"""The shape of the package, checked: the layout never imports the step, no module
imports itself through others, no flat module imports a folder, no private name
is reached across folders, and no module, class or function outgrows what a
reader takes in at once (nor comes within 5% of it, so that the next option does
not split a unit by line count)."""

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "eqxdist"
MODULES = sorted(PACKAGE.rglob("*.py"))

MAX_MODULE_LINES = 600
MAX_CLASS_CODE_LINES = 200
MAX_FUNCTION_CODE_LINES = 80

# 5% under the ceilings: a unit this close is split by meaning now, not by line
# count when the next option pushes it over.
NEAR_MODULE_LINES = 570
NEAR_CLASS_CODE_LINES = 190
NEAR_FUNCTION_CODE_LINES = 76


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def _code_lines(source: str, node: ast.AST) -> int:
    """The lines of `node` that hold code: not blank, not only a comment, not a
    docstring."""
    lines = set(range(node.lineno, node.end_lineno + 1))  # type: ignore[attr-defined]
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    text = source.splitlines()
    comments = {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
        and not text[token.start[0] - 1].split("#")[0].strip()
    }
    return sum(1 for i in lines - comments if text[i - 1].strip())


def _imports(path: Path) -> set[str]:
    """The `eqxdist` modules `path` imports, as dotted names under the package
    (anywhere in it: a function's late import is an arrow too)."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = [*package[: len(package) - node.level + 1]]
            if node.module:
                found.add(".".join([*base, *node.module.split(".")]))
            else:  # `from . import x`: `x` may be a module
                found.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "eqxdist"
        ):
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("eqxdist"))
    return found


def test_the_layout_never_imports_the_step():
    """The layout (where arrays live) is below the step (what it computes): the
    step reads its layout, never the other way round."""
    for path in sorted((PACKAGE / "_layout").rglob("*.py")):
        wrong = sorted(m for m in _imports(path) if m.startswith("eqxdist._step"))
        assert not wrong, f"{_name(path)} imports {wrong}"


def test_the_step_asks_the_layout_not_its_parts():
    """The step asks its `Layout` what it needs (`context_axis`,
    `loss_per_microbatch`, `fsdp_options`, `check_training`, `loss_view`); it
    never looks a parallelism's part up by its type."""
    for path in sorted((PACKAGE / "_step").rglob("*.py")):
        wrong = sorted(
            m for m in _imports(path) if m.startswith("eqxdist._layout.parts")
        )
        assert not wrong, f"{_name(path)} imports {wrong}"


# Parallelisms whose mechanism is one folder of the layout behind its
# `__init__`: code outside imports its names from there, never a module inside.
FOLDERS = ("pipeline", "experts")


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_parallelism_is_one_folder_behind_its_interface(folder):
    """The pipeline's mechanism (schedules, engine, slots, passes, the loss
    cut) is `_layout/pipeline/`, expert parallelism's (the wrapper the loss
    sees, the dispatches) `_layout/experts/`; every module outside a folder
    imports its names from the folder's `__init__`, never a module inside, so
    the folder can change behind that interface."""
    inside = PACKAGE / "_layout" / folder
    for path in MODULES:
        if inside in path.parents:
            continue
        wrong = sorted(
            m for m in _imports(path) if m.startswith(f"eqxdist._layout.{folder}.")
        )
        assert not wrong, (
            f"{_name(path)} imports {wrong}; import the name from "
            f"eqxdist._layout.{folder} (add it to its __all__)"
        )


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folder_interface_names_no_module(folder):
    """Every name a folder exports is the function or class, not a module of
    the folder that shadows it (`from .x import y` binds the module `x` on the
    package, over a name `x` imported before)."""
    import importlib
    import types

    package = importlib.import_module(f"eqxdist._layout.{folder}")
    for name in package.__all__:
        value = getattr(package, name)
        assert not isinstance(value, types.ModuleType), (name, value)


def test_the_moe_layer_knows_no_mesh():
    """The `MoE` layer routes and computes its experts; expert parallelism is
    the layout's (`_layout/experts`): nothing in `_experts/` imports the
    layout, the step or the views of a mesh axis, and the layer has no field
    naming an axis (torchtitan's MoE module, ignorant of expert parallelism)."""
    import dataclasses

    import eqxdist as ed

    for path in sorted((PACKAGE / "_experts").rglob("*.py")):
        wrong = sorted(
            m
            for m in _imports(path)
            if m.startswith(("eqxdist._layout", "eqxdist._step", "eqxdist._long"))
        )
        assert not wrong, f"{_name(path)} imports {wrong}"
    fields = {f.name for f in dataclasses.fields(ed.MoE)}
    assert not fields & {"expert_axis", "tokens_split", "whole_loss"}, fields


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_cycles() -> list[list[str]]:
    """The circles among the package's modules (their strongly connected
    components of more than one module, Tarjan's algorithm), every import
    counted: a function's late import or a `TYPE_CHECKING` one is an arrow too."""
    names = {_module_name(p): p for p in MODULES}
    graph = {
        name: sorted(m for m in _imports(path) if m in names and m != name)
        for name, path in names.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def test_no_module_imports_itself_through_others():
    """No circle of imports: each module sits above the ones it imports, so
    every one can be read (and imported) after those, never halfway through."""
    assert not _import_cycles(), _import_cycles()


def test_each_parallelism_is_one_part_in_one_module():
    """`_layout/parts/`: one module per parallelism, each defining one
    `Part` (the protocol of `parts/base.py`), and a `Layout` is its parts."""
    import importlib

    from eqxdist._layout.parts.base import Part

    names = sorted(
        p.stem
        for p in (PACKAGE / "_layout" / "parts").glob("*.py")
        if p.stem not in ("__init__", "base")
    )
    assert names == [
        "context", "data", "experts", "fsdp", "pipeline", "tensor", "zero1"
    ]  # fmt: skip
    for name in names:
        module = importlib.import_module(f"eqxdist._layout.parts.{name}")
        parts = [
            v
            for v in vars(module).values()
            if isinstance(v, type)
            and issubclass(v, Part)
            and v is not Part
            and v.__module__ == module.__name__
        ]
        assert len(parts) == 1, (name, parts)


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_modules_classes_and_functions_stay_small(path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, _name(path)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = _code_lines(source, node)
            assert lines <= MAX_CLASS_CODE_LINES, (
                f"{_name(path)}: class {node.name} has {lines} lines of code"
            )
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = _code_lines(source, node)
            assert lines <= MAX_FUNCTION_CODE_LINES, (
                f"{_name(path)}: function {node.name} has {lines} lines of code"
            )


def _near_ceilings(path: Path) -> list[str]:
    source = path.read_text()
    near = []
    if len(source.splitlines()) > NEAR_MODULE_LINES:
        near.append(f"{len(source.splitlines())} lines (<= {NEAR_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", NEAR_CLASS_CODE_LINES
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind, limit = "function", NEAR_FUNCTION_CODE_LINES
        else:
            continue
        lines = _code_lines(source, node)
        if lines > limit:
            near.append(f"{kind} {node.name}: {lines} lines of code (<= {limit})")
    return near


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_unit_within_five_percent_of_its_ceiling(path):
    near = _near_ceilings(path)
    assert not near, f"{_name(path)}: {near}; split it by what its parts do"


SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
# The flat helpers: private modules at the top of the package. (The public
# namespaces `__init__`, `compat`, `metrics` and `launch` gather the folders.)
FLAT_MODULES = sorted(PACKAGE.glob("_*.py"))


def _top_folder(module: str) -> str:
    """`eqxdist._layout.rules` -> `_layout`; `eqxdist` -> ``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_folders_are_all_found():
    assert {"_layout", "_step", "_data", "_loop", "_metrics"} <= set(SUBPACKAGES)
    assert {"_utils", "_mesh", "_data_parallel"} <= {p.stem for p in FLAT_MODULES}


@pytest.mark.parametrize(
    "path", [p for p in FLAT_MODULES if p.name != "__init__.py"], ids=_name
)
def test_flat_modules_never_import_a_folder(path):
    """The flat helpers are below every folder: a folder (`_layout`, `_step`, ...)
    imports them, never the other way round, so no arrow runs back up."""
    wrong = sorted(m for m in _imports(path) if _top_folder(m) in SUBPACKAGES)
    assert not wrong, f"{_name(path)} imports {wrong}; move what it needs down"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _class_privates(tree: ast.AST) -> set[str]:
    """The private names the classes of `tree` define: methods and class
    attributes in their bodies, and attributes their methods set on `self`."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
            elif isinstance(item, ast.Assign):
                names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names.update(
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            )
    return {n for n in names if _private(n)}


def _own_access(value: ast.expr) -> bool:
    """`self._x`, `cls._x`, `super()._x`: a class reaching its own names."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def _private_crossings() -> list[tuple[str, int, str, set[str]]]:
    """Every `x._name` (not on `self`/`cls`/`super()`) in a module of one folder
    where `_name` is a method or attribute of classes of other folders only:
    (file, line, name, the folders defining it)."""
    trees = {path: ast.parse(path.read_text()) for path in MODULES}
    homes: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for name in _class_privates(tree):
            homes.setdefault(name, set()).add(str(path.parent.relative_to(PACKAGE)))
    found = []
    for path, tree in trees.items():
        folder = str(path.parent.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            where = homes.get(node.attr, set())
            if where and folder not in where and not _own_access(node.value):
                found.append((_name(path), node.lineno, node.attr, where))
    return found


def test_no_private_name_is_reached_across_folders():
    """A folder's classes keep their private methods and attributes to the
    folder: another folder calls what they make public (as `Gradients` does)."""
    crossings = _private_crossings()
    wrong = crossings
    assert not wrong, "\n".join(
        f"{path}:{line} reaches {name}, private to {sorted(where)}"
        for path, line, name, where in wrong
    )
