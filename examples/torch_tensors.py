"""Arrays of other libraries: shmtree's own calls take torch tensors (CPU) as input and out=."""
# needs: torch
import sys

try:
    import torch
except ImportError:
    print("torch is not installed: skipped")
    sys.exit(0)

import shmtree


def step(comm):
    t = torch.full((3,), float(comm.rank + 1))
    comm.allreduce(t, out=t)                     # in place, on the tensor's own memory
    u = comm.allgather(torch.tensor([comm.rank]))   # torch in, torch out
    return t.tolist(), type(u).__name__, u.tolist()


if __name__ == "__main__":
    print(shmtree.run(step, 2))

# Output:
# [([3.0, 3.0, 3.0], 'Tensor', [[0], [1]]), ([3.0, 3.0, 3.0], 'Tensor', [[0], [1]])]
