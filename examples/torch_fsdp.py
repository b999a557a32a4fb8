"""FSDP (fully_shard) on the shmtree backend, under torch.multiprocessing.spawn."""
# needs: torch
import os
import sys
import tempfile

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.fsdp import fully_shard
except ImportError:
    print("torch is not installed: skipped")
    sys.exit(0)

import shmtree.torch  # noqa: F401  (registers the backend "shmtree")


def train(rank, world, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("shmtree", store=dist.FileStore(store_path, world),
                            rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)                         # its parameters: a shard per rank
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)      # each rank its own data
    for step in range(3):
        x, y = torch.randn(8, 17, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)   # all_gather_into_tensor
        loss.backward()                                # reduce_scatter_tensor of the gradients
        opt.step()
    if rank == 0:
        print("trained 3 steps on", world, "ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(train, args=(2, os.path.join(tempfile.mkdtemp(), "store")), nprocs=2)

# Output:
# trained 3 steps on 2 ranks
