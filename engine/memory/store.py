"""The two tiers of saved tensors: kept on the device (GPU tier) or copied into pooled host buffers (host tier).

`TieredStore.pack` / `unpack` are the saved-tensor hooks of a decoder layer's forward. Each saved tensor becomes an
Entry (one per tensor object: a tensor saved by several ops is stored once). On CUDA the device-to-host copies run on
their own stream into page-locked buffers of a pool that is allocated once and reused every step; the copies back
run on a second stream, `prefetch_layers` layers ahead of backward. On the CPU the host tier is a second pooled
buffer, so the same path (copy out, copy back, prefetch, budget) runs and is tested bitwise.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from .policy import OPERATOR_CLASSES, MemoryPolicy

# Host buffers are carved from chunks of this size, all alike (a power of two: torch's page-locked allocator rounds
# every request up to one); a tensor larger than what is left of a chunk is stored in pieces over several. So the
# pool is as large as one step's offloaded bytes, whatever the tensor sizes, and still fits when they change.
HOST_CHUNK_BYTES = 256 * 2**20
# The profiler range around every copy to or from the host tier (the per-operator breakdown counts them apart).
COPY_RANGE = "moe_tune_memory::host tier copy"
# Slots start at multiples of this: every dtype view is aligned, and copies start on a DMA-friendly boundary.
HOST_ALIGN_BYTES = 512


def _is_dense(t: torch.Tensor) -> bool:
    """True when the tensor's elements fill a contiguous span of memory (any order of dims, no gaps, no overlap),
    so it can be copied as one block and rebuilt with the same strides."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def is_parameter(t: torch.Tensor) -> bool:
    # Weights (and views of them: linear saves weight.t()) are not activations; under ZeRO-3 their data moves.
    base = t._base
    return _is_parameter(t) or (base is not None and _is_parameter(base))


def _is_parameter(t: torch.Tensor) -> bool:
    # isinstance(t, nn.Parameter) as nn.Parameter's metaclass decides it, without its Python __instancecheck__
    # (about 20 us a call, on every tensor autograd saves).
    return issubclass(type(t), nn.Parameter) or getattr(t, "_is_param", False)


class HostPool:
    """Host buffers handed out in order from reusable chunks; `reset()` rewinds once no slot is in use."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self.chunks: list[torch.Tensor] = []
        self.allocations = 0  # chunks allocated over the pool's life (constant once a step's layout repeats)
        self._chunk = 0
        self._offset = 0

    @property
    def capacity_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def reset(self) -> None:
        self._chunk, self._offset = 0, 0

    def take(self, nbytes: int) -> list[torch.Tensor]:
        """uint8 host buffers that hold nbytes together, in order: one, or pieces over consecutive chunks."""
        pieces = []
        while nbytes > 0:
            if self._chunk == len(self.chunks):
                self.chunks.append(torch.empty(HOST_CHUNK_BYTES, dtype=torch.uint8, pin_memory=self.pin_memory))
                self.allocations += 1
            chunk = self.chunks[self._chunk]
            size = min(nbytes, chunk.numel() - self._offset)
            if size > 0:
                pieces.append(chunk[self._offset : self._offset + size])
                nbytes -= size
                self._offset += -(-size // HOST_ALIGN_BYTES) * HOST_ALIGN_BYTES
            if self._offset >= chunk.numel():
                self._chunk, self._offset = self._chunk + 1, 0
        return pieces


def _byte_span(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense tensor (_is_dense) as one flat uint8 view, in memory order."""
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    return flat.view(torch.uint8)


class Entry:
    """One saved tensor: on the device (`device`), in a host slot (`host`), or both while a copy is in flight."""

    __slots__ = ("layer", "klass", "nbytes", "size", "stride", "dtype", "dev", "device", "host", "out_event",
                 "fetched", "in_event", "refs", "__weakref__")  # fmt: skip

    def __init__(self, t: torch.Tensor, layer: int, klass: str):
        self.layer, self.klass = layer, klass
        self.refs = 1  # saves of this tensor whose unpack is still to come
        self.nbytes = t.numel() * t.element_size()
        self.size, self.stride, self.dtype, self.dev = t.shape, t.stride(), t.dtype, t.device
        # Detached: an op that saves its own output would otherwise close a cycle the garbage collector cannot see
        # through (t.grad_fn -> saved variable -> Entry -> t), leaking the graph when backward never runs.
        self.device: torch.Tensor | None = t.detach()
        self.host: list[torch.Tensor] | None = None  # its bytes in host buffers (HostPool.take)
        self.out_event = None
        self.fetched: torch.Tensor | None = None
        self.in_event = None


@dataclass
class StepStats:
    """What the store did since the last `take_stats()`: sums over every forward and backward in that time (a
    training step's micro-batches)."""

    gpu_bytes: int = 0  # saved tensors left on the device at the end of forward
    # The device storage those tensors keep alive, each storage once: more than gpu_bytes where a saved view holds a
    # larger tensor's memory (which the budget, counting each tensor's own bytes, does not see).
    gpu_storage_bytes: int = 0
    host_bytes: int = 0  # saved tensors copied to the host tier (offloaded or evicted by the budget)
    evicted_bytes: int = 0  # of host_bytes, those the budget moved
    host_bytes_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATOR_CLASSES, 0))
    gpu_bytes_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATOR_CLASSES, 0))
    unpacks: int = 0  # saved tensors backward asked for
    hits: int = 0  # of those, found on the device or already on their way back (prefetched)
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    wait_s: float = 0.0  # time backward waited for a swap-in


class TieredStore:
    """Saved-tensor hooks with a GPU tier and a host tier, a budget for the first and prefetch from the second."""

    def __init__(self, policy: MemoryPolicy, num_layers: int):
        self.policy = policy
        self.num_layers = num_layers
        self.is_cuda: bool | None = None
        self.pool: HostPool | None = None
        self._streams = None
        # CUDA: (kind, start event, end event, bytes) of copies and waits not yet added to the stats.
        self._timings: list = []
        self.stats = StepStats()
        self._begin_forward_state()
        self._live_host: weakref.WeakSet[Entry] = weakref.WeakSet()

    def _begin_forward_state(self) -> None:
        self.layer = -1
        self.klass = "activation"
        self._by_id: dict[int, tuple[weakref.ref, int, Entry]] = {}
        self._resident: list[Entry] = []  # budgeted entries on the device, coldest first
        self._resident_bytes = 0
        self._by_layer: dict[int, list[weakref.ref]] = defaultdict(list)
        self._prefetched: set[int] = set()
        self._backward_started: set[int] = set()
        # Tensors saved during the current layer, held until it ends: autograd may save the same tensor again, and only
        # a live tensor object is recognised as the same (the memory of those copied out is freed when the layer ends).
        self._held: list[torch.Tensor] = []

    def end_layer(self) -> None:
        self._held.clear()

    def begin_forward(self, device: torch.device) -> None:
        if self.pool is None:
            self.is_cuda = device.type == "cuda"
            self.pool = HostPool(pin_memory=self.is_cuda)
            if self.is_cuda:
                self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        # Slots of an earlier forward whose backward never ran stay taken: the pool grows past them instead.
        if not len(self._live_host):
            self.pool.reset()
        if self.is_cuda:
            # Copies into reused slots must follow the last step's copies out of them.
            d2h, h2d = self._streams
            d2h.wait_stream(h2d)
            # Timings of a forward whose stats are never taken (backward never ran) must not pile up.
            self._add_timings(wait=False)
        self._begin_forward_state()

    def end_forward(self) -> None:
        """Forward is done: count what stays on the device, start bringing back the layers backward needs first."""
        # From the per-layer list, not _by_id: a dead tensor's id() can be reused, which replaces its entry there.
        storages: dict[int, int] = {}
        for refs in self._by_layer.values():
            for ref in refs:
                entry = ref()
                if entry is None or entry.device is None:
                    continue
                self.stats.gpu_bytes += entry.nbytes
                self.stats.gpu_bytes_by_class[entry.klass] += entry.nbytes
                storage = entry.device.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        self.stats.gpu_storage_bytes += sum(storages.values())
        self._by_id.clear()
        self._resident.clear()
        top = self.num_layers - 1
        for layer in range(top, top - self.policy.prefetch_layers, -1):
            self._prefetch_layer(layer)

    def pack(self, t: torch.Tensor):
        if is_parameter(t):
            return t
        known = self._by_id.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            known[2].refs += 1
            return known[2]
        entry = Entry(t, self.layer, self.klass)
        self._held.append(t)
        self._by_id[id(t)] = (weakref.ref(t), t._version, entry)
        self._by_layer[self.layer].append(weakref.ref(entry))
        movable = (
            entry.nbytes >= max(self.policy.min_offload_bytes, 1)
            and t.layout == torch.strided
            and t.device.type == ("cuda" if self.is_cuda else "cpu")
            and _is_dense(t)
        )
        if movable and self.policy.choice(self.klass) == "offload":
            self._copy_out(entry)
        elif movable and self.policy.gpu_budget_bytes is not None:
            self._resident.append(entry)
            self._resident_bytes += entry.nbytes
            self._enforce_budget()
        return entry

    def _enforce_budget(self) -> None:
        # Forward saves the hottest tensors last (backward runs in reverse): sink the oldest first.
        while self._resident_bytes > self.policy.gpu_budget_bytes and self._resident:
            entry = self._resident.pop(0)
            self._resident_bytes -= entry.nbytes
            self.stats.evicted_bytes += entry.nbytes
            self._copy_out(entry)

    @torch.no_grad()
    def _copy_out(self, entry: Entry) -> None:
        t = entry.device
        host = self.pool.take(entry.nbytes)
        src = _byte_span(t)
        if self.is_cuda:
            d2h, _ = self._streams
            start, end = _timing_events()
            d2h.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(d2h):
                start.record()
                _copy_pieces(host, src, to_pieces=True, non_blocking=True)
                end.record()
            # The caching allocator must not hand t's memory out again before the copy has read it.
            t.record_stream(d2h)
            entry.out_event = end
            self._timings.append(("d2h", start, end, entry.nbytes))
        else:
            t0 = time.perf_counter()
            _copy_pieces(host, src, to_pieces=True)
            self.stats.d2h_s += time.perf_counter() - t0
        entry.host, entry.device = host, None
        self._live_host.add(entry)
        self.stats.host_bytes += entry.nbytes
        self.stats.host_bytes_by_class[entry.klass] += entry.nbytes
        self.stats.d2h_bytes += entry.nbytes

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        entry: Entry = packed
        self.stats.unpacks += 1
        if entry.layer not in self._backward_started:
            # Layer L's backward begins: swap in the layers `prefetch_layers` below it (L itself came earlier).
            self._backward_started.add(entry.layer)
            for layer in range(entry.layer - 1, entry.layer - self.policy.prefetch_layers - 1, -1):
                self._prefetch_layer(layer)
        if entry.device is not None:
            self.stats.hits += 1
            return entry.device
        if entry.fetched is not None:
            self.stats.hits += 1
        else:
            t0 = time.perf_counter()
            self._copy_in(entry)
            if not self.is_cuda:
                self.stats.wait_s += time.perf_counter() - t0
        return self._take_fetched(entry)

    def _prefetch_layer(self, layer: int) -> None:
        if layer < 0 or layer in self._prefetched:
            return
        self._prefetched.add(layer)
        # Backward needs a layer's tensors in about the reverse of the order forward saved them.
        for ref in reversed(self._by_layer.get(layer, [])):
            entry = ref()
            if entry is not None and entry.host is not None and entry.fetched is None:
                self._copy_in(entry)

    @torch.no_grad()
    def _copy_in(self, entry: Entry) -> None:
        if self.is_cuda:
            _, h2d = self._streams
            start, end = _timing_events()
            with torch.cuda.stream(h2d):
                h2d.wait_event(entry.out_event)
                start.record()
                fetched = torch.empty_strided(entry.size, entry.stride, dtype=entry.dtype, device=entry.dev)
                _copy_pieces(entry.host, _byte_span(fetched), to_pieces=False, non_blocking=True)
                end.record()
            entry.in_event = end
            self._timings.append(("h2d", start, end, entry.nbytes))
        else:
            t0 = time.perf_counter()
            fetched = torch.empty_strided(entry.size, entry.stride, dtype=entry.dtype, device=entry.dev)
            _copy_pieces(entry.host, _byte_span(fetched), to_pieces=False)
            self.stats.h2d_s += time.perf_counter() - t0
        entry.fetched = fetched
        self.stats.h2d_bytes += entry.nbytes

    def _take_fetched(self, entry: Entry) -> torch.Tensor:
        fetched = entry.fetched
        if self.is_cuda and entry.in_event is not None:
            # The GPU time between these two events is time backward's stream stood still for the swap-in.
            current = torch.cuda.current_stream(fetched.device)
            start, end = _timing_events()
            start.record(current)
            current.wait_event(entry.in_event)
            end.record(current)
            self._timings.append(("wait", start, end, 0))
            fetched.record_stream(current)
            entry.in_event = None
        entry.refs -= 1
        if entry.refs <= 0:
            # Autograd holds the returned tensor for as long as its node needs it; the host copy stays for an
            # unexpected second ask.
            entry.fetched = None
        return fetched

    def take_stats(self) -> StepStats:
        """The stats since the last call (on CUDA this waits for the copies, to read their timings)."""
        self._add_timings(wait=True)
        stats, self.stats = self.stats, StepStats()
        return stats

    def _add_timings(self, wait: bool) -> None:
        """Add the GPU time of the recorded copies and waits to the stats: all of them (wait: after a synchronize),
        or those already finished."""
        if not self._timings:
            return
        if wait:
            torch.cuda.synchronize()
        pending = []
        for kind, start, end, nbytes in self._timings:
            if not wait and not end.query():
                pending.append((kind, start, end, nbytes))
                continue
            seconds = start.elapsed_time(end) / 1e3
            if kind == "d2h":
                self.stats.d2h_s += seconds
            elif kind == "h2d":
                self.stats.h2d_s += seconds
            else:
                self.stats.wait_s += seconds
        self._timings = pending


def _copy_pieces(pieces: list[torch.Tensor], span: torch.Tensor, to_pieces: bool, non_blocking: bool = False) -> None:
    """Copy a tensor's bytes (span) into its host pieces, or back."""
    offset = 0
    with torch.profiler.record_function(COPY_RANGE):
        for piece in pieces:
            part = span[offset : offset + piece.numel()]
            if to_pieces:
                piece.copy_(part, non_blocking=non_blocking)
            else:
                part.copy_(piece, non_blocking=non_blocking)
            offset += piece.numel()


def _timing_events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
