"""Per-operator time of one training step: which share of the step each op class takes (docs/bench.md, "Breakdown").

One step runs under torch.profiler (CPU activities; CUDA too on a GPU). The model is not edited: forward hooks on
its submodules open and close a `moe_tune::<class>` record_function range around each classified module, so every
op its forward runs falls inside the range of the innermost classified module. Backward ops are attributed
through autograd's sequence numbers: the profiler records the sequence number of the forward op that created each
autograd node, and `autograd::engine::evaluate_function: <Node>` events carry the same number, so a node's backward
counts to the class of its forward op (recomputed forwards in backward land in their own module ranges). lm_head
and the loss are whatever the model's forward runs after its final norm; DeepSpeed's `engine.step` (gradient
clipping, the optimizer, the ZeRO bookkeeping) is wrapped in an `optimizer step` range; collectives are recognised
by name wherever they run; the selective-caching copies to and from host memory are `host-tier copies` (on a GPU
they run on their own streams, overlapping the rest).

Time per class: on CPU the self time of its ops, over the profiled step's wall time; on CUDA the time of the
kernels its ops launched, over the median step time measured without the profiler (the profiler slows the host, not
the kernels). What no op covers (Python between ops, GPU idle while the host launches or waits) is `unattributed`;
when overlapping streams make the covered time exceed the step, shares are taken of the covered time. Shares sum
to 1. Beside the time, each class's host side in the profiled step: the device work its ops launched (kernels,
copies, memsets: `launches`) and its ops' self CPU time (`host_s`, inflated by the profiler alike for every class);
`unattributed`'s host time is the profiled step's wall time no op covers (Python between ops). Where the GPU idles
for the host (a large `unattributed` on CUDA), these say which class's launches and host work hold the step back;
on CUDA `gpu_idle_before_s` says where the GPU waited: the gaps in its timeline, each counted to the class whose
work ends the gap, and `gpu_waits` names the ops whose work ended the longest of them.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from moe_tune.engine.bench.timing import StepClock
from moe_tune.engine.memory.store import COPY_RANGE
from moe_tune.engine.train.graphs import GRAPHED_ATTR

# The op classes, in the order tables and charts show them.
OP_CLASSES = (
    "linear attention", "full attention", "sparse attention", "MoE experts", "shared expert / dense MLP",
    "router + dispatch", "all-to-all / collectives", "optimizer step", "norms", "lm_head + loss",
    "host-tier copies", "other", "unattributed",
)  # fmt: skip
RANGE_PREFIX = "moe_tune::"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
# torch.optim wraps every optimizer's step and zero_grad in a range named so.
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
# Collective ops and their backends' ranges (c10d ops, NCCL/Gloo work, the param-comms record), by name.
COLLECTIVE = re.compile(
    r"all_to_all|alltoall|all_gather|allgather|reduce_scatter|all_reduce|allreduce|broadcast|nccl|gloo|c10d::"
    r"|record_param_comms",
    re.IGNORECASE,
)
# What a breakdown's times are (its `timing`).
CUDA_TIMING = "kernel time (CUDA)"
CPU_TIMING = "self CPU time"
# The ops listed by name under the class table: the heaviest few.
TOP_OPS = 15
US_PER_S = 1e6


def module_classes(root: nn.Module) -> dict[nn.Module, str]:
    """The op class of every classified submodule of `root` (an MoECausalLM, LoRA-wrapped or not). Unlisted modules
    (containers, the decoder layers' residual adds, embeddings) take their enclosing module's class."""
    from peft.tuners.lora import LoraLayer

    from moe_tune.engine.model.attention import GatedAttention, GatedDeltaNet, QSAAttention, SparseAttention
    from moe_tune.engine.model.blocks import RMSNorm, SwiGLU
    from moe_tune.engine.model.kda import KimiDeltaAttention
    from moe_tune.engine.model.mla import MultiHeadLatentAttention, SparseMultiHeadLatentAttention
    from moe_tune.engine.model.moe import GroupedExperts, MoEBlock

    # Order matters: the sparse attentions subclass the dense ones; the expert LoRA layer is a LoraLayer.
    table: tuple[tuple[tuple[type, ...], str], ...] = (
        ((GroupedExperts,), "MoE experts"),
        ((GatedDeltaNet, KimiDeltaAttention), "linear attention"),
        ((SparseAttention, QSAAttention, SparseMultiHeadLatentAttention), "sparse attention"),
        ((GatedAttention, MultiHeadLatentAttention), "full attention"),
        ((RMSNorm,), "norms"),
        ((SwiGLU,), "shared expert / dense MLP"),
        ((MoEBlock,), "router + dispatch"),
    )
    classes = {}
    for name, module in root.named_modules():
        base = module.get_base_layer() if isinstance(module, LoraLayer) else module
        label = next((label for types, label in table if isinstance(base, types)), None)
        if getattr(module, GRAPHED_ATTR, False):
            # A graphed MoE block (train.cuda_graphs) runs its router and shared expert inside the experts' graph.
            label = "MoE experts"
        elif name.endswith("shared_expert_gate"):
            label = "shared expert / dense MLP"
        elif name == "lm_head":
            label = "lm_head + loss"
        if label is not None:
            classes[module] = label
    return classes


class _Ranges(threading.local):
    """The open record_function ranges of this thread, innermost last, each under the key that closes it."""

    def __init__(self):
        self.stack: list[tuple[Any, Any]] = []

    def open(self, key: Any, label: str) -> None:
        from torch.autograd.profiler import record_function

        handle = record_function(RANGE_PREFIX + label)
        handle.__enter__()
        self.stack.append((key, handle))

    def close(self, key: Any) -> None:
        """Close the range of `key` and any left open inside it (a forward that raised)."""
        if not any(k is key for k, _ in self.stack):
            return
        while self.stack:
            k, handle = self.stack.pop()
            handle.__exit__(None, None, None)
            if k is key:
                return


# The key of the loss range: opened when the final norm returns, closed when the model's forward returns.
_LOSS = object()


@contextmanager
def class_ranges(root: nn.Module, classes: dict[nn.Module, str]) -> Iterator[None]:
    """Forward hooks on `classes`' modules that wrap each call in its class's range, and a range from the end of
    `root.norm` (the final norm) to the end of `root`'s forward: lm_head and the loss, however the model computes
    them (through the lm_head module, or a fused linear cross-entropy on its weight). Removed on exit."""
    ranges = _Ranges()
    handles = []

    def opener(label: str) -> Callable:
        def pre_hook(module, args):
            ranges.open(module, label)

        return pre_hook

    for module, label in classes.items():
        handles.append(module.register_forward_pre_hook(opener(label)))
        handles.append(module.register_forward_hook(lambda module, args, output: ranges.close(module)))
    # A final norm recomputed in backward (after the model's forward returned) opens no loss range.
    in_forward = threading.Event()

    def open_loss(module, args, output):
        if in_forward.is_set():
            ranges.open(_LOSS, "lm_head + loss")

    def close_loss(module, args, output):
        in_forward.clear()
        ranges.close(_LOSS)

    handles.append(root.register_forward_pre_hook(lambda module, args: in_forward.set()))
    handles.append(root.norm.register_forward_hook(open_loss))
    handles.append(root.register_forward_hook(close_loss))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while ranges.stack:
            ranges.stack.pop()[1].__exit__(None, None, None)


@contextmanager
def optimizer_range(engine) -> Iterator[None]:
    """Wrap `engine.step` (DeepSpeed's: clipping, the optimizer, ZeRO's bookkeeping) in the optimizer range."""
    with method_in_range(engine, "step", RANGE_PREFIX + "optimizer step"):
        yield


@contextmanager
def method_in_range(obj, name: str, label: str) -> Iterator[None]:
    """Run each call of obj's method `name` inside a record_function range `label`; the class's method again after."""
    from torch.autograd.profiler import record_function

    original = getattr(obj, name)

    def ranged(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    setattr(obj, name, ranged)
    try:
        yield
    finally:
        delattr(obj, name)


def _own_class(event, inherited: str | None) -> str | None:
    """The class an event sets for itself and its children, or `inherited`. Backward nodes are resolved later."""
    name = event.name
    if name == COPY_RANGE:
        return "host-tier copies"
    if COLLECTIVE.search(name):
        return "all-to-all / collectives"
    if name.startswith(RANGE_PREFIX):
        return name.removeprefix(RANGE_PREFIX)
    if name.startswith(OPTIMIZER_PREFIXES):
        return "optimizer step"
    return inherited


def _walk(roots, visit: Callable[[Any, Any], Any], state: Any) -> None:
    """Depth-first over event trees: visit(event, parent state) returns the state its children get."""
    pending = [(root, state) for root in reversed(roots)]
    while pending:
        event, parent_state = pending.pop()
        own = visit(event, parent_state)
        pending.extend((child, own) for child in reversed(event.cpu_children))


def attribute(events) -> list[tuple[Any, str]]:
    """(event, op class) for every CPU event of a profile: the innermost class range around it; a backward node's
    subtree the class of the forward op that created the node (the latest forward op with its sequence number on
    its forward thread); collectives and optimizer ranges by name; `other` where nothing applies."""
    from torch.autograd import DeviceType

    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    roots = [e for e in cpu_events if e.cpu_parent is None]
    # Pass 1: classes of forward ops (outside any backward node), by (thread, sequence number).
    forward: dict[tuple[int, int], tuple[float, str | None]] = {}

    def visit_forward(event, state):
        inherited, in_backward = state
        if event.name.startswith(BACKWARD_PREFIX):
            return (None, True)
        own = _own_class(event, inherited)
        if not in_backward and event.sequence_nr >= 0:
            key = (event.thread, event.sequence_nr)
            start = event.time_range.start
            if key not in forward or forward[key][0] <= start:
                forward[key] = (start, own)
        return (own, in_backward)

    _walk(roots, visit_forward, (None, False))
    # Pass 2: every event's class.
    result: list[tuple[Any, str]] = []

    def visit(event, inherited):
        if event.name.startswith(BACKWARD_PREFIX) and not COLLECTIVE.search(event.name):
            thread = event.fwd_thread if event.fwd_thread else event.thread
            created = forward.get((thread, event.sequence_nr))
            own = created[1] if created is not None and created[1] is not None else inherited
        else:
            own = _own_class(event, inherited)
        result.append((event, own or "other"))
        return own

    _walk(roots, visit, None)
    return result


def _event_time_us(event, is_cuda: bool) -> float:
    """Self CPU time, or on CUDA the time of the kernels the op itself launched."""
    if is_cuda:
        return float(sum(kernel.duration for kernel in event.kernels))
    return float(event.self_cpu_time_total)


def _device_events(prof) -> list:
    """The raw Kineto events of a finished torch.profiler run that ran on a device (kernels, copies, memsets)."""
    from torch.autograd import DeviceType

    return [event for event in prof.profiler.kineto_results.events() if event.device_type() != DeviceType.CPU]


def _start_end_us(event) -> tuple[float, float]:
    return event.start_ns() / 1e3, (event.start_ns() + event.duration_ns()) / 1e3


def device_spans(prof) -> list[tuple[float, float, int]]:
    """(start us, end us, linked correlation id) of every device event (kernels, copies, memsets) of a finished
    torch.profiler run, from its raw Kineto events: the FunctionEvents of torch 2.11 do not keep the link."""
    return [(*_start_end_us(event), event.linked_correlation_id()) for event in _device_events(prof)]


def _idle_gaps(spans: list[tuple[float, float, Any]]) -> Iterator[tuple[float, Any]]:
    """(microseconds, the event's third field) of every gap in the device's timeline of (start, end, id or name)
    events: in start order, wherever an event starts after all earlier ones have ended, the gap before it and what
    names the event (the linked correlation id of the op that launched it, or its name)."""
    busy_until: float | None = None
    for start, end, linked in sorted(spans):
        if busy_until is not None and start > busy_until:
            yield start - busy_until, linked
        busy_until = end if busy_until is None else max(busy_until, end)


def gpu_idle_before(spans: list[tuple[float, float, int]], attributed: list[tuple[Any, str]]) -> dict[str, float]:
    """Microseconds the device sat idle right before each class's device work, in the profiled step.

    spans: `device_spans` (every stream's kernels, copies and memsets). Each gap (`_idle_gaps`) counts to the class
    of the op that launched the work ending it (the CPU event whose id its linked correlation id names; `other`
    when none is attributed). The GPU waited there for the host to issue that class's work, so this says which
    class's host side holds the step back. Gaps are those of the profiled step: the profiler slows the host, so
    they are larger than in an unprofiled step, alike for every class."""
    # The ops the profiler gave device work to (it links a device event to its op by that op's id).
    label_of = {event.id: label for event, label in attributed if event.kernels}
    idle: dict[str, float] = defaultdict(float)
    for gap_us, linked in _idle_gaps(spans):
        idle[label_of.get(linked, "other")] += gap_us
    return dict(idle)


def gpu_waits(spans: list[tuple[float, float, int]], attributed: list[tuple[Any, str]]) -> list[dict[str, Any]]:
    """The ops whose device work the GPU waited for longest in the profiled step, the gaps counted as
    `gpu_idle_before` counts them, per op name and class: idle seconds in all, gaps, the longest gap; the TOP_OPS
    heaviest. A gap before work no attributed op launched is `(no op)`, class `other`."""
    op_of = {event.id: (event.name, label) for event, label in attributed if event.kernels}
    by_op = _gaps_by(_idle_gaps(spans), lambda linked: op_of.get(linked, ("(no op)", "other")))
    return [dict(op=name, op_class=label, idle_s=total / US_PER_S, gaps=gaps, longest_s=longest / US_PER_S)
            for (name, label), total, gaps, longest in by_op[:TOP_OPS]]  # fmt: skip


def _gaps_by(gaps: Iterator[tuple[float, Any]], key: Callable[[Any], Any]) -> list[tuple[Any, float, int, float]]:
    """(key, idle us in all, gaps, longest gap us) per key of `_idle_gaps`' gaps (key(what names the event ending
    each)), the most idle first, equal ones by key."""
    totals: dict[Any, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for gap_us, ends in gaps:
        entry = totals[key(ends)]
        entry[0] += gap_us
        entry[1] += 1
        entry[2] = max(entry[2], gap_us)
    ranked = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))
    return [(name, total, int(count), longest) for name, (total, count, longest) in ranked]


def device_timeline(events: list[tuple[float, float, str]], step_s: float) -> dict[str, Any]:
    """The device's time in a step profiled with device activity only (`timeline_step`), from its events (start us,
    end us, name: kernels, copies, memsets on every stream) and the step's wall time: `busy_s` (the union of the
    events), `idle_s` (the gaps between the first event's start and the last one's end), `outside_s` (the step's time
    before the first and after the last: the host's work before its first launch, the wait at the end), `launches`,
    `gaps [{kernel, gaps, idle_s, longest_s}]`: the device work the GPU waited for longest, by name (the TOP_OPS
    heaviest), each gap counted to the event that ends it (`_idle_gaps`), and `kernels [{kernel, calls, time_s}]`:
    every name's device work, the longest first (inside CUDA graph replays too; the table prints the TOP_OPS
    heaviest)."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for start, end, name in events:
        per_name[name][0] += end - start
        per_name[name][1] += 1
    heaviest_work = sorted(per_name.items(), key=lambda item: (-item[1][0], item[0]))
    by_name = _gaps_by(_idle_gaps(events), lambda name: name)
    span_us = max(end for _, end, _ in events) - min(start for start, _, _ in events) if events else 0.0
    idle_us = sum(total for _, total, _, _ in by_name)
    return dict(
        step_s=step_s,
        busy_s=(span_us - idle_us) / US_PER_S,
        idle_s=idle_us / US_PER_S,
        outside_s=max(step_s - span_us / US_PER_S, 0.0),
        launches=len(events),
        gaps=[dict(kernel=name, gaps=gaps, idle_s=total / US_PER_S, longest_s=longest / US_PER_S)
              for name, total, gaps, longest in by_name[:TOP_OPS]],  # fmt: skip
        kernels=[dict(kernel=name, calls=int(calls), time_s=us / US_PER_S) for name, (us, calls) in heaviest_work],
    )


def timeline_step(runner) -> dict[str, Any]:
    """One more training step of `runner` (a steps.StepRunner, on CUDA) under torch.profiler recording device
    activity only: no op is recorded on the host, so the host runs at nearly its unprofiled pace (CUPTI still traces
    each launch) and the device's gaps are nearly the real ones; `device_timeline` of it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        record = runner.step()
    events = [(*_start_end_us(event), event.name()) for event in _device_events(prof)]
    return device_timeline(events, record["step_time_s"])


def shares(
    attributed: list[tuple[Any, str]],
    step_time_s: float,
    is_cuda: bool,
    host_wall_s: float | None = None,
    idle_before_us: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Seconds and share of the step per op class (OP_CLASSES order, `unattributed` the rest), each class's
    launches and host seconds, and the heaviest ops by name. The basis is `step_time_s`, or the covered time when
    that is larger (overlapping streams). host_wall_s: the profiled step's wall time (unattributed's host time is
    what no op's self CPU time covers of it; 0 without it). idle_before_us (CUDA): `gpu_idle_before`'s result, each
    class's `gpu_idle_before_s`."""
    per_class: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    host_us: dict[str, float] = defaultdict(float)
    per_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for event, label in attributed:
        host_us[label] += float(event.self_cpu_time_total)
        if is_cuda:
            launches[label] += len(event.kernels)
        us = _event_time_us(event, is_cuda)
        if us <= 0:
            continue
        per_class[label] += us
        entry = per_op[(event.name, label)]
        entry[0] += us
        entry[1] += 1
    covered_s = sum(per_class.values()) / US_PER_S
    basis_s = max(step_time_s, covered_s)
    per_class["unattributed"] = (basis_s - covered_s) * US_PER_S
    if host_wall_s is not None:
        host_us["unattributed"] = max(host_wall_s * US_PER_S - sum(host_us.values()), 0.0)
    rows = [dict(op_class=label, time_s=per_class.get(label, 0.0) / US_PER_S,
                 share=per_class.get(label, 0.0) / US_PER_S / basis_s if basis_s > 0 else 0.0,
                 launches=launches.get(label, 0), host_s=host_us.get(label, 0.0) / US_PER_S)
            for label in OP_CLASSES]  # fmt: skip
    if idle_before_us is not None:
        for row in rows:
            row["gpu_idle_before_s"] = idle_before_us.get(row["op_class"], 0.0) / US_PER_S
    heaviest = sorted(per_op.items(), key=lambda item: -item[1][0])[:TOP_OPS]
    return dict(
        basis_s=basis_s,
        covered_s=covered_s,
        classes=rows,
        top_ops=[dict(op=name, op_class=label, time_s=us / US_PER_S, calls=int(calls))
                 for (name, label), (us, calls) in heaviest],  # fmt: skip
    )


def find_model(engine_or_model: nn.Module) -> nn.Module:
    """The MoECausalLM inside a DeepSpeed engine / PeftModel."""
    from moe_tune.engine.model.model import MoECausalLM

    for module in engine_or_model.modules():
        if isinstance(module, MoECausalLM):
            return module
    raise AssertionError("no MoECausalLM inside the engine")


def profiled_step(runner, reference_step_s: float) -> dict[str, Any]:
    """One more training step of `runner` (a steps.StepRunner) under torch.profiler; the per-class breakdown.
    `reference_step_s`: the median unprofiled step, the basis of kernel-time shares on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    model = find_model(runner.engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.is_cuda else [])
    with class_ranges(model, module_classes(model)), optimizer_range(runner.engine):
        with profile(activities=activities) as prof:
            # Host wall time: runner.step() synchronizes the device itself, and a sync here would enter the profile.
            with StepClock(is_cuda=False) as clock:
                record = runner.step()
    wall_s = clock.seconds
    attributed = attribute(prof.events())
    spans = device_spans(prof) if runner.is_cuda else None
    idle = gpu_idle_before(spans, attributed) if runner.is_cuda else None
    result = shares(
        attributed, reference_step_s if runner.is_cuda else wall_s, runner.is_cuda, host_wall_s=wall_s,
        idle_before_us=idle,
    )  # fmt: skip
    if runner.is_cuda:
        result["gpu_waits"] = gpu_waits(spans, attributed)
    result.update(
        timing=CUDA_TIMING if runner.is_cuda else CPU_TIMING,
        profiled_step_time_s=wall_s,
        loss=record["loss"],
    )
    return result
