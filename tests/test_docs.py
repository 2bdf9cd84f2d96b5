"""Docs stay true: every `path/file.py:Symbol` anchor in the markdown names real code.

The real check runs ``scripts/check_docs.py`` on this repo; the self-tests run it on a tiny fake
repo so the checker itself is tested (it is standard-library only and imports nothing it checks).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_docs.py"


def check(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60)


# -- the real repo --------------------------------------------------------------------------------
def test_repo_docs_anchors_resolve():
    r = check(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


def test_repo_docs_cover_every_public_symbol():
    r = check(REPO, "--coverage")
    assert r.returncode == 0, r.stdout + r.stderr


# -- facts in the docs that are checked against the code -----------------------------------------
def test_mask_matrices_in_the_docs_match_the_code():
    """The literal attention matrices in docs/concepts/canvases-and-cache.md are what
    ``dense_mask`` computes for the layout they describe."""
    import re

    import torch

    from dgemma.models.masks import dense_mask, single_shot_info

    text = (REPO / "docs" / "concepts" / "canvases-and-cache.md").read_text()
    blocks = re.findall(r"<!-- mask-matrix: (\w+) -->\n```\n(.*?)```", text, re.S)
    assert {mode for mode, _ in blocks} == {"causal", "block"}
    info = single_shot_info(torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool), 2)
    for mode, body in blocks:
        rows = [parts[1:] for parts in map(str.split, body.splitlines()) if len(parts) > 1 and parts[1] in ("0", "1")]
        shown = torch.tensor([[int(x) for x in row] for row in rows])
        assert shown.tolist() == dense_mask(info, info, encoder=mode, window=None)[0].int().tolist(), mode


def test_config_files_in_the_guides_load(tmp_path):
    """Every complete config file shown in a guide (a ``python`` block defining ``get_config``)
    builds a valid Config, so a renamed field or section breaks the guide's test, not its reader."""
    import re

    from dgemma.training.config import Config, load_config

    found = 0
    for md in sorted((REPO / "docs").rglob("*.md")):
        for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", md.read_text(), re.M | re.S)):
            if "def get_config" in code:
                path = tmp_path / f"{md.stem}_{i}.py"
                path.write_text(code)
                assert isinstance(load_config(path), Config), md
                found += 1
    assert found


def test_every_shipped_config_file_loads():
    """Every recipe in ``configs/`` builds a valid Config, and a warm start it names exists in the
    repo or in a run workdir it documents, so a renamed field breaks this test, not a user's run."""
    from dgemma.training.config import Config, load_config

    files = sorted((REPO / "configs").glob("*.py"))
    assert files
    for path in files:
        cfg = load_config(path)
        assert isinstance(cfg, Config), path
        weights = cfg.init.weights
        if weights is not None and weights.startswith("checkpoints/"):
            assert (REPO / weights).is_dir(), f"{path.name}: init.weights={weights} is not in the repo"


# -- self-tests on a fake repo --------------------------------------------------------------------
PKG = '''
"""A fake package module."""
from dataclasses import dataclass
from os.path import join

LIMIT: int = 3
A, B = 1, 2


def helper(x):
    return x


def _private():
    pass


@dataclass
class Box:
    width: int
    height: int = 1

    def area(self):
        return self.width * self.height

    class Inner:
        def deep(self):
            pass


class Cache:
    def __init__(self):
        self.keys = {}
'''


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    (tmp_path / "dgemma").mkdir()
    (tmp_path / "dgemma" / "__init__.py").write_text("from dgemma.core import helper\n")
    (tmp_path / "dgemma" / "core.py").write_text(PKG)
    (tmp_path / "docs").mkdir()
    return tmp_path


def write_doc(root: Path, body: str, name: str = "docs/README.md") -> None:
    (root / name).write_text(textwrap.dedent(body))


def test_valid_function_anchor_passes(fake):
    write_doc(fake, "The helper is `dgemma/core.py:helper`.\n")
    r = check(fake)
    assert r.returncode == 0, r.stdout
    assert r.stdout.strip() == "1 anchors in 1 files OK"


def test_renamed_function_fails_naming_file_and_symbol(fake):
    write_doc(fake, "intro\n\nSee `dgemma/core.py:helper`.\n")
    (fake / "dgemma" / "core.py").write_text(PKG.replace("def helper", "def assist"))
    r = check(fake)
    assert r.returncode == 1
    assert "docs/README.md:3: dgemma/core.py has no symbol 'helper'" in r.stdout


def test_typo_gets_a_suggestion(fake):
    write_doc(fake, "`dgemma/core.py:helpr`\n")
    r = check(fake)
    assert r.returncode == 1 and "did you mean 'helper'?" in r.stdout


def test_missing_file_fails(fake):
    write_doc(fake, "`dgemma/gone.py:helper` and `dgemma/also_gone.py`\n", name="NOTES.md")
    r = check(fake)
    assert r.returncode == 1
    assert "NOTES.md:1: dgemma/gone.py: no such file" in r.stdout
    assert "NOTES.md:1: dgemma/also_gone.py: no such file" in r.stdout


@pytest.mark.parametrize("anchor", [
    "dgemma/core.py:Box.area", "dgemma/core.py:Box.width", "dgemma/core.py:Box.height",
    "dgemma/core.py:Box.Inner.deep", "dgemma/core.py:Cache.keys", "dgemma/core.py:LIMIT",
    "dgemma/core.py:B", "dgemma/core.py:helper()", "dgemma/core.py", "dgemma/core.py::Box::area",
])
def test_members_and_definitions_resolve(fake, anchor):
    write_doc(fake, f"- `{anchor}`\n")
    r = check(fake)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("anchor, message", [
    ("dgemma/core.py:Box.volume", "dgemma/core.py:Box has no member 'volume'"),
    ("dgemma/core.py:helper.x", "dgemma/core.py:helper is not a class"),
    ("dgemma/core.py:join", "imported from os.path; cite the defining module"),
    ("dgemma/__init__.py:helper", "imported from dgemma.core"),
    ("dgemma/core.py:Box-area", "malformed anchor"),
])
def test_bad_members_fail(fake, anchor, message):
    write_doc(fake, f"`{anchor}`\n")
    r = check(fake)
    assert r.returncode == 1 and message in r.stdout, r.stdout


@pytest.mark.parametrize("text", [
    "see `dgemma/core.py:12`", "see dgemma/core.py:12-20", "[x](dgemma/core.py#L12)",
    "in `dgemma/core.py`, line 40", "dgemma/core.py (lines 3-9)", "line 40 of dgemma/core.py",
])
def test_line_number_citation_fails(fake, text):
    write_doc(fake, text + "\n")
    r = check(fake)
    assert r.returncode == 1
    assert "docs/README.md:1: line-number citation" in r.stdout and "cite a symbol" in r.stdout


def test_fenced_blocks_prose_and_placeholders_are_not_anchors(fake):
    write_doc(fake, """\
        Cite code as `path/file.py:Symbol`; each `__init__.py` re-exports.

        ```
        File "dgemma/core.py", line 40, in helper
        `dgemma/gone.py:nothing`
        ```
        """)
    r = check(fake)
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith("0 anchors")


def test_coverage_reports_uncited_public_symbol_then_passes(fake):
    write_doc(fake, "`dgemma/core.py:Box.area` and `dgemma/core.py:Cache`\n")
    assert check(fake).returncode == 0  # without --coverage nothing is required
    r = check(fake, "--coverage")
    assert r.returncode == 1
    assert "dgemma/core.py:helper: public symbol cited by no doc anchor" in r.stdout
    assert "_private" not in r.stdout and "LIMIT" not in r.stdout
    assert "dgemma/__init__.py" not in r.stdout  # re-exports count at the defining module
    write_doc(fake, "`dgemma/core.py:Box.area`, `dgemma/core.py:Cache`, `dgemma/core.py:helper`\n")
    r = check(fake, "--coverage")
    assert r.returncode == 0, r.stdout
    assert "3 public symbols cited" in r.stdout


def test_coverage_respects_dunder_all(fake):
    (fake / "dgemma" / "core.py").write_text('__all__ = ["helper"]\n' + PKG)
    write_doc(fake, "`dgemma/core.py:helper`\n")
    r = check(fake, "--coverage")
    assert r.returncode == 0, r.stdout
