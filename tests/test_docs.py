"""Every ```python block of the docs runs, page by page, in order, against the real
code (blocks fenced as ```py are shown but not run). Keeps the docs honest."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())
BLOCK = re.compile(r"^( *)```python[^\n]*\n(.*?)^\1```", flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_doc_snippets_run(page: Path) -> None:
    blocks = BLOCK.findall(page.read_text())
    assert blocks, f"{page} has no python blocks"
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, (indent, code) in enumerate(blocks):
        code = "\n".join(line[len(indent) :] for line in code.splitlines())
        exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
