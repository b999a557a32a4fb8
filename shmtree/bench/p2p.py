"""shmtree-bench p2p: point-to-point messages beside MPI, measured in the same run.

Two figures, each for shmtree (2 ranks: shmtree.run) and for MPI (mpi4py under the mpiexec
beside the interpreter, e.g. the mpich wheel's; p2p_worker.py):

- ping-pong: rank 0 sends, rank 1 receives into a preallocated array and sends back; the figure
  is half the round trip (send + recv of one message), in microseconds;
- sendrecv bandwidth: both ranks `sendrecv` the size to each other at once (into a
  preallocated out); bytes one rank receives per second, GB/s.

The two libraries are measured in alternating rounds (--rounds, default 3) and each figure is
the best round's (the least disturbed by other load), so a busy machine slows both alike.
"""
from __future__ import annotations

import json
import os
import sys

from .harness import BenchError
from .mpi import OPEN_MPI_ENV, find_mpiexec, run_job
from .p2p_worker import measure
from .units import format_size, parse_sizes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "p2p_worker.py")
DEFAULT_PINGPONG = "8,32K"
DEFAULT_BANDWIDTH = "2M,16M"


def _shmtree_rank(comm, pingpong, bandwidth):
    return measure(lambda x, d: comm.send(x, d), lambda out, s: comm.recv(s, out=out),
                   lambda x, out, o: comm.sendrecv(x, o, o, out=out), comm.barrier,
                   comm.rank, pingpong, bandwidth)


def run_shmtree(pingpong, bandwidth):
    import shmtree
    return shmtree.run(_shmtree_rank, 2, args=(pingpong, bandwidth))[0]


def run_mpi(pingpong, bandwidth, python=None, timeout=300):
    python = python or sys.executable
    mpiexec = find_mpiexec(python)
    if mpiexec is None:
        raise BenchError("no mpiexec beside the interpreter nor on PATH")
    cmd = [mpiexec, "-n", "2", python, WORKER, ",".join(map(str, pingpong)),
           ",".join(map(str, bandwidth))]
    out, err, rc = run_job(cmd, dict(os.environ, **OPEN_MPI_ENV), timeout, "mpiexec")
    for line in out.splitlines():
        if line.startswith("P2P-RESULT "):
            data = json.loads(line[len("P2P-RESULT "):])
            return data["library"], {k: {int(n): v for n, v in d.items()}
                                     for k, d in data["figures"].items()}
    raise BenchError(f"the MPI worker failed (exit {rc}): {err.strip()[-2000:]}")


def _best(a, b, key):
    if a is None:
        return b
    return {n: (min if key == "pingpong" else max)(a[n], b[n]) for n in a}


def cmd_p2p(args):
    pingpong, bandwidth = args.pingpong, args.bandwidth
    shm = {"pingpong": None, "bandwidth": None}
    mpi = {"pingpong": None, "bandwidth": None}
    library, problem = None, None
    for _ in range(args.rounds):
        got = run_shmtree(pingpong, bandwidth)
        for k in shm:
            shm[k] = _best(shm[k], got[k], k)
        if problem is None and not args.no_mpi:
            try:
                library, got = run_mpi(pingpong, bandwidth)
                for k in mpi:
                    mpi[k] = _best(mpi[k], got[k], k)
            except BenchError as exc:
                problem = str(exc)
    first = (library or "MPI").splitlines()[0]
    name = " ".join(first.replace("Version:", "").split())[:24]
    print(f"point-to-point, 2 ranks, best of {args.rounds} alternating round(s)"
          + (f"; MPI: {problem}" if problem else f"; MPI: {name}"))
    print(f"{'measure':<22}{'size':>8}{'shmtree':>12}{name:>26}{'MPI/shmtree':>13}")
    for k, unit, sizes in (("pingpong", "us", pingpong), ("bandwidth", "GB/s", bandwidth)):
        for n in sizes:
            s = shm[k][n]
            m = mpi[k][n] if mpi[k] else None
            ratio = "" if m is None else f"{(m / s if k == 'pingpong' else s / m):.2f}"
            what = "half round trip" if k == "pingpong" else "sendrecv bandwidth"
            print(f"{what:<22}{format_size(n):>8}{s:>9.2f} {unit:<3}"
                  f"{'' if m is None else f'{m:>9.2f} {unit}':>26}{ratio:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shmtree": shm, "mpi": mpi, "mpi_library": library,
                       "mpi_problem": problem}, f, indent=1)
    return 0


def add_parser(sub, arg, positive):
    p = sub.add_parser(
        "p2p", help="point-to-point messages: ping-pong and sendrecv bandwidth beside MPI",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--pingpong", type=arg(parse_sizes), default=parse_sizes(DEFAULT_PINGPONG),
                   help=f"ping-pong sizes (default {DEFAULT_PINGPONG})")
    p.add_argument("--bandwidth", type=arg(parse_sizes), default=parse_sizes(DEFAULT_BANDWIDTH),
                   help=f"sendrecv sizes (default {DEFAULT_BANDWIDTH})")
    p.add_argument("--rounds", type=arg(positive), default=3,
                   help="alternating rounds of shmtree and MPI; the best of each (default 3)")
    p.add_argument("--no-mpi", action="store_true", help="shmtree only")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    return p
