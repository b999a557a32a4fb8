"""``persistent``: a persistent allreduce's ``p()`` beside the plain call, in one run.

For every P of ``--nprocs`` (default 1, 2) and size of ``--sizes`` (default 8 B), one
``shmtree.run`` whose workers each hold a private array ``x`` (every item 1) and
``p = comm.allreduce_init(x, op, out=x)``, then measure (``measure.py``, the protocol of every
table) in turn, ``--repeats`` rounds (default 5):

    plain       comm.allreduce(x, op, out=x)
    persistent  p()

alternating plain, persistent, plain, ... so that the machine's drift (other jobs) falls on both
alike.  A round's figure is the maximum over ranks of each rank's median per call; the table
gives, per method, the median of its rounds, their ratio (persistent / plain: below 1, ``p()``
is cheaper), and the lowest and highest ratio of a single round (the spread).  Neither call is
given ``timeout=``: the spelling the persistent form exists to beat.  The calls work in place,
so the values change from call to call (a sum doubles at P = 2, reaching inf for floats); the
work of a call does not.

A shmtree without ``allreduce_init`` (it is newer than the bench's other calls) makes the
command fail with a message that says so.
"""
import statistics
import sys

import numpy as np

from . import machine, report
from .commands import (options_of, plan_of, progress_of, shmtree_failure, usable,
                       whole_sizes, write_outputs)
from .harness import BenchError
from .measure import measure, slowest
from .sweep import CommSync
from .units import count_for, format_size

DEFAULT_NPROCS = (1, 2)
DEFAULT_SIZES = "8"
DEFAULT_REPEATS = 5
METHODS = ("plain", "persistent")
COLUMNS = {
    "nprocs": "processes (P)", "size": "message bytes", "count": "elements",
    "plain_us": "comm.allreduce(x, op, out=x): median over rounds of the max over ranks of "
                "the median per call",
    "persistent_us": "p() of p = comm.allreduce_init(x, op, out=x): the same",
    "ratio": "persistent_us / plain_us",
    "ratio_min": "the lowest persistent/plain of one round",
    "ratio_max": "the highest persistent/plain of one round",
    "plain_rounds_us": "every round's plain time", "persistent_rounds_us": "every round's p()",
}


def _worker(comm, sizes, plan, repeats):
    sync = CommSync(comm)
    out = []
    for size in sizes:
        x = np.ones(count_for(size, plan.dtype), plan.dtype)
        p = comm.allreduce_init(x, plan.op, out=x)
        calls = {"plain": lambda i: comm.allreduce(x, plan.op, out=x),
                 "persistent": lambda i: p()}
        rounds = {m: [] for m in METHODS}
        for _ in range(repeats):
            for method in METHODS:
                rounds[method].append(measure(calls[method], sync, plan.iters, plan.target_s))
        p.free()
        out.append(rounds)
    return out


def run_persistent(sizes, nprocs, plan, options, repeats=DEFAULT_REPEATS):
    """{size: {method: [summary of each round, combined over ranks]}} for one P."""
    import shmtree
    if not hasattr(shmtree.Communicator, "allreduce_init"):
        raise BenchError(f"this shmtree ({machine.shmtree_version()}) has no "
                         "comm.allreduce_init: nothing to measure")
    per_rank = shmtree.run(_worker, nprocs, args=(sizes, plan, repeats), **options)
    return {size: {m: [slowest([r[k][m][j] for r in per_rank]) for j in range(repeats)]
                   for m in METHODS}
            for k, size in enumerate(sizes)}


def row(nprocs, size, dtype, rounds):
    """One table/JSON row from the rounds of both methods at one (P, size)."""
    us = {m: [s["median_s"] * 1e6 for s in rounds[m]] for m in METHODS}
    ratios = [b / a for a, b in zip(us["plain"], us["persistent"])]
    plain, persistent = (statistics.median(us[m]) for m in METHODS)
    count = count_for(size, dtype)
    return {"nprocs": nprocs, "size": count * np.dtype(dtype).itemsize, "count": count,
            "plain_us": plain, "persistent_us": persistent, "ratio": persistent / plain,
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "plain_rounds_us": us["plain"], "persistent_rounds_us": us["persistent"]}


def text_table(rows):
    headers = ["P", "size", "plain (us)", "p() (us)", "p()/plain", "rounds' p()/plain"]
    return report.table(headers, [
        [r["nprocs"], format_size(r["size"]), report.fmt(r["plain_us"]),
         report.fmt(r["persistent_us"]), report.fmt(r["ratio"], 2) + "x",
         f"{report.fmt(r['ratio_min'], 2)}-{report.fmt(r['ratio_max'], 2)}x"] for r in rows])


def cmd_persistent(args):
    cores = usable()
    nprocs = list(args.nprocs or DEFAULT_NPROCS)
    options = options_of(args)
    rounded = whole_sizes(args, max(nprocs))
    rows = []
    bar = report.Progress(len(nprocs), "persistent", progress_of(args))
    try:
        for P in nprocs:
            bar.step(max(args.sizes), f"P={P}")
            try:
                measured = run_persistent(args.sizes, P, plan_of(args, P), options,
                                          args.repeats)
            except BenchError:
                raise
            except Exception as exc:
                raise shmtree_failure(exc) from exc
            rows += [row(P, s, args.dtype, measured[s]) for s in args.sizes]
    finally:
        bar.done()
    plan = plan_of(args, nprocs[0])
    knobs = ", ".join(f"{k}={v}" for k, v in options.items()) or "default group options"
    print(f"# shmtree {machine.shmtree_version()} persistent allreduce: P = "
          f"{', '.join(map(str, nprocs))}, {plan.dtype} {plan.op}, {knobs}, {args.repeats} "
          "rounds")
    print("# plain = comm.allreduce(x, op, out=x); p() = comm.allreduce_init(x, op, out=x)(); "
          "x private, in place, no timeout=; measured alternately, round by round")
    print("# a cell: the median over rounds; rounds' p()/plain: the lowest and highest ratio "
          "of one round")
    over = [P for P in nprocs if P > cores]
    if over:
        print(f"# P = {', '.join(map(str, over))} oversubscribed: more processes than the "
              f"{cores} usable cores")
    if rounded:
        print(rounded)
    print(text_table(rows))
    doc = report.document(
        "persistent", machine.describe(args.topology),
        {"argv": args.argv, "nprocs": nprocs, "sizes": args.sizes, "repeats": args.repeats,
         "plan": plan.as_dict(), "group_options": options, "python": sys.executable},
        COLUMNS, rows)
    write_outputs(args, doc, list(COLUMNS), rows)
    return 0
