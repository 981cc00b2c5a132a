"""The README's performance paragraph quotes docs/PERF.md: every measured figure in it (grouped integers such as
tokens/s, and ratios such as 2.42x) appears in the report, so the two cannot drift apart."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Figures that are measurements: 93,094 (tokens/s, token counts) and 2.42x (ratios).
FIGURE = re.compile(r"\b\d{1,3}(?:,\d{3})+\b|\b\d+\.\d+x\b")


def performance_paragraphs(readme: str) -> str:
    """The README from its top to its first second-level heading: the paragraphs that quote measurements."""
    return readme.split("\n## ", 1)[0]


def test_every_figure_of_the_readme_is_in_the_performance_report():
    quoted = FIGURE.findall(performance_paragraphs((ROOT / "README.md").read_text()))
    report = (ROOT / "docs" / "PERF.md").read_text() + (ROOT / "docs" / "memory.md").read_text()
    assert len(quoted) >= 10, quoted
    missing = [figure for figure in quoted if not re.search(rf"(?<![\d,.]){re.escape(figure)}(?![\d,])", report)]
    assert not missing, f"README figures missing from docs/PERF.md: {missing}"


def test_figures_are_grouped_integers_and_ratios():
    text = "trains at 93,095 tokens/s (2.43x), then 1,048,576 tokens"
    assert FIGURE.findall(performance_paragraphs(text)) == ["93,095", "2.43x", "1,048,576"]
