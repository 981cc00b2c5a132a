"""bench_linear_attention's rows without a GPU (timings faked): the peer before the slow chunk reference in each
case, and a forward that runs out of memory leaves its forward+backward untried (any other refusal does not)."""

import pytest
import torch

from moe_tune.engine.bench import linear_attention_op

OURS = ["moe_tune triton", "moe_tune triton, recomputing in backward"]
REFERENCE = "moe_tune chunk reference (torch small ops)"


def cpu_inputs(B, T, H, K, V, dtype, is_per_channel):
    gen = torch.Generator().manual_seed(0)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen) if is_per_channel
                                       else torch.randn(B, T, H, generator=gen))  # fmt: skip
    inputs = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
                  v=torch.randn(B, T, H, V, generator=gen), g=g,
                  beta=torch.sigmoid(torch.randn(B, T, H, generator=gen)))  # fmt: skip
    return {name: x.requires_grad_() for name, x in inputs.items()}


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError], ids=["out of memory", "another error"])
def test_the_peer_comes_before_the_reference_and_an_out_of_memory_forward_ends_its_row(monkeypatch, error):
    timed = []

    def fake_time(fn, inputs, with_backward):
        timed.append((fn.__name__, with_backward))
        if fn.__name__ == "reference" and not with_backward:
            raise error("CUDA out of memory. Tried to allocate 128.00 MiB." if error is torch.OutOfMemoryError
                        else "refused")  # fmt: skip
        return 1.0, torch.zeros(()), 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(linear_attention_op, "machine_info", lambda is_cuda: {})
    monkeypatch.setattr(linear_attention_op, "make_inputs", cpu_inputs)
    monkeypatch.setattr(linear_attention_op, "fla_op_for", lambda case: (f"chunk_{case}", object()))
    monkeypatch.setattr(linear_attention_op, "_time", fake_time)
    rows = linear_attention_op.bench_linear_attention(batch_size=1, seq_len=8, num_heads=1, head_dim_k=4,
                                                      head_dim_v=4, cases=("gdn", "kda"))  # fmt: skip
    assert [(row["case"], row["impl"]) for row in rows] == [
        *(("gdn", impl) for impl in [*OURS, "fla chunk_gdn", "torch sdpa causal (softmax yardstick)", REFERENCE]),
        *(("kda", impl) for impl in [*OURS, "fla chunk_kda", "fla chunk_kda, disable_recompute", REFERENCE]),
    ]  # fmt: skip
    references = [row for row in rows if row["impl"] == REFERENCE]
    assert len(references) == 2 and all("fwd_ms" not in row for row in references)
    assert timed.count(("reference", False)) == 2
    if error is torch.OutOfMemoryError:
        assert timed.count(("reference", True)) == 0 and all("fwd_bwd_ms" not in row for row in references)
        assert all(row["note"] == "fwd refused: OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 MiB.; "
                   "fwd_bwd not run: the forward alone ran out of memory" for row in references)  # fmt: skip
    else:
        # Another refusal of the forward (a library's, say) still tries the forward+backward.
        assert timed.count(("reference", True)) == 2 and all(row["fwd_bwd_ms"] == 1.0 for row in references)
        assert all(row["note"] == "fwd refused: RuntimeError: refused" for row in references)
    others = [row for row in rows if row["impl"] != REFERENCE]
    assert all(row["fwd_ms"] == 1.0 and row["fwd_bwd_ms"] == 1.0 and "note" not in row for row in others)


def test_fla_kda_runs_both_ways_and_the_gated_delta_rule_its_default(monkeypatch):
    # FLA's KDA at its default (recomputing in backward) and keeping its forward's intermediates (disable_recompute,
    # its faster training pass): the peer's best beside ours. Its gated delta rule has no such option.
    called = []

    def fla_op(**kwargs):
        called.append(sorted(name for name in kwargs if name not in "qkvg" and name != "beta"))
        return (kwargs["v"] * 1.0,)

    def fake_time(fn, inputs, with_backward):
        if fn.__name__.startswith("fla"):
            fn(**inputs)
        return 1.0, torch.zeros(()), 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(linear_attention_op, "machine_info", lambda is_cuda: {})
    monkeypatch.setattr(linear_attention_op, "make_inputs", cpu_inputs)
    monkeypatch.setattr(linear_attention_op, "fla_op_for", lambda case: (f"chunk_{case}", fla_op))
    monkeypatch.setattr(linear_attention_op, "_time", fake_time)
    for case, expected in (("gdn", [["use_qk_l2norm_in_kernel"]]),
                           ("kda", [["use_qk_l2norm_in_kernel"], ["disable_recompute", "use_qk_l2norm_in_kernel"]])):
        called.clear()
        rows = linear_attention_op.bench_linear_attention(batch_size=1, seq_len=8, num_heads=1, head_dim_k=4,
                                                          head_dim_v=4, cases=(case,), include_reference=False)
        fla_rows = [row["impl"] for row in rows if row["impl"].startswith("fla")]
        assert fla_rows == [f"fla chunk_{case}", *([f"fla chunk_{case}, disable_recompute"] if case == "kda" else [])]
        # Each FLA row's function ran once a pass (forward, forward+backward) with these options.
        assert called == [options for options in expected for _ in range(2)]
