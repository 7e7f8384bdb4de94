"""tilefish command line: info | compile | bench | tune | table | demo (`tilefish --help` lists them from the
parser, with one line each)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# How long `tilefish bench` (no family, the quick run) takes: `tilefish bench --help` says it, and the README
# states the same words (tests/test_cli.py checks both). Measured: 58 s wall on an H100 from a cold kernel cache.
QUICK_RUN_TIME = "under two minutes on an H100, compilation included"


def _dir_size(path: Path) -> tuple[int, int]:
    n = size = 0
    if path.is_dir():
        for f in path.rglob("*"):
            if f.is_file():
                n += 1
                size += f.stat().st_size
    return n, size


def cmd_info(args) -> int:
    import torch

    from . import __version__
    from .runtime import cache_dir
    from .runtime.compiler import nvrtc_version

    print(f"tilefish        {__version__}")
    print(f"torch           {torch.__version__} (CUDA {torch.version.cuda})")
    try:
        import cuda.core

        print(f"cuda-core       {cuda.core.__version__}")
    except ImportError as e:
        print(f"cuda-core       not importable: {e}")
    try:
        print(f"NVRTC           {nvrtc_version()}")
    except Exception as e:  # noqa: BLE001
        print(f"NVRTC           not usable: {e}")
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        print(f"CUDA driver     {v // 1000}.{v % 1000 // 10}" if int(err) == 0 else f"CUDA driver     none ({err})")
    except Exception as e:  # noqa: BLE001
        print(f"CUDA driver     none ({e.__class__.__name__})")
    if torch.cuda.is_available():
        from .runtime import device_info

        for i in range(torch.cuda.device_count()):
            d = device_info(i)
            print(f"GPU {i}           {d.name}  {d.arch}  {d.sm_count} SMs  L2 {d.l2_bytes / 2**20:.0f} MiB  "
                  f"memory {d.total_memory / 2**30:.1f} GiB  smem/block {d.smem_per_block_optin // 1024} KiB")
    else:
        print("GPU             none visible to torch (kernels compile; they cannot run)")
    cd = cache_dir()
    n, size = _dir_size(cd)
    on = os.environ.get("TILEFISH_CACHE", "1") not in ("0", "false", "no", "off")
    print(f"kernel cache    {cd}  ({n} files, {size / 2**20:.1f} MiB){'' if on else '  [disabled: TILEFISH_CACHE=0]'}")
    return 0


def cmd_compile(args) -> int:
    from .ops import kernel_specs
    from .runtime import compile_many

    archs = args.arch or ["sm_80", "sm_90"]
    jobs = [(fam, spec, arch) for arch in archs for fam, spec in kernel_specs(include_variants=args.all, arch=arch)
            if spec.supports(arch)]
    results = compile_many([(s, a) for _, s, a in jobs], args.jobs)
    failures = 0
    print(f"{'arch':7s} {'family':7s} {'kernel':74s} {'regs':>5s} {'smem':>7s} {'stack':>6s} {'spill':>9s}")
    for (fam, spec, arch), (r, log) in zip(jobs, results):
        if r is None:
            failures += 1
            print(f"{arch:7s} {fam:7s} {spec.name} {spec.defines} COMPILE ERROR\n{log}", file=sys.stderr)
            continue
        unknown = spec.hot and r.registers < 0  # no ptxas report: spills cannot be ruled out
        bad = spec.hot and r.spills
        failures += bad or unknown
        flag = "  SPILLS IN HOT KERNEL" if bad else "  NO PTXAS REPORT (spills unchecked)" if unknown else ""
        name = spec.name + "".join(f" -D{k}" for k, _ in spec.defines)
        print(f"{spec.target(arch):7s} {fam:7s} {name[:74]:74s} {r.registers:5d} {r.static_smem:7d} "
              f"{r.stack_bytes:6d} {r.spill_stores:4d}/{r.spill_loads:<4d}{flag}")
    print(f"{len(jobs)} kernel(s), {failures} failure(s)")
    return 1 if failures else 0


# `tilefish compile --arch`: the GPUs a user may have (A100, RTX 30xx / A10 / A40, RTX 40xx / L4 / L40,
# H100 / H200, B200, RTX 50xx).
COMPILE_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: a flag it does not define is its own usage error, under its own usage line (argparse
    leaves unknown flags to the top level, whose usage names no subcommand). On `tilefish bench`, a family's flag
    given with no family named is an error naming the families that take it (argparse alone would read the
    flag's value as a family's name)."""
    family_flags: dict[str, list[str]] = {}  # `tilefish bench`: flag -> the families that define it

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if not {name for names in self.family_flags.values() for name in names}.intersection(args):
            for flag in (a.split("=", 1)[0] for a in args):
                if flag in self.family_flags:
                    self.error(f"{flag} applies to one family (tilefish bench {'|'.join(self.family_flags[flag])} "
                               f"{flag} ...); the all-families run, quick or --full, has a fixed plan")
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _bench_flags(all_families: bool) -> argparse.ArgumentParser:
    """The flags of every `tilefish bench` run, as a parent parser. A family's copy has no defaults (SUPPRESS):
    `tilefish bench` itself sets them, so a value given before the family (bench --out DIR w4a16) stands."""
    def default(value):
        return value if all_families else argparse.SUPPRESS

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", metavar="DIR", default=default(None),
                   help="all families: where the JSON / PNG / summary go (default ./tilefish-results/<gpu>-<date>); "
                   "one family: DIR/<family>.json and .png")
    p.add_argument("--json", metavar="PATH", default=default(None),
                   help="write the report as JSON here (all families: the summary report, besides --out)")
    p.add_argument("--plot", metavar="PATH", default=default(None),
                   help="write a PNG plot here (all families: the summary report's)")
    p.add_argument("--reps", type=int, default=default(50), help="timed runs per measurement (default 50)")
    return p


def cmd_bench(args) -> int:
    from .bench.families import FAMILIES

    family = FAMILIES.get(args.family)
    if family is not None and args.full:
        print(f"tilefish bench: --full is for the all-families run; `tilefish bench {args.family}` already runs "
              f"its complete set", file=sys.stderr)
        return 2
    if family is not None and (text := family.text_instead_of_run(args)) is not None:  # needs no GPU
        print(text)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("tilefish bench needs an NVIDIA GPU (sm_80 or newer); none is visible to torch.", file=sys.stderr)
        return 2
    if family is None:  # every family: the quick plan or --full, one progress bar, one summary (bench/quick.py)
        from .bench import quick

        return quick.run(args, full=args.full, out=args.out)
    rep = family.run(args)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun (bench e2e --tp) rank 0 reports
        return 0
    print(rep.table(), flush=True)
    if summary := family.summary(rep):
        print("\n" + summary, flush=True)
    print()
    json_path, plot_path = args.json, args.plot
    if args.out:  # --out DIR with one family: DIR/<family>.json and .png unless --json / --plot say otherwise
        json_path = json_path or str(Path(args.out) / f"{args.family}.json")
        plot_path = plot_path or str(Path(args.out) / f"{args.family}.png")
    if json_path:
        rep.to_json(json_path)
        print(f"wrote {json_path}")
    if plot_path:
        try:
            rep.plot(plot_path)
            print(f"wrote {plot_path}")
        except ImportError as e:
            if args.plot:  # asked for by name: as before
                raise
            print(f"no PNG: {e.name or 'matplotlib'} is not installed (pip install 'tilefish[bench]')")
    return 0


def _tune_groups(args) -> tuple[int, ...] | None:
    """tune --groups as ints, or None after a one-line error naming the allowed sizes."""
    try:
        groups = tuple(int(g) for g in args.groups.split(",") if g.strip())
    except ValueError:
        groups = ()
    allowed = (-1, 32, 64, 128) if args.codebook == "int4" else (32, 64, 128)
    if not groups or any(g not in allowed for g in groups):
        print(f"tilefish tune: --groups takes comma-separated group sizes from {allowed}; got {args.groups!r}",
              file=sys.stderr)
        return None
    return groups


def cmd_tune(args) -> int:
    import torch

    groups = _tune_groups(args)
    if groups is None:
        return 2
    if not torch.cuda.is_available():
        print("tilefish tune measures kernels on a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from .bench.tune import DEFAULT_TUNE_M, tune

    if args.models == "list":
        print("--models list: see `tilefish bench w4a16 --list-models`", file=sys.stderr)
        return 2
    ms = tuple(int(v) for v in args.m.split(",")) if args.m else DEFAULT_TUNE_M
    tune(shapes=args.shapes, models=args.models, ms=ms, dtypes=tuple(args.dtypes.split(",")), groups=groups,
         codebook=args.codebook, out=args.out, cublas=args.cublas, progress=lambda s: print(s, flush=True))
    return 0


def _load_report(path: str):
    """(the Report in the benchmark JSON at path, None), or (None, a one-line reason it is not one: missing,
    unreadable, not JSON, not a tilefish report)."""
    import json

    from .bench.report import Report

    try:
        return Report.from_json(path), None
    except OSError as e:  # missing, a directory, no permission
        return None, e.strerror or e.__class__.__name__
    except UnicodeDecodeError:
        return None, "not a text file (expected a benchmark JSON, as `tilefish bench --json PATH` writes)"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # JSON, but not the report's fields
        what = f"no {e} field; " if isinstance(e, KeyError) else ""
        return None, (f"not a tilefish benchmark report ({what}expected the JSON object `tilefish bench --json PATH` "
                      f"writes, with 'title' and 'rows')")


def cmd_table(args) -> int:
    reports = []
    for path in args.paths:  # every file read before anything is printed: a bad one is an error on its own
        rep, why = _load_report(path)
        if rep is None:
            print(f"tilefish table: {path}: {why}", file=sys.stderr)
            return 2
        reports.append(rep)
    for rep in reports:
        if args.plot:
            rep.plot(args.plot)
        env = getattr(rep, "environment", {})
        print(f"**{rep.title}** — {env.get('gpu', '?')}, commit {env.get('commit', '?')[:12]}, "
              f"{env.get('date', '?')[:10]}; ceilings: "
              + ", ".join(f"{k} {v:,.0f}" for k, v in rep.ceilings.items()) + "\n")
        print(rep.markdown())
        for n in rep.notes:
            print(f"\n{n}")
        print()
    return 0


def cmd_demo(args) -> int:
    import torch

    from . import nf4

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    q = nf4.quantize(w, blocksize=64, double_quant=True)
    w_hat = nf4.dequantize(q, torch.bfloat16)
    rel = ((w_hat.float() - w.float()).norm() / w.float().norm()).item()
    print(f"NF4 4096x4096 on {dev}: {q.codes.numel() / 2**20:.1f} MiB of codes for "
          f"{w.numel() * 2 / 2**20:.0f} MiB of bf16; round-trip relative error {rel:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (main parses with it; the tests read its subcommands off it). Imports no torch."""
    from .bench.families import FAMILIES
    from .bench.families.w4a16 import model_names
    from .bench.family import choice_list, int_list, positive_int, shape_list

    p = argparse.ArgumentParser(
        prog="tilefish", description="Hand-written CUDA 4-bit matmul kernels for LLM inference, driven from "
        "PyTorch: the command line.", epilog="`tilefish COMMAND --help` lists a command's flags.")
    sub = p.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("info", help="GPU, versions, kernel cache").set_defaults(fn=cmd_info)
    c = sub.add_parser("compile", help="compile every kernel variant (no GPU needed); print resources")
    c.add_argument("--arch", action="append", choices=COMPILE_ARCHS,
                   help=f"target (repeatable: --arch sm_86 --arch sm_120), one of {', '.join(COMPILE_ARCHS)}; "
                   "the kernels the dispatchers launch on that GPU; default sm_80 and sm_90")
    c.add_argument("--all", action="store_true", help="also the benchmark-only design-space variants")
    c.add_argument("--jobs", "-j", type=positive_int, default=1, help="parallel compile processes (default 1)")
    c.set_defaults(fn=cmd_compile)
    b = sub.add_parser("bench", help="benchmark against peers and ceilings (needs a GPU)",
                       parents=[_bench_flags(all_families=True)],
                       description=f"Without a family: a quick run of every family ({QUICK_RUN_TIME}) "
                       "with a progress bar, then one summary screen; the JSON and "
                       "PNG of every family go to --out (default ./tilefish-results/<gpu>-<date>/). Ctrl-C "
                       "writes what was measured and exits 130. --full runs every family's complete sweep. "
                       "With a family: its complete set, its own table and flags (tilefish bench FAMILY --help).")
    b.add_argument("--full", action="store_true",
                   help="all families: each one's complete default sweep instead of the quick plan (many minutes)")
    families = b.add_subparsers(dest="family", title="families", metavar="FAMILY", parser_class=_Parser,
                                help="one family (its complete set, its own table); default: every family, quick, "
                                "one summary")
    family_flags: dict[str, list[str]] = {}
    for family in FAMILIES.values():
        # no abbreviations: another family's flag is not taken for one of this family's (--dtype for --dtypes)
        fp = families.add_parser(family.name, help=family.help, description=family.help[:1].upper() + family.help[1:]
                                 + ".", parents=[_bench_flags(all_families=False)], allow_abbrev=False)
        family.add_arguments(fp)
        for action in fp._actions:
            for flag in action.option_strings:
                if flag not in b._option_string_actions:
                    family_flags.setdefault(flag, []).append(family.name)
    b.family_flags = family_flags
    b.set_defaults(fn=cmd_bench)
    u = sub.add_parser("tune", help="time your weights' W4A16 plans on this GPU, keep the fastest",
                       description="Measure the W4A16 plans of your model's weights on this GPU and keep the "
                       "fastest (the dispatcher then takes them on this GPU).")
    u.add_argument("--models", type=model_names,
                   help="comma-separated models of `tilefish bench w4a16 --list-models`, or 'all' "
                        "(default: the Llama-3 set)")
    u.add_argument("--shapes", type=shape_list,
                   help="comma-separated KxN weights (in_features x out_features); overrides --models")
    u.add_argument("--m", type=int_list, help="comma-separated row counts to tune (default 1,2,4,...,256,1024,4096; "
                                               "a tuned m serves calls within 2x of it)")
    u.add_argument("--dtypes", type=choice_list(("fp16", "bf16")), default="fp16,bf16")
    u.add_argument("--groups", default="128,-1", help="comma-separated group sizes (default 128,-1)")
    u.add_argument("--codebook", default="int4", choices=["int4", "nf4"],
                   help="nf4: the fused NF4 matmul's plans (--groups are NF4 blocksizes then, e.g. 64)")
    u.add_argument("--cublas", action="store_true", help="also time cuBLAS on each case (printed ratio)")
    u.add_argument("--out", help="write the table here instead of the kernel cache's per-GPU table")
    u.set_defaults(fn=cmd_tune)
    t = sub.add_parser("table", help="print a benchmark JSON (bench/results/...) as markdown")
    t.add_argument("paths", nargs="+", metavar="PATH",
                   help="a benchmark JSON (`tilefish bench --json`, bench/results/<gpu>/*.json)")
    t.add_argument("--plot", help="also draw the (last) JSON as a PNG here")
    t.set_defaults(fn=cmd_table)
    sub.add_parser("demo", help="a short worked example: NF4 round trip of a 4096x4096 weight").set_defaults(
        fn=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
