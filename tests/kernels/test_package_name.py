"""The import name `kernels` is ours: no installed distribution may also ship it.

transformers 5.25 made the Hub's `kernels` package a requirement; installed beside
this project, `import kernels` finds whichever comes first on sys.path, and
transformers then fails to configure any model. The pin in pyproject.toml keeps it
out; this test names the clash the moment a dependency brings it back.
"""

import importlib.metadata
from pathlib import Path

import kernels


def test_kernels_is_this_projects_package():
    assert Path(kernels.__file__).resolve().parent == Path(__file__).resolve().parents[2] / "kernels"


def test_no_other_distribution_provides_kernels():
    owners = set(importlib.metadata.packages_distributions().get("kernels", [])) - {"streamer"}
    try:
        owners.add(f"kernels {importlib.metadata.version('kernels')}")
    except importlib.metadata.PackageNotFoundError:
        pass
    assert not owners, f"installed distributions also ship the import name `kernels`: {sorted(owners)}"
