"""DistributedDataParallel on the shmtree backend of torch.distributed.

    python examples/torch_ddp.py                                       # spawns 2 processes
    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py    # or under torchrun
"""
# needs: torch
import os
import sys
import tempfile

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP
except ImportError:
    print("torch is not installed: skipped")
    sys.exit(0)

import shmtree.torch  # noqa: F401  (registers the backend "shmtree")


def train(rank=None, world=None, store_path=None):
    if store_path is None:
        dist.init_process_group("shmtree")                 # env://: torchrun's variables
    else:
        dist.init_process_group("shmtree", store=dist.FileStore(store_path, world),
                                rank=rank, world_size=world)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)          # each rank its own data
    for step in range(20):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()                                    # gradients allreduced by shmtree
        opt.step()
    # every rank holds the same parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    if rank == 0:
        print("parameters equal on every rank:", all(torch.equal(gathered[0], t) for t in gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "RANK" in os.environ:                               # started by torchrun
        train()
    else:
        mp.spawn(train, args=(2, os.path.join(tempfile.mkdtemp(), "store")), nprocs=2)

# Output:
# parameters equal on every rank: True
