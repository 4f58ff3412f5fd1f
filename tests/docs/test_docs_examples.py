"""Runnable docs: every fenced block marked `<!-- docs-test: run -->` in README.md and docs/ runs.

Each page's marked blocks run in order in a fresh directory holding a copy of `examples/` (a later
block may use what an earlier one wrote). Consecutive `python` blocks run in one subprocess, each in
a fresh namespace compiled with the page's path and line numbers (a traceback points into the page);
`bash` blocks run with `bash -euo pipefail` and this interpreter's directory (the project's
`.venv/bin`) first on PATH. docs/reference/runnable-docs.md is the convention for writers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- docs-test: run -->"
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
BLOCK_TIMEOUT_S = 180
DRIVER = """
import json, sys
for block in json.load(open(sys.argv[1])):
    code = compile("\\n" * block["line"] + block["source"], block["path"], "exec")
    exec(code, {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class Block:
    """One marked block: its page, the line its code starts on (1-based), language and code."""

    path: str
    line: int
    language: str
    source: str


def marked_blocks(text: str, path: str) -> list[Block]:
    """The blocks of `text` that the line before marks with MARKER; a marker not followed by a
    fenced block of a runnable language is an error (a block must never be skipped silently)."""
    lines, blocks, i = text.splitlines(), [], 0
    pending: int | None = None  # line of a marker waiting for its block
    while i < len(lines):
        stripped = lines[i].strip()
        fence = FENCE.match(stripped)
        if fence:
            ticks, info = fence.group(1), fence.group(2).lower()
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip().startswith(ticks[0] * len(ticks))
                        and lines[j].strip().strip(ticks[0]) == ""), None)  # fmt: skip
            if end is None:
                raise ValueError(f"{path}:{i + 1}: the fenced block is never closed")
            if pending is not None:
                if info not in LANGUAGES:
                    raise ValueError(f"{path}:{pending}: a marked block must be one of {sorted(LANGUAGES)}, "
                                     f"not {info or 'unlabelled'!r}")
                blocks.append(Block(path, i + 2, LANGUAGES[info], "\n".join(lines[i + 1:end]) + "\n"))
                pending = None
            i = end + 1
            continue
        if stripped == MARKER:
            pending = i + 1
        elif stripped and pending is not None:
            raise ValueError(f"{path}:{pending}: {MARKER} must be followed by a fenced code block")
        i += 1
    if pending is not None:
        raise ValueError(f"{path}:{pending}: {MARKER} must be followed by a fenced code block")
    return blocks


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_blocks() -> dict[str, list[Block]]:
    found = {}
    for page in pages():
        rel = str(page.relative_to(ROOT))
        blocks = marked_blocks(page.read_text(), rel)
        if blocks:
            found[rel] = blocks
    return found


PAGES = page_blocks()


def run(cmd: list[str], cwd: Path, what: str) -> None:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}
    try:
        result = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{what} ran longer than {BLOCK_TIMEOUT_S} s") from err
    assert result.returncode == 0, (
        f"{what} failed (exit {result.returncode}):\n--- stdout\n{result.stdout[-4000:]}\n"
        f"--- stderr\n{result.stderr[-4000:]}"
    )


def groups(blocks: list[Block]) -> list[list[Block]]:
    """Consecutive blocks of one language (python ones share a subprocess)."""
    out: list[list[Block]] = []
    for block in blocks:
        if out and out[-1][0].language == block.language == "python":
            out[-1].append(block)
        else:
            out.append([block])
    return out


@pytest.mark.parametrize("page", sorted(PAGES))
def test_marked_blocks_run(page, tmp_path):
    shutil.copytree(
        ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("*.parquet", "__pycache__")
    )
    for n, group in enumerate(groups(PAGES[page])):
        first = group[0]
        where = f"{page}:{first.line} ({first.language})"
        if first.language == "bash":
            run(["bash", "-euo", "pipefail", "-c", first.source], tmp_path, where)
            continue
        spec = tmp_path / f".docs-test-{n}.json"
        spec.write_text(json.dumps([{"path": str(ROOT / b.path), "line": b.line - 1, "source": b.source}
                                    for b in group]))
        run([sys.executable, "-c", DRIVER, str(spec)], tmp_path, where)


def test_the_docs_mark_runnable_blocks_in_both_languages():
    languages = {b.language for blocks in PAGES.values() for b in blocks}
    assert languages == {"python", "bash"}, languages
    assert {"docs/getting-started.md", "docs/training/data-and-rewards.md"} <= set(PAGES)


def test_a_marker_needs_a_runnable_block_and_fenced_examples_are_not_markers():
    text = f"{MARKER}\n```python\nx = 1\n```\n\n````markdown\n{MARKER}\n```python\nnot run\n```\n````\n"
    (block,) = marked_blocks(text, "p.md")
    assert (block.line, block.language, block.source) == (3, "python", "x = 1\n")
    with pytest.raises(ValueError, match="p.md:1: .* must be followed by a fenced code block"):
        marked_blocks(f"{MARKER}\ntext\n```python\nx\n```\n", "p.md")
    with pytest.raises(ValueError, match="must be one of"):
        marked_blocks(f"{MARKER}\n```yaml\na: 1\n```\n", "p.md")
