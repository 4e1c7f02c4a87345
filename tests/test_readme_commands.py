"""The README's two commands are what CI runs, and they install what the tests need.

``.ci/run`` takes its commands from the README's first code block
(``.ci/readme_commands.py``); these checks keep that block in the shape CI
expects, and keep every optional package a test imports in an extra that
command 1 installs (or the test skips naming the extra).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

from readme_commands import first_block_commands  # noqa: E402


def _commands() -> list[str]:
    return first_block_commands((ROOT / "README.md").read_text())


def _extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_the_readme_block_holds_install_then_tests():
    install, tests = _commands()
    assert "pip install" in install and "examples/ag_matmul.py" in install
    assert tests.startswith("python3 -m pytest tests")


def test_ci_runs_the_readme_commands_and_no_install_of_its_own():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_commands.py README.md" in ci
    assert "pip install" not in ci


def test_command_1_installs_every_extra_the_tests_import():
    install, _ = _commands()
    asked = re.search(r'-e "\.\[([a-z,]+)\]"', install)
    assert asked, install
    extras = _extras()
    installed = {re.split(r"[<>=!\[ ]", req)[0].lower().replace("_", "-")
                 for name in asked.group(1).split(",") for req in extras[name]}
    # Optional packages the tests import (importorskip): each must come with command 1.
    imported = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for mod in re.findall(r'importorskip\(\s*"([A-Za-z_.]+)"', path.read_text()):
            imported.add(mod.split(".")[0])
    pip_names = {"orbax": "orbax-checkpoint"}
    # Not optional for jaxtdist: installed with it; matplotlib only draws plots.
    always = {"triton", "jax", "numpy", "matplotlib"}
    missing = {pip_names.get(m, m) for m in imported - always} - installed
    assert not missing, f"tests import {sorted(missing)}, which command 1 does not install"
