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
    # On the CPU the time is the host time, and nothing is launched.
    for label, row in rows.items():
        assert row["launches"] == 0
        assert row["host_s"] == pytest.approx(row["time_s"], rel=1e-6, abs=1e-9), label


def test_copies_to_the_host_tier_are_a_class_of_their_own(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = tiny_breakdown("memory.preset=max-context", "memory.min_offload_mb=0")
    rows = {row["op_class"]: row for row in result["classes"]}
    assert rows["host-tier copies"]["time_s"] > 0
    assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0)
    copies = [op for op in result["top_ops"] if op["op_class"] == "host-tier copies"]
    assert all(op["op"].startswith(("aten::", "moe_tune_memory::")) for op in copies)


def test_cuda_shares_count_launches_and_host_time_per_class():
    class Kernel:
        def __init__(self, us):
            self.duration = us

    class Event:
        def __init__(self, name, kernel_us, host_us):
            self.name, self.kernels, self.self_cpu_time_total = name, [Kernel(us) for us in kernel_us], host_us

    attributed = [
        (Event("aten::mm", [300.0, 200.0], 40.0), "MoE experts"),
        (Event("aten::mul", [100.0], 25.0), "MoE experts"),
        (Event("aten::add", [50.0, 50.0, 100.0], 60.0), "norms"),
        (Event("aten::view", [], 5.0), "other"),  # host work without a launch
    ]
    result = shares(attributed, step_time_s=0.002, is_cuda=True, host_wall_s=0.0003)
    rows = {row["op_class"]: row for row in result["classes"]}
    assert (rows["MoE experts"]["launches"], rows["norms"]["launches"], rows["other"]["launches"]) == (3, 3, 0)
    assert rows["MoE experts"]["time_s"] == pytest.approx(600e-6) and rows["norms"]["time_s"] == pytest.approx(200e-6)
    assert rows["MoE experts"]["host_s"] == pytest.approx(65e-6) and rows["other"]["host_s"] == pytest.approx(5e-6)
    # The step's idle GPU time is unattributed; so is the profiled step's host time no op covers (300 - 130 us).
    assert rows["unattributed"]["time_s"] == pytest.approx(0.002 - 800e-6)
    assert rows["unattributed"]["host_s"] == pytest.approx(170e-6)
    assert rows["unattributed"]["launches"] == 0


def test_breakdown_table_shows_launches_host_time_and_idle_on_cuda_only():
    from rich.console import Console

    from moe_tune.cli.profile_steps import breakdown_table
    from moe_tune.engine.bench.breakdown import CPU_TIMING, CUDA_TIMING

    classes = [dict(op_class=label, time_s=0.001, share=1 / len(OP_CLASSES), launches=7, host_s=0.0025,
                    gpu_idle_before_s=0.0042) for label in OP_CLASSES]  # fmt: skip

    def rendered(timing):
        console = Console(record=True, width=200)
        console.print(breakdown_table(dict(classes=classes, timing=timing)))
        return console.export_text()

    cuda, cpu = rendered(CUDA_TIMING), rendered(CPU_TIMING)
    assert "launches" in cuda and "host ms" in cuda and "2.5" in cuda
    assert "GPU idle before ms" in cuda and "4.2" in cuda
    assert "launches" not in cpu and "host ms" not in cpu and "2.5" not in cpu and "4.2" not in cpu


def test_covered_time_beyond_the_step_becomes_the_basis():
    """Overlapping streams (kernel time summed over streams) exceed the wall time: shares of the covered time."""

    class Event:
        name, kernels, self_cpu_time_total = "aten::mm", (), 3e6

    result = shares([(Event(), "MoE experts")], step_time_s=2.0, is_cuda=False)
    rows = {row["op_class"]: row for row in result["classes"]}
    assert result["basis_s"] == 3.0
    assert rows["MoE experts"]["share"] == 1.0 and rows["unattributed"]["share"] == 0.0


def test_gpu_idle_counts_to_the_class_whose_work_ends_the_gap():
    from types import SimpleNamespace

    from moe_tune.engine.bench.breakdown import gpu_idle_before

    def op(event_id, kernels):
        return SimpleNamespace(id=event_id, kernels=kernels)

    mm, norm, view, launcher = op(1, ["k"]), op(2, ["k"]), op(9, []), op(4, ["k"])
    # An op without device work has the id a launch links to: it must not take that launch's gap.
    attributed = [(mm, "MoE experts"), (norm, "norms"), (view, "full attention"), (launcher, "optimizer step")]
    spans = [  # (start, end, linked correlation id), not in start order
        (130.0, 140.0, 2),  # after a 20 us gap: norms
        (0.0, 100.0, 1),  # the first event: no gap before it
        (105.0, 110.0, 1),  # 5 us: MoE experts
        (108.0, 109.0, 4),  # overlaps (another stream): no gap
        (150.0, 160.0, 4),  # 10 us: optimizer step
        (170.0, 171.0, 9),  # 5 us, launched by no op with device work that the attribution saw: other
        (160.0, 165.0, 2),  # starts when the last one ends: no gap
    ]
    idle = gpu_idle_before(spans, attributed)
    assert idle == {"norms": 20.0, "MoE experts": 5.0, "optimizer step": 10.0, "other": 5.0}


def test_gpu_waits_name_the_ops_whose_work_ends_the_gaps():
    from types import SimpleNamespace

    from rich.console import Console

    from moe_tune.cli.profile_steps import gpu_waits_table
    from moe_tune.engine.bench.breakdown import TOP_OPS, gpu_idle_before, gpu_waits

    def op(event_id, name, kernels=("k",)):
        return SimpleNamespace(id=event_id, name=name, kernels=list(kernels))

    attributed = [(op(1, "aten::mm"), "MoE experts"), (op(2, "aten::item"), "other"), (op(3, "aten::mm"), "norms"),
                  (op(4, "aten::view", ()), "norms")]  # fmt: skip
    spans = [
        (0.0, 10.0, 1),
        (30.0, 40.0, 2),  # 20 us before aten::item
        (45.0, 50.0, 1),  # 5 us before aten::mm of the experts
        (49.0, 52.0, 3),  # overlaps: no gap
        (60.0, 61.0, 3),  # 8 us before aten::mm of the norms: same name, another class, another row
        (100.0, 101.0, 1),  # 39 us before the experts' aten::mm again
        (102.0, 103.0, 4),  # 1 us, linked to an op without device work the attribution saw: (no op)
    ]
    waits = gpu_waits(spans, attributed)
    assert [(w["op"], w["op_class"], w["gaps"]) for w in waits] == [
        ("aten::mm", "MoE experts", 2), ("aten::item", "other", 1), ("aten::mm", "norms", 1), ("(no op)", "other", 1)
    ]  # fmt: skip
    assert [w["idle_s"] * 1e6 for w in waits] == pytest.approx([44.0, 20.0, 8.0, 1.0])
    assert waits[0]["longest_s"] * 1e6 == pytest.approx(39.0)
    # The same gaps as the per-class idle, split by op.
    assert sum(w["idle_s"] for w in waits) * 1e6 == pytest.approx(sum(gpu_idle_before(spans, attributed).values()))
    many = [(op(10 + i, f"op{i}"), "other") for i in range(TOP_OPS + 3)]
    many_spans = [(100.0 * i, 100.0 * i + 1.0, 10 + i) for i in range(TOP_OPS + 3)]
    assert len(gpu_waits(many_spans, many)) == TOP_OPS
    console = Console(record=True, width=200)
    console.print(gpu_waits_table(dict(gpu_waits=waits)))
    text = console.export_text()
    assert "aten::item" in text and "0.04" in text and "(no op)" in text


def test_shares_report_the_idle_before_each_class_only_when_given():
    class Event:
        name, kernels, self_cpu_time_total = "aten::mm", (), 1.0

    attributed = [(Event(), "MoE experts")]
    with_idle = shares(attributed, 0.001, True, idle_before_us={"norms": 250.0})
    rows = {row["op_class"]: row for row in with_idle["classes"]}
    assert rows["norms"]["gpu_idle_before_s"] == pytest.approx(250e-6)
    assert rows["MoE experts"]["gpu_idle_before_s"] == 0.0
    assert all("gpu_idle_before_s" not in row for row in shares(attributed, 0.001, True)["classes"])


def test_the_device_timeline_sums_busy_and_idle_time_and_names_the_work_after_the_gaps():
    from rich.console import Console

    from moe_tune.cli.profile_steps import device_gaps_table, device_timeline_line, device_work_table
    from moe_tune.engine.bench.breakdown import TOP_OPS, device_timeline

    events = [
        (100.0, 110.0, "embed"),
        (130.0, 150.0, "gdn_fwd"),  # 20 us idle before it
        (140.0, 160.0, "copy"),  # another stream, overlapping: busy until 160, no gap
        (155.0, 158.0, "memset"),  # inside the busy span
        (160.0, 170.0, "mm"),  # starts as the last ends: no gap
        (175.0, 180.0, "gdn_fwd"),  # 5 us before gdn_fwd again
        (230.0, 240.0, "optimizer"),  # 50 us
    ]
    timeline = device_timeline(events[::-1], step_s=200e-6)  # any order
    assert timeline["busy_s"] * 1e6 == pytest.approx(10 + 40 + 5 + 10)
    assert timeline["idle_s"] * 1e6 == pytest.approx(20 + 5 + 50)
    # Busy and idle fill the span from the first event's start to the last one's end.
    assert (timeline["busy_s"] + timeline["idle_s"]) * 1e6 == pytest.approx(240 - 100)
    assert timeline["outside_s"] * 1e6 == pytest.approx(200 - 140)
    assert timeline["launches"] == len(events) and timeline["step_s"] == 200e-6
    assert [(g["kernel"], g["gaps"]) for g in timeline["gaps"]] == [("optimizer", 1), ("gdn_fwd", 2)]
    assert [g["idle_s"] * 1e6 for g in timeline["gaps"]] == pytest.approx([50.0, 25.0])
    assert timeline["gaps"][1]["longest_s"] * 1e6 == pytest.approx(20.0)
    # Each name's own time, overlaps and all, heaviest first (equal times by name, whatever the events' order).
    assert [(k["kernel"], k["calls"]) for k in timeline["kernels"]] == [
        ("gdn_fwd", 2), ("copy", 1), ("embed", 1), ("mm", 1), ("optimizer", 1), ("memset", 1)
    ]  # fmt: skip
    assert [k["time_s"] * 1e6 for k in timeline["kernels"]] == pytest.approx([25.0, 20.0, 10.0, 10.0, 10.0, 3.0])
    # At most TOP_OPS gaps' names, every kernel's name (the CLI prints TOP_OPS); a step with no device work has none.
    many = [(10.0 * i, 10.0 * i + 1.0 + 0.01 * i, f"k{i}") for i in range(TOP_OPS + 5)]
    assert len(device_timeline(many, 1.0)["gaps"]) == TOP_OPS
    names = [k["kernel"] for k in device_timeline(many, 1.0)["kernels"]]
    assert names == [f"k{i}" for i in reversed(range(TOP_OPS + 5))]
    empty = device_timeline([], 0.5)
    assert (empty["busy_s"], empty["idle_s"], empty["outside_s"], empty["gaps"], empty["kernels"]) == (
        0.0, 0.0, 0.5, [], []
    )  # fmt: skip
    console = Console(record=True, width=200)
    console.print(device_timeline_line(timeline))
    console.print(device_gaps_table(timeline))
    console.print(device_work_table(timeline))
    text = console.export_text()
    assert "0.2 ms, the device busy 0.1 ms (7 kernels, copies and memsets), idle 0.1 ms" in text
    assert "optimizer" in text and "0.05" in text and "0.03" in text  # a gap of 50 us; gdn_fwd's 25 us
    # The table prints the TOP_OPS heaviest names of however many the JSON keeps.
    console = Console(record=True, width=200)
    console.print(device_work_table(device_timeline(many, 1.0)))
    text = console.export_text()
    shown = [f"k{i}" for i in range(TOP_OPS + 5) if f" k{i} " in text]
    assert shown == [f"k{i}" for i in range(5, TOP_OPS + 5)]
