"""cross_entropy's Triton kernel path on CUDA: bf16 loss and every gradient against the fp32 full-logits reference at
the benchmark shape and at odd ones, the kernel path taken by auto dispatch (not the torch passes), NaN-filled
buffers with guarded ends, bitwise reruns, and agreement with the torch path.

Shapes: N tokens, D model dim, V vocabulary; the benchmark model's loss (B2 T4096 = 8192 tokens, D 2048, V 32000).
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
import torch
from kernel_fixtures import fail_if_interpreted, guarded_outputs

from moe_tune.ops.cross_entropy import kernels, linear_cross_entropy
from moe_tune.ops.cross_entropy.autograd import LinearCrossEntropyFunction, default_chunk_size
from moe_tune.ops.cross_entropy.reference import linear_cross_entropy_ref

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
IGNORE = -100
# bf16 against the fp32 reference on the same rounded inputs, relative to the reference (the loss) or to its largest
# entry (the gradients), as tests/ops/test_cross_entropy.py's LOW_PRECISION_TOLERANCES: the logits are rounded once to
# bf16 before the fp32 softmax, dL/dz once more, then the gradient matmuls round their outputs.
LOSS_REL_TOL = 4e-4
GRAD_REL_TOL = 1.6e-2
# Past the end of the per-token loss buffer and of every chunk's logits.
GUARD_ELEMENTS = 1 << 16

# (N, D, V, reduction)
CASES = {
    "bench_N8192_V32000": (8192, 2048, 32000, "mean"),
    # A Qwen3-size vocabulary, not a multiple of BLOCK_V, over an N that is not a multiple of the chunk.
    "N1000_V151936": (1000, 2048, 151936, "mean"),
    # A small odd vocabulary: one chunk, one partial tile per row.
    "N1000_V1001_sum": (1000, 2048, 1001, "sum"),
}


@pytest.fixture
def kernel_path(monkeypatch):
    """Auto dispatch on CUDA tensors, the kernels compiled for the GPU; counts the kernel's launches."""
    fail_if_interpreted(kernels._cross_entropy_chunk_kernel)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launches = []
    real_chunk_fwd = kernels.cross_entropy_chunk_fwd

    def counting_chunk_fwd(logits_CV, *args):
        launches.append(tuple(logits_CV.shape))
        return real_chunk_fwd(logits_CV, *args)

    monkeypatch.setattr(kernels, "cross_entropy_chunk_fwd", counting_chunk_fwd)
    return launches


guarded = guarded_outputs(kernels, GUARD_ELEMENTS, alloc_name="alloc")


def _case(num_tokens, model_dim, vocab, seed=0):
    """bf16 hidden [N, D] and weight [V, D] needing gradients (logits of order a few units), labels [N] with both
    end class ids and every seventh token ignored."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(num_tokens, model_dim, generator=gen, device=DEVICE).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, model_dim, generator=gen, device=DEVICE) * model_dim**-0.5).bfloat16()
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen, device=DEVICE)
    labels[0], labels[1] = vocab - 1, 0
    labels[2::7] = IGNORE
    return hidden, weight.requires_grad_(), labels


def _loss_and_grads(fn, hidden, weight, labels, **kwargs):
    loss = fn(hidden, weight, labels, **kwargs)
    return loss.detach(), torch.autograd.grad(loss, (hidden, weight))


def _rel(actual, expected):
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_path_matches_fp32_reference_bf16(kernel_path, guarded, case):
    num_tokens, model_dim, vocab, reduction = case
    hidden, weight, labels = _case(num_tokens, model_dim, vocab)
    loss, grads = _loss_and_grads(linear_cross_entropy, hidden, weight, labels, reduction=reduction)
    torch.cuda.synchronize()
    guarded.check()
    # The kernel path, not the torch passes: one launch per chunk of the bf16 budget's rows.
    rows = default_chunk_size(num_tokens, vocab, bytes_per_logit=2)
    assert len(kernel_path) == -(-num_tokens // rows) and kernel_path[0] == (rows, vocab)
    ref = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, *ref, labels, reduction=reduction)
    assert loss.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)
    assert abs(float(loss) - float(ref_loss)) <= LOSS_REL_TOL * abs(float(ref_loss))
    errors = {name: _rel(g, r) for name, g, r in zip(("hidden", "weight"), grads, ref_grads)}
    assert all(error <= GRAD_REL_TOL for error in errors.values()), errors


def test_kernel_path_reruns_are_bitwise_equal(kernel_path):
    hidden, weight, labels = _case(1000, 2048, 151936)
    first = _loss_and_grads(linear_cross_entropy, hidden, weight, labels)
    second = _loss_and_grads(linear_cross_entropy, hidden, weight, labels)
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_kernel_path_agrees_with_the_torch_path(kernel_path):
    # Both compute dL/dz = softmax - onehot in fp32 from the same bf16 logits and round it once to bf16; they differ
    # by the order of logsumexp's sums, the GEMMs' chunking (the kernel path takes twice the rows) and exp's rounding.
    num_tokens, model_dim, vocab = 8192, 2048, 32000
    hidden, weight, labels = _case(num_tokens, model_dim, vocab)
    results = {}
    for use_kernel in (True, False):
        rows = default_chunk_size(num_tokens, vocab, 2 if use_kernel else 4)
        results[use_kernel] = _loss_and_grads(
            lambda h, w, y, use_kernel=use_kernel, rows=rows: LinearCrossEntropyFunction.apply(
                h, w, y, None, IGNORE, "mean", rows, use_kernel
            ),
            hidden, weight, labels,
        )  # fmt: skip
    assert len(kernel_path) == 2
    (loss, grads), (torch_loss, torch_grads) = results[True], results[False]
    assert abs(float(loss) - float(torch_loss)) <= 1e-6 * abs(float(torch_loss))
    errors = {name: _rel(g, r) for name, g, r in zip(("hidden", "weight"), grads, torch_grads)}
    assert all(error <= GRAD_REL_TOL for error in errors.values()), errors
