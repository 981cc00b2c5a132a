"""The reference stays the reference: with flash-linear-attention importable (CI installs it, as users of the
linear-attention families do), align builds and runs transformers' own PyTorch paths, says so in its report, and
aligns on a CPU, where FLA's Triton kernels cannot run. pure_torch_paths() restores what it rebinds."""

import sys
import types

import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.align.reference import describe, external_paths, pure_torch_paths

from hf_tiny import save_tiny_checkpoint, tiny_kimi_linear, tiny_qwen3_next

FAKE_MODULE = "transformers.models.fake_kernels.modeling_fake_kernels"


@pytest.fixture(params=["kernels module", "function"])
def fake_modeling_module(request, monkeypatch):
    """A modeling module whose `root` went through transformers' fallback decorator with an importable 'package'
    (math.sqrt stands in for an FLA kernel), registered where pure_torch_paths looks: as the kernels package wraps it
    (an nn.Module calling transformers' wrapper; transformers >= 5.25 requires kernels) and as the bare wrapper
    function (transformers without kernels: the H200's 5.17)."""
    from transformers.integrations import hub_kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    def root(x):
        return x ** 0.5 + 1000.0  # distinguishable from math.sqrt

    module = types.ModuleType(FAKE_MODULE)
    # The bare wrapper whatever the installed transformers does with kernels.
    with monkeypatch.context() as patch:
        patch.setattr(hub_kernels, "use_kernel_forward_from_hub", lambda name: lambda function: function, raising=False)
        module.root = use_kernel_func_from_hub_with_fallback("sqrt", "math")(root)
    if request.param == "kernels module":
        kernels = pytest.importorskip("kernels", reason="transformers >= 5.25 requires it")
        # What transformers >= 5.25 does with its wrapper (hub_kernels.use_kernel_func_from_hub_with_fallback).
        module.root = kernels.use_kernel_forward_from_hub("sqrt")(module.root)
    module.plain = root
    assert isinstance(module.root, torch.nn.Module) == (request.param == "kernels module")
    monkeypatch.setitem(sys.modules, FAKE_MODULE, module)
    return module, root


def test_pure_torch_paths_rebinds_and_restores(fake_modeling_module):
    module, root = fake_modeling_module
    wrapper = module.root
    assert wrapper(4.0) == 2.0  # math.sqrt: the external implementation outside the context
    with pure_torch_paths() as replaced:
        assert module.root is root and module.root(4.0) == 1002.0
        assert replaced[(FAKE_MODULE, "root")] == "math"
        # Still named while held (the report is written inside the context).
        assert external_paths([module]) == {(FAKE_MODULE, "root"): "math"}
        with pure_torch_paths() as nested:
            assert module.root is root and nested[(FAKE_MODULE, "root")] == "math"
        assert module.root is root  # the nested exit restores only what it replaced itself: nothing
    assert module.root is wrapper and module.plain is root


def test_pure_torch_paths_restores_when_the_body_raises(fake_modeling_module):
    module, root = fake_modeling_module
    wrapper = module.root
    with pytest.raises(RuntimeError, match="inside"):
        with pure_torch_paths():
            assert module.root is root
            raise RuntimeError("inside")
    assert module.root is wrapper
    assert external_paths([module]) == {(FAKE_MODULE, "root"): "math"}


@pytest.mark.parametrize("replaced, line", [
    ({}, "transformers' PyTorch paths"),
    ({("m", "a"): "fla.ops.kda", ("m", "b"): "causal_conv1d.cpp"},
     "transformers' PyTorch paths (causal-conv1d, flash-linear-attention importable, not used)"),
])
def test_describe_names_the_distributions(replaced, line):
    assert describe(replaced) == line


def two_layer_kimi_linear():
    return tiny_kimi_linear(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            mlp_layer_types=["dense", "sparse"], num_local_experts=5)


@pytest.mark.parametrize("builder", [tiny_qwen3_next, two_layer_kimi_linear], ids=["qwen3_next", "kimi_linear"])
def test_align_with_fla_installed_runs_transformers_pytorch_paths(builder, tmp_path):
    pytest.importorskip("fla", reason="flash-linear-attention is in the test extra (CI has it)")
    checkpoint = save_tiny_checkpoint(builder(), tmp_path / "checkpoint")
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert report.passed, report.failures
    assert report.reference_paths.startswith("transformers' PyTorch paths (")
    assert "flash-linear-attention importable, not used" in report.reference_paths
    # Outside align the modeling module calls FLA again (as the GPU baseline of `profile --against` wants).
    assert any(origin.startswith("fla") for origin in external_paths().values())
