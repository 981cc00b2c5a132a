"""cross_entropy ops: the chunked linear cross-entropy against F.cross_entropy on full logits (loss and every
gradient), its memory property (no [N, V] tensor), the skipped gradients, dispatch, errors; and the LM loss of
engine/model/model.py that uses it.

Shapes: N tokens, D model dim, V vocabulary, C chunk rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from moe_tune.ops.cross_entropy import autograd as chunked
from moe_tune.ops.cross_entropy import cross_entropy, linear_cross_entropy
from moe_tune.ops.cross_entropy.autograd import CHUNK_LOGITS_BYTES, MIN_CHUNK_ROWS, default_chunk_size
from moe_tune.ops.cross_entropy.reference import linear_cross_entropy_ref

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
    """Records the shape of every tensor each aten op returns (views included)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
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
    # auto and triton take the chunked path: it has no kernel to force, and it runs anywhere.
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
