"""Entry script of the vLLM backend, run by vLLM's interpreter: `python main.py [options] [-- vLLM args]`.

vLLM's venv does not have the `inflight` package, so this script loads its own folder as a private
package (`_inflight_vllm`, whose modules import each other relatively) and the route paths from
`inflight/client/routes.py` by path; it never imports `inflight` itself. Its folder is taken off
`sys.path` first, so that module names here cannot shadow the ones vLLM imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUTES_FILE = HERE.parents[1] / "client" / "routes.py"
PACKAGE = "_inflight_vllm"


def load_package() -> None:
    """This folder as the package `_inflight_vllm`, and routes.py as `_inflight_vllm_routes`."""
    spec = importlib.util.spec_from_file_location(PACKAGE, HERE / "__init__.py",
                                                  submodule_search_locations=[str(HERE)])
    assert spec is not None and spec.loader is not None
    sys.modules[PACKAGE] = package = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(package)
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}_routes", ROUTES_FILE)
    assert spec is not None and spec.loader is not None
    sys.modules[spec.name] = routes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(routes)


def main() -> int:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    load_package()
    return importlib.import_module(f"{PACKAGE}.server").main(sys.argv[1:], sys.modules[f"{PACKAGE}_routes"])


if __name__ == "__main__":
    sys.exit(main())
