"""shmtree-bench p2p: point-to-point messages beside MPI, measured in the same run.

Two figures, each for shmtree (2 ranks: shmtree.run) and for each MPI (mpi4py under the mpiexec
beside the interpreter, e.g. the mpich wheel's, or each --mpi-python's; p2p_worker.py):

- ping-pong: rank 0 sends, rank 1 receives into a preallocated array and sends back; the figure
  is half the round trip (send + recv of one message), in microseconds;
- sendrecv bandwidth: both ranks `sendrecv` the size to each other at once (into a
  preallocated out); bytes one rank receives per second, GB/s.

The libraries are measured in alternating rounds (--rounds, default 3) and each figure is the
best round's (the least disturbed by other load), so a busy machine slows all alike; the last
column is the best MPI's figure over shmtree's (above 1: shmtree is better).
"""
from __future__ import annotations

import json
import os
import sys

from .mpi import add_round_options, alternate, mpi_pythons, run_worker
from .p2p_worker import measure
from .units import format_size, parse_sizes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "p2p_worker.py")
DEFAULT_PINGPONG = "8,32K"
DEFAULT_BANDWIDTH = "2M,16M"
ROWS = (("pingpong", "half round trip", "us", min), ("bandwidth", "sendrecv bandwidth", "GB/s",
                                                         max))


def _shmtree_rank(comm, pingpong, bandwidth):
    return measure(lambda x, d: comm.send(x, d), lambda out, s: comm.recv(s, out=out),
                   lambda x, out, o: comm.sendrecv(x, o, o, out=out), comm.barrier,
                   comm.rank, pingpong, bandwidth)


def run_shmtree(pingpong, bandwidth):
    import shmtree
    return shmtree.run(_shmtree_rank, 2, args=(pingpong, bandwidth))[0]


def run_mpi(pingpong, bandwidth, python=None, timeout=300):
    library, figures = run_worker(python or sys.executable, 2, WORKER,
                                  [",".join(map(str, pingpong)), ",".join(map(str, bandwidth))],
                                  "P2P-RESULT", timeout)
    return library, {k: {int(n): v for n, v in d.items()} for k, d in figures.items()}


def _best(a, b):
    return {k: {n: better(a[k][n], b[k][n]) for n in a[k]} for k, _, _, better in ROWS}


def cmd_p2p(args):
    pingpong, bandwidth = args.pingpong, args.bandwidth
    pythons = mpi_pythons(args)
    shm, mpis = alternate(args.rounds, lambda: run_shmtree(pingpong, bandwidth),
                          lambda python: run_mpi(pingpong, bandwidth, python), pythons, _best)
    print(f"point-to-point, 2 ranks, best of {args.rounds} alternating round(s)"
          + "".join(f"; {name}: {problem}" for name, _, problem in mpis if problem))
    mpis = [(name, figures) for name, figures, _ in mpis if figures]
    print(f"{'measure':<22}{'size':>8}{'shmtree':>13}" + "".join(f"{n[:22]:>24}" for n, _ in mpis)
          + ("  best MPI/shmtree" if mpis else ""))
    for k, what, unit, better in ROWS:
        for n in (pingpong if k == "pingpong" else bandwidth):
            s = shm[k][n]
            line = f"{what:<22}{format_size(n):>8}{s:>9.2f} {unit:<4}"
            line += "".join(f"{f[k][n]:>19.2f} {unit:<4}" for _, f in mpis)
            if mpis:
                m = better(f[k][n] for _, f in mpis)
                line += f"{(m / s if k == 'pingpong' else s / m):>18.2f}"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shmtree": shm, "mpi": {name: figures for name, figures in mpis}}, f,
                      indent=1)
    return 0


def add_parser(sub, arg, positive):
    p = sub.add_parser(
        "p2p", help="point-to-point messages: ping-pong and sendrecv bandwidth beside MPI",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--pingpong", type=arg(parse_sizes), default=parse_sizes(DEFAULT_PINGPONG),
                   help=f"ping-pong sizes (default {DEFAULT_PINGPONG})")
    p.add_argument("--bandwidth", type=arg(parse_sizes), default=parse_sizes(DEFAULT_BANDWIDTH),
                   help=f"sendrecv sizes (default {DEFAULT_BANDWIDTH})")
    add_round_options(p, arg, positive)
    return p
