"""shmtree-bench multinode: allreduce across simulated nodes (shmtree.from_mpi) beside MPI.

    shmtree-bench multinode -n 4 --node-size 2 --sizes 8,64K,2M,16M,64M

launches ``mpiexec -n N python -m shmtree.bench.multinode --worker ...`` (the mpiexec beside this
interpreter, as ``pip install mpich`` puts it) and prints, per size, the median over the slowest
rank of float32 sum allreduces:
  hier    shmtree.from_mpi(COMM_WORLD, node_size=k).allreduce(x, out=o): the whole hierarchy;
  mpi     COMM_WORLD.Allreduce(x, o) on the same processes;
  intra   the node's own shmtree allreduce alone (every node at once): the in-node part;
  inter   the leaders' inter-node step alone (shmtree.internode.inter.Link.allreduce, one
          leader per node, the other ranks waiting in their node's barrier): the between-nodes part;
and hier/mpi and hier/max(intra, inter): at 1 the pipeline hides the smaller part completely.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

MARKER = "MULTINODE "
COLUMNS = {"bytes": "message bytes (float32)",
           "hier_us": "shmtree.from_mpi allreduce, median us, slowest rank",
           "mpi_us": "COMM_WORLD.Allreduce on the same processes",
           "intra_us": "the node's own shmtree allreduce alone (all nodes at once)",
           "inter_us": "the leaders' inter-node step alone (the others wait in their node)"}
DEFAULT_SIZES = "8,64K,2M,16M,64M"


def _median_max(w, fn, reps):
    from mpi4py import MPI
    w.Barrier()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return w.allreduce(float(np.median(ts)), op=MPI.MAX)


def worker(sizes, node_size, repeats, segment):
    from mpi4py import MPI

    import shmtree
    w = MPI.COMM_WORLD
    c = shmtree.from_mpi(w, node_size=node_size, **({} if segment is None else
                                                     {"segment_bytes": segment}))
    rows = []
    for size in sizes:
        x = np.ones(max(1, size // 4), np.float32)
        o = np.empty_like(x)
        reps = repeats if size >= (8 << 20) else max(repeats, min(200, (64 << 20) // size))
        c.allreduce(x, out=o)                                  # (warm: pages, scratch)
        hier = _median_max(w, lambda: c.allreduce(x, out=o), reps)
        mpi = _median_max(w, lambda: w.Allreduce(x, o), reps)
        intra = _median_max(w, lambda: c.local.allreduce(x, out=o), reps)
        link = c._link
        w.Barrier()
        inter = 0.0
        if link is not None:         # the leaders alone; the others sleep in their node
            buf = x.copy()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                link.run(type(link).allreduce, buf, "sum")
                ts.append(time.perf_counter() - t0)
            inter = float(np.median(ts))
        if c.node_size > 1:
            c.local.barrier()
        inter = w.allreduce(inter, op=MPI.MAX)
        rows.append({"bytes": x.nbytes, "hier_us": hier * 1e6, "mpi_us": mpi * 1e6,
                     "intra_us": intra * 1e6, "inter_us": inter * 1e6})
    c.close()
    if w.rank == 0:
        print(MARKER + json.dumps({"nprocs": w.size, "node_size": node_size,
                                   "nodes": c.nodes, "library": MPI.Get_library_version()
                                   .splitlines()[0].strip(), "rows": rows}), flush=True)


def run(nprocs, node_size, sizes, repeats=5, segment=None, timeout=900):
    """Launch the workers under mpiexec; the parsed result of rank 0."""
    from .harness import BenchError
    from .mpi import find_mpiexec, run_job
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        raise BenchError('multinode needs mpi4py and an MPI: pip install "shmtree[mpi]" '
                         "(mpi4py mpich)")
    mpiexec = find_mpiexec(sys.executable)
    if mpiexec is None:
        raise BenchError("no mpiexec beside this interpreter nor on PATH: pip install mpich")
    cmd = [mpiexec, "-n", str(nprocs), sys.executable, "-m", "shmtree.bench.multinode",
           "--worker", "--node-size", str(node_size), "--repeats", str(repeats),
           "--sizes", ",".join(map(str, sizes))]
    if segment is not None:
        cmd += ["--segment", str(segment)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    out, err, returncode = run_job(cmd, env, timeout, "mpiexec")
    for line in out.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise BenchError(f"the multinode workers failed (exit {returncode}):\n"
                     f"{(err or out)[-2000:]}")


def table(doc):
    from .units import format_size
    lines = [f"# allreduce float32 sum across {doc['nodes']} simulated nodes "
             f"({doc['nprocs']} processes, node_size {doc['node_size']}); {doc['library']}; "
             "median us of the slowest rank",
             f"{'size':>8} {'hier':>10} {'mpi':>10} {'intra':>10} {'inter':>10} "
             f"{'hier/mpi':>9} {'hier/max(intra,inter)':>22}"]
    for r in doc["rows"]:
        top = max(r["intra_us"], r["inter_us"])
        lines.append(f"{format_size(r['bytes']):>8} {r['hier_us']:10.1f} {r['mpi_us']:10.1f} "
                     f"{r['intra_us']:10.1f} {r['inter_us']:10.1f} "
                     f"{r['hier_us'] / r['mpi_us']:9.2f} {r['hier_us'] / top:22.2f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m shmtree.bench.multinode")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--segment", type=int)
    p.add_argument("-n", "--nprocs", type=int, default=4)
    args = p.parse_args(argv)
    from .units import parse_size
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.node_size, args.repeats, args.segment)
        return 0
    print(table(run(args.nprocs, args.node_size, sizes, args.repeats, args.segment)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
