"""Typed kernel configs and how a call settles on one.

Each op's config is a frozen dataclass deriving ``KernelConfig``: it derives
its defaults from the problem (``default``), validates itself against a
problem (``validate``), names its search space for the tuner
(``search_space``), gives its kernel's arguments (``kernel_args``, ``launch_options``)
and names the kernel ``variant`` it runs.
``resolve`` picks a call's config the same way for every op: the defaults
updated by the caller's overrides when there are any, else by the tuning
cache's entry for (op, device kind, world, shape, dtype); with
``JAXTDIST_AUTOTUNE=1`` a cache miss is tuned first.

Example:
  >>> cfg = resolve(AgMatmulConfig, problem, rt)           # defaults + tuned entry
  >>> cfg = resolve(AgMatmulConfig, problem, rt, {"BLOCK_N": 128})  # + overrides
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import jax.numpy as jnp
import numpy as np

from jaxtdist.ops._tuning import autotuned

C = TypeVar("C", bound="KernelConfig")


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a config is chosen for: one call's per-rank problem on a platform.

    Attributes:
      platform: "gpu" or "cpu" (the interpreter).
      world: ranks in the group.
      shape: the op's shape key (ag_matmul: (m_shard, n, k)).
      dtype: operand dtype name.
      sms: streaming multiprocessors a persistent grid may fill (GPUs).
      vendor: "nvidia" or "amd": which GPU features exist (AMD has no TMA and
        no copy-engine pushes: configs that need them are not offered there).
    """
    platform: str
    world: int
    shape: tuple[int, ...]
    dtype: str
    sms: int = 132
    vendor: str = "nvidia"

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize


class KernelConfig:
    """Base of the typed kernel configs (each a frozen dataclass)."""

    OP: ClassVar[str] = ""

    @property
    def variant(self) -> str:
        """The kernel this config runs (recorded with tuned entries)."""
        return "default"

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def default(cls: type[C], problem: Problem) -> C:
        """The config a problem gets with no tuned entry: one rule for every shape."""
        raise NotImplementedError

    @classmethod
    def search_space(cls, problem: Problem) -> list[dict]:
        """Overrides of the defaults worth timing for ``problem`` (the tuner's candidates)."""
        return [{}]

    @classmethod
    def settle(cls: type[C], base: C, asked: Mapping[str, Any]) -> C:
        """``base`` updated by the keys ``asked`` for; settings that depend on the ones
        asked for follow them (op-specific)."""
        return base.replace(**asked)

    @classmethod
    def fitting(cls, problem: Problem, candidates: list[dict]) -> list[dict]:
        """The override sets of ``candidates`` that validate for ``problem``, each
        settling to a distinct config (the defaults and duplicates are timed once)."""
        kept, seen = [], set()
        for overrides in candidates:
            try:
                config = cls.settle(cls.default(problem), overrides)
                config.validate(problem)
            except ValueError:
                continue
            key = tuple(sorted(config.to_dict().items()))
            if key not in seen:
                seen.add(key)
                kept.append(overrides)
        return kept

    def validate(self, problem: Problem) -> None:
        """Raises ``ValueError`` naming the first constraint ``problem`` puts that this
        config breaks."""

    LAUNCH_KEYS: ClassVar[tuple[str, ...]] = ("num_warps", "num_stages")

    def kernel_args(self) -> dict:
        """The kernel's constexpr arguments this config sets (launch options aside)."""
        return {k: v for k, v in self.to_dict().items() if k not in self.LAUNCH_KEYS}

    def launch_options(self) -> dict:
        """``num_warps`` and ``num_stages`` (those of them the config has)."""
        return {k: v for k, v in self.to_dict().items() if k in self.LAUNCH_KEYS}

    def replace(self: C, **changes: Any) -> C:
        unknown = sorted(set(changes) - set(self.keys()))
        if unknown:
            raise ValueError(f"jaxtdist.{self.OP}: unknown config keys {unknown}; known: "
                             f"{sorted(self.keys())}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_blocks(op: str, cfg, keys, at_least: dict | None = None) -> None:
    """Integer config fields ``keys`` of ``cfg``: ints >= 1 (or ``at_least[key]``), and
    BLOCK_* powers of 2 >= 16 (tl.dot's smallest tile); ValueError naming the field."""
    for key in keys:
        value = getattr(cfg, key)
        low = (at_least or {}).get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"jaxtdist.{op}: config {key}={value!r} must be an int >= {low}")
        if key.startswith("BLOCK_") and (value & (value - 1) or value < 16):
            raise ValueError(f"jaxtdist.{op}: config {key}={value} must be a power of 2 "
                             ">= 16 (tl.dot's smallest tile)")


def config_dict(op: str, config: Any) -> dict | None:
    """A call's ``config=`` as the dict of keys it asks for: a mapping as it is, a
    typed config (``AgMatmulConfig(...)``) as all its keys; else ``TypeError``."""
    if config is None:
        return None
    if isinstance(config, KernelConfig):
        return {key: getattr(config, key) for key in config.keys()}
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"jaxtdist.{op}: config must be a dict of config keys (e.g. "
                    f"{{'BLOCK_M': 128}}), got {type(config).__name__}: {config!r}")


def resolve(config_type: type[C], problem: Problem, rt, config: Mapping[str, Any] | None = None,
            *, base: C | None = None, axis_name="tp") -> C:
    """The config a call uses: ``base`` (default: the problem's defaults), updated by
    the tuning cache's entry for the problem (only when ``config`` is None), then by
    ``config``; validated against the problem.

    On a cache miss with ``JAXTDIST_AUTOTUNE=1``, the installed tuner
    (``ops/_tuning.py``) tunes the problem first and caches the choice.
    """
    cfg = base if base is not None else config_type.default(problem)
    asked = dict(config or {})
    from_cache = False
    if config is None:
        tuned = rt.tuning.lookup(config_type.OP, problem.world, problem.shape, problem.dtype)
        from_cache = tuned is not None
        if not from_cache:
            tuned = autotuned(config_type.OP, problem, axis_name)
        asked = dict(tuned or {})
    # NumPy integers (a config built from an array's entries) pass the checks as
    # ints but are no Triton constexpr: the kernels get Python ints.
    asked = {k: int(v) if isinstance(v, np.integer) else v for k, v in asked.items()}
    try:
        _check_types(config_type.OP, cfg, asked)
        cfg = config_type.settle(cfg, asked)
        cfg.validate(problem)
        _check_launch(config_type.OP, cfg)
    except ValueError as e:
        if not from_cache:
            raise
        source = rt.tuning.source(config_type.OP, problem.world, problem.shape,
                                  problem.dtype) or "(an entry stored in memory)"
        raise ValueError(f"{e} [a tuned entry of the tuning cache {source}, written by another "
                         "jaxtdist version or by hand: delete it, or point "
                         "JAXTDIST_TUNING_CACHE elsewhere]") from None
    return cfg


# Triton's largest block (elements) and the largest value a constexpr count may take.
_MAX_BLOCK = 1 << 20
_MAX_INT = (1 << 31) - 1


def _check_types(op: str, cfg, asked: Mapping[str, Any]) -> None:
    """Each asked value of its field's declared type (int, bool or str; fields
    declared Any take several kinds): a ValueError naming the key, before anything
    computes with it."""
    declared = {f.name: getattr(f.type, "__name__", f.type) for f in dataclasses.fields(cfg)}
    for key, value in asked.items():
        kind = declared.get(key)  # unknown keys are settle's to name
        if kind == "bool":
            ok, want = isinstance(value, (bool, np.bool_)), "True or False"
        elif kind == "int":
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
            want = "an int"
        elif kind == "str":
            ok, want = isinstance(value, str), "a string"
        else:
            continue
        if not ok:
            raise ValueError(f"jaxtdist.{op}: config {key}={value!r} must be {want} (the "
                             f"default here: {getattr(cfg, key)!r})")


def _check_launch(op: str, cfg) -> None:
    """Launch options and sizes within what Triton compiles: num_warps a power of 2
    up to 32, num_stages up to 16, BLOCK_* up to Triton's largest block, other
    integer fields within int32."""
    for key, value in cfg.to_dict().items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            continue
        if key == "num_warps" and (value & (value - 1) or not 1 <= value <= 32):
            raise ValueError(f"jaxtdist.{op}: config num_warps={value}; allowed: 1, 2, 4, 8, "
                             "16, 32")
        if key == "num_stages" and not 1 <= value <= 16:
            raise ValueError(f"jaxtdist.{op}: config num_stages={value}; allowed: 1 to 16")
        if key.startswith("BLOCK_") and value > _MAX_BLOCK:
            raise ValueError(f"jaxtdist.{op}: config {key}={value} is past Triton's largest "
                             f"block ({_MAX_BLOCK} elements)")
        if value > _MAX_INT:
            raise ValueError(f"jaxtdist.{op}: config {key}={value} does not fit in int32")
