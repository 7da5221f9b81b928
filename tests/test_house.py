"""The shape of the package, checked: the layout never imports the step, and no
module, class or function outgrows what a reader takes in at once."""

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
    """The `eqxdist` modules `path` imports, as dotted names under the package."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            found.add(".".join([*base, *(node.module or "").split(".")]))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "eqxdist"
        ):
            found.add(node.module or "")
    return found


def test_the_layout_never_imports_the_step():
    """The layout (where arrays live) is below the step (what it computes): the
    step reads its layout, never the other way round."""
    for path in sorted((PACKAGE / "_layout").glob("*.py")):
        wrong = sorted(m for m in _imports(path) if m.startswith("eqxdist._step"))
        assert not wrong, f"{_name(path)} imports {wrong}"


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
