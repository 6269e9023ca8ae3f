"""Copy a built wheel's compiled kernels (and their manifest) into this checkout, so that an editable install made
with PAGEDSERVE_BUILD_KERNELS=0 uses the modules the wheel was tested with instead of compiling them again (CI).

    python scripts/kernels_from_wheel.py dist/pagedserve-*.whl
"""
from __future__ import annotations

import sys
import zipfile
from pathlib import Path

KERNELS = "pagedserve/model_executor/kernels/"


def main(wheel_path: str) -> int:
    root = Path(__file__).resolve().parent.parent
    with zipfile.ZipFile(wheel_path) as wheel:
        names = [n for n in wheel.namelist() if n.startswith(KERNELS) and n.count("/") == KERNELS.count("/")
                 and (n.endswith(".so") or n.endswith("/prebuilt.json"))]
        if not any(n.endswith("/prebuilt.json") for n in names):
            print(f"{wheel_path} holds no prebuilt kernels", file=sys.stderr)
            return 1
        wheel.extractall(root, names)
    print("the wheel's kernels in the checkout:", ", ".join(sorted(n.rsplit("/", 1)[1] for n in names)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
