"""Generate the Python stubs of the wire contract: `python proto/generate.py` (or `make proto`).

The stubs are committed beside the .proto files; tests/test_proto.py fails when they are stale.
"""
from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("splitspec/v1/*.proto"))


def generate(out_dir: Path) -> None:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` for every proto under `out_dir`.

    Raises:
        RuntimeError: protoc reported an error.
    """
    from grpc_tools import protoc  # dev dependency: only needed to regenerate
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
