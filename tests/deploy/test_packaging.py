"""The distribution the images install (`pip install .`, not editable): every file of the two packages
goes into the wheel, and the wheel alone, without the source tree, imports and serves its data.

The suite itself runs on an editable install, which reads everything from the source tree, so a file a
package needs at run time but the wheel leaves out (a page, a stub, a marker) would pass every other test
and break only the images.

The SDK is marked `py.typed`, so a drafter author's type checker reads its annotations: drafters written
as users write them (the README's, and one that uses the rest of the public API) must pass `mypy --strict`
against the SDK installed from the wheel, as a user's checker sees it.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from readme_blocks import readme_drafter

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("drafter_sdk", "verifier_service")
# Where this environment's packages are (two folders on systems whose platform packages live apart).
INSTALLED = list(dict.fromkeys(sysconfig.get_paths()[kind] for kind in ("purelib", "platlib")))
SCRIPTS = {"splitspec": "verifier_service.tools.cli:main", "splitspec-verifier": "verifier_service.api.cli:main",
           "splitspec-drafter": "drafter_sdk.server.cli:main"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the tree: setuptools writes its build folder beside the sources."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(work / "dist"), str(source)], check=True, timeout=120)
    (built,) = (work / "dist").glob("splitspec-*.whl")
    return built


def test_every_file_of_the_packages_is_in_the_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    files = {p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert files - names == set()
    assert {"drafter_sdk/py.typed", "verifier_service/api/playground.html"} <= names


def test_the_wheel_declares_the_three_commands(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (entry_points,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parsed = configparser.ConfigParser()
        parsed.read_string(z.read(entry_points).decode())
    assert dict(parsed["console_scripts"]) == SCRIPTS


def test_the_wheel_alone_imports_and_reads_its_data(wheel: Path, tmp_path: Path) -> None:
    """Unpacked, on a path without the source tree and without the editable install's finder (no site:
    the installed dependencies are put on the path by hand, which skips the finder's .pth file)."""
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
    check = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "import drafter_sdk, verifier_service.api.http_app\n"
        "from importlib import resources\n"
        "from verifier_service.api import cli\n"
        "assert all(m.__file__.startswith(sys.argv[1]) for m in (drafter_sdk, cli)), (drafter_sdk, cli)\n"
        "assert '<html' in resources.files('verifier_service.api').joinpath('playground.html').read_text()\n"
        "assert resources.files('drafter_sdk').joinpath('py.typed').is_file()\n"
        "cli.parser()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", check, str(unpacked), *INSTALLED],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# The rest of the public API, as a drafter author types it: trees and chains, the hooks, serve's options.
TYPED_DRAFTER = """
import asyncio
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

from drafter_sdk import LOOKAHEAD, TREE_CAPABILITY, Drafter, DraftRequest, DraftTree, NgramDrafter, ReleaseReason, serve


class Branching(Drafter):
    version = "1.0"
    capabilities = (TREE_CAPABILITY, LOOKAHEAD)
    runs_inline = True

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], int] = {}
        self.trees: Counter | None = None

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self.trees = Counter("branching_trees", "trees drafted", registry=registry)

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[Sequence[int] | DraftTree]:
        drafts: list[Sequence[int] | DraftTree] = []
        for r in requests:
            self.seen[r.key] = len(r.tokens)
            last = r.tokens[-1]
            if r.max_draft_nodes >= 2 and r.sampling.temperature == 0.0:
                drafts.append(DraftTree(tokens=[last, last + 1], parents=[-1, -1]) if last % 2 else
                              DraftTree.from_branches([r.generated_tokens[-2:], [last]]))
            else:
                drafts.append(r.generated_tokens[-r.draft_len:] if r.draft_len else [])
        return drafts

    def state_bytes(self, key: tuple[str, str]) -> int:
        return 8 if key in self.seen else 0

    def on_release(self, key: tuple[str, str], reason: ReleaseReason = ReleaseReason.UNSPECIFIED) -> None:
        self.seen.pop(key, None)

    def save_learned(self) -> bytes | None:
        return str(len(self.seen)).encode()

    def restore_learned(self, data: bytes) -> None:
        int(data)


class Slow(NgramDrafter):
    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        return super().prepare_draft_tokens(requests)


class Fetching(Drafter):  # awaits another service, through an asyncio client

    async def load(self) -> None:
        await asyncio.sleep(0)

    async def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        await asyncio.sleep(0)
        return [list(r.tokens[-r.draft_len:]) if r.draft_len else [] for r in requests]


if __name__ == "__main__":
    serve(Branching(), port=0, port_file="port", max_state_mib=64.0)
    serve(Slow(max_draft_len=4))
    serve(Fetching())
"""


@pytest.mark.parametrize("name", ["readme", "typed"])
def test_a_drafter_type_checks_against_the_installed_sdk(wheel: Path, tmp_path: Path, name: str) -> None:
    """The wheel unpacked into a bare environment's site-packages, with this one's packages after it (a
    .pth file) for the SDK's dependencies: mypy reads the SDK there as a user's checker does, through
    py.typed (it cannot follow the editable install's import hook)."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    python = env / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    (site / "dependencies.pth").write_text("".join(f"{folder}\n" for folder in INSTALLED))
    source = tmp_path / f"{name}_drafter.py"
    source.write_text(readme_drafter() if name == "readme" else TYPED_DRAFTER)
    checked = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-executable",
                              str(python), str(source)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Success: no issues found in 1 source file" in checked.stdout
