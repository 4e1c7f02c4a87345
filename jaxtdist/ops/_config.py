"""Typed kernel configs and how a call settles on one.

Each op's config is a frozen dataclass deriving ``KernelConfig``: it derives
its defaults from the problem (``default``), declares each field's allowed
values once (``setting``: kind, bounds, powers of 2, choices), checked by one
function (``check_settings``) for every op, adds the constraints between fields
or against the problem (``check``), names its search space for the tuner
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
        """Raises ``ValueError`` naming the first declared field constraint, or the
        first constraint ``problem`` puts (``check``), that this config breaks."""
        check_settings(self.OP, self, self.to_dict())
        self.check(problem)

    def check(self, problem: Problem) -> None:
        """The constraints between fields and against ``problem`` (op-specific): a
        ``ValueError`` naming the first one broken."""

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


def config_dict(op: str, config: Any) -> dict | None:
    """A call's ``config=`` as the dict of keys it asks for: a mapping as it is, a
    typed config (``AgPointerConfig(...)``) as its ``to_dict``; else ``TypeError``."""
    if config is None:
        return None
    if isinstance(config, KernelConfig):
        return config.to_dict()
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
    (``TuningCache.install_autotune``) tunes the problem first and caches the choice.
    """
    cfg = base if base is not None else config_type.default(problem)
    asked = dict(config or {})
    from_cache = False
    if config is None:
        tuned = rt.tuning.lookup(config_type.OP, problem.world, problem.shape, problem.dtype)
        from_cache = tuned is not None
        if not from_cache:
            tuned = rt.tuning.autotuned(config_type.OP, problem, axis_name)
        asked = dict(tuned or {})
    # NumPy integers (a config built from an array's entries) pass the checks as
    # ints but are no Triton constexpr: the kernels get Python ints.
    asked = {k: int(v) if isinstance(v, np.integer) else v for k, v in asked.items()}
    try:
        check_settings(config_type.OP, cfg, asked)
        cfg = config_type.settle(cfg, asked)
        cfg.validate(problem)
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
_KINDS = {"int": "an int", "bool": "True or False", "str": "a string"}


def setting(default: Any, *, kind: str | None = None, low: int = 1,
            high: int | None = None, high_is: str = "", pow2: bool = False,
            choices: tuple = (), auto: bool = False, inert: tuple = (), note: str = "") -> Any:
    """A config field with its allowed values declared (``check_settings`` checks them).

    Args:
      default: the field's default.
      kind: "int", "bool" or "str" (default: the field's annotation).
      low, high: bounds of an int (every int must fit int32).
      high_is: what ``high`` is, for the error past it.
      pow2: an int must be a power of 2.
      choices: the only values allowed.
      auto: "auto" is allowed too (a rule picks the value).
      inert: values that ask nothing of the kernel: a config of another variant,
        which has no such field, takes them and ignores them.
      note: what the value means, appended to errors.
    """
    return dataclasses.field(default=default, metadata=dict(
        kind=kind, low=low, high=high, high_is=high_is, pow2=pow2, choices=tuple(choices),
        auto=auto, inert=tuple(inert), note=f" {note}" if note else ""))


def block(default: int, low: int = 16) -> Any:
    """A tile size: a power of 2 from ``low`` (16: tl.dot's smallest tile) up to
    Triton's largest block."""
    return setting(default, low=low, high=_MAX_BLOCK, high_is="Triton's largest block",
                   pow2=True, note="(tl.dot's smallest tile)" if low == 16 else "")


# What Triton compiles, for every config's launch options (fields of these names
# need no declaration; other launch options declare them: ``setting(4, **WARPS)``).
WARPS = dict(choices=(1, 2, 4, 8, 16, 32))
STAGES = dict(high=16)
_LAUNCH_LIMITS = {"num_warps": setting(4, **WARPS).metadata,
                  "num_stages": setting(3, **STAGES).metadata}


def check_settings(op: str, cfg: Any, values: Mapping[str, Any]) -> None:
    """Each of ``values`` (by key) within what its field of ``cfg``'s class declares
    (``setting``); keys of no field are skipped (``replace`` names them). Raises a
    ``ValueError`` naming the op, the key, the value and what is allowed."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in values.items():
        if key in fields:
            check_setting(op, fields[key], value)


def check_setting(op: str, field: dataclasses.Field, value: Any) -> None:
    """``value`` within what ``field`` declares (see ``setting``): else a ``ValueError``
    naming the op, the key, the value and what is allowed."""
    meta = field.metadata or _LAUNCH_LIMITS.get(field.name, {})
    kind = meta.get("kind") or getattr(field.type, "__name__", field.type)
    if meta.get("auto") and isinstance(value, str) and value == "auto":
        return
    err, note = f"jaxtdist.{op}: config {field.name}={value!r}", meta.get("note", "")
    low = meta.get("low", -_MAX_INT)  # a field declared without ``setting``: any int
    noun = "a power of 2" if meta.get("pow2") else "an int"
    want = {"bool": "True or False", "str": "a string", "int": f"{noun} >= {low}"}.get(kind)
    is_bool = isinstance(value, (bool, np.bool_))
    typed = {"bool": is_bool, "str": isinstance(value, str),
             "int": isinstance(value, (int, np.integer)) and not is_bool}.get(kind, True)
    ok = typed and (kind != "int" or (
        value >= low and not (meta.get("pow2") and value & (value - 1))))
    if not ok and meta.get("auto"):
        raise ValueError(f"{err}; allowed: " + ("True, False or 'auto'" if kind == "bool"
                                                  else f"'auto' or {want}") + note)
    if not typed and kind != "bool":
        raise ValueError(f"{err} must be {_KINDS[kind]} (the default here: {field.default!r})")
    if not ok:
        raise ValueError(f"{err} must be {want}{note}")
    high = meta.get("high")
    if kind == "int" and high is not None and value > high:
        raise ValueError(f"{err} is past {meta['high_is']} ({high} elements)" if meta["high_is"]
                         else f"{err} must be {noun} in [{low}, {high}]{note}")
    if kind == "int" and value > _MAX_INT:
        raise ValueError(f"{err} does not fit in int32")
    if meta.get("choices") and value not in meta["choices"]:
        raise ValueError(f"{err}; allowed: {', '.join(repr(c) for c in meta['choices'])}{note}")
