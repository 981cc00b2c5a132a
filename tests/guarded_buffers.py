"""Kernel output buffers that catch what kernel tests must catch: every buffer starts as NaN (an unwritten element
poisons the result) and is followed by a guard region (a store past the end changes it; the Triton interpreter does
not raise on out-of-bounds stores). Tests swap a kernel module's `_alloc` for `GuardedBuffers.alloc`."""

import torch

GUARD_VALUE = 1234.5


class GuardedBuffers:
    def __init__(self, guard_elements: int):
        self.guard_elements = guard_elements
        self.buffers: list[tuple[torch.Tensor, int, tuple]] = []

    def alloc(self, shape, dtype, device):
        numel = 1
        for size in shape:
            numel *= size
        flat = torch.full((numel + self.guard_elements,), float("nan"), dtype=dtype, device=device)
        flat[numel:] = GUARD_VALUE
        self.buffers.append((flat, numel, tuple(shape)))
        return flat[:numel].view(shape)

    def check(self):
        assert self.buffers, "no kernel buffer was allocated: the kernel path did not run"
        for flat, numel, shape in self.buffers:
            is_intact = bool((flat[numel:] == GUARD_VALUE).all())
            assert is_intact, f"a kernel wrote past the end of a buffer of shape {shape}"
