"""Generated reference pages stay current, and the CLI reference names only real flags.

``scripts/gen_api_reference.py --check`` fails when ``docs/reference/api.md`` or
``docs/reference/config.md`` differ from what the source generates: add, rename or remove a
public function or a config field without regenerating and CI turns red. The self-tests run the
generator on a tiny fake repo. The CLI checks run each verb's ``--help``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gen_api_reference.py"


def gen(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the real repo --------------------------------------------------------------------------------
def test_generated_pages_are_current():
    r = gen(REPO, "--check")
    assert r.returncode == 0, r.stdout + r.stderr + "\nrun `python scripts/gen_api_reference.py` and commit the result"


def test_api_page_lists_exactly_what_coverage_requires():
    """The generator and scripts/check_docs.py --coverage agree on what "public" means."""
    check_docs = load_script("check_docs")
    required = set(check_docs.Checker(REPO).public_symbols("dgemma"))
    listed = set(re.findall(r"^- `([\w/.]+\.py):(\w+)`", (REPO / "docs/reference/api.md").read_text(), re.M))
    assert listed == required


# -- self-tests on a fake repo --------------------------------------------------------------------
CONFIG = '''
from dataclasses import dataclass, field
from typing import Literal
from dgemma.models.transformer import ModelConfig


@dataclass(kw_only=True)
class TrainConfig:
    """How long to train."""

    steps: int = 2_000  # optimiser steps
    mode: Literal["a", "b"] = "a"
    sizes: list[int] = field(default_factory=lambda: [1, 2])


@dataclass(kw_only=True)
class Config:
    workdir: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
'''
MODEL = '''
from dataclasses import dataclass


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture."""

    hidden_size: int = 64  # width


def build(cfg):
    """Build a model. Second sentence."""
'''


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    for rel, text in {"dgemma/__init__.py": '"""Fake."""\n', "dgemma/models/transformer.py": MODEL,
                      "dgemma/training/config.py": CONFIG,
                      "dgemma/core.py": 'def helper():\n    """Help :func:`~dgemma.core.other` out."""\n\n\n'
                                        'def _private():\n    pass\n'}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path


def test_generates_both_pages_then_check_passes(fake):
    assert gen(fake).returncode == 0
    api = (fake / "docs/reference/api.md").read_text()
    assert "- `dgemma/core.py:helper` (function `helper()`): Help `other` out." in api
    assert "- `dgemma/models/transformer.py:build` (function `build(cfg)`): Build a model." in api
    assert "- `dgemma/models/transformer.py:ModelConfig` (class): Architecture." in api
    assert "_private" not in api
    config = (fake / "docs/reference/config.md").read_text()
    assert "| `--cfg.train.steps` | `int` | `2_000` | optimiser steps |" in config
    assert "| `--cfg.train.sizes` | `list[int]` | `[1, 2]` |" in config
    assert '`Literal["a", "b"]`' in config and "| `--cfg.model.hidden_size` | `int` | `64` | width |" in config
    assert "| `--cfg.workdir` | `str \\| None` | `None` |" in config
    r = gen(fake, "--check")
    assert r.returncode == 0 and "up to date" in r.stdout


def test_renamed_function_or_field_makes_check_fail(fake):
    gen(fake)
    core = fake / "dgemma/core.py"
    core.write_text(core.read_text().replace("def helper", "def assist"))
    r = gen(fake, "--check")
    assert r.returncode == 1 and "docs/reference/api.md" in r.stderr and "assist" in r.stdout
    gen(fake)
    cfg = fake / "dgemma/training/config.py"
    cfg.write_text(cfg.read_text().replace("steps: int", "num_steps: int"))
    r = gen(fake, "--check")
    assert r.returncode == 1 and "docs/reference/config.md" in r.stderr


def test_check_writes_nothing(fake):
    r = gen(fake, "--check")
    assert r.returncode == 1 and not (fake / "docs").exists()


# -- the CLI reference ------------------------------------------------------------------------------
CLI_PAGE = REPO / "docs" / "reference" / "cli.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def cli_sections() -> dict[str, str]:
    """``"prepare sudoku"`` -> the text of the section headed ``dgemma prepare sudoku``."""
    out, name, lines = {}, None, []
    for line in CLI_PAGE.read_text().splitlines():
        m = re.match(r"^#{2,3} `dgemma ([\w -]+)`\s*$", line)
        if m or line.startswith("## "):
            if name:
                out[name] = "\n".join(lines)
            name, lines = (m[1] if m else None), []
        elif name:
            lines.append(line)
    if name:
        out[name] = "\n".join(lines)
    return out


def help_text(*words: str) -> str:
    r = subprocess.run([sys.executable, "-m", "dgemma", *words, "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"dgemma {' '.join(words)} --help failed: {r.stderr}"
    return r.stdout


def choices(help_out: str) -> set[str]:
    m = re.search(r"\{([\w,-]+)\}", help_out)
    return set(m[1].split(",")) if m else set()


def test_every_verb_is_documented():
    sections = cli_sections()
    verbs = choices(help_text())
    assert verbs, "dgemma --help lists no verbs"
    assert verbs <= set(sections), f"verbs without a section in {CLI_PAGE.name}: {sorted(verbs - set(sections))}"
    targets = choices(help_text("prepare"))
    assert {f"prepare {t}" for t in targets} <= set(sections)


@pytest.mark.parametrize("section", sorted(cli_sections()))
def test_cli_reference_flags_exist(section):
    text = "\n".join(line for line in cli_sections()[section].splitlines() if "torchrun" not in line)
    flags = {f for f in FLAG.findall(text) if not f.startswith("--cfg") and f != "--help"}
    if not flags:
        return  # e.g. `dgemma train`: only --cfg flags, which the config reference covers
    out = help_text(*section.split())
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", out))
    assert not missing, f"docs/reference/cli.md documents {missing} for `dgemma {section}`, not in its --help"
