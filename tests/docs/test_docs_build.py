"""The documentation site builds with `mkdocs build --strict` (warnings are errors), the strict build
really fails on a broken link, a broken anchor and a page missing from the navigation, and the API
reference pages render the public objects' docstrings."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of `config` into `site`, with this interpreter's mkdocs."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    try:
        return subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
             "--site-dir", str(site)],
            cwd=config.parent, capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
    except FileNotFoundError as err:  # pragma: no cover - the interpreter itself is missing
        raise AssertionError(f"cannot run {sys.executable}: {err}") from err


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build(ROOT / "mkdocs.yml", out)
    if "No module named mkdocs" in result.stderr:
        raise AssertionError("mkdocs is not installed: pip install torch==2.13.0 -e '.[docs]' "
                             "(scripts/bootstrap.sh installs the docs extra)")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_site_builds_with_no_warning(site):
    for page in ("index.html", "getting-started/index.html", "benchmarks/index.html", "design/index.html",
                 "reference/config/index.html", "training/data-and-rewards/index.html"):
        assert (site / page).is_file(), page


@pytest.mark.parametrize(
    "page, objects",
    [
        ("engine", ["inflight.engine.LLMEngine", "inflight.engine.LLMEngine.finish_weight_update",
                    "inflight.engine.AsyncEngine", "inflight.engine.SamplingParams",
                    "inflight.engine.RequestOutput"]),
        ("client", ["inflight.client.RemoteClient", "inflight.client.InferenceClient.pause",
                    "inflight.client.InferenceClient.resume", "inflight.client.update_all_or_nothing"]),
        ("rewards", ["inflight.rewards.get_reward", "inflight.rewards.register", "inflight.rewards.score"]),
        ("tasks", ["inflight.tasks.load_problems", "inflight.tasks.DataTask", "inflight.tasks.ToolEnv"]),
        ("environment", ["inflight.tasks.base.Environment", "inflight.tasks.base.Environment.step",
                         "inflight.tasks.base.StepResult", "inflight.tasks.base.Task",
                         "inflight.tasks.base.Problem"]),
    ],
)  # fmt: skip
def test_api_pages_render_the_public_objects(site, page, objects):
    html = (site / "reference" / "api" / page / "index.html").read_text()
    missing = [name for name in objects if f'id="{name}"' not in html]
    assert not missing, f"reference/api/{page}.md does not render {missing} (a docstring missing?)"


def test_strict_build_fails_on_broken_links_anchors_and_pages_left_out(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "inflight").symlink_to(ROOT / "inflight")  # the API pages read the package's source
    index = tmp_path / "docs" / "index.md"
    index.write_text(
        index.read_text() + "\n[gone](no-such-page.md) [bad anchor](benchmarks.md#no-such-heading)\n"
    )
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the navigation\n")
    result = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "no-such-page.md" in out and "no-such-heading" in out and "orphan.md" in out, out


def test_readme_is_a_front_page_with_working_links():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, (
        "README.md is a front page: keep it under 250 lines (details go in docs/)"
    )
    dated = re.findall(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d\b|\bUTC\b", text)
    assert not dated, (
        f"README.md holds dates or times of day {dated}: measurements belong in docs/benchmarks.md"
    )
    for link in re.findall(r"\]\(((?:docs|examples)/[^)#\s]+)", text):
        assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"
    for heading in (
        "## Train on your own data or a SkyRL recipe",
        "## Train your agent",
        "## Serve and evaluate",
    ):
        assert heading in text, heading
