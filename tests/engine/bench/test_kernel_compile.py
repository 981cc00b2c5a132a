"""engine/bench/kernel_compile.py: the linear-attention kernels of a training call compiled for sm_90 on the CPU,
and its one-line refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MODULE = "moe_tune.engine.bench.kernel_compile"


def run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_reverse_state_pass_prefetches_only_with_dv_new_from_registers(tmp_path):
    # What KernelConfig.state_bwd_dv_in_registers' comment says of the sm_90 compile: the default loop (dv_new read
    # back through a barrier) has no asynchronous copies, the candidate's prefetches its loads; both without spills.
    out = tmp_path / "rows.json"
    result = run("--ops", "gdn", "--kernels", "_chunk_state_bwd_kernel", "--candidate",
                 "state_bwd_dv_in_registers=true", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(row["kernel"], row["candidate"]) for row in rows] == [
        ("_chunk_state_bwd_kernel", {}), ("_chunk_state_bwd_kernel", {"state_bwd_dv_in_registers": True})
    ]  # fmt: skip
    round_trip, in_registers = rows
    assert round_trip["async_copies"] == 0 < in_registers["async_copies"]
    assert all(row["spill_stores"] == row["spill_loads"] == 0 and 0 < row["registers"] <= 255 for row in rows)
    assert all(row["mmas"] > 0 and row["shared"] > 0 and (row["BK"], row["BV"]) == (128, 32) for row in rows)
    # The table printed on stdout has a row per launch.
    assert result.stdout.count("| _chunk_state_bwd_kernel |") == 2


@pytest.mark.parametrize("args, interpret, message", [
    (["--kernels", "_no_such_kernel"], False, "_no_such_kernel: not a linear-attention kernel"),
    (["--ops", "gdn", "--kernels", "_kda_grad_products_kernel,_chunk_state_bwd_kernel"], False,
     "--kernels (_kda_grad_products_kernel): not launched by gdn's training call under these candidates"),
    (["--candidate", "no_such_field=1"], False, "--candidate"),
    (["--head-dims", "128"], False, "'128': must be K,V, two positive integers"),
    (["--ops", "gla"], False, "'gla': must be distinct names from gdn, kda"),
    (["--json", "/no/such/folder/rows.json"], False, "--json (/no/such/folder/rows.json): must be a file in an"),
    (["--ops", "gdn"], True, "cannot compile for sm_90 here: TRITON_INTERPRET=1"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(args, interpret, message):
    result = run(*args, interpret=interpret)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stdout == ""
