"""Sequence-split decode_attention and gated_delta_rule (``context_axis=``).

decode_attention over a cache split along its sequence axis (the long-context serving case): device i
holds cache rows [i * Lmax / n, (i + 1) * Lmax / n). It attends its rows with the op's implementation, run
on the local problem translated by -i * Lmax / n (lengths, positions and the mods' indices shift
together), and one log-sum-exp merge across the axis (``pmax`` of the lse, ``psum`` of the weighted
outputs and weights) gives the result on every device.

gated_delta_rule over a sequence split along the axis. On a device's part of the sequence the state map
is affine, ``S_end = A S_start + B`` (``A`` the product of the decays ``exp(log_alpha) (I - beta k k^T)``,
a [dk, dk] matrix per batch and head; without beta a multiple of the identity). One run of the chunked
implementation on the augmented values ``[0 | v]`` from the state ``[I | 0]`` gives all of it at once:
the final state is ``[A | B]``, and the outputs are ``[u_t | o_t]`` with ``o_t`` the outputs from a zero
start and ``u_t = scale A_t^T q_t`` (``A_t`` the map up to token t), so the true outputs are
``o_t + u_t^T S_start``. The [dk, dk + dv] maps of all devices are all-gathered (small: no q/k/v moves),
each device folds those before it into its ``S_start``, and the last device's final state is the
global one. Forward and backward are JAX autodiff through that program (the implementation's own
custom_vjp, ``all_gather``, a scan over the devices). The cost is one run with dk + dv value columns
instead of dv.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flashlax.fallbacks.attention import NEG_INF
from flashlax.parallel.shard import Placement, local_kv_heads, shift_mod
from flashlax.parallel.vma import match_vma


def merge_across(axis: str, out, lse):
    """Log-sum-exp merge of per-device partial attention over the mesh axis ``axis``: out [..., Dv] (each
    normalised by its own sum), lse [...]. Fully masked rows everywhere: out 0, lse -inf."""
    m = lax.pmax(lse, axis)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    weight = jnp.exp(lse - m_safe)                       # 0 where this device saw nothing
    total = lax.psum(weight, axis)
    merged = lax.psum(weight[..., None] * out.astype(weight.dtype), axis)
    has_any = total > 0
    safe = jnp.where(has_any, total, 1.0)
    return merged / safe[..., None], jnp.where(has_any, m_safe + jnp.log(safe), NEG_INF)


def decode_attention(placement: Placement, call, q, k_cache, v_cache, kv_lens, *, score_mod, mask_mod,
                     return_lse: bool):
    op = "decode_attention"
    axis, parts = placement.context, placement.context_size
    max_len, q_len = placement.global_len(k_cache.shape[2]), q.shape[2]
    if max_len % parts or max_len // parts < q_len:
        raise ValueError(f"{op}: the cache length Lmax={max_len} must split evenly over context_axis={axis!r} "
                         f"({parts} devices) into parts of at least Lq={q_len} rows (k_cache {k_cache.shape})")
    heads, kv_heads = q.shape[1], k_cache.shape[1]

    def local(q, k_cache, v_cache, kv_lens):
        first = (lax.axis_index(axis) * k_cache.shape[2]).astype(jnp.int32)   # global position of row 0
        b0 = placement.offset("b", q.shape[0])
        h0 = placement.offset("h", q.shape[1])
        k_cache, v_cache = local_kv_heads(placement, k_cache, v_cache, heads, kv_heads, h0)
        # The local problem is the global one translated by -first. Its lengths may lie past the local
        # rows (all visible) or below Lq (the new tokens lie beyond them): the implementations read rows
        # in [0, min(length, local Lmax)) and place the new tokens at length - Lq + i.
        lens = kv_lens.astype(jnp.int32) - first
        shift = dict(b=b0, h=h0, q_pos=lambda i: i + first, kv_pos=lambda j: j + first)
        out, lse = call(q, k_cache, v_cache, lens, shift_mod(score_mod, "score", **shift),
                        shift_mod(mask_mod, "mask", **shift), return_lse=True)
        out, lse = merge_across(axis, out, lse)
        out = out.astype(q.dtype)
        return (out, lse.astype(jnp.float32)) if return_lse else out

    return placement.run(local, (q, k_cache, v_cache, kv_lens), ("bh..", "bks.", "bks.", "b"),
                         ("bh..", "bh.") if return_lse else "bh..")


def gated_delta_rule(placement: Placement, call, q, k, v, log_alpha, beta, initial_state, *,
                     return_final_state: bool):
    op = "gated_delta_rule"
    axis, parts = placement.context, placement.context_size
    if placement.global_len(q.shape[2]) % parts:
        raise ValueError(f"{op}: the sequence length T={q.shape[2]} must split evenly over context_axis="
                         f"{axis!r} ({parts} devices) (q {q.shape})")

    def local(q, k, v, log_alpha, beta, initial_state):
        batch, heads, _, dk = q.shape
        dv = v.shape[-1]
        state_dtype = jnp.promote_types(jnp.float32, v.dtype)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=state_dtype), (batch, heads, dk, dk))
        start = jnp.concatenate([eye, jnp.zeros((batch, heads, dk, dv), state_dtype)], axis=-1)
        v_aug = jnp.concatenate([jnp.zeros(v.shape[:3] + (dk,), v.dtype), v], axis=-1)
        o_aug, s_aug = call(q, k, v_aug, log_alpha, beta, start, return_final_state=True)
        u, o_zero = o_aug[..., :dk], o_aug[..., dk:]
        decay, offset = s_aug[..., :dk], s_aug[..., dk:]          # this part's map: S -> decay S + offset
        decays, offsets = lax.all_gather(decay, axis), lax.all_gather(offset, axis)
        me = lax.axis_index(axis)
        state0 = (jnp.zeros((batch, heads, dk, dv), state_dtype) if initial_state is None
                  else initial_state.astype(state_dtype))
        state0 = match_vma(state0, decays, offsets)

        def step(state, part):
            decay_j, offset_j = part
            return jnp.einsum("...ij,...jv->...iv", decay_j, state, precision=lax.Precision.HIGHEST) + offset_j, state

        _, starts = lax.scan(step, state0, (decays, offsets))        # the state entering each part
        start_me = lax.dynamic_index_in_dim(starts, me, keepdims=False)
        o = o_zero.astype(state_dtype) + jnp.einsum("...tk,...kv->...tv", u.astype(state_dtype), start_me,
                                                    precision=lax.Precision.HIGHEST)
        o = o.astype(v.dtype)
        if not return_final_state:
            return o
        final_me = jnp.einsum("...ij,...jv->...iv", decay, start_me, precision=lax.Precision.HIGHEST) + offset
        final = lax.psum(jnp.where(me == parts - 1, final_me, 0.0), axis)   # the last part's, on every device
        return o, final

    outs = ("bhs.", "bh..") if return_final_state else "bhs."
    return placement.run(local, (q, k, v, log_alpha, beta, initial_state),
                         ("bhs.",) * 3 + ("bhs",) * 2 + ("bh..",), outs)
