#!/usr/bin/env python
"""Two client programs, quiet and under load: is a pool of 2 faster than one process?

    python bench/clients.py                       # both programs, quiet and loaded, 3 rounds
    python bench/clients.py --rounds 5 --load 1   # one competing busy process (the default)

- **lsq**: data-parallel least-squares gradient descent, ``shmtree.Pool(2).run``: each worker
  holds half the rows of X (n x d float64), and each iteration computes its part of the
  gradient X^T (X w - y), allreduces it (d floats) and steps.  Beside it, the same iterations
  in one process holding all of X.  Reported: iterations per second and pool / one process.
- **cg**: conjugate gradients on a 1-d Laplacian (n unknowns, rows split over 2 ranks of
  ``shmtree.run``): per iteration one halo exchange (``sendrecv`` of one value each way) and two
  8 B allreduces.  Beside it, the same solver in one process.  Reported: us per iteration.
- **waits**: of the pool's run, the waiting counters (``comm.stats()``: yields, futex sleeps)
  per iteration.

Each program runs quiet, then with ``--load`` competing processes (a busy loop each, not
pinned: the scheduler puts them where it likes, as another user's job would be), alternating
quiet and loaded over ``--rounds`` rounds; the best round of each is printed.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

try:
    import shmtree
except ImportError:                      # run from a checkout: bench/ sits beside shmtree/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import shmtree

LSQ_N, LSQ_D, LSQ_ITERS = 200_000, 32, 60
CG_N, CG_ITERS = 1 << 14, 400


def _busy(stop):
    while not stop.is_set():
        for _ in range(10000):
            pass


class Load:
    """`n` busy processes while the block runs."""

    def __init__(self, n):
        self.n, self.procs = n, []

    def __enter__(self):
        ctx = mp.get_context("fork")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_busy, args=(self.stop,), daemon=True)
                      for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


# ---- least squares -------------------------------------------------------------------------

def _lsq_data(n, d, part=0, parts=1):
    rng = np.random.default_rng(7)
    X = rng.standard_normal((n, d))
    y = X @ np.arange(1.0, d + 1) + 0.01 * rng.standard_normal(n)
    lo, hi = n * part // parts, n * (part + 1) // parts
    return np.ascontiguousarray(X[lo:hi]), y[lo:hi].copy()


def _lsq_iterate(X, y, n, iters, allreduce=None):
    w = np.zeros(X.shape[1])
    lr = 0.5 / n
    t0 = time.perf_counter()
    for _ in range(iters):
        g = X.T @ (X @ w - y)
        if allreduce is not None:
            g = allreduce(g)
        w -= lr * g
    return time.perf_counter() - t0, w


def _lsq_worker(comm, n, d, iters):
    X, y = _lsq_data(n, d, comm.rank, comm.size)
    _lsq_iterate(X, y, n, 3, comm.allreduce)                    # warm
    comm.barrier()
    before = comm.stats()
    secs, w = _lsq_iterate(X, y, n, iters, comm.allreduce)
    after = comm.stats()
    waits = {k: (after[k] - before[k]) / iters for k in ("yields", "sleeps")}
    return secs, w, waits


def lsq(pool, n=LSQ_N, d=LSQ_D, iters=LSQ_ITERS):
    X, y = _lsq_data(n, d)
    _lsq_iterate(X, y, n, 3)
    one, w1 = _lsq_iterate(X, y, n, iters)
    got = pool.run(_lsq_worker, n, d, iters)
    secs = max(g[0] for g in got)
    assert np.allclose(got[0][1], w1, rtol=1e-9, atol=1e-9), "the pool's weights differ"
    return {"one_it_s": iters / one, "pool_it_s": iters / secs, "speedup": one / secs,
            "waits": got[0][2]}


# ---- conjugate gradients ---------------------------------------------------------------------

def _cg(n_local, iters, comm=None):
    """CG on tridiag(-1, 2, -1) x = 1 (rows split over comm's ranks); seconds per iteration."""
    P, me = (1, 0) if comm is None else (comm.size, comm.rank)
    b = np.ones(n_local)
    x = np.zeros(n_local)
    r = b.copy()
    p = r.copy()
    left, right = np.zeros(1), np.zeros(1)

    def matvec(v):
        if comm is not None and P > 1:
            if me > 0:
                comm.sendrecv(v[:1], me - 1, source=me - 1, out=left)
            if me < P - 1:
                comm.sendrecv(v[-1:], me + 1, source=me + 1, out=right)
        out = 2 * v
        out[1:] -= v[:-1]
        out[:-1] -= v[1:]
        if me > 0:
            out[0] -= left[0]
        if me < P - 1:
            out[-1] -= right[0]
        return out

    def dot(a, c):
        s = np.array([a @ c])
        return float(comm.allreduce(s)[0]) if comm is not None else float(s[0])

    rr = dot(r, r)
    t0 = time.perf_counter()
    for _ in range(iters):
        Ap = matvec(p)
        alpha = rr / dot(p, Ap)
        x += alpha * p
        r -= alpha * Ap
        new = dot(r, r)
        p = r + (new / rr) * p
        rr = new
    return (time.perf_counter() - t0) / iters, rr


def _cg_worker(comm, n, iters):
    _cg(n // comm.size, 20, comm)
    comm.barrier()
    return _cg(n // comm.size, iters, comm)


def cg(n=CG_N, iters=CG_ITERS):
    _cg(n, 20)
    one, rr1 = _cg(n, iters)
    got = shmtree.run(_cg_worker, 2, args=(n, iters))
    per = max(g[0] for g in got)
    assert abs(got[0][1] - rr1) <= 1e-6 * max(1.0, abs(rr1)), (got[0][1], rr1)
    return {"one_us": one * 1e6, "pair_us": per * 1e6, "speedup": one / per}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", type=int, default=1, help="competing busy processes (1)")
    args = ap.parse_args(argv)
    best = {}
    with shmtree.Pool(2) as pool:
        for _ in range(args.rounds):
            for case in ("quiet", "loaded"):
                with Load(args.load if case == "loaded" else 0):
                    got = {"lsq": lsq(pool), "cg": cg()}
                for prog, r in got.items():
                    key = (prog, case)
                    if key not in best or r["speedup"] > best[key]["speedup"]:
                        best[key] = r
    print(f"# shmtree {shmtree.__version__} clients: {os.cpu_count()} CPUs, best of "
          f"{args.rounds} rounds; loaded = {args.load} busy process(es) beside the run")
    print(f"# lsq: n={LSQ_N} d={LSQ_D}, {LSQ_ITERS} iterations; cg: n={CG_N}, {CG_ITERS} "
          "iterations")
    print(f"{'program':8} {'case':7} {'one process':>14} {'pool of 2':>14} {'pool/one':>9} "
          f"{'yields/it':>10} {'sleeps/it':>10}")
    for (prog, case), r in sorted(best.items()):
        if prog == "lsq":
            one, two = f"{r['one_it_s']:.1f} it/s", f"{r['pool_it_s']:.1f} it/s"
            waits = f"{r['waits']['yields']:10.1f} {r['waits']['sleeps']:10.2f}"
        else:
            one, two = f"{r['one_us']:.1f} us/it", f"{r['pair_us']:.1f} us/it"
            waits = f"{'':10} {'':10}"
        print(f"{prog:8} {case:7} {one:>14} {two:>14} {r['speedup']:8.2f}x {waits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
