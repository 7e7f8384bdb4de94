"""The Marlin benchmark peer (tilefish.bench.peers.marlin): its weight / scale layout bit for bit against an
independent, loop-by-loop rendering of Marlin's Layer.pack, availability reasons, the build's PTX patch."""
from __future__ import annotations

import re

import pytest
import torch

from conftest import TOLERANCE, poison, rel_err
from tilefish.bench.peers import marlin as mp
from tilefish.bench.peers.marlin import (
    MarlinBuildError,
    MarlinPatchError,
    MarlinPeer,
    pack_marlin,
    patch_kernel_source,
    unpack_marlin,
    workspace_size,
)
from tilefish.quant.int4 import Int4Weight


def random_weight(n, k, group_size, dtype=torch.float16, seed=0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    G = k if group_size == -1 else group_size
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // G, generator=gen) * 0.1 + 1e-3).to(dtype)
    return Int4Weight(q, scales, None, group_size)


# ------------------------------------------------------------------------------------------------------------
# an independent reference: Marlin's Layer.pack (marlin/__init__.py at 2f6d7c1), step by step, with plain loops


def marlin_perms():
    """Marlin's _get_perms, as loops over Python lists: (_perm [1024], _scale_perm [64], _scale_perm_single [32])."""
    perm = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    interleave = [0, 2, 4, 6, 1, 3, 5, 7]
    perm = [perm[8 * c + interleave[t]] for c in range(len(perm) // 8) for t in range(8)]
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    scale_perm_single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return perm, scale_perm, scale_perm_single


def marlin_pack_loops(w: Int4Weight):
    """B (list of rows of int32 words) and s (list of rows) as Layer.pack makes them from the same integers:
    w [k, n] = q^T; 16 x 16 tiles row-major side by side; _perm per 1024; nibble i = value i of each 8."""
    perm, scale_perm, scale_perm_single = marlin_perms()
    n, k = w.n, w.k
    q = w.q.tolist()
    res = [[0] * (n * 16) for _ in range(k // 16)]
    for kk in range(k):
        for nn in range(n):
            res[kk // 16][(nn // 16) * 256 + (kk % 16) * 16 + nn % 16] = q[nn][kk]
    B = []
    for row in res:
        permuted = [row[1024 * (c // 1024) + perm[c % 1024]] for c in range(len(row))]
        words = []
        for c in range(0, len(permuted), 8):
            word = 0
            for i in range(8):
                word |= permuted[c + i] << (4 * i)
            words.append(word - (1 << 32) if word >= 1 << 31 else word)
        B.append(words)
    sc = w.scales.t().tolist()  # [groups, n]
    p = scale_perm_single if w.groups == 1 else scale_perm
    flat = [v for row in sc for v in row]
    flat = [flat[len(p) * (c // len(p)) + p[c % len(p)]] for c in range(len(flat))]
    s = [flat[g * n:(g + 1) * n] for g in range(len(sc))]
    return B, s


CASES = [(256, 256, -1), (256, 256, 128), (256, 512, 128), (256, 512, -1), (128, 256, 128), (512, 256, 128)]


@pytest.mark.parametrize("k,n,group", CASES)
def test_pack_matches_marlin_layer_pack(k, n, group):
    w = random_weight(n, k, group, seed=k + n + group)
    B, s = pack_marlin(w)
    assert B.dtype == torch.int32 and tuple(B.shape) == (k // 16, 2 * n) and B.is_contiguous()
    assert s.dtype == torch.float16 and tuple(s.shape) == (w.groups, n) and s.is_contiguous()
    ref_B, ref_s = marlin_pack_loops(w)
    assert B.tolist() == ref_B
    assert torch.equal(s, torch.tensor(ref_s, dtype=torch.float16))


@pytest.mark.parametrize("k,n,group", CASES)
def test_round_trip_bit_for_bit(k, n, group):
    w = random_weight(n, k, group, seed=7 * k + n)
    B, s = pack_marlin(w)
    back = unpack_marlin(B, s, n, k, group)
    assert back.group_size == group and back.zeros is None
    assert torch.equal(back.q, w.q)
    assert torch.equal(back.scales.view(torch.int16), w.scales.view(torch.int16))


@pytest.mark.parametrize("k,n,group", [(256, 512, 128), (128, 256, 128), (1024, 256, -1)])
def test_pack_matches_marlins_own_layer_pack(k, n, group):
    """Marlin's Layer.pack itself (the vendored marlin/__init__.py, marlin_cuda stubbed: pack is pure torch +
    numpy) on a layer fake-quantized from the same integers and scales."""
    import sys
    import types

    d = mp.find_source_dir()
    if d is None or not (d / "marlin_layer.py").is_file():
        pytest.skip("Marlin not vendored with marlin_layer.py (scripts/vendor_marlin.sh)")
    stub = types.ModuleType("marlin_cuda")
    saved = sys.modules.get("marlin_cuda")
    sys.modules["marlin_cuda"] = stub
    try:
        ns: dict = {"__name__": "marlin_layer"}
        exec(compile((d / "marlin_layer.py").read_text(), str(d / "marlin_layer.py"), "exec"), ns)
    finally:
        if saved is None:
            sys.modules.pop("marlin_cuda", None)
        else:
            sys.modules["marlin_cuda"] = saved
    w = random_weight(n, k, group, seed=5)
    linear = torch.nn.Linear(k, n, bias=False).half()
    linear.weight.data = w.dequantize(torch.float16)  # round(W / s) + 8 gives q back: |W / s - (q - 8)| < 2^-8
    layer = ns["Layer"](k, n, groupsize=group)
    layer.pack(linear, w.scales)  # scales [n, groups], as Marlin's test.py passes them
    B, s = pack_marlin(w)
    assert torch.equal(layer.B, B)
    assert torch.equal(layer.s, s)


def test_perm_prefix_as_published():
    # Marlin's _perm starts, for lane 0: tile rows 0, 1, 8, 9 of column 0 then of column 8, interleaved.
    perm, scale_perm, single = marlin_perms()
    assert perm[:8] == [0, 128, 8, 136, 16, 144, 24, 152]
    assert mp._lane_tile_order().tolist() == perm
    assert mp._scale_order(False).tolist() == scale_perm
    assert mp._scale_order(True).tolist() == single
    assert single[:8] == [0, 1, 8, 9, 16, 17, 24, 25]


def test_first_word_by_hand():
    # q[n, k] = (k + 3 n) % 16: word 0 of band 0 is lane 0's tile-0 values, nibble i = value NIBBLE_ORDER[i] of
    # (k, n) = (0,0) (1,0) (8,0) (9,0) (0,8) (1,8) (8,8) (9,8).
    n, k = 64, 16
    kk = torch.arange(k)[None, :]
    nn = torch.arange(n)[:, None]
    w = Int4Weight(((kk + 3 * nn) % 16).to(torch.uint8), torch.ones(n, 1, dtype=torch.float16), None, -1)
    B, _ = pack_marlin(w)
    vals = [(a + 3 * b) % 16 for a, b in ((0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8))]
    want = sum(vals[[0, 2, 4, 6, 1, 3, 5, 7][i]] << (4 * i) for i in range(8))
    assert B[0, 0].item() & 0xFFFFFFFF == want


def test_single_group_when_group_equals_k():
    # k == 128 with group 128 is one group: Marlin (s.size(0) == 1 -> groupsize -1) uses the single-group order
    w = random_weight(256, 128, 128, seed=3)
    _, s = pack_marlin(w)
    _, s_single = pack_marlin(Int4Weight(w.q, w.scales, None, -1))
    assert torch.equal(s, s_single)


def test_pack_rejects_what_marlin_cannot_hold():
    w = random_weight(256, 256, 128)
    with pytest.raises(ValueError, match="symmetric"):
        pack_marlin(Int4Weight(w.q, w.scales, torch.full_like(w.q[:, :2], 8), 128))
    with pytest.raises(TypeError, match="fp16"):
        pack_marlin(Int4Weight(w.q, w.scales.to(torch.bfloat16), None, 128))
    with pytest.raises(ValueError, match="group_size"):
        pack_marlin(random_weight(256, 256, 64))
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_marlin(random_weight(96, 256, 128))
    B, s = pack_marlin(w)
    with pytest.raises(ValueError, match="B must be"):
        unpack_marlin(B[:, :-1], s, 256, 256, 128)
    with pytest.raises(ValueError, match="s must be"):
        unpack_marlin(B, s.float(), 256, 256, 128)


def test_workspace_size():
    assert workspace_size(4096) == 4096 // 128 * 16
    assert workspace_size(256, max_par=8) == 16
    ws = MarlinPeer.workspace(512, "cpu")
    assert ws.dtype == torch.int32 and ws.numel() == 64 and not ws.any()


# ------------------------------------------------------------------------------------------------------------
# availability


class FakeEnv(MarlinPeer):
    """A peer whose environment probes answer what the test says (everything usable by default)."""

    def __init__(self, tmp_path, **env):
        for name in (mp.KERNEL_FILE, mp.BINDING_FILE):
            if not (tmp_path / name).exists():
                (tmp_path / name).write_text("// no createpolicy here\n")
        super().__init__(source_dir=tmp_path)
        self.env = {"cuda_home": "/usr/local/cuda", "ninja": True, "torch_cuda": "13.0", "cap": (9, 0), **env}

    def _cuda_home(self):
        return self.env["cuda_home"]

    def _ninja(self):
        return self.env["ninja"]

    def _torch_cuda(self):
        return self.env["torch_cuda"]

    def _capability(self):
        return self.env["cap"]


def test_available_when_everything_is_there(tmp_path):
    assert FakeEnv(tmp_path).available(torch.float16, 128, k=4096, n=4096) is None
    assert FakeEnv(tmp_path).available(torch.float16, -1, k=128, n=256) is None


@pytest.mark.parametrize("env,match", [
    ({"cuda_home": None}, "nvcc not found"),
    ({"ninja": False}, "ninja"),
    ({"torch_cuda": None}, "CPU-only"),
    ({"cap": None}, "no CUDA device"),
    ({"cap": (7, 5)}, "sm_80 or newer .*sm_75"),
])
def test_available_environment_reasons(tmp_path, env, match):
    why = FakeEnv(tmp_path, **env).available(torch.float16, 128, k=4096, n=4096)
    assert why is not None and "\n" not in why and re.search(match, why), why


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.bfloat16), "fp16 only .*bfloat16"),
    (dict(dtype=torch.float32), "fp16 only"),
    (dict(group_size=64), "group size -1 or 128 only .*64"),
    (dict(group_size=32), "group size"),
    (dict(symmetric=False), "symmetric"),
    (dict(k=4096 + 64), r"k % 128 \(k=4160\)"),
    (dict(n=4096 + 128), r"n % 256 \(n=4224\)"),
    (dict(k=192, n=384), r"k % 128 \(k=192\), n % 256 \(n=384\)"),
])
def test_available_problem_reasons(tmp_path, kwargs, match):
    args = dict(dtype=torch.float16, group_size=128, k=4096, n=4096) | kwargs
    why = FakeEnv(tmp_path).available(**args)
    assert why is not None and "\n" not in why and re.search(match, why), why


def test_available_without_sources(tmp_path):
    peer = MarlinPeer(source_dir=tmp_path / "nothing")
    why = peer.available(torch.float16, 128, k=4096, n=4096)
    assert "not vendored" in why and "vendor_marlin.sh" in why


def test_failed_build_is_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path / "cache"))
    peer = FakeEnv(tmp_path)  # its kernel source lacks the createpolicy pattern: the build stops before nvcc
    assert peer.available(torch.float16, 128, k=4096, n=4096) is None
    why = peer.available(torch.float16, 128, k=4096, n=4096, build=True)
    assert why.startswith("build failed") and "createpolicy" in why
    assert peer.available(torch.float16, 128, k=4096, n=4096) == why  # remembered, without building again
    with pytest.raises(MarlinBuildError, match="build failed"):
        peer.build()


def test_build_patches_a_copy_and_loads_it_once(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    src = tmp_path / "src"
    src.mkdir()
    peer = FakeEnv(src)
    (src / mp.KERNEL_FILE).write_text(SYNTHETIC)
    calls = []

    def fake_load(**kw):
        import os

        calls.append(dict(kw, arch=os.environ.get("TORCH_CUDA_ARCH_LIST")))
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert peer.available(torch.float16, 128, k=4096, n=4096, build=True) is None
    assert peer.build() == "module" and len(calls) == 1
    kw = calls[0]
    assert kw["arch"] == "9.0" and "TORCH_CUDA_ARCH_LIST" not in __import__("os").environ
    assert kw["name"].startswith("tilefish_marlin_") and kw["name"].isidentifier()
    kernel = next(s for s in kw["sources"] if s.endswith(mp.KERNEL_FILE))
    assert str(tmp_path / "cache") in kernel and "createpolicy" not in open(kernel).read()
    assert "createpolicy" in (src / mp.KERNEL_FILE).read_text()  # the vendored copy stays as fetched
    assert "--expt-relaxed-constexpr" in kw["extra_cuda_cflags"]
    assert FakeEnv(src).build() == "module" and len(calls) == 1  # one load per process for the same sources


def test_matmul_calls_marlin_with_its_defaults(tmp_path):
    class FakeModule:
        def mul(self, *args):
            self.args = args

    peer = FakeEnv(tmp_path)
    peer._module = mod = FakeModule()
    x = torch.zeros(2, 3, 256, dtype=torch.float16)
    B, s = pack_marlin(random_weight(512, 256, 128))
    ws = MarlinPeer.workspace(512, "cpu")
    with pytest.raises(TypeError, match="fp16 CUDA"):  # CPU tensors are refused before Marlin sees them
        peer.matmul(x, B, s, ws)
    A, B2, C, s2, ws2, *rest = _call_without_device_check(peer, x, B, s, ws, mod)
    assert tuple(A.shape) == (6, 256) and B2 is B and s2 is s and ws2 is ws and tuple(C.shape) == (6, 512)
    assert rest == [-1, -1, -1, 16]


def _call_without_device_check(peer, x, B, s, ws, mod):
    class CudaLike(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    y = peer.matmul(x.as_subclass(CudaLike), B, s, ws)
    assert tuple(y.shape) == (2, 3, 512)
    return list(mod.args)


def test_this_machine_gives_a_reason_or_none():
    why = MarlinPeer().available(torch.float16, 128, k=4096, n=4096)
    assert why is None or (isinstance(why, str) and why and "\n" not in why)


# ------------------------------------------------------------------------------------------------------------
# the PTX patch

SYNTHETIC = r'''
__device__ inline void cp_async4_stream(void* smem_ptr, const void* glob_ptr) {
  const int BYTES = 16;
  uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile(
    "{\n"
    "   .reg .b64 p;\n"
    "   createpolicy.fractional.L2::evict_first.b64 p, 1.0;"
    "   cp.async.cg.shared.global.L2::cache_hint [%0], [%1], %2, p;\n"
    "}\n" :: "r"(smem), "l"(glob_ptr), "n"(BYTES)
  );
}
__device__ inline void cp_async_fence() { asm volatile("cp.async.commit_group;\n" ::); }
'''


def test_patch_replaces_the_policy_copy():
    out = patch_kernel_source(SYNTHETIC)
    assert "createpolicy" not in out and "cache_hint" not in out and ".reg .b64 p" not in out
    assert r'"   cp.async.cg.shared.global [%0], [%1], %2;\n"' in out
    assert out.count("cp.async.cg.shared.global") == 1
    # everything else is untouched
    policy = ('"   .reg .b64 p;\\n"\n'
              '    "   createpolicy.fractional.L2::evict_first.b64 p, 1.0;"\n'
              '    "   cp.async.cg.shared.global.L2::cache_hint [%0], [%1], %2, p;\\n"')
    assert policy in SYNTHETIC
    assert out == SYNTHETIC.replace(policy, r'"   cp.async.cg.shared.global [%0], [%1], %2;\n"')


def test_patch_missing_or_repeated_pattern_is_an_error():
    with pytest.raises(MarlinPatchError, match="found it 0 times"):
        patch_kernel_source(SYNTHETIC.replace("evict_first", "evict_last"))
    with pytest.raises(MarlinPatchError, match="found it 2 times"):
        patch_kernel_source(SYNTHETIC + SYNTHETIC)


def test_patch_applies_to_the_vendored_source():
    d = mp.find_source_dir()
    if d is None:
        pytest.skip("Marlin not vendored (scripts/vendor_marlin.sh)")
    src = (d / mp.KERNEL_FILE).read_text()
    out = patch_kernel_source(src)
    assert "createpolicy" not in out and len(out) < len(src)


def test_vendor_sources_from_a_git_dir(tmp_path):
    import subprocess

    repo = tmp_path / "marlin"
    (repo / "marlin").mkdir(parents=True)
    (repo / "marlin" / mp.KERNEL_FILE).write_text(SYNTHETIC)
    (repo / "marlin" / mp.BINDING_FILE).write_text("// binding\n")
    (repo / "marlin" / "__init__.py").write_text("# layer\n")
    (repo / "LICENSE").write_text("Apache-2.0\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    dest = mp.vendor_sources(repo / ".git", tmp_path / "vendored")
    assert (dest / mp.KERNEL_FILE).read_text() == SYNTHETIC
    assert (dest / "marlin_layer.py").read_text() == "# layer\n"
    assert len((dest / "COMMIT").read_text().strip()) == 40
    assert MarlinPeer(source_dir=dest).source_dir() == dest


# ------------------------------------------------------------------------------------------------------------
# GPU: Marlin's output against tilefish's reference on the same integers


@pytest.mark.gpu
@pytest.mark.parametrize("group", [128, -1])
def test_marlin_matches_reference(cuda, group):
    from tilefish.reference import w4a16_matmul

    peer = MarlinPeer()
    k, n = 1024, 512
    why = peer.available(torch.float16, group, k=k, n=n, build=True)
    if why is not None:
        pytest.skip(f"Marlin unavailable: {why}")
    w = random_weight(n, k, group, seed=11).to(cuda)
    mw = peer.prepare(w)
    for m in (1, 7, 16, 33, 64, 130, 512):
        x = torch.randn(m, k, dtype=torch.float16, device=cuda)
        out = poison(torch.empty(m, n, dtype=torch.float16, device=cuda))
        y = peer.matmul(x, mw.B, mw.s, mw.workspace, out=out)
        ref = w4a16_matmul(x, w)
        assert rel_err(y, ref) < TOLERANCE[torch.float16], (m, rel_err(y, ref))
        assert not mw.workspace.any(), "Marlin left its lock workspace dirty"
    y3 = peer.matmul(torch.randn(2, 3, k, dtype=torch.float16, device=cuda), mw.B, mw.s, mw.workspace)
    assert y3.shape == (2, 3, n)


# ---- bench w4a16 --peers marlin: the CLI and suite plumbing (the timing itself needs the GPU) ---------------------

def test_bench_peers_flag_reaches_run(monkeypatch, capsys):
    from tilefish import cli
    from tilefish.bench.families import FAMILIES
    from tilefish.bench import w4a16 as bench_w4a16

    seen, calls = [], []
    monkeypatch.setattr(cli, "cmd_bench", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(bench_w4a16, "run", lambda **kw: calls.append(kw))
    assert cli.main(["bench", "w4a16", "--peers", "marlin"]) == 0
    assert cli.main(["bench", "w4a16"]) == 0
    for args in seen:
        FAMILIES["w4a16"].run(args)
    assert [kw["peers"] for kw in calls] == [("marlin",), ()]
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "w4a16", "--peers", "exllama"])
    assert e.value.code == 2 and "marlin" in capsys.readouterr().err


def test_bench_run_rejects_an_unknown_peer():
    from tilefish.bench import w4a16 as bench_w4a16

    with pytest.raises(ValueError, match="known: marlin"):
        bench_w4a16.run(shapes=[(4096, 4096)], peers=("exllama",))
