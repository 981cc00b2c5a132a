"""cross_entropy ops: the chunked linear cross-entropy against F.cross_entropy on full logits (loss and every
gradient), its memory property (no [N, V] tensor), the skipped gradients, dispatch, errors; its Triton kernel path
in the interpreter (fp32 and fp16, odd shapes, NaN-filled buffers with guarded ends, bitwise reruns, dispatch); and
the LM loss of engine/model/model.py that uses it.

Shapes: N tokens, D model dim, V vocabulary, C chunk rows.
"""

from __future__ import annotations

import logging

import pytest
from kernel_fixtures import forced_kernel_path, guarded_outputs
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    import torch.nn.functional as F
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    import moe_tune.ops.cross_entropy as ce_op
    from moe_tune.ops.cross_entropy import autograd as chunked
    from moe_tune.ops.cross_entropy import cross_entropy, kernels, linear_cross_entropy
    from moe_tune.ops.cross_entropy.autograd import (
        CHUNK_LOGITS_BYTES,
        MIN_CHUNK_ROWS,
        LinearCrossEntropyFunction,
        default_chunk_size,
    )
    from moe_tune.ops.cross_entropy.reference import linear_cross_entropy_ref

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

IGNORE = -100
# A grad_output other than 1: backward must scale the gradients saved by the forward.
GRAD_SCALE = 0.37

# One table per dtype. fp64 and fp32 compute in their own dtype on both paths and differ only by summation order
# (the chunked path sums the loss and grad weight chunk by chunk).
EXACT_TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=2e-6, rtol=1e-5),
}
# Low-precision inputs against the fp32 reference on the same (rounded) inputs, relative to the reference's largest
# magnitude: the logits are rounded once to the inputs' dtype before the fp32 softmax (as nn.Linear + .float()
# does), the gradients once more after their matmuls. Gradients: four rounding steps (bf16 2^-8, fp16 2^-11;
# measured 1.7 and 1.3); the loss averages the logits' rounding out (measured 5e-5 and 1.3e-5).
LOW_PRECISION_TOLERANCES = {
    torch.float16: dict(loss=1e-4, grad=2e-3),
    torch.bfloat16: dict(loss=4e-4, grad=1.6e-2),
}

# (N, D, V, chunk_size)
SHAPES = [
    pytest.param(37, 16, 50, 8, id="N_not_multiple_of_chunk"),  # last chunk has 5 rows
    pytest.param(5, 16, 50, 64, id="chunk_larger_than_N"),  # one chunk, shorter than chunk_size
    pytest.param(48, 16, 50, 16, id="N_multiple_of_chunk"),
    pytest.param(7, 8, 11, 1, id="chunk_of_one_row"),
]
LABEL_PATTERNS = [
    pytest.param("all", id="all_labelled"),
    pytest.param("some_ignored", id="some_ignored"),
    # Whole chunks ignored: a chunk with nothing labelled must still write zero gradient rows.
    pytest.param("first_half_ignored", id="first_half_ignored"),
]


def _labels(pattern: str, num_tokens: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, vocab, (num_tokens,), generator=generator)
    if pattern == "some_ignored":
        labels[::3] = IGNORE
    elif pattern == "first_half_ignored":
        labels[: num_tokens // 2] = IGNORE
    elif pattern == "none_labelled":
        labels[:] = IGNORE
    return labels


def _case(num_tokens, model_dim, vocab, dtype, pattern="some_ignored", has_bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Logits of order a few units: a softmax that is neither flat nor one-hot.
    hidden = torch.randn(num_tokens, model_dim, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, model_dim, generator=gen, dtype=torch.float64) / model_dim**0.5).to(dtype)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype) if has_bias else None
    return hidden, weight, bias, _labels(pattern, num_tokens, vocab, gen)


def _loss_and_grads(fn, hidden, weight, bias, labels, grad_scale=GRAD_SCALE, **kwargs):
    """fn's loss and the gradients of grad_scale * loss w.r.t. the inputs that require grad (None elsewhere)."""
    inputs = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in (hidden, weight, bias)]
    loss = fn(inputs[0], inputs[1], labels, inputs[2], **kwargs)
    (loss * grad_scale).backward()
    return loss.detach(), [None if t is None else t.grad for t in inputs]


def _full_logits_ce(hidden, weight, labels, bias, reduction="mean", ignore_index=IGNORE):
    """The oracle: F.cross_entropy on the full logits, in the inputs' dtype."""
    return F.cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def nan_fresh_outputs(monkeypatch):
    """torch.empty_like fills with NaN while a test runs: a gradient row the op forgets to write fails it."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: real_empty_like(*args, **kwargs).fill_(torch.nan))


def _requiring_grad(*tensors):
    return [None if t is None else t.requires_grad_() for t in tensors]


@pytest.mark.parametrize("num_tokens, model_dim, vocab, chunk_size", SHAPES)
@pytest.mark.parametrize("pattern", LABEL_PATTERNS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")])
def test_linear_cross_entropy_matches_full_logits(
    num_tokens, model_dim, vocab, chunk_size, pattern, reduction, dtype, nan_fresh_outputs
):
    hidden, weight, bias, labels = _case(num_tokens, model_dim, vocab, dtype, pattern)
    _requiring_grad(hidden, weight, bias)
    loss, grads = _loss_and_grads(
        linear_cross_entropy, hidden, weight, bias, labels, reduction=reduction, chunk_size=chunk_size
    )
    ref_loss, ref_grads = _loss_and_grads(_full_logits_ce, hidden, weight, bias, labels, reduction=reduction)
    tol = EXACT_TOLERANCES[dtype]
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, **tol)
    for name, grad, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert grad.dtype == dtype, name
        torch.testing.assert_close(grad, ref, **tol, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_low_precision_inputs_against_fp32_reference(dtype, reduction, nan_fresh_outputs):
    num_tokens, model_dim, vocab, chunk_size = 70, 32, 97, 16
    hidden, weight, bias, labels = _case(num_tokens, model_dim, vocab, dtype)
    _requiring_grad(hidden, weight, bias)
    loss, grads = _loss_and_grads(
        linear_cross_entropy, hidden, weight, bias, labels, reduction=reduction, chunk_size=chunk_size
    )
    # The reference on the same rounded values, upcast: what the loss would be without low-precision matmuls.
    up = [t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, *up, labels, reduction=reduction)
    tol = LOW_PRECISION_TOLERANCES[dtype]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, atol=tol["loss"] * ref_loss.abs().item(), rtol=0)
    for name, grad, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert grad.dtype == dtype, name
        torch.testing.assert_close(grad.float(), ref, atol=tol["grad"] * ref.abs().max().item(), rtol=0,
                                   msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_nothing_labelled_gives_zero_loss_and_zero_gradients(reduction):
    # The choice documented in the op: "mean" divides by max(labelled, 1) as the data-parallel trainer does, so a
    # row without labels contributes 0, not NaN (F.cross_entropy's mean is 0 / 0 there).
    hidden, weight, bias, labels = _case(20, 8, 13, torch.float64, "none_labelled")
    _requiring_grad(hidden, weight, bias)
    for fn in (linear_cross_entropy, linear_cross_entropy_ref):
        loss, grads = _loss_and_grads(fn, hidden, weight, bias, labels, reduction=reduction)
        assert loss.item() == 0.0
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    assert _full_logits_ce(hidden, weight, labels, bias, reduction="sum").item() == 0.0
    assert _full_logits_ce(hidden, weight, labels, bias, reduction="mean").isnan()


def test_cross_entropy_on_logits_has_the_same_conventions():
    # The model's path for heads the chunked op cannot take: the same loss from logits that exist.
    hidden, weight, bias, labels = _case(30, 8, 13, torch.float64)
    logits = F.linear(hidden, weight, bias)
    for reduction in ("mean", "sum"):
        torch.testing.assert_close(
            cross_entropy(logits, labels, ignore_index=IGNORE, reduction=reduction),
            linear_cross_entropy(hidden, weight, labels, bias, reduction=reduction),
            **EXACT_TOLERANCES[torch.float64],
        )
    labels[:] = IGNORE
    assert cross_entropy(logits, labels).item() == 0.0


class _OutputShapes(TorchDispatchMode):
    """Records the shape (and dtype) of every tensor each aten op returns (views included)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.shapes += [tuple(t.shape) for t in tensors]
        self.dtypes += [t.dtype for t in tensors]
        return out


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


def test_no_tensor_holds_more_than_one_chunk_of_logits(monkeypatch):
    # Sizes chosen so that N*V exceeds every legitimate tensor: chunk logits C*V, grad weight V*D, grad hidden N*D.
    num_tokens, model_dim, vocab, chunk_size = 50, 8, 37, 16
    hidden, weight, bias, labels = _case(num_tokens, model_dim, vocab, torch.float32)
    _requiring_grad(hidden, weight, bias)
    rows_seen = []
    real_chunk_logits = chunked.chunk_logits

    def counting_chunk_logits(hidden_CD, weight_VD, bias_V):
        rows_seen.append(hidden_CD.shape[0])
        return real_chunk_logits(hidden_CD, weight_VD, bias_V)

    monkeypatch.setattr(chunked, "chunk_logits", counting_chunk_logits)
    with _OutputShapes() as recorder:
        linear_cross_entropy(hidden, weight, labels, bias, chunk_size=chunk_size).backward()
    assert rows_seen == [16, 16, 16, 2]
    largest = max(_numel(s) for s in recorder.shapes)
    assert largest == chunk_size * vocab
    assert largest < num_tokens * vocab

    # The check can fail: the full-logits reference makes an [N, V] tensor.
    with _OutputShapes() as recorder:
        linear_cross_entropy_ref(hidden, weight, labels, bias).backward()
    assert (num_tokens, vocab) in recorder.shapes


def test_default_chunk_size_bounds_the_chunk_logits():
    for num_tokens, vocab in [(32768, 151936), (32768, 32000), (1000, 259), (5, 151936), (0, 50)]:
        rows = default_chunk_size(num_tokens, vocab)
        assert rows >= 1
        # Within the budget, unless the minimum row count alone exceeds it.
        assert rows * vocab * 4 <= CHUNK_LOGITS_BYTES or rows <= MIN_CHUNK_ROWS
        num_chunks = -(-num_tokens // rows)
        # Evened out: the last chunk is not a sliver.
        assert num_tokens - (num_chunks - 1) * rows >= rows - num_chunks
    assert default_chunk_size(1000, 259) == 1000  # a small vocabulary: one chunk


def test_frozen_weight_skips_the_weight_gradient():
    # A frozen LM head under LoRA: no [V, D] gradient is ever computed, and grad hidden is unchanged.
    num_tokens, model_dim, vocab = 40, 8, 29
    hidden, weight, _, labels = _case(num_tokens, model_dim, vocab, torch.float32, has_bias=False)
    hidden.requires_grad_()
    with _OutputShapes() as recorder:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=16)
        loss.backward()
    assert weight.grad is None
    assert (vocab, model_dim) not in recorder.shapes
    ref_loss, (ref_grad_hidden, _, _) = _loss_and_grads(_full_logits_ce, hidden, weight, None, labels, grad_scale=1.0)
    torch.testing.assert_close(loss.detach(), ref_loss, **EXACT_TOLERANCES[torch.float32])
    torch.testing.assert_close(hidden.grad, ref_grad_hidden, **EXACT_TOLERANCES[torch.float32])


def test_hidden_without_grad_gets_none():
    num_tokens, model_dim, vocab = 40, 8, 29
    hidden, weight, bias, labels = _case(num_tokens, model_dim, vocab, torch.float32)
    _requiring_grad(weight, bias)
    with _OutputShapes() as recorder:
        linear_cross_entropy(hidden, weight, labels, bias, chunk_size=16).backward()
    assert hidden.grad is None
    assert (num_tokens, model_dim) not in recorder.shapes
    _, (_, ref_grad_weight, ref_grad_bias) = _loss_and_grads(_full_logits_ce, hidden, weight, bias, labels,
                                                             grad_scale=1.0)
    torch.testing.assert_close(weight.grad, ref_grad_weight, **EXACT_TOLERANCES[torch.float32])
    torch.testing.assert_close(bias.grad, ref_grad_bias, **EXACT_TOLERANCES[torch.float32])


def test_no_grad_computes_no_gradients():
    num_tokens, model_dim, vocab = 40, 8, 29
    hidden, weight, bias, labels = _case(num_tokens, model_dim, vocab, torch.float32)
    _requiring_grad(hidden, weight, bias)
    with torch.no_grad(), _OutputShapes() as recorder:
        loss = linear_cross_entropy(hidden, weight, labels, bias, chunk_size=16)
    assert (vocab, model_dim) not in recorder.shapes and (num_tokens, model_dim) not in recorder.shapes
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _full_logits_ce(hidden, weight, labels, bias).detach())


def test_backward_twice_with_retain_graph():
    # backward scales the saved gradients out of place: a second backward sees them unscaled.
    hidden, weight, bias, labels = _case(20, 8, 13, torch.float64)
    _requiring_grad(hidden, weight, bias)
    loss = linear_cross_entropy(hidden, weight, labels, bias, chunk_size=8)
    first = torch.autograd.grad(loss * 2.0, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss * 2.0, (hidden, weight, bias))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_reference_path_when_the_environment_asks(monkeypatch):
    hidden, weight, bias, labels = _case(20, 8, 13, torch.float64)
    calls = []
    monkeypatch.setattr(chunked.LinearCrossEntropyFunction, "apply", lambda *a: calls.append(a) or torch.zeros(()))
    monkeypatch.setenv("MOE_TUNE_KERNELS", "reference")
    _requiring_grad(hidden, weight, bias)
    loss = linear_cross_entropy(hidden, weight, labels, bias)
    assert not calls
    torch.testing.assert_close(loss, _full_logits_ce(hidden, weight, labels, bias))
    # auto and triton take the chunked Function (fp64 with a bias gradient: its torch path, test_kernel_dispatch).
    for mode in ("auto", "triton"):
        monkeypatch.setenv("MOE_TUNE_KERNELS", mode)
        linear_cross_entropy(hidden, weight, labels, bias)
    assert len(calls) == 2


def _error_case():
    return dict(
        hidden=torch.zeros(6, 4),
        weight=torch.zeros(9, 4),
        labels=torch.zeros(6, dtype=torch.int64),
        bias=None,
    )


@pytest.mark.parametrize(
    "change, match",
    [
        pytest.param(dict(hidden=torch.zeros(6)), r"hidden: shape \(6,\) .* must be a float \[N, D\]",
                     id="hidden_rank"),
        pytest.param(dict(hidden=torch.zeros(6, 4, dtype=torch.int64)), r"hidden: .* must be a float", id="hidden_int"),
        pytest.param(dict(weight=torch.zeros(9, 5)), r"weight: shape \(9, 5\) must be \[V, D\] with D = 4",
                     id="weight_D"),
        pytest.param(dict(weight=torch.zeros(9, 4, dtype=torch.float64)), r"weight: dtype .* must match hidden",
                     id="weight_dtype"),
        pytest.param(dict(bias=torch.zeros(8)), r"bias: shape \(8,\) must be \[V\] with V = 9", id="bias_shape"),
        pytest.param(dict(bias=torch.zeros(9, dtype=torch.float16)), r"bias: dtype .* must match", id="bias_dtype"),
        pytest.param(dict(labels=torch.zeros(6, dtype=torch.int32)), r"labels: dtype torch.int32 must be int64",
                     id="labels_dtype"),
        pytest.param(dict(labels=torch.zeros(5, dtype=torch.int64)), r"labels: shape \(5,\) must be \[N\] with N = 6",
                     id="labels_shape"),
        pytest.param(dict(labels=torch.tensor([0, 1, 9, -100, 2, 3])), r"labels: values must be in \[0, V\) = \[0, 9\)",
                     id="labels_range"),
        pytest.param(dict(labels=torch.tensor([0, 1, -1, -100, 2, 3])), r"found min -1", id="labels_negative"),
        pytest.param(dict(reduction="none"), r"reduction \('none'\) must be one of mean, sum", id="reduction"),
        pytest.param(dict(chunk_size=0), r"chunk_size \(0\) must be a positive int", id="chunk_zero"),
    ],
)
def test_errors_name_the_tensor_and_the_rule(change, match):
    args = _error_case() | change
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**args)


# The Triton kernel path, in the interpreter: fp32 and fp16 (bf16 arithmetic is NaN there; bf16 runs on the GPU,
# tests/gpu/test_cross_entropy_gpu.py).

# Past the end of the per-token loss buffer and of every chunk's logits: more than a whole BLOCK_V tile.
GUARD_ELEMENTS = 2 * kernels.BLOCK_V

kernel_path = forced_kernel_path(kernels, "_cross_entropy_chunk_kernel", on_gpu=False)
guarded = guarded_outputs(kernels, GUARD_ELEMENTS, alloc_name="alloc")

# (N, D, V, chunk_size)
KERNEL_SHAPES = [
    pytest.param(37, 16, 50, 8, id="V_under_block_N_not_multiple_of_chunk"),  # one partial tile; last chunk 5 rows
    pytest.param(13, 8, 2 * kernels.BLOCK_V + 905, 5, id="V_not_multiple_of_block"),  # three tiles, the last partial
    pytest.param(6, 8, kernels.BLOCK_V, 4, id="V_one_full_block"),  # no masked column at all
    pytest.param(7, 8, 11, 1, id="chunk_of_one_row"),  # every chunk a single program
    pytest.param(5, 16, 50, 64, id="chunk_larger_than_N"),
]
KERNEL_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


def _kernel_labels(num_tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random labels with the first and last class ids present, every third token from the third ignored."""
    labels = torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    labels[0] = vocab - 1
    if num_tokens > 1:
        labels[1] = 0
    labels[2::3] = IGNORE
    return labels


def _assert_matches_reference(loss, grads, hidden, weight, bias, labels, reduction):
    """The kernel path's loss and gradients (None where not needed) against the full logits, by the tables above:
    fp32 against F.cross_entropy in fp32, fp16 against the fp32 reference on the same rounded inputs."""
    dtype = hidden.dtype
    if dtype == torch.float32:
        ref_loss, ref_grads = _loss_and_grads(_full_logits_ce, hidden, weight, bias, labels, reduction=reduction)
        torch.testing.assert_close(loss, ref_loss, **EXACT_TOLERANCES[dtype])
    else:
        up = [None if t is None else t.detach().float().requires_grad_(t.requires_grad) for t in (hidden, weight, bias)]
        ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, *up, labels, reduction=reduction)
        tol = LOW_PRECISION_TOLERANCES[dtype]
        torch.testing.assert_close(loss, ref_loss, atol=tol["loss"] * ref_loss.abs().item(), rtol=0)
    assert loss.dtype == torch.float32
    for name, grad, ref in zip(("hidden", "weight"), grads, ref_grads):
        assert (grad is None) == (ref is None), name
        if grad is None:
            continue
        assert grad.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(grad, ref, **EXACT_TOLERANCES[dtype], msg=lambda m, name=name: f"{name}: {m}")
        else:
            atol = LOW_PRECISION_TOLERANCES[dtype]["grad"] * ref.abs().max().item()
            torch.testing.assert_close(grad.float(), ref, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("num_tokens, model_dim, vocab, chunk_size", KERNEL_SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_path_matches_full_logits(
    guarded, num_tokens, model_dim, vocab, chunk_size, reduction, dtype, nan_fresh_outputs
):
    # A frozen bias: added by the logits' matmul, no bias gradient (that case takes the torch path).
    hidden, weight, bias, _ = _case(num_tokens, model_dim, vocab, dtype)
    labels = _kernel_labels(num_tokens, vocab)
    _requiring_grad(hidden, weight)
    loss, grads = _loss_and_grads(
        linear_cross_entropy, hidden, weight, bias, labels, reduction=reduction, chunk_size=chunk_size
    )
    guarded.check()
    num_chunks = -(-num_tokens // chunk_size)
    # The per-token losses, then one logits buffer per chunk: the kernel path ran and wrote nothing past them.
    assert len(guarded.buffers) == 1 + num_chunks and guarded.buffers[0][2] == (num_tokens,)
    assert all(shape[1] == vocab for _, _, shape in guarded.buffers[1:])
    _assert_matches_reference(loss, grads[:2], hidden, weight, bias, labels, reduction)


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_path_computes_only_the_needed_gradient(guarded, frozen, dtype, nan_fresh_outputs):
    num_tokens, model_dim, vocab = 23, 8, 37
    hidden, weight, _, _ = _case(num_tokens, model_dim, vocab, dtype, has_bias=False)
    labels = _kernel_labels(num_tokens, vocab)
    trained = _requiring_grad(weight if frozen == "hidden" else hidden)[0]
    with _OutputShapes() as recorder:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
        (loss * GRAD_SCALE).backward()
    guarded.check()
    assert (hidden if frozen == "hidden" else weight).grad is None
    # A [V, D] product only for a trained weight, an [N, D] one only for a trained hidden.
    assert ((vocab, model_dim) in recorder.shapes) == (frozen == "hidden")
    assert ((num_tokens, model_dim) in recorder.shapes) == (frozen == "weight")
    grads = [trained.grad, None] if frozen == "weight" else [None, trained.grad]
    _assert_matches_reference(loss.detach(), grads, hidden, weight, None, labels, "mean")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_path_under_no_grad_writes_only_the_loss(guarded, dtype):
    hidden, weight, bias, _ = _case(19, 8, 29, dtype)
    labels = _kernel_labels(19, 29)
    _requiring_grad(hidden, weight)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, bias, chunk_size=8)
        # The chunks' logits are left as the matmul wrote them: no gradient pass over them.
        for (flat, numel, shape), start in zip(guarded.buffers[1:], range(0, 19, 8), strict=True):
            expected = chunked.chunk_logits(hidden[start : start + shape[0]], weight, bias)
            assert torch.equal(flat[:numel].view(shape), expected)
    guarded.check()
    assert not loss.requires_grad
    ref_loss = linear_cross_entropy_ref(*[t.detach().float() for t in (hidden, weight)], labels, bias.float())
    if dtype == torch.float32:
        torch.testing.assert_close(loss, ref_loss, **EXACT_TOLERANCES[dtype])
    else:
        atol = LOW_PRECISION_TOLERANCES[dtype]["loss"] * ref_loss.abs().item()
        torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_path_with_nothing_labelled_gives_zero_loss_and_zero_gradients(guarded, reduction, dtype):
    hidden, weight, _, labels = _case(20, 8, 13, dtype, "none_labelled", has_bias=False)
    _requiring_grad(hidden, weight)
    loss, grads = _loss_and_grads(linear_cross_entropy, hidden, weight, None, labels, reduction=reduction,
                                  chunk_size=8)  # fmt: skip
    guarded.check()
    assert loss.item() == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads[:2])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_path_agrees_with_the_torch_path(kernel_path, dtype):
    # The same dL/dz: softmax - onehot in fp32, rounded once to the inputs' dtype, so the paths differ only by
    # the order of the row sums in logsumexp. Bounds: fp32 a few ulps; fp16 one rounding step of dL/dz (2^-11)
    # where the two land on either side of a rounding boundary. Measured: loss 0 and 8e-8 relative, gradients
    # 1.5e-7 (fp32) and 4.2e-6 (fp16) of the largest entry.
    num_tokens, model_dim, vocab, chunk_size = 40, 16, 300, 16
    hidden, weight, _, _ = _case(num_tokens, model_dim, vocab, dtype, has_bias=False)
    labels = _kernel_labels(num_tokens, vocab)
    _requiring_grad(hidden, weight)
    results = {}
    for use_kernel in (True, False):
        apply = lambda h, w, y, b, use_kernel=use_kernel: LinearCrossEntropyFunction.apply(  # noqa: E731
            h, w, y, b, IGNORE, "mean", chunk_size, use_kernel
        )
        results[use_kernel] = _loss_and_grads(apply, hidden, weight, None, labels)
    (loss, grads), (torch_loss, torch_grads) = results[True], results[False]
    torch.testing.assert_close(loss, torch_loss, atol=0, rtol=1e-6)
    grad_tolerance = 1e-6 if dtype == torch.float32 else 5e-4
    for grad, ref in zip(grads[:2], torch_grads[:2]):
        torch.testing.assert_close(grad.float(), ref.float(), atol=grad_tolerance * ref.abs().max().item(), rtol=0)


def test_kernel_path_reruns_are_bitwise_equal(kernel_path):
    hidden, weight, bias, _ = _case(29, 16, kernels.BLOCK_V + 77, torch.float16)
    labels = _kernel_labels(29, kernels.BLOCK_V + 77)
    _requiring_grad(hidden, weight)
    first = _loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_size=8)
    second = _loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_size=8)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1][:2], second[1][:2]))


def test_kernel_path_holds_one_chunk_of_logits_in_the_inputs_dtype(kernel_path):
    num_tokens, model_dim, vocab, chunk_size = 50, 8, 37, 16
    hidden, weight, _, labels = _case(num_tokens, model_dim, vocab, torch.float16, has_bias=False)
    _requiring_grad(hidden, weight)
    with _OutputShapes() as recorder:
        linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size).backward()
    # The interpreter copies each kernel argument's bytes to the host and back (uint8): not the op's tensors.
    floats = [(s, d) for s, d in zip(recorder.shapes, recorder.dtypes) if d.is_floating_point]
    assert max(_numel(s) for s, _ in floats) == chunk_size * vocab
    # No fp32 copy of a chunk: every [C, V] tensor is fp16 (the chunk's logits, then dL/dz in place).
    assert {d for s, d in floats if s[-1:] == (vocab,) and _numel(s) > vocab} == {torch.float16}


def test_kernel_path_chunks_hold_the_budget_in_the_inputs_dtype(kernel_path, monkeypatch):
    # A budget of 10 fp32 rows: the torch path takes 10 rows per chunk, the kernel path at fp16 twice that.
    num_tokens, model_dim, vocab = 40, 8, 50
    monkeypatch.setattr(chunked, "CHUNK_LOGITS_BYTES", 10 * vocab * 4)
    monkeypatch.setattr(chunked, "MIN_CHUNK_ROWS", 1)
    rows_seen = []
    real_chunk_logits = chunked.chunk_logits

    def counting_chunk_logits(hidden_CD, *args):
        rows_seen.append(hidden_CD.shape[0])
        return real_chunk_logits(hidden_CD, *args)

    monkeypatch.setattr(chunked, "chunk_logits", counting_chunk_logits)
    for dtype, bias_grad, expected in [
        (torch.float16, False, [20, 20]),
        (torch.float32, False, [10, 10, 10, 10]),
        # A bias gradient: the torch path and its fp32 rows.
        (torch.float16, True, [10, 10, 10, 10]),
    ]:
        rows_seen.clear()
        hidden, weight, bias, labels = _case(num_tokens, model_dim, vocab, dtype)
        _requiring_grad(hidden, weight, bias if bias_grad else None)
        linear_cross_entropy(hidden, weight, labels, bias)
        assert rows_seen == expected, (dtype, bias_grad)


def test_default_chunk_size_counts_the_bytes_of_the_held_logits():
    for num_tokens, vocab in [(32768, 151936), (8192, 32000), (5, 151936)]:
        fp32_rows = default_chunk_size(num_tokens, vocab)
        bf16_rows = default_chunk_size(num_tokens, vocab, bytes_per_logit=2)
        assert bf16_rows * vocab * 2 <= CHUNK_LOGITS_BYTES or bf16_rows <= MIN_CHUNK_ROWS
        assert fp32_rows <= bf16_rows <= max(2 * fp32_rows, num_tokens)
    # The benchmark shape: four chunks of fp32 logits, two of bf16 ones.
    assert default_chunk_size(8192, 32000) == 2048 and default_chunk_size(8192, 32000, 2) == 4096


def _path_spies(monkeypatch) -> dict[str, int]:
    """Counts the chunk loops each path runs."""
    calls = {"kernel": 0, "torch": 0}
    for name, key in (("_kernel_chunks", "kernel"), ("_torch_chunks", "torch")):
        real = getattr(chunked, name)

        def spy(*args, real=real, key=key):
            calls[key] += 1
            return real(*args)

        monkeypatch.setattr(chunked, name, spy)
    return calls


@pytest.mark.parametrize(
    "mode, dtype, bias_grad, expected",
    [
        pytest.param("auto", torch.float32, False, "torch", id="auto_cpu_torch"),  # CPU tensors: no kernel under auto
        pytest.param("triton", torch.float32, False, "kernel", id="triton_fp32_kernel"),
        pytest.param("triton", torch.float16, False, "kernel", id="triton_fp16_kernel"),
        pytest.param("triton", torch.float32, True, "torch", id="triton_bias_grad_torch"),  # dL/db: the torch path
        pytest.param("triton", torch.float64, False, "torch", id="triton_fp64_torch"),  # no fp64 kernel
    ],
)
def test_kernel_dispatch(monkeypatch, kernel_path, mode, dtype, bias_grad, expected):
    monkeypatch.setenv("MOE_TUNE_KERNELS", mode)
    calls = _path_spies(monkeypatch)
    hidden, weight, bias, labels = _case(20, 8, 13, dtype)
    _requiring_grad(hidden, weight, bias if bias_grad else None)
    loss, grads = _loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_size=8)
    assert calls == {"kernel": int(expected == "kernel"), "torch": int(expected == "torch")}
    assert (grads[2] is None) == (not bias_grad)
    # The path's numbers are checked above; here only that it gives the loss.
    ref_loss = linear_cross_entropy_ref(*[t.detach().double() for t in (hidden, weight)], labels, bias.double())
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-3 * ref_loss.item(), rtol=0)


def test_kernel_dispatch_logs_the_path_once(monkeypatch, kernel_path, caplog):
    monkeypatch.setattr(ce_op, "_logged_paths", set())
    hidden, weight, _, labels = _case(20, 8, 13, torch.float32, has_bias=False)
    with caplog.at_level(logging.INFO, logger="moe_tune.ops"):
        for _ in range(2):
            linear_cross_entropy(hidden, weight, labels)
        monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
        linear_cross_entropy(hidden, weight, labels)
    assert [r.getMessage() for r in caplog.records] == [
        "linear_cross_entropy: chunked triton path (MOE_TUNE_KERNELS=triton)",
        "linear_cross_entropy: chunked path (MOE_TUNE_KERNELS=auto)",
    ]


def test_forced_kernel_on_cpu_without_the_interpreter_raises(monkeypatch, kernel_path):
    monkeypatch.delenv("TRITON_INTERPRET")
    hidden, weight, _, labels = _case(6, 4, 9, torch.float32, has_bias=False)
    with pytest.raises(RuntimeError, match="MOE_TUNE_KERNELS=triton but linear_cross_entropy got CPU tensors"):
        linear_cross_entropy(hidden, weight, labels)


# The LM loss of engine/model/model.py: chunked in training, full logits when asked or when the head is not plain.


def _tiny_model():
    from moe_tune.engine.model.model import build_model
    from moe_tune.profiles import load_profile

    return build_model(load_profile("tiny").model)


def _tiny_batch(vocab: int, lengths=(9, 14, 5)):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.roll(ids, -1, 1)
    labels[0, cu[1:] - 1] = IGNORE  # no label across a document end
    return ids, cu, labels


def _model_loss_and_grads(model, ids, cu, labels, **kwargs):
    model.zero_grad()
    out = model(ids, cu, labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_denominator", [None, 7.5])
def test_model_training_loss_is_chunked_and_equals_the_full_logits_loss(loss_denominator):
    model = _tiny_model().train()
    ids, cu, labels = _tiny_batch(model.cfg.vocab_size)
    chunked_out, chunked_grads = _model_loss_and_grads(model, ids, cu, labels, loss_denominator=loss_denominator)
    assert chunked_out.logits is None
    full_out, full_grads = _model_loss_and_grads(model, ids, cu, labels, loss_denominator=loss_denominator,
                                                 return_logits=True)
    assert full_out.logits.shape == (1, ids.shape[1], model.cfg.vocab_size)
    torch.testing.assert_close(chunked_out.lm_loss, full_out.lm_loss, **EXACT_TOLERANCES[torch.float32])
    assert chunked_grads.keys() == full_grads.keys() and "lm_head.weight" in chunked_grads
    # fp32 on both paths: they differ by summation order only (measured 2e-7 at most).
    for name in full_grads:
        torch.testing.assert_close(chunked_grads[name], full_grads[name], atol=5e-7, rtol=1e-5, msg=name)


def test_model_eval_returns_logits_and_the_same_loss():
    # align and golden traces read logits from an eval-mode forward with labels.
    model = _tiny_model().eval()
    ids, cu, labels = _tiny_batch(model.cfg.vocab_size)
    with torch.no_grad():
        out = model(ids, cu, labels)
        chunked_out = model(ids, cu, labels, return_logits=False)
    assert out.logits is not None and chunked_out.logits is None
    torch.testing.assert_close(out.lm_loss, chunked_out.lm_loss, **EXACT_TOLERANCES[torch.float32])
    expected = F.cross_entropy(out.logits[0].float(), labels[0], ignore_index=IGNORE)
    torch.testing.assert_close(out.lm_loss, expected, **EXACT_TOLERANCES[torch.float32])


def test_model_loss_with_nothing_labelled_is_zero():
    model = _tiny_model().train()
    ids, cu, labels = _tiny_batch(model.cfg.vocab_size)
    labels[:] = IGNORE
    for return_logits in (False, True):
        assert model(ids, cu, labels, return_logits=return_logits).lm_loss.item() == 0.0


def test_peft_heads_chunk_only_when_a_plain_weight_computes_them():
    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.model.model import plain_linear_head
    from moe_tune.profiles import load_profile

    lora = load_profile("tiny").lora
    # modules_to_save (the tiny profile): the trained copy of the head is a plain linear layer.
    saved = inject_lora(_tiny_model(), lora).train()
    head = saved.base_model.model.lm_head
    assert plain_linear_head(head) is head.modules_to_save["default"]
    ids, cu, labels = _tiny_batch(saved.base_model.model.cfg.vocab_size)
    out = saved(input_ids=ids, cu_seqlens=cu, labels=labels)
    assert out.logits is None
    out.loss.backward()
    assert head.modules_to_save["default"].weight.grad is not None and head.original_module.weight.grad is None
    with saved.disable_adapter():
        assert plain_linear_head(head) is head.original_module

    # LoRA on the head: its output is not one weight's product, so the model computes the full logits.
    adapted = inject_lora(_tiny_model(), lora.model_copy(update={"target_modules": ["lm_head"],
                                                                 "modules_to_save": []})).train()
    assert plain_linear_head(adapted.base_model.model.lm_head) is None
    out = adapted(input_ids=ids, cu_seqlens=cu, labels=labels)
    assert out.logits is not None
    out.loss.backward()
