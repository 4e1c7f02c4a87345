"""Identity primitives: values passed through unchanged, under jit and vmap, whose
rules (autodiff, remat, lowering) carry jaxtdist's bookkeeping.

Example::

    marked_p = identity_primitive("jaxtdist_marked")
    ad.primitive_jvps[marked_p] = ...  # the caller's autodiff rule
    y, = marked_p.bind(x)
"""

from __future__ import annotations

from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

__all__ = ["identity_primitive"]


def identity_primitive(name: str) -> jex_core.Primitive:
    """A primitive returning its operands unchanged, under jit and vmap (its params,
    if any, only label it); the caller gives it its autodiff and remat rules, and
    may register another lowering."""
    prim = jex_core.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(lambda *xs, **params: list(xs))
    prim.def_abstract_eval(lambda *avals, **params: list(avals))
    mlir.register_lowering(prim, lambda ctx, *xs, **params: list(xs))
    batching.primitive_batchers[prim] = lambda args, dims, **params: (
        prim.bind(*args, **params), dims)
    return prim
