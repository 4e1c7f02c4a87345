"""Greedy generation with a model's KV cache, from prompts as users have them: any
length, a batch of different lengths (token lists, or a right-padded array with
``lengths`` or ``pad_id``), on any mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["generate"]


@nnx.jit
def _prefill(model, prompts, lengths):
    """The first generated token [batch, 1]: the argmax of each sequence's logits
    at its last real position (``lengths - 1``)."""
    logits = model(prompts, lengths=lengths)
    last = jnp.arange(prompts.shape[1], dtype=jnp.int32)[None, :] == (lengths - 1)[:, None]
    # A where, not a product: the padding's logits are NaN.
    picked = jnp.sum(jnp.where(last[..., None], logits, 0.0), axis=1)
    return jnp.argmax(picked, axis=-1).astype(jnp.int32)[:, None]


@nnx.jit
def _decode(model, tokens):
    return jnp.argmax(model(tokens, decode=True), axis=-1).astype(jnp.int32)


def _as_batch(prompts, lengths, pad_id) -> tuple[np.ndarray, np.ndarray]:
    """(prompts [batch, seq] int32, lengths [batch] int32) on the host, checked."""
    if isinstance(prompts, (list, tuple)) and prompts and not np.isscalar(prompts[0]):
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        if lengths is not None:
            raise ValueError("jaxtdist.nn.generate: prompts given as token lists carry their "
                             "lengths; pass lengths= only with a padded [batch, seq] array")
        lengths = [len(r) for r in rows]
        out = np.zeros((len(rows), max(lengths, default=0)), np.int64)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        prompts = out
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or not np.issubdtype(prompts.dtype, np.integer) or not prompts.size:
        raise ValueError(f"jaxtdist.nn.generate: prompts have shape {prompts.shape} and dtype "
                         f"{prompts.dtype}; expected non-empty integer [batch, seq] (or a "
                         "list of token lists)")
    batch, seq = prompts.shape
    if lengths is None and pad_id is not None:
        # Right padding: the run of pad_id at each row's end (a row of pad_id only
        # keeps its first token).
        real = prompts != pad_id
        lengths = np.where(real.any(1), seq - np.argmax(real[:, ::-1], axis=1), 1)
    lengths = np.full((batch,), seq) if lengths is None else np.asarray(lengths)
    if (lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer)
            or (lengths < 1).any() or (lengths > seq).any()):
        raise ValueError(f"jaxtdist.nn.generate: lengths={lengths.tolist()}; expected "
                         f"{batch} integers in [1, {seq}] (each prompt's real tokens)")
    return prompts.astype(np.int32), lengths.astype(np.int32)


def generate(model: nnx.Module, prompts, steps: int, *, lengths=None,
             pad_id: int | None = None, max_len: int | None = None) -> np.ndarray:
    """Greedy continuation of each prompt by ``steps`` tokens, through the model's
    KV cache (``init_cache`` is called here; ``clear_cache`` after to train).

    Args:
      model: a ``jaxtdist.nn.Llama`` (any model with its ``init_cache``, prefill
        ``lengths=`` and ``decode=True`` calls).
      prompts: [batch, seq] token ids, right-padded where ``lengths`` or
        ``pad_id`` say so, or a list of token lists of any lengths.
      steps: tokens to generate (>= 1).
      lengths: [batch] each prompt's real tokens (default: all of seq, or from
        ``pad_id``).
      pad_id: the id the prompts are right-padded with: each row's trailing run
        of it is padding. Without ``lengths`` or ``pad_id`` every token is a
        prompt token (a padded prompt then reads its padding as text).
      max_len: the cache's length (default seq + steps).

    Returns:
      [batch, steps] int32 on the host: each prompt's next tokens, whatever the
      other prompts' lengths.

    Example:
      >>> out = jaxtdist.nn.generate(model, [[5, 9, 2, 7, 1], [4, 4, 8]], steps=8)
    """
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"jaxtdist.nn.generate: steps={steps!r}; give an int >= 1")
    prompts, lengths = _as_batch(prompts, lengths, pad_id)
    batch, seq = prompts.shape
    model.init_cache(batch, max_len or seq + steps)
    out = [_prefill(model, prompts, lengths)]
    model.layers[0].self_attn.check_room(steps - 1)  # a clear error, before NaN
    for _ in range(steps - 1):
        out.append(_decode(model, out[-1]))
    return np.concatenate([np.asarray(jax.device_get(t)) for t in out], axis=1)
