"""The W4A16 op: validate -> pick a plan (dispatch.py) -> get the kernel -> launch.

matmul_impl is the op (CPU tensors: the float64 reference). A LaunchPlan holds every launch of one
(weight, bias, m, device, policy), decided once: the configuration, its geometry (grid, clusters,
shared memory and the scratch it needs: dispatch.launch_geometry, the one copy plan() reports too),
and every argument but x, the output and that scratch. The launchers (_mma_launches,
_hopper_launches, _skinny_launches) check what their kernel takes and turn the geometry into
launches; they compute none of it themselves.

The launch choices A/Bs, sweeps and the sanitizer switch are one LaunchPolicy (policy.py): pass
policy= to matmul_impl / LaunchPlan.build / plan_for, or run the calls inside launch_policy(...).
"""
from __future__ import annotations

import warnings

import torch

from ...runtime import (cluster_capacity, current_stream_handle, device_info, get_kernel, i32, launch_prepared,
                        prepare_launch)
from ...runtime.tma import tensor_map_rows
from .configs import (HOPPER_BK, ONE_CTA_PER_SM_SMEM, THREADS, GemmConfig, HopperConfig, SkinnyConfig, column_tiles,
                      kernel_spec)
from .dispatch import choose_plan, choose_skinny_cluster_split, launch_geometry
from .geometry import LaunchGeometry
from .layout import DTYPES, TABLE_CODEBOOKS, W4A16Weight, check_codebook, check_shape, unpack
from .policy import LaunchPolicy, resolve_policy
from .tuned import TunedTable, gpu_key, table_for
from .workspace import _lock as _workspace_lock
from .workspace import check_counters, hand_over


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
    if w.codebook in TABLE_CODEBOOKS and w.zeros is not None:
        raise ValueError(f"codebook {w.codebook!r} has no zero points")
    check_codebook(w.codebook, w.group_size, w.zeros is None)
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


def validate_epilogue(x: torch.Tensor, w: W4A16Weight, residual: torch.Tensor | None, gated) -> None:
    """The fused epilogue's arguments (x and w already validated): residual, a tensor like the output
    (x.shape[:-1] + (n,), x's dtype and device), added to y; gated, silu(gate) * up of a weight in the gated
    column order (layout.interleave_gated), y then n / 2 wide. Not both."""
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be True or False, got {gated!r}")
    if residual is None:
        return
    if gated:
        raise ValueError("a gated matmul takes no residual (the epilogue is one or the other)")
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
    want = tuple(x.shape[:-1]) + (w.n,)
    if residual.dtype != x.dtype or tuple(residual.shape) != want or residual.device != x.device:
        raise ValueError(f"residual must be a {x.dtype} tensor of shape {want} on {x.device} (the output's), got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")


def matmul_impl(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None = None,
                cfg: GemmConfig | HopperConfig | SkinnyConfig | None = None, slices: int | None = None,
                ctas: int | None = None, workspace=None, policy: LaunchPolicy | None = None,
                residual: torch.Tensor | None = None, gated: bool = False, light_ahead: bool = False) -> torch.Tensor:
    """cfg: a configuration to force (sweeps, tests); None: the dispatcher's. slices: the k split of
    a tile kernel (mma.sync, wgmma tile mode); ctas: the grid of a stream-K one (skinny, wgmma
    streamk); None: the dispatcher's choice. Giving the one the plan's kernel does not take is a
    ValueError (on CUDA, where the plan is made). workspace: a workspace.Workspace, or the int32
    tile counters a layer owns; None: fresh zeroed counters where the plan needs them. policy: the
    LaunchPolicy to plan under; None: the active one (policy.launch_policy). residual / gated: the
    fused epilogue (validate_epilogue; reference.w4a16_epilogue is its definition). light_ahead: the kernel
    ahead of this call in the stream is a light one (a norm), so the dispatcher may take a plan launched as
    thread-block clusters (dispatch.choose_skinny_cluster_split)."""
    validate(x, w, bias)
    validate_epilogue(x, w, residual, gated)
    if not isinstance(light_ahead, bool):
        raise TypeError(f"light_ahead must be True or False, got {light_ahead!r}")
    policy = resolve_policy(policy)
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
        from ...reference import dense_matmul, w4a16_epilogue, w4a16_matmul

        y = (w4a16_matmul(x2, unpack(w), bias) if w.codebook == "int4" else
             dense_matmul(x2, w.dequantize(torch.float64), bias)).reshape(*lead, w.n)
        return w4a16_epilogue(y, residual, gated)
    if x.device.type != "cuda":
        raise ValueError(f"W4A16 runs on CUDA or CPU tensors, not {x.device}")
    if counters is not None:
        check_counters(counters, x.device)
    x2 = x2.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # the kernel reads bias[col] by pointer: a strided view gets an explicit copy
    m = x2.shape[0]
    n_out = w.n // 2 if gated else w.n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n_out)
    if x2.data_ptr() % 16:  # an offset view: the kernels read x in 16-byte (TMA: aligned) pieces
        x2 = x2.clone()
    r2 = None
    if residual is not None:  # read by 16-byte chunks where a tile leaves shared memory
        r2 = residual.reshape(m, w.n).contiguous()
        if r2.data_ptr() % 16:
            r2 = r2.clone()
    LaunchPlan.build(w, bias, m, x.device, cfg, slices, ctas, counters, policy, light_ahead).launch(
        x2.data_ptr(), out.data_ptr(), 0 if r2 is None else r2.data_ptr(), gated)
    return out if flat else out.reshape(*lead, n_out)


def _check_count(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int or None, got {v!r}")


class LaunchPlan:
    """The kernel launches of one (weight, bias, m, device, policy): the configuration, its geometry
    (grid, clusters, shared memory, scratch: dispatch.launch_geometry), and every argument but x,
    the output and the scratch, decided once. The op builds one a call; W4A16Linear keeps one per
    input shape, stream and policy (policy.active_policy_key), so an eager call only allocates the
    output (and the plan's fp32 partials, if it has any) and launches.

    Scratch (workspace.py): `partials` fp32 sums, allocated per launch; `tiles` counters, the
    owner's `counters` when given and large enough (taken in turn by streams), else fresh zeros."""

    __slots__ = ("launches", "keep", "m", "k", "dtype", "device", "partials", "tiles", "counters", "config",
                 "geometry", "policy")

    def __init__(self, launches: list[tuple], keep: tuple, m: int, k: int, dtype: torch.dtype, device: torch.device,
                 partials: int, tiles: int, counters: torch.Tensor | None, config=None,
                 geometry: LaunchGeometry | None = None, policy: LaunchPolicy | None = None):
        self.launches = launches  # (kernel, launch config, TMA box of x or None: x by pointer, args before out,
        #                            args after out and the two scratch pointers)
        self.keep = keep          # tensors the arguments point into (weight, bias): kept alive
        self.m, self.k, self.dtype, self.device = m, k, dtype, device
        self.partials, self.tiles = partials, tiles  # fp32 partial sums, tile counters the launches need
        self.counters = counters if counters is not None and tiles <= counters.numel() else None
        self.config, self.geometry, self.policy = config, geometry, policy  # what was decided (read-outs)

    @classmethod
    def build(cls, w: W4A16Weight, bias: torch.Tensor | None, m: int, device: torch.device,
              cfg=None, slices: int | None = None, ctas: int | None = None,
              counters: torch.Tensor | None = None, policy: LaunchPolicy | None = None,
              light_ahead: bool = False) -> "LaunchPlan":
        """w and bias already validated (validate), on `device` and contiguous; m >= 1. slices / ctas:
        matmul_impl's; counters: owned tile counters (checked), or None; policy: the LaunchPolicy
        (None: the active one); light_ahead: matmul_impl's."""
        for name, t in (("packed", w.packed), ("scales", w.scales), ("zeros", w.zeros)):
            if t is not None and (t.data_ptr() % 16 or not t.is_contiguous()):
                raise ValueError(f"{name} must be contiguous and 16-byte aligned for the CUDA kernel")
        policy = resolve_policy(policy)
        info = device_info(device.index)
        clusters = None
        if cfg is None:
            clusters = device_clusters(info, policy)
            plan = choose_plan(m, w.n, w.k, info.sm_count, info.cc, w.group_size, clusters, w.dtype,
                               w.codebook, _device_table(info), info.smem_per_block_optin, w.zeros is not None)
            cfg = plan.cfg
            if slices is None and ctas is None:
                slices, ctas = plan.slices, plan.ctas
                if (light_ahead and isinstance(cfg, SkinnyConfig) and ctas is None and policy.dsmem_split
                        and info.cc == 90 and m <= cfg.mt):
                    kern = _kernel(w.dtype, cfg, w.group_size, w.zeros is not None, w.packed.device.index, w.codebook)
                    smem = cfg.smem_bytes(w.group_size, w.zeros is not None)
                    slices = choose_skinny_cluster_split(
                        cfg, w.n, w.k, info.sm_count, lambda s: kern.max_active_clusters(s, cfg.threads, smem))
        if isinstance(cfg, SkinnyConfig) and slices is not None and ctas is not None:
            raise ValueError(f"config {cfg.label()}: a cluster split (slices) sets its own grid; give slices or "
                             "ctas, not both")
        if cfg.streamk and slices is not None and not isinstance(cfg, SkinnyConfig):
            raise ValueError(f"config {cfg.label()} is stream-K: it takes ctas (its grid), not slices (a k split)")
        if not cfg.streamk and ctas is not None:
            raise ValueError(f"config {cfg.label()} splits k: it takes slices, not ctas (a stream-K grid)")
        if clusters is None:  # a forced configuration: asked only once the arguments are known to fit it
            clusters = device_clusters(info, policy)
        launcher = _hopper_launches if isinstance(cfg, HopperConfig) else \
            _skinny_launches if isinstance(cfg, SkinnyConfig) else _mma_launches
        launches, geo = launcher(cfg, m, w, bias, slices, ctas, info, clusters, policy)
        return cls(launches, (w.packed, w.scales, w.zeros, bias), m, w.k, w.dtype, torch.device("cuda", info.index),
                   geo.partial_floats, geo.tile_counters, counters, cfg, geo, policy)

    def launch(self, x_ptr: int, out_ptr: int, residual_ptr: int = 0, gated: bool = False) -> None:
        """x_ptr: x as [m, k] contiguous, 16-byte aligned, on the plan's device; out_ptr: [m, n] contiguous
        ([m, n / 2] gated). The epilogue (kernels/w4a16/epilogue.cuh, checked by the caller: validate_epilogue):
        residual_ptr, a [m, n] residual added to y (0: none); gated, silu(gate) * up of a GATED_BLOCK
        interleaved weight."""
        partials = torch.empty(self.partials, dtype=torch.float32, device=self.device) if self.partials else None
        ws = 0 if partials is None else partials.data_ptr()
        epilogue = (residual_ptr, i32(1 if gated else 0))
        if not self.tiles:
            self._enqueue(x_ptr, out_ptr, ws, 0, epilogue)
        elif self.counters is None:
            fresh = torch.zeros(self.tiles, dtype=torch.int32, device=self.device)
            self._enqueue(x_ptr, out_ptr, ws, fresh.data_ptr(), epilogue)
        else:
            index = self.device.index
            with _workspace_lock:
                hand_over(self.counters, index, current_stream_handle(index))
                self._enqueue(x_ptr, out_ptr, ws, self.counters.data_ptr(), epilogue)

    def _enqueue(self, x_ptr: int, out_ptr: int, ws_ptr: int, counters_ptr: int, epilogue: tuple) -> None:
        for kern, config, box, head, tail in self.launches:
            xa = x_ptr if box is None else tensor_map_rows(x_ptr, self.m, self.k, self.dtype, self.device.index, *box)
            launch_prepared(kern, config, xa, *head, out_ptr, ws_ptr, counters_ptr, *tail, *epilogue)


def _weight_args(w: W4A16Weight, bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (w.packed.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr() if w.zeros is not None else 0,
            bias.data_ptr() if bias is not None else 0)


def _mma_launches(cfg: GemmConfig, m: int, w: W4A16Weight, bias, slices: int | None, ctas, info, clusters,
                  policy: LaunchPolicy):
    """The mma.sync kernel (any GPU): grid (m tiles, n tiles, k slices)."""
    if w.n % cfg.bn:
        raise ValueError(f"config {cfg.label()} needs n % {cfg.bn} == 0 (n={w.n})")
    if cfg.swap and m > 8:
        raise ValueError(f"config {cfg.label()} (swapped operands) handles m <= 8, got m={m}")
    asym = w.zeros is not None
    geo = launch_geometry(cfg, slices, None, m, w.n, w.k, info.sm_count, w.group_size, asym, clusters,
                          policy.separate_tail)
    kern = _kernel(w.dtype, cfg, w.group_size, asym, w.packed.device.index, w.codebook)
    tail = (i32(m), i32(w.n), i32(w.k), i32(geo.slices))
    head = _weight_args(w, bias)
    return [(kern, prepare_launch(kern, launch.grid, THREADS, geo.smem, pdl=policy.programmatic), None, head, tail)
            for launch in geo.launches], geo


def device_clusters(info, policy: LaunchPolicy | None = None) -> tuple[tuple[int, int], ...]:
    """The cluster capacity the dispatcher plans with on this device (runtime.device_info's answer)
    under `policy` (None: the active one): the sm_90 GPU's at one CTA an SM (runtime.cluster_capacity,
    measured once; the same table GpuSpec.current() holds, so plan() sees what the launch sees), ()
    elsewhere and with the DSMEM split off. The policy acts here, on an argument of the cached
    planners (choose_config, choose_hopper_plan, decide, launch_geometry), so a cached plan never
    crosses policies."""
    if not resolve_policy(policy).dsmem_split:
        return ()
    caps = _clusters_by_device.get(info.index)
    if caps is None:
        caps = _clusters_by_device[info.index] = (cluster_capacity(info.index, 384, ONE_CTA_PER_SM_SMEM)
                                                  if info.cc == 90 else ())
    return caps


def plan_for(w: W4A16Weight, m: int, device: torch.device | None = None, policy: LaunchPolicy | None = None):
    """The plan (tuned.Plan) a call with m rows of x on `device` gets from the dispatcher under
    `policy` (None: the active one); benchmarks label their rows with it."""
    info = device_info(w.packed.device.index if device is None else device.index)
    return choose_plan(m, w.n, w.k, info.sm_count, info.cc, w.group_size, device_clusters(info, policy), w.dtype,
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


def _hopper_launches(cfg: HopperConfig, m: int, w: W4A16Weight, bias, slices: int | None, ctas: int | None, info,
                     clusters, policy: LaunchPolicy):
    """The sm_90a wgmma kernel: a TMA map for x (mt x 64 boxes, 128-byte swizzle); grid (m tiles,
    n tiles, k slices), or for a stream-K config (cfg.streamk) a 1-D grid of `ctas` CTAs; a 2-8 way
    k split whose clusters all fit at once as clusters of its slices, grid (m tiles x slices, n
    tiles); a partial last wave as a second, 1-D launch from tile_base (geometry.separate_tail).
    All of it is launch_geometry's; the kernel's `slices` argument carries the CTA count in
    stream-K mode (wgmma.cu)."""
    if info.cc != 90:
        raise ValueError(f"config {cfg.label()} uses wgmma / TMA (sm_90a) and runs on Hopper (sm_90) only; "
                         f"this GPU is sm_{info.cc}")
    asym = w.zeros is not None
    n_tiles = column_tiles(cfg, w.n)  # n % 64 == 0 (check_shape); a last column tile narrower than cfg.bn runs ragged
    units = n_tiles * -(-m // cfg.mt) * (w.k // HOPPER_BK)
    if units >= 2**31:
        raise ValueError(f"m={m}, n={w.n}, k={w.k}: {units} (tile, k stage) units exceed the wgmma kernel's "
                         "32-bit unit index; split m into several calls")
    if not cfg.streamk and n_tiles > 65535:
        raise ValueError(f"n={w.n} gives {n_tiles} column tiles of {cfg.bn}, more than gridDim.y allows (65535)")
    kern = _kernel(w.dtype, cfg, w.group_size, asym, w.packed.device.index, w.codebook)
    geo = _hopper_geometry(cfg, kern, slices, ctas, m, w.n, w.k, info.sm_count, w.group_size, asym, clusters,
                           policy)
    box = (cfg.mt, HOPPER_BK)
    tail = (i32(m), i32(w.n), i32(w.k), i32(geo.ctas if cfg.streamk else geo.slices), i32(int(geo.cluster > 1)))
    head = _weight_args(w, bias)
    return [(kern, prepare_launch(kern, launch.grid, cfg.threads, geo.smem, launch.cluster, pdl=policy.programmatic),
             box, head, tail + (i32(launch.first_tile),)) for launch in geo.launches], geo


def _hopper_geometry(cfg: HopperConfig, kern, slices, ctas, m, n, k, sm_count, group_size, asym, clusters,
                     policy: LaunchPolicy) -> LaunchGeometry:
    """launch_geometry, with the one check the launch adds: a k split planned as clusters runs as
    clusters only where the driver's occupancy answer for the loaded kernel has room for all of
    them at once. The capacity table the geometry reads is the driver's answer for an empty kernel
    at one CTA an SM, and a cluster launch runs one CTA an SM, so the two agree; should they not
    (a premise broken), the split sums through the global workspace instead (correct, and never a
    cluster launch that does not fit), with a warning that plan() no longer describes it."""
    geo = launch_geometry(cfg, slices, ctas, m, n, k, sm_count, group_size, asym, clusters, policy.separate_tail)
    if geo.cluster == 1:
        return geo
    fits = kern.max_active_clusters(geo.cluster, cfg.threads, geo.smem)
    if geo.ctas // geo.cluster <= fits:
        return geo
    warnings.warn(f"{cfg.label()}/x{geo.slices}: the cluster capacity table has room for "
                  f"{geo.ctas // geo.cluster} clusters of {geo.cluster}, the driver for {fits} of this kernel; "
                  "the split runs through the global workspace (plan() reports clusters)", RuntimeWarning,
                  stacklevel=4)
    return launch_geometry(cfg, geo.slices, None, m, n, k, sm_count, group_size, asym, (), policy.separate_tail)


def hopper_split_uses_clusters(cfg: HopperConfig, m: int, n: int, k: int, slices: int, group_size: int,
                               asym: bool, dtype: torch.dtype, device: torch.device,
                               policy: LaunchPolicy | None = None) -> bool:
    """Whether LaunchPlan.build runs this k split as clusters on `device` under `policy` (None: the
    active one); sweeps record it next to the time."""
    policy = resolve_policy(policy)
    info = device_info(device.index)
    kern = get_kernel(kernel_spec(dtype, cfg, group_size, asym), device)
    return _hopper_geometry(cfg, kern, slices, None, m, n, k, info.sm_count, group_size, asym,
                            device_clusters(info, policy), policy).cluster > 1


def _skinny_launches(cfg: SkinnyConfig, m: int, w: W4A16Weight, bias, slices, ctas: int | None, info, clusters,
                     policy: LaunchPolicy):
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
    geo = launch_geometry(cfg, slices, ctas, m, w.n, w.k, info.sm_count, w.group_size, asym, clusters,
                          policy.separate_tail)
    kern = _kernel(w.dtype, cfg, w.group_size, asym, w.packed.device.index, w.codebook)
    if geo.cluster > 1:  # every cluster at once, or the split is not one wave
        fits = kern.max_active_clusters(geo.cluster, cfg.threads, geo.smem)
        if geo.ctas // geo.cluster > fits:
            raise ValueError(f"{cfg.label()}/x{geo.cluster}: {geo.ctas // geo.cluster} clusters of {geo.cluster} "
                             f"CTAs, and this GPU holds {fits} at once; take fewer slices or wider tiles")
    tail = (i32(m), i32(w.n), i32(w.k))
    head = _weight_args(w, bias)
    return [(kern, prepare_launch(kern, launch.grid, cfg.threads, geo.smem, launch.cluster, pdl=policy.programmatic),
             (cfg.mt, 64), head, tail) for launch in geo.launches], geo
