"""Where a tensor-parallel decode step's time goes: the all-reduce latency of each transport, and the
step without communication.

Usage (2 GPUs): torchrun --nproc_per_node 2 scripts/profile_tp.py [--no-comm-step]
Prints, on rank 0, microseconds per all-reduce of a decode step's activations ([m, 4096] fp16, m = 1
and 16), 64 of them back to back in one CUDA graph (a 32-layer step has 64): NCCL through torch's
functional collectives, and torch's symmetric-memory one-shot / two-shot all-reduce (P2P over NVLink,
no multicast) when this torch has them.
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as fc

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def graph_us(fn, calls=64, reps=20):
    from tilefish.bench.e2e import _captured  # warm-up on a side stream, then one graph of `calls` calls

    replay = _captured(lambda: [fn() for _ in range(calls)])
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    rows = []
    for m in (1, 16):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        rows.append((f"nccl funcol m={m}", graph_us(lambda: fc.wait_tensor(fc.all_reduce(x, "sum", group)))))
        rows.append((f"nccl in-place m={m}", graph_us(lambda: dist.all_reduce(x))))
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(m * 4096, dtype=torch.float16, device="cuda")
            symm_mem.rendezvous(buf, group.group_name)
            name = group.group_name

            def one_shot():
                buf.copy_(x.view(-1))
                return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)

            def two_shot():
                buf.copy_(x.view(-1))
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
                return buf

            rows.append((f"symm_mem one-shot m={m}", graph_us(one_shot)))
            rows.append((f"symm_mem two-shot m={m}", graph_us(two_shot)))
            y = one_shot()
            full = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(full, x)
            err = (y.view(m, 4096).float() - sum(f.float() for f in full)).abs().max().item()
            rows.append((f"symm_mem one-shot m={m} max abs err vs gathered sum", err))
        except Exception as e:  # noqa: BLE001
            rows.append((f"symm_mem m={m} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}", float("nan")))
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
        for name, us in rows:
            print(f"  {name:60s} {us:8.2f} us")
    if "--no-comm-step" in sys.argv:  # the e2e step at TP = world with every all-reduce skipped (wrong values)
        from tilefish import distributed
        from tilefish.bench import e2e_tp

        distributed._all_reduce = lambda y, group: y
        rep = e2e_tp.run([world], impls=("fp16", "w4a16"), batches=(1, 16))
        if rank == 0:
            print("without the all-reduces (values wrong, times only):")
            print(rep.table())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
