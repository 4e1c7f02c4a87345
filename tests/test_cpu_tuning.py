"""Split-K ag_matmul and the tuning cache, under the interpreter (CPU)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
from jaxtdist.ops._config import Problem, resolve
from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
from jaxtdist.tune import _tuner
from tests.conftest import (ag_matmul_fn, assert_close, check_config_errors, cpu_only, f64, place,
                            rand, setup)

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32


def _problem(platform, world, m_shard, n, k, dtype) -> Problem:
    return Problem(platform, world, (m_shard, n, k), jnp.dtype(dtype).name)


def _resolve(rt, problem, asked):
    """A call's config as ag_matmul resolves it (defaults for the overrides asked for)."""
    return resolve(AgMatmulConfig, problem, rt, asked,
                   base=AgMatmulConfig.for_overrides(problem, asked or {}))


# (world, dtype, (m_shard, k, n_shard), config): split K in both kernel modes,
# K not a multiple of BLOCK_K * SPLIT_K (the last split is short or empty).
SPLIT_K_CASES = [
    (2, F32, (3, 100, 20), dict(SPLIT_K=3)),                       # one tile over all rows
    (4, BF16, (2, 64, 12), dict(SPLIT_K=2)),
    (2, F32, (40, 72, 24), dict(SPLIT_K=2)),                       # rank-major tiles
    (4, F32, (17, 96, 40), dict(SPLIT_K=4, BLOCK_K=16)),
    (8, BF16, (5, 40, 8), dict(SPLIT_K=2, ALL_ROWS=False, BLOCK_M=16)),
    # Chunks (signals) finer than row tiles, in both modes.
    (4, F32, (3, 48, 12), dict(CHUNK_ROWS=1, NUM_COMM=3)),
    (2, BF16, (37, 40, 20), dict(CHUNK_ROWS=4, NUM_COMM=5, COPY_BLOCK_C=16)),
    (8, F32, (9, 72, 8), dict(CHUNK_ROWS=2, ALL_ROWS=False, SPLIT_K=2)),
]

# Producers that push into peers' heap inboxes (no staging, no wait): one tile
# over all rows (decode) and rank-major tiles, chunks finer than tiles, split K.
PUSH_CASES = [
    (2, F32, (3, 100, 20), dict(PRODUCER="push")),
    (4, BF16, (2, 64, 12), dict(PRODUCER="push", SPLIT_K=2, NUM_COMM=3)),
    (8, F32, (4, 48, 8), dict(PRODUCER="push", CHUNK_ROWS=2, NUM_COMM=5)),
    (4, F32, (40, 72, 24), dict(PRODUCER="push", CHUNK_ROWS=4, ALL_ROWS=False, BLOCK_M=16)),
    (2, BF16, (37, 40, 20), dict(PRODUCER="push", ALL_ROWS=False, BLOCK_M=16, SPLIT_K=2)),
]


@pytest.mark.parametrize("world,dtype,shape,config", SPLIT_K_CASES + PUSH_CASES,
                         ids=lambda c: str(c))
def test_split_k(world, dtype, shape, config):
    mesh = setup(world)
    m, k, n = shape
    f = ag_matmul_fn(mesh, config)
    for _ in range(3):  # counters keep counting across calls
        x = rand((world * m, k), dtype)
        w = rand((k, world * n), dtype)
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        assert_close(out, f64(x) @ f64(w), dtype)


# The persistent TMA kernel: tensor-descriptor loads, tiles from a counter that
# the last program resets (three calls per case check the reset), N and K not
# multiples of the blocks (descriptors clip), chunks finer than tiles.
TMA_CASES = [
    (2, F32, (32, 72, 24), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)),
    (4, BF16, (16, 40, 40), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, CHUNK_ROWS=4,
                                 NUM_COMM=3)),
    (8, F32, (16, 64, 8), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)),
]


def _check_persistent(world, dtype, shape, config):
    """Three calls (counters and epochs carry over); out and every rank's gathered x."""
    mesh = setup(world)
    m, k, n = shape
    f = jax.jit(jax.shard_map(
        lambda x, w: ag_matmul_with_gathered(x, w, "tp", config=config),
        mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
        out_specs=(P(None, "tp"), P(None, "tp"))))
    for _ in range(3):
        x = rand((world * m, k), dtype)
        w = rand((k, world * n), dtype)
        out, gathered = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        assert_close(out, f64(x) @ f64(w), dtype)
        for rank in range(world):  # every rank's gathered copy is the whole of x
            assert (jnp.asarray(gathered[:, rank * k:(rank + 1) * k]) == x).all()


@pytest.mark.parametrize("world,dtype,shape,config", TMA_CASES, ids=lambda c: str(c))
def test_tma_persistent(world, dtype, shape, config):
    _check_persistent(world, dtype, shape, dict(config, TMA=True))


# The copy-engine variant (the CPU backend raises the flags with a gather kernel
# run before the GEMM): local tiles read x, static round-robin over programs,
# chunks coarser or finer than tiles, sub-groups of a (dp, tp) mesh.
CE_CASES = [
    (2, F32, (32, 72, 24), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)),
    (4, BF16, (32, 40, 40), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, CHUNK_ROWS=32)),
    (8, F32, (16, 64, 8), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, CHUNK_ROWS=4, NUM_COMM=3)),
    # Serial pushes (a GPU stream order; the CPU backend accepts it, same result).
    (4, F32, (32, 40, 40), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, PUSH_ORDER="serial")),
]


@pytest.mark.parametrize("world,dtype,shape,config", CE_CASES, ids=lambda c: str(c))
def test_copy_engine_producer(world, dtype, shape, config):
    _check_persistent(world, dtype, shape, dict(config, TMA=True, PRODUCER="ce"))


def test_copy_engine_producer_needs_tma():
    check_config_errors([
        (dict(PRODUCER="ce", TMA=False), "PRODUCER='ce' needs TMA=True"),
        (dict(PRODUCER="push", TMA=True), "PRODUCER='push' needs TMA=False"),
        (dict(PRODUCER="dma", TMA=True), "PRODUCER='dma'; allowed")],
        x_shape=(32, 64), w_shape=(64, 8))


def test_bad_configs_are_refused():
    check_config_errors([
        (dict(SPLIT_K=5), "SPLIT_K=5 exceeds the 2 blocks"),
        (dict(BLOCK_N=24), "BLOCK_N=24 must be a power of 2"),
        (dict(NUM_COMM=0), "NUM_COMM=0 must be an int >= 1"),
        (dict(CHUNK_ROWS=64), "CHUNK_ROWS=64 must divide"),
        (dict(BLOK_M=16), "unknown config keys"),
        # The removed one-library-GEMM-per-shard mode's keys are unknown like any other.
        (dict(GEMM="cublas"), r"unknown config keys \['GEMM'\]"),
        (dict(GEMM="cublas", GEMM_ALGO=1), r"unknown config keys \['GEMM', 'GEMM_ALGO'\]"),
        (dict(TMA=True, ALL_ROWS=False, BLOCK_M=16), "m_shard=4 to be a multiple of BLOCK_M=16"),
        (dict(TMA=True, SPLIT_K=2, ALL_ROWS=False, BLOCK_M=4), "SPLIT_K=2 needs TMA=False")],
        x_shape=(8, 64), w_shape=(64, 8))


def test_tune_picks_fastest_and_persists(monkeypatch):
    mesh = setup(2)
    cands = [dict(BLOCK_N=16), dict(BLOCK_N=32, SPLIT_K=2), dict(BLOCK_N=24)]  # last: invalid
    order = iter([0, 1])

    def measure(fn, args, world, iterations):
        jax.block_until_ready(fn(*args))
        return [50.0, 20.0][next(order)]

    result = td.tune.tune_ag_matmul(4, 24, 64, F32, axis_name="tp", candidates=cands,
                                    measure=measure)
    assert result["config"]["BLOCK_N"] == 32 and result["config"]["SPLIT_K"] == 2
    assert result["us"] == 20.0
    assert "power of 2" in result["tried"][2]["error"]
    on_disk = json.loads(td.tune.cache_path().read_text())
    entry = on_disk["entries"][result["key"]]
    assert entry["config"]["BLOCK_N"] == 32 and entry["variant"] == "pointer"
    # The file records the versions it was measured with; entries hold configs only.
    assert {"jaxtdist", "triton", "jax"} <= set(on_disk) and set(entry) == {"config", "variant"}

    # A fresh runtime (as in a second process) reads the entry and does not tune.
    td.shutdown()
    mesh = setup(2)
    monkeypatch.setenv("JAXTDIST_AUTOTUNE", "1")
    monkeypatch.setattr(_tuner, "tune", lambda *a, **k: pytest.fail("tuned again"))
    cfg = resolve(AgMatmulConfig, _problem("cpu", 2, 4, 24, 64, F32), td.runtime.runtime())
    assert cfg.BLOCK_N == 32 and cfg.SPLIT_K == 2
    x = rand((8, 64), F32)
    w = rand((64, 48), F32)
    out = ag_matmul_fn(mesh)(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
    assert_close(out, f64(x) @ f64(w), F32)


def test_autotune_on_first_trace(monkeypatch):
    """JAXTDIST_AUTOTUNE=1: a shape without an entry is tuned while the caller traces."""
    mesh = setup(2)
    timings = {}

    def measure(fn, args, world, iterations):
        jax.block_until_ready(fn(*args))
        timings[len(timings)] = 10.0 - len(timings)  # later candidates "faster"
        return timings[len(timings) - 1]

    monkeypatch.setenv("JAXTDIST_AUTOTUNE", "1")
    monkeypatch.setattr(_tuner, "default_measure", lambda platform: measure)
    monkeypatch.setattr(AgMatmulConfig, "search_space",
                        classmethod(lambda cls, problem: [dict(BLOCK_N=16), dict(BLOCK_N=32)]))
    x = rand((6, 40), F32)
    w = rand((40, 32), F32)
    out = ag_matmul_fn(mesh)(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
    assert_close(out, f64(x) @ f64(w), F32)
    assert len(timings) == 2
    cfg = td.runtime.runtime().tuning.lookup("ag_matmul", 2, (3, 16, 40), F32)
    assert cfg is not None and cfg["BLOCK_N"] == 32


def test_import_jaxtdist_installs_the_autotune_hook(monkeypatch):
    """The ops ask the runtime's tuning cache, whose autotune slot ``import jaxtdist``
    fills with the tuner's hook; it answers only under JAXTDIST_AUTOTUNE=1."""
    from jaxtdist.runtime._config_cache import TuningCache

    assert TuningCache._autotune is _tuner.autotune_on_miss
    asked = []
    monkeypatch.setattr(TuningCache, "_autotune",
                        staticmethod(lambda *a: asked.append(a) or {"BLOCK_N": 32}))
    cache = TuningCache("a device")
    problem = _problem("gpu", 2, 3, 16, 40, F32)
    monkeypatch.delenv("JAXTDIST_AUTOTUNE", raising=False)
    assert cache.autotuned("ag_matmul", problem, "tp") is None and not asked
    monkeypatch.setenv("JAXTDIST_AUTOTUNE", "1")
    assert cache.autotuned("ag_matmul", problem, "tp") == {"BLOCK_N": 32}
    assert asked == [("ag_matmul", problem, "tp")]
    with pytest.raises(ValueError, match="must be callable"):
        TuningCache.install_autotune(None)


def test_tune_refuses_cpu_timing():
    setup(2)
    with pytest.raises(ValueError, match="timing needs GPUs"):
        td.tune.tune_ag_matmul(4, 8, 16, F32, axis_name="tp")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gpu_candidates_are_valid_configs(world):
    """Every candidate the GPU tuner would time passes the config checks."""
    from jaxtdist.tune.shapes import AG_MATMUL_SHAPES

    for m_shard, n, k in list(AG_MATMUL_SHAPES) + [(64, 1024, 1024), (3, 100, 200)]:
        for dtype in (BF16, F32):
            problem = _problem("gpu", world, m_shard, n, k, dtype)
            candidates = AgMatmulConfig.search_space(problem)
            assert len(candidates) >= (3 if (m_shard, n, k) in AG_MATMUL_SHAPES else 1)
            resolved = set()
            for overrides in candidates:
                cfg = AgMatmulConfig.settle(AgMatmulConfig.default(problem), overrides)
                cfg.validate(problem)
                resolved.add(tuple(sorted(cfg.to_dict().items())))
            assert len(resolved) == len(candidates), "a config would be timed twice"


@pytest.mark.parametrize("m_shard,n,k,dtype,kernel", [
    (128, 4096, 8192, BF16, "ce"),     # few row tiles that TMA loads: copy engines
    (256, 1024, 4096, BF16, "ce"),
    (96, 4096, 8192, BF16, "sm"),      # rows not a multiple of 128
    (128, 4096, 8192, F32, "sm"),      # 32-bit: the pointer kernel
    (1024, 4096, 4096, BF16, "ce"),
    (1, 4096, 8192, BF16, "push"),     # decode: SM producers push
])
def test_gpu_defaults_pick_the_measured_kernel(m_shard, n, k, dtype, kernel):
    problem = _problem("gpu", 4, m_shard, n, k, dtype)
    cfg = AgMatmulConfig.default(problem)
    cfg.validate(problem)
    assert cfg.PRODUCER == kernel and cfg.TMA == (kernel == "ce")


@pytest.mark.parametrize("asked,tma,producer", [
    (None, True, "ce"),                                   # the shape's defaults
    (dict(SPLIT_K=2), False, "sm"),                       # a pointer-kernel mode
    (dict(TMA=False), False, "sm"),
    (dict(TMA=True, PRODUCER="sm"), True, "sm"),
    (dict(TMA=True), True, "ce"),
    (dict(PRODUCER="push"), False, "push"),
])
def test_gpu_config_asking_for_pointer_modes_starts_from_pointer_defaults(asked, tma, producer):
    """On a shape whose GPU defaults are the copy-engine kernel, asking for a mode only
    the pointer kernel has gives the pointer kernel, not a refused mixture."""
    import types
    gpu = types.SimpleNamespace(platform="gpu",
                                tuning=types.SimpleNamespace(lookup=lambda *args: None,
                                                         autotuned=lambda *args: None))
    cfg = _resolve(gpu, _problem("gpu", 4, 128, 4096, 8192, BF16), asked)
    assert cfg.TMA == tma and cfg.PRODUCER == producer
    if asked and asked.get("SPLIT_K"):
        assert cfg.SPLIT_K == asked["SPLIT_K"]


@pytest.mark.parametrize("tuned,asked,order", [
    (None, None, "serial"),                                   # copy-engine defaults
    (dict(PRODUCER="ce", TMA=True, PUSH_ORDER="parallel"), None, "parallel"),  # tuned
    (dict(PRODUCER="sm", TMA=True, CHUNK_ROWS=32), None, None),  # tuned SM producers
    (None, dict(TMA=True, PRODUCER="sm", CHUNK_ROWS=32), None),
    (None, dict(PUSH_ORDER="parallel"), "parallel"),
    (None, dict(TMA=False), None),
    (None, dict(TMA=False, PUSH_ORDER="parallel"), None),  # asks nothing of SM producers
])
def test_gpu_push_order_follows_the_producer(tuned, asked, order):
    """The copy engines push serially unless a tuned entry or the caller says otherwise;
    SM producers' configs (defaults, tuned or asked for) have no push order."""
    import types
    gpu = types.SimpleNamespace(platform="gpu",
                                tuning=types.SimpleNamespace(lookup=lambda *args: tuned,
                                                         autotuned=lambda *args: None))
    cfg = _resolve(gpu, _problem("gpu", 4, 1024, 4096, 4096, BF16), asked)
    assert getattr(cfg, "PUSH_ORDER", None) == order


def test_tuned_copy_engine_pick_falls_back_when_its_inboxes_do_not_fit(monkeypatch):
    """A tuned (or default) PRODUCER="ce" whose inboxes (2 x world x shard) exhaust the
    heap runs with SM producers (staging slots: 2 x shard); asked for explicitly, the
    same config raises HeapExhaustedError naming the heap."""
    world, m, k, n = 2, 64, 256, 16
    ce = dict(TMA=True, PRODUCER="ce", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, CHUNK_ROWS=32)
    # 300 kB: the SM workspace (~130 kB) fits beside the reserved part, the inboxes
    # (~260 kB) do not.
    mesh = setup(world, heap_bytes=300_000)
    rt = td.runtime.runtime()
    monkeypatch.setattr(rt.tuning, "lookup", lambda *args: dict(ce))
    x = rand((world * m, k), F32)
    w = rand((k, world * n), F32)
    xs, ws = place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))
    for _ in range(2):
        assert_close(ag_matmul_fn(mesh)(xs, ws), f64(x) @ f64(w), F32)
    kinds = {key[0] for key in rt._workspaces}
    assert "ag_matmul/gather" in kinds and "ag_matmul/inbox" not in kinds, kinds
    with pytest.raises(td.HeapExhaustedError, match="heap"):
        ag_matmul_fn(mesh, dict(ce))(xs, ws)


def test_autotune_without_a_timer_takes_the_defaults(monkeypatch):
    """JAXTDIST_AUTOTUNE=1 where kernels cannot be timed (CPU, no measure): calls
    run with their defaults (every tunable op failed, its message naming a measure=
    argument that ops do not take)."""
    mesh = setup(2)
    monkeypatch.setenv("JAXTDIST_AUTOTUNE", "1")
    x = rand((6, 56), F32)
    w = rand((56, 32), F32)
    out = ag_matmul_fn(mesh)(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
    assert_close(out, f64(x) @ f64(w), F32)
    assert td.runtime.runtime().tuning.lookup("ag_matmul", 2, (3, 16, 56), F32) is None


@pytest.mark.parametrize("content,what", [
    ([1], r"a JSON list, not an object"),
    ({"format": 2, "entries": [1, 2]}, r"its entries are a list, not an object"),
    ({"format": 2, "entries": {"k": {"variant": "x"}}}, r"entry 'k' has no config object"),
])
def test_a_malformed_tuning_cache_is_named(tmp_path, monkeypatch, content, what):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(content))
    monkeypatch.setenv("JAXTDIST_TUNING_CACHE", str(path))
    from jaxtdist.runtime._config_cache import TuningCache
    with pytest.raises(ValueError, match=rf"the tuning cache {re.escape(str(path))} is not a "
                                         rf"jaxtdist tuning cache \({what}\); delete it"):
        TuningCache("cpu").lookup("ag_matmul", 2, (3, 16, 40), F32)


def test_a_stale_tuned_entry_names_its_file(tmp_path, monkeypatch):
    """A tuned entry that no longer validates (another version's, or edited by hand):
    the error names the cache file, since the caller passed no config."""
    from jaxtdist.runtime._config_cache import FORMAT, TuningCache, entry_key
    path = tmp_path / "tuning.json"
    key = entry_key("ag_matmul", "cpu", 2, (3, 16, 40), F32)
    path.write_text(json.dumps({"format": FORMAT,
                                "entries": {key: {"config": {"BLOCK_N": 48}}}}))
    monkeypatch.setenv("JAXTDIST_TUNING_CACHE", str(path))
    class _Rt:
        tuning = TuningCache("cpu")
    with pytest.raises(ValueError, match=rf"BLOCK_N=48 .* \[a tuned entry of the tuning cache "
                                         rf"{re.escape(str(path))}"):
        resolve(AgMatmulConfig, _problem("cpu", 2, 3, 16, 40, F32), _Rt())


def test_an_unwritable_tuning_cache_keeps_the_result_in_the_message(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("JAXTDIST_TUNING_CACHE", str(blocker / "tuning.json"))
    from jaxtdist.runtime._config_cache import TuningCache
    cache = TuningCache("cpu")
    with pytest.raises(OSError, match=r"cannot write the tuning cache .*; the tuned config "
                                      r"\{'BLOCK_N': 32\} for ag_matmul\|cpu.* is kept for this "
                                      r"process only"):
        cache.store("ag_matmul", 2, (3, 16, 40), F32, {"BLOCK_N": 32}, "pointer")
    assert cache.lookup("ag_matmul", 2, (3, 16, 40), F32) == {"BLOCK_N": 32}
