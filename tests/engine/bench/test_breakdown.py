"""The per-operator breakdown (engine/bench/breakdown.py): backward time goes to the class of its forward op, and
the shares of a tiny-profile step sum to one."""

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from moe_tune.engine.bench.breakdown import OP_CLASSES, attribute, class_ranges, shares

BACKWARD = "autograd::engine::evaluate_function: "


class MatMul(nn.Module):
    # torch.mm itself: DeepSpeed's ZeRO-3 (run by other tests in this process) may leave F.linear patched.
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32))

    def forward(self, x):
        return torch.mm(x, self.weight)


class Toy(nn.Module):
    """experts (mm) -> norm (tanh) -> what follows the final norm (exp, sum: the loss)."""

    def __init__(self):
        super().__init__()
        self.experts = MatMul()
        self.norm = nn.Tanh()

    def forward(self, x):
        return self.norm(self.experts(x)).exp().sum()


def test_backward_nodes_count_to_the_class_of_their_forward_op():
    model = Toy()
    classes = {model.experts: "MoE experts", model.norm: "norms"}
    x = torch.randn(16, 32)
    with class_ranges(model, classes), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).backward()
    labels = {}
    for event, label in attribute(prof.events()):
        if event.name.startswith(BACKWARD):
            labels.setdefault(event.name.removeprefix(BACKWARD), set()).add(label)
        if event.name in ("aten::mm", "aten::tanh", "aten::exp"):
            labels.setdefault(event.name, set()).add(label)
    assert labels["aten::mm"] == labels["MmBackward0"] == {"MoE experts"}
    assert labels["aten::tanh"] == labels["TanhBackward0"] == {"norms"}
    # The ops after the final norm (and their backward) are the loss.
    assert labels["aten::exp"] == labels["ExpBackward0"] == labels["SumBackward0"] == {"lm_head + loss"}


def tiny_breakdown(*overrides: str) -> dict:
    from moe_tune.engine.bench.breakdown import profiled_step
    from moe_tune.engine.bench.steps import StepRunner
    from moe_tune.profiles import load_profile

    job = load_profile("tiny", ["data.seq_len=32", "train.micro_batch_size=1", "data.corpus_documents=50", *overrides])
    runner = StepRunner(job)
    try:
        runner.step()
        return profiled_step(runner, reference_step_s=1.0)
    finally:
        runner.close()


def test_shares_of_a_tiny_step_sum_to_one_and_cover_its_classes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = tiny_breakdown()
    rows = {row["op_class"]: row for row in result["classes"]}
    assert list(rows) == list(OP_CLASSES)
    assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0)
    assert all(row["share"] >= 0 for row in rows.values())
    # On CPU the basis is the profiled step's own wall time, so the reference step is not used.
    assert result["basis_s"] == pytest.approx(max(result["profiled_step_time_s"], result["covered_s"]))
    # tiny: 3 linear-attention layers, 1 sparse, routed and shared experts, a trained lm_head; no full attention.
    for label in ("linear attention", "sparse attention", "MoE experts", "shared expert / dense MLP",
                  "router + dispatch", "norms", "lm_head + loss", "optimizer step"):  # fmt: skip
        assert rows[label]["time_s"] > 0, label
    assert rows["full attention"]["time_s"] == 0 and rows["host-tier copies"]["time_s"] == 0
    # Ops cover most of a CPU step: what is left is Python between ops.
    assert rows["unattributed"]["share"] < 0.5


def test_copies_to_the_host_tier_are_a_class_of_their_own(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = tiny_breakdown("memory.preset=max-context", "memory.min_offload_mb=0")
    rows = {row["op_class"]: row for row in result["classes"]}
    assert rows["host-tier copies"]["time_s"] > 0
    assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0)
    copies = [op for op in result["top_ops"] if op["op_class"] == "host-tier copies"]
    assert all(op["op"].startswith(("aten::", "moe_tune_memory::")) for op in copies)


def test_covered_time_beyond_the_step_becomes_the_basis():
    """Overlapping streams (kernel time summed over streams) exceed the wall time: shares of the covered time."""

    class Event:
        name, kernels, self_cpu_time_total = "aten::mm", (), 3e6

    result = shares([(Event(), "MoE experts")], step_time_s=2.0, is_cuda=False)
    rows = {row["op_class"]: row for row in result["classes"]}
    assert result["basis_s"] == 3.0
    assert rows["MoE experts"]["share"] == 1.0 and rows["unattributed"]["share"] == 0.0
