"""What the terminal shows: `moe-tune --version`, and `profile --kernels` within 120 columns without columns that
are all "-" (--wide: the full table, one line a row)."""

import re
from importlib import metadata

import pytest
from rich.console import Console
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.cli.profile_kernels import KERNELS_WIDTH, kernels_table

runner = CliRunner()


def test_version_prints_the_package_and_its_libraries():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    first, second = result.stdout.splitlines()
    assert first == f"moe-tune {metadata.version('moe-tune')}"
    for name in ("torch", "triton", "deepspeed", "peft", "transformers"):
        assert re.search(rf"\b{name} {re.escape(metadata.version(name))}(,|$)", second), name


def _row(op: str, impl: str, is_cuda: bool, note: str | None = None, **values) -> dict:
    row = dict(op=op, case="a case of words", impl=impl, shape="B1 T128 HQ4 H1 K32 V32 S32", dtype="float32",
               fwd_ms=1.234, fwd_bwd_ms=None, fwd_tflops=0.5, fwd_bwd_tflops=None, fwd_peak_fraction=None,
               fwd_bwd_peak_fraction=None, peak_memory_bytes=None, note=note, device="cuda" if is_cuda else "cpu",
               machine="m", torch="2", triton="3", commit="abc", date="2026-01-01")  # fmt: skip
    row.update(values)
    return row


def _render(rows: list[dict], wide: bool) -> tuple[str, list[str]]:
    width = 1000 if wide else KERNELS_WIDTH
    console = Console(width=width, record=True, highlight=False)
    table, notes = kernels_table(rows, wide, width)
    console.print(table)
    for line in notes:
        console.print(line, markup=False)
    return console.export_text(), notes


LONG_NOTE = "fwd+bwd 1.234x frozen experts without LoRA (1.23 against 1.00 ms, medians of 5 passes) " * 2
CPU_ROWS = [
    _row("gated_delta_rule", "moe_tune chunk reference (torch small ops)", False),
    _row("cross_entropy", "full logits (F.linear + F.cross_entropy)", False, note=LONG_NOTE),
    _row("rotary", "reference (torch small ops)", False, note=LONG_NOTE, fwd_tflops=None),
]
CUDA_ROWS = [
    _row("moe", "triton (moe_tune grouped GEMM, fused gate)", True, note=LONG_NOTE, fwd_bwd_ms=12345.678,
         fwd_bwd_tflops=0.000757, fwd_peak_fraction=0.53, fwd_bwd_peak_fraction=0.4, peak_memory_bytes=12.3e9),
    _row("sparse_attention", "reference (dense masked, fp32)", True, note="short", fwd_peak_fraction=0.01,
         peak_memory_bytes=1e9),
]  # fmt: skip


@pytest.mark.parametrize("rows", [CPU_ROWS, CUDA_ROWS], ids=["cpu", "cuda"])
def test_kernels_table_fits_120_columns_and_loses_no_cell(rows):
    text, notes = _render(rows, wide=False)
    assert max(len(line) for line in text.splitlines()) <= KERNELS_WIDTH
    words = " ".join(text.split())
    for row in rows:
        # Every word of every text cell is printed whole (wrapped between words, never cut).
        for key in ("op", "case", "impl", "shape", "dtype"):
            for word in row[key].split():
                assert word in words, (key, word)
    # Each note once, as a numbered footnote after the table.
    assert [note.split("] ", 1)[1] for note in notes] == list(dict.fromkeys(r["note"] for r in rows if r["note"]))
    assert f"[{len(notes)}]" in words


def test_kernels_table_drops_columns_that_are_all_dashes():
    text, _ = _render(CPU_ROWS, wide=False)
    header = " ".join(text.split("─")[0].split())
    # On the CPU no row has a % of peak or a peak memory; every row lacks fwd+bwd here too.
    assert "peak" not in header and "fwd+bwd" not in header
    assert "fwd ms" in " ".join(text.split()) or "fwd" in header
    cuda_text, _ = _render(CUDA_ROWS, wide=False)
    assert "(% peak)" in cuda_text and "peak mem" in cuda_text and "fwd+bwd" in cuda_text


def test_wide_kernels_table_has_one_line_per_row_with_its_note():
    text, notes = _render(CPU_ROWS, wide=True)
    assert notes == []
    for row in CPU_ROWS:
        lines = [line for line in text.splitlines() if f"│ {row['op']} " in line]
        assert len(lines) == 1 and (row["note"] or "").strip() in lines[0]
    assert "peak" not in text


def test_profile_kernels_on_the_cpu_fits_120_columns():
    result = runner.invoke(app, ["profile", "--kernels", "--ops", "rms_norm"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    table = lines[1:]
    assert max(len(line) for line in table) <= KERNELS_WIDTH
    assert not any(re.search(r"(^|\s)-(\s|$)", line) for line in table), "a column of dashes is left"
    assert "[1] moves at least" in result.stdout


def test_wide_applies_only_to_kernels():
    result = runner.invoke(app, ["profile", "tiny", "--wide"])
    assert result.exit_code == 2
    assert "--wide (True) does not apply with a PROFILE" in result.stderr
