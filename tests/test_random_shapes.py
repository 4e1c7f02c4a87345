"""The random model-layer problems of ``bench gemm --random N --seed S`` (issue 82):
reproducible per seed, different across seeds, shaped as real tensor-parallel
layers, refusing bad arguments; the benchmark draws them and names the seed."""

from __future__ import annotations

import argparse
import collections

import pytest

from jaxtdist.bench import gemm
from jaxtdist.bench.random_shapes import (MODEL_LAYERS, TENSOR_PARALLEL, AttentionProblem,
                                          attention_problems, gemm_problems)


def test_a_seed_gives_the_same_problems_and_another_seed_others():
    assert gemm_problems(40, seed=3) == gemm_problems(40, seed=3)
    assert gemm_problems(40, seed=3) != gemm_problems(40, seed=4)
    assert gemm_problems(10, seed=3) == gemm_problems(40, seed=3)[:10]


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_problems_are_tensor_parallel_layers_of_the_model_families(seed):
    problems = gemm_problems(300, seed)
    widths = {d for d, *_ in MODEL_LAYERS}
    for op, m, n, k in problems:
        assert op in ("ag_matmul", "matmul_rs", "matmul_ar")
        assert m >= 1 and n >= 1 and k >= 1
        if op == "ag_matmul":      # column parallel: contracts over d_model
            assert k in widths
        else:                      # row parallel: produces d_model, contracts a shard
            assert n in widths
            assert any(k * tp in (h * hd for _, _, h, _, hd in MODEL_LAYERS) or
                       k * tp in (f for _, f, *_ in MODEL_LAYERS) for tp in TENSOR_PARALLEL)
        if op == "matmul_ar":
            assert m <= 256, "decode rows"
    ops = collections.Counter(op for op, *_ in problems)
    assert min(ops.values()) >= 30, ops
    rows = [m for op, m, _, _ in problems if op != "matmul_ar"]
    assert any(m & (m - 1) for m in rows), "odd (non power of 2) lengths are drawn"
    assert min(rows) < 256 and max(rows) >= 8192, "decode and long prefill rows"


@pytest.mark.parametrize("n,seed,match", [(0, 1, "n=0"), (True, 1, "n=True"),
                                          (4, -1, "seed=-1"), (4, 1.5, "seed=1.5")])
@pytest.mark.parametrize("draw", [gemm_problems, attention_problems])
def test_bad_arguments_name_themselves(draw, n, seed, match):
    with pytest.raises(ValueError, match=match):
        draw(n, seed)


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_attention_problems_cover_what_models_have(seed):
    """Head dims 64 to 256, GQA ratios 1 to 16, batch > 1 at short lengths, lengths off
    every tile, causal and not; reproducible per seed."""
    problems = attention_problems(300, seed)
    assert problems == attention_problems(300, seed) != attention_problems(300, seed + 1)
    assert all(isinstance(p, AttentionProblem) for p in problems)
    for b, s, hq, hkv, d, _ in problems:
        assert hq % hkv == 0 and 1 <= hq // hkv <= 16, (hq, hkv)  # Qwen3-235B: 64/4
        assert d in (64, 96, 128, 256) and 128 <= s <= 16384 and b * s <= 32768
    assert {p.head_dim for p in problems} >= {64, 128, 256}
    assert {p.heads // p.kv_heads for p in problems} >= {1, 2, 4, 8}
    assert any(p.seq % 128 for p in problems), "lengths off the tiles"
    assert any(p.batch > 1 and p.seq <= 1024 for p in problems), "short sequences, batch > 1"
    assert 0 < sum(not p.causal for p in problems) < len(problems) // 2


def test_gemm_benchmark_draws_random_problems_and_names_the_seed(monkeypatch, tmp_path):
    # The benchmark points the tuning cache at a fresh file: restored after the test.
    monkeypatch.setenv("JAXTDIST_TUNING_CACHE", str(tmp_path / "tuning.json"))
    timed = []
    monkeypatch.setattr(gemm, "bench_gemm", lambda shapes, *a, **k: timed.extend(shapes) or [])
    args = argparse.Namespace(random=12, seed=5, only=[], iterations=1, rounds=1, sweep=False)
    rows, meta = gemm.run(args)
    assert timed == gemm_problems(12, 5)
    assert meta["random"] == 12 and meta["seed"] == 5
    text = gemm.table(dict(device="cpu", rows=rows, iterations=1, rounds=1, **meta))
    assert "12 random model-layer shapes, seed 5 (`--random 12 --seed 5`)" in text
    timed.clear()
    gemm.run(argparse.Namespace(random=None, seed=0, only=[], iterations=1, rounds=1,
                                sweep=False))
    assert timed == list(gemm.GEMM_SHAPES)
