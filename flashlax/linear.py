"""Front end of gated_delta_rule: validates, asks the dispatcher for an implementation, calls it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from flashlax import dispatch
from flashlax.parallel import shard as parallel

_CHUNK_SIZES = (16, 32, 64, 128)


def _shape(x):
    return tuple(np.shape(x))


def _dtype(x):
    return jnp.result_type(x)


def _check_floating(name: str, x) -> None:
    if not jnp.issubdtype(_dtype(x), jnp.floating):
        raise ValueError(f"gated_delta_rule: {name} must be floating point, got dtype {_dtype(x)} "
                         f"(shape {_shape(x)})")


def _validate(q, k, v, log_alpha, beta, scale, initial_state, chunk_size) -> float:
    """Checks shapes and dtypes statically (nothing traced); returns the resolved scale."""
    shapes = f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}, log_alpha {_shape(log_alpha)}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(_shape(x)) != 4:
            raise ValueError(f"gated_delta_rule: {name} must be [B, H, T, d], got {name} {_shape(x)} ({shapes})")
    for name, x in (("q", q), ("k", k), ("v", v), ("log_alpha", log_alpha)):
        _check_floating(name, x)
    if _shape(k) != _shape(q):
        raise ValueError(f"gated_delta_rule: q and k must have the same shape [B, H, T, dk], got {shapes}")
    if _shape(v)[:3] != _shape(q)[:3]:
        raise ValueError(f"gated_delta_rule: v must be [B, H, T, dv] with q's B, H, T, got {shapes}")
    if not (_dtype(q) == _dtype(k) == _dtype(v)):
        raise ValueError(f"gated_delta_rule: q, k, v must share one dtype, got q {_dtype(q)}, k {_dtype(k)}, "
                         f"v {_dtype(v)} ({shapes})")
    batch, heads, seq_len, dk = _shape(q)
    dv = _shape(v)[-1]
    if seq_len < 1 or dk < 1 or dv < 1:
        raise ValueError(f"gated_delta_rule: empty sequence or head dimension ({shapes})")
    if _shape(log_alpha) != (batch, heads, seq_len):
        raise ValueError(f"gated_delta_rule: log_alpha must be [B, H, T] = {(batch, heads, seq_len)}, "
                         f"got {shapes}")
    if beta is not None:
        _check_floating("beta", beta)
        if _shape(beta) != (batch, heads, seq_len):
            raise ValueError(f"gated_delta_rule: beta must be [B, H, T] = {(batch, heads, seq_len)}, "
                             f"got beta {_shape(beta)} ({shapes})")
    if initial_state is not None:
        _check_floating("initial_state", initial_state)
        if _shape(initial_state) != (batch, heads, dk, dv):
            raise ValueError(f"gated_delta_rule: initial_state must be [B, H, dk, dv] = {(batch, heads, dk, dv)}, "
                             f"got initial_state {_shape(initial_state)} ({shapes})")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
            or int(chunk_size) not in _CHUNK_SIZES:
        raise ValueError(f"gated_delta_rule: chunk_size must be a power of two in 16..128 {_CHUNK_SIZES}, "
                         f"got {chunk_size!r}")
    if scale is None:
        return float(dk) ** -0.5
    try:
        return float(scale)
    except Exception as err:  # a tracer: the scale is a compile-time constant of every impl
        raise ValueError(f"gated_delta_rule: scale must be a Python number, got {type(scale).__name__}") from err


def default_impl(dtype, dk: int, dv: int, backend: str | None = None) -> str:
    """The implementation ``impl=None`` runs: the backend's default ("chunked" on CPU, "ssd" on GPU), except
    float32 inputs with a head dim over 128 on the GPU, which run "chunked": ssd there is not measured
    faster and its float32 kernels take minutes to compile at head dim 256 (docs/PERF_NOTES.md)."""
    name = dispatch.default_impl("gated_delta_rule", backend)
    if name == "ssd" and jnp.dtype(dtype) == jnp.float32 and max(dk, dv) > 128:
        return "chunked"
    return name


def gated_delta_rule(q, k, v, log_alpha, beta=None, *, scale: float | None = None, initial_state=None,
                     return_final_state: bool = False, chunk_size: int = 64, impl: str | None = None,
                     interpret: bool = False, context_axis: str | None = None):
    """Gated delta rule (with ``beta``) or gated linear attention / Mamba-2 SSD (``beta=None``).

    With beta:    ``S_t = exp(log_alpha_t) (S_{t-1} - beta_t k_t (k_t^T S_{t-1})) + beta_t k_t v_t^T``
    Without beta: ``S_t = exp(log_alpha_t) S_{t-1} + k_t v_t^T``;      ``o_t = scale * S_t^T q_t``.

    Args:
      q, k: [B, H, T, dk]; v: [B, H, T, dv] (one dtype: float32, bfloat16 or float16).
      log_alpha: [B, H, T] log decay (<= 0). beta: [B, H, T] or None.
      scale: defaults to ``dk ** -0.5``. initial_state: [B, H, dk, dv] or None (zeros).
      return_final_state: also return the final state [B, H, dk, dv] float32.
      chunk_size: 16, 32, 64 or 128 (chunked paths). impl: "recurrent", "chunked", "chunked_fat",
      "ssd" or None (the backend's default: "chunked" on CPU, "ssd" on GPU except float32 with a head
      dim over 128: "chunked"; :func:`default_impl`). interpret: run a Pallas kernel in the interpreter.
      context_axis: a mesh axis name splitting T (contiguously in axis order): sequence parallelism. Each
        device runs its part of the sequence; the affine state maps of the parts are combined across
        the axis (an all-gather of [dk, dk + dv] maps per batch and head), forward and backward.
        See docs/API.md, "Sharding and context parallelism".
    Returns:
      o [B, H, T, dv] in v's dtype, or (o, final_state). Sharded inputs (batch, heads, with
      ``context_axis`` the sequence) give outputs sharded like them.
    Raises:
      ValueError: bad shapes or dtypes, a chunk_size outside 16/32/64/128, a non-numeric scale.
      RuntimeError: impl="ssd" on CPU without interpret=True.
    Example:
      >>> x = jnp.ones((1, 2, 100, 16)) / 4.0
      >>> o = flashlax.gated_delta_rule(x, x, x, -jnp.ones((1, 2, 100)), jnp.full((1, 2, 100), 0.5))
      >>> o.shape
      (1, 2, 100, 16)
    """
    scale = _validate(q, k, v, log_alpha, beta, scale, initial_state, chunk_size)
    if impl is None:
        impl = default_impl(jnp.result_type(q), q.shape[-1], v.shape[-1])
    entry, fn = dispatch.resolve("gated_delta_rule", impl, interpret=interpret)
    q, k, v, log_alpha = (jnp.asarray(x) for x in (q, k, v, log_alpha))
    beta = None if beta is None else jnp.asarray(beta)
    initial_state = None if initial_state is None else jnp.asarray(initial_state)
    options = dict(scale=scale, chunk_size=int(chunk_size))
    if entry.kind == "pallas":
        options["interpret"] = interpret
    return parallel.gated_delta_rule(fn, q, k, v, log_alpha, beta, initial_state=initial_state,
                                     return_final_state=bool(return_final_state), context_axis=context_axis,
                                     kernel=entry.kind == "pallas", **options)
