"""Reading what a Markdown page states its ```python blocks print, and comparing it
with what they print (for `test_docs.py` and `test_readme.py`).

How a page states what a block prints (the stated output), one of:

- a ```text block right after the python block (blank lines between are fine): the
  block's whole output;
- a comment at the end of a `print(...)` statement: the one line it prints,
  `print(x.shape)  # (64, 16)`;
- comment lines right below a `print(...)` statement: the lines it prints, for
  output too long for one line or printed by a loop.

A comment on a `print` is its output and nothing else: a remark goes in the prose
or on a line of its own above. In a stated line `...` stands for any text (times,
addresses), and a line that is only `...` for any number of lines; a number written
with a decimal point or an exponent stands for any number within one unit of its
last digit (`0.31` for `0.3125`, `1.2947` for `1.294672`); other text and whole
numbers must be printed exactly. A block that prints must state all of it, once.
"""

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

from compile_speed import script_flags

ROOT = Path(__file__).resolve().parent.parent

# A python block, and the ```text block that may follow it at the same indentation.
BLOCK = re.compile(
    r"^(?P<indent> *)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*\n"
    r"(?:\s*\n)*(?:(?P=indent)```text[^\n]*\n(?P<text>.*?)^(?P=indent)```)?",
    flags=re.S | re.M,
)
NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
STATED_PIECE = re.compile(rf"(\.\.\.)|(?<![\w.])({NUMBER})(?![\d.])")


class Block(NamedTuple):
    code: str
    first_line: int  # in the page, of the code's first line
    text: str | None  # the ```text block after it, if any


def _dedent(text: str, indent: int) -> str:
    return "\n".join(line[indent:] for line in text.splitlines())


def blocks_of(page: Path) -> list[Block]:
    source = page.read_text()
    blocks = []
    for match in BLOCK.finditer(source):
        indent = len(match["indent"])
        first_line = source.count("\n", 0, match.start("code")) + 1
        text = None if match["text"] is None else _dedent(match["text"], indent)
        blocks.append(Block(_dedent(match["code"], indent), first_line, text))
    return blocks


class Stated(NamedTuple):
    lines: list[str] | None  # what the block states it prints; None: nothing
    unstated: list[int]  # page lines of prints that state nothing
    twice: list[int]  # page lines of prints that state something beside a ```text


def stated_output(block: Block) -> Stated:
    """What `block` states it prints (see the module's docstring)."""
    lines = block.code.splitlines()
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, alone on its line)
    tokens = tokenize.generate_tokens(io.StringIO(block.code).readline)
    for token in tokens:
        if token.type == tokenize.COMMENT:
            row, col = token.start
            alone = not lines[row - 1][:col].strip()
            comments[row] = (token.string[1:].removeprefix(" "), alone)
    prints = sorted(
        node.end_lineno
        for node in ast.walk(ast.parse(block.code))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "print"
        and node.end_lineno is not None
    )
    stated: list[str] = []
    unstated, with_comments = [], []
    for end in prints:
        mine = []
        if end in comments and not comments[end][1]:
            mine.append(comments[end][0])
        row = end + 1
        while row in comments and comments[row][1]:
            mine.append(comments[row][0])
            row += 1
        (with_comments if mine else unstated).append(block.first_line + end - 1)
        stated += mine
    if block.text is not None:
        return Stated(block.text.splitlines(), [], with_comments)
    return Stated(stated if prints else None, unstated, [])


def line_matches(stated: str, printed: str) -> bool:
    """`printed` is what the stated line says, `...` and numbers as stated."""
    pattern, numbers = "", []
    position = 0
    for piece in STATED_PIECE.finditer(stated):
        pattern += re.escape(stated[position : piece.start()])
        if piece[1]:
            pattern += ".*"
        else:
            pattern += rf"(?<![\w.])({NUMBER})(?![\d.])"
            numbers.append(piece[2])
        position = piece.end()
    pattern += re.escape(stated[position:])
    match = re.fullmatch(pattern, printed)
    if match is None:
        return False
    for want, got in zip(numbers, match.groups(), strict=True):
        if not any(c in want for c in ".eE"):
            if want != got:
                return False
        elif (
            abs(Decimal(got) - Decimal(want))
            > Decimal(10) ** Decimal(want).as_tuple().exponent
        ):
            return False
    return True


def lines_match(stated: list[str], printed: list[str]) -> bool:
    if not stated:
        return not printed
    if stated[0] == "...":
        rest = stated[1:]
        return any(lines_match(rest, printed[i:]) for i in range(len(printed) + 1))
    return (
        bool(printed)
        and line_matches(stated[0], printed[0])
        and lines_match(stated[1:], printed[1:])
    )


def mismatch(stated: list[str], printed: list[str]) -> str | None:
    """`None` if the lines `printed` are those `stated` (trailing blanks aside),
    else both, for a failure message."""
    stated = [line.rstrip() for line in stated]
    printed = [line.rstrip() for line in printed]
    while stated and not stated[-1]:
        stated.pop()
    while printed and not printed[-1]:
        printed.pop()
    if lines_match(stated, printed):
        return None
    return "states:\n  " + "\n  ".join(stated) + "\nprints:\n  " + "\n  ".join(printed)


def readers_env() -> dict[str, str]:
    """The environment a reader's fresh Python has: this process's without the
    8 devices of conftest in `XLA_FLAGS` (the tests' compile flags stay:
    `compile_speed.py`), importing the checkout's eqxdist (as the tests do)."""
    env = {**os.environ, "XLA_FLAGS": script_flags()}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


def run_as_pasted(script: Path) -> subprocess.CompletedProcess:
    """`script` run as a reader runs what they pasted: a fresh Python in the
    script's folder (`readers_env`); its output captured."""
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=script.parent,
        env=readers_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
