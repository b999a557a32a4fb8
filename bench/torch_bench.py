#!/usr/bin/env python
"""torch.distributed: backend "shmtree" beside "gloo", in one run: ``shmtree-bench torch``.

    python bench/torch_bench.py                       # = shmtree-bench torch
    python bench/torch_bench.py --sizes 8,64M -n 4 --steps 50

Every operation at each size, an FSDP and a DDP training step, bfloat16 all_reduce's element rate
over float32's, for both backends in the same processes (shmtree/bench/torchdist.py has the
code and says what is measured; `shmtree-bench torch --help` lists the options).
Needs torch (`pip install "shmtree[torch]"`).
"""
import os
import sys

try:
    import shmtree  # noqa: F401
except ImportError:                      # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shmtree.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["torch"] + sys.argv[1:]))
