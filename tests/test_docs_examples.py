"""The runnable examples the docs point users to still run and still print what
the docs say: the sharded decode loop of docs/attention.md and
examples/moe_train.py, each in a fresh process with the host device count it
sets itself (the suite's own process already holds 8 devices)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import cpu_only, timeout

ROOT = Path(__file__).resolve().parents[1]


def _run(source: str, tmp_path: Path) -> str:
    script = tmp_path / "example.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _program_blocks(markdown: str) -> list[str]:
    """The python blocks of a docs page that are whole programs (they set the host
    device count themselves), not snippets."""
    return [b for b in re.findall(r"```python\n(.*?)```", markdown, re.S)
            if 'os.environ.setdefault("XLA_FLAGS"' in b]


@cpu_only()
@timeout(600)
def test_the_attention_page_decode_loop_matches_plain_attention(tmp_path):
    blocks = _program_blocks((ROOT / "docs" / "attention.md").read_text())
    assert len(blocks) == 1, "docs/attention.md: one runnable decode loop expected"
    out = _run(blocks[0], tmp_path).strip().splitlines()[-1]
    # It prints the output's shape and its relative error against plain JAX.
    shape, err = re.fullmatch(r"(\(.*\)) (\S+)", out).groups()
    assert shape == "(2, 8, 64)"
    assert float(err) < 1e-5, out


@cpu_only()
@timeout(600)
def test_moe_train_example_loss_falls(tmp_path):
    out = _run((ROOT / "examples" / "moe_train.py").read_text(), tmp_path)
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 10, out
    assert losses[-1] < 0.95 * losses[0], losses
