"""The package's layers import downward only, and no two modules import each other in a circle.

Read from the source (every `import inflight.x` / `from inflight.x import`, at module level or inside
a function: a lazy import up the layers is still an upward dependency)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import inflight

ROOT = Path(inflight.__file__).parent

# Lower layers first; a package may import those of a strictly lower rank (same rank: neither).
LAYERS: dict[str, int] = {
    "import_path": -1,  # `package.module:name` settings: the standard library only
    "algorithms": 0,  # pure tensor functions: torch and the standard library only
    "chat": 0,
    "testing": 1,  # tiny_vlm.py builds its processors with chat/image_only.py
    "models_hub": 0,  # `inflight models get`: transformers and pip only
    "rewards": 1,
    "tasks": 2,
    "config": 3,
    "engine": 3,
    # a leaf: the transport kinds' facts (read by validation and the backend registry)
    "weight_sync.kinds": 1,
    "weight_sync": 4,
    "client": 5,
    "backends.registry": 2,  # a leaf module: the backends' entries, which config validation reads
    "backends": 5,  # below server: `inflight serve --backend NAME` (server/main.py) execs backends.NAME
    "server": 6,
    # the project's python, over client/wire.py; server/main.py launches it by path
    "backends.hf_generate": 6,
    "rollout": 6,
    "eval": 7,
    "agents": 7,  # the agent endpoint and generator: server, client and rollout below it; train holds it
    "tracking": 4,  # metrics, trackers, run logs: what a user sees of a run (config below it); train above
    # processes, servers, placement, restarts, threads: engines, client, backends below; train above
    "train.strategies": 2,  # a leaf: the policy-worker kinds' entries (workers named by import path)
    "orchestration": 7,
    "train": 8,
    "megatron": 9,  # the Megatron worker: train's batches, LoRA and losses below it; train names it by path
    "cluster": 9,
    "bench": 10,
    "env_report": 11,
    "cli": 12,
}


def _module_name(path: Path) -> str:
    return ".".join(("inflight", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The inflight modules `path` imports: `from a import b` names the module `a.b` when there is
    one (a package's `__init__` that only leads to it does not count), else `a`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in modules else node.module)
    return {n for n in names if n in modules}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}


def _layer(module: str) -> str:
    """The module's package, or the module itself where LAYERS ranks it apart (`package.module`)."""
    if not module.count("."):
        return "(root)"
    parts = module.split(".")
    return ".".join(parts[1:3]) if ".".join(parts[1:3]) in LAYERS else parts[1]


def test_every_package_has_a_layer():
    packages = {_layer(m) for m in _graph()} - {"(root)", "__init__", "__main__"}
    assert packages <= set(LAYERS), f"give these packages a rank in LAYERS: {sorted(packages - set(LAYERS))}"


def test_imports_point_down():
    upward = sorted(
        f"{src} -> {dst}"
        for src, dsts in _graph().items()
        for dst in dsts
        if _layer(src) in LAYERS and _layer(dst) in LAYERS and _layer(src) != _layer(dst)
        and LAYERS[_layer(dst)] >= LAYERS[_layer(src)]
    )
    assert not upward, "imports that do not point down the layers:\n" + "\n".join(upward)


def test_no_package_level_circles():
    edges: dict[str, set[str]] = defaultdict(set)
    for src, dsts in _graph().items():
        edges[_layer(src)].update(_layer(d) for d in dsts if _layer(d) != _layer(src))
    cycle = _find_cycle(edges)
    assert cycle is None, "packages import each other in a circle: " + " -> ".join(cycle or [])


def test_no_module_level_circles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle or [])


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph `edges` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None
