"""The soak script (bench/soak.py): its closed forms are right, and a short soak has no error.

A ~16 s soak with oversubscribed ranks (2 x cores), random sizes up to 64 MiB, random dtypes,
ops, layouts, out modes, sleeps, and two group configurations; every result is compared bit for
bit with its closed form.  Longer: `python bench/soak.py --seconds 120`.
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

SOAK_SECONDS = 8


@pytest.fixture(scope="module")
def soak_script():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                        "soak.py")


@pytest.fixture(scope="module")
def soak_module(soak_script):
    spec = importlib.util.spec_from_file_location("shmtree_soak", soak_script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("P", [1, 2, 3, 8])
def test_closed_forms_match_numpy(soak_module, P):
    """The soak's expected results equal numpy's reduction of its inputs (else a soak with
    zero errors would prove nothing)."""
    ufuncs = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
    for dtype in soak_module.DTYPES:
        for op in soak_module.valid_ops(dtype):
            for n in (0, 1, 13, 1000):
                inputs = [soak_module.pattern(dtype, op, r, P, n) for r in range(P)]
                want = ufuncs[op].reduce(np.stack(inputs), axis=0, dtype=np.dtype(dtype))
                got = soak_module.expected(dtype, op, P, n)
                assert got.dtype == np.dtype(dtype) and np.array_equal(got, want), \
                    (dtype, op, P, n)
                if P > 1 and n > 12:
                    # the inputs differ by rank, so a rank's input alone is not the answer
                    assert not all(np.array_equal(x, got) for x in inputs), (dtype, op, P)


@pytest.mark.timeout(150)
def test_short_soak_has_no_errors(soak_script, repo_root, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, soak_script, "--seconds", str(SOAK_SECONDS),
                           "--segment-seconds", str(SOAK_SECONDS / 2), "--seed", "20240611",
                           "--json"], capture_output=True, text=True, timeout=130, env=env,
                          cwd=str(tmp_path))
    assert proc.stdout.strip(), f"no report; stderr:\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["errors"] == 0, json.dumps(report["error_samples"], indent=1)[:6000]
    assert proc.returncode == 0, proc.stderr
    assert report["procs"] == 2 * len(os.sched_getaffinity(0))
    assert len(report["segments"]) >= 2
    assert report["calls"] >= 20, f"only {report['calls']} calls in {SOAK_SECONDS} s"
    assert report["bytes"] > 0 and report["slowest"]["seconds"] > 0
    assert SOAK_SECONDS - 1 <= report["wall_s"] <= SOAK_SECONDS + 60
