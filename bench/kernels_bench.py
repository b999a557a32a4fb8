#!/usr/bin/env python
"""Reduction kernels alone: element rates of float32, bfloat16 and float16 sums, side by side.

    python bench/kernels_bench.py                          # 1, 4, 16 MiB; 2 and 4 sources
    python bench/kernels_bench.py --sizes 1M,64M --nsrc 2,8 --ops sum,max --repeat 30

Times `shmtree._kernels.reduce_into`, which runs the same kernel the engine reduces each chunk
with (`get_kernel(op, dtype)`, called from engine/prims.pxi) over the whole array, with the GIL
released; its Python-side checks cost a few microseconds per call, nothing at these sizes.

A size is the bytes of the float32 array; the 16-bit arrays hold the same number of elements
(half the bytes), so the columns compare element rates at equal work.  dst is a separate array
(out of place, as when the engine reduces into a ring slot); `--inplace` reduces into srcs[0].
Each cell is the best of --repeat calls on each of --trials fresh sets of arrays (Melem/s =
elements of dst per microsecond), the dtypes taking turns within every round, so that noise
from other processes on the machine hits them alike.  The ratio columns divide a 16-bit rate by the float32 rate of the same row.
"""
import argparse
import os
import sys
import time

import numpy as np

try:
    import shmtree
except ImportError:                      # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import shmtree

from shmtree import _kernels as K  # noqa: E402
from shmtree.bench.units import parse_size as _parse_size  # noqa: E402


def _label(nbytes):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def dtypes():
    out = [("f32", np.dtype(np.float32))]
    try:
        import ml_dtypes
        out.append(("bf16", np.dtype(ml_dtypes.bfloat16)))
    except ImportError:
        print("(ml_dtypes not installed: no bfloat16 column)", file=sys.stderr)
    out.append(("f16", np.dtype(np.float16)))
    return out


def operands(dtype, n, nsrc, rng):
    # Values of either sign and many magnitudes, no inf/nan: the kernels are branch-free, but
    # keep the data typical of gradients anyway.
    srcs = [rng.standard_normal(n).astype(np.float32).astype(dtype) for _ in range(nsrc)]
    return np.empty(n, dtype), srcs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,4M,16M", help="float32 bytes per array (default %(default)s)")
    ap.add_argument("--nsrc", default="2,4", help="sources per reduction (default %(default)s)")
    ap.add_argument("--ops", default="sum", help="ops, comma-separated (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=0,
                    help="calls per cell and trial (default: ~0.1 s of f32 work)")
    ap.add_argument("--trials", type=int, default=3,
                    help="fresh arrays per cell, the best kept (default %(default)s): where "
                         "the pages of an allocation land moves a figure by up to 2x here")
    ap.add_argument("--inplace", action="store_true", help="dst is srcs[0]")
    isas = K.half_isas() if hasattr(K, "half_isas") else ()
    ap.add_argument("--isa", choices=isas or None,
                    help="instruction set of the 16-bit kernels (default: the best the CPU has; "
                         f"here: {', '.join(isas) or 'not selectable in this build'})")
    args = ap.parse_args(argv)
    if args.isa:
        K.half_isa(args.isa)
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    nsrcs = [int(s) for s in args.nsrc.split(",")]
    ops = args.ops.split(",")
    kinds = dtypes()
    rng = np.random.default_rng(0)

    names = [k for k, _ in kinds]
    head = f"{'op':>4} {'size(f32)':>10} {'nsrc':>4} " + " ".join(f"{k + ' Me/s':>10}" for k in names)
    head += " " + " ".join(f"{k + '/f32':>9}" for k in names[1:])
    isa = K.half_isa() if hasattr(K, "half_isa") else "n/a"
    print(f"shmtree {getattr(shmtree, '__version__', '?')} kernels, "
          f"{'in place' if args.inplace else 'out of place'}, 16-bit kernels: {isa}, "
          f"best of repeated calls")
    print(head)
    for op in ops:
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            for nsrc in nsrcs:
                reps = args.repeat or max(5, min(500, int(0.1e9 / max(1, n * nsrc))))
                best = {k: float("inf") for k in names}
                for _ in range(args.trials):                 # fresh arrays each trial
                    cells = {k: operands(dt, n, nsrc, rng) for k, dt in kinds}
                    for k in names:                          # warm up (page faults, caches)
                        dst, srcs = cells[k]
                        K.reduce_into(srcs[0] if args.inplace else dst, srcs, op)
                    for _ in range(reps):
                        for k in names:
                            dst, srcs = cells[k]
                            target = srcs[0] if args.inplace else dst
                            t0 = time.perf_counter()
                            K.reduce_into(target, srcs, op)
                            best[k] = min(best[k], time.perf_counter() - t0)
                    del cells
                rates = {k: n / best[k] / 1e6 for k in names}
                line = f"{op:>4} {_label(nbytes):>10} {nsrc:>4} "
                line += " ".join(f"{rates[k]:>10.0f}" for k in names)
                line += " " + " ".join(f"{rates[k] / rates['f32']:>8.2f}x" for k in names[1:])
                print(line, flush=True)


if __name__ == "__main__":
    main()
