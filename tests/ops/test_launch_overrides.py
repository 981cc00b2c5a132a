"""Kernel launches named by MOE_TUNE_LAUNCH (ops/common/launch.py): each kind of value read as its field's type, each
rule broken once (one line naming the source, the entry and the rule), the op families' own choices replaced only
where named, and a conv run in the interpreter launching what the variable names; `moe-tune profile --launch` and
the variable at the command line's root."""

import dataclasses
import json
import types

import pytest
from kernel_fixtures import forced_kernel_path, record_launches
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from typer.testing import CliRunner

    from moe_tune.cli import app
    from moe_tune.engine.bench.causal_conv_sweep import make_inputs
    from moe_tune.ops.causal_conv import causal_conv_heads, kernels, kernels_heads
    from moe_tune.ops.common.launch import LAUNCH_ENV, LaunchError, parse_launch, with_overrides
    from moe_tune.ops.linear_attention.kernels_common import pick_config

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels_heads, "_conv_heads_fwd_kernel", on_gpu=False)
runner = CliRunner()


def _gpu():
    # pick_config reads only whether the tensor is on CUDA (and Triton's version).
    return types.SimpleNamespace(is_cuda=True)


def test_each_kind_of_value_is_read_as_its_fields_type():
    text = ("linear_attention.split_grad_wy=false, linear_attention.block_k_grad_wy=none,"
            "linear_attention.block_v_state_fwd=32/16,linear_attention.inverse_dots_16bit=tf32,"
            "causal_conv.grad_block_t=16,causal_conv.one_pass_backward=TRUE,linear_attention.min_state_programs=96")
    assert parse_launch(text) == {
        "linear_attention": {"split_grad_wy": False, "block_k_grad_wy": None, "block_v_state_fwd": (32, 16),
                             "inverse_dots_16bit": "tf32", "min_state_programs": 96},
        "causal_conv": {"grad_block_t": 16, "one_pass_backward": True},
    }  # fmt: skip


BAD = [
    ("causal_conv", "must be FAMILY.FIELD=VALUE (linear_attention, causal_conv, moe_gate_up_fwd, moe_down_fwd, "
     "moe_down_bwd, moe_gate_up_bwd, moe_expert_grad, moe_lora_rows, moe_lora_bwd)"),
    ("causal_conv.one_pass_backward", "must be FAMILY.FIELD=VALUE"),
    ("one_pass_backward=true", "must be FAMILY.FIELD=VALUE"),
    ("causal_conv.=1", "must be FAMILY.FIELD=VALUE"),
    ("causal_conv.one_pass_backward=true,", "entry '': must be FAMILY.FIELD=VALUE"),
    ("conv.block_t=64", "family 'conv' must be one of linear_attention, causal_conv"),
    ("causal_conv.block=64", "causal_conv has no field 'block' (its fields: block_t, block_c, num_warps,"),
    ("causal_conv.one_pass_backward=1", "one_pass_backward must be true or false"),
    ("causal_conv.block_t=48", "block_t must be a power of two"),
    ("causal_conv.grad_num_warps=6", "grad_num_warps must be a power of two"),
    ("causal_conv.block_t=0", "block_t must be an integer from 1 to 65536"),
    ("causal_conv.block_t=-64", "block_t must be an integer from 1 to 65536"),
    ("causal_conv.block_t=6.4e1", "block_t must be an integer from 1 to 65536"),
    ("causal_conv.block_t=none", "block_t must be an integer from 1 to 65536"),
    ("causal_conv.block_t=131072", "block_t must be an integer from 1 to 65536"),
    ("causal_conv.block_t=" + "9" * 5000, "block_t must be an integer from 1 to 65536"),
    ("causal_conv.block_t=\uff11\uff16", "block_t must be an integer from 1 to 65536"),
    ("causal_conv.num_warps=64", "num_warps must be at most 32 (a program's 1024 threads)"),
    ("linear_attention.block_k_grad_wy=x", "block_k_grad_wy must be an integer from 1 to 65536 or none"),
    ("linear_attention.block_v_state_fwd=32/", "block_v_state_fwd must be an integer from 1 to 65536 (several joined "
     "by /)"),
    ("linear_attention.block_v_state_fwd=32/24", "block_v_state_fwd must be a power of two"),
    ("linear_attention.inverse_dots_16bit=bf16", "inverse_dots_16bit must be one of fp16, tf32, tf32x3, ieee"),
    ("causal_conv.block_t=32,causal_conv.block_t=64", "causal_conv.block_t is named twice"),
    # Each MoE kernel takes the fields it reads: one_dot is the gate_up forward's, swiglu_pass the down backward's,
    # tma the GEMMs' but the weight gradients', block_p the weight gradients', and the rank pass has no column tile;
    # block_m is the routing's, not a kernel's.
    ("moe_down_fwd.one_dot=true", "moe_down_fwd has no field 'one_dot' (its fields: block_n, block_k, num_warps, "
     "num_stages, maxnreg, tma)"),
    ("moe_expert_grad.tma=true", "moe_expert_grad has no field 'tma'"),
    ("moe_gate_up_bwd.swiglu_pass=true", "moe_gate_up_bwd has no field 'swiglu_pass'"),
    ("moe_lora_bwd.block_p=128", "moe_lora_bwd has no field 'block_p'"),
    ("moe_lora_rows.block_n=64", "moe_lora_rows has no field 'block_n' (its fields: block_k, num_warps, num_stages, "
     "maxnreg)"),
    ("moe_gate_up_fwd.block_m=64", "moe_gate_up_fwd has no field 'block_m'"),
    ("moe_gate_up_fwd.block_n=96", "block_n must be a power of two"),
    ("moe_gate_up_fwd.one_dot=yes", "one_dot must be true or false"),
    ("moe_expert_grad.maxnreg=x", "maxnreg must be an integer from 1 to 65536 or none"),
]


@pytest.mark.parametrize("text, rule", BAD, ids=[text for text, _ in BAD])
def test_each_broken_rule_is_one_line_naming_the_source_and_the_entry(text, rule):
    with pytest.raises(LaunchError) as error:
        parse_launch(text, "--launch")
    message = str(error.value)
    assert message.startswith("--launch entry '") and rule in message and "\n" not in message


def test_families_take_their_own_fields_only_where_named(monkeypatch):
    default_conv = kernels.DEFAULT_LAUNCH
    monkeypatch.setenv(LAUNCH_ENV, "")
    assert kernels.pick_launch(None) is default_conv
    before = pick_config(_gpu())
    monkeypatch.setenv(LAUNCH_ENV, "causal_conv.one_pass_backward=true,causal_conv.grad_block_c=64")
    assert pick_config(_gpu()) == before
    assert kernels.pick_launch(None) == kernels.ConvLaunch(grad_block_c=64, one_pass_backward=True)
    monkeypatch.setenv(LAUNCH_ENV, "linear_attention.grad_dq_norm_in_output=true")
    assert kernels.pick_launch(None) is default_conv
    after = pick_config(_gpu())
    assert after.grad_dq_norm_in_output and after == type(before)(**{**vars(before), "grad_dq_norm_in_output": True})
    monkeypatch.setenv(LAUNCH_ENV, "  ")
    assert with_overrides("causal_conv", default_conv) is default_conv


def test_the_moe_kernels_take_their_own_fields_only_where_named(monkeypatch):
    from moe_tune.ops.moe import kernel_config

    # An sm_80 GPU, whose gate_up forward is two products of 64 columns.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    bf16_gpu = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device="cuda:0")
    monkeypatch.setenv(LAUNCH_ENV, "")
    default = kernel_config.pick_config(bf16_gpu, 8192 * 8, 64)
    assert not default.gate_up_fwd.one_dot
    monkeypatch.setenv(LAUNCH_ENV, "moe_gate_up_fwd.one_dot=true,moe_gate_up_fwd.block_n=128,"
                                   "moe_expert_grad.block_p=256,moe_lora_rows.maxnreg=none,causal_conv.block_t=64")
    named = kernel_config.pick_config(bf16_gpu, 8192 * 8, 64)
    replace = dataclasses.replace
    assert named == replace(
        default,
        gate_up_fwd=replace(default.gate_up_fwd, one_dot=True, block_n=128),
        expert_grad=replace(default.expert_grad, block_p=256),
    )
    # The fp32 and interpreter defaults take the same fields; a forced config (tests, sweeps) is used as given.
    fp32 = kernel_config.pick_config(types.SimpleNamespace(is_cuda=True, dtype=torch.float32), 64, 4)
    assert fp32.gate_up_fwd.one_dot and fp32.gate_up_fwd.block_n == 128 and fp32.down_fwd.block_n == 64
    assert kernel_config.pick_config(torch.zeros(2, 16), 4, 2).gate_up_fwd.one_dot
    with kernel_config.forced_config(default):
        assert kernel_config.pick_config(bf16_gpu, 8192 * 8, 64) is default


def test_a_conv_run_launches_what_the_variable_names(kernel_path, monkeypatch):
    import moe_tune.engine.bench.causal_conv_sweep as sweep

    monkeypatch.setattr(sweep, "SHAPE", dict(key_heads=1, value_heads=2, key_dim=16, value_dim=8, width=4))
    inputs, positions, grads = make_inputs([7, 20], torch.float32, "cpu")
    launched = record_launches(monkeypatch, kernels_heads, (
        "_conv_heads_fwd_kernel", "_conv_heads_bwd_kernel", "_conv_heads_bwd_one_pass_kernel"))  # fmt: skip

    def run():
        torch.autograd.backward(causal_conv_heads(*inputs, positions, 16, 8), grads)

    run()
    monkeypatch.setenv(LAUNCH_ENV, "causal_conv.one_pass_backward=true")
    run()
    assert launched == ["_conv_heads_fwd_kernel", "_conv_heads_fwd_kernel", "_conv_heads_bwd_kernel",
                        "_conv_heads_fwd_kernel", "_conv_heads_bwd_one_pass_kernel"]  # fmt: skip


def test_profile_launch_is_checked_recorded_and_refused_where_it_does_not_apply(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # Set through monkeypatch first, so that the value the command sets in this process is undone after the test.
    monkeypatch.setenv(LAUNCH_ENV, "")
    bad = runner.invoke(app, ["profile", "--kernels", "--ops", "causal_conv", "--launch", "causal_conv.block_t=3"])
    assert bad.exit_code == 2
    assert bad.output.strip() == "error: --launch entry 'causal_conv.block_t=3': block_t must be a power of two"
    empty = runner.invoke(app, ["profile", "--kernels", "--ops", "causal_conv", "--launch", ""])
    assert empty.exit_code == 2 and empty.output.count("\n") == 1 and "--launch: empty" in empty.output
    misplaced = runner.invoke(app, ["profile", "tiny", "--load-checkpoint", str(tmp_path / "ckpt"),
                                    "--launch", "causal_conv.block_t=32"])  # fmt: skip
    assert misplaced.exit_code == 2
    assert "--launch (causal_conv.block_t=32) does not apply with --load-checkpoint" in misplaced.output
    out = tmp_path / "rows.json"
    text = "causal_conv.one_pass_backward=true"
    good = runner.invoke(app, ["profile", "--kernels", "--ops", "causal_conv", "--launch", text, "--json", str(out)])
    assert good.exit_code == 0, good.output
    assert {row["launch"] for row in json.loads(out.read_text())} == {text}
    monkeypatch.setenv(LAUNCH_ENV, "")
    plain = tmp_path / "plain.json"
    assert runner.invoke(app, ["profile", "--kernels", "--ops", "causal_conv", "--json", str(plain)]).exit_code == 0
    assert {row["launch"] for row in json.loads(plain.read_text())} == {None}


def test_a_bad_variable_is_refused_at_the_root_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(LAUNCH_ENV, "causal_conv.blockt=32")
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: MOE_TUNE_LAUNCH entry 'causal_conv.blockt=32': causal_conv has no field 'blockt' (its fields: "
        "block_t, block_c, num_warps, grad_block_t, grad_block_c, grad_num_warps, one_pass_backward)"
    ]


@pytest.mark.parametrize("mode", ["bogus", "kernel", "Triton2"])
def test_a_bad_kernel_mode_is_refused_at_the_root_in_one_line(monkeypatch, mode):
    # MOE_TUNE_KERNELS was refused by the first kernel call, with a traceback from inside the run.
    monkeypatch.setenv("MOE_TUNE_KERNELS", mode)
    monkeypatch.setenv(LAUNCH_ENV, "")
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: MOE_TUNE_KERNELS ({mode.lower()!r}) must be one of reference, triton, auto"
    ]


class _OutOfResources(Exception):
    """Stands for triton.runtime.errors.OutOfResources (what a tile past the GPU's shared memory raises)."""


_OutOfResources.__module__ = "triton.runtime.errors"


def test_a_launch_a_kernel_cannot_take_ends_the_run_in_one_line(monkeypatch):
    from moe_tune.cli import profile_kernels

    monkeypatch.setenv(LAUNCH_ENV, "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def refuses(*args):
        raise _OutOfResources("out of resource: shared memory, Required: 300000, Hardware limit: 232448.\nmore")

    monkeypatch.setattr(profile_kernels, "run", refuses)
    text = "causal_conv.grad_block_c=8192"
    result = runner.invoke(app, ["profile", "--kernels", "--ops", "causal_conv", "--launch", text])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: MOE_TUNE_LAUNCH ({text}): a kernel cannot run under it: _OutOfResources: out of resource: shared "
        "memory, Required: 300000, Hardware limit: 232448."
    ]
    # Without a launch named from outside the error is not the user's: it keeps its traceback.
    monkeypatch.setenv(LAUNCH_ENV, "")
    plain = runner.invoke(app, ["profile", "--kernels", "--ops", "causal_conv"])
    assert isinstance(plain.exception, _OutOfResources)


TILED_PRODUCTS = "linear_attention.block_k_kda_grad_products"
WARPS_PRODUCTS = "linear_attention.num_warps_kda_grad_products"


@pytest.mark.parametrize("text, refused", [
    (f"{TILED_PRODUCTS}=32,{WARPS_PRODUCTS}=16", True),
    (f"{WARPS_PRODUCTS}=32,{TILED_PRODUCTS}=64", True),
    (f"{TILED_PRODUCTS}=32,{WARPS_PRODUCTS}=8", False),
    (f"{TILED_PRODUCTS}=32,{WARPS_PRODUCTS}=4", False),
    (f"{TILED_PRODUCTS}=32", False),  # the GPU's 8 warps
    (f"{TILED_PRODUCTS}=none,{WARPS_PRODUCTS}=16", False),  # the whole kernel
    (f"{WARPS_PRODUCTS}=16", True),  # pick_config's key tiles of 64
    (f"{WARPS_PRODUCTS}=8", False),
])  # fmt: skip
def test_key_tiles_of_kdas_products_kernel_launch_at_most_8_warps(text, refused, monkeypatch):
    # 16 warps in 32-column tiles made an illegal memory access on the H200 (Triton 3.6 and 3.7.1): refused when
    # named, and by the config itself however it is built.
    if refused:
        with pytest.raises(LaunchError, match=r"^--launch linear_attention: num_warps_kda_grad_products \d+ with "
                           r"block_k_kda_grad_products \d+: key tiles launch at most 8 warps"):  # fmt: skip
            parse_launch(text, "--launch")
    else:
        monkeypatch.setenv(LAUNCH_ENV, text)
        fields = parse_launch(text)["linear_attention"]
        assert {name: getattr(pick_config(_gpu()), name) for name in fields} == fields
    import dataclasses

    config = pick_config(_gpu())
    fields = dict(block_k_kda_grad_products=32, num_warps_kda_grad_products=16)
    with pytest.raises(ValueError, match="key tiles launch at most 8 warps"):
        dataclasses.replace(config, **fields)
