"""Generate the Python stubs in drafter_sdk/proto from protos/splitspec/v1.

Reproducible: pinned grpcio-tools (see pyproject's `dev` extra), files sorted,
imports rewritten to the package. `--check` fails when the committed stubs
drift from the .proto files.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "drafter_sdk" / "proto"
PACKAGE = "drafter_sdk.proto"
IMPORT = re.compile(r"^from splitspec\.v1 import (\w+) as", re.MULTILINE)
INIT = '"""Generated protobuf and gRPC stubs of splitspec.v1 (do not edit; run protos/generate.py)."""\n'


def generate() -> dict[str, str]:
    """Return {file name: content} of the stubs generated from the protos."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        files = {"__init__.py": INIT}
        for path in sorted(Path(tmp).rglob("*.py*")):
            text = IMPORT.sub(lambda m: f"from {PACKAGE} import {m.group(1)} as", path.read_text())
            files[path.name] = text
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs differ")
    check = parser.parse_args().check
    files = generate()
    if check:
        present = {p.name for p in OUT.glob("*.py*")}
        drift = sorted(present ^ set(files))
        for name, text in files.items():
            path = OUT / name
            if path.exists() and path.read_text() != text:
                drift.append(name)
                sys.stdout.writelines(difflib.unified_diff(
                    path.read_text().splitlines(True), text.splitlines(True), str(path), "generated"))
        if drift:
            print(f"generated stubs drift from protos/: {', '.join(drift)}; run python protos/generate.py")
            return 1
        print(f"stubs up to date ({len(files)} files)")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for stale in OUT.glob("*.py*"):
        if stale.name not in files:
            stale.unlink()
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(files)} files to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
