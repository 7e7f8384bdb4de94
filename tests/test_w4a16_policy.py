"""The W4A16 launch policy (ops/w4a16/policy.py) and the one launch geometry (dispatch.launch_geometry),
on the CPU: a policy is checked when made, the active one is restored after its with-block whatever
happens, the cached planners never hand one policy's plan to another, and LaunchPlan.build launches
exactly the geometry plan() reports (the runtime faked: a described GPU, kernels that are never loaded)."""
from __future__ import annotations

import dataclasses
import math
import threading
from types import SimpleNamespace

import pytest
import torch

import tilefish
from tilefish import GpuSpec
from tilefish.ops import w4a16 as ops
from tilefish.ops.w4a16 import dispatch, launch

H200 = GpuSpec("NVIDIA H200", 132, 90)
GPUS = [H200,
        # an sm_90 part of another size and cluster capacity (no shipped table: the model and rules)
        GpuSpec("Described Hopper", 114, 90, clusters=((2, 57), (3, 36), (4, 28), (5, 20), (6, 16), (7, 14), (8, 12))),
        GpuSpec("NVIDIA A100-SXM4-80GB", 108, 80), GpuSpec("NVIDIA GeForce RTX 4090", 128, 89)]
POLICIES = [ops.LaunchPolicy(), ops.LaunchPolicy(dsmem_split=False), ops.LaunchPolicy(separate_tail="never"),
            ops.LaunchPolicy(False, "always"), ops.LaunchPolicy(programmatic=False)]
# a whole-tile plan of a two-CTA-an-SM configuration on a per-channel weight whose partial last wave
# fills most of the H200's SMs: the rule runs that wave as a launch of its own
TAIL_CFG = ops.HopperConfig(128, 2, 1, 4)
TAIL_K, TAIL_N = 128, 128 * 24
TAIL_M = -(-(2 * 132 + 132 * 3 // 4) // 24) * 128 - 37


# ---- the policy value and the active policy --------------------------------------------------------------------

def test_policy_checks_each_field_and_is_immutable():
    assert ops.LaunchPolicy() == ops.DEFAULT_POLICY == ops.LaunchPolicy(True, "rule")
    for bad in (1, 0, "yes", None):
        with pytest.raises(ValueError, match="LaunchPolicy.dsmem_split must be True or False"):
            ops.LaunchPolicy(dsmem_split=bad)
    for bad in ("Rule", "", None, True):
        with pytest.raises(ValueError, match="LaunchPolicy.separate_tail must be 'rule', 'never' or 'always'"):
            ops.LaunchPolicy(separate_tail=bad)
    for field in ("programmatic", "wide_clusters"):
        for bad in (1, 0, "yes", None):
            with pytest.raises(ValueError, match=f"LaunchPolicy.{field} must be True or False"):
                ops.LaunchPolicy(**{field: bad})
    p = ops.LaunchPolicy(dsmem_split=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.dsmem_split = True
    assert hash(p) == hash(ops.LaunchPolicy(dsmem_split=False))
    assert p.planner_clusters(H200.clusters) == () and ops.LaunchPolicy().planner_clusters(H200.clusters) == H200.clusters


def test_launch_policy_sets_and_restores_even_on_exception():
    off, never = ops.LaunchPolicy(dsmem_split=False), ops.LaunchPolicy(separate_tail="never")
    assert ops.active_policy() == ops.DEFAULT_POLICY and ops.active_policy_key() == 0
    with ops.launch_policy(off) as active:
        assert active is off and ops.active_policy() is off
        with ops.launch_policy(never):
            assert ops.active_policy() is never
        assert ops.active_policy() is off
        with pytest.raises(KeyError):
            with ops.launch_policy(never):
                raise KeyError("inside")
        assert ops.active_policy() is off
    assert ops.active_policy() == ops.DEFAULT_POLICY
    for bad in (None, {"dsmem_split": False}, "never"):
        with pytest.raises(TypeError, match="LaunchPolicy"):
            with ops.launch_policy(bad):
                pass
    assert ops.active_policy() == ops.DEFAULT_POLICY


def test_policy_keys_name_equal_policies_alike():
    """active_policy_key: what a cache of launch plans adds to its key (W4A16Linear's)."""
    keys = {}
    for p in POLICIES + [ops.LaunchPolicy(False, "always"), ops.LaunchPolicy()]:
        with ops.launch_policy(p):
            keys.setdefault(p, set()).add(ops.active_policy_key())
    assert all(len(k) == 1 for k in keys.values())
    assert len({next(iter(k)) for k in keys.values()}) == len(keys) == len(POLICIES)
    assert keys[ops.LaunchPolicy()] == {ops.active_policy_key()}


def test_policy_belongs_to_its_thread():
    seen = []
    with ops.launch_policy(ops.LaunchPolicy(dsmem_split=False)):
        t = threading.Thread(target=lambda: seen.append(ops.active_policy()))
        t.start()
        t.join()
        assert ops.active_policy().dsmem_split is False
    assert seen == [ops.DEFAULT_POLICY]


def test_explicit_policy_arguments_are_checked():
    with pytest.raises(TypeError, match="LaunchPolicy"):
        tilefish.w4a16.plan(16, 4096, 4096, gpu=H200, policy="never")
    x, w = torch.randn(2, 128), tilefish.w4a16.quantize(torch.randn(64, 128), 128)
    with pytest.raises(TypeError, match="LaunchPolicy"):
        ops.matmul_impl(x.to(w.dtype), w, policy={"dsmem_split": False})


# ---- the cached planners never cross policies ---------------------------------------------------------------------

CACHED = (dispatch.decide, dispatch.choose_config, dispatch.choose_mma_config, dispatch.choose_hopper_plan,
          dispatch.choose_hopper_slices, dispatch.launch_geometry)


def _clear_caches():
    for f in CACHED:
        f.cache_clear()


def test_cached_plans_never_cross_policies():
    """Plans made with every policy interleaved (each planner's cache warm with the others' plans)
    equal plans made per policy from empty caches; and the policies do change plans: a DSMEM split
    becomes a workspace split, a separate tail one launch."""
    cases = [(m, n, k, g) for m in (16, 64, 256, 1000) for k, n in ((14336, 4096), (4096, 14336), (8192, 28672))
             for g in (128, -1)]

    def plans(policy):
        return {c: tilefish.w4a16.plan(*c[:3], group_size=c[3], gpu=H200, policy=policy) for c in cases}

    _clear_caches()
    interleaved = {p: {} for p in POLICIES}
    for c in cases:
        for p in POLICIES:
            with ops.launch_policy(p):  # the active policy, as the launcher reads it
                interleaved[p][c] = tilefish.w4a16.plan(*c[:3], group_size=c[3], gpu=H200)
    for p in POLICIES:
        _clear_caches()
        assert plans(p) == interleaved[p], p
    on, off = interleaved[ops.LaunchPolicy()], interleaved[ops.LaunchPolicy(dsmem_split=False)]
    assert any(on[c].cluster > 1 for c in cases) and all(off[c].cluster == 1 for c in cases)
    assert all(off[c].policy == ops.LaunchPolicy(dsmem_split=False) for c in cases)
    # the tail: the same cached geometry function, another mode
    for mode, launches in (("rule", 2), ("never", 1), ("always", 2), ("rule", 2)):
        geo = ops.launch_geometry(TAIL_CFG, 1, None, TAIL_M, TAIL_N, TAIL_K, 132, -1, False, H200.clusters, mode)
        assert len(geo.launches) == launches, mode
    _clear_caches()


# ---- the launchers launch plan()'s geometry --------------------------------------------------------------------

class _Kernel:
    """A loaded kernel as the launchers use it: only the driver's cluster occupancy answer."""

    def __init__(self, spec, clusters):
        self.spec, self.clusters = spec, dict(clusters)

    def max_active_clusters(self, cluster, block, smem):
        return self.clusters.get(cluster, 0)


@pytest.fixture
def described(monkeypatch):
    """Make launch.py see a described GPU: device_info, cluster capacity and kernels from a GpuSpec,
    prepare_launch recording its arguments. Returns a function that switches the GPU."""
    def use(gpu: GpuSpec, driver_clusters=None):
        info = SimpleNamespace(index=0, cc=gpu.cc, sm_count=gpu.sm_count, name=gpu.name,
                               smem_per_block_optin=gpu.smem_per_block)
        monkeypatch.setattr(launch, "device_info", lambda index=None: info)
        monkeypatch.setattr(launch, "cluster_capacity", lambda *a, **k: gpu.clusters)
        monkeypatch.setattr(launch, "get_kernel", lambda spec, index=None: _Kernel(
            spec, gpu.clusters if driver_clusters is None else driver_clusters))
        monkeypatch.setattr(launch, "prepare_launch", lambda kern, grid, block, smem=0, cluster=1, pdl=False:
                            SimpleNamespace(grid=grid, block=block, smem=smem, cluster=cluster, pdl=pdl))
        for name in ("_kernels", "_clusters_by_device", "_keys_by_device"):
            monkeypatch.setattr(launch, name, {})
    return use


def _weight(n, k, group, zp, codebook="int4", dtype=torch.float16):
    """What LaunchPlan.build reads of a W4A16Weight (its tensors only for alignment and pointers)."""
    packed, scales = torch.empty(64, dtype=torch.int32), torch.empty(64, dtype=dtype)
    return SimpleNamespace(n=n, k=k, group_size=group, zeros=scales if zp else None, dtype=dtype, codebook=codebook,
                           packed=packed, scales=scales)


def _assert_launches(lp, geo, where):
    """lp (a LaunchPlan) launches exactly geo (a LaunchGeometry)."""
    assert len(lp.launches) == len(geo.launches), where
    for (kern, config, box, head, tail), want in zip(lp.launches, geo.launches):
        assert (config.grid, config.cluster, config.smem) == (want.grid, want.cluster, geo.smem), where
        assert config.pdl == lp.policy.programmatic, where  # every launch of a plan follows its policy
        if isinstance(lp.config, ops.HopperConfig):
            assert int(tail[3]) == (geo.ctas if lp.config.streamk else geo.slices), where
            assert int(tail[4]) == (geo.cluster > 1) and int(tail[5]) == want.first_tile, where
        elif isinstance(lp.config, ops.GemmConfig):
            assert int(tail[3]) == geo.slices, where
    assert sum(math.prod(launch.grid) for launch in geo.launches) == geo.ctas, where
    assert (lp.partials, lp.tiles) == (geo.partial_floats, geo.tile_counters), where


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: f"{g.name}-{g.sm_count}")
def test_the_launch_is_plan_geometry_on_a_described_gpu(gpu, described):
    """LaunchPlan.build, the dispatcher's plan: the configuration, grids, clusters, shared memory,
    kernel split arguments and scratch plan() reports, under every policy."""
    described(gpu)
    dev = torch.device("cuda", 0)
    count = 0
    for policy in POLICIES:
        for k, n in ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 28672), (2880, 5760), (192, 320)):
            for group, zp, codebook in ((128, False, "int4"), (-1, True, "int4"), (32, True, "int4"),
                                        (64, False, "nf4")):
                if group > 0 and k % group:
                    continue
                w = _weight(n, k, group, zp, codebook)
                for m in (1, 8, 16, 33, 64, 256, 1000, 4096):
                    p = tilefish.w4a16.plan(m, n, k, group_size=group, codebook=codebook, zero_points=zp, gpu=gpu,
                                            policy=policy)
                    lp = ops.LaunchPlan.build(w, None, m, dev, policy=policy)
                    where = (gpu.name, policy, m, n, k, group, zp, codebook, p.label)
                    assert lp.config == p.config and lp.policy == p.policy == policy, where
                    assert lp.geometry.launches == p.launches, where
                    assert (lp.geometry.slices, lp.geometry.ctas, lp.geometry.cluster, lp.geometry.smem,
                            lp.geometry.scratch_bytes) == (p.slices, p.ctas, p.cluster, p.smem_bytes,
                                                           p.workspace_bytes), where
                    _assert_launches(lp, lp.geometry, where)
                    count += 1
    assert count > 500


def test_forced_plans_launch_launch_geometry(described):
    """Forced configurations, splits and grids (sweeps, tests): what the launcher makes is
    launch_geometry's, the separate tail's second launch and the DSMEM clusters included."""
    described(H200)
    dev = torch.device("cuda", 0)
    seen_tail = seen_cluster = False
    for policy in POLICIES:
        w = _weight(TAIL_N, TAIL_K, -1, False)
        lp = ops.LaunchPlan.build(w, None, TAIL_M, dev, TAIL_CFG, 1, policy=policy)
        geo = ops.launch_geometry(TAIL_CFG, 1, None, TAIL_M, TAIL_N, TAIL_K, 132, -1, False,
                                  policy.planner_clusters(H200.clusters), policy.separate_tail)
        assert lp.geometry == geo and len(geo.launches) == (1 if policy.separate_tail == "never" else 2)
        _assert_launches(lp, geo, policy)
        seen_tail |= len(geo.launches) == 2
        for k, n, m, group in ((2048, 512, 5, 128), (2048, 512, 133, -1), (1088, 1024, 3, 64)):
            w = _weight(n, k, group, group == -1)
            cases = [(cfg, sl, None) for cfg in ops.HOPPER_CONFIGS if not cfg.streamk for sl in (None, 1, 2, 3, 8, 40)]
            cases += [(cfg, None, ct) for cfg in ops.HOPPER_CONFIGS if cfg.streamk for ct in (None, 1, 7, 10**6)]
            cases += [(cfg, None, ct) for cfg in ops.SKINNY_CONFIGS if m <= cfg.mt and n % cfg.bn == 0
                      for ct in (None, 3, 10**6)]
            cases += [(cfg, sl, None) for cfg in ops.SKINNY_CONFIGS if m <= cfg.mt == 8 and n % cfg.bn == 0
                      for sl in (2, 4)]  # the cluster split (8-row tiles)
            cases += [(cfg, sl, None) for cfg in (ops.GemmConfig(1, 2, 4, 6, swap=True, breg=True),
                                                  ops.GemmConfig(2, 2, 4, 4)) if not (cfg.swap and m > 8)
                      for sl in (None, 1, 3)]
            for cfg, sl, ct in cases:
                lp = ops.LaunchPlan.build(w, None, m, dev, cfg, sl, ct, policy=policy)
                geo = ops.launch_geometry(cfg, sl, ct, m, n, k, 132, group, group == -1,
                                          policy.planner_clusters(H200.clusters), policy.separate_tail)
                assert lp.geometry == geo, (policy, cfg, sl, ct)
                _assert_launches(lp, geo, (policy, cfg, sl, ct))
                seen_cluster |= geo.cluster > 1
                assert policy.dsmem_split or geo.cluster == 1
    assert seen_tail and seen_cluster


def test_a_driver_without_room_for_the_clusters_gets_the_workspace_split(described):
    """The launch's one check beyond the geometry: where the driver's answer for the loaded kernel
    has no room for the clusters the capacity table promised, the split sums through the global
    workspace (with a warning), never a cluster launch that cannot run at once."""
    described(H200, driver_clusters=())
    w = _weight(512, 2048, 128, False)
    cfg = ops.HopperConfig(64, 4, 1, 6)
    planned = ops.launch_geometry(cfg, 2, None, 5, 512, 2048, 132, 128, False, H200.clusters)
    assert planned.cluster == 2
    with pytest.warns(RuntimeWarning, match="the split runs through the global workspace"):
        lp = ops.LaunchPlan.build(w, None, 5, torch.device("cuda", 0), cfg, 2)
    assert lp.geometry == ops.launch_geometry(cfg, 2, None, 5, 512, 2048, 132, 128, False, ())
    assert lp.geometry.cluster == 1 and lp.partials > 0 and lp.tiles > 0
    _assert_launches(lp, lp.geometry, cfg)


def test_skinny_cluster_split_geometry():
    """A skinny "/x<S>" plan launches S CTAs a tile as clusters of S (a weight of 16 column tiles of 256 and
    32 k stages: 16 x S CTAs); S past 16 (sm_90's largest cluster) or past the k stages, or a tile of more than
    8 rows, is refused."""
    cfg = ops.SkinnyConfig(8, 4, 1, 3, 2)
    geo = ops.launch_geometry(cfg, 16, None, 1, 4096, 4096, 132, 128, False)
    assert (geo.ctas, geo.cluster, geo.launches[0].grid, geo.launches[0].cluster) == (256, 16, (256, 1, 1), 16)
    plain = ops.launch_geometry(cfg, None, None, 1, 4096, 4096, 132, 128, False)
    assert (plain.ctas, plain.cluster) == (264, 1)
    for slices in (17, 33):
        with pytest.raises(ValueError, match="cluster split"):
            ops.launch_geometry(cfg, slices, None, 1, 4096, 4096 if slices == 17 else 2048, 132, 128, False)
    with pytest.raises(ValueError, match="cluster split"):
        ops.launch_geometry(cfg, 4, None, 1, 1024, 384, 132, 128, False)  # k 384: 3 stages
    with pytest.raises(ValueError, match="8-row tiles"):
        ops.launch_geometry(ops.SkinnyConfig(16, 4, 1, 4, 2), 4, None, 1, 4096, 4096, 132, 128, False)


def test_a_skinny_cluster_split_the_gpu_cannot_hold_at_once_is_refused(described):
    """A forced skinny cluster split whose clusters the driver cannot hold at once is a ValueError naming
    the counts, before any launch (it would run as a second wave), as is one given both slices and ctas."""
    described(H200, driver_clusters=())
    w = _weight(512, 2048, 128, False)
    cfg = ops.SkinnyConfig(8, 4, 1, 3, 2)
    with pytest.raises(ValueError, match="clusters of 4 CTAs, and this GPU holds 0 at once"):
        ops.LaunchPlan.build(w, None, 1, torch.device("cuda", 0), cfg, 4)
    with pytest.raises(ValueError, match="give slices or ctas, not both"):
        ops.LaunchPlan.build(w, None, 1, torch.device("cuda", 0), cfg, 4, 8)


# The H200's driver answer for the skinny kernels at two CTAs an SM (scripts/experiments/skinny_cluster_capacity.py)
H200_SKINNY_CLUSTERS = {1: 264, 2: 132, 3: 79, 4: 62, 5: 47, 6: 39, 7: 32, 8: 30}


def test_skinny_cluster_split_rule():
    """The cluster split a light kernel ahead allows: the largest S <= 8 whose clusters all fit, that keeps a CTA
    an SM, and whose CTAs stream at most one unit more than stream-K's longest. Llama-3-8B's q/k/v (24 tiles of
    256, 32 stages) at m = 1 on the H200 takes 8 (measured -0.6 / -0.7 us a layer in the decode step); weights
    of more tiles than the clusters hold, of so few that S > 8 would be needed, or whose CTAs would stream much
    longer (gate_up, o, down, Llama-3-70B's q/k/v), keep stream-K; so do 16-row tiles."""
    cap = H200_SKINNY_CLUSTERS.get
    cfg = ops.SkinnyConfig(8, 4, 1, 3, 2)
    choose = ops.choose_skinny_cluster_split
    assert choose(cfg, 6144, 4096, 132, lambda s: cap(s, 0)) == 8
    for n, k in ((28672, 4096), (4096, 4096), (4096, 14336), (10240, 8192), (4608, 3584)):
        assert choose(cfg, n, k, 132, lambda s: cap(s, 0)) is None, (n, k)
    assert choose(cfg, 6144, 4096, 132, lambda s: 0) is None  # no room for any cluster
    assert choose(ops.SkinnyConfig(16, 4, 1, 4, 2), 6144, 4096, 132, lambda s: cap(s, 0)) is None


def test_light_ahead_takes_the_cluster_split_only_where_the_rule_does(described):
    """LaunchPlan.build with light_ahead: the dispatcher's skinny plan as its cluster split where the rule picks
    one (clusters launched, S CTAs a tile), and unchanged elsewhere, without the hint, or with the DSMEM split
    off; a forced configuration is never changed."""
    described(H200, driver_clusters=tuple(H200_SKINNY_CLUSTERS.items()))
    dev = torch.device("cuda", 0)
    qkv = _weight(6144, 4096, 128, False)
    lp = ops.LaunchPlan.build(qkv, None, 1, dev, light_ahead=True)
    assert isinstance(lp.config, ops.SkinnyConfig) and lp.geometry.cluster == 8 and lp.geometry.ctas == 8 * 6144 // lp.config.bn
    assert lp.launches[0][1].cluster == 8
    plain = ops.LaunchPlan.build(qkv, None, 1, dev)
    assert plain.geometry.cluster == 1
    off = ops.LaunchPlan.build(qkv, None, 1, dev, policy=ops.LaunchPolicy(dsmem_split=False), light_ahead=True)
    assert off.geometry.cluster == 1
    for n, k in ((28672, 4096), (4096, 4096), (4096, 14336)):
        assert ops.LaunchPlan.build(_weight(n, k, 128, False), None, 1, dev, light_ahead=True).geometry.cluster == 1
    forced = ops.LaunchPlan.build(qkv, None, 1, dev, ops.SkinnyConfig(8, 4, 1, 3, 2), light_ahead=True)
    assert forced.geometry.cluster == 1


def test_light_ahead_must_be_a_bool():
    """A light_ahead that is not a bool is a TypeError naming it, before any plan or launch (CPU too)."""
    import torch

    from tilefish import w4a16

    w = w4a16.quantize(torch.randn(256, 128), 128, True, dtype=torch.float16)
    x = torch.randn(1, 128, dtype=torch.float16)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="light_ahead must be True or False"):
            ops.matmul_impl(x, w, light_ahead=bad)
