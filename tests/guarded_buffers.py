"""Kernel output buffers that catch what kernel tests must catch: every buffer starts as NaN (an unwritten element
poisons the result) and is followed by a guard region (a store past the end changes it; the Triton interpreter does
not raise on out-of-bounds stores). Tests swap a kernel module's `_alloc` for `GuardedBuffers.alloc` (and the MoE
kernels' int32 `_alloc_index` for `GuardedBuffers.alloc_index`: int32 has no NaN, so those start as INDEX_FILL)."""

import torch

GUARD_VALUE = 1234.5
# A fresh int32 buffer holds INDEX_FILL (no expert, row or tile index is below -1) and is followed by INDEX_GUARD.
INDEX_FILL = -7
INDEX_GUARD = 0x5EED


class GuardedBuffers:
    def __init__(self, guard_elements: int):
        self.guard_elements = guard_elements
        self.buffers: list[tuple[torch.Tensor, int, tuple]] = []  # (flat buffer, elements in use, shape)
        self._guard_values: list[float] = []  # each buffer's

    def alloc(self, shape, dtype, device):
        return self._alloc(shape, dtype, device, float("nan"), GUARD_VALUE)

    def alloc_index(self, shape, device):
        return self._alloc(shape, torch.int32, device, INDEX_FILL, INDEX_GUARD)

    def _alloc(self, shape, dtype, device, fill, guard):
        numel = 1
        for size in shape:
            numel *= size
        flat = torch.full((numel + self.guard_elements,), fill, dtype=dtype, device=device)
        flat[numel:] = guard
        self.buffers.append((flat, numel, tuple(shape)))
        self._guard_values.append(guard)
        return flat[:numel].view(shape)

    def check(self):
        assert self.buffers, "no kernel buffer was allocated: the kernel path did not run"
        for (flat, numel, shape), guard in zip(self.buffers, self._guard_values, strict=True):
            is_intact = bool((flat[numel:] == guard).all())
            assert is_intact, f"a kernel wrote past the end of a {flat.dtype} buffer of shape {shape}"
