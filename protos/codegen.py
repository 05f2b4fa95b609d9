"""The one codegen command: `python protos/codegen.py [OUT_DIR]`.

Compiles every `.proto` under `protos/` into `_pb2.py`, `_pb2_grpc.py` and `.pyi` files beside
it: `protos/raypipe/v1/emotion.proto` becomes the importable `protos.raypipe.v1.emotion_pb2`
(the proto package, and so the service's wire name, stays `raypipe.v1`). `protos` is the one
package below both `raypipe` (the client) and `serve_app` (the server). Without OUT_DIR it
writes into the repo root (the one place generated code lives); the drift test passes a
temporary dir and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes generated modules under out_dir and returns their paths."""
    from grpc_tools import protoc  # a build tool, not a runtime dependency of importers

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    files = [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {files}")
    generated = []
    for f in files:
        stem = out_dir / f.removesuffix(".proto")
        generated += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return generated


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(target):
        print(path.relative_to(target))
