"""W4A16 GEMM op (fp16/bf16 activations x 4-bit weights), one module per concern, read in this order:

  layout.py      the weight in the kernel layout (W4A16Weight; pack / unpack; the layout itself in
                 its docstring) and the shape checks
  configs.py     the three kernels' configurations (GemmConfig: mma.sync, any GPU; HopperConfig: sm_90
                 wgmma, k split or stream-K; SkinnyConfig: sm_90 stream-K for small m), kernel_spec,
                 their design spaces and labels
  time_model.py  the fitted time model of the wgmma plans (coefficients in time_model_h200.json,
                 written by scripts/fit_w4a16_time_model.py)
  policy.py      LaunchPolicy, the launch choices A/Bs, sweeps and the sanitizer switch (DSMEM split,
                 separate tail), and launch_policy(...), which makes one active for a with-block
  geometry.py    the launch geometry of a decided split (grids, clusters, shared memory, scratch)
                 and the separate-tail rule
  dispatch.py    choose_plan / choose_config and the rules behind them: which kernel, configuration
                 and split; launch_geometry, what a plan launches (the launchers' and plan()'s one copy)
  tuned.py       measured plans per GPU (`tilefish tune`'s tables), which choose_plan takes first
  launch.py      the op: matmul_impl, LaunchPlan, the launchers (they launch dispatch.launch_geometry)
  workspace.py   the launches' scratch: fp32 partials per call, tile counters owned by the caller
                 (Workspace, a layer's buffer) and taken in turn by streams

This package re-exports the names other code uses, so `ops.w4a16.X` keeps working. The launch
choices are switched through a LaunchPolicy (policy= or launch_policy), never by patching a module.
To patch something else for the op (tests, A/B builds), set it on the module that reads it, e.g.
`launch.kernel_spec`, `launch._kernels`: a re-export bound here is a second name for the same
object, and rebinding it changes only this namespace.
"""
from __future__ import annotations

from .configs import (CONFIGS, H200_CLUSTERS, HOPPER_BK, HOPPER_CONFIGS, HOPPER_SOURCE, MAX_CLUSTER_SLICES,
                      ONE_CTA_PER_SM_SMEM, SKINNY_BK, SKINNY_CONFIGS, SKINNY_SOURCE, SOURCE, THREADS, GemmConfig,
                      HopperConfig, SkinnyConfig, canonical_label, kernel_spec, parse_plan, variant_specs)
from .dispatch import (HOPPER_MIN_M, HOPPER_SLICES, MAX_HOPPER_SLICES, MIN_K_TILES_PER_SLICE, MODEL_MAX_M, NF4_GROUPS,
                       NF4_TALL_TILE, PER_CHANNEL_WGMMA_MIN_K, PER_CHANNEL_WGMMA_MIN_N, SKINNY_M16_MIN_N,
                       SKINNY_M16_PER_CHANNEL_MAX_N, SKINNY_MAX_M, SKINNY_STAGED_MIN_TRIPS,
                       SKINNY_WIDE_N, SMALL_WEIGHT_NK, STREAMK_MAX_M, TINY_WEIGHT_NK, _fit_n, choose_config, choose_plan,
                       choose_hopper_config, choose_hopper_plan, choose_hopper_slices, choose_mma_config,
                       choose_skinny_config, choose_skinny_cluster_split, choose_slices, dispatch_builds, dispatch_specs, skinny_fixup_trips,
                       KernelBuild, launch_geometry, plan_geometry)
from .geometry import Launch, LaunchGeometry, separate_tail, split_geometry
from .launch import (LaunchPlan, device_clusters, hopper_split_uses_clusters, matmul_impl, plan_for, validate,
                     validate_epilogue)
from .policy import (DEFAULT_POLICY, SEPARATE_TAIL_MODES, LaunchPolicy, active_policy, active_policy_key,
                     launch_policy, resolve_policy)
from .layout import (BK, CODEBOOKS, DTYPES, GATED_BLOCK, NF4_NIBBLE_ORDER, W4A16Weight, _strip_permute, check_perm,
                     check_shape, deinterleave_gated, gated_order, interleave_gated, pack, split_gated, unpack)
from .tuned import Plan, TunedTable, gpu_key
from .workspace import LAYER_COUNTERS, Workspace, layer_counters, make_layer_counters, new_counters
from .time_model import (FIXUP_PER_WAVE, HOPPER_TIME_MODEL, MODEL_LARGE_M, hopper_model_regime, hopper_plan_features,
                         hopper_plan_load, hopper_time_model, predicted_hopper_us, split_fits_clusters)

