"""Goal of issue 41: no code outside the backend registry compares inference-backend names; it asks
the entry (`inflight.backends.registry.backend_entry`). Read from the source of inflight/ (AST)."""

from __future__ import annotations

import ast
from pathlib import Path

import inflight
from inflight.backends.registry import backend_names

ROOT = Path(inflight.__file__).parent
REGISTRY = ROOT / "backends" / "registry.py"


def _names(node: ast.AST) -> set[str]:
    """The backend names among the string constants of `node` (a constant or a tuple/list/set of them)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in backend_names()}


def _reads_backend(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in ("backend", "server")


def backend_name_uses(source: str) -> list[str]:
    """Each place in `source` that decides by a backend's name: a comparison of a `.backend`
    setting with a name, literal choices listing backends, a table keyed by backend names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_reads_backend(s) for s in sides) and any(_names(s) for s in sides):
                found.append(
                    f"line {node.lineno}: compares a backend setting with "
                    f"{sorted(set().union(*map(_names, sides)))}"
                )
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                # a list of backends (not a kernel choice)
                if kw.arg == "choices" and len(_names(kw.value)) >= 2:
                    found.append(f"line {node.lineno}: literal backend choices {sorted(_names(kw.value))}")
        elif (
            isinstance(node, ast.Dict)
            and len(set().union(*(_names(k) for k in node.keys if k is not None))) >= 2
        ):
            found.append(f"line {node.lineno}: a table keyed by backend names")
    return found


def test_no_backend_name_is_compared_outside_the_registry():
    uses = {str(p.relative_to(ROOT)): backend_name_uses(p.read_text()) for p in sorted(ROOT.rglob("*.py"))
            if p != REGISTRY}
    assert {path: found for path, found in uses.items() if found} == {}, "ask backend_entry(name) instead"


def test_the_check_sees_what_the_call_sites_did_before_the_registry():
    before = '''
takes_adapters = engine.backend != "vllm"
parser.add_argument("--backend", default="native", choices=["native", "vllm"])
START_TIMEOUT_S = {"native": 120.0, "vllm": 600.0}
if args.server == "vllm":
    pass
'''
    assert len(backend_name_uses(before)) == 4
    after = ('takes_adapters = backend_entry(engine.backend).serves_adapters\nif backend == "native": pass\n'
             'attention_backend: str = ours("auto", choices=("auto", "native", "torch"))\n')
    assert backend_name_uses(after) == []  # the engine's own kernel choice is not a backend name read
