"""No statement of ours follows a return, raise, continue or break in the same block (read with ast, nothing
imported): such code never runs, and an edit that leaves a function's old body after its new return passes every
test that calls the function."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("cli", "engine", "ops", "profiles", "tests")
ENDS_BLOCK = (ast.Return, ast.Raise, ast.Continue, ast.Break)


def unreachable(source: str) -> list[int]:
    """The lines of the statements that follow a block-ending statement in the same block."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                ends = [i for i, statement in enumerate(block) if isinstance(statement, ENDS_BLOCK)]
                if ends and ends[0] < len(block) - 1:
                    lines.append(block[ends[0] + 1].lineno)
    return lines


def test_the_check_finds_code_after_a_return():
    source = "def f(x):\n    if x:\n        return 1\n        x += 1\n    return x\n    print(x)\n"
    assert sorted(unreachable(source)) == [4, 6]
    assert unreachable("def f(x):\n    for y in x:\n        if y:\n            break\n    return x\n") == []


def test_no_code_follows_a_block_end():
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            found += [f"{path.relative_to(REPO)}:{line}" for line in unreachable(path.read_text())]
    assert not found, f"statements after a return, raise, continue or break (never run): {found}"
