"""The path choice (issue 82): fused kernels or the decomposed form, per shape, dtype
and world size; its overrides (``config={"PATH": ...}``), ``jaxtdist.explain``, the
debug log line, ag_attention's world-1 cuDNN rule; and the decomposed form's
numbers against the kernels and a float64 reference at world 2.

The decisions need no kernels and no devices: they are asked for GPU situations
by ``explain`` (``platform="gpu"``) on shapes alone.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops._gemm_paths import AG_MATMUL_MIN_BYTES, MATMUL_RS_MIN_BYTES
from jaxtdist.ops._path import DECOMPOSED, FUSED
from jaxtdist.ops.ag_attention import cudnn_refuses
from tests.conftest import cpu_only, f64, place, rand, rel_err, setup

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
HOPPER = dict(platform="gpu", compute_capability="9.0")


def _gpu(op, *shapes, world, dtype=BF16, **kwargs):
    return td.explain(op, *shapes, axis_size=world, dtype=dtype, **HOPPER, **kwargs)


# -- the GEMM ops' rules ------------------------------------------------------------

# (op, x, w, dtype, world, path): both sides of each threshold, the dtype counted.
# ag_matmul: x's bytes per rank (m_shard * k); matmul_rs: the product's (M * N).
GEMM_CASES = [
    ("ag_matmul", (16, 4096), (4096, 1024), BF16, 4, FUSED),        # 128 KiB: from here
    ("ag_matmul", (15, 4096), (4096, 1024), BF16, 4, DECOMPOSED),   # 120 KiB
    ("ag_matmul", (8, 4096), (4096, 1024), F32, 2, FUSED),          # 128 KiB in float32
    ("ag_matmul", (8, 4096), (4096, 1024), BF16, 2, DECOMPOSED),    # 64 KiB
    ("ag_matmul", (1024, 4096), (4096, 4096), BF16, 4, FUSED),      # docs/perf's smallest
    ("matmul_rs", (128, 1024), (1024, 4096), BF16, 4, FUSED),       # 1 MiB: from here
    ("matmul_rs", (127, 1024), (1024, 4096), BF16, 4, DECOMPOSED),
    ("matmul_rs", (8192, 3072), (3072, 4096), BF16, 4, FUSED),      # docs/perf's smallest
    ("matmul_ar", (1, 2048), (2048, 8192), BF16, 4, FUSED),         # at every size
    ("matmul_ar", (512, 2048), (2048, 8192), BF16, 2, FUSED),
]


@pytest.mark.parametrize("op,x,w,dtype,world,path", GEMM_CASES)
def test_gemm_rule(op, x, w, dtype, world, path):
    choice = _gpu(op, x, w, world=world, dtype=dtype)
    assert choice.path == path, str(choice)
    nbytes = (x[0] * x[1] if op == "ag_matmul" else x[0] * w[1]) * jnp.dtype(dtype).itemsize
    assert choice.inputs["collective_bytes"] == nbytes
    assert choice.inputs["world"] == world
    flops = 2 * x[0] * w[1] * x[1] * (world if op == "ag_matmul" else 1)
    assert choice.inputs["flops_per_rank"] == flops


def test_gemm_thresholds():
    """The thresholds the docstring of ``_gemm_paths`` derives (128 KiB, 1 MiB)."""
    assert AG_MATMUL_MIN_BYTES == 128 << 10
    assert MATMUL_RS_MIN_BYTES == 1 << 20


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_gemm_world_1_is_the_dot(op, platform):
    choice = td.explain(op, (4096, 4096), (4096, 4096), axis_size=1, platform=platform)
    assert (choice.path, choice.runs) == (DECOMPOSED, "jnp.dot")
    assert "one rank" in choice.reason


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_interpreter_keeps_the_kernels(op):
    choice = td.explain(op, (1, 16), (16, 16), axis_size=2, platform="cpu")
    assert choice.path == FUSED
    assert "interpreter" in choice.reason


# -- overrides ------------------------------------------------------------------------

def test_config_forces_either_path():
    small, large = ((8, 4096), (4096, 1024)), ((1024, 4096), (4096, 4096))
    assert _gpu(td.ag_matmul, *small, world=4).path == DECOMPOSED
    forced = _gpu(td.ag_matmul, *small, world=4, config={"PATH": "fused"})
    assert forced.path == FUSED and forced.reason == "config PATH='fused'"
    forced = _gpu(td.ag_matmul, *large, world=4, config={"PATH": "decomposed"})
    assert (forced.path, forced.runs) == (DECOMPOSED, "jax.lax.all_gather + jnp.dot")
    assert _gpu(td.matmul_ar, (1, 64), (64, 64), world=2,
                config={"PATH": "decomposed"}).runs == "jnp.dot + jax.lax.psum"
    # World 1: "fused" runs the kernels instead of jnp.dot.
    assert _gpu(td.matmul_rs, *large, world=1, config={"PATH": "fused"}).path == FUSED
    # "auto" is the rule's choice.
    assert _gpu(td.ag_matmul, *small, world=4, config={"PATH": "auto"}).path == DECOMPOSED


def test_environment_sets_the_default(monkeypatch):
    """JAXTDIST_PATH: the path of calls whose config asks none."""
    small = ((8, 4096), (4096, 1024))
    monkeypatch.setenv("JAXTDIST_PATH", "fused")
    choice = _gpu(td.ag_matmul, *small, world=4)
    assert choice.path == FUSED and choice.reason == "JAXTDIST_PATH='fused'"
    # A call's config still decides.
    assert _gpu(td.ag_matmul, *small, world=4, config={"PATH": "auto"}).path == DECOMPOSED
    monkeypatch.setenv("JAXTDIST_PATH", "decomposed")
    large = ((1024, 4096), (4096, 4096))
    assert _gpu(td.matmul_rs, *large, world=2).path == DECOMPOSED
    # Where an op has no decomposed form, its rule decides.
    q = (1, 128, 8, 128)
    assert _gpu(td.ag_attention, q, q, q, world=2).path == FUSED
    monkeypatch.setenv("JAXTDIST_PATH", "xla")
    with pytest.raises(ValueError, match="the environment variable JAXTDIST_PATH is 'xla'; "
                                         "allowed: 'auto'"):
        _gpu(td.ag_matmul, *small, world=4)


def test_kernel_keys_run_the_kernels():
    """Keys of the kernel config at world > 1 configure the kernels: they run."""
    choice = _gpu(td.ag_matmul, (8, 4096), (4096, 1024), world=4, config={"BLOCK_N": 64})
    assert choice.path == FUSED and "BLOCK_N" in choice.reason
    assert choice.config.BLOCK_N == 64


def test_bad_path_is_refused():
    with pytest.raises(ValueError, match=r"config PATH is 'cublas'; allowed: 'auto', 'fused', "
                                         r"'decomposed'"):
        _gpu(td.ag_matmul, (8, 64), (64, 64), world=2, config={"PATH": "cublas"})
    # ag_attention has no decomposed form at world > 1.
    q = (1, 128, 8, 128)
    with pytest.raises(ValueError, match="has no decomposed form at world 2; allowed here"):
        _gpu(td.ag_attention, q, q, q, world=2, config={"PATH": "decomposed"})
    with pytest.raises(ValueError, match="not a jaxtdist op"):
        td.explain("matmul", (8, 64), (64, 64))
    with pytest.raises(ValueError, match="axis_size"):
        td.explain(td.ag_matmul, (8, 64), (64, 64), axis_size=0)


# -- explain ---------------------------------------------------------------------------

def test_explain_says_why():
    text = str(_gpu(td.ag_matmul, (8, 4096), (4096, 1024), world=4))
    assert text.startswith("jaxtdist.ag_matmul: decomposed path (jax.lax.all_gather + "
                           "jnp.dot): all_gather moves 64 KiB per rank < 128 KiB")
    choice = _gpu(td.matmul_rs, (4096, 1024), (1024, 4096), world=4)
    assert choice.config is not None and type(choice.config).__name__ == "MatmulRsConfig"
    assert "config: MatmulRsConfig(" in str(choice)
    assert ">= 1.0 MiB" in choice.reason
    # Avals and arrays are operands too.
    aval = jax.ShapeDtypeStruct((16, 4096), BF16)
    assert td.explain(td.ag_matmul, aval, jnp.zeros((4096, 8), BF16), axis_size=4,
                      **HOPPER).path == FUSED


# -- ag_attention at world 1 -------------------------------------------------------

# (compute capability, dtype, head dim, "" where cuDNN takes it, else a word of why not)
CUDNN_TABLE = [
    ("9.0", BF16, 128, ""), ("9.0", F16, 64, ""), ("9.0", BF16, 96, ""),
    ("9.0", BF16, 256, ""), ("9.0", BF16, 8, ""),
    ("9.0", F32, 128, "float32"), ("9.0", BF16, 100, "head dim 100"),
    ("9.0", BF16, 264, "head dim 264"),
    ("8.0", BF16, 128, ""), ("8.6", F16, 128, ""), ("8.0", BF16, 256, "up to 128"),
    ("10.0", BF16, 128, "compute capability 10.0"), ("7.0", BF16, 64, "7.0"),
]


@pytest.mark.parametrize("capability,dtype,head_dim,why", CUDNN_TABLE)
def test_cudnn_rule(capability, dtype, head_dim, why):
    got = cudnn_refuses("gpu", capability, dtype, head_dim)
    assert (why in got and got) if why else got == "", got
    q, kv = (2, 512, 32, head_dim), (2, 512, 8, head_dim)  # GQA 32/8
    choice = td.explain(td.ag_attention, q, kv, kv, axis_size=1, dtype=dtype,
                        platform="gpu", compute_capability=capability)
    assert choice.path == (FUSED if why else DECOMPOSED), str(choice)
    if not why:
        assert "cuDNN" in choice.runs and choice.config is None
    else:
        assert "cuDNN does not take the case" in choice.reason and choice.config is not None


def test_cudnn_needs_jax_0_10_2():
    assert "36008" in cudnn_refuses("gpu", "9.0", BF16, 128, jax_version=(0, 10, 1))
    assert cudnn_refuses("gpu", "9.0", BF16, 128, jax_version=(0, 11, 2)) == ""


def test_attention_paths_elsewhere():
    q = (1, 256, 8, 128)
    assert "interpreter" in cudnn_refuses("cpu", "", BF16, 128)
    on_cpu = td.explain(td.ag_attention, q, q, q, axis_size=1, platform="cpu")
    assert on_cpu.path == DECOMPOSED and "interpreter" in on_cpu.reason
    # World > 1: the kernels (the decomposed form is not declared there).
    assert _gpu(td.ag_attention, q, q, q, world=2).path == FUSED
    # Forced: the kernels where cuDNN would run, not causal either.
    assert _gpu(td.ag_attention, q, q, q, world=1, causal=False,
                config={"PATH": "fused"}).path == FUSED
    assert _gpu(td.ag_attention, q, q, q, world=1, causal=False).inputs["causal"] is False


# -- the log line and the numbers (world 2, CPU) ------------------------------------

SPECS = {"ag_matmul": ((P("tp", None), P(None, "tp")), P(None, "tp")),
         "matmul_rs": ((P(None, "tp"), P("tp", None)), P("tp", None)),
         "matmul_ar": ((P(None, "tp"), P("tp", None)), P())}


def _fn(mesh, op, path):
    in_specs, out_specs = SPECS[op]
    config = None if path is None else {"PATH": path}
    return jax.shard_map(lambda x, w: getattr(td, op)(x, w, "tp", config=config), mesh=mesh,
                         in_specs=in_specs, out_specs=out_specs)


@cpu_only()
def test_log_line(caplog):
    mesh = setup(2)
    x, w = rand((8, 16)), rand((16, 8))
    with caplog.at_level(logging.DEBUG, logger="jaxtdist"):
        jax.jit(_fn(mesh, "matmul_ar", "decomposed")).lower(x, w)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxtdist"]
    assert any(line.startswith("jaxtdist.matmul_ar: decomposed path (jnp.dot + jax.lax.psum):"
                               " config PATH='decomposed'") for line in lines), lines


@cpu_only()
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
def test_decomposed_matches_kernels(op):
    """Forward and gradients at world 2: the decomposed form (forced), the kernels
    (the interpreter's choice) and float64 agree to float32 rounding."""
    mesh = setup(2)
    x, w = rand((8, 16)), rand((16, 12))
    (x_spec, w_spec), _ = SPECS[op]
    ref = f64(x) @ f64(w)  # every op's global result is the whole product
    g = rand(ref.shape)
    results = {}
    for path in (None, "decomposed"):
        f = _fn(mesh, op, path)

        def loss(x, w, f=f):
            return jnp.sum(f(x, w) * g)

        args = place(mesh, x, x_spec), place(mesh, w, w_spec)
        out = jax.jit(f)(*args)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
        results[path] = (out, *grads)
    # float64 references: out = x @ w; d/dx sum(out * g) = g @ w.T, d/dw = x.T @ g.
    refs = (ref, f64(g) @ f64(w).T, f64(x).T @ f64(g))
    for name, fused, decomposed, r in zip(("out", "dx", "dw"), results[None],
                                          results["decomposed"], refs):
        assert rel_err(fused, r) < 1e-5, (op, name, "fused")
        assert rel_err(decomposed, r) < 1e-5, (op, name, "decomposed")
        assert rel_err(decomposed, np.asarray(fused, np.float64)) < 1e-5, (op, name)


def test_shared_gpu_launch_keeps_the_kernels(monkeypatch):
    """``jaxtdist.launch --share-gpu`` puts every rank on one GPU, where XLA's
    collectives fail: its ranks keep the kernels (unless the caller set otherwise)."""
    from jaxtdist.launch._supervisor import LaunchOptions, child_env

    monkeypatch.delenv("JAXTDIST_PATH", raising=False)
    shared = child_env(0, LaunchOptions(nproc=2, command=["true"], share_gpu=True), "h:1")
    assert shared["JAXTDIST_PATH"] == "fused"
    assert "JAXTDIST_PATH" not in child_env(0, LaunchOptions(nproc=1, command=["true"]), "h:1")
