"""W4A16 GEMM op (fp16/bf16 activations x 4-bit weights), one module per concern, read in this order:

  layout.py      the weight in the kernel layout (W4A16Weight; pack / unpack; the layout itself in
                 its docstring) and the shape checks
  configs.py     the three kernels' configurations (GemmConfig: mma.sync, any GPU; HopperConfig: sm_90
                 wgmma, k split or stream-K; SkinnyConfig: sm_90 stream-K for small m), kernel_spec,
                 their design spaces and labels
  time_model.py  the fitted time model of the wgmma plans (coefficients in time_model_h200.json,
                 written by scripts/fit_w4a16_time_model.py)
  dispatch.py    choose_plan / choose_config and the rules behind them: which kernel, configuration
                 and split
  tuned.py       measured plans per GPU (`tilefish tune`'s tables), which choose_plan takes first
  launch.py      the op: matmul_impl, LaunchPlan, the launchers; the A/B switches
  workspace.py   the launches' scratch: fp32 partials per call, tile counters owned by the caller
                 (Workspace, a layer's buffer) and taken in turn by streams

This package re-exports the names other code uses, so `ops.w4a16.X` keeps working. To patch or
switch something for the op (tests, A/B scripts), set it on the module that reads it, e.g.
`launch.HOPPER_DSMEM_SPLIT`, `launch.kernel_spec`, `launch._kernels`: a re-export bound here is a
second name for the same object, and rebinding it changes only this namespace.
"""
from __future__ import annotations

from .configs import (CONFIGS, H200_CLUSTERS, HOPPER_BK, HOPPER_CONFIGS, HOPPER_SOURCE, MAX_CLUSTER_SLICES,
                      ONE_CTA_PER_SM_SMEM, SKINNY_BK, SKINNY_CONFIGS, SKINNY_SOURCE, SOURCE, THREADS, GemmConfig,
                      HopperConfig, SkinnyConfig, canonical_label, kernel_spec, parse_plan, variant_specs)
from .dispatch import (HOPPER_MIN_M, HOPPER_SLICES, MAX_HOPPER_SLICES, MIN_K_TILES_PER_SLICE, MODEL_MAX_M, NF4_GROUPS,
                       NF4_TALL_TILE, PER_CHANNEL_WGMMA_MIN_K, PER_CHANNEL_WGMMA_MIN_N, SKINNY_M16_MIN_N,
                       SKINNY_M16_PER_CHANNEL_MAX_N, SKINNY_MAX_M, SKINNY_MMA_MAX_NK, SKINNY_STAGED_MIN_TRIPS,
                       SKINNY_WIDE_N, SMALL_WEIGHT_NK, STREAMK_MAX_M, TINY_WEIGHT_NK, _fit_n, choose_config, choose_plan,
                       choose_hopper_config, choose_hopper_plan, choose_hopper_slices, choose_mma_config,
                       choose_skinny_config, choose_slices, dispatch_specs, skinny_fixup_trips)
from .launch import (LaunchPlan, _device_clusters, _kernel, _separate_tail, validate, hopper_split_uses_clusters,
                     matmul_impl, plan_for)
from .layout import (BK, CODEBOOKS, DTYPES, NF4_NIBBLE_ORDER, W4A16Weight, _strip_permute, check_perm, check_shape,
                     pack, unpack)
from .tuned import Plan, TunedTable, gpu_key
from .workspace import LAYER_COUNTERS, Workspace, layer_counters, make_layer_counters, new_counters
from .time_model import (FIXUP_PER_WAVE, HOPPER_TIME_MODEL, MODEL_LARGE_M, hopper_model_regime, hopper_plan_features,
                         hopper_plan_load, hopper_time_model, predicted_hopper_us, split_fits_clusters)

# The launch path's switches and caches, not re-exported: a copy bound here would take a patch
# that launch.py never sees.
_LAUNCH_STATE = ("HOPPER_DSMEM_SPLIT", "HOPPER_SEPARATE_TAIL", "_kernels", "_clusters_by_device", "_keys_by_device")


def __getattr__(name: str):
    if name in _LAUNCH_STATE:
        raise AttributeError(f"{name} lives in tilefish.ops.w4a16.launch, the module that reads it: "
                             f"read or set launch.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
