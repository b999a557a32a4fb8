"""Every code example of the docs and the README runs (issue 36).

- Each ``examples/*.py`` is run as ``python examples/NAME.py`` in a process of its own (a
  session of its own, killed whole on a timeout) and must exit 0.  The docs and README show
  these very files (literalinclude).  A file whose last lines are an ``# Output:`` block of
  comments must print exactly those lines: the output the docs show is the output it gives.
- A ``# needs: MODULE`` line marks an example that needs an optional package (torch, mpi4py):
  without it the example must still exit 0, saying it skipped, and the test is skipped.
- A ``# mpiexec: ARGS`` line marks an example that runs under ``mpiexec ARGS``: run so where
  mpiexec (the mpich wheel's) and mpi4py are present, else skipped.
- README.md's code blocks are these very files, and its set-up commands are the ones CI and
  the docs name.
- The Examples sections of the public API's docstrings (the modules of API_MODULES) run as
  doctests, each in a clean namespace that is a module of its own (so that a function it
  defines can be sent to a Pool's workers).
"""
import doctest
import importlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import types

import pytest

import shmtree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(ROOT, "examples")
EXAMPLES = sorted(name for name in os.listdir(EXAMPLES_DIR) if name.endswith(".py"))
EXAMPLE_TIMEOUT_S = 150             # each example takes a few seconds on 2 cores
API_MODULES = ("shmtree.frontend.front", "shmtree.frontend.moves", "shmtree.frontend.scans",
               "shmtree.frontend.forms", "shmtree.frontend.memory", "shmtree.api",
               "shmtree.launching.launch", "shmtree.launching.pool", "shmtree.errors",
               "shmtree.frontend.persistent", "shmtree.frontend.requests",
               "shmtree.launching.joining", "shmtree.accumulator",
               "shmtree.groups.survive")


def _import_root():
    """Where `import shmtree` finds the package this test imported (an in-place build of this
    checkout, or the installed one): the examples' processes import the same."""
    return os.path.dirname(os.path.dirname(os.path.abspath(shmtree.__file__)))


def _header(text, key):
    """The value of a `# key: value` line of an example, or None."""
    m = re.search(rf"^# {key}: *(.*)$", text, re.M)
    return m.group(1).strip() if m else None


def expected_output(text):
    """The lines of an example's closing `# Output:` block (None without one)."""
    lines = text.rstrip("\n").splitlines()
    try:
        start = max(i for i, line in enumerate(lines) if line.strip() == "# Output:")
    except ValueError:
        return None
    block = lines[start + 1:]
    assert all(line.startswith("#") for line in block), "the # Output: block must end the file"
    return [line[2:] if line.startswith("# ") else line[1:] for line in block]


def _mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def _has(module):
    return importlib.util.find_spec(module) is not None


def _run(argv, timeout):
    """(returncode, stdout, stderr) of argv in a session of its own, killed whole on timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (_import_root(), os.environ.get("PYTHONPATH")) if p]))
    env.pop("PYTHONSAFEPATH", None)       # (the example's own folder stays on its path)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} ran past {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)      # (anything it left behind)
        except ProcessLookupError:
            pass
    return proc.returncode, out, err


def test_there_are_examples():
    assert len(EXAMPLES) >= 10, EXAMPLES


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    path = os.path.join(EXAMPLES_DIR, name)
    with open(path) as f:
        text = f.read()
    argv = [sys.executable, os.path.join("examples", name)]
    needs = (_header(text, "needs") or "").split()
    missing = [m for m in needs if not _has(m)]
    mpi = _header(text, "mpiexec")
    if mpi is not None and not missing:
        mpiexec = _mpiexec()
        if mpiexec is None:
            pytest.skip(f"{name} runs under mpiexec, and there is none (pip install mpich)")
        argv = [mpiexec] + mpi.split() + argv
    code, out, err = _run(argv, EXAMPLE_TIMEOUT_S)
    assert code == 0, f"{' '.join(argv)} exited {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    if missing:
        assert "skipped" in out, out
        pytest.skip(f"{name} needs {', '.join(missing)}: it skipped, as it should")
    expected = expected_output(text)
    if expected is not None:
        assert out.splitlines() == expected, f"--- stdout\n{out}\n--- stderr\n{err}"


def test_expected_output_block_is_parsed():
    text = "print(1)\n\n# Output:\n# [1, 2]\n#\n# x\n"
    assert expected_output(text) == ["[1, 2]", "", "x"]
    assert expected_output("print(1)\n") is None


# ---- the API reference names every public name ----

def test_api_reference_lists_every_public_name():
    """Every name of shmtree.__all__ has an entry in the API reference (docs/api/*.rst): an
    autosummary line of its own or a directive that documents it."""
    api = os.path.join(ROOT, "docs", "api")
    text = ""
    for name in sorted(os.listdir(api)):
        if name.endswith(".rst"):
            with open(os.path.join(api, name)) as f:
                text += f.read()
    missing = [n for n in shmtree.__all__ if n != "__version__" and not re.search(
        rf"^(   {n}|\.\. \w+:: (shmtree\.)?{n})$", text, re.M)]
    assert not missing, f"not in docs/api/: {missing}"


# ---- README.md ----

def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_examples_are_the_example_files():
    blocks = re.findall(r"^```python\n(.*?)^```$", _readme(), re.M | re.S)
    assert len(blocks) >= 3, "README shows the run, Pool and torch examples"
    files = {}
    for name in EXAMPLES:
        with open(os.path.join(EXAMPLES_DIR, name)) as f:
            files[f.read().strip()] = name
    shown = [files.get(block.strip()) for block in blocks]
    assert None not in shown, ("a README code block that is no examples/ file",
                               [b[:80] for b, n in zip(blocks, shown) if n is None])
    assert {"run_allreduce.py", "pool_tasks.py", "torch_ddp.py"} <= set(shown), shown


def test_readme_set_up_commands():
    text = _readme()
    assert "pip install . && shmtree-bench" in text
    assert 'pip install ".[test]" && python -m pytest' in text       # .ci/run runs this one
    assert len(text.splitlines()) <= 250


# ---- the Examples sections of the API's docstrings ----

def _api_doctests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests, seen = [], set()
    for name in API_MODULES:
        for test in finder.find(importlib.import_module(name)):
            if test.examples and test.name not in seen:
                seen.add(test.name)
                tests.append(test)
    return sorted(tests, key=lambda t: t.name)


API_DOCTESTS = _api_doctests()


def test_the_api_has_examples():
    names = {t.name.rsplit(".", 1)[-1] for t in API_DOCTESTS}
    for method in ("allreduce", "iallreduce", "allreduce_init", "scatter", "split", "empty"):
        assert method in names, sorted(names)
    for name in ("run", "Pool", "Request", "Persistent", "wait_all", "WorkerError"):
        assert name in names, sorted(names)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("test", API_DOCTESTS, ids=[t.name for t in API_DOCTESTS])
def test_docstring_example(test):
    module = types.ModuleType("shmtree_doctest")     # functions defined here can be pickled
    sys.modules[module.__name__] = module
    try:
        test.globs = module.__dict__
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS
                                       | doctest.NORMALIZE_WHITESPACE)
        report = io.StringIO()
        result = runner.run(test, out=report.write, clear_globs=False)
    finally:
        del sys.modules[module.__name__]
        module.__dict__.clear()
    assert result.failed == 0, report.getvalue()
