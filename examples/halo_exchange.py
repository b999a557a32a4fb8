"""Point-to-point messages: a 1-D halo exchange, each rank owning a slab."""
import numpy as np

import shmtree


def step(comm, n_steps):
    left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    u = np.zeros(1000 + 2)                # one ghost cell at each end
    u[1:-1] = comm.rank
    for _ in range(n_steps):
        # my first cell goes left while the right neighbour's first cell comes in, and back
        u[-1:] = comm.sendrecv(u[1:2], left, right, sendtag=0, recvtag=0)
        u[:1] = comm.sendrecv(u[-2:-1], right, left, sendtag=1, recvtag=1)
        u[1:-1] = 0.5 * u[1:-1] + 0.25 * (u[:-2] + u[2:])
    return round(float(u[1:-1].mean()), 6)


def ping_pong(comm):
    """send / recv, and their nonblocking forms: Requests."""
    if comm.rank == 0:
        comm.send(np.arange(3), 1, tag=7)
        return comm.recv(1, tag=8).tolist()
    got = comm.irecv(0, tag=7).wait()
    comm.isend(got * 10, 0, tag=8).wait()
    return got.tolist()


if __name__ == "__main__":
    print(shmtree.run(step, 4, args=(10,)))
    print(shmtree.run(ping_pong, 2))

# Output:
# [0.003524, 1.0, 2.0, 2.996476]
# [[0, 10, 20], [0, 1, 2]]
