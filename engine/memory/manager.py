"""Selective caching of a model's decoder layers: which operator class a saved tensor belongs to, where it is kept,
which modules are recomputed, and the per-step metrics.

Mechanisms, all PyTorch's own:
- forward pre/post hooks on every classified module keep a stack of "the operator class running now";
- a decoder layer's forward runs under `torch.autograd.graph.saved_tensors_hooks` whose pack reads that stack and
  keeps the tensor on the GPU or copies it to the host tier (store.py);
- each outermost module of a recomputed class runs under non-reentrant activation checkpoint, applied through
  hooks (`torch.distributed._composable.checkpoint`), so module names and state-dict keys do not change. Everything
  inside such a module is recomputed with it; its inputs are saved under the enclosing class.
Our Triton ops are autograd Functions called inside modules, so what they save is classified like any other op.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from moe_tune.engine.model.model import ACTIVATION_MEMORY_ATTR, MoECausalLM
from moe_tune.engine.model.projections import CLASS_SCOPE_HOOK
from moe_tune.profiles.schema import MemoryProfile

from .policy import BYTES_PER_GB, MemoryPolicy, operator_class, resolve_policy
from .store import TieredStore, is_parameter


class ActivationMemory:
    """Selective caching for the decoder layers of one model. `run_layer` is called by the model's layer loop."""

    def __init__(self, layers: nn.ModuleList, policy: MemoryPolicy, chunked: list[nn.Module] | None = None):
        """chunked: modules that run inside sequence chunks (MoECausalLM.sequence_chunked_modules), recomputed whole
        with their chunk: no recompute region is made in them, which would recompute their code a third time."""
        self.policy = policy
        self._chunked = set(chunked or [])
        self.store = TieredStore(policy, len(layers))
        self.regions: list[nn.Module] = []
        self._region_set: set[nn.Module] = set()
        # The classes of the modules whose forward is running, innermost last (the store holds the innermost).
        self._class_stack: list[str] = []
        self._in_forward = False
        self._counting: list = []
        self._recomputed_bytes = 0
        self._recomputations = 0
        self._region_runs = 0
        for layer in layers:
            # The decoder layer is the scope of the saved-tensor hooks, never a region itself.
            self._instrument(layer, "activation", inside_region=False, is_layer=True)

    def _instrument(self, module: nn.Module, parent_class: str, inside_region: bool, is_layer: bool = False) -> None:
        own = operator_class(module)
        klass = own or parent_class
        inside_region = inside_region or module in self._chunked
        is_region = own is not None and not inside_region and not is_layer and self.policy.choice(own) == "recompute"
        if is_region:
            self._make_region(module)
        if hasattr(module, "saves_op_intermediates") and self.policy.choice(klass) == "offload":
            # A token mixer whose op could keep its kernels' intermediates (several times its inputs' bytes) would
            # send them over PCIe too: its backward recomputes them instead.
            module.saves_op_intermediates = False
        if own is not None:
            module.register_forward_pre_hook(self._class_pre_hook(own))
            module.register_forward_hook(self._class_post_hook(), always_call=True, prepend=True)
        # A layer's projections of one input (`shared_input_projections`) run as one autograd node where they can
        # (engine/model/projections.py), which a recompute region on each would keep from applying; a recomputed
        # linear layer saves its input all the same, so they are left out of regions (their rank products stay).
        shared = {getattr(module, name) for name in getattr(module, "shared_input_projections", ())}
        for child in module.children():
            self._instrument(child, klass, inside_region or is_region or child in shared)

    def _make_region(self, module: nn.Module) -> None:
        from torch.distributed._composable import checkpoint

        checkpoint(module, context_fn=lambda: (nullcontext(), self._recompute_context(module)))
        self.regions.append(module)
        self._region_set.add(module)

    def _class_pre_hook(self, klass: str):
        def hook(module, args):
            self._class_stack.append(self.store.klass)
            self.store.klass = klass
            if module in self._region_set and self._in_forward and _checkpoint_enabled(module):
                self._begin_counting()

        # Outside a region it only sets the class: engine/model/projections may run it around a shared node.
        setattr(hook, CLASS_SCOPE_HOOK, True)
        return hook

    def _class_post_hook(self):
        def hook(module, args, output):
            if module in self._region_set and self._in_forward and _checkpoint_enabled(module):
                self._end_counting()
            self.store.klass = self._class_stack.pop()

        setattr(hook, CLASS_SCOPE_HOOK, True)
        return hook

    def _begin_counting(self) -> None:
        """Between a region's checkpoint hooks and its code: count what the checkpoint drops, then hand it on.

        torch has no public getter for the hooks in force; this one private call reads them (torch >= 2.8)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] == self.store.pack:
            # Nothing in the region needs a gradient: checkpoint left the hooks alone and saves nothing.
            self._counting.append(None)
            return
        checkpoint_pack, checkpoint_unpack = top
        seen: dict[int, weakref.ref] = {}

        def pack(t):
            # Weights are not recomputed; a tensor saved by several ops of the region counts once.
            if not is_parameter(t) and not (id(t) in seen and seen[id(t)]() is t):
                seen[id(t)] = weakref.ref(t)
                self._recomputed_bytes += t.numel() * t.element_size()
            return checkpoint_pack(t)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, checkpoint_unpack)
        hooks.__enter__()
        self._counting.append(hooks)
        self._region_runs += 1

    def _end_counting(self) -> None:
        hooks = self._counting.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    @contextmanager
    def _recompute_context(self, module: nn.Module):
        """Around a region's recomputation in backward: count it, and undo what its forward writes to buffers (the
        MoE block's expert load counts), so that recomputing does not count twice."""
        self._recomputations += 1
        saved = [(b, b.detach().clone()) for b in module.buffers()]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

    def run_layer(self, index: int, layer: nn.Module, x: torch.Tensor, batch):
        if index == 0:
            self.store.begin_forward(x.device)
        self.store.layer = index
        self.store.klass = "activation"
        self._in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.store.pack, self.store.unpack):
                out = layer(x, batch)
        finally:
            self._in_forward = False
            self.store.end_layer()
        if index == self.store.num_layers - 1:
            self.store.end_forward()
        return out

    def step_metrics(self) -> dict[str, float | int | None]:
        """Metrics since the last call, as flat `memory_*` keys of a metrics.jsonl record. Bytes, counts and times
        are summed over every forward and backward since then (a step's micro-batches); the hit rate and bandwidths
        are over all of them; the host pool's size is its size now."""
        s = self.store.take_stats()
        record = {
            "memory_gpu_saved_bytes": s.gpu_bytes,
            "memory_gpu_storage_bytes": s.gpu_storage_bytes,
            "memory_host_saved_bytes": s.host_bytes,
            "memory_evicted_bytes": s.evicted_bytes,
            "memory_recomputed_bytes": self._recomputed_bytes,
            "memory_recomputed_modules": self._region_runs,
            "memory_recomputations": self._recomputations,
            "memory_cache_hit_rate": s.hits / s.unpacks if s.unpacks else None,
            "memory_d2h_gb_per_s": s.d2h_bytes / s.d2h_s / BYTES_PER_GB if s.d2h_bytes and s.d2h_s > 0 else None,
            "memory_h2d_gb_per_s": s.h2d_bytes / s.h2d_s / BYTES_PER_GB if s.h2d_bytes and s.h2d_s > 0 else None,
            "memory_swap_wait_s": s.wait_s,
            "memory_host_pool_bytes": self.store.pool.capacity_bytes if self.store.pool is not None else 0,
        }
        for klass, nbytes in s.host_bytes_by_class.items():
            record[f"memory_host_bytes_{klass}"] = nbytes
        for klass, nbytes in s.gpu_bytes_by_class.items():
            record[f"memory_gpu_bytes_{klass}"] = nbytes
        self._recomputed_bytes = self._recomputations = self._region_runs = 0
        return record


def _checkpoint_enabled(module: nn.Module) -> bool:
    """True while the module's checkpoint hooks are active: in forward, not while backward recomputes it."""
    from torch.distributed._composable import checkpoint

    return checkpoint.state(module).enable_hook


def attach_activation_memory(model: nn.Module, memory: MemoryProfile) -> ActivationMemory | None:
    """Put the profile's selective caching on the decoder layers of `model` (PEFT and LoRA layers already in place),
    and its sequence chunks (memory.sequence_chunk_tokens) on the per-token part of every layer. None when
    `memory.activation_checkpointing` asks for whole-layer recomputation instead, or when the policy keeps every saved
    tensor where autograd leaves it (`none`, no budget): then the layers run without the saved-tensor hooks, whose
    host time on every saved tensor buys nothing there (profiles/tiny.yaml on 2 CPU cores: 164.5 ms a step with them,
    153.5 without)."""
    policy = resolve_policy(memory)
    lm = _language_model(model)
    # Sequence chunks are set whatever the policy: they recompute on their own (blocks.recomputed).
    lm.set_sequence_chunk_tokens(memory.sequence_chunk_tokens)
    if memory.activation_checkpointing or policy.keeps_everything:
        return None
    manager = ActivationMemory(lm.layers, policy, lm.sequence_chunked_modules())
    setattr(lm, ACTIVATION_MEMORY_ATTR, manager)
    return manager


def find_activation_memory(model: nn.Module) -> ActivationMemory | None:
    return getattr(_language_model(model), ACTIVATION_MEMORY_ATTR, None)


def _language_model(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, MoECausalLM):
            return module
    raise TypeError(f"no MoECausalLM inside {type(model).__name__}")
