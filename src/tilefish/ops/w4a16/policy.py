"""The launch policy of the W4A16 / NF4 op and the kernels launched around it (norm, rope_attention): the launch
choices A/Bs, sweeps and the sanitizer switch.

A LaunchPolicy is one immutable value, checked when it is made. Every plan is made under one:
an explicit `policy=` argument (LaunchPlan.build, matmul_impl, plan), else the active one, which
`launch_policy(p)` sets for a with-block and restores on the way out, exceptions included. Like
torch.autocast, the active policy belongs to the thread (and asyncio task) that set it; a new
thread starts with the default, LaunchPolicy().

How a policy stays out of other policies' plans:
- The cached planners (choose_config, choose_hopper_plan, choose_hopper_slices, decide,
  launch_geometry) see the policy only through their arguments: the DSMEM switch as the cluster
  capacity they plan with (planner_clusters: () when it is off), the tail mode as an argument of
  launch_geometry. A cache hit is therefore always a plan of the same policy.
- A launch plan kept across calls (W4A16Linear keeps one per input shape and stream) must key it on
  active_policy_key() as well: equal policies share a key, so an A/B that alternates two policies
  keeps both plans instead of rebuilding one each round. A CUDA graph replays the launches made
  while it was captured, under the policy active then.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass

SEPARATE_TAIL_MODES = ("rule", "never", "always")


@dataclass(frozen=True)
class LaunchPolicy:
    """dsmem_split: a wgmma k split of 2..8 slices whose clusters all fit at once sums its partials
    through distributed shared memory in a cluster of the slices (False: every split goes through
    the global workspace, and the planners plan as if the GPU had no clusters).
    separate_tail: the partial last wave of a whole-tile wgmma plan as a launch of its own
    (geometry.separate_tail): "rule" (where it was measured to help), "never", or "always" (any
    partial wave that fits one CTA an SM).
    programmatic: every launch under programmatic dependent launch (sm_90+): a kernel may start while
    the one ahead of it in the stream finishes, streaming its first weights meanwhile (the kernels wait
    for it before reading x or writing anything); the tilefish kernels around it (tilefish.norm) follow
    the same switch. False: each launch starts once the kernel ahead has ended.
    wide_clusters: clusters of more than the portable 8 CTAs (sm_90's non-portable sizes, up to 16) where a
    plan takes them: today rope_attention's split combine (ops.rope_attention.max_cluster_splits). False: 8 at
    most, as on every other GPU."""

    dsmem_split: bool = True
    separate_tail: str = "rule"
    programmatic: bool = True
    wide_clusters: bool = True

    def __post_init__(self):
        if not isinstance(self.dsmem_split, bool):
            raise ValueError(f"LaunchPolicy.dsmem_split must be True or False, got {self.dsmem_split!r}")
        if not isinstance(self.programmatic, bool):
            raise ValueError(f"LaunchPolicy.programmatic must be True or False, got {self.programmatic!r}")
        if not isinstance(self.wide_clusters, bool):
            raise ValueError(f"LaunchPolicy.wide_clusters must be True or False, got {self.wide_clusters!r}")
        if not isinstance(self.separate_tail, str) or self.separate_tail not in SEPARATE_TAIL_MODES:
            raise ValueError(f"LaunchPolicy.separate_tail must be 'rule', 'never' or 'always', got "
                             f"{self.separate_tail!r}")

    def planner_clusters(self, capacity: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        """The cluster capacity the planners see under this policy: the GPU's, or () with the DSMEM
        split off (a k split then never runs as clusters, and the time model weighs it that way)."""
        return capacity if self.dsmem_split else ()


DEFAULT_POLICY = LaunchPolicy()

# Equal policies share one small int key (interned under a lock: activations are rare).
_keys: dict[LaunchPolicy, int] = {DEFAULT_POLICY: 0}
_keys_lock = threading.Lock()
_active: contextvars.ContextVar[tuple[LaunchPolicy, int]] = contextvars.ContextVar(
    "tilefish_w4a16_launch_policy", default=(DEFAULT_POLICY, 0))


def _key_of(policy: LaunchPolicy) -> int:
    key = _keys.get(policy)
    if key is None:
        with _keys_lock:
            key = _keys.setdefault(policy, len(_keys))
    return key


def active_policy() -> LaunchPolicy:
    """The policy plans are made under where no `policy=` is given."""
    return _active.get()[0]


def active_policy_key() -> int:
    """A small int naming the active policy (equal policies, equal keys): part of the key of any
    launch plan kept across calls, so a plan made under another policy is never reused."""
    return _active.get()[1]


def resolve_policy(policy: LaunchPolicy | None) -> LaunchPolicy:
    """`policy`, checked, or the active one for None."""
    if policy is None:
        return _active.get()[0]
    if not isinstance(policy, LaunchPolicy):
        raise TypeError(f"policy must be an ops.w4a16.LaunchPolicy or None, got {type(policy).__name__}")
    return policy


@contextlib.contextmanager
def launch_policy(policy: LaunchPolicy):
    """Make `policy` the active one inside the with-block (this thread / task), restoring the one
    before on exit, exceptions included. E.g. an A/B of the workspace fixup:

        with ops.w4a16.launch_policy(ops.w4a16.LaunchPolicy(dsmem_split=False)):
            y = layer(x)
    """
    if not isinstance(policy, LaunchPolicy):
        raise TypeError(f"launch_policy takes an ops.w4a16.LaunchPolicy, got {type(policy).__name__}")
    token = _active.set((policy, _key_of(policy)))
    try:
        yield policy
    finally:
        _active.reset(token)
