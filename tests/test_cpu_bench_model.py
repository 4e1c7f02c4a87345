"""``python -m jaxtdist.bench model`` without GPUs: the kernel-name breakdown, the
fastest-contender ratio, which attention cases cuDNN takes, the dense experts of the
MoE twin, the flags process's command and merge, and one tiny run (faked timing)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtdist.bench import breakdown as bd
from jaxtdist.bench import xla_flags

# CUPTI names as they appear on H100/H200 (cuDNN, cuBLAS, NCCL, XLA fusions) and
# jaxtdist's own Triton kernels.
KERNELS = {
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention fwd",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7": "attention bwd",
    "ag_attention_kernel": "attention fwd",
    "attention_ws_kernel": "attention fwd",
    "attention_bwd_dq_kernel": "attention bwd",
    "attention_bwd_dkdv_kernel": "attention bwd",
    "flash_decode_kernel": "attention fwd",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "GEMM",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "GEMM",
    "gemm_fusion_dot_123": "GEMM",
    "cutlass3x_sm90_tensorop_gemm_bf16": "GEMM",
    "grouped_gemm_kernel": "GEMM",
    "grouped_dw_kernel": "GEMM",
    "ag_matmul_tma_kernel": "GEMM + comm (fused)",
    "matmul_rs_kernel": "GEMM + comm (fused)",
    "matmul_ar_kernel": "GEMM + comm (fused)",
    "ag_grouped_gemm_kernel": "GEMM + comm (fused)",
    "grouped_gemm_rs_kernel": "GEMM + comm (fused)",
    "ncclDevKernel_AllGather_RING_LL": "comm",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "comm",
    "all_gather_kernel": "comm",
    "reduce_scatter_kernel": "comm",
    "all_reduce_two_shot_kernel": "comm",
    "moe_dispatch_kernel": "comm",
    "moe_combine_kernel": "comm",
    "copy_gathered_kernel": "comm",
    "loop_multiply_fusion_2": "other",
    "input_reduce_fusion_7": "other",
    "jaxtdist_write_ctx": "other",
}


def test_classify_kernel_sorts_every_known_name():
    got = {name: bd.classify_kernel(name) for name in KERNELS}
    assert got == KERNELS
    assert set(KERNELS.values()) == set(bd.CATEGORIES)


def test_breakdown_sums_per_category_and_shares_in_the_cell():
    times = {"nvjet_tst_128x256": 60.0, "ncclDevKernel_AllGather_RING_LL": 20.0,
             "ag_attention_kernel": 15.0, "loop_add_fusion": 5.0}
    parts = bd.breakdown(times)
    assert list(parts) == list(bd.CATEGORIES)
    assert parts["GEMM"] == 60.0 and parts["comm"] == 20.0 and parts["attention bwd"] == 0.0
    assert sum(parts.values()) == pytest.approx(100.0)
    assert bd.breakdown_cell(dict(kernel_us=times)) == \
        "GEMM 60%, comm 20%, attention fwd 15%, other 5%"
    assert bd.breakdown_cell(dict(mean_us=1.0)) == "n/a"  # no kernel records (faked timing)
    assert bd.breakdown_cell(None) == "n/a"


def test_ratio_is_over_the_fastest_contender():
    from jaxtdist.bench import model

    row = dict(step="train", label="1 x 64 tokens", world=2, tp=2,
               xla=dict(mean_us=900.0), **{"xla+cudnn": dict(mean_us=400.0),
                                            "xla+cudnn+flags": dict(error=["OOM"]),
                                            "jaxtdist": dict(mean_us=500.0)})
    assert model.fastest_contender(row) == ("xla+cudnn", dict(mean_us=400.0))
    assert model._ratio(row) == "1.25"  # 500 / 400, not 500 / 900 (the unfused twin)
    row["xla+cudnn+flags"] = dict(mean_us=250.0)
    assert model._ratio(row) == "2.00"
    assert model.fastest_contender(dict(jaxtdist=dict(mean_us=1.0))) == (None, None)
    assert model._ratio(dict(jaxtdist=dict(mean_us=1.0), xla=dict(skipped="x"))) == "n/a"


def test_moe_contenders_keep_their_faster_expert_form():
    """Each XLA contender of a MoE preset is timed with ragged_dot and with dense
    slots; its row entry is the faster, named, and its output diff is that form's."""
    from jaxtdist.bench import model

    a = model.SIZES["tiny-moe"]
    variants = model._variants(a, ("xla", "xla+cudnn", "jaxtdist"))
    assert variants == {"xla/ragged_dot": ("xla", "unfused", "ragged_dot"),
                        "xla/dense": ("xla", "unfused", "dense"),
                        "xla+cudnn/ragged_dot": ("xla+cudnn", "cudnn", "ragged_dot"),
                        "xla+cudnn/dense": ("xla+cudnn", "cudnn", "dense"),
                        "jaxtdist": ("jaxtdist", "unfused", "ragged_dot")}
    stats = {"xla/ragged_dot": dict(mean_us=30.0), "xla/dense": dict(mean_us=20.0),
             "xla+cudnn/ragged_dot": dict(mean_us=10.0), "xla+cudnn/dense": dict(error=["x"]),
             "jaxtdist": dict(mean_us=12.0)}
    outs = {"xla/ragged_dot": np.ones(4), "xla/dense": np.full(4, 1.5),
            "xla+cudnn/ragged_dot": np.ones(4), "jaxtdist": np.ones(4)}
    row = {}
    model._collapse(row, variants, stats, dict(memory={}, outputs=outs), tokens=100)
    assert row["xla"]["mean_us"] == 20.0 and row["xla"]["experts"] == "dense"
    assert row["xla+cudnn"]["experts"] == "ragged_dot"
    assert row["xla"]["tokens_per_s"] == pytest.approx(100 / 20e-6)
    assert row["output_rel_diff"] == {"xla": pytest.approx(0.5), "xla+cudnn": 0.0}
    assert set(row["variants"]) == set(variants) - {"jaxtdist"}
    assert model._time("xla")(row) == "20.0 (dense)"
    assert model._ratio(row) == "1.20"


def test_cudnn_takes_16_bit_heads_up_to_its_limit():
    from jaxtdist.nn._cudnn import check_xla_attention, cudnn_refusal

    assert cudnn_refusal(jnp.bfloat16, 128, "cuda", "9.0") is None
    assert cudnn_refusal(jnp.float16, 256, "cuda", "9.0") is None
    assert cudnn_refusal(jnp.bfloat16, 256, "cuda", "8.0") == \
        "head dim 256: cuDNN takes multiples of 8 up to 128 on compute capability 8.0"
    assert "multiples of 8" in cudnn_refusal(jnp.bfloat16, 100, "cuda", "9.0")
    assert "float32" in cudnn_refusal(jnp.float32, 128, "cuda", "9.0")
    assert "packed" in cudnn_refusal(jnp.bfloat16, 128, "cuda", "9.0", packed=True)
    assert cudnn_refusal(jnp.bfloat16, 128, "cpu") == "no cuDNN on cpu"
    assert cudnn_refusal(jnp.bfloat16, 128, "rocm") == "no cuDNN on rocm"
    with pytest.raises(ValueError, match=r"xla_attention='flash'; allowed: 'unfused'"):
        check_xla_attention("ParallelAttention", "flash")


def _dense_reference(x, ids, w, wg, wu, wd, capacity):
    """Per pick in GShard's order (every token's j-th pick before its j+1-th): kept
    while its expert has a slot; float64."""
    t, k = ids.shape
    used = np.zeros(wg.shape[0], int)
    out = np.zeros((t, x.shape[1]))
    for j in range(k):
        for i in range(t):
            e = ids[i, j]
            if not 0 <= e < wg.shape[0] or w[i, j] == 0 or used[e] >= capacity:
                continue
            used[e] += 1
            g = x[i] @ wg[e]
            h = g / (1 + np.exp(-g)) * (x[i] @ wu[e])
            out[i] += w[i, j] * (h @ wd[e])
    return out


@pytest.mark.parametrize("capacity", [None, 2])
def test_dense_experts_match_the_picks_they_keep(capacity):
    from jaxtdist.nn._dense_experts import check_xla_experts, dense_experts

    rng = np.random.default_rng(3)
    t, k, e, d, f = 6, 2, 4, 8, 12
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    ids[1, 1] = -1  # an invalid id: no slot, no output
    w = rng.random((t, k)).astype(np.float32)
    w[2, 0] = 0.0  # a pick the layer's capacity dropped: takes no slot
    wg, wu = (rng.standard_normal((e, d, f)).astype(np.float32) / 3 for _ in range(2))
    wd = rng.standard_normal((e, f, d)).astype(np.float32) / 3
    got = dense_experts(*(jnp.asarray(a) for a in (x, ids, w, wg, wu, wd)), jax.nn.silu,
                        capacity)
    want = _dense_reference(*(a.astype(np.float64) if a.dtype == np.float32 else a
                              for a in (x, ids, w, wg, wu, wd)), capacity or t)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    if capacity:  # some pick was dropped: the capacity mattered
        assert not np.allclose(want, _dense_reference(x, ids, w, wg, wu, wd, t))
    with pytest.raises(ValueError, match="xla_experts='einsum'; allowed: 'ragged_dot'"):
        check_xla_experts("ParallelMoE", "einsum")


def test_flags_process_command_env_and_merge(tmp_path):
    env = xla_flags.flags_env({"XLA_FLAGS": "--xla_dump_to=/tmp/d", "PATH": "/bin"})
    assert env["XLA_FLAGS"].startswith("--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding")
    assert xla_flags.flags_active(env) and not xla_flags.flags_active({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    argv = xla_flags.command("llama3-8b", 4, 4, 20, 2, "-")
    assert argv[:4] == [sys.executable, "-m", "jaxtdist.bench", "model"]
    assert argv[argv.index("--contenders") + 1] == "xla+cudnn+flags"
    rows = [dict(step="train", label="a"), dict(step="decode", label="b")]
    seen = {}

    def runner(cmd, env, capture_output, text):
        seen.update(cmd=cmd, env=env)
        out = cmd[cmd.index("--json") + 1]
        theirs = [dict(step="train", label="a", **{"xla+cudnn+flags": dict(mean_us=7.0)},
                       variants={"xla+cudnn+flags": dict(mean_us=7.0)})]
        with open(out, "w") as f:
            json.dump(dict(rows=theirs), f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    theirs = xla_flags.run_flags_process(argv, env, runner=runner)
    assert xla_flags.flags_active(seen["env"]) and seen["cmd"][-1] != "-"
    xla_flags.merge_rows(rows, theirs, ["xla+cudnn+flags"])
    assert rows[0]["xla+cudnn+flags"] == dict(mean_us=7.0)
    assert rows[0]["variants"] == {"xla+cudnn+flags": dict(mean_us=7.0)}
    assert "no b row" in rows[1]["xla+cudnn+flags"]["error"][0]

    def failing(cmd, env, capture_output, text):
        return subprocess.CompletedProcess(cmd, 1, "", "F parse_flags_from_env.cc] Unknown flag")

    xla_flags.merge_rows(rows, xla_flags.run_flags_process(argv, env, runner=failing),
                         ["xla+cudnn+flags"])
    assert "exited 1: F parse_flags_from_env.cc] Unknown flag" in \
        rows[0]["xla+cudnn+flags"]["error"][0]


def test_model_benchmark_runs_every_contender_and_tabulates(faked_timing):
    """``bench model --size tiny`` (CPU, world 2, faked timing, one layer): the XLA twin
    and jaxtdist train and decode from shared parameters and agree; the cuDNN and
    flags contenders are labelled as not run on CPU, not repeated as the unfused one."""
    for name in ("flax", "optax"):
        pytest.importorskip(name, reason=f"the model benchmark needs {name}: "
                            "pip install -e '.[nn]'")
    from jaxtdist.bench import __main__ as cli
    from jaxtdist.bench import model

    rows = model.bench_model("tiny", 1, 2, 2, rounds=1)
    assert [(r["step"], r["label"]) for r in rows] == [("train", "4 x 64 tokens"),
                                                       ("decode", "batch 4, KV 72")]
    # The first training step's loss (bf16 activations, each model's own roundings);
    # the decode logits through bf16 parameters (1.1e-2 to 1.6e-2 on GPUs).
    train, decode = (r["output_rel_diff"]["xla"] for r in rows)
    assert train < 1e-3 and decode < 2e-2, rows
    for row in rows:
        for name in ("xla", "jaxtdist"):
            assert row[name]["mean_us"] == 1.5 and row[name]["memory_bytes"] > 0, row[name]
            assert row[name]["tokens_per_s"] == pytest.approx(row["tokens"] / 1.5e-6)
        assert row["xla+cudnn"] == dict(skipped="cuDNN does not take the case: no cuDNN on cpu")
        assert "skipped" in row["xla+cudnn+flags"]
        assert row["fastest"] == "xla"
    text = model.table(dict(world=2, device="cpu", rows=rows, iterations=1, rounds=1))
    assert "| train | 4 x 64 tokens | 1 x 2 | 1.5 | skipped | skipped | 1.5 | " \
           "XLA unfused attention | 1.00 |" in text
    assert "| decode | batch 4, KV 72 | jaxtdist | 1.5 | 2666667 |" in text
    assert "Not timed: XLA + cuDNN attention: cuDNN does not take the case: no cuDNN on cpu" \
        in text
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in text
    assert "model" in cli.benchmarks()
    with pytest.raises(ValueError, match="--contenders"):
        model.bench_model("tiny", 1, 2, 2, contenders=("pallas",))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_xla_twin_forms_compute_the_same_layers(capacity_factor):
    """The nn options the contenders set: ``ParallelMoE(impl="xla", xla_experts="dense")``
    gives ragged_dot's output (with and without the layer's capacity: the same picks
    dropped), and ``ParallelAttention(xla_attention="cudnn")`` on CPU, where cuDNN
    takes no case, is the unfused attention (float32, world 2)."""
    flax = pytest.importorskip("flax", reason="jaxtdist.nn needs flax: pip install -e '.[nn]'")
    del flax
    from flax import nnx

    from jaxtdist import nn as tdnn
    from tests.conftest import dp_tp_mesh

    mesh = dp_tp_mesh((1, 2))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 8, 16)), jnp.float32)
    moe = {form: tdnn.ParallelMoE(16, 24, num_experts=4, top_k=2, impl="xla", mesh=mesh,
                                  capacity_factor=capacity_factor, xla_experts=form,
                                  rngs=nnx.Rngs(0)) for form in ("ragged_dot", "dense")}
    ys = {form: np.asarray(nnx.jit(lambda m, x: m(x))(layer, x)) for form, layer in moe.items()}
    np.testing.assert_allclose(ys["dense"], ys["ragged_dot"], rtol=1e-5, atol=1e-6)
    if capacity_factor is None:
        attn = {form: tdnn.ParallelAttention(16, 4, num_kv_heads=2, rope_theta=1e4, impl="xla",
                                             mesh=mesh, xla_attention=form, rngs=nnx.Rngs(0))
                for form in ("unfused", "cudnn")}
        outs = {f: np.asarray(nnx.jit(lambda m, x: m(x))(a, x)) for f, a in attn.items()}
        np.testing.assert_array_equal(outs["cudnn"], outs["unfused"])
    with pytest.raises(ValueError, match="xla_experts='einsum'"):
        tdnn.ParallelMoE(16, 24, num_experts=4, top_k=2, impl="xla", mesh=mesh,
                         xla_experts="einsum", rngs=nnx.Rngs(0))
