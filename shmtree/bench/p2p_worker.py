"""The MPI side of shmtree-bench p2p (run under mpiexec by path, 2 ranks), and the measuring
loop both sides share (measure).  Prints one line 'P2P-RESULT {json}' on rank 0.  argv:
ping-pong sizes, sendrecv sizes (comma-separated bytes)."""
import json
import sys
import time

import numpy as np

TARGET_S = 0.3


def _iters(n):
    return max(5, min(5000, int(TARGET_S * 2e9 / max(n, 2000) / 4)))


def measure(comm_send, comm_recv, comm_sendrecv, barrier, rank, pingpong, bandwidth):
    """The figures of one library (its calls given as functions): {"pingpong": {n: us},
    "bandwidth": {n: GB/s}}."""
    got = {"pingpong": {}, "bandwidth": {}}
    other = 1 - rank
    for n in pingpong:
        x, out = np.zeros(n, np.uint8), np.empty(n, np.uint8)
        iters = _iters(n)
        for rep in (max(3, iters // 10), iters):
            barrier()
            t = time.perf_counter()
            for _ in range(rep):
                if rank == 0:
                    comm_send(x, other)
                    comm_recv(out, other)
                else:
                    comm_recv(out, other)
                    comm_send(x, other)
            dt = time.perf_counter() - t
        got["pingpong"][n] = dt / iters / 2 * 1e6
    for n in bandwidth:
        x, out = np.ones(n, np.uint8), np.empty(n, np.uint8)
        iters = max(3, _iters(n) // 2)
        comm_sendrecv(x, out, other)
        barrier()
        t = time.perf_counter()
        for _ in range(iters):
            comm_sendrecv(x, out, other)
        dt = time.perf_counter() - t
        got["bandwidth"][n] = n * iters / dt / 1e9
    return got


def main():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    pingpong = [int(v) for v in sys.argv[1].split(",") if v]
    bandwidth = [int(v) for v in sys.argv[2].split(",") if v]
    got = measure(lambda x, d: comm.Send(x, d), lambda out, s: comm.Recv(out, s),
                  lambda x, out, o: comm.Sendrecv(x, o, recvbuf=out, source=o), comm.Barrier,
                  comm.rank, pingpong, bandwidth)
    if comm.rank == 0:
        print("P2P-RESULT " + json.dumps({"library": MPI.Get_library_version().strip(),
                                          "figures": got}), flush=True)


if __name__ == "__main__":
    main()
