"""Across simulated nodes: shmtree.from_mpi allreduce beside COMM_WORLD.Allreduce in one run,
and where the time of shmtree's goes.

    python bench/multinode_breakdown.py -n 4 --node-size 2 --sizes 8,64K,1M,4M,16M,64M \
        --dtype float64 --runs 5 [--trace]

Each run is one mpiexec job; inside it, per size, the two allreduces alternate call by call
(slowest rank per call), so that both see the same load of a shared machine.  Printed: per size
the median over runs of each run's median time, the median of the runs' ratios, and (--trace)
per call the time of each step of the hierarchy, summed over segments, by thread:
    rs/red   the intra-node step before the network (reduce_scatter on lanes, allreduce below
             LANES_BYTES on lanes, reduce on leaders)
    net      the Link step (MPI + its folding) on the link thread or inline
    ag/bc    the intra-node step after the network (allgather on lanes, broadcast on leaders)
    wait     the main thread waiting for a link job
    wall     the call, and overlap = (rs + net + ag) / wall
and cpu ratio: the CPU time of all ranks (every thread) in shmtree's call over that in MPI's.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

MARKER = "BREAKDOWN "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


class Trace:
    """Per-thread intervals of the hierarchy's steps (monkeypatched wrappers)."""

    def __init__(self):
        self.events = []
        self.on = False
        self.inside = threading.local()     # (steps inside the agreement count as agree)

    def wrap(self, label, fn):
        trace = self

        def timed(*args, **kw):
            if not trace.on or getattr(trace.inside, "agree", False):
                return fn(*args, **kw)
            t0 = time.perf_counter()
            trace.inside.agree = label == "agree"
            try:
                return fn(*args, **kw)
            finally:
                trace.inside.agree = False
                trace.events.append((label, threading.get_ident(), t0, time.perf_counter()))
        return timed

    def install(self, c):
        from shmtree.frontend import calls
        from shmtree.internode import inter, pipelines
        local = c.local
        labels = {calls.REDUCE_SCATTER: "rs/red", calls.REDUCE: "rs/red",
                  calls.ALLREDUCE: "rs/red", calls.ALLGATHER: "ag/bc", calls.BROADCAST: "ag/bc"}
        run = local.run                   # (every step in the node is a parsed call run here)

        def run_timed(spec):
            return self.wrap(labels.get(spec.coll, "other"), lambda: run(spec))()
        local.run = run_timed
        for name, label in (("_agree", "agree"),):
            setattr(c, name, self.wrap(label, getattr(c, name)))
        for name in ("allreduce", "allreduce_lane"):
            if hasattr(inter.Link, name):
                setattr(inter.Link, name, self.wrap("net", getattr(inter.Link, name)))
        pipelines._wait = self.wrap("wait", pipelines._wait)
        inter.Link.wait = self.wrap("wait", inter.Link.wait)

    def summary(self, wall):
        out = {}
        for label, _, t0, t1 in self.events:
            out[label] = out.get(label, 0.0) + (t1 - t0)
        out["wall"] = wall
        busy = out.get("rs/red", 0) + out.get("net", 0) + out.get("ag/bc", 0)
        out["overlap"] = busy / wall if wall else 0.0
        return out


def worker(sizes, node_size, reps, dtype, trace, segment):
    from mpi4py import MPI

    import shmtree
    w = MPI.COMM_WORLD
    kw = {} if segment is None else {"segment_bytes": segment}
    c = shmtree.from_mpi(w, node_size=node_size, **kw)
    tr = Trace() if trace else None
    if tr is not None:
        tr.install(c)
    rows = []
    for size in sizes:
        n = max(1, size // np.dtype(dtype).itemsize)
        x = (np.arange(n) % 7 + w.rank).astype(dtype)
        o = np.empty_like(x)
        ref = np.empty_like(x)
        c.allreduce(x, out=o)
        w.Allreduce(x, ref)
        assert np.array_equal(o, ref), "shmtree and MPI differ"
        k = reps if size >= (8 << 20) else max(reps, min(200, (64 << 20) // max(size, 1)))
        hs, ms, hc, mc = [], [], [], []
        for _ in range(k):
            w.Barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            c.allreduce(x, out=o)
            hs.append(time.perf_counter() - t0)
            hc.append(time.process_time() - c0)
            w.Barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            w.Allreduce(x, o)
            ms.append(time.perf_counter() - t0)
            mc.append(time.process_time() - c0)
        hs = np.max(w.allgather(np.array(hs)), axis=0)
        ms = np.max(w.allgather(np.array(ms)), axis=0)
        hc = np.sum(w.allgather(np.array(hc)), axis=0)     # CPU of every rank (all threads)
        mc = np.sum(w.allgather(np.array(mc)), axis=0)
        row = {"bytes": int(x.nbytes), "hier_ms": float(np.median(hs)) * 1e3,
               "mpi_ms": float(np.median(ms)) * 1e3, "hier_cpu_ms": float(np.median(hc)) * 1e3,
               "mpi_cpu_ms": float(np.median(mc)) * 1e3}
        if tr is not None:       # traced calls apart (the wrappers cost a little)
            per = []
            for _ in range(min(k, 9)):
                w.Barrier()
                tr.events.clear()
                tr.on = True
                t0 = time.perf_counter()
                c.allreduce(x, out=o)
                wall = time.perf_counter() - t0
                tr.on = False
                per.append(tr.summary(wall))
            every = w.allgather(per)
            row["trace"] = [{key: float(np.median([p[key] for p in every[r]])) * (
                1 if key == "overlap" else 1e3) for key in every[r][0]}
                for r in range(w.size)]
        rows.append(row)
    c.close()
    if w.rank == 0:
        print(MARKER + json.dumps({"rows": rows, "nodes": c.nodes}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--sizes", default="8,64K,1M,4M,16M,64M")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--segment", type=int)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    sizes = [_size(s) for s in a.sizes.split(",")]
    if a.worker:
        worker(sizes, a.node_size, a.reps, a.dtype, a.trace, a.segment)
        return
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        q for q in (ROOT, os.environ.get("PYTHONPATH")) if q))
    runs = []
    for _ in range(a.runs):
        cmd = [mpiexec, "-n", str(a.n), sys.executable, os.path.abspath(__file__), "--worker",
               "--node-size", str(a.node_size), "--sizes", a.sizes, "--dtype", a.dtype,
               "--reps", str(a.reps)] + (["--trace"] if a.trace else []) + \
            (["--segment", str(a.segment)] if a.segment else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
        if not line:
            sys.exit(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                     f"{proc.stderr[-3000:]}")
        runs.append(json.loads(line[0][len(MARKER):]))
    print(f"# {a.dtype} sum allreduce, mpiexec -n {a.n}, node_size {a.node_size} "
          f"({runs[0]['nodes']} nodes); median of {a.runs} runs (ratio: median of the runs' "
          f"ratios)")
    print(f"{'size':>8} {'shmtree ms':>11} {'MPI ms':>9} {'ratio':>6} {'cpu ratio':>9}   "
          "runs' ratios")
    for i, size in enumerate(sizes):
        hs = [r["rows"][i]["hier_ms"] for r in runs]
        ms = [r["rows"][i]["mpi_ms"] for r in runs]
        ratios = [h / m for h, m in zip(hs, ms)]
        cpu = [r["rows"][i]["hier_cpu_ms"] / r["rows"][i]["mpi_cpu_ms"] for r in runs]
        nb = runs[0]["rows"][i]["bytes"]
        print(f"{nb:>8} {np.median(hs):11.3f} {np.median(ms):9.3f} {np.median(ratios):6.2f} "
              f"{np.median(cpu):9.2f}   "
              + " ".join(f"{q:.2f}" for q in ratios))
    if a.trace:
        print("# trace (ms per call, median over traced calls, median over runs), by rank")
        for i, size in enumerate(sizes):
            tr = [r["rows"][i]["trace"] for r in runs]
            for rank in range(a.n):
                keys = tr[0][rank].keys()
                med = {k: np.median([t[rank].get(k, 0.0) for t in tr]) for k in keys}
                print(f"{runs[0]['rows'][i]['bytes']:>8} r{rank} " +
                      " ".join(f"{k}={med[k]:.3f}" for k in
                               ("agree", "rs/red", "net", "ag/bc", "wait", "wall", "overlap")
                               if k in med))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
