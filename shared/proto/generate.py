"""Regenerate the committed gRPC modules: ``python -m shared.proto.generate``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc


def main() -> int:
    here = Path(__file__).resolve().parent
    root = here.parent.parent
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            str(here / "pdserve.proto"),
        ]
    )
    grpc_file = here / "pdserve_pb2_grpc.py"
    text = grpc_file.read_text()
    # grpcio-tools emits "from shared.proto import pdserve_pb2"; keep that (absolute, package-safe).
    text = re.sub(r"^import grpc\n", "import grpc  # noqa: I001\n", text, count=1, flags=re.M)
    grpc_file.write_text(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
