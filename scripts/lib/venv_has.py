"""Exit 0 when this interpreter's environment has every `name==version` of SPEC (a local suffix such
as +cpu is fine) and every module named after `--modules`; with `--torch-if-any V`, a torch that is
installed must be V. Reads package metadata only (imports nothing), so it answers well under a second.

Usage: venv_has.py SPEC [--modules NAME ...] [--torch-if-any VERSION]
"""

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--modules", nargs="*", default=[])
    parser.add_argument("--torch-if-any")
    args = parser.parse_args()
    try:
        for req in args.spec.split():
            name, _, want = req.partition("==")
            have = version(name).split("+")[0]  # a name without a version only needs to be there
            if want and have != want:
                return 1
        for module in args.modules:
            version(module)
    except PackageNotFoundError:
        return 1
    if args.torch_if_any:
        try:
            if version("torch").split("+")[0] != args.torch_if_any:
                return 1
        except PackageNotFoundError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
