"""What the front page and the getting-started pages state, held to the code that decides it: the
extras installed, the model architectures the engine loads, the command's subcommands, what
`inflight train` with no `--config` runs, the checkpoints the GSM8K recipe writes, and the README's
recipe commands themselves (each `inflight train --config` line validates as written)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import datasets
import pytest
import yaml

from inflight.cli import build_parser
from inflight.config import load_config
from inflight.engine.models import ARCHITECTURES
from inflight.train.main import build_parser as train_parser
from inflight.train.main import resolve_config
from inflight.train.policy import run_training_steps

ROOT = Path(__file__).resolve().parents[2]
FRONT_PAGES = ("README.md", "docs/getting-started.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def bash_blocks(path: str) -> list[str]:
    """The page's bash blocks, continuation lines joined."""
    text = (ROOT / path).read_text()
    return [body.replace("\\\n", " ") for lang, body in FENCE.findall(text) if lang in ("bash", "sh")]


def words(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def test_every_extra_is_installed_and_listed_alike():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    bootstrap = re.findall(r"-e \"\.\[([\w,]+)\]\"", (ROOT / "scripts/bootstrap.sh").read_text())
    assert [set(b.split(",")) for b in bootstrap] == [extras], "scripts/bootstrap.sh installs every extra"
    for page in FRONT_PAGES:
        listed = re.findall(r"pip install -e \.\[([\w,]+)\]", (ROOT / page).read_text())
        assert listed and all(set(x.split(",")) == extras for x in listed), (
            f"{page}: {listed} vs {sorted(extras)}"
        )


def test_the_model_lists_name_what_the_engine_loads():
    def key(name: str) -> str:  # Qwen2.5-VL and Qwen2_5_VLForConditionalGeneration alike: qwen25vl
        return re.sub(
            r"[-._]", "", name.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration")
        ).lower()

    engine = {key(name) for name in ARCHITECTURES}
    for page in (*FRONT_PAGES, "docs/training/data-and-rewards.md"):
        text = " ".join((ROOT / page).read_text().split())
        lists = re.findall(
            r"any local Hugging Face ((?:[\w.-]+, )+[\w.-]+ or [\w.-]+) (?:directory|checkpoint)", text
        )
        assert lists, f"{page} names no model list"
        for found in lists:
            names = {key(n) for n in re.split(r", | or ", found)}
            assert names == engine, f"{page}: {found!r} vs the engine's {sorted(ARCHITECTURES)}"


def test_the_subcommand_lists_are_the_commands():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for page in FRONT_PAGES:
        lists = re.findall(r"`((?:inflight )?train(?: \| \w+)+)`", (ROOT / page).read_text())
        assert lists, f"{page} lists no subcommands"
        for found in lists:
            assert set(found.removeprefix("inflight ").split(" | ")) == set(sub.choices), f"{page}: {found}"


def test_no_config_means_skyrls_defaults_in_the_help_and_the_docs():
    cfg, _ = resolve_config(None, [])
    # SkyRL's, not the demo's
    assert cfg.data.train_data == [str(Path("~/data/gsm8k/train.parquet").expanduser())]
    assert cfg.trainer.policy.model.path is None and cfg.trainer.train_batch_size == 1024
    help_text = next(a.help for a in train_parser()._actions if a.dest == "config")
    assert "SkyRL's defaults" in help_text
    configs = " ".join((ROOT / "docs/training/configs.md").read_text().split())
    assert "With no `--config` every key takes SkyRL's default" in configs
    assert "runs the built-in demo job" not in configs
    run = subprocess.run(
        [sys.executable, "-m", "inflight.cli", "train", "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert (
        run.returncode == 2 and "trainer.policy.model.path" in run.stderr and "data.train_data" in run.stderr
    )


def stated_defaults() -> list[tuple[str, str, str]]:
    """(page, key, value) for every "`trainer.key` (..., default V" a page states."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = re.compile(r"`((?:trainer|generator|data|environment)\.[\w.]+)` \((?:[^)]*?, )?default ([^;,)]+)")
    return [
        (str(p.relative_to(ROOT)), key, value.strip())
        for p in pages
        for key, value in found.findall(p.read_text())
    ]


def test_the_defaults_the_docs_state_are_the_schemas():
    """precision-and-memory.md said shared_prefix_forward defaults to false after the default became true."""
    stated = stated_defaults()
    assert any(key == "trainer.shared_prefix_forward" for _, key, _ in stated)
    cfg = load_config(None, [])
    for page, key, value in stated:
        actual = cfg
        for part in key.split("."):
            actual = getattr(actual, part)
        said = yaml.safe_load(value.strip("`"))
        if isinstance(said, str):
            said = str(Path(said).expanduser()) + ("/" if said.endswith("/") else "")
        assert said == actual, f"{page} says {key} defaults to {value}; the schema's default is {actual!r}"


def gsm8k_recipes() -> list[tuple[str, str]]:
    """(page, bash block) of every block that trains the GSM8K recipe and names one of its checkpoints,
    and the README's (whose prose names the last one)."""
    pages = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")))]
    return [
        (page, block)
        for page in pages
        for block in bash_blocks(page)
        if "--config examples/gsm8k/config.yaml" in block and ("global_step_" in block or page == "README.md")
    ]


@pytest.mark.parametrize("page, block", gsm8k_recipes())
def test_the_gsm8k_checkpoints_named_are_ones_the_run_writes(tmp_path, page, block):
    """Issue 40: the recipe evaluated global_step_200, which its 125-step run never writes."""
    lines = block.splitlines()
    make = next(words(x) for x in lines if "examples/gsm8k/make_data.py" in x)  # the block writes its data
    args = make[next(i for i, w in enumerate(make) if w.endswith("make_data.py")) + 1:]
    subprocess.run(
        [sys.executable, str(ROOT / "examples/gsm8k/make_data.py"), *args, "--output-dir", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    rows = len(datasets.Dataset.from_parquet(str(tmp_path / "train.parquet")))
    train = next(words(x) for x in lines if "inflight train --config examples/gsm8k/config.yaml" in x)
    cfg, _ = resolve_config(str(ROOT / "examples/gsm8k/config.yaml"), [w for w in train if "=" in w])
    steps, every = run_training_steps(cfg, rows), cfg.trainer.ckpt_interval
    written = {k for k in range(every, steps + 1, every)} | {steps}
    named = {int(n) for n in re.findall(r"global_step_(\d+)", block)}
    # its prose and the config's comments name the last checkpoint of the recipe as written
    if page == "README.md":
        for text in (ROOT / page).read_text(), (ROOT / "examples/gsm8k/config.yaml").read_text():
            named |= {int(n) for n in re.findall(r"global_step_(\d+)", text)}
        assert named, "README.md names the checkpoint the GSM8K recipe ends with"
    assert named <= written, (
        f"{page}: names global_step_{sorted(named - written)}; the run writes {sorted(written)}"
    )


def readme_train_commands() -> list[str]:
    return [line for block in bash_blocks("README.md") for line in block.splitlines()
            if re.match(r"\s*\.venv/bin/inflight train --config ", line)]


@pytest.mark.parametrize("line", readme_train_commands())
def test_the_readme_recipe_commands_validate_as_written(tmp_path, line):
    """Each README `inflight train --config` line, its model path given a tiny model of the same family and
    its data written by the recipe's own script, passes --print-config (what a run checks first)."""
    from inflight.testing import make_tiny_model

    command = words(line)
    config = command[command.index("--config") + 1]
    model = make_tiny_model(tmp_path / "model", arch="llama" if "smollm2" in config else "qwen2")
    overrides = [f"trainer.policy.model.path={model}" if w.startswith("trainer.policy.model.path=") else w
                 for w in command[command.index(config) + 1:]]
    recipe = Path(config).parent
    if (ROOT / recipe / "make_data.py").is_file() and recipe != Path("examples"):
        subprocess.run([sys.executable, str(ROOT / recipe / "make_data.py"), "--output-dir",
                        str(tmp_path / recipe / "data")], check=True, capture_output=True, timeout=300)
    (tmp_path / "examples").mkdir(exist_ok=True)
    for source in (ROOT / "examples").rglob("*.yaml"):
        target = tmp_path / source.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text())
    run = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "--print-config", "--config", config,
                          *overrides], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, f"{line}\n{run.stderr[-3000:]}"
