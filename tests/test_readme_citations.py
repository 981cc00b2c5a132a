"""The README's citations of docs pages: every page cited in a parenthesis exists, and every decimal figure quoted in
that parenthesis (`(bench-qwen3-moe: 117.1 ms against 103.6 ms without it; docs/perf-history.md)`) is in the page, so
a figure cannot point to a page that does not hold it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A parenthesis without nested ones that names a docs page, and the decimal figures in it.
CITATION = re.compile(r"\(([^()]*?)\bdocs/([\w-]+\.md)\b[^()]*\)")
DECIMAL = re.compile(r"(?<![\d.])\d+\.\d+(?![\d.])")


def missing_figures(text: str, pages: dict[str, str]) -> list[str]:
    """`page: figure` for each figure cited to a page that does not hold it, `page: no such page` for a missing page."""
    missing = []
    for citation in CITATION.finditer(text):
        name = citation.group(2)
        if name not in pages:
            missing.append(f"{name}: no such page")
            continue
        page = pages[name]
        missing += [f"{name}: {figure}" for figure in DECIMAL.findall(citation.group(0))
                    if not re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d.])", page)]
    return missing


def test_readme_figures_are_in_the_pages_they_cite():
    pages = {path.name: path.read_text() for path in (ROOT / "docs").glob("*.md")}
    readme = (ROOT / "README.md").read_text()
    assert len(CITATION.findall(readme)) >= 10
    assert missing_figures(readme, pages) == []


def test_a_figure_cited_to_the_wrong_page_is_found():
    pages = {"PERF.md": "step 117.1 -> 103.6 ms", "perf-history.md": "117.1 and 103.6"}
    assert missing_figures("cost 11% (bench: 117.1 ms against 103.6 ms; docs/perf-history.md).", pages) == []
    assert missing_figures("cost 11% (117.1 against 103.5 ms, docs/PERF.md)", pages) == ["PERF.md: 103.5"]
    assert missing_figures("see (docs/gone.md) and (117.1; docs/PERF.md)", pages) == ["gone.md: no such page"]
