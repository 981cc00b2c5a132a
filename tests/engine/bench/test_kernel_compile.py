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


def test_kda_products_in_key_tiles_spill_less_than_over_the_whole_key(tmp_path):
    # What kernels_common.GPU_BLOCK_K_KDA_GRAD_PRODUCTS' comment says of the sm_90 compile: pick_config's products
    # kernel in key tiles of 64 keeps a smaller stack a thread than the kernel over the whole K, which spills.
    out = tmp_path / "rows.json"
    result = run("--ops", "kda", "--kernels", "_kda_grad_products_kernel,_kda_grad_products_tiled_kernel",
                 "--candidate", "block_k_kda_grad_products=none", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(row["kernel"], row["candidate"]) for row in rows] == [
        ("_kda_grad_products_tiled_kernel", {}),
        ("_kda_grad_products_kernel", {"block_k_kda_grad_products": None}),
    ]  # fmt: skip
    tiled, whole = rows
    assert (tiled["BK"], whole["BK"]) == (64, 128)
    assert 0 < whole["spill_stores"] and tiled["stack"] < whole["stack"]
    assert all(row["mmas"] > 0 and 0 < row["registers"] <= 255 and row["num_warps"] == 8 for row in rows)
    # The table printed on stdout has a row per launch.
    assert result.stdout.count("| _kda_grad_products") == 2


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
