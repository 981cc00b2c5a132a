"""Projections of one input as one autograd node (engine/model/projections.py): outputs and every gradient against the
modules' own calls, with and without LoRA adapters, unused outputs, trainable bases, odd widths; every condition under
which the modules run instead; the memory manager's class hooks around the node; the token mixers taking it."""

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from small_models import loss_and_grads as row_loss_and_grads, perturbed_lora_model
from torch import nn

from moe_tune.engine.bench.breakdown import method_in_range
from moe_tune.engine.lora.fused import FusedLoraLinear, use_fused_lora
from moe_tune.engine.model import projections
from moe_tune.engine.model.projections import (
    CLASS_SCOPE_HOOK,
    SharedInputProjections,
    project,
    shared_input_linears,
)

NODE = "SharedInputLinearsFunctionBackward"
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}
IN_FEATURES = 12
# Widths of the projections: wide, narrow as a gate (1 and 3 columns), and one as wide as the input.
WIDTHS = (20, 3, 12, 1)
NAMES = tuple(f"p{i}" for i in range(len(WIDTHS)))


class Group(nn.Module):
    def __init__(self, widths=WIDTHS, bias=False):
        super().__init__()
        for name, width in zip(NAMES, widths):
            setattr(self, name, nn.Linear(IN_FEATURES, width, bias=bias))

    def members(self):
        return [getattr(self, name) for name in NAMES]


def make_group(lora_on=(), dtype=torch.float64, train_base=False, seed=0, **lora_options):
    """A Group whose `lora_on` projections carry a fused LoRA adapter (B non-zero so every path carries signal)."""
    torch.manual_seed(seed)
    group = Group().to(dtype)
    if lora_on:
        config = LoraConfig(r=4, lora_alpha=6, target_modules=list(lora_on), **lora_options)
        group = get_peft_model(group, config).base_model.model
        assert use_fused_lora(group) == len(lora_on)
        with torch.no_grad():
            for name, p in group.named_parameters():
                if "lora_B" in name:
                    p.normal_()
    for name, p in group.named_parameters():
        if "lora_" not in name:
            p.requires_grad_(train_base or not lora_on)
    return group


def trainable(group):
    return {name: p for name, p in group.named_parameters() if p.requires_grad}


def loss_and_grads(group, x, outputs_fn, used):
    """outputs_fn(group, x) -> outputs; the loss weighs each used output with fixed random weights."""
    x = x.detach().requires_grad_()
    outs = outputs_fn(group, x)
    gen = torch.Generator().manual_seed(7)
    loss = sum((outs[i] * torch.randn(outs[i].shape, generator=gen, dtype=outs[i].dtype)).sum() for i in used)
    params = trainable(group)
    grads = torch.autograd.grad(loss, [x, *params.values()], allow_unused=True)
    return outs, dict(zip(["x", *params], grads))


def by_modules(group, x):
    return tuple(m(x) for m in group.members())


def by_node(group, x):
    outs = shared_input_linears(x, group.members())
    assert outs is not None and all(type(o.grad_fn).__name__ == NODE for o in outs)
    return outs


def assert_same(result, expected, dtype):
    (outs, grads), (expected_outs, expected_grads) = result, expected
    for out, expected_out in zip(outs, expected_outs):
        assert out.shape == expected_out.shape and out.dtype == expected_out.dtype
        torch.testing.assert_close(out, expected_out, **TOLERANCES[dtype])
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        expected_grad = expected_grads[name]
        if expected_grad is None:
            # No path from the loss: the node must not invent one (a zero gradient would still move AdamW's state).
            assert grad is None, name
        else:
            torch.testing.assert_close(grad, expected_grad, **TOLERANCES[dtype], msg=lambda m, n=name: f"{n}: {m}")


def make_x(lead, layout, dtype):
    torch.manual_seed(3)
    if layout == "strided":
        return torch.randn(*lead, 2 * IN_FEATURES, dtype=dtype)[..., ::2]
    return torch.randn(*lead, IN_FEATURES, dtype=dtype)


LORA_SETS = [
    pytest.param((), id="no-lora"),
    pytest.param(("p0",), id="lora-first"),
    pytest.param(("p1", "p3"), id="lora-on-gates"),  # adapters on the narrow outputs only
    pytest.param(NAMES, id="lora-all"),
]
USED = [
    pytest.param((0, 1, 2, 3), id="all-used"),
    pytest.param((1, 2), id="first-and-last-unused"),  # no gradient reaches p0 (an adapter) nor p3
    pytest.param((3,), id="only-last"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("used", USED)
@pytest.mark.parametrize("lora_on", LORA_SETS)
@pytest.mark.parametrize("lead, layout", [((2, 5), "contiguous"), ((7,), "contiguous"), ((1, 3), "strided")])
def test_node_matches_the_modules(lead, layout, lora_on, used, dtype):
    group = make_group(lora_on, dtype)
    x = make_x(lead, layout, dtype)
    assert_same(loss_and_grads(group, x, by_node, used), loss_and_grads(group, x, by_modules, used), dtype)


@pytest.mark.parametrize("lora_on", [(), ("p0", "p2")], ids=["full", "lora"])
def test_trainable_bases_get_their_gradients(lora_on):
    # Full fine-tuning (and LoRA over a trainable base): every weight's gradient, not only x's and the adapters'.
    group = make_group(lora_on, train_base=True)
    assert all(p.requires_grad for p in group.parameters())
    x = make_x((4, 3), "contiguous", torch.float64)
    result = loss_and_grads(group, x, by_node, (0, 2, 3))
    assert_same(result, loss_and_grads(group, x, by_modules, (0, 2, 3)), torch.float64)
    assert result[1]["p0.base_layer.weight" if lora_on else "p0.weight"] is not None


def test_no_grad_and_frozen_input():
    group = make_group(("p1",))
    x = make_x((3, 2), "contiguous", torch.float64)
    with torch.no_grad():
        outs = shared_input_linears(x, group.members())
        for out, expected in zip(outs, by_modules(group, x)):
            torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])
    # x needs no gradient: only the adapters get theirs.
    outs = shared_input_linears(x, group.members())
    grads = torch.autograd.grad(sum(o.sum() for o in outs), list(trainable(group).values()))
    expected = torch.autograd.grad(sum(o.sum() for o in by_modules(group, x)), list(trainable(group).values()))
    for grad, expected_grad in zip(grads, expected):
        torch.testing.assert_close(grad, expected_grad, **TOLERANCES[torch.float64])


def _hooked(group):
    group.p2.register_forward_hook(lambda m, a, o: None)


def _hooked_base(group):
    group.p0.base_layer.register_forward_pre_hook(lambda m, a: None)


def _backward_hook(group):
    group.p3.register_full_backward_hook(lambda m, gi, go: None)


def _partitioned(group):
    group.p1.weight.ds_id = 0  # what ZeRO-3 sets on a partitioned weight


def _merged(group):
    group.p0.merge()  # every condition of LoRA's own fast path holds here too (tests/engine/test_lora_fused.py)


def _dropout(group):
    group.p0.lora_dropout["default"] = nn.Dropout(0.1)
    group.eval()  # the identity then, so the modules' outputs are repeatable


FALLBACKS = [
    pytest.param(dict(), _hooked, id="forward-hook"),
    pytest.param(dict(), _hooked_base, id="hook-on-lora-base"),
    pytest.param(dict(), _backward_hook, id="backward-hook"),
    pytest.param(dict(), _partitioned, id="zero3-partitioned-weight"),
    pytest.param(dict(), _merged, id="lora-merged"),
    pytest.param(dict(), _dropout, id="lora-dropout"),
    pytest.param(dict(bias=True), None, id="bias"),
]


@pytest.mark.parametrize("options, change", FALLBACKS)
def test_modules_run_where_the_node_would_skip_something(options, change):
    if options.get("bias"):
        torch.manual_seed(0)
        group = Group(bias=True).double()
    else:
        group = make_group(("p0",))
    if change is not None:
        change(group)
    x = make_x((2, 3), "contiguous", torch.float64)
    assert shared_input_linears(x, group.members()) is None
    # project() then calls the modules: their hooks fire and the outputs are theirs exactly.
    calls = []
    group.p2.register_forward_pre_hook(lambda m, a: calls.append(m))
    outs = project(x, group.members())
    assert calls == [group.p2]
    for out, expected in zip(outs, by_modules(group, x)):
        assert torch.equal(out, expected)


def test_weights_in_another_dtype_than_the_input_run_the_modules():
    group = make_group(("p0",))
    assert shared_input_linears(make_x((2, 3), "contiguous", torch.float32), group.members()) is None
    group.p1.weight.data = group.p1.weight.data.float()
    assert shared_input_linears(make_x((2, 3), "contiguous", torch.float64), group.members()) is None


def test_global_hooks_and_autocast_run_the_modules():
    group = make_group(("p0",))
    x = make_x((2, 3), "contiguous", torch.float64)
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert shared_input_linears(x, group.members()) is None
    finally:
        handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert shared_input_linears(x, group.members()) is None
    assert shared_input_linears(x, group.members()) is not None


def test_class_scope_hooks_run_once_around_the_node():
    group = make_group(("p0", "p1"))
    events = []

    def pre(module, args):
        events.append(("pre", module, torch.is_grad_enabled()))

    def post(module, args, output):
        events.append(("post", module, tuple(type(o.grad_fn).__name__ for o in output)))

    for hook in (pre, post):
        setattr(hook, CLASS_SCOPE_HOOK, True)
    for module in group.modules():
        if isinstance(module, nn.Linear | FusedLoraLinear):
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)
    x = make_x((2, 3), "contiguous", torch.float64)
    outs = shared_input_linears(x, group.members())
    assert outs is not None
    assert events == [("pre", group.p0, True), ("post", group.p0, (NODE,) * len(NAMES))]
    # An unmarked hook beside them keeps the node from applying.
    group.p3.register_forward_hook(lambda m, a, o: None)
    assert shared_input_linears(x, group.members()) is None


def test_outputs_are_handed_out_once_in_the_callers_order():
    group = make_group(("p2",))
    x = make_x((2, 3), "contiguous", torch.float64)
    out = SharedInputProjections(x, group.members())
    first = out.of(group.p3, group.p1)
    assert [o.shape[-1] for o in first] == [WIDTHS[3], WIDTHS[1]]
    assert all(type(o.grad_fn).__name__ == NODE for o in first)
    # Taken again, a module runs itself.
    again = out.of(group.p3)[0]
    assert type(again.grad_fn).__name__ != NODE and torch.allclose(again, first[0])
    # Where the node does not apply, each module runs when its output is taken.
    calls = []
    group.p1.register_forward_pre_hook(lambda m, a: calls.append(m))
    out = SharedInputProjections(x, group.members())
    assert calls == []
    out.of(group.p1)
    assert calls == [group.p1]


def test_node_sums_x_gradient_inside_its_gemms():
    # Four projections and two adapters: autograd would add five parts of x's gradient to the first; the node adds
    # each inside its GEMM (three projections and the adapters' shared part), with no add of its own.
    from torch.profiler import profile

    group = make_group(("p0", "p2"))
    x = make_x((4, 2), "contiguous", torch.float64).requires_grad_()
    outs = shared_input_linears(x, group.members())
    loss = torch.stack([o.sum() for o in outs]).sum()
    with profile() as prof:
        loss.backward()
    names = [e.name for e in prof.events()]
    assert "aten::add" not in names and "aten::add_" not in names
    assert names.count("aten::addmm_") == len(NAMES)


def by_node_handing_on(group, x):
    # x's later use (a scaled copy into the loss) through the handed-on x: its gradient enters the node's backward.
    *outs, x_on = shared_input_linears(x, group.members(), hand_on=True)
    assert all(type(o.grad_fn).__name__ == "SharedInputLinearsHandOnFunctionBackward" for o in (*outs, x_on))
    assert x_on.data_ptr() == x.data_ptr() and torch.equal(x_on, x)
    return (*outs, x_on * 1.5)


def by_modules_and_x(group, x):
    return (*by_modules(group, x), x * 1.5)


@pytest.mark.parametrize("used", [(0, 1, 2, 3, 4), (1, 4), (4,), (0, 3)], ids=["all", "some", "x-only", "x-unused"])
@pytest.mark.parametrize("lora_on", [(), ("p0", "p2"), ("p3",)], ids=["no-lora", "lora", "lora-last"])
@pytest.mark.parametrize("lead, layout", [((2, 5), "contiguous"), ((1, 3), "strided")])
def test_node_handing_x_on_matches_the_modules(lead, layout, lora_on, used):
    # Every output used or not, the handed-on x alone (its later uses' gradient passes through unchanged), or unused.
    group = make_group(lora_on, torch.float64)
    x = make_x(lead, layout, torch.float64)
    result = loss_and_grads(group, x, by_node_handing_on, used)
    assert_same(result, loss_and_grads(group, x, by_modules_and_x, used), torch.float64)


def test_node_handing_x_on_adds_its_later_gradient_inside_its_first_gemm():
    # x's later uses' gradient starts x's gradient inside the first GEMM (one addmm), the other parts are added in
    # place (addmm_): no add kernel, and the incoming gradient, which no node lodged, is never written (autograd may
    # share it).
    from torch.profiler import profile

    group = make_group(())
    x = make_x((4, 2), "contiguous", torch.float64).requires_grad_()
    *outs, x_on = shared_input_linears(x, group.members(), hand_on=True)
    later = torch.randn(x.shape, dtype=torch.float64)
    later_before = later.clone()
    loss = torch.stack([o.sum() for o in outs]).sum() + (x_on * later).sum()
    with profile() as prof:
        (dx,) = torch.autograd.grad(loss, [x])
    names = [e.name for e in prof.events()]
    assert "aten::add" not in names and "aten::add_" not in names
    assert names.count("aten::addmm") == 1 and names.count("aten::addmm_") == len(NAMES) - 1
    expected = later + sum(m.weight.sum(0) for m in group.members())
    torch.testing.assert_close(dx, expected, **TOLERANCES[torch.float64])
    assert torch.equal(later, later_before)


def by_two_nodes(second_hands_on, extra_use):
    """Node a hands x on to node b (handing it on again or not); extra_use: the first handed-on x also feeds a scaled
    copy into the loss, so autograd sums two gradients of it."""

    def outputs(pair, x):
        *outs_a, x_a = shared_input_linears(x, pair.a.members(), hand_on=True)
        if second_hands_on:
            *outs_b, x_b = shared_input_linears(x_a, pair.b.members(), hand_on=True)
            outs_b.append(x_b * 1.5)
        else:
            outs_b = list(shared_input_linears(x_a, pair.b.members()))
        return (*outs_a, *outs_b, *([x_a * 0.5] if extra_use else []))

    return outputs


def by_two_groups_of_modules(second_hands_on, extra_use):
    def outputs(pair, x):
        return (*by_modules(pair.a, x), *by_modules(pair.b, x), *([x * 1.5] if second_hands_on else []),
                *([x * 0.5] if extra_use else []))  # fmt: skip

    return outputs


@pytest.mark.parametrize("extra_use", [False, True], ids=["one-use", "extra-use"])
@pytest.mark.parametrize("second_hands_on", [True, False], ids=["b-hands-on", "b-plain"])
@pytest.mark.parametrize("lora_on", [(), ("p0", "p2")], ids=["no-lora", "lora"])
def test_node_adds_in_place_into_the_gradient_the_next_node_lodged(lora_on, second_hands_on, extra_use):
    # Node b makes x's gradient as a tensor of its own and lodges it (ops/common/grad_handoff.py): node a adds its
    # products into that tensor in place, with no out-of-place addmm (which copies its first operand). Where autograd
    # sums the handed-on x's two uses into a new tensor, node a adds out of place as before. Outputs and every
    # gradient as the modules' own calls give them either way (fp64).
    from torch.profiler import profile

    pair = nn.Module()
    pair.a, pair.b = make_group(lora_on), make_group(lora_on, seed=1)
    x = make_x((4, 3), "contiguous", torch.float64)
    num_outs = 2 * len(NAMES) + second_hands_on + extra_use
    with profile(record_shapes=True) as prof:
        result = loss_and_grads(pair, x, by_two_nodes(second_hands_on, extra_use), range(num_outs))
    expected = loss_and_grads(pair, x, by_two_groups_of_modules(second_hands_on, extra_use), range(num_outs))
    assert_same(result, expected, torch.float64)
    copied = [e for e in prof.events() if e.name == "aten::addmm" and e.input_shapes[0] == [4 * 3, IN_FEATURES]]
    # Out of place: node b where a later use's gradient (not lodged) reaches it, node a where autograd summed two.
    assert len(copied) == second_hands_on + extra_use


def test_node_never_writes_a_gradient_passed_through_to_it():
    # Node b's outputs are unused: x's gradient passes through it unchanged, and it is the very tensor an add's
    # backward also gave the other operand w. Node b must not lodge it, or node a's in-place GEMM would change w's
    # gradient too.
    group_a, group_b = make_group(()), make_group((), seed=1)
    x = make_x((4, 3), "contiguous", torch.float64).requires_grad_()
    w = torch.randn(x.shape, dtype=torch.float64, requires_grad=True)
    c = torch.randn(x.shape, dtype=torch.float64)
    *outs_a, x_a = shared_input_linears(x, group_a.members(), hand_on=True)
    *_, x_b = shared_input_linears(x_a, group_b.members(), hand_on=True)
    loss = torch.stack([o.sum() for o in outs_a]).sum() + ((x_b + w) * c).sum()
    dx, dw = torch.autograd.grad(loss, [x, w])
    assert torch.equal(dw, c)
    expected = c + sum(m.weight.sum(0) for m in group_a.members())
    torch.testing.assert_close(dx, expected, **TOLERANCES[torch.float64])


def test_projections_hand_on_x_only_where_the_node_applies():
    group = make_group(())
    x = make_x((3,), "contiguous", torch.float64).requires_grad_()
    handed = SharedInputProjections(x, group.members(), hand_on=True)
    assert handed.x is not x and handed.x.grad_fn is not None and torch.equal(handed.x, x)
    assert SharedInputProjections(x, group.members()).x is x
    # A hooked projection runs its module: x itself is handed out.
    group.p1.register_forward_hook(lambda m, a, o: None)
    assert SharedInputProjections(x, group.members(), hand_on=True).x is x


def hybrid_model():
    """A small model with every token mixer that projects its input in a group (gated delta net, KDA, gated and
    sparse attention) and dense SwiGLU MLPs, LoRA on q, k, v and o, perturbed parameters, fp64."""
    from moe_tune.profiles import load_profile

    raw = load_profile("tiny").model.model_dump(mode="json")
    layers = [{"attention": name, "mlp": "dense"} for name in ("linear", "kda", "full", "sparse")]
    raw.update(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
               layers=layers, kda_attention={"num_heads": 2, "head_dim": 8})  # fmt: skip
    raw["linear_attention"].update(num_key_heads=1, num_value_heads=2, key_head_dim=8, value_head_dim=8)
    raw["sparse_attention"].update(index_heads=2, index_head_dim=8, topk=64, block_size=16)
    return perturbed_lora_model(raw, ["q_proj", "k_proj", "v_proj", "o_proj"], False, torch.float64)


def model_loss_and_grads(model):
    return row_loss_and_grads(model, [0, 20, 61, 90], 259)


def test_token_mixers_take_the_node_and_train_as_their_modules(monkeypatch):
    model = hybrid_model()
    taken = []
    original = projections.shared_input_linears

    def recording(x, modules, hand_on=False):
        outs = original(x, modules, hand_on)
        taken.append(len(modules) if outs is not None else None)
        return outs

    monkeypatch.setattr(projections, "shared_input_linears", recording)
    loss, grads = model_loss_and_grads(model)
    # The gated delta net's and KDA's six projections, the gated and sparse attention's q, k and v, each dense
    # MLP's gate and up: every group, every time.
    assert sorted(taken) == [2, 2, 2, 2, 3, 3, 6, 6]
    monkeypatch.setattr(projections, "shared_input_linears", lambda x, modules, hand_on=False: None)
    expected_loss, expected_grads = model_loss_and_grads(model)
    torch.testing.assert_close(loss, expected_loss, **TOLERANCES[torch.float64])
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        message = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(grad, expected_grads[name], **TOLERANCES[torch.float64], msg=message)


def test_memory_policies_keep_the_node_and_leave_its_projections_out_of_regions(monkeypatch):
    from moe_tune.engine.memory import attach_activation_memory
    from moe_tune.profiles.schema import MemoryProfile

    model = hybrid_model()
    manager = attach_activation_memory(model, MemoryProfile(linear="recompute", min_offload_mb=0))
    grouped = {getattr(m, n) for m in model.modules() for n in getattr(m, "shared_input_projections", ())}
    assert grouped and not grouped & set(manager.regions)
    # Other linear layers (o_proj, the MLPs) are still recomputed.
    assert any(isinstance(m, nn.Linear | FusedLoraLinear) for m in manager.regions)
    taken = []
    original = projections.shared_input_linears
    monkeypatch.setattr(projections, "shared_input_linears",
                        lambda x, modules, hand_on=False: taken.append(original(x, modules, hand_on)) or taken[-1])
    model_loss_and_grads(model)
    assert taken and all(outs is not None for outs in taken)


def test_linear_plus_adds_inside_the_gemm_or_calls_the_module():
    from moe_tune.engine.model.projections import linear_plus

    torch.manual_seed(5)
    x = torch.randn(3, 4, IN_FEATURES, dtype=torch.float64, requires_grad=True)
    add_to = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    for bias, hooked in [(False, False), (True, False), (False, True)]:
        module = nn.Linear(IN_FEATURES, 7, bias=bias).double()
        if hooked:
            module.register_forward_hook(lambda m, a, o: None)
        out = linear_plus(x, module, add_to)
        expected = module(x) + add_to
        # The add inside one addmm only for a bias-free, unhooked nn.Linear.
        assert (type(out.grad_fn).__name__ == "ViewBackward0") == (not bias and not hooked)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])
        leaves = [x, add_to, module.weight]
        expected_grads = torch.autograd.grad(expected.sum(), leaves)
        for grad, expected_grad in zip(torch.autograd.grad(out.sum(), leaves), expected_grads):
            torch.testing.assert_close(grad, expected_grad, **TOLERANCES[torch.float64])


def moe_block(shared):
    """A small MoE block (a gated, ungated or no shared expert) with perturbed fp64 parameters, and its input."""
    from moe_tune.engine.model.moe import MoEBlock
    from moe_tune.profiles.schema import MoESpec

    spec = MoESpec(num_experts=6, top_k=2, expert_intermediate_size=8, shared_expert_intermediate_size=0 if
                   shared == "none" else 10, shared_expert_gate=shared == "gated")  # fmt: skip
    torch.manual_seed(0)
    block = MoEBlock(IN_FEATURES, spec).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    return block, torch.randn(1, 9, IN_FEATURES, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("shared", ["gated", "ungated", "none"])
def test_moe_block_routes_and_adds_its_shared_expert_as_its_modules_would(shared, monkeypatch):
    # The router's and the shared gate's logits from one node, the shared expert's rows scaled before its down
    # projection and its output added inside the routed experts' slot sum: the layer's output and every gradient as
    # the modules' own calls give them (routed + sigmoid(gate(x)) * shared_expert(x)), fp64.
    block, x = moe_block(shared)
    spec = block.spec
    taken = []
    original = projections.shared_input_linears

    def recording(x, modules, hand_on=False):
        outs = original(x, modules, hand_on)
        taken.append((len(modules), hand_on, outs is not None))
        return outs

    monkeypatch.setattr(projections, "shared_input_linears", recording)
    out, _ = block(x)
    monkeypatch.undo()

    def modules_formula(x):
        from moe_tune.ops.moe import topk_route

        x_TD = x.reshape(-1, IN_FEATURES)
        logits = block.gate(x_TD)
        ids, weights, _ = topk_route(logits, spec.top_k, score_func=spec.score_func, renormalize=spec.renormalize,
                                     selection_bias=None, routed_scaling=spec.routed_scaling)  # fmt: skip
        y = block.experts(x_TD, ids, weights.to(x.dtype))
        if block.shared_expert is not None:
            mlp = block.shared_expert
            s = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x_TD)) * mlp.up_proj(x_TD))
            if block.shared_expert_gate is not None:
                s = s * torch.sigmoid(block.shared_expert_gate(x_TD))
            y = y + s
        return y.view(x.shape)

    expected = modules_formula(x)
    # A gated block's router and gate share a node, a router alone takes one too: either hands x on to the experts;
    # the shared expert's gate and up share another, which hands it on again to the routed experts.
    expected_calls = {"gated": [(2, True, True), (2, True, True)], "ungated": [(1, True, True), (2, True, True)],
                      "none": [(1, True, True)]}  # fmt: skip
    assert taken == expected_calls[shared]
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])
    leaves = [x, *[p for p in block.parameters() if p.requires_grad]]
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy, allow_unused=True)
    expected_grads = torch.autograd.grad(expected, leaves, dy, allow_unused=True)
    for grad, expected_grad in zip(grads, expected_grads):
        if expected_grad is None:
            assert grad is None
        else:
            torch.testing.assert_close(grad, expected_grad, **TOLERANCES[torch.float64])


@pytest.mark.parametrize("shared", ["gated", "ungated", "none"])
def test_moe_block_sums_its_inputs_gradient_inside_the_projections_gemms(shared):
    # The router's, the shared expert's and the routed experts' gradients of the input meet inside the two nodes'
    # backward GEMMs: autograd adds no two [T, D] tensors (it did for the shared and routed experts' before).
    from torch.profiler import profile

    block, x = moe_block(shared)
    out, _ = block(x)
    with profile(record_shapes=True) as prof:
        torch.autograd.grad(out, [x], torch.randn_like(out))
    token_rows = [x.shape[1], IN_FEATURES]
    adds = [e.input_shapes for e in prof.events() if e.name in ("aten::add", "aten::add_")]
    assert not [shapes for shapes in adds if shapes[:2] == [token_rows, token_rows]]
    # One GEMM of x's gradient a projection (router, shared gate, shared expert's gate and up), each adding to it.
    gemms = [e.input_shapes[0] for e in prof.events() if e.name in ("aten::addmm", "aten::addmm_")]
    assert gemms.count(token_rows) == {"gated": 4, "ungated": 3, "none": 1}[shared]


@pytest.mark.parametrize("hooked", [False, True], ids=["node", "hooked-projection"])
def test_swiglu_handing_x_on_matches_its_plain_call(hooked):
    # SwiGLU(x, hand_on=True) -> (its output, x handed on): the output and every gradient (x's later uses' included)
    # as the plain call with x used again; x is handed on by the gate and up node, or is x itself where a hook on a
    # projection keeps the node from applying.
    from moe_tune.engine.model.blocks import SwiGLU

    torch.manual_seed(3)
    mlp = SwiGLU(IN_FEATURES, 10).double()
    if hooked:
        mlp.up_proj.register_forward_hook(lambda module, args, out: None)
    x = make_x((2, 5), "contiguous", torch.float64).requires_grad_()
    scale = torch.rand(2, 5, 1, dtype=torch.float64, requires_grad=True)
    add_to = torch.randn(2, 5, IN_FEATURES, dtype=torch.float64, requires_grad=True)
    later = torch.randn(2, 5, IN_FEATURES, dtype=torch.float64)
    out, x_on = mlp(x, scale=scale, add_to=add_to, hand_on=True)
    assert (x_on is x) == hooked and torch.equal(x_on, x)
    expected = mlp(x, scale=scale, add_to=add_to)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])
    leaves = [x, scale, add_to, *mlp.parameters()]
    dy = torch.randn_like(out)
    grads = torch.autograd.grad((out * dy).sum() + (x_on * later).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * dy).sum() + (x * later).sum(), leaves)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, **TOLERANCES[torch.float64])


ROUTED_EXPERTS_SCOPE = "routed experts"


def routed_experts_marked(block):
    """Run a MoE block's routed experts inside a profiler scope (inside_routed_experts finds it); nothing for others."""
    experts = getattr(block, "experts", None)
    if experts is None:
        return contextlib.nullcontext()
    return method_in_range(experts, "forward", ROUTED_EXPERTS_SCOPE)


def inside_routed_experts(event) -> bool:
    while event is not None:
        if event.name == ROUTED_EXPERTS_SCOPE:
            return True
        event = event.cpu_parent
    return False


@pytest.mark.parametrize("shared", ["gated", "ungated", "none", "dense"])
def test_channel_mixers_add_the_residual_inside_their_ops(shared):
    # mixer(x, residual=r) = mixer(x) + r, every gradient (r's is y's) as that sum's, with no add kernel of [T, D]
    # forward: the residual joins the shared expert's down GEMM, the routed experts' slot sum or the dense MLP's down
    # GEMM.
    from torch.profiler import profile

    from moe_tune.engine.model.moe import DenseMLP

    if shared == "dense":
        torch.manual_seed(2)
        block, x = DenseMLP(IN_FEATURES, 10).double(), torch.randn(1, 9, IN_FEATURES, dtype=torch.float64)
        x.requires_grad_()
    else:
        block, x = moe_block(shared)
    residual = torch.randn_like(x).requires_grad_()
    with profile(record_shapes=True) as prof, routed_experts_marked(block):
        out, aux = block(x, residual=residual)
    token_rows = [[1, x.shape[1], IN_FEATURES], [x.shape[1], IN_FEATURES]]
    # Outside the routed experts' op (whose reference adds its add_to where the kernels add it in their slot sum).
    adds = [e.input_shapes[:2] for e in prof.events() if e.name in ("aten::add", "aten::add_")
            and not inside_routed_experts(e)]  # fmt: skip
    assert not [shapes for shapes in adds if shapes[0] in token_rows and shapes[1] in token_rows]
    # Out of place, addmm copies its addend first: a MoE block's GEMMs take no [T, D] addend (the slot sum adds the
    # residual), a dense MLP's down GEMM takes it.
    copied = [e for e in prof.events() if e.name == "aten::addmm" and e.input_shapes[0] in token_rows]
    assert len(copied) == (shared == "dense")
    expected, expected_aux = block(x)
    expected = expected + residual
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])
    torch.testing.assert_close(aux, expected_aux, **TOLERANCES[torch.float64])
    leaves = [x, residual, *[p for p in block.parameters() if p.requires_grad]]
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    for grad, expected_grad in zip(grads, torch.autograd.grad(expected, leaves, dy), strict=True):
        torch.testing.assert_close(grad, expected_grad, **TOLERANCES[torch.float64])
    assert torch.equal(grads[1], dy)
