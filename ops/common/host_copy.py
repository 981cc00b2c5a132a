"""Host copies of small device tensors whose producer already holds them, so ops read them without waiting for
the GPU; and copies to the GPU that do not wait either.

Reading a device tensor on the host (`.tolist()`, `.cpu()`) waits until the GPU has run everything queued before
it. The document bounds `cu_seqlens` are made on the host and copied to the GPU once per batch, then read back by
the ops that plan on the host (full attention's document buckets, linear attention's chunk layout). The data path
`remember`s its host copy beside the device tensor; `host_values` returns it while the device tensor is unchanged
(same object, same version counter), and otherwise reads the device once and remembers what it read.
"""

from __future__ import annotations

import weakref

import torch

# id(device tensor) -> (weak reference to it, its version when remembered, the host copy)
_copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def remember(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
    """Record that `host_tensor` (on the CPU) holds `device_tensor`'s values as they are now."""
    if host_tensor.device.type != "cpu" or host_tensor.shape != device_tensor.shape:
        raise ValueError(
            f"host_tensor: {host_tensor.device} {tuple(host_tensor.shape)} must be a CPU tensor of the device "
            f"tensor's shape {tuple(device_tensor.shape)}"
        )
    if host_tensor is device_tensor:
        # A CPU "device" tensor is its own host copy: an entry would hold it alive and never be dropped.
        return
    key = id(device_tensor)
    ref = weakref.ref(device_tensor, lambda _, key=key: _copies.pop(key, None))
    _copies[key] = (ref, device_tensor._version, host_tensor)


def host_values(t: torch.Tensor) -> torch.Tensor:
    """t's values on the CPU: the remembered copy while t is the remembered, unmodified tensor; else t read from
    its device, and remembered (the next layer asking for the same tensor does not wait again)."""
    entry = _copies.get(id(t))
    if entry is not None:
        ref, version, host = entry
        if ref() is t and t._version == version:
            return host
    host = t.cpu()
    if host is not t:
        remember(t, host)
    return host


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through page-locked memory, so the host does not wait for the copy (a
    copy from pageable memory waits for all the work queued before it)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
