"""CUDA graphs of the MoE blocks (`train.cuda_graphs`): each block's forward and backward replayed as one launch.

One GPU's training step is held by the host's launch rate (docs/PERF.md, issue 9): the MoE block (router, routed
experts with their adapters, shared expert) issues about 80 launches a layer and a step, none of which depends on
the batch's document bounds, so its work is the same every step for a fixed micro-batch shape. Every block's
forward and backward are captured once (as torch's `make_graphed_callables` does: warm-up runs on a side stream, one
memory pool, captures in the order a step runs them), differentiating with respect to leaves that share the
parameters' memory (`_BlockCapture` says why); a step then replays two graphs a block.

The kernels a replay runs are the ones eager mode runs, on the same inputs: results are bitwise the same
(tests/gpu/test_cuda_graphs_gpu.py). Where a block's forward differs from the captured one (another input shape or
dtype, eval mode, routing pinned by `moe-tune align`, no residual), it runs eagerly. The graphs take the block's two
inputs, x and the decoder layer's residual (which the block adds to its output inside its own ops); a replay copies
each into the graph's static input unless it was written there: the decoder layer's post-attention norm writes both
there (`MoEBlock.input_buffers`), which saves two copies of [T, D] a layer. Backward alike: a replay's outputs ask
for their gradients in the backward graph's static inputs (`want_grad_in`), where the op consuming the block's
output (the next layer's input norm, or the final norm) writes its input's gradient, and the backward replay
copies only a gradient made elsewhere.

What a graph cannot see is ruled out before capture (`graph_blockers`): ZeRO-3 gathers each module's weights in
forward hooks, expert parallelism sizes its all-to-all on the host, and selective caching works through
saved-tensor hooks and recomputation.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from moe_tune.ops.common.grad_handoff import want_grad_in
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

# Forward + backward runs of each block before capture, on a side stream: Triton compiles and autotunes there,
# cuBLAS picks its algorithms, lazily built buffers are allocated (torch's own example uses 3).
WARMUP_ITERS = 3
# Set on a graphed block (the breakdown reads it: the router and shared expert run inside the block's graph).
GRAPHED_ATTR = "_moe_tune_cuda_graph"


@dataclass
class GraphedBlocks:
    """What `graph_moe_blocks` captured: one capture a block, and the tokens per micro-batch they replay for."""

    captures: list[_BlockCapture]
    tokens: int

    @property
    def blocks(self) -> list[nn.Module]:
        return [capture.block for capture in self.captures]

    def note(self) -> str:
        return f"CUDA graphs: {len(self.captures)} MoE blocks captured for micro-batches of {self.tokens} tokens"

    def release(self) -> None:
        """Give the blocks their eager forward back and destroy the graphs now (their memory pool goes with them)."""
        for capture in self.captures:
            del capture.block.forward, capture.block.input_buffers
            delattr(capture.block, GRAPHED_ATTR)
            capture.drop()
        self.captures = []
        gc.collect()


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
    if profile.parallel.context_parallel > 1:
        reasons.append(f"parallel.context_parallel ({profile.parallel.context_parallel}) routes each MoE block on a "
                       "share of the row and combines its aux loss over the ranks: use 1")  # fmt: skip
    if profile.memory.activation_checkpointing:
        reasons.append("memory.activation_checkpointing (true) recomputes layers in backward: set it false")
    elif not resolve_policy(profile.memory).keeps_everything:
        reasons.append(f"memory.preset ({profile.memory.preset}) offloads or recomputes saved tensors through hooks "
                       "a graph replay skips: use none, with no operator class or GPU budget set")  # fmt: skip
    chunk = profile.memory.sequence_chunk_tokens
    if chunk is not None and chunk < profile.data.seq_len:
        reasons.append(f"memory.sequence_chunk_tokens ({chunk}) runs each MoE block chunk by chunk, recomputed in "
                       f"backward, on rows of data.seq_len ({profile.data.seq_len}): unset it or make it "
                       "at least data.seq_len")  # fmt: skip
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
    """Capture the forward and backward of every block in `blocks` (training mode) for inputs x and residual of
    `shape` and `dtype`; each block's forward then replays its graph for such inputs and runs eagerly for others."""
    if any(hasattr(block, GRAPHED_ATTR) for block in blocks):
        raise RuntimeError("MoE blocks already graphed: release() the previous capture first")
    # A hook inside a block would run at capture only, never at replay.
    hooked = [name for block in blocks for name, m in block.named_modules()
              if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]  # fmt: skip
    if hooked:
        raise RuntimeError(f"cannot graph MoE blocks with module hooks (on {hooked[:3]})")
    for block in blocks:
        block.train()
    # Counted loads of the warm-up runs are not the step's: restored after capture (replays count their own).
    counts = [(buffer, buffer.clone()) for block in blocks for buffer in (block.load_counts, block.dropped_slots)]
    captures = [_BlockCapture(block, torch.randn(shape, dtype=dtype, device=device)) for block in blocks]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for capture in captures:
            capture.warm_up()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # One pool for all graphs, captured in a step's order (forwards first to last, backwards last to first), so
    # that what one graph frees and another reuses is dead by the time the other replays.
    pool = torch.cuda.graph_pool_handle()
    with _no_collection_during_capture():
        for capture in captures:
            capture.capture_forward(pool)
        for capture in reversed(captures):
            capture.capture_backward(pool)
    with torch.no_grad():
        for buffer, value in counts:
            buffer.copy_(value)
    for capture in captures:
        capture.install()
    return GraphedBlocks(captures, shape[1])


@contextmanager
def _no_collection_during_capture():
    """Python's cycle collector off while capturing, after one collection: garbage it would free mid-capture (an
    unreleased earlier graph, whose replay Function sits in a reference cycle) destroys CUDA graphs and their memory,
    which invalidates the capture (seen on the H200: a second capture in one process failed at a random op)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _BlockCapture:
    """One block's forward and backward graphs, and the autograd Function that replays them.

    The graphs differentiate with respect to fresh leaves that share the trainable parameters' memory (not the
    parameters themselves): a parameter's gradient accumulator may be an older autograd node bound to the stream it
    was made on (DeepSpeed's set-up leaves such nodes alive), and a capture cannot wait on another stream. The
    replayed gradients reach the real parameters through the Function's inputs, outside any capture."""

    def __init__(self, block: nn.Module, sample: torch.Tensor):
        self.block = block
        self.eager = block.forward
        self.names = [n for n, p in block.named_parameters() if p.requires_grad]
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.sample = sample
        # Inputs (x or residual) of the replays that were not already in their static input
        # (MoEBlock.input_buffers) and were copied there.
        self.input_copies = 0
        # By output (the block's y, its aux loss): the gradients that reached the backward replays elsewhere than in
        # their static input (ops/common/grad_handoff.want_grad_in) and were copied there.
        self.grad_copies: list[int] = []

    def _leaves(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(x and residual, the parameters' stand-ins), fresh leaves that require grad."""
        inputs = [self.sample.detach().requires_grad_(), self.sample.detach().clone().requires_grad_()]
        return inputs, [p.detach().requires_grad_() for p in self.params]

    def _forward(self, inputs: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        x, residual = inputs
        outputs = torch.func.functional_call(self.block, dict(zip(self.names, leaves)), (x,), {"residual": residual})
        flat, self.spec = torch.utils._pytree.tree_flatten(outputs)
        return flat

    def _grads(self, outputs, inputs, grads_out) -> tuple[torch.Tensor | None, ...]:
        differentiable = [(o, g) for o, g in zip(outputs, grads_out) if o.requires_grad]
        return torch.autograd.grad(
            [o for o, _ in differentiable], inputs, [g for _, g in differentiable], allow_unused=True
        )

    def warm_up(self) -> None:
        for _ in range(WARMUP_ITERS):
            inputs, leaves = self._leaves()
            outputs = self._forward(inputs, leaves)
            self._grads(outputs, [*inputs, *leaves], [torch.empty_like(o) for o in outputs])

    def drop(self) -> None:
        """Destroy the graphs and the static buffers now rather than whenever the replay Function's cycle is
        collected."""
        self.fwd_graph = self.bwd_graph = None
        self.inputs = self.outputs = self.grads_out = self.grads_in = []

    def capture_forward(self, pool) -> None:
        self.inputs, self.leaves = self._leaves()
        self.fwd_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd_graph, pool=pool):
            self.outputs = self._forward(self.inputs, self.leaves)

    def capture_backward(self, pool) -> None:
        self.grads_out = [torch.empty_like(o) for o in self.outputs]
        self.grad_copies = [0] * len(self.outputs)
        self.bwd_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bwd_graph, pool=pool):
            grads = self._grads(self.outputs, [*self.inputs, *self.leaves], self.grads_out)
        self.grads_in = tuple(None if g is None else g.detach() for g in grads)
        self.outputs = [o.detach() for o in self.outputs]

    def install(self) -> None:
        capture = self

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, residual, *params):
                for static, given in zip(capture.inputs, (x, residual)):
                    if given.data_ptr() != static.data_ptr():
                        static.detach().copy_(given)
                        capture.input_copies += 1
                capture.fwd_graph.replay()
                # Fresh aliases of the static outputs: autograd sets a grad_fn on what forward returns.
                return tuple(o.detach() for o in capture.outputs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                for i, (static, grad) in enumerate(zip(capture.grads_out, grads)):
                    if static.data_ptr() != grad.data_ptr():
                        static.copy_(grad)
                        capture.grad_copies[i] += 1
                capture.bwd_graph.replay()
                return tuple(None if g is None else g.detach() for g in capture.grads_in)

        block, sample = self.block, self.sample

        def replays(*inputs: torch.Tensor) -> bool:
            return block.training and block.pinned_topk_ids is None and all(
                t.shape == sample.shape and t.dtype == sample.dtype and t.device == sample.device for t in inputs
            )

        def input_buffers(like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            # The static inputs themselves (aliases without their autograd history): inputs written there are not
            # copied.
            return tuple(t.detach() for t in capture.inputs) if replays(like) else (None, None)

        def forward(x: torch.Tensor, chunk=None, residual: torch.Tensor | None = None):
            if chunk is None and residual is not None and replays(x, residual):
                # The graphs read the parameters where they were at capture (ZeRO-1/2 update them in place).
                assert all(p.data_ptr() == leaf.data_ptr() for p, leaf in zip(capture.params, capture.leaves)), (
                    "a graphed MoE block's parameters moved after capture"
                )
                outputs = Replay.apply(x, residual, *capture.params)
                # The op consuming an output (the next layer's input norm, or the final norm) may write its gradient
                # straight into the backward graph's static input.
                for output, static in zip(outputs, capture.grads_out):
                    want_grad_in(output, static.detach())
                return torch.utils._pytree.tree_unflatten(list(outputs), capture.spec)
            return capture.eager(x, chunk, residual)

        block.forward = forward
        block.input_buffers = input_buffers
        setattr(block, GRAPHED_ATTR, True)
