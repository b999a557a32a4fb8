"""Sphinx configuration of shmtree's documentation site.

Build it (from the repository root, with the docs extra installed: ``pip install ".[docs]"``)::

    sphinx-build -W -b html docs docs/_build/html

The API reference is made by autodoc from the docstrings of the *installed* shmtree (or of an
in-place build: ``python setup.py build_ext --inplace``), so the extension modules must be
built.  The torch backend's page imports shmtree.torch: where torch is absent, autodoc mocks it.
"""
import shmtree

project = "shmtree"
author = "the shmtree authors"
copyright = "the shmtree authors"
release = shmtree.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = []

# myst: design.md and algorithms.md link to each other's headings (#tree-order ...)
myst_heading_anchors = 3

# autodoc / numpydoc
autodoc_member_order = "bysource"
autodoc_typehints = "none"          # the signatures say it; numpydoc's Parameters say the types
autosummary_generate = False        # the API pages are written by hand, with autodoc directives
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_validation_checks = set()

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False
if not HAVE_TORCH:                  # the torch backend's page from its docstrings all the same
    autodoc_mock_imports = ["torch"]

html_theme = "furo"
html_title = f"shmtree {release}"
html_static_path = []
pygments_style = "sphinx"
nitpicky = False
default_role = "py:obj"         # `name` in a docstring links to the object when there is one
highlight_language = "none"      # plain blocks are tables and output; code blocks name their language
