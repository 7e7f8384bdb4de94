"""Where a skinny W4A16 GEMM's time goes *inside* a decode step: per-CTA %globaltimer stamps of every skinny launch
of the e2e bench's captured step (scripts/profile_e2e.py's captured_step), with programmatic launch from the kernels
around it, unlike scripts/experiments/timeline_w4a16_skinny.py, which times one kernel alone.

The skinny kernels are built with -D TF_TIMELINE (kernels/w4a16/timeline.cuh: each CTA stamps its entry, the
consumers' and the producer's return from grid_dependency_wait, its first stage landing, its final main loop's end,
the tile counter's reply, its end; skinny.cu lists them) and each launch gets its fp32 partials with room for the
stamps after them (torch.empty inside the capture: no memset kernel joins the step). The stamps are poisoned
(-1) before the last replay, which is read back. Every time is in us from the step's first skinny CTA entry.

Per launch, in step order: the weight and plan, CTAs, then the earliest entry and the median / latest CTA of each
stamp, and how long after the launch ahead's last CTA ended its own last one did (its share of the chain).

Then, per weight (the median over its launches), the CTA that ended last, its stamps from the launch's producer
wait: where a launch's tail goes (its final fixup: slots summed, then the epilogue; or a fixup the finisher ran).
With an output path (argument 4) the raw stamps go there too (torch.save: records and their [ctas, 16] stamps).

Usage (device): python scripts/experiments/timeline_decode_step.py [layers] [batch] [replays] [stamps.pt]   (8 1 20)
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

import tilefish.ops.w4a16.launch as w4a16_launch
from tilefish.bench import e2e
from tilefish.models.llama import LlamaConfig
from tilefish.ops.w4a16.configs import SKINNY_SOURCE, SkinnyConfig
from tilefish.ops.w4a16.workspace import StreamTurn
from tilefish.runtime import i32

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import profile_e2e  # noqa: E402

# The last CTA's stamps, in the order it passes them (6: its consumers' fixup's slots summed; 13 / 14: a fixup
# its finisher ran, begun / ended; 4: the finisher's exit).
TAIL = [(12, "producer wait"), (2, "first stage"), (8, "loop end"), (9, "counter reply"), (13, "fin. fixup"),
        (14, "fin. fixed"), (4, "fin. exit"), (10, "fix ready"), (6, "slots summed"), (5, "end")]
# Stamp index -> what it marks (kernels/w4a16/skinny.cu's timeline comment), in the order a CTA passes them.
STAMPS = [(0, "entry"), (12, "producer wait"), (11, "consumer wait"), (2, "first stage"), (8, "loop end"),
          (9, "counter reply"), (10, "fix ready"), (5, "end")]


@dataclasses.dataclass
class Record:
    label: str
    k: int
    n: int
    ctas: int
    buf: torch.Tensor  # fp32 partials, then 16 int64 stamps a CTA
    partials: int
    captured: bool

    def stamps(self) -> torch.Tensor:
        return self.buf[self.partials:self.partials + 32 * self.ctas].view(torch.int64).view(self.ctas, 16)


RECORDS: list[Record] = []


def instrument() -> None:
    """Skinny kernels from now on are TF_TIMELINE builds (with env TIMELINE_DEFINES's comma list of experiment
    switches too), and their launches record their partials + stamps."""
    get = w4a16_launch.get_kernel

    extra = tuple((d, "1") for d in os.environ.get("TIMELINE_DEFINES", "").split(",") if d)

    def get_kernel(spec, device=None):
        if spec.source == SKINNY_SOURCE:
            spec = dataclasses.replace(spec, defines=spec.defines + (("TF_TIMELINE", "1"),) + extra)
        return get(spec, device)

    w4a16_launch.get_kernel = get_kernel
    w4a16_launch._kernels.clear()
    plain = w4a16_launch.LaunchPlan.launch

    def launch(self, x_ptr, out_ptr, residual_ptr=0, gated=False):
        if not isinstance(self.config, SkinnyConfig):
            return plain(self, x_ptr, out_ptr, residual_ptr, gated)
        ctas = self.geometry.ctas
        buf = torch.empty(self.partials + 32 * ctas, dtype=torch.float32, device=self.device)
        n = int(self.launches[0][4][1])  # the launch's tail: (m, n, k)
        RECORDS.append(Record(self.config.label(), self.k, n, ctas, buf, self.partials,
                              torch.cuda.is_current_stream_capturing()))
        epilogue = (residual_ptr, i32(1 if gated else 0))
        if self.counters is None:
            fresh = torch.zeros(self.tiles, dtype=torch.int32, device=self.device)
            self._enqueue(x_ptr, out_ptr, buf.data_ptr(), fresh.data_ptr(), epilogue)
        else:
            with StreamTurn(self.counters, self.device.index) as counters_ptr:
                self._enqueue(x_ptr, out_ptr, buf.data_ptr(), counters_ptr, epilogue)

    w4a16_launch.LaunchPlan.launch = launch


def summary(records: list[Record]) -> None:
    tables = [r.stamps().cpu() for r in records]
    t0 = min(int(t[:, 0][t[:, 0] >= 0].min()) for t in tables)
    print(f"{'#':>3s} {'weight':>12s} {'plan':22s} {'ctas':>4s} " + " ".join(f"{name:>17s}" for _, name in STAMPS)
          + f" {'after ahead':>11s}")
    print(f"{'':47s}" + " ".join(f"{'first/med/last':>17s}" if i == 0 else f"{'med/last':>17s}" for i, _ in STAMPS))
    ahead_end = None
    for i, (r, t) in enumerate(zip(records, tables)):
        cells = []
        for idx, _ in STAMPS:
            v = sorted((int(x) - t0) / 1e3 for x in t[:, idx] if x >= 0)
            if not v:
                cells.append(f"{'-':>17s}")
            elif idx == 0:
                cells.append(f"{v[0]:5.1f}/{statistics.median(v):5.1f}/{v[-1]:5.1f}")
            else:
                cells.append(f"{statistics.median(v):8.1f}/{v[-1]:5.1f}")
        ends = [int(x) for x in t[:, 5] if x >= 0]
        end = (max(ends) - t0) / 1e3 if ends else None
        share = f"{end - ahead_end:11.2f}" if end is not None and ahead_end is not None else f"{'':>11s}"
        print(f"{i:3d} {f'{r.k}x{r.n}':>12s} {r.label:22s} {r.ctas:4d} " + " ".join(cells) + share)
        ahead_end = end if end is not None else ahead_end


def tails(records: list[Record]) -> None:
    """Per weight, the median over its launches of the last-ending CTA's stamps from the launch's median producer
    wait (- where that CTA has none), and how many CTAs ran a fixup in their finisher."""
    by_weight: dict[tuple[int, int], list[list[float]]] = {}
    fin_fixups: dict[tuple[int, int], list[int]] = {}
    for r in records:
        t = r.stamps().cpu()
        waits = sorted(int(x) for x in t[:, 12] if x >= 0)
        ends = t[:, 5]
        if not waits or int(ends.max()) < 0:
            continue
        origin = statistics.median(waits)
        last = t[int(ends.argmax())]
        row = [(int(last[i]) - origin) / 1e3 if last[i] >= 0 else float("nan") for i, _ in TAIL]
        by_weight.setdefault((r.k, r.n), []).append(row)
        fin_fixups.setdefault((r.k, r.n), []).append(int((t[:, 13] >= 0).sum()))
    print("\nThe last CTA of each weight's launches (median over them), us from the launch's median producer wait")
    print(f"{'weight':>12s} " + " ".join(f"{name:>13s}" for _, name in TAIL) + f" {'fin. fixups':>11s}")
    for (k, n), rows in by_weight.items():
        cells = []
        for j in range(len(TAIL)):
            v = [row[j] for row in rows if row[j] == row[j]]
            cells.append(f"{statistics.median(v):13.2f}" if v else f"{'-':>13s}")
        print(f"{f'{k}x{n}':>12s} " + " ".join(cells) + f" {statistics.median(fin_fixups[(k, n)]):11.0f}")


def main():
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    replays = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    cfg = LlamaConfig.llama3_8b(layers)
    dev = torch.device("cuda")
    instrument()
    torch.manual_seed(0)
    runner = e2e._HF(cfg, dev)
    with torch.no_grad():
        profile_e2e.convert_variant(runner, "w4a16")
        replay = profile_e2e.captured_step(runner, cfg, batch, dev)
    captured = [r for r in RECORDS if r.captured]
    if not captured:
        raise SystemExit("no skinny launch was captured in the step (batch > 16, or not an sm_90 GPU?)")
    for _ in range(replays):
        replay()
    for r in captured:
        r.stamps().fill_(-1)
    replay()
    torch.cuda.synchronize()
    print(f"GPU {torch.cuda.get_device_name()}, {layers} layers, batch {batch}: {len(captured)} skinny launches a step "
          f"(us from the step's first skinny CTA entry; stamps of the replay after {replays})")
    summary(captured)
    tails(captured)
    if len(sys.argv) > 4:
        torch.save([dict(label=r.label, k=r.k, n=r.n, ctas=r.ctas, stamps=r.stamps().cpu().clone()) for r in captured],
                   sys.argv[4])


if __name__ == "__main__":
    main()
