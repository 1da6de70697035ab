"""Pure-XLA gated delta rule / gated linear attention: recurrent (the reference), chunked, chunked_fat.

Recurrence (per batch and head, state ``S [dk, dv]``)::

    with beta:    S_t = a_t (S_{t-1} - b_t k_t (k_t^T S_{t-1})) + b_t k_t v_t^T,   a_t = exp(log_alpha_t)
    without beta: S_t = a_t S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

Chunked form (chunk of C tokens, state ``S0`` at its start). Writing the update as
``S_t = a_t S_{t-1} + k_t d_t^T`` with ``d_t = b_t (v_t - a_t S_{t-1}^T k_t)`` (``d_t = v_t`` without
beta) gives, with ``G[t, j] = exp(sum_{j < i <= t} log_alpha_i)`` and ``g_t = exp(sum_{i <= t} log_alpha_i)``::

    (I + A) D = diag(b) V - diag(b g) K S0,      A = strictly_lower(diag(b) (K K^T) * G)
    D = U - W S0,                                U = (I + A)^-1 diag(b) V,  W = (I + A)^-1 diag(b g) K
    O = P D + Q_g S0,                            P = scale (Q K^T * G * lower),  Q_g = scale diag(g) Q
    S_C = g_C S0 + K_dec^T D,                    K_dec = G[C, :] K

Everything except ``S0`` is computed for all chunks at once as batched matmuls ("precompute": P, Q_g,
U, W, K_dec); only ``D_n = U_n - W_n S_n``, ``S_{n+1} = g S_n + K_dec^T D_n`` and ``Q_g S_n`` run in a
sequential ``lax.scan`` over chunks, and ``P_n D_n`` is one batched matmul after it. (Without beta:
``O = O_intra + Q_g S0`` with ``O_intra = P V``, ``S_C = g_C S0 + K_dec^T V``.) The backward reuses
that split: a hand-written vjp of the batched precompute, and a hand-written reverse scan for the
linear state recurrence.

Numerics: every exponent is a sum of ``log_alpha`` over a segment inside one chunk, computed directly
(a cumulative sum of same-sign terms), not as a difference of prefix sums: the exponents are <= 0 (no overflow, also
for log_alpha = -1e4) and carry no cancellation error from large prefix sums. Masked (upper) entries
get exponent 0 before ``exp`` and are zeroed after, so no inf reaches a product or a gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashlax._precision import xla_precision
from flashlax.parallel.vma import match_vma

# Python-level arguments of the impls: compile-time constants of the jitted impls.
_STATIC = ("scale", "return_final_state", "chunk_size")


def _mm(spec: str, *operands):
    """einsum in full precision (no tf32 on GPU unless the caller asks for it: flashlax/_precision.py)."""
    return jnp.einsum(spec, *operands, precision=xla_precision(jnp.result_type(*operands)))


def _compute_dtype(*arrays):
    """float32, or float64 when an input is float64 (the reference under jax.enable_x64())."""
    dtypes = [a.dtype for a in arrays if a is not None]
    return jnp.promote_types(jnp.float32, jnp.result_type(*dtypes))


# ----------------------------------------------------------------------------------------------------
# recurrent: lax.scan over time (the reference)
# ----------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_delta_rule_recurrent(q, k, v, log_alpha, beta=None, *, scale: float, initial_state=None,
                               return_final_state: bool = False, chunk_size: int = 64):
    """Token-by-token ``lax.scan``; runs in float64 when given float64 inputs (under jax.enable_x64()).

    q, k: [B, H, T, dk]; v: [B, H, T, dv]; log_alpha, beta: [B, H, T]; initial_state: [B, H, dk, dv].
    Returns o [B, H, T, dv] in v's dtype (and the final state [B, H, dk, dv], float32 or float64).
    ``chunk_size`` is accepted for a uniform signature and ignored.
    """
    del chunk_size
    cdt = _compute_dtype(q, k, v, log_alpha, beta, initial_state)
    batch, heads, _, dk = q.shape
    dv = v.shape[-1]
    if initial_state is None:
        state0 = jnp.zeros((batch, heads, dk, dv), cdt)
    else:
        state0 = initial_state.astype(cdt)
    state0 = match_vma(state0, q, k, v, log_alpha, beta)   # the scan's carry varies like its inputs

    def time_major(x):
        return None if x is None else jnp.moveaxis(x.astype(cdt), 2, 0)

    xs = (time_major(q), time_major(k), time_major(v), time_major(log_alpha), time_major(beta))

    def step(state, x):
        q_t, k_t, v_t, la_t, b_t = x
        decay = jnp.exp(la_t)[..., None, None]
        if b_t is None:
            state = decay * state + k_t[..., :, None] * v_t[..., None, :]
        else:
            k_state = _mm("bhk,bhkv->bhv", k_t, state)
            state = (decay * (state - b_t[..., None, None] * k_t[..., :, None] * k_state[..., None, :])
                     + b_t[..., None, None] * k_t[..., :, None] * v_t[..., None, :])
        return state, scale * _mm("bhk,bhkv->bhv", q_t, state)

    final_state, o = lax.scan(step, state0, xs)
    o = jnp.moveaxis(o, 0, 2).astype(v.dtype)
    return (o, final_state) if return_final_state else o


# ----------------------------------------------------------------------------------------------------
# chunked: batched intra-chunk precompute + sequential state scan
# ----------------------------------------------------------------------------------------------------

_UT_BASE = 8     # diagonal blocks inverted in closed form before the doubling levels


def _unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] (the UT transform of the delta rule).

    The diagonal blocks of size _UT_BASE are inverted in closed form: a block b is nilpotent (b^8 = 0),
    so (I + b)^-1 = (I - b)(I + b^2)(I + b^4), four batched 8x8 products. Then block-recursive doubling:
    with the inverses X11, X22 of two diagonal halves, the inverse of the doubled block is
    [[X11, 0], [-X22 A21 X11, X22]], log2(C / 8) levels of batched matmuls. Starting the doubling at
    single rows instead took 2.5x longer on CPU (its first levels are many tiny ops; session 6: 1.78 ->
    0.72 ms for 32 chunks of 64, 28 -> 7.4 ms for 512), and a batched triangular_solve about 3x longer
    than that. A C that is not a power of two is padded with zero rows/columns (an identity block) inside.
    """
    size = a.shape[-1]
    padded = max(1 << (size - 1).bit_length(), _UT_BASE)
    if padded != size:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, padded - size), (0, padded - size)])
    batch = a.shape[:-2]
    block = _UT_BASE
    nb = padded // block
    diag = a.reshape(batch + (nb, block, nb, block))
    diag = jnp.moveaxis(jnp.diagonal(diag, axis1=-4, axis2=-2), -1, -3)     # [..., nb, 8, 8]
    # One flat batch axis for the 8x8 products (with the batch axes as they are, XLA CPU's algebraic
    # simplifier hit a RET_CHECK on the transposes around them in a fwd+bwd of chunked_fat, jax 0.11.2).
    diag = diag.reshape((-1, block, block))
    eye = jnp.eye(block, dtype=a.dtype)[None]
    sq = _mm("bij,bjk->bik", diag, diag)
    inv = _mm("bij,bjk->bik", eye - diag, eye + sq)
    sq = _mm("bij,bjk->bik", sq, sq)
    inv = _mm("bij,bjk->bik", inv, eye + sq).reshape(batch + (nb, block, block))   # inverted diagonal blocks
    while block < padded:
        pairs = padded // (2 * block)
        diag = a.reshape(batch + (pairs, 2 * block, pairs, 2 * block))
        diag = jnp.moveaxis(jnp.diagonal(diag, axis1=-4, axis2=-2), -1, -3)   # [..., pairs, 2b, 2b]
        inv = inv.reshape(batch + (pairs, 2, block, block))
        upper, lower = inv[..., 0, :, :], inv[..., 1, :, :]
        off = -_mm("...ij,...jk,...kl->...il", lower, diag[..., block:, :block], upper)
        inv = jnp.concatenate([jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1),
                               jnp.concatenate([off, lower], axis=-1)], axis=-2)
        block *= 2
    return inv[..., 0, :size, :size]


def _decays(log_alpha):
    """(seg, decay, gamma, e_last) of a chunk: seg[t, j] = sum_{j < i <= t} log_alpha_i (0 for t <= j),
    decay = exp(seg) on and below the diagonal (0 above), gamma_t = exp(sum_{i <= t} log_alpha_i) and
    e_last_j = exp(seg[C-1, j]) (token j decayed to the chunk end)."""
    size = log_alpha.shape[-1]
    idx = jnp.arange(size)
    incl = idx[:, None] >= idx[None, :]          # t >= j
    strict = idx[:, None] > idx[None, :]         # t > j
    # A cumulative sum down each column of the masked log_alpha: each entry sums only its own segment
    # (terms of one sign, no cancellation) and is <= 0 because log_alpha <= 0. (Session 5 and before: a
    # masked matmul with a triangular ones matrix, C^3 multiply-adds per chunk, as many as q k^T at dk 64.)
    seg = jnp.cumsum(jnp.where(strict, log_alpha[..., :, None], 0.0), axis=-2)
    decay = jnp.where(incl, jnp.exp(seg), 0.0)
    gamma = jnp.exp(log_alpha[..., :1] + seg[..., :, 0])
    return seg, decay, gamma, jnp.exp(seg[..., -1, :])


def _intra_chunk(q, k, v, log_alpha, beta, scale: float):
    """State-independent work of every chunk at once.

    q, k: [..., N, C, dk]; v: [..., N, C, dv]; log_alpha, beta: [..., N, C] (compute dtype).
    Without beta: (o_intra [..., N, C, dv], q_eff [..., N, C, dk], (chunk decay [..., N], h [..., N, dk,
    dv])), so that per chunk ``O = o_intra + q_eff @ S0`` and ``S_C = decay S0 + h``. With beta:
    (p [..., N, C, C], q_eff, (chunk decay, u, w, k_dec)), so that ``D = u - w S0``,
    ``O = p @ D + q_eff @ S0`` and ``S_C = decay S0 + k_dec^T D``.
    """
    if beta is None:
        _, decay, gamma, e_last = _decays(log_alpha)
        k_dec = k * e_last[..., None]
        scores = _mm("...tk,...jk->...tj", q, k) * decay
        o_intra = scale * _mm("...tj,...jv->...tv", scores, v)
        q_eff = (scale * gamma)[..., None] * q
        h = _mm("...jk,...jv->...kv", k_dec, v)
        return o_intra, q_eff, (gamma[..., -1], h)
    return _intra_chunk_delta(q, k, v, log_alpha, beta, scale)


def _intra_chunk_delta_fwd(q, k, v, log_alpha, beta, scale):
    _, decay, gamma, e_last = _decays(log_alpha)
    size = log_alpha.shape[-1]
    strict = jnp.arange(size)[:, None] > jnp.arange(size)[None, :]
    qk = _mm("...tk,...jk->...tj", q, k)
    kk = _mm("...tk,...jk->...tj", k, k)
    scores = qk * decay
    a = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    t_inv = _unit_lower_inverse(a)
    u = _mm("...tj,...jx->...tx", t_inv, beta[..., None] * v)
    w = _mm("...tj,...jx->...tx", t_inv, (beta * gamma)[..., None] * k)
    # O = P (u - w S) + q_g S with P = scale * scores: P meets D = u - w S after the state scan, so
    # neither P u nor P w is formed (sessions <= 5 had O = P u + (q_g - P w) S: one more C^2 dk product
    # per chunk forward and two more in the backward).
    q_eff = (scale * gamma)[..., None] * q
    k_dec = k * e_last[..., None]
    out = (scale * scores, q_eff, (gamma[..., -1], u, w, k_dec))
    return out, (q, k, v, beta, decay, gamma, e_last, qk, kk, t_inv, u, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _intra_chunk_delta(q, k, v, log_alpha, beta, scale):
    """The delta-rule precompute of every chunk (see the module docstring); a hand-written vjp."""
    return _intra_chunk_delta_fwd(q, k, v, log_alpha, beta, scale)[0]


def _intra_chunk_delta_bwd(scale, res, cts):
    """Reverse mode of :func:`_intra_chunk_delta_fwd`, written out so each product is one batched matmul
    and no intermediate is differentiated twice (autodiff of the forward spent 3x the forward's time
    here, much of it in transposes and copies between its matmuls).

    log_alpha enters through seg (segment sums) and gamma_t = exp(sum_{i <= t} log_alpha_i); both
    gradients are sums over the same segments, so no cancellation is introduced."""
    q, k, v, beta, decay, gamma, e_last, qk, kk, t_inv, u, w = res
    d_p, d_qeff, (d_cdecay, d_u, d_w, d_kdec) = cts
    size = beta.shape[-1]
    strict = jnp.arange(size)[:, None] > jnp.arange(size)[None, :]
    # p = scale * scores, q_eff = scale g Q
    d_scores = scale * d_p
    d_gamma = scale * jnp.sum(q * d_qeff, axis=-1)
    d_qk = d_scores * decay
    dq = scale * gamma[..., None] * d_qeff + _mm("...tj,...jk->...tk", d_qk, k)
    # U = T (b V), W = T (b g K), T = (I + A)^-1
    d_bv = _mm("...jt,...jv->...tv", t_inv, d_u)
    d_bgk = _mm("...jt,...jk->...tk", t_inv, d_w)
    # dT = dU (bV)^T + dW (bgK)^T and dA = -T^T dT T^T; with T^T dU = dbV, T bV = U (and the same for W):
    # dA = -(dbV U^T + dbgK W^T), two [C, C] products instead of four (no [C, C] x [C, C] ones).
    d_a = jnp.where(strict, -(_mm("...tv,...jv->...tj", d_bv, u) + _mm("...tk,...jk->...tj", d_bgk, w)), 0.0)
    # A = strict(b[t] KK[t, j] G[t, j])
    d_kk = d_a * beta[..., :, None] * decay
    k_bgk = jnp.sum(k * d_bgk, axis=-1)
    d_beta = jnp.sum(v * d_bv, axis=-1) + gamma * k_bgk + jnp.sum(d_a * kk * decay, axis=-1)
    d_gamma = d_gamma + beta * k_bgk
    dv = beta[..., None] * d_bv
    dk = ((beta * gamma)[..., None] * d_bgk + e_last[..., None] * d_kdec
          + _mm("...tj,...tk->...jk", d_qk, q)
          + _mm("...tj,...jk->...tk", d_kk + jnp.swapaxes(d_kk, -1, -2), k))
    # Through the decays: d seg on and below the diagonal (decay = exp(seg) there, 0 above)
    d_seg = (d_scores * qk + d_a * beta[..., :, None] * kk) * decay
    d_seg = d_seg.at[..., -1, :].add(jnp.sum(k * d_kdec, axis=-1) * e_last)
    d_gamma = d_gamma.at[..., -1].add(d_cdecay)
    # seg[t, j] sums log_alpha_i over j < i <= t, so d log_alpha_i = sum_{t >= i, j < i} dseg[t, j]: a suffix
    # sum over t, then a masked sum over j. (Not as rowsum - colsum of dseg: the diagonal and the terms
    # with j >= i would cancel there, and at strong decay they dwarf the result.)
    suffix = jnp.flip(jnp.cumsum(jnp.flip(d_seg, -2), axis=-2), -2)
    d_log_alpha = jnp.sum(jnp.where(strict, suffix, 0.0), axis=-1)
    d_log_alpha = d_log_alpha + jnp.flip(jnp.cumsum(jnp.flip(d_gamma * gamma, -1), axis=-1), -1)
    return dq, dk, dv, d_log_alpha, d_beta


_intra_chunk_delta.defvjp(_intra_chunk_delta_fwd, _intra_chunk_delta_bwd)


def _segments(seq_len: int, chunk_size: int) -> list[tuple[int, int, int]]:
    """(start, num_chunks, size): floor(T/C) full chunks, then the remainder as one smaller chunk."""
    full = seq_len // chunk_size
    segs = []
    if full:
        segs.append((0, full, chunk_size))
    if seq_len % chunk_size:
        segs.append((full * chunk_size, 1, seq_len % chunk_size))
    return segs


def _precompute(q, k, v, log_alpha, beta, *, scale: float, chunk_size: int):
    """Upcasts, cuts the sequence into segments of chunks and runs :func:`_intra_chunk` on each.

    Returns one ``(o_intra or p, q_eff, terms)`` per segment (see :func:`_intra_chunk`), chunk-major: the
    full chunks [N, B, H, C, ...], then the remainder as one chunk [1, B, H, T % C, ...]. ``terms`` drive
    the state recurrence: with beta ``(chunk_decay, u, w, k_dec)``, without ``(chunk_decay, h)``.
    """
    cdt = _compute_dtype(q, k, v, log_alpha, beta)
    parts = []
    for start, num, size in _segments(q.shape[2], chunk_size):
        def cut(x):
            if x is None:
                return None
            x = lax.slice_in_dim(x, start, start + num * size, axis=2).astype(cdt)
            return _to_chunks(x, num)

        parts.append(_intra_chunk(cut(q), cut(k), cut(v), cut(log_alpha), cut(beta), scale))
    return tuple(parts)


def _to_chunks(x, num):
    """[B, H, num * C, ...] -> chunk-major [num, B, H, C, ...]: the scans then slice their leading axis
    and every per-chunk array is made in that layout (no transposes around the scans)."""
    x = x.reshape(x.shape[:2] + (num, x.shape[2] // num) + x.shape[3:])
    return jnp.moveaxis(x, 2, 0)


def _from_chunks(x):
    """[num, B, H, C, ...] -> [B, H, num * C, ...]."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _state_update(state, terms):
    """One chunk of the state recurrence: (S_{n+1}, D_n or None)."""
    if len(terms) == 2:
        chunk_decay, h = terms
        return chunk_decay[..., None, None] * state + h, None
    chunk_decay, u, w, k_dec = terms
    delta = u - _mm("...ck,...kv->...cv", w, state)
    return chunk_decay[..., None, None] * state + _mm("...ck,...cv->...kv", k_dec, delta), delta


def _output_scan(parts, state0, out_dtype):
    """Forward without keeping the chunk states: q_eff_n S_n (and with beta D_n) inside the scan."""
    state = state0.astype(parts[0][1].dtype)
    outs = []
    for first, q_eff, terms in parts:
        if len(terms) == 4:        # with beta: D_n from the scan, then P_n D_n for all chunks at once
            def step(state, x):
                q_eff_n, terms_n = x
                out = _mm("...tk,...kv->...tv", q_eff_n, state)
                new, delta = _state_update(state, terms_n)
                return new, (out, delta)

            state, (o, deltas) = lax.scan(step, state, (q_eff, terms))
            o = o + _mm("...tj,...jv->...tv", first, deltas)
        else:
            def step(state, x):
                o_intra_n, q_eff_n, terms_n = x
                out = o_intra_n + _mm("...tk,...kv->...tv", q_eff_n, state)
                return _state_update(state, terms_n)[0], out

            state, o = lax.scan(step, state, (first, q_eff, terms))
        outs.append(_from_chunks(o))
    return jnp.concatenate(outs, axis=2).astype(out_dtype), state


def _state_scan(terms, state):
    """Runs the state over one segment's chunks.

    With beta: ``D_n = u_n - w_n S_n``, ``S_{n+1} = g_n S_n + k_dec_n^T D_n``; without:
    ``S_{n+1} = g_n S_n + h_n``. Returns (S_n at every chunk start [N, B, H, dk, dv], D_n [N, B, H, C, dv]
    or None, the state after the segment).
    """
    def step(state, x):
        new, delta = _state_update(state, x)
        return new, (state, delta)

    final, (starts, deltas) = lax.scan(step, state, terms)
    return starts, deltas, final


def _run_states(parts, state0):
    """State scans over all segments in order: per segment (starts, deltas), and the final state."""
    state = state0.astype(parts[0][1].dtype)
    out = []
    for _, _, terms in parts:
        starts, deltas, state = _state_scan(terms, state)
        out.append((starts, deltas))
    return tuple(out), state


def _assemble(parts, states, out_dtype):
    """O = o_intra + q_eff @ S_start (with beta: p @ D + q_eff @ S_start) per chunk, flattened back to
    [B, H, T, dv]."""
    outs = []
    for (first, q_eff, terms), (starts, deltas) in zip(parts, states):
        o = _mm("...tk,...kv->...tv", q_eff, starts)
        o = o + (_mm("...tj,...jv->...tv", first, deltas) if len(terms) == 4 else first)
        outs.append(_from_chunks(o))
    return jnp.concatenate(outs, axis=2).astype(out_dtype)


def _reverse_scan(first, q_eff, terms, starts, deltas, do, adj):
    """Adjoint of one segment's outputs (``O_n = o_intra_n + q_eff_n S_n``; with beta
    ``O_n = p_n D_n + q_eff_n S_n``, ``first`` being o_intra or p) and of its state scan.

    Only the adjoint recurrence is sequential (per chunk: adj_n = q_eff_n^T dO_n + g_n adj_{n+1}
    - w_n^T dD_n with dD_n = p_n^T dO_n + k_dec_n adj_{n+1}); the products that merely read S_n, D_n,
    dO_n or adj_{n+1} run before or after it as matmuls batched over all chunks. do [N, B, H, C, dv]:
    output cotangent; adj: adjoint of the state after the segment. Returns (cotangents of ``first``,
    of q_eff and of ``terms``, adjoint of the state before the segment).
    """
    with_beta = len(terms) == 4
    d_out_p = _mm("...tj,...tv->...jv", first, do) if with_beta else None     # p^T dO, part of dD

    def step(adj_next, x):
        q_eff_n, terms_n, do_n, dd_n = x
        adj = _mm("...tk,...tv->...kv", q_eff_n, do_n) + terms_n[0][..., None, None] * adj_next
        if not with_beta:
            return adj, (adj_next, None)
        _, _, w, k_dec = terms_n
        d_delta = dd_n + _mm("...ck,...kv->...cv", k_dec, adj_next)          # = d u
        return adj - _mm("...ck,...cv->...kv", w, d_delta), (adj_next, d_delta)

    adj, (adj_next, d_delta) = lax.scan(step, adj, (q_eff, terms, do, d_out_p), reverse=True)
    d_q_eff = _mm("...tv,...kv->...tk", do, starts)
    d_decay = jnp.sum(adj_next * starts, axis=(-2, -1))
    if not with_beta:
        return do, d_q_eff, (d_decay, adj_next), adj
    d_first = _mm("...tv,...jv->...tj", do, deltas)
    d_w = -_mm("...cv,...kv->...ck", d_delta, starts)
    d_kdec = _mm("...cv,...kv->...ck", deltas, adj_next)
    return d_first, d_q_eff, (d_decay, d_delta, d_w, d_kdec), adj


def _forward(q, k, v, log_alpha, beta, state0, scale, chunk_size):
    pre = functools.partial(_precompute, scale=scale, chunk_size=chunk_size)
    parts, pullback = jax.vjp(pre, q, k, v, log_alpha, beta)
    states, final = _run_states(parts, state0)
    return _assemble(parts, states, v.dtype), final, (pullback, parts, states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _chunked(q, k, v, log_alpha, beta, state0, scale: float, chunk_size: int, fat: bool):
    parts = _precompute(q, k, v, log_alpha, beta, scale=scale, chunk_size=chunk_size)
    return _output_scan(parts, state0, v.dtype)


def _chunked_fwd(q, k, v, log_alpha, beta, state0, scale, chunk_size, fat):
    if not fat:
        # Only the inputs: the backward recomputes the precompute and re-derives the chunk states.
        parts = _precompute(q, k, v, log_alpha, beta, scale=scale, chunk_size=chunk_size)
        return _output_scan(parts, state0, v.dtype), ((q, k, v, log_alpha, beta), state0)
    # Everything the backward needs: the precompute's own residuals, its outputs (not o_intra) and
    # every chunk-start state.
    o, final, (pullback, parts, states) = _forward(q, k, v, log_alpha, beta, state0, scale, chunk_size)
    parts = tuple((first if len(terms) == 4 else None, q_eff, terms) for first, q_eff, terms in parts)
    return (o, final), ((pullback, parts, states), state0)


def _chunked_bwd(scale, chunk_size, fat, res, cotangents):
    do, dfinal = cotangents
    saved, state0 = res
    if fat:
        pullback, parts, states = saved
    else:
        # The barrier (over the residuals and the cotangents, as jax.checkpoint does) keeps XLA from
        # CSE-ing this recomputation with the forward under one jit, which would keep every
        # intermediate alive and defeat the O(inputs) residuals.
        (saved, state0), do = lax.optimization_barrier(((saved, state0), do))
        pre = functools.partial(_precompute, scale=scale, chunk_size=chunk_size)
        parts, pullback = jax.vjp(pre, *saved)
        states, _ = _run_states(parts, state0)
    cdt = parts[0][1].dtype

    # Segments last to first; per chunk the output O = o_intra + q_eff @ S_start (with beta p @ D +
    # q_eff @ S_start) and the recurrence.
    adj = dfinal.astype(cdt)
    cts, end = [None] * len(parts), do.shape[2]
    for i in reversed(range(len(parts))):
        first, q_eff, terms = parts[i]
        num, size = q_eff.shape[0], q_eff.shape[3]
        do_seg = _to_chunks(lax.slice_in_dim(do, end - num * size, end, axis=2).astype(cdt), num)
        end -= num * size
        d_first, d_q_eff, d_terms, adj = _reverse_scan(first, q_eff, terms, *states[i], do_seg, adj)
        cts[i] = (d_first, d_q_eff, d_terms)
    dq, dk, dv, dlog_alpha, dbeta = pullback(tuple(cts))
    return dq, dk, dv, dlog_alpha, dbeta, adj.astype(state0.dtype)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _run_chunked(q, k, v, log_alpha, beta, scale, initial_state, return_final_state, chunk_size, fat,
                 by_slice=False):
    if initial_state is None:
        initial_state = jnp.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), _compute_dtype(q, k, v))
    initial_state = match_vma(initial_state, q, k, v, log_alpha, beta)   # the scans' carries vary like q
    if by_slice:
        o, final = _chunked_by_slice(q, k, v, log_alpha, beta, initial_state, float(scale), int(chunk_size))
    else:
        o, final = _chunked(q, k, v, log_alpha, beta, initial_state, float(scale), int(chunk_size), fat)
    return (o, final) if return_final_state else o


def _slice_map(fn, args):
    """lax.map of ``fn`` over the (batch, head) slices of [B, H, ...] arrays (None passes through): fn gets
    [1, 1, ...] slices; its outputs come back as [B, H, ...]."""
    bsz, heads = args[0].shape[:2]
    # The mapped axis is B*H with no size-1 axes after it: with [B*H, 1, 1, ...] operands XLA CPU gave the
    # reshaped parameters a layout that needed a physical copy of every input (4 x 8 MB at B2 H8 T2048
    # dk64), which pushed the temp buffer past glibc's 32 MB mmap threshold: ~12k page faults per call.
    flat = [None if x is None else x.reshape((bsz * heads,) + x.shape[2:]) for x in args]

    def one(xs):
        out = fn(tuple(None if x is None else x[None, None] for x in xs))
        return jax.tree.map(lambda x: x[0, 0], out)

    out = lax.map(one, tuple(flat))
    return jax.tree.map(lambda x: x.reshape((bsz, heads) + x.shape[1:]), out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _chunked_by_slice(q, k, v, log_alpha, beta, state0, scale: float, chunk_size: int):
    """The chunked path on one (batch, head) slice at a time. Same results as the batched version; what
    changes is the size of XLA's temporaries, 1 / (B H) of the batched version's. On CPU that decides the
    speed: XLA allocates its temp buffer per call and glibc maps every block over 32 MB fresh, so the
    batched version page-faults its whole temp in on every call (session 4, EPYC box, B2 H8 T2048
    fwd+bwd: 223 -> 185 ms at dk64, 433 -> 379 ms at dk128, system time 95 -> 30 and 174 -> 58 ms;
    forward 79 -> 50 ms at dk64). On a GPU the slices would run one after the other, so this is the
    dispatcher's CPU option only. Its own custom_vjp keeps the residuals to the inputs (the backward
    maps the per-slice vjp, which recomputes as the batched one does)."""
    return _slice_map(lambda a: _chunked(*a, scale, chunk_size, False), (q, k, v, log_alpha, beta, state0))


def _chunked_by_slice_fwd(q, k, v, log_alpha, beta, state0, scale, chunk_size):
    out = _chunked_by_slice(q, k, v, log_alpha, beta, state0, scale, chunk_size)
    return out, (q, k, v, log_alpha, beta, state0)


def _chunked_by_slice_bwd(scale, chunk_size, res, cotangents):
    def one(a):
        *primals, do, dfinal = a
        _, pullback = jax.vjp(lambda *p: _chunked(*p, scale, chunk_size, False), *primals)
        return pullback((do, dfinal))

    return _slice_map(one, (*res, *cotangents))


_chunked_by_slice.defvjp(_chunked_by_slice_fwd, _chunked_by_slice_bwd)


@functools.partial(jax.jit, static_argnames=_STATIC + ("sequential_heads",))
def gated_delta_rule_chunked(q, k, v, log_alpha, beta=None, *, scale: float, initial_state=None,
                             return_final_state: bool = False, chunk_size: int = 64,
                             sequential_heads: bool = False):
    """Chunk-parallel XLA path; custom_vjp saving only the inputs (residuals O(inputs)).

    The backward recomputes the batched intra-chunk work and the chunk-start states (a forward scan),
    then runs the reverse scan. Shapes as :func:`gated_delta_rule_recurrent`. ``sequential_heads``: one
    (batch, head) slice at a time (:func:`_chunked_by_slice`; the dispatcher's choice on CPU).
    """
    return _run_chunked(q, k, v, log_alpha, beta, scale, initial_state, return_final_state, chunk_size,
                        fat=False, by_slice=sequential_heads)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_delta_rule_chunked_fat(q, k, v, log_alpha, beta=None, *, scale: float, initial_state=None,
                                 return_final_state: bool = False, chunk_size: int = 64):
    """Same forward as :func:`gated_delta_rule_chunked`; saves the intra-chunk intermediates and the
    per-chunk states so the backward recomputes nothing (residuals O(T * (C + dk * dv / C)))."""
    return _run_chunked(q, k, v, log_alpha, beta, scale, initial_state, return_final_state, chunk_size,
                        fat=True)
