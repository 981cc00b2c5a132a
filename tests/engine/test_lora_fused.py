"""The LoRA fast path (engine/lora/fused.py): the fused Function's output and every gradient against plain autograd,
a model built by inject_lora against the same model on PEFT's own forward, and every condition under which PEFT's
forward runs instead."""

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn
from torch.profiler import ProfilerActivity, profile

from moe_tune.engine.lora import inject_lora, load_adapter
from moe_tune.engine.lora.fused import FusedLoraLinear, LoraDeltaFunction, _scaled_mm, use_fused_lora
from moe_tune.engine.model.model import build_model
from moe_tune.profiles import load_profile

# Legend: N rows (leading dims flattened), I in_features, O out_features, R rank.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float64: dict(atol=1e-12, rtol=1e-12),
}
# The autograd node the fused Function records, and the one a bias-free plain base shares with its adapter
# (engine/model/projections.py).
FUSED_NODE = "LoraDeltaFunctionBackward"
SHARED_NODE = "SharedInputLinearsFunctionBackward"
SCALING = 1.75
GEMMS = ("aten::mm", "aten::addmm")


def reference(x, lora_a, lora_b, base_out, scaling):
    return base_out + scaling * (x @ lora_a.t()) @ lora_b.t()


def make_x(lead, in_features, layout, dtype):
    if layout == "strided":
        # every other column of a wider tensor: rows are not contiguous, yet view as 2D
        return torch.randn(*lead, 2 * in_features, dtype=dtype)[..., ::2]
    if layout == "transposed":
        # the feature dim has stride 1 only along the other axis: flattening to 2D needs a copy
        return torch.randn(in_features, *lead, dtype=dtype).movedim(0, -1)
    return torch.randn(*lead, in_features, dtype=dtype)


def make_inputs(lead, in_features, out_features, rank, layout="contiguous", dtype=torch.float32):
    torch.manual_seed(0)
    x = make_x(lead, in_features, layout, dtype)
    lora_a = torch.randn(rank, in_features, dtype=dtype)
    lora_b = torch.randn(out_features, rank, dtype=dtype)
    base_out = torch.randn(*lead, out_features, dtype=dtype)
    return x, lora_a, lora_b, base_out


SHAPES = [
    pytest.param((2, 5), 7, 3, 4, id="3d-in7-out3"),  # leading dims [2, 5], in > out
    pytest.param((3, 2, 4), 6, 9, 2, id="4d-in6-out9"),  # two leading dims more, out > in
    pytest.param((6,), 5, 5, 1, id="2d-rank1"),  # rank 1
    pytest.param((1,), 8, 4, 3, id="2d-one_row"),  # a single row
    pytest.param((1, 1), 8, 4, 3, id="3d-one_row"),  # a single row behind two leading dims
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed"])
@pytest.mark.parametrize("lead, in_features, out_features, rank", SHAPES)
def test_function_output_and_gradients_match_autograd(lead, in_features, out_features, rank, layout, dtype):
    inputs = make_inputs(lead, in_features, out_features, rank, layout, dtype)
    leaves = [t.detach().requires_grad_() for t in inputs]  # detach keeps x's strides
    expected = reference(*leaves, SCALING)
    dy = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, leaves, dy)

    out = LoraDeltaFunction.apply(*leaves, SCALING)
    assert type(out.grad_fn).__name__ == FUSED_NODE
    assert out.shape == expected.shape and out.dtype == dtype
    grads = torch.autograd.grad(out, leaves, dy)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    for name, grad, expected_grad in zip(("x", "A", "B", "base_out"), grads, expected_grads):
        assert grad.shape == expected_grad.shape, name
        torch.testing.assert_close(grad, expected_grad, **TOLERANCES[dtype], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_function_passes_gradcheck(layout):
    inputs = make_inputs((2, 3), 4, 5, 2, layout, torch.float64)
    leaves = tuple(t.detach().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(lambda *t: LoraDeltaFunction.apply(*t, 0.7), leaves)


@pytest.mark.parametrize("needs, num_gemms", [
    (("b",), 1),  # dB only: the scaled dy^T xa
    (("a",), 2),  # dxa, then dA
    (("x",), 2),  # dxa, then dx
    (("base",), 0),  # the incoming gradient itself
    (("x", "a", "b", "base"), 4),  # dxa is computed once for dA and dx
])  # fmt: skip
def test_backward_computes_only_the_needed_gradients(needs, num_gemms):
    inputs = make_inputs((2, 5), 7, 3, 4)
    leaves = [t.requires_grad_(name in needs) for name, t in zip(("x", "a", "b", "base"), inputs)]
    wanted = [t for t in leaves if t.requires_grad]
    out = LoraDeltaFunction.apply(*leaves, SCALING)
    dy = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        grads = torch.autograd.grad(out, wanted, dy)
    names = [e.name for e in prof.events()]
    # Scaling is folded into the GEMMs: no elementwise launch, whatever is needed.
    assert sum(names.count(g) for g in GEMMS) == num_gemms and "aten::mul" not in names
    expected_grads = torch.autograd.grad(reference(*leaves, SCALING), wanted, dy)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, **TOLERANCES[torch.float32])


def test_scaled_mm_never_reads_its_shape_tensor():
    # Backward relies on addmm with beta=0 ignoring its input: NaN there must not reach the result.
    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(3, 4)
    out = _scaled_mm(a, b, SCALING, like=torch.full((5, 4), float("nan")))
    torch.testing.assert_close(out, SCALING * (a @ b), **TOLERANCES[torch.float32])


def test_base_output_gradient_is_the_incoming_one():
    x, lora_a, lora_b, base_out = make_inputs((2, 5), 7, 3, 4)
    base_out.requires_grad_()
    out = LoraDeltaFunction.apply(x, lora_a, lora_b, base_out, SCALING)
    dy = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, base_out, dy)
    assert grad.data_ptr() == dy.data_ptr()


def tiny_lora_model():
    profile_ = load_profile("tiny")
    model = inject_lora(build_model(profile_.model), profile_.lora)
    # Fresh adapters are a no-op (B = 0); give every adapter weight a value so the checks mean something.
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.05)
    return profile_.model, model


def tiny_batch(vocab, lengths=(9, 14, 5)):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(lengths)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu, torch.roll(ids, -1, 1)


def loss_grads_and_nodes(model, batch):
    """The loss, every trainable parameter's gradient, and the autograd node of each LoRA linear's output."""
    nodes = []

    def record(module, args, output):
        nodes.append(type(output.grad_fn).__name__)

    handles = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, PeftLinear)]
    ids, cu, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, cu_seqlens=cu, labels=labels).loss
    loss.backward()
    for handle in handles:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, nodes


def test_fast_path_trains_the_tiny_model_like_peft():
    cfg, model = tiny_lora_model()
    batch = tiny_batch(cfg.vocab_size)
    fused_loss, fused_grads, fused_nodes = loss_grads_and_nodes(model, batch)
    # Back to PEFT's own class: the same parameters, PEFT's forward.
    for m in model.modules():
        if type(m) is FusedLoraLinear:
            m.__class__ = PeftLinear
    peft_loss, peft_grads, peft_nodes = loss_grads_and_nodes(model, batch)

    # Every adapted layer of the tiny model is a bias-free nn.Linear: its GEMM and its adapter share one node.
    assert fused_nodes and set(fused_nodes) == {SHARED_NODE}
    assert len(peft_nodes) == len(fused_nodes) and not {FUSED_NODE, SHARED_NODE} & set(peft_nodes)
    torch.testing.assert_close(fused_loss, peft_loss, **TOLERANCES[torch.float32])
    assert fused_grads.keys() == peft_grads.keys()
    linear_adapters = [n for n in fused_grads if ".lora_A." in n and ".experts." not in n]
    assert linear_adapters and all(peft_grads[n].abs().sum() > 0 for n in linear_adapters)
    for name in peft_grads:
        torch.testing.assert_close(
            fused_grads[name], peft_grads[name], **TOLERANCES[torch.float32], msg=lambda m, n=name: f"{n}: {m}"
        )


def test_swap_keeps_state_dict_keys_and_layer_types():
    _, model = tiny_lora_model()
    fused = [m for m in model.modules() if isinstance(m, FusedLoraLinear)]
    keys = list(model.state_dict().keys())
    for m in fused:
        m.__class__ = PeftLinear
    assert list(model.state_dict().keys()) == keys
    assert use_fused_lora(model) == len(fused) > 0
    assert use_fused_lora(model) == 0  # already switched
    assert list(model.state_dict().keys()) == keys
    assert all(isinstance(m, LoraLayer) and isinstance(m, PeftLinear) for m in fused)


def test_loaded_adapter_takes_the_fast_path(tmp_path):
    cfg, model = tiny_lora_model()
    model.save_pretrained(tmp_path / "adapter")
    loaded = load_adapter(build_model(cfg), tmp_path / "adapter")
    num_fused = sum(isinstance(m, FusedLoraLinear) for m in loaded.modules())
    assert num_fused == sum(isinstance(m, FusedLoraLinear) for m in model.modules()) > 0


IN, OUT, RANK = 12, 10, 4


class TwoLinears(nn.Module):
    def __init__(self, proj: nn.Module | None = None):
        super().__init__()
        self.proj = proj if proj is not None else nn.Linear(IN, OUT)
        self.head = nn.Linear(OUT, OUT)

    def forward(self, x):
        return self.head(self.proj(x))


def lora_proj(proj: nn.Module | None = None, **config):
    """A PEFT model with an adapter on `proj` (random A and B), switched to the fast path; the model and the layer."""
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            TwoLinears(proj), LoraConfig(r=RANK, lora_alpha=2 * RANK + 1, target_modules=["proj"], **config)
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    use_fused_lora(model)
    return model, model.base_model.model.proj


def plain_lora(layer, x, adapter="default"):
    """base(x) + scaling * x A^T B^T from the layer's weights."""
    lora_a, lora_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return layer.base_layer(x) + layer.scaling[adapter] * (x.to(lora_a.dtype) @ lora_a.t()) @ lora_b.t()


def x_batch(dtype=torch.float32):
    torch.manual_seed(4)
    return torch.randn(2, 3, IN, dtype=dtype, requires_grad=True)


def test_plain_adapter_takes_the_fast_path():
    _, layer = lora_proj()
    x = x_batch()
    out = layer(x)
    assert type(layer) is FusedLoraLinear and type(out.grad_fn).__name__ == FUSED_NODE
    torch.testing.assert_close(out, plain_lora(layer, x), **TOLERANCES[torch.float32])


# Each case sets a layer up and returns (run: computes the layer's output, the right output).


def fallback_dropout():
    model, layer = lora_proj(lora_dropout=0.1)
    model.eval()  # dropout is the identity, so the plain sum is the right result
    x = x_batch()
    return lambda: layer(x), plain_lora(layer, x)


def fallback_merged():
    _, layer = lora_proj()
    x = x_batch()
    expected = plain_lora(layer, x).detach()
    layer.merge()
    return lambda: layer(x), expected


def fallback_disabled():
    model, layer = lora_proj()
    x = x_batch()

    def run():
        with model.disable_adapter():
            return layer(x)

    return run, layer.base_layer(x)


def fallback_deepspeed_partitioned():
    _, layer = lora_proj()
    # What ZeRO-3 puts on a partitioned parameter; its module's hooks would gather it.
    layer.lora_B["default"].weight.ds_id = 0
    x = x_batch()
    return lambda: layer(x), plain_lora(layer, x)


def fallback_two_active_adapters():
    model, layer = lora_proj()
    model.add_adapter("other", LoraConfig(r=2, lora_alpha=3, target_modules=["proj"]))
    with torch.no_grad():
        layer.lora_B["other"].weight.normal_()
    layer.set_adapter(["default", "other"])
    x = x_batch()
    return lambda: layer(x), plain_lora(layer, x) + plain_lora(layer, x, "other") - layer.base_layer(x)


def fallback_active_adapter_not_on_this_layer():
    model, layer = lora_proj()
    model.add_adapter("other", LoraConfig(r=2, lora_alpha=3, target_modules=["head"]))
    model.set_adapter("other")
    assert layer.active_adapters == ["other"]
    x = x_batch()
    return lambda: layer(x), layer.base_layer(x)


def fallback_adapter_names():
    _, layer = lora_proj()
    x = x_batch()
    expected = torch.stack([plain_lora(layer, x[0]), layer.base_layer(x[1])])
    return lambda: layer(x, adapter_names=["default", "__base__"]), expected


def fallback_input_dtype():
    _, layer = lora_proj()
    layer.lora_A.double()
    layer.lora_B.double()
    x = x_batch()
    return lambda: layer(x), plain_lora(layer, x).float()


def fallback_autocast():
    _, layer = lora_proj()
    x = x_batch()

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x).float()

    return run, plain_lora(layer, x)


def fallback_dora():
    _, layer = lora_proj(use_dora=True)
    x = x_batch()
    # DoRA's result is not the plain sum: the right one is PEFT's own.
    return lambda: layer(x), PeftLinear.forward(layer, x)


def fallback_lora_bias():
    _, layer = lora_proj(lora_bias=True)
    with torch.no_grad():
        layer.lora_B["default"].bias.normal_()
    x = x_batch()
    return lambda: layer(x), plain_lora(layer, x) + layer.scaling["default"] * layer.lora_B["default"].bias


def fallback_fan_in_fan_out():
    from transformers.pytorch_utils import Conv1D

    # GPT-2's Conv1D stores its weight as [in, out]: PEFT sets fan_in_fan_out for it.
    _, layer = lora_proj(Conv1D(OUT, IN), fan_in_fan_out=True)
    assert type(layer) is FusedLoraLinear and layer.fan_in_fan_out
    x = x_batch()
    return lambda: layer(x), plain_lora(layer, x)


FALLBACKS = [
    fallback_dropout, fallback_merged, fallback_disabled, fallback_deepspeed_partitioned, fallback_two_active_adapters,
    fallback_active_adapter_not_on_this_layer, fallback_adapter_names, fallback_input_dtype, fallback_autocast,
    fallback_dora, fallback_lora_bias, fallback_fan_in_fan_out,
]  # fmt: skip


def recording(function, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(True)
        return function(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("case", FALLBACKS, ids=[f.__name__.removeprefix("fallback_") for f in FALLBACKS])
def test_fallback_runs_peft_forward_and_stays_right(case, monkeypatch):
    peft_calls, fused_calls = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run, expected = case()
        monkeypatch.setattr(PeftLinear, "forward", recording(PeftLinear.forward, peft_calls))
        monkeypatch.setattr(LoraDeltaFunction, "forward", recording(LoraDeltaFunction.forward, fused_calls))
        out = run()
    assert peft_calls and not fused_calls and type(out.grad_fn).__name__ not in (FUSED_NODE, SHARED_NODE)
    # Autocast computes in bf16 (8 bits of mantissa).
    tolerance = dict(atol=2e-2, rtol=2e-2) if case is fallback_autocast else TOLERANCES[torch.float32]
    torch.testing.assert_close(out, expected, **tolerance)


def test_base_layer_with_another_output_dtype_keeps_peft_sum():
    class Float64Linear(nn.Linear):
        def forward(self, x):
            return super().forward(x).double()

    _, layer = lora_proj(Float64Linear(IN, OUT))
    x = x_batch()
    out = layer(x)
    assert out.dtype == torch.float64 and type(out.grad_fn).__name__ != FUSED_NODE
    torch.testing.assert_close(out, plain_lora(layer, x), **TOLERANCES[torch.float32])


def base_no_bias():
    return lora_proj(nn.Linear(IN, OUT, bias=False))[1], SHARED_NODE


def base_bias():
    return lora_proj(nn.Linear(IN, OUT))[1], FUSED_NODE


def base_layer_hook():
    # A hook on the base layer would miss its call inside the shared node: the base runs as a module.
    _, layer = lora_proj(nn.Linear(IN, OUT, bias=False))
    layer.base_layer.register_forward_hook(lambda module, args, out: None)
    return layer, FUSED_NODE


def base_backward_hook():
    _, layer = lora_proj(nn.Linear(IN, OUT, bias=False))
    layer.base_layer.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    return layer, FUSED_NODE


def base_linear_subclass():
    class OtherLinear(nn.Linear):
        pass

    return lora_proj(OtherLinear(IN, OUT, bias=False))[1], FUSED_NODE


BASE_CASES = [base_no_bias, base_bias, base_layer_hook, base_backward_hook, base_linear_subclass]


@pytest.mark.parametrize("case", BASE_CASES, ids=[f.__name__.removeprefix("base_") for f in BASE_CASES])
def test_a_plain_bias_free_base_shares_the_adapters_node(case, monkeypatch):
    # torch's own linear whatever ran earlier in this process (a ZeRO-3 engine built outside finetune and StepRunner
    # leaves DeepSpeed's in torch.nn.functional.linear).
    monkeypatch.setattr(torch.nn.functional, "linear", torch._C._nn.linear)
    layer, node = case()
    x = x_batch()
    out = layer(x)
    assert type(out.grad_fn).__name__ == node
    torch.testing.assert_close(out, plain_lora(layer, x), **TOLERANCES[torch.float32])
    params = [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    grads = torch.autograd.grad(out.square().sum(), params)
    expected = torch.autograd.grad(plain_lora(layer, x).square().sum(), params)
    for grad, expected_grad in zip(grads, expected):
        torch.testing.assert_close(grad, expected_grad, **TOLERANCES[torch.float32])


def test_hooks_that_keep_the_base_output_see_it_unchanged():
    _, layer = lora_proj(nn.Linear(IN, OUT, bias=False))
    kept = []
    for register in (layer.base_layer.register_forward_hook, nn.modules.module.register_module_forward_hook):
        handle = register(lambda module, args, out: kept.append(out.detach()) if module is layer.base_layer else None)
        x = x_batch()
        out = layer(x)
        handle.remove()
        torch.testing.assert_close(kept.pop(), layer.base_layer(x).detach(), rtol=0, atol=0)
        torch.testing.assert_close(out, plain_lora(layer, x), **TOLERANCES[torch.float32])
