"""shmtree-bench idle: what a rank costs while it waits for a late peer, and how fast it wakes.

Two ranks (``shmtree.run``) call an 8 B allreduce; rank 1 arrives late, rank 0 waits.

- **cpu**: rank 0's CPU time (its calling thread, ``time.thread_time``) over a wait of
  ``--wait`` seconds (default 2), as a percentage of the wait.  A waiting rank spins for the
  plan's ``spin_us``, yields until 220 us have passed, then sleeps on its futex bell; between the
  engine's 20 ms time slices it checks its deadline, signals and peers in Python.
- **wake**: the time from rank 1's entry into the allreduce (``time.monotonic_ns`` just before
  the call) to rank 0's return from it (the same clock, read just after), median over
  ``--wakes`` calls, for two cases measured alternately:
  ``parked``, rank 1 late by ``--late`` (default 5 ms: rank 0 sleeps on its bell), and
  ``ready``, rank 1 late by nothing (rank 0 is in the call, spinning, when rank 1 enters).
  ``parked - ready`` is what parking adds to a wake-up.
- **floor**: the same measure for the operating system alone: a process blocked in ``select``
  on a pipe for ``--late``, woken by a byte written to it from another process, the two pinned
  to two different CPUs as the ranks are (median over ``--wakes``): the cost of any sleep that
  another process ends, on this machine.  On a VM it grows with the length of the sleep (a
  halted virtual CPU is woken by the hypervisor), so it is measured at the same ``--late``.
"""
from __future__ import annotations

import os
import select
import statistics
import time

import numpy as np

DEFAULT_WAIT_S = 2.0
DEFAULT_LATE_S = 0.005
DEFAULT_WAKES = 200


def _late_by(seconds):
    """Sleep `seconds`, the last 200 us of them spinning, so the late call starts on time."""
    end = time.monotonic() + seconds
    if seconds > 0.0005:
        time.sleep(seconds - 0.0002)
    while time.monotonic() < end:
        pass


def _rank(comm, wait_s, late_s, wakes):
    x = np.ones(2, np.float32)
    for _ in range(200):
        comm.allreduce(x)
    got = {"parked": [], "ready": []}
    for i in range(2 * wakes):
        case = "parked" if i % 2 == 0 else "ready"
        comm.barrier()
        if comm.rank == 1:
            _late_by(late_s if case == "parked" else 20e-6)
            got[case].append(time.monotonic_ns())
            comm.allreduce(x)
        else:
            comm.allreduce(x)
            got[case].append(time.monotonic_ns())
    comm.barrier()
    if comm.rank == 1:
        time.sleep(wait_s)
        comm.allreduce(x)
        return got, None
    c0, w0 = time.thread_time(), time.monotonic()
    comm.allreduce(x)
    return got, (time.thread_time() - c0) / (time.monotonic() - w0)


def _os_floor(wakes, late_s):
    """Median us from a write to a pipe in one process to the return of `select` in another
    that has slept `late_s` there (the two on two different CPUs where there are two)."""
    cpus = sorted(os.sched_getaffinity(0))
    a, b = os.pipe()          # parent -> child
    c, d = os.pipe()          # child -> parent: the child's wake time
    pid = os.fork()
    if pid == 0:
        try:
            os.sched_setaffinity(0, {cpus[0]})
            os.close(b)
            os.close(c)
            for _ in range(wakes):
                select.select([a], [], [])
                now = time.monotonic_ns()
                os.read(a, 8)
                os.write(d, now.to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(a)
    os.close(d)
    got = []
    try:
        os.sched_setaffinity(0, {cpus[-1]})
        for _ in range(wakes):
            _late_by(late_s)              # (the child is asleep in select by now)
            t = time.monotonic_ns()
            os.write(b, b"x")
            got.append((int.from_bytes(os.read(c, 8), "little") - t) / 1e3)
    finally:
        os.sched_setaffinity(0, cpus)
        os.close(b)
        os.close(c)
        os.waitpid(pid, 0)
    return statistics.median(got)


def measure_idle(wait_s=DEFAULT_WAIT_S, late_s=DEFAULT_LATE_S, wakes=DEFAULT_WAKES):
    """{"cpu_pct", "parked_us", "ready_us", "added_us", "floor_us"} of one run."""
    import shmtree
    (t0, cpu), (t1, _) = shmtree.run(_rank, 2, args=(wait_s, late_s, wakes))
    us = {case: statistics.median((b - a) / 1e3 for a, b in zip(t1[case], t0[case]))
          for case in ("parked", "ready")}
    return {"cpu_pct": 100 * cpu, "parked_us": us["parked"], "ready_us": us["ready"],
            "added_us": us["parked"] - us["ready"], "floor_us": _os_floor(wakes, late_s)}


def add_parser(sub, arg, positive):
    p = sub.add_parser("idle", help="a waiting rank's CPU use and wake-up time",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S,
                   help=f"seconds of the long wait whose CPU is measured ({DEFAULT_WAIT_S})")
    p.add_argument("--late", type=float, default=DEFAULT_LATE_S,
                   help=f"seconds the peer is late in the parked wake-ups ({DEFAULT_LATE_S})")
    p.add_argument("--wakes", type=arg(positive), default=DEFAULT_WAKES,
                   help=f"wake-ups of each case ({DEFAULT_WAKES})")
    p.add_argument("--rounds", type=arg(positive), default=2, help="runs (2)")
    return p


def cmd_idle(args):
    from . import machine, report
    rows = [measure_idle(args.wait, args.late, args.wakes) for _ in range(args.rounds)]
    print(f"# shmtree {machine.shmtree_version()} idle: P=2, 8 B allreduce, rank 1 late; "
          f"cpu over a {args.wait:g} s wait, wake-ups median of {args.wakes} "
          f"(parked: late by {args.late * 1e3:g} ms; ready: late by 20 us)")
    print("# OS floor: a pipe write waking a process blocked as long in select, on another CPU "
          "(the OS alone)")
    print(report.table(
        ["run", "cpu while waiting", "wake parked (us)", "wake ready (us)", "OS floor (us)",
         "parked - floor (us)"],
        [[i + 1, f"{r['cpu_pct']:.2f}%", report.fmt(r["parked_us"]), report.fmt(r["ready_us"]),
          report.fmt(r["floor_us"]), report.fmt(r["parked_us"] - r["floor_us"])]
         for i, r in enumerate(rows)]))
    return 0
