"""A Pool that heals: a worker dies during map; its task fails, the others run (issue 38)."""
import os
import signal
import sys

import shmtree


def task(i):
    if i == 3 and shmtree.size() == 4 and shmtree.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)      # the worker of rank 1 dies, once
    return i * i


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "respawn"     # or "shrink"
    with shmtree.Pool(4, on_failure=mode) as pool:
        results = []
        for i in range(8):                         # (apply_async: each task on its own)
            try:
                results.append(pool.apply_async(task, (i,)).get(timeout=60))
            except shmtree.PeerLostError as exc:
                results.append(type(exc).__name__)
        print(results)
        print(pool.group.size)

# Output:
# [0, 1, 4, 9, 16, 25, 36, 49]
# 4
