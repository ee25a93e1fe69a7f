"""Moving a party's tensors between the host and its device without waiting for the device at every copy.

On a CUDA device, torch runs the work of a training step asynchronously: the host queues kernels and goes on. A copy
between host and device made without ``non_blocking`` stops that: the host waits until everything queued so far has
run (a *host sync*). A split-learning step copies a lot -- the batch's row ids in, every received tensor in, every
tensor it sends out (the wire format is bytes) -- and with a wait at each copy the GPU idles while the host works and
the host idles while the GPU works: on small batches the step then takes longer than on the CPU alone.

- :func:`to_device` and :func:`index_tensor` copy host tensors (and row ids) in through pinned (page-locked) memory
  with ``non_blocking``: no wait. torch's caching host allocator keeps the pinned buffer until the copy has run, and
  later kernels on the same stream see the copied values.
- :func:`to_host` copies every device tensor of a message (or of several messages) into pinned host memory with
  ``non_blocking`` and then waits once for all of them: one wait per message sent, not one per tensor.

On the CPU all three are the plain operations (no extra copies), so CPU runs are unchanged.
``tests/test_device.py`` counts the host reads of a training step on the CPU (the places a sync would happen on a
GPU); the ``gpu``-marked tests check the copies on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["to_device", "index_tensor", "to_host", "is_cuda", "device_here"]


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def device_here(name: str) -> str:
    """A run's ``--device`` for reading it on this machine: a CUDA device becomes the CPU where torch finds none, so a
    run trained on a GPU predicts and is attacked anywhere (its checkpoint loads on the CPU)."""
    return "cpu" if name.startswith("cuda") and not torch.cuda.is_available() else name


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.to(device=device, dtype=dtype)``; from the host to a CUDA device without a host sync."""
    if is_cuda(device) and t.device.type == "cpu":
        t = t.detach().pin_memory().to(device, non_blocking=True)
        return t if dtype is None or t.dtype is dtype else t.to(dtype)
    return t.to(device=device, dtype=dtype)


def index_tensor(ids: np.ndarray | Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Row ids as an index tensor on ``device`` (``torch.as_tensor(ids, device=device)`` without a host sync)."""
    t = torch.as_tensor(ids)
    return to_device(t, device) if is_cuda(device) else t


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host, with one wait for all that were on a CUDA device (host tensors come back as they
    are; a device tensor as a detached copy).

    Each device tensor is copied into pinned memory with ``non_blocking``; the copies queue behind the work that
    computes them, and the host waits once, on each device's current stream, before anything reads them. A tensor
    that appears several times (the same gradient sent to every party) is copied once.
    """
    out: list[torch.Tensor] = []
    copies: dict[int, torch.Tensor] = {}
    waits: set[torch.device] = set()
    for t in tensors:
        if t.is_cpu:
            out.append(t)
            continue
        host = copies.get(id(t))
        if host is None:
            if is_cuda(t.device):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t.detach(), non_blocking=True)
                waits.add(t.device)
            else:  # another accelerator: its own (blocking) copy
                host = t.detach().cpu()
            copies[id(t)] = host
        out.append(host)
    for device in waits:
        torch.cuda.current_stream(device).synchronize()
    return out
