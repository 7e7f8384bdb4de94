"""Launch scratch of the W4A16 kernels: who owns it, and how it stays safe across streams and graphs.

A plan that cuts a tile's k range between CTAs (a k split summed through global memory, stream-K,
the skinny kernel) needs two kinds of scratch:

- fp32 partial sums, written and read inside the launch. They are allocated per call from torch's
  caching allocator: a temporary like any other, so stream order, CUDA-graph pools and graph trees
  handle it (eager, `torch.cuda.graph` capture and `torch.compile(mode="reduce-overhead")` alike).
- tile counters (int32, one per output tile) that must read zero when the launch starts; every
  kernel leaves them zero (kernels/w4a16/fixup.cuh). They belong to the caller: the layers of a
  device share one set, made when the first layer's weight is set on or moved to that device
  (`layer_counters`, never inside a call), and a `Workspace` is the same for callers of the
  functional op. A call without counters, or whose plan needs more than they have, zero-fills fresh
  ones (one memset more). One shared set, not one per layer: under torch.compile every tensor a
  layer reads is a graph input whose guards are checked at every call (a decode step of a 32-layer
  model checked 128 more tensors), and layers on one stream never overlap anyway.

Nothing here is allocated lazily and kept: no tensor outlives the call that made it, except the
counters, which their owner made before any call.

Two streams never use the same counters at once: a launch with owned counters holds `_lock` while it
enqueues (`with StreamTurn(counters, index) as ptr:` outside this package), and when the counters were
last used on another stream, the current stream first waits for that stream's work so far (an event).
During graph capture nothing is recorded or waited on: the graph's launches run when it replays, ordered
like any other work on the tensors it uses.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ...runtime import current_stream_handle

# Tile counters a layer owns. Plans that split tiles keep their tile count small (stream-K and k
# splits are weighed only while the tiles fill fewer than a few waves: dispatch.py), so 4096 covers
# every plan the dispatcher makes on today's GPUs; a plan with more tiles gets fresh zeroed ones.
LAYER_COUNTERS = 4096

_lock = threading.Lock()
# counters' data_ptr -> (stream handle, torch stream) of their last launch outside capture
_owners: dict[int, tuple[int, torch.cuda.Stream]] = {}


_layer_counters: dict[int, torch.Tensor] = {}  # CUDA device index -> the counters its layers share


def new_counters(device, slots: int = LAYER_COUNTERS) -> torch.Tensor:
    """Zeroed tile counters on `device`, for a caller to own (a Workspace, the layers of a device)."""
    counters = torch.zeros(slots, dtype=torch.int32, device=device)
    if counters.is_cuda:
        weakref.finalize(counters, _owners.pop, counters.data_ptr(), None)
    return counters


def make_layer_counters(device: torch.device) -> None:
    """Make the counters the layers on CUDA `device` share, if not made yet: called when a layer's
    weight is set on or moved to the device, never inside a call."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        if index not in _layer_counters:
            _layer_counters[index] = new_counters(torch.device("cuda", index))


def layer_counters(device: torch.device) -> torch.Tensor | None:
    """The counters the layers on `device` share, or None (not a CUDA device, or none made)."""
    return _layer_counters.get(device.index) if device.type == "cuda" else None


class Workspace:
    """Tile counters for repeated functional calls (`tilefish.w4a16.matmul(..., workspace=ws)`,
    `tilefish.nf4.matmul`): made once on `device`, they save the per-call memset of fresh ones. One
    workspace serves any weight and any stream (streams take turns, see the module docstring).
    W4A16Linear / NF4Linear own theirs; they need none passed."""

    __slots__ = ("counters",)

    def __init__(self, device="cuda", slots: int = LAYER_COUNTERS):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        self.counters = new_counters(torch.device(device), slots)

    @property
    def device(self) -> torch.device:
        return self.counters.device

    def __repr__(self) -> str:
        return f"Workspace({self.counters.numel()} tile counters on {self.device})"


def check_counters(counters, device: torch.device) -> None:
    """Owned counters must be a contiguous int32 CUDA tensor on the call's device."""
    if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or counters.dim() != 1:
        raise TypeError(f"workspace counters must be a 1-D int32 tensor (tilefish.w4a16.Workspace), got "
                        f"{getattr(counters, 'dtype', type(counters).__name__)}")
    if counters.device != device:
        raise ValueError(f"the workspace is on {counters.device}, the call on {device}")
    if not counters.is_contiguous():
        raise ValueError("workspace counters must be contiguous")


def hand_over(counters: torch.Tensor, device_index: int, handle: int) -> None:
    """Make the current stream (`handle`) the user of `counters`; call with `_lock` held, and keep it
    until the launches that use them are enqueued. If another stream used them last, the current one
    waits for that stream's work so far first."""
    ptr = counters.data_ptr()
    owner = _owners.get(ptr)
    if owner is not None and owner[0] == handle:
        return
    if torch.cuda.is_current_stream_capturing():
        return
    current = torch.cuda.current_stream(device_index)
    if owner is not None:
        done = torch.cuda.Event()
        done.record(owner[1])
        current.wait_event(done)
    _owners[ptr] = (handle, current)


class StreamTurn:
    """``with StreamTurn(counters, index) as ptr:`` enqueue the launches that use owned `counters` (on CUDA
    device `index`, the current stream) inside the block: the current stream's turn with them (hand_over,
    `_lock` held); ptr is their data_ptr."""

    __slots__ = ("counters", "index")

    def __init__(self, counters: torch.Tensor, index: int):
        self.counters, self.index = counters, index

    def __enter__(self) -> int:
        _lock.acquire()
        try:
            hand_over(self.counters, self.index, current_stream_handle(self.index))
        except BaseException:
            _lock.release()
            raise
        return self.counters.data_ptr()

    def __exit__(self, *exc) -> None:
        _lock.release()
