"""causal_conv_heads: the reference against concatenating, convolving, splitting and repeating; the Triton kernels in
the interpreter against the reference (outputs and every gradient, q/k repeats 1-3, head dims that cut channel
tiles, documents, NaN-filled buffers with guarded ends); input checks.

Shapes: q, k [B, T, Hk*K], v [B, T, Hv*V]; weight [2 Hk K + Hv V, W]; positions [T].
"""

import pytest
from kernel_fixtures import forced_kernel_path, guarded_outputs
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.ops.causal_conv import causal_conv, causal_conv_heads, kernels, kernels_heads
    from moe_tune.ops.causal_conv.reference import causal_conv_heads_ref, causal_conv_ref
    from norm_conv_cases import CONV_TOLERANCES, assert_close_to_reference, causal_conv_case, conv_launch

TOLERANCES = CONV_TOLERANCES
GUARD_ELEMENTS = kernels.BLOCK_T * kernels.BLOCK_C

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels_heads, "_conv_heads_fwd_kernel", on_gpu=False)
guarded = guarded_outputs(kernels, GUARD_ELEMENTS, "alloc")

# (batch, document lengths, key heads, K, value heads, V, width, dilation)
CASES = {
    # Two value heads per key head; q/k 48 channels (under one 128-channel tile), v 160 (a full and a partial tile).
    "G2": (1, [1, 63, 7, 70], 2, 24, 4, 40, 4, 1),
    # One value head per key head, two rows, dilation 2.
    "G1_B2_dilated": (2, [5, 3, 100], 3, 16, 3, 16, 4, 2),
    # Three value heads per key head; K = 40 heads straddle the 128-channel tile edge.
    "G3": (1, [130], 4, 40, 12, 8, 3, 1),
    # Width 1: no tap reaches back.
    "W1_one_key_head": (1, [9, 4], 1, 8, 2, 24, 1, 1),
}


def heads_case(batch, lengths, num_key_heads, key_dim, num_value_heads, value_dim, width, dtype, seed=0):
    channels = 2 * num_key_heads * key_dim + num_value_heads * value_dim
    x, weight, positions, _ = causal_conv_case(batch, lengths, channels, width, dtype, seed=seed)
    q, k, v = (t.detach().contiguous().requires_grad_() for t in x.split(
        [num_key_heads * key_dim, num_key_heads * key_dim, num_value_heads * value_dim], -1))  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = sum(lengths)
    grads = [torch.randn(batch, tokens, num_value_heads, dim, generator=gen).to(dtype)
             for dim in (key_dim, key_dim, value_dim)]  # fmt: skip
    return (q, k, v, weight), positions, grads


def run(op, inputs, positions, grads, dilation, key_dim, value_dim, outputs=(0, 1, 2)):
    out = op(*inputs, positions, key_dim, value_dim, dilation)
    picked = [out[i] for i in outputs]
    return out, torch.autograd.grad(picked, inputs, [grads[i] for i in outputs])


def test_reference_is_the_concatenated_conv_split_into_repeated_heads():
    (q, k, v, weight), positions, _ = heads_case(1, [5, 20], 2, 4, 6, 3, 4, torch.float64)
    yq, yk, yv = causal_conv_heads_ref(q, k, v, weight, positions, 4, 3)
    y = causal_conv_ref(torch.cat([q, k, v], -1), weight, positions, 1)
    assert yq.shape == yk.shape == (1, 25, 6, 4) and yv.shape == (1, 25, 6, 3)
    for head in range(6):
        key_head = head // 3
        torch.testing.assert_close(yq[0, :, head], y[0, :, key_head * 4 : key_head * 4 + 4], rtol=0, atol=0)
        torch.testing.assert_close(yk[0, :, head], y[0, :, 8 + key_head * 4 : 8 + key_head * 4 + 4], rtol=0, atol=0)
        torch.testing.assert_close(yv[0, :, head], y[0, :, 16 + head * 3 : 16 + head * 3 + 3], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(kernel_path, guarded, conv_launch, case, dtype):
    batch, lengths, num_key_heads, key_dim, num_value_heads, value_dim, width, dilation = case
    inputs, positions, grads = heads_case(batch, lengths, num_key_heads, key_dim, num_value_heads, value_dim, width,
                                          dtype)  # fmt: skip
    out, input_grads = run(causal_conv_heads, inputs, positions, grads, dilation, key_dim, value_dim)
    as_fp64 = [t.detach().double().requires_grad_() for t in inputs]
    out_ref, grads_ref = run(causal_conv_heads_ref, as_fp64, positions, [g.double() for g in grads], dilation,
                             key_dim, value_dim)  # fmt: skip
    guarded.check()
    assert all(t.is_contiguous() for t in out)
    names = ("q", "k", "v", "dq", "dk", "dv", "dweight")
    assert_close_to_reference(names, (*out, *input_grads), (*out_ref, *grads_ref), dtype, TOLERANCES[dtype])


@pytest.mark.parametrize("outputs", [(2,), (0, 2)], ids=["v_only", "q_and_v"])
def test_outputs_without_gradient_count_as_zeros(kernel_path, guarded, conv_launch, outputs):
    inputs, positions, grads = heads_case(1, [30, 11], 2, 16, 4, 8, 4, torch.float32)
    _, input_grads = run(causal_conv_heads, inputs, positions, grads, 1, 16, 8, outputs)
    as_fp64 = [t.detach().double().requires_grad_() for t in inputs]
    _, grads_ref = run(causal_conv_heads_ref, as_fp64, positions, [g.double() for g in grads], 1, 16, 8, outputs)
    guarded.check()
    for grad, grad_ref in zip(input_grads, grads_ref, strict=True):
        torch.testing.assert_close(grad.double(), grad_ref, atol=1e-5, rtol=1e-5)


def test_kernel_is_the_plain_conv_kernel_on_the_concatenation(kernel_path):
    # Same taps, same fp32 accumulation and rounding: bit for bit what causal_conv's kernel gives, split into heads.
    (q, k, v, weight), positions, _ = heads_case(1, [40, 25], 2, 16, 4, 24, 4, torch.float16)
    with torch.no_grad():
        yq, yk, yv = causal_conv_heads(q, k, v, weight, positions, 16, 24)
        y = causal_conv(torch.cat([q, k, v], -1), weight, positions)
    yq_ref, yk_ref, yv_ref = (t.reshape(1, 65, -1, d) for t, d in zip(y.split([32, 32, 96], -1), (16, 16, 24)))
    torch.testing.assert_close(yq, yq_ref.repeat_interleave(2, dim=2), rtol=0, atol=0)
    torch.testing.assert_close(yk, yk_ref.repeat_interleave(2, dim=2), rtol=0, atol=0)
    torch.testing.assert_close(yv, yv_ref, rtol=0, atol=0)


def test_frozen_weight_gets_no_gradient(kernel_path, guarded, conv_launch):
    (q, k, v, weight), positions, grads = heads_case(1, [17, 30], 1, 8, 2, 8, 4, torch.float32)
    weight.requires_grad_(False)
    out = causal_conv_heads(q, k, v, weight, positions, 8, 8)
    input_grads = torch.autograd.grad(out, (q, k, v), grads)
    out_ref = causal_conv_heads_ref(q, k, v, weight, positions, 8, 8)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), grads)
    guarded.check()
    for grad, grad_ref in zip(input_grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, grad_ref, **TOLERANCES[torch.float32])
    # The outputs, dq, dk, dv and (two passes) the fp32 dpre: no [tiles, C, W] buffer for dw.
    assert len(guarded.buffers) == (6 if conv_launch.one_pass_backward else 7)


BAD = [
    pytest.param(dict(k=torch.ones(1, 10, 16)), r"k: shape \(1, 10, 16\) must equal q's \(1, 10, 8\)", id="k_shape"),
    pytest.param(dict(v=torch.ones(1, 9, 8)), r"v: shape \(1, 9, 8\) must be \[B, T, C\] with \[B, T\] = \(1, 10\)",
                 id="v_tokens"),
    pytest.param(dict(v=torch.ones(1, 10, 8, dtype=torch.float64)), r"v: torch.float64 on cpu must match q", id="v_dtype"),
    pytest.param(dict(key_head_dim=3), r"key_head_dim \(3\) and value_head_dim \(4\) must divide", id="key_dim"),
    pytest.param(dict(value_head_dim=8, weight=torch.ones(24, 4)), r"v: 1 value heads must be a multiple of q's 2",
                 id="group"),
    pytest.param(dict(weight=torch.ones(23, 4)), r"weight: shape \(23, 4\) must be \[C, W\] with C = 24", id="weight"),
    pytest.param(dict(positions=torch.zeros(9, dtype=torch.long)), r"positions: shape \(9,\) must be \[T\]", id="pos"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", BAD)
def test_bad_inputs_raise(bad, message):
    inputs = dict(q=torch.ones(1, 10, 8), k=torch.ones(1, 10, 8), v=torch.ones(1, 10, 8), weight=torch.ones(24, 4),
                  positions=torch.zeros(10, dtype=torch.long), key_head_dim=4, value_head_dim=4)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        causal_conv_heads(**{**inputs, **bad})
