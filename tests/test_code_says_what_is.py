"""Code says what is: no comment in cli/, engine/, ops/ or profiles/ says when or in which run something was measured,
and none points to a file outside the repository (.diag/, shared/, /work/: a clone has none of them).

A tuned constant's comment says what was measured and where the result is (docs/PERF.md); the history of the runs
goes to commit messages or docs/perf-history.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("cli", "engine", "ops", "profiles")
SCANNED_SUFFIXES = (".py", ".yaml", ".yml", ".md")
_ORDINAL = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|twentieth"
    r"|twenty[- ][a-z]+|thirtieth|\d+(?:st|nd|rd|th)|earlier|previous|last|this|next|same|an|one|a"
)
# (rule, pattern): what a line must not hold.
RULES = (
    ("a session named in words (which run measured it)", re.compile(rf"\b(?:{_ORDINAL})[- ]session\b", re.I)),
    ("a date", re.compile(r"\b20\d\d-\d\d-\d\d\b")),
    ("a device call of a run", re.compile(r"\b(?:device )?call \d+\b", re.I)),
    ("a path to .diag/, which a clone lacks", re.compile(r"\.diag/")),
    ("a path to shared/, which a clone lacks", re.compile(r"(?:^|[^\w./-])shared/")),
    ("a path under /work/, outside the repository", re.compile(r"/work/")),
)


def problems_in(text: str, name: str) -> list[str]:
    """One "name:line: rule: the line" string per rule a line breaks."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for rule, pattern in RULES:
            if pattern.search(line):
                found.append(f"{name}:{number}: {rule}: {line.strip()}")
    return found


def scanned_files() -> list[Path]:
    files = []
    for folder in SCANNED_DIRS:
        files += [
            p for p in sorted((ROOT / folder).rglob("*"))
            if p.suffix in SCANNED_SUFFIXES and p.is_file() and "__pycache__" not in p.parts
        ]  # fmt: skip
    return files


def test_scanned_tree_is_not_empty():
    names = {p.relative_to(ROOT).parts[0] for p in scanned_files()}
    assert names == set(SCANNED_DIRS)


def test_code_says_what_is():
    found = []
    for path in scanned_files():
        found += problems_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, (
        "comments must say what is, not when or in which run it was measured, and name no file outside the "
        "repository; say what was measured and where the result is (docs/PERF.md), history goes to commit messages "
        "or docs/perf-history.md:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "line",
    [
        "# 0.349 ms (docs/PERF.md, nineteenth session)",
        "# measured in the Eighteenth session",
        "# the 3rd session's figure",
        "# 391 ms at stage 3 in an earlier session",
        "# until the twenty-first session",
        "# H200 (2026-11-30, the kernel alone)",
        "# nineteenth session, call 2",
        "# device call 12 of the sweep",
        "# the script is .diag/s12/wy_time.py",
        "# the models of shared/ANCHORS.md",
        '"""Numbers of shared/DESIGN.md."""',
        "# see /work/notes/issue5.md",
    ],
    ids=[
        "ordinal", "capitalised", "numeral", "earlier", "twenty-first", "iso-date", "call", "device-call", "diag",
        "shared", "shared-docstring", "work",
    ],
)
def test_each_rule_catches_its_narration(line):
    problems = problems_in(f"x = 1\n{line}\n", "ops/x.py")
    assert problems and all(p.startswith("ops/x.py:2: ") for p in problems)


@pytest.mark.parametrize(
    "line",
    [
        "    from moe_tune.engine.generate.session import load_session",
        "        session = load_session(target)",
        "# lr at step 2026 of the run",
        "# the shared expert's gate (shared_expert_gate)",
        "# ops/common/shared_memory.py holds it",
        "# one call per step",
    ],
    ids=["module", "variable", "number", "shared-expert", "shared-in-path", "call-word"],
)
def test_plain_code_passes(line):
    assert problems_in(line, "engine/x.py") == []
