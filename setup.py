"""Build the Cython extensions of shmtree.

Optimised (-O3) by default, portable: no -march=native unless SHMTREE_NATIVE=1 is set in the
environment at build time.  SHMTREE_VEC_REPORT=1 adds -fopt-info-vec-optimized so that one can
see which reduction loops the compiler vectorised.
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

cflags = ["-O3", "-std=gnu11", "-fno-strict-aliasing"]
if os.environ.get("SHMTREE_NATIVE") == "1":
    cflags.append("-march=native")
if os.environ.get("SHMTREE_VEC_REPORT") == "1":
    cflags.append("-fopt-info-vec-optimized")

def ext(name):
    return Extension(
        f"shmtree.{name}",
        [f"shmtree/{name}.pyx"],
        include_dirs=["shmtree/_csrc", numpy.get_include()],
        depends=sorted(glob.glob("shmtree/_csrc/*.h")),     # rebuild when a header changes
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=cflags,
    )

setup(
    ext_modules=cythonize(
        [ext("_kernels"), ext("_engine"), ext("_moving"), ext("_p2p"), ext("_accum"),
         ext("_rounding")],
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
