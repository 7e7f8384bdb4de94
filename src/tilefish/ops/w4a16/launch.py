"""The W4A16 op: validate -> pick a plan (dispatch.py) -> get the kernel -> launch.

matmul_impl is the op (CPU tensors: the float64 reference). A LaunchPlan holds every launch of one
(weight, bias, m, device), decided once: the configuration, grid, shared memory, the scratch it needs
(workspace.py) and every argument but x, the output and that scratch; the launchers (_mma_launches,
_hopper_launches, _skinny_launches) build it for each kernel.

Switches for A/Bs and sweeps live here, where they are read: set them on this module
(tilefish.ops.w4a16.launch), not on the package, which only re-exports names.
"""
from __future__ import annotations

import functools

import torch

from ...runtime import (cluster_capacity, current_stream_handle, device_info, get_kernel, i32, launch_prepared,
                        prepare_launch)
from ...runtime.tma import tensor_map_rows
from .configs import (HOPPER_BK, MAX_CLUSTER_SLICES, ONE_CTA_PER_SM_SMEM, SKINNY_BK, THREADS, GemmConfig, HopperConfig,
                      SkinnyConfig, column_tiles, kernel_spec)
from .dispatch import choose_hopper_slices, choose_plan, choose_slices
from .tuned import TunedTable, gpu_key, table_for
from .layout import BK, CODEBOOKS, DTYPES, W4A16Weight, check_shape, unpack
from .workspace import _lock as _workspace_lock
from .workspace import check_counters, hand_over

HOPPER_DSMEM_SPLIT = True  # False: every k split sums through the global workspace (A/B, sweeps)
HOPPER_SEPARATE_TAIL = "rule"  # _separate_tail: "rule"; "never" / "always" (any partial wave that fits) for A/Bs


# ---- the op ---------------------------------------------------------------------------------------------------

def validate(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, W4A16Weight):
        raise TypeError(f"w must be a W4A16Weight (tilefish.w4a16.quantize / from_gptq / from_awq), got {type(w).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if w.scales.dtype != x.dtype:
        raise TypeError(f"x is {x.dtype} but the weight's scales are {w.scales.dtype}; convert one of them "
                        "(W4A16Weight.scales.to(...))")
    if x.dim() == 0:
        raise ValueError(f"x must be [..., k] with k = {w.k}; got a 0-D tensor")
    if x.shape[-1] != w.k:
        raise ValueError(f"x has k={x.shape[-1]} (last dim) but the weight has in_features k={w.k}")
    check_shape(w.n, w.k, w.group_size)
    if w.codebook not in CODEBOOKS or (w.codebook == "nf4" and (w.zeros is not None or w.group_size == -1)):
        raise ValueError(f"codebook {w.codebook!r}: int4, or nf4 with group scales and no zero points")
    if w.packed.dtype != torch.int32 or w.packed.shape != (w.n // 64, 8 * w.k):
        raise ValueError(f"packed must be int32 [n/64, 8k] = {(w.n // 64, 8 * w.k)}, got {w.packed.dtype} "
                         f"{tuple(w.packed.shape)}")
    groups = 1 if w.group_size == -1 else w.k // w.group_size
    if w.scales.shape != (groups, w.n):
        raise ValueError(f"scales must be [groups, n] = {(groups, w.n)}, got {tuple(w.scales.shape)}")
    if w.zeros is not None and (w.zeros.dtype != x.dtype or w.zeros.shape != (groups, w.n)):
        raise ValueError(f"zeros must be {x.dtype} [groups, n] = {(groups, w.n)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != x.dtype or bias.shape != (w.n,):
            raise ValueError(f"bias must be a {x.dtype} tensor of shape ({w.n},)")
    if w.perm is not None and (not isinstance(w.perm, torch.Tensor) or w.perm.dtype not in (torch.int32, torch.int64)
                               or w.perm.shape != (w.k,)):
        raise ValueError(f"perm must be an int32/int64 tensor of shape ({w.k},), got "
                         f"{getattr(w.perm, 'dtype', type(w.perm).__name__)} {tuple(getattr(w.perm, 'shape', ()))}")
    dev = x.device
    if (w.packed.device != dev or w.scales.device != dev or (w.zeros is not None and w.zeros.device != dev)
            or (bias is not None and bias.device != dev) or (w.perm is not None and w.perm.device != dev)):
        tensors = {"x": x, "packed": w.packed, "scales": w.scales, "zeros": w.zeros, "bias": bias, "perm": w.perm}
        raise ValueError("all tensors must be on one device; got "
                         + ", ".join(f"{a} on {t.device}" for a, t in tensors.items() if t is not None))


def matmul_impl(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None = None,
                cfg: GemmConfig | HopperConfig | SkinnyConfig | None = None, slices: int | None = None,
                ctas: int | None = None, workspace=None) -> torch.Tensor:
    """cfg: a configuration to force (sweeps, tests); None: the dispatcher's. slices: the k split of
    a tile kernel (mma.sync, wgmma tile mode); ctas: the grid of a stream-K one (skinny, wgmma
    streamk); None: the dispatcher's choice. Giving the one the plan's kernel does not take is a
    ValueError (on CUDA, where the plan is made). workspace: a workspace.Workspace, or the int32
    tile counters a layer owns; None: fresh zeroed counters where the plan needs them."""
    validate(x, w, bias)
    if slices is not None:
        _check_count("slices", slices)
    if ctas is not None:
        _check_count("ctas", ctas)
    counters = getattr(workspace, "counters", workspace)
    flat = x.dim() == 2  # the common case: no reshape in or out (~2 us each)
    lead = x.shape[:-1]
    x2 = x if flat else x.reshape(-1, w.k)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    if x.device.type == "cpu":
        from ...reference import dense_matmul, w4a16_matmul

        if w.codebook == "int4":
            return w4a16_matmul(x2, unpack(w), bias).reshape(*lead, w.n)
        return dense_matmul(x2, w.dequantize(torch.float64), bias).reshape(*lead, w.n)
    if x.device.type != "cuda":
        raise ValueError(f"W4A16 runs on CUDA or CPU tensors, not {x.device}")
    if counters is not None:
        check_counters(counters, x.device)
    x2 = x2.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # the kernel reads bias[col] by pointer: a strided view gets an explicit copy
    m = x2.shape[0]
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, w.n)
    if x2.data_ptr() % 16:  # an offset view: the kernels read x in 16-byte (TMA: aligned) pieces
        x2 = x2.clone()
    LaunchPlan.build(w, bias, m, x.device, cfg, slices, ctas, counters).launch(x2.data_ptr(), out.data_ptr())
    return out if flat else out.reshape(*lead, w.n)


def _check_count(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int or None, got {v!r}")


class LaunchPlan:
    """The kernel launches of one (weight, bias, m, device): the configuration, grid, shared memory,
    the scratch they need and every argument but x, the output and that scratch, decided once. The
    op builds one a call; W4A16Linear keeps one per input shape and stream, so an eager call only
    allocates the output (and the plan's fp32 partials, if it has any) and launches.

    Scratch (workspace.py): `partials` fp32 sums, allocated per launch; `tiles` counters, the
    owner's `counters` when given and large enough (taken in turn by streams), else fresh zeros."""

    __slots__ = ("launches", "keep", "m", "k", "dtype", "device", "partials", "tiles", "counters")

    def __init__(self, launches: list[tuple], keep: tuple, m: int, k: int, dtype: torch.dtype, device: torch.device,
                 partials: int, tiles: int, counters: torch.Tensor | None):
        self.launches = launches  # (kernel, launch config, TMA box of x or None: x by pointer, args before out,
        #                            args after out and the two scratch pointers)
        self.keep = keep          # tensors the arguments point into (weight, bias): kept alive
        self.m, self.k, self.dtype, self.device = m, k, dtype, device
        self.partials, self.tiles = partials, tiles  # fp32 partial sums, tile counters the launches need
        self.counters = counters if counters is not None and tiles <= counters.numel() else None

    @classmethod
    def build(cls, w: W4A16Weight, bias: torch.Tensor | None, m: int, device: torch.device,
              cfg=None, slices: int | None = None, ctas: int | None = None,
              counters: torch.Tensor | None = None) -> "LaunchPlan":
        """w and bias already validated (validate), on `device` and contiguous; m >= 1. slices / ctas:
        matmul_impl's; counters: owned tile counters (checked), or None."""
        for name, t in (("packed", w.packed), ("scales", w.scales), ("zeros", w.zeros)):
            if t is not None and (t.data_ptr() % 16 or not t.is_contiguous()):
                raise ValueError(f"{name} must be contiguous and 16-byte aligned for the CUDA kernel")
        info = device_info(device.index)
        if cfg is None:
            plan = choose_plan(m, w.n, w.k, info.sm_count, info.cc, w.group_size, _device_clusters(info), w.dtype,
                               w.codebook, _device_table(info), info.smem_per_block_optin, w.zeros is not None)
            cfg = plan.cfg
            if slices is None and ctas is None:
                slices, ctas = plan.slices, plan.ctas
        if cfg.streamk and slices is not None:
            raise ValueError(f"config {cfg.label()} is stream-K: it takes ctas (its grid), not slices (a k split)")
        if not cfg.streamk and ctas is not None:
            raise ValueError(f"config {cfg.label()} splits k: it takes slices, not ctas (a stream-K grid)")
        if isinstance(cfg, HopperConfig):
            launches, partials, tiles = _hopper_launches(cfg, m, w, bias, slices, ctas, info)
        elif isinstance(cfg, SkinnyConfig):
            launches, partials, tiles = _skinny_launches(cfg, m, w, bias, ctas, info)
        else:
            launches, partials, tiles = _mma_launches(cfg, m, w, bias, slices, info)
        return cls(launches, (w.packed, w.scales, w.zeros, bias), m, w.k, w.dtype, torch.device("cuda", info.index),
                   partials, tiles, counters)

    def launch(self, x_ptr: int, out_ptr: int) -> None:
        """x_ptr: x as [m, k] contiguous, 16-byte aligned, on the plan's device; out_ptr: [m, n] contiguous."""
        partials = torch.empty(self.partials, dtype=torch.float32, device=self.device) if self.partials else None
        ws = 0 if partials is None else partials.data_ptr()
        if not self.tiles:
            self._enqueue(x_ptr, out_ptr, ws, 0)
        elif self.counters is None:
            fresh = torch.zeros(self.tiles, dtype=torch.int32, device=self.device)
            self._enqueue(x_ptr, out_ptr, ws, fresh.data_ptr())
        else:
            index = self.device.index
            with _workspace_lock:
                hand_over(self.counters, index, current_stream_handle(index))
                self._enqueue(x_ptr, out_ptr, ws, self.counters.data_ptr())

    def _enqueue(self, x_ptr: int, out_ptr: int, ws_ptr: int, counters_ptr: int) -> None:
        for kern, config, box, head, tail in self.launches:
            xa = x_ptr if box is None else tensor_map_rows(x_ptr, self.m, self.k, self.dtype, self.device.index, *box)
            launch_prepared(kern, config, xa, *head, out_ptr, ws_ptr, counters_ptr, *tail)


def _weight_args(w: W4A16Weight, bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (w.packed.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr() if w.zeros is not None else 0,
            bias.data_ptr() if bias is not None else 0)


def _mma_launches(cfg: GemmConfig, m: int, w: W4A16Weight, bias, slices: int | None, info):
    """The mma.sync kernel (any GPU): grid (m tiles, n tiles, k slices)."""
    if w.n % cfg.bn:
        raise ValueError(f"config {cfg.label()} needs n % {cfg.bn} == 0 (n={w.n})")
    if cfg.swap and m > 8:
        raise ValueError(f"config {cfg.label()} (swapped operands) handles m <= 8, got m={m}")
    asym = w.zeros is not None
    n_tiles, m_tiles, k_tiles = w.n // cfg.bn, -(-m // cfg.bm), -(-w.k // BK)  # k % 128 == 64: a half last tile
    tiles = n_tiles * m_tiles
    slices = slices or choose_slices(tiles, k_tiles, info.sm_count)
    slices = max(1, min(slices, k_tiles))
    split = slices > 1
    kern = _kernel(w.dtype, cfg, w.group_size, asym, w.packed.device.index, w.codebook)
    config = prepare_launch(kern, (m_tiles, n_tiles, slices), THREADS, _smem_bytes(cfg, w.group_size, asym))
    tail = (i32(m), i32(w.n), i32(w.k), i32(slices))
    return ([(kern, config, None, _weight_args(w, bias), tail)], tiles * slices * cfg.bm * cfg.bn if split else 0,
            tiles if split else 0)


def _device_clusters(info) -> tuple[tuple[int, int], ...]:
    """The cluster capacity the sm_90 dispatcher plans with (one CTA an SM); () elsewhere, and ()
    while HOPPER_DSMEM_SPLIT is off. The flag acts here, on an argument of the cached planners
    (choose_config, choose_hopper_plan), so switching it never leaves a stale cached plan."""
    if not HOPPER_DSMEM_SPLIT:
        return ()
    caps = _clusters_by_device.get(info.index)
    if caps is None:
        caps = _clusters_by_device[info.index] = (cluster_capacity(info.index, 384, ONE_CTA_PER_SM_SMEM)
                                                  if info.cc == 90 else ())
    return caps


def plan_for(w: W4A16Weight, m: int, device: torch.device | None = None):
    """The plan (tuned.Plan) a call with m rows of x on `device` gets from the dispatcher (benchmarks
    label their rows with it)."""
    info = device_info(w.packed.device.index if device is None else device.index)
    return choose_plan(m, w.n, w.k, info.sm_count, info.cc, w.group_size, _device_clusters(info), w.dtype,
                       w.codebook, _device_table(info), info.smem_per_block_optin, w.zeros is not None)


def _device_table(info) -> TunedTable | None:
    """This GPU's tuned plans (tuned.table_for: the one cache of tables, which `tilefish tune` resets)."""
    key = _keys_by_device.get(info.index)
    if key is None:
        key = _keys_by_device[info.index] = gpu_key(info.name, info.sm_count)
    return table_for(key)


# Per-call lookups of the launch path, cached (each saved ~1 us of host time a call).
_clusters_by_device: dict[int, tuple[tuple[int, int], ...]] = {}
_keys_by_device: dict[int, str] = {}  # a device's table key (gpu_key), fixed per device
_kernels: dict[tuple, object] = {}


def _kernel(dtype: torch.dtype, cfg, group_size: int, asym: bool, device_index: int | None, codebook: str = "int4"):
    key = (dtype, cfg, group_size, asym, device_index, codebook)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = get_kernel(kernel_spec(dtype, cfg, group_size, asym, codebook), device_index)
    return kern


@functools.lru_cache(maxsize=None)
def _smem_bytes(cfg, group_size: int, asym: bool) -> int:
    return cfg.smem_bytes(group_size, asym)


def _hopper_launches(cfg: HopperConfig, m: int, w: W4A16Weight, bias, slices: int | None, ctas: int | None, info):
    """The sm_90a wgmma kernel: a TMA map for x (mt x 64 boxes, 128-byte swizzle); grid (m tiles,
    n tiles, k slices), or for a stream-K config (cfg.streamk) a 1-D grid of `ctas` CTAs (default one
    wave: SMs x cfg.ctas_per_sm, at most one (tile, k stage) unit each). A 2-8 way k split whose
    clusters all fit at once runs as clusters of its slices: grid (m tiles x slices, n tiles). A
    partial last wave that _separate_tail picks runs as a second, 1-D launch from tile_base."""
    if info.cc != 90:
        raise ValueError(f"config {cfg.label()} uses wgmma / TMA (sm_90a) and runs on Hopper (sm_90) only; "
                         f"this GPU is sm_{info.cc}")
    asym = w.zeros is not None
    # n % 64 == 0 (check_shape); a last column tile narrower than cfg.bn runs ragged (wgmma.cu)
    n_tiles, m_tiles, k_stages = column_tiles(cfg, w.n), -(-m // cfg.mt), w.k // HOPPER_BK
    tiles = n_tiles * m_tiles
    units = tiles * k_stages
    if units >= 2**31:
        raise ValueError(f"m={m}, n={w.n}, k={w.k}: {units} (tile, k stage) units exceed the wgmma kernel's "
                         "32-bit unit index; split m into several calls")
    if cfg.streamk:
        ctas = max(1, min(ctas or info.sm_count * cfg.ctas_per_sm(w.group_size, asym), units, 2**31 - 1))
        # the kernel's `slices` argument carries the CTA count in stream-K mode (wgmma.cu)
        slices, grid, ws_floats = ctas, ctas, ctas * 2 * cfg.mt * cfg.bn
    else:
        slices = slices or choose_hopper_slices(cfg, m, w.n, w.k, info.sm_count, _device_clusters(info),
                                                w.group_size != -1)
        slices = max(1, min(slices, k_stages, 65535))  # gridDim.z
        if n_tiles > 65535:
            raise ValueError(f"n={w.n} gives {n_tiles} column tiles of {cfg.bn}, more than gridDim.y allows (65535)")
        grid, ws_floats = (m_tiles, n_tiles, slices), tiles * slices * cfg.mt * cfg.bn if slices > 1 else 0
    # A k split of a tile runs as one thread-block cluster of its slices, which add their partials
    # through distributed shared memory, when all the clusters fit at once (a cluster must sit
    # inside one GPC; else the rest run as a second wave) and with one CTA an SM (a cluster whose
    # CTAs double up on SMs leaves others idle, much slower). Otherwise, for stream-K
    # and for splits wider than a portable cluster, the slices sum through fp32 partials in global memory.
    kern = _kernel(w.dtype, cfg, w.group_size, asym, w.packed.device.index, w.codebook)
    smem = _smem_bytes(cfg, w.group_size, asym)
    cluster = 1
    if _split_runs_as_clusters(cfg, kern, tiles, slices, smem):
        grid, ws_floats, cluster, smem = (m_tiles * slices, n_tiles, 1), 0, slices, max(smem, ONE_CTA_PER_SM_SMEM)
    counted = cfg.streamk or (slices > 1 and cluster == 1)  # the fixups that meet at a tile counter
    box = (cfg.mt, HOPPER_BK)
    tail = (i32(m), i32(w.n), i32(w.k), i32(slices), i32(int(cluster > 1)))
    head = _weight_args(w, bias)
    scratch = (ws_floats, tiles if counted else 0)
    split = _separate_tail(cfg, tiles, slices, cluster, w.group_size, asym, info.sm_count)
    if split:
        return [(kern, prepare_launch(kern, tiles - split, cfg.threads, smem), box, head, tail + (i32(0),)),
                (kern, prepare_launch(kern, split, cfg.threads, smem), box, head, tail + (i32(tiles - split),))], \
            *scratch
    return [(kern, prepare_launch(kern, grid, cfg.threads, smem, cluster), box, head, tail + (i32(0),))], *scratch


def _separate_tail(cfg: HopperConfig, tiles: int, slices: int, cluster: int, group_size: int, asym: bool,
                   sm_count: int) -> int:
    """How many tiles of a whole-tile launch (no k split) to run as a launch of their own (0: one
    launch): the partial last wave of a per-channel weight's plan, when the kernel fits two CTAs an
    SM and that wave fits one CTA an SM but fills more than half the SMs.

    Why: in one launch the hardware hands each pair of slots freed together to two tail CTAs. The
    per-channel kernel's CTAs finish a wave nearly together, so a large tail runs two an SM on half
    the SMs (each at ~1.6x the time of a CTA alone) while the other SMs idle; a launch of its own
    starts on an idle GPU, which places CTAs one an SM first. With group scales the first wave's
    CTAs finish apart and the tail spreads by itself, and a small tail gains little: there the
    second launch only adds its start and the wait for the first wave's last CTA (~5 us). The
    measurements are in docs/w4a16.md."""
    if HOPPER_SEPARATE_TAIL not in ("rule", "never", "always"):
        raise ValueError("ops.w4a16.launch.HOPPER_SEPARATE_TAIL must be 'rule', 'never' or 'always', got "
                         f"{HOPPER_SEPARATE_TAIL!r}")
    if (HOPPER_SEPARATE_TAIL == "never" or cfg.streamk or slices != 1 or cluster != 1
            or cfg.ctas_per_sm(group_size, asym) != 2):
        return 0
    slots = 2 * sm_count
    tail = tiles % slots
    if tiles <= slots or tail > sm_count:
        return 0
    return tail if HOPPER_SEPARATE_TAIL == "always" or (group_size == -1 and tail > sm_count // 2) else 0


def _split_runs_as_clusters(cfg: HopperConfig, kern, tiles: int, slices: int, smem: int) -> bool:
    """Whether a k split of `tiles` tiles into `slices` runs as clusters (the DSMEM fixup): a tile
    mode split of 2..MAX_CLUSTER_SLICES whose clusters, one CTA an SM, all fit at once."""
    if cfg.streamk or not 1 < slices <= MAX_CLUSTER_SLICES or not HOPPER_DSMEM_SPLIT:
        return False
    return tiles <= kern.max_active_clusters(slices, cfg.threads, max(smem, ONE_CTA_PER_SM_SMEM))


def hopper_split_uses_clusters(cfg: HopperConfig, m: int, n: int, k: int, slices: int, group_size: int,
                               asym: bool, dtype: torch.dtype, device: torch.device) -> bool:
    """What _hopper_launches decides for this plan (sweeps record it next to the time)."""
    kern = get_kernel(kernel_spec(dtype, cfg, group_size, asym), device)
    tiles = column_tiles(cfg, n) * -(-m // cfg.mt)
    return _split_runs_as_clusters(cfg, kern, tiles, slices, cfg.smem_bytes(group_size, asym))


def _skinny_launches(cfg: SkinnyConfig, m: int, w: W4A16Weight, bias, ctas: int | None, info):
    """The sm_90a stream-K kernel: a TMA map for x (mt x 64 boxes, 128-byte swizzle), a 1-D grid of
    `ctas` CTAs (default SMs x cfg.ctas_per_sm, at most one unit of (tile, 128-k stage) each; with
    k % 128 == 64 a tile's last stage is half of one)."""
    if info.cc != 90:
        raise ValueError(f"config {cfg.label()} uses TMA / bulk copies (sm_90a) and runs on Hopper (sm_90) only; "
                         f"this GPU is sm_{info.cc}")
    if m > cfg.mt:
        raise ValueError(f"config {cfg.label()} handles m <= {cfg.mt} rows, got m={m}")
    if w.n % cfg.bn:
        raise ValueError(f"config {cfg.label()} needs n % {cfg.bn} == 0 (n={w.n})")
    asym = w.zeros is not None
    tiles = w.n // cfg.bn
    units = tiles * -(-w.k // SKINNY_BK)  # k % 128 == 64: each tile's last stage is a half one
    ctas = max(1, min(ctas or info.sm_count * cfg.ctas_per_sm, units, 2**31 - 1))
    kern = _kernel(w.dtype, cfg, w.group_size, asym, w.packed.device.index, w.codebook)
    config = prepare_launch(kern, ctas, cfg.threads, _smem_bytes(cfg, w.group_size, asym))
    tail = (i32(m), i32(w.n), i32(w.k))
    return [(kern, config, (cfg.mt, 64), _weight_args(w, bias), tail)], ctas * 2 * cfg.mt * cfg.bn, tiles
