"""Root conftest: `python -m pytest` in a source checkout tests the *installed* shmtree when the
checkout's own extensions are not built in place (`pip install .` builds them elsewhere), and the
in-place build when there is one (`python setup.py build_ext --inplace`, for development)."""
import glob
import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))

if not all(glob.glob(os.path.join(_ROOT, "shmtree", f"{name}*.so"))
           for name in ("_engine", "_kernels", "_moving")):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
    # and the same for the Python subprocesses the tests start (`python -m shmtree.bench` from
    # the root would otherwise import the unbuilt source tree); Python >= 3.11 reads this
    os.environ["PYTHONSAFEPATH"] = "1"
