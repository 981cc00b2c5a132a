"""CUDA graphs of the MoE blocks (`train.cuda_graphs`): each block's forward and backward replayed as one launch.

One GPU's training step is held by the host's launch rate (docs/PERF.md, issue 9): the MoE block (router, routed
experts with their adapters, shared expert) issues about 80 launches a layer and a step, none of which depends on
the batch's document bounds, so its work is the same every step for a fixed micro-batch shape. torch's
`make_graphed_callables` captures every block's forward and backward once (all in one memory pool, in the order a
step runs them: forwards first to last, backwards last to first); a step then replays two graphs a block.

The kernels a replay runs are the ones eager mode runs, on the same inputs: results are bitwise the same
(tests/gpu/test_cuda_graphs_gpu.py). Where a block's forward differs from the captured one (another input shape or
dtype, eval mode, routing pinned by `moe-tune align`), it runs eagerly.

What a graph cannot see is ruled out before capture (`graph_blockers`): ZeRO-3 gathers each module's weights in
forward hooks, expert parallelism sizes its all-to-all on the host, and selective caching works through
saved-tensor hooks and recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

# Forward + backward runs of each block before capture, on a side stream: Triton compiles and autotunes there,
# cuBLAS picks its algorithms, lazily built buffers are allocated (torch's own example uses 3).
WARMUP_ITERS = 3
# Set on a graphed block (the breakdown reads it: the router and shared expert run inside the block's graph).
GRAPHED_ATTR = "_moe_tune_cuda_graph"


@dataclass
class GraphedBlocks:
    """What `graph_moe_blocks` captured: the blocks (with their eager forwards) and the input shape they replay for."""

    blocks: list[nn.Module]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def note(self) -> str:
        return f"CUDA graphs: {len(self.blocks)} MoE blocks captured for micro-batches of {self.shape[1]} tokens"

    def release(self) -> None:
        """Give the blocks their eager forward back; the graphs and their memory pool go with the last reference."""
        for block in self.blocks:
            del block.forward
            delattr(block, GRAPHED_ATTR)
        self.blocks = []


def graph_blockers(profile: JobProfile, device_type: str, expert_parallel: int) -> list[str]:
    """Why the MoE blocks of this run cannot be graphed (empty: they can), one reason per line, naming the field."""
    from moe_tune.engine.memory import resolve_policy

    reasons = []
    if device_type != "cuda":
        reasons.append(f"the run is on {device_type}: CUDA graphs need a CUDA device")
    if profile.parallel.zero_stage == 3:
        reasons.append("parallel.zero_stage (3) gathers each module's weights in hooks that a graph replay skips: "
                       "use 1 or 2")  # fmt: skip
    if expert_parallel > 1:
        reasons.append(f"parallel.expert_parallel ({expert_parallel}) sizes its all-to-all on the host every step: "
                       "use 1")  # fmt: skip
    if profile.memory.activation_checkpointing:
        reasons.append("memory.activation_checkpointing (true) recomputes layers in backward: set it false")
    elif not resolve_policy(profile.memory).keeps_everything:
        reasons.append(f"memory.preset ({profile.memory.preset}) offloads or recomputes saved tensors through hooks "
                       "a graph replay skips: use none, with no operator class or GPU budget set")  # fmt: skip
    return reasons


def check_cuda_graphs(profile: JobProfile, device_type: str, expert_parallel: int) -> None:
    """Before anything is built: ProfileError when `train.cuda_graphs` is true and the run rules graphs out."""
    _refuse_on(profile, graph_blockers(profile, device_type, expert_parallel))


def _refuse_on(profile: JobProfile, reasons: list[str]) -> None:
    if reasons and profile.train.cuda_graphs is True:
        raise ProfileError([f"train.cuda_graphs (true): {reason}" for reason in reasons])


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    from moe_tune.engine.model.moe import MoEBlock

    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def maybe_graph_moe_blocks(
    model: nn.Module, profile: JobProfile, device: torch.device, expert_parallel: int, tokens: int
) -> GraphedBlocks | None:
    """Graph the model's MoE blocks as `train.cuda_graphs` asks: 'auto' when nothing rules it out, true or a
    ProfileError naming why not, false never. Call after deepspeed.initialize (ZeRO-1/2 move the weights into flat
    buffers there; a graph keeps the addresses it captured). `tokens`: tokens per micro-batch (rows x seq_len)."""
    if profile.train.cuda_graphs is False:
        return None
    blocks = moe_blocks(model)
    reasons = graph_blockers(profile, device.type, expert_parallel)
    if not blocks:
        reasons.append("the model has no MoE layers")
    if reasons:
        _refuse_on(profile, reasons)
        return None
    dtype = torch.bfloat16 if profile.train.precision == "bf16" else torch.float32
    return graph_moe_blocks(blocks, (1, tokens, blocks[0].gate.in_features), dtype, device)


def graph_moe_blocks(
    blocks: list[nn.Module], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> GraphedBlocks:
    """Capture the forward and backward of every block in `blocks` (training mode) for inputs of `shape` and
    `dtype`; each block's forward then replays its graph for such inputs and runs eagerly for others."""
    if any(hasattr(block, GRAPHED_ATTR) for block in blocks):
        raise RuntimeError("MoE blocks already graphed: release() the previous capture first")
    eager = [block.forward for block in blocks]
    samples = tuple((torch.randn(shape, dtype=dtype, device=device, requires_grad=True),) for _ in blocks)
    for block in blocks:
        block.train()
    # Counted loads of the warm-up runs are not the step's: restored after capture (replays count their own).
    counts = [(buffer, buffer.clone()) for block in blocks for buffer in (block.load_counts, block.dropped_slots)]
    torch.cuda.make_graphed_callables(
        tuple(blocks), samples, num_warmup_iters=WARMUP_ITERS, allow_unused_input=True
    )
    with torch.no_grad():
        for buffer, value in counts:
            buffer.copy_(value)
    for block, eager_forward in zip(blocks, eager):
        block.forward = _replay_or_eager(block, block.forward, eager_forward, samples[0][0])
        setattr(block, GRAPHED_ATTR, True)
    return GraphedBlocks(list(blocks), shape, dtype)


def _replay_or_eager(block: nn.Module, graphed, eager, sample: torch.Tensor):
    shape, dtype, device = sample.shape, sample.dtype, sample.device

    def forward(x: torch.Tensor):
        if (block.training and x.shape == shape and x.dtype == dtype and x.device == device
                and block.pinned_topk_ids is None):  # fmt: skip
            return graphed(x)
        return eager(x)

    return forward
