#!/usr/bin/env python
"""Soak test: random allreduces for a given time, every result checked against a closed form.

    python bench/soak.py --seconds 60            # human summary
    python bench/soak.py --seconds 20 --json     # one JSON object on stdout
    python bench/soak.py --requests 100000 --procs 2   # nonblocking: 64 outstanding

What it does:
- runs in segments (--segment-seconds); each segment is one shmtree.run of --procs ranks
  (default 2 x the usable cores: oversubscribed, so ranks are descheduled mid-call) with a random
  tree shape, chunk size and slot count;
- every call draws (identically on every rank, from a shared seed) a size log-uniform in
  0 .. --max-mib MiB (some calls are empty), a dtype and an op, a layout (contiguous, strided)
  and an output mode (new array, out=, in place); each rank sleeps a random while first (from its
  own generator) to perturb the timing;
- inputs are periodic patterns built from the rank, so the exact result is known in closed form
  in every rank (sum: (i%7+1)(r+1) -> (i%7+1)P(P+1)/2; max/min: i%5+r -> i%5+P-1 / i%5;
  prod: 1+(i+r)%2 -> a power of two; bool: one rank differs per index), compared bit for bit;
- the ranks agree on when to stop with a one-byte allreduce (max) before every call;
- reports calls, bytes, errors (wrong results and exceptions) and the slowest call.

Exit status: 0 with no error, 1 otherwise.
"""
import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np

try:
    import shmtree
except ImportError:                      # run from a checkout: bench/ sits beside shmtree/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import shmtree

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"]
OPS = ["sum", "prod", "min", "max"]
TREES = ["auto", "chain", "binary", "flat", "ring", 3]
CHUNKS = [None, 4096, 16384, 65536, 1 << 20]
SLOTS = [None, 2, 3, 8]


def valid_ops(dtype):
    return ["sum", "prod"] if np.dtype(dtype).kind == "c" else OPS


# ---------------------------------------------------------------------------------------------
# inputs and their closed-form results (periodic patterns, tiled with np.resize: no int64 index
# array of the message's length)

def _period(op, P):
    return {"sum": 7, "max": 5, "min": 5, "prod": 2}[op] * max(P, 1) * 2


def pattern(dtype, op, rank, P, n):
    dt = np.dtype(dtype)
    i = np.arange(_period(op, P))
    if dt.kind == "b":
        base = (i % P == rank) if op in ("sum", "max") else (i % P != rank)
    elif op == "sum":
        base = (i % 7 + 1) * (rank + 1)
    elif op in ("max", "min"):
        base = i % 5 + rank
    else:
        base = 1 + (i + rank) % 2
    base = base.astype(np.int64).astype(dt) if dt.kind != "b" else base
    if dt.kind == "c" and op == "sum":
        base = base * dt.type(1 + 1j)
    return np.resize(base, n)


def expected(dtype, op, P, n):
    dt = np.dtype(dtype)
    i = np.arange(_period(op, P))
    if dt.kind == "b":
        base = np.full(i.shape, op in ("sum", "max"))    # exactly one rank differs per index
    elif op == "sum":
        base = (i % 7 + 1) * (P * (P + 1) // 2)
    elif op == "max":
        base = i % 5 + P - 1
    elif op == "min":
        base = i % 5
    else:
        odd_ranks, even_ranks = P // 2, (P + 1) // 2
        base = np.where(i % 2 == 0, 2 ** odd_ranks, 2 ** even_ranks)
    base = base.astype(np.int64).astype(dt) if dt.kind != "b" else base
    if dt.kind == "c" and op == "sum":
        base = base * dt.type(1 + 1j)
    return np.resize(base, n)


# ---------------------------------------------------------------------------------------------
# one rank

def draw_call(rng, max_bytes):
    """The next call's description (the same on every rank: rng is seeded alike)."""
    dtype = str(rng.choice(DTYPES))
    op = str(rng.choice(valid_ops(dtype)))
    itemsize = np.dtype(dtype).itemsize
    if rng.random() < 0.05:
        nbytes = 0
    else:
        nbytes = int(math.exp(rng.uniform(0.0, math.log(max_bytes))))
    n = nbytes // itemsize
    layout = "strided" if n <= (1 << 20) // itemsize and rng.random() < 0.2 else "contiguous"
    out_mode = str(rng.choice(["new", "out", "in_place"]))
    return dtype, op, n, layout, out_mode


def soak_worker(comm, seed, deadline, max_bytes, sleep_ms, call_timeout):
    P = comm.size
    shared = np.random.default_rng(seed)                  # identical draws in every rank
    local = np.random.default_rng([seed, comm.rank, 7])   # this rank's timing noise
    stats = dict(calls=0, bytes=0, errors=[], slowest=None, control_calls=0)
    flag = np.zeros(1, np.uint8)
    while True:
        flag[0] = time.time() >= deadline
        stats["control_calls"] += 1
        if comm.allreduce(flag, op="max", timeout=call_timeout)[0]:
            break
        dtype, op, n, layout, out_mode = draw_call(shared, max_bytes)
        x = pattern(dtype, op, comm.rank, P, n)
        if layout == "strided":
            wide = np.empty(2 * n, dtype=x.dtype)
            wide[::2] = x
            x = wide[::2]
        keep = x.copy() if out_mode == "new" and n <= 4096 else None
        if local.random() < 0.3:
            time.sleep(local.uniform(0, sleep_ms) / 1000.0)
        t0 = time.perf_counter()
        if out_mode == "new":
            y = comm.allreduce(x, op=op, timeout=call_timeout)
        elif out_mode == "out":
            y = comm.allreduce(x, op=op, out=np.empty(n, dtype=x.dtype), timeout=call_timeout)
        else:
            y = comm.allreduce(x, op=op, out=x, timeout=call_timeout)
        secs = time.perf_counter() - t0
        nbytes = n * np.dtype(dtype).itemsize
        stats["calls"] += 1
        stats["bytes"] += nbytes
        what = dict(call=stats["calls"], dtype=dtype, op=op, n=n, bytes=nbytes, layout=layout,
                    out=out_mode, seconds=round(secs, 6))
        if stats["slowest"] is None or secs > stats["slowest"]["seconds"]:
            stats["slowest"] = what
        want = expected(dtype, op, P, n)
        if y.shape != want.shape or y.dtype != want.dtype or not np.array_equal(y, want):
            bad = np.flatnonzero(y != want)[:3].tolist() if y.shape == want.shape else []
            stats["errors"].append(dict(what, rank=comm.rank, kind="wrong result",
                                        first_bad=bad))
        elif keep is not None and not np.array_equal(x, keep):
            stats["errors"].append(dict(what, rank=comm.rank, kind="input modified"))
        del x, y, want
    return stats


# ---------------------------------------------------------------------------------------------
# nonblocking: many requests outstanding (--requests N)

REQUEST_KINDS = ("iallreduce", "ibroadcast", "ireduce", "iallgather", "ireduce_scatter",
                 "ibarrier")


def request_worker(comm, total, window, seed, max_bytes):
    """Post `total` nonblocking calls, at most `window` outstanding, each checked when it is
    done (oldest first); the process's threads, descriptors and resident memory are sampled
    after a warm-up and at the end."""
    import threading

    import psutil

    rng = np.random.default_rng(seed)            # the same draws on every rank
    P, me = comm.size, comm.rank
    proc = psutil.Process()
    pending = []
    checked = errors = 0
    samples = []

    def check(kind, n, i, req):
        got = req.result()
        want = np.full(n, float(i % 97))
        if kind == "iallreduce":
            ok = np.array_equal(got, want * P * (P + 1) / 2)
        elif kind == "ibroadcast":
            ok = np.array_equal(got, want + (i % P))
        elif kind == "ireduce":
            ok = (got is None) if me != i % P else np.array_equal(got, want * P * (P + 1) / 2)
        elif kind == "iallgather":
            ok = np.array_equal(got, np.stack([want * (r + 1) for r in range(P)]))
        elif kind == "ireduce_scatter":
            full = want * P * (P + 1) / 2
            ok = np.array_equal(got, np.array_split(full, P)[me])
        else:
            ok = got is None
        return ok

    for i in range(total):
        kind = REQUEST_KINDS[int(rng.integers(len(REQUEST_KINDS)))]
        n = int(2 ** rng.uniform(0, math.log2(max(2, max_bytes // 8))))
        x = np.full(n, float(i % 97)) * (me + 1)
        if kind == "iallreduce":
            req = comm.iallreduce(x)
        elif kind == "ibroadcast":
            root = i % P
            req = comm.ibroadcast(np.full(n, float(i % 97)) + root if me == root else None,
                                  root)
        elif kind == "ireduce":
            req = comm.ireduce(x, root=i % P)
        elif kind == "iallgather":
            req = comm.iallgather(x)
        elif kind == "ireduce_scatter":
            req = comm.ireduce_scatter(x)
        else:
            req = comm.ibarrier()
        pending.append((kind, n, i, req, x))
        if len(pending) >= window:
            kind_, n_, i_, req_, _ = pending.pop(0)
            errors += not check(kind_, n_, i_, req_)
            checked += 1
        if i == min(2000, total // 10) or i == total - 1:
            samples.append((threading.active_count(), proc.num_fds(), proc.memory_info().rss))
    for kind_, n_, i_, req_, _ in pending:
        errors += not check(kind_, n_, i_, req_)
        checked += 1
    return dict(checked=checked, errors=errors, threads=[s[0] for s in samples],
                fds=[s[1] for s in samples], rss_mib=[round(s[2] / 2 ** 20, 1) for s in samples])


def request_soak(total, procs, window, seed, max_kib):
    t0 = time.time()
    per_rank = shmtree.run(request_worker, procs, args=(total, window, seed, max_kib << 10))
    return dict(requests=total, procs=procs, window=window, seed=seed,
                wall_s=round(time.time() - t0, 2), per_rank=per_rank,
                errors=sum(r["errors"] for r in per_rank))


# ---------------------------------------------------------------------------------------------
# the parent

def soak(seconds, procs, max_mib, seed, segment_seconds, sleep_ms, call_timeout, progress):
    rng = np.random.default_rng(seed)
    started = time.time()
    end = started + seconds
    report = dict(seconds=seconds, procs=procs, cores=len(os.sched_getaffinity(0)),
                  max_mib=max_mib, seed=seed, segments=[], calls=0, control_calls=0, bytes=0,
                  errors=0, error_samples=[], slowest=None)
    seg = 0
    while time.time() < end - 0.5 or seg == 0:
        seg += 1
        options = dict(tree=TREES[rng.integers(len(TREES))])
        chunk = CHUNKS[rng.integers(len(CHUNKS))]
        slots = SLOTS[rng.integers(len(SLOTS))]
        if chunk is not None:
            options["chunk_bytes"] = chunk
        if slots is not None:
            options["slots"] = slots
        deadline = min(end, time.time() + segment_seconds)
        seg_seed = int(rng.integers(2 ** 31))
        t0 = time.time()
        entry = dict(segment=seg, options={k: v for k, v in options.items()}, seed=seg_seed)
        try:
            per_rank = shmtree.run(soak_worker, procs,
                                   args=(seg_seed, deadline, max_mib << 20, sleep_ms,
                                         call_timeout),
                                   **options)
            errors = [e for s in per_rank for e in s["errors"]]
            entry.update(calls=per_rank[0]["calls"], bytes=per_rank[0]["bytes"],
                         errors=len(errors))
            report["calls"] += per_rank[0]["calls"]
            report["control_calls"] += per_rank[0]["control_calls"]
            report["bytes"] += per_rank[0]["bytes"]
            report["errors"] += len(errors)
            report["error_samples"].extend(errors[: max(0, 10 - len(report["error_samples"]))])
            for r, s in enumerate(per_rank):
                if s["slowest"] and (report["slowest"] is None
                                     or s["slowest"]["seconds"] > report["slowest"]["seconds"]):
                    report["slowest"] = dict(s["slowest"], rank=r, segment=seg,
                                             options=entry["options"])
        except Exception as e:                   # a worker raised or died: count it, go on
            report["errors"] += 1
            entry.update(calls=None, errors=1, exception=f"{type(e).__name__}: {e}")
            report["error_samples"].append(dict(segment=seg, kind="exception",
                                                text=f"{type(e).__name__}: {e}",
                                                traceback=getattr(e, "remote_traceback", "")
                                                or traceback.format_exc()))
        entry["wall_s"] = round(time.time() - t0, 3)
        report["segments"].append(entry)
        if progress:
            print(f"segment {seg}: {entry}", file=sys.stderr, flush=True)
    report["wall_s"] = round(time.time() - started, 3)
    report["gib_per_s"] = round(report["bytes"] / max(report["wall_s"], 1e-9) / 2 ** 30, 3)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = len(os.sched_getaffinity(0))
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    ap.add_argument("--procs", type=int, default=2 * cores,
                    help=f"ranks per group (default 2 x usable cores = {2 * cores})")
    ap.add_argument("--max-mib", type=int, default=64, help="largest message, MiB (default 64)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    ap.add_argument("--segment-seconds", type=float, default=20.0,
                    help="seconds per group configuration (default 20)")
    ap.add_argument("--sleep-ms", type=float, default=5.0,
                    help="largest random sleep before a call, ms (default 5)")
    ap.add_argument("--call-timeout", type=float, default=120.0,
                    help="timeout= of every call, s (a hang is reported, not waited out)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--progress", action="store_true", help="one line per segment on stderr")
    ap.add_argument("--requests", type=int, default=0,
                    help="instead: post this many nonblocking calls (mixed collectives and "
                         "sizes, --window outstanding), check each, and report threads, "
                         "descriptors and memory after a warm-up and at the end")
    ap.add_argument("--window", type=int, default=64, help="outstanding requests (default 64)")
    ap.add_argument("--max-kib", type=int, default=256,
                    help="largest message of --requests, KiB (default 256)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.requests:
        report = request_soak(args.requests, args.procs, args.window, seed, args.max_kib)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            print(f"request soak: {report['requests']} requests, P={report['procs']}, "
                  f"{report['window']} outstanding, seed {seed}, {report['wall_s']} s")
            for r, got in enumerate(report["per_rank"]):
                print(f"  rank {r}: {got['checked']} checked, {got['errors']} wrong; threads "
                      f"{got['threads']}, fds {got['fds']}, RSS MiB {got['rss_mib']} "
                      "(after warm-up, at the end)")
        return 0 if report["errors"] == 0 else 1
    report = soak(args.seconds, args.procs, args.max_mib, seed, args.segment_seconds,
                  args.sleep_ms, args.call_timeout, args.progress)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        s = report["slowest"] or {}
        print(f"soak: {report['wall_s']:.1f} s, P={report['procs']} on {report['cores']} cores, "
              f"seed {report['seed']}, {len(report['segments'])} segments")
        print(f"  calls   {report['calls']} checked (+{report['control_calls']} control)")
        print(f"  bytes   {report['bytes'] / 2 ** 30:.2f} GiB reduced "
              f"({report['gib_per_s']:.2f} GiB/s)")
        print(f"  errors  {report['errors']}")
        if s:
            print(f"  slowest {s['seconds'] * 1e3:.1f} ms: {s['bytes'] / 2 ** 20:.2f} MiB "
                  f"{s['dtype']} {s['op']} ({s['layout']}, out={s['out']}) on rank {s['rank']}, "
                  f"options {s['options']}")
        for e in report["error_samples"]:
            print(f"  ! {e}")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
