"""gated_delta_rule on the GPU, impl "ssd": Pallas kernels (Triton lowering), forward; the Pallas backward is in
:mod:`flashlax.kernels.ssd_bwd`. ``backward="auto"`` (the default) takes the faster backward on the H200: the
chunked XLA path's backward with beta and a head dim over 128, the Pallas kernels otherwise; both on the same
residuals, the inputs.

The chunked algorithm of ``flashlax/fallbacks/linear.py`` (see its docstring for the algebra) split into
kernels by parallelism. Per chunk of C tokens with state ``S`` at its start::

    with beta:  D = u - w S,   u = T (beta v),   w = T (beta gamma k),   T = (I + A)^-1
    O = P D + q_g S,   S' = g_C S + k_dec^T D          (without beta: D = v, no T at all)

1. ``_precompute_kernel`` (one program per chunk, batch and head; with beta, or in the transition form):
   A and its inverse T from 16 x 16 diagonal blocks inverted in closed form and block forward-substitution
   merges, then w and u; in the transition form also ``M = g_C I - k_dec^T w`` and ``H = k_dec^T u``
   (``k_dec^T v`` without beta).
2. ``_state_kernel`` (one program per batch, head and ``state_block_v`` columns of dv): the sequential pass
   over the chunks, the float32 state in registers, storing each chunk's start state. Two forms
   (``SSDConfig.transition``): ``D = u - w S`` (stored), ``S <- g_C S + k_dec^T D``: two products per
   step; or ``S <- M S + H``: one product (none without beta), D formed later by the output kernel. With
   ``SSDConfig.kdec`` the precompute stores k_dec and the two-product form reads it, so no decay vector is
   formed inside the sequential chain.
3. ``_output_kernel`` (one program per chunk, batch and head): O = P D + q_g S with P recomputed from q, k.
   With ``SSDConfig.fuse_out`` (two-product form) the forward's state pass forms O itself for its dv
   columns as it goes (``_chunk_output``): no chunk states or D are stored and no output kernel runs.

Numerics. Every decay is ``exp`` of a segment sum of log_alpha inside one chunk: for two positions in
different sub-blocks it is (suffix of the earlier block) + (whole blocks between) + (prefix of the later
block), inside one sub-block a masked triangular product. Each is a sum of terms <= 0, so no exponent is
positive (no overflow at log_alpha = -1e4), none cancels (a difference of prefix sums after a -1e4 token
would lose 1e-3 absolute in float32), and masked entries are exp(0) = 1 zeroed afterwards (no 0 * inf at
log_alpha = 0). The last partial chunk is read and written with row masks (log_alpha 0, every other input
0 past the end), never padded in memory. float32 inputs: 16 x 16 x 16 products in IEEE float32, larger
ones per ``SSDConfig.f32_dot`` ("ieee", or "tf32x3": three tf32 tensor-core passes, hi*hi + hi*lo + lo*hi,
measured 3e-7 relative from the IEEE XLA path); bf16/f16 inputs: products of data-sized tiles on the
tensor cores with float32 accumulation; the state, every decay and the UT transform in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashlax.kernels._ssd_tiles import (F32, UT_BLOCK, Decays, Static, add_all, call, chunk_decays, chunk_delta,
                                         chunk_keys, chunk_rows, col_bound, dot, iota, load, load_square,
                                         load_vec, mat_spec, mm, named, p_blocks, per_chunk_arg, per_chunk_out,
                                         seq_arg, seq_out, sequential_program, state_block, store,
                                         store_chunk_matrix, store_state, ut_apply, ut_blocks, ut_diagonal,
                                         ut_solve, vec_spec)
from flashlax._precision import uses_tf32
from flashlax.kernels.configs import FUSE_OUT_MAX_CHUNK, SSDConfig, check_ssd_config, ssd_config
from flashlax.parallel.vma import cotangent_like, match_vma


def _precompute_kernel(*refs, names, st: Static):
    """One chunk. With beta: w = T (beta gamma k) [C, dk], u = T (beta v) [C, dv], and T itself [C, C] when
    asked ("t": the backward's UT kernel reads it instead of inverting again); with ``st.transition`` also
    M = g I - k_dec^T w [dk, dk] and H = k_dec^T u [dk, dv] (float32). Without beta (transition only):
    H = k_dec^T v."""
    r = named(refs, names)
    sb = UT_BLOCK
    rows = chunk_rows(st, sb)
    nb = len(rows)
    row_m = pl.program_id(0) * st.dkp
    k = [load(r["k"], row, sb, 0, st.dkp, st, col_bound(st.dk, st.dkp)) for row in rows]
    dec = chunk_decays(r["la"], rows, sb, st)
    if "inc" in r or "kdec" in r:
        k_dec = decayed_keys(k, dec, st)
        if "kdec" in r:
            for i in range(nb):
                store(r["kdec"], rows[i], 0, k_dec[i], st)
    if st.has_beta:
        beta = [load_vec(r["beta"], row, sb, st) for row in rows]
        if st.config.ut_subst and not st.transition and "t" not in r:
            # SSDConfig.ut_subst: T's diagonal blocks only, w and u by block forward substitution
            a, _, _, inv = ut_diagonal(k, beta, dec, st)
            a = {(i, j): mm(a[i, j], st) for i in range(nb) for j in range(i)}
            solve = functools.partial(ut_solve, a, [mm(x, st) for x in inv], st=st)
        else:
            t, kk, g_strict = ut_blocks(k, beta, dec, st)
            t = {key: mm(x, st) for key, x in t.items()}
            if "t" in r:
                store_chunk_matrix(r["t"], rows, t, st)
            if "kg" in r:     # SSDConfig.store_kg: k k^T * G_strict for the wy kernel, float32
                store_chunk_matrix(r["kg"], rows, {key: kk[key] * g_strict[key] for key in kk}, st)
            solve = functools.partial(ut_apply, t, st=st)
        w = solve([(beta[j] * dec.gamma(j))[:, None] * k[j].astype(F32) for j in range(nb)])
        for i in range(nb):
            store(r["w"], rows[i], 0, w[i], st)
        if "m" in r:
            store_state(r["m"], row_m, 0, transition_matrix(k_dec, w, dec, st), st)
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        x = [load(r["v"], row, sb, c0, bv, st, col_bound(st.dv, st.dvp)).astype(F32) for row in rows]
        if st.has_beta:
            x = solve([beta[j][:, None] * x[j] for j in range(nb)])     # u
            for i in range(nb):
                store(r["u"], rows[i], c0, x[i], st)
        if "inc" in r:
            store_state(r["inc"], row_m, c0, transposed_product(k_dec, x, st), st)


def decayed_keys(k, dec: Decays, st: Static):
    """k_dec: each sub-block of k decayed to the chunk end (mm dtype)."""
    return [mm(dec.e_last(i)[:, None] * k[i].astype(F32), st) for i in range(len(k))]


def transposed_product(k_dec, x, st: Static):
    """k_dec^T x [dkp, cols] float32 over the chunk's sub-blocks (H = k_dec^T u, and M's k_dec^T w)."""
    return add_all(dot(k_dec[i], mm(x[i], st), st, ta=True) for i in range(len(k_dec)))


def transition_matrix(k_dec, w, dec: Decays, st: Static):
    """M = g I - k_dec^T w [dkp, dkp] float32 of one chunk from its sub-blocks."""
    eye = jnp.where(iota((st.dkp, st.dkp), 0) == iota((st.dkp, st.dkp), 1), dec.chunk_decay(), 0.0)
    return eye - transposed_product(k_dec, w, st)


def _mh_kernel(*refs, names, st: Static):
    """One chunk, the transition form with beta when ``SSDConfig.mh_kernel``: M = g I - k_dec^T w and
    H = k_dec^T u from the stored w and u, on ``st.block("mh")`` sub-blocks (the precompute's 16 x 16 UT
    structure does it on [16, dk] pieces)."""
    r = named(refs, names)
    sb = st.block("mh")
    rows = chunk_rows(st, sb)
    row_m = pl.program_id(0) * st.dkp
    dec = chunk_decays(r["la"], rows, sb, st)
    k_dec = decayed_keys([load(r["k"], row, sb, 0, st.dkp, st, col_bound(st.dk, st.dkp)) for row in rows], dec, st)
    store_state(r["m"], row_m, 0,
                transition_matrix(k_dec, [load(r["w"], row, sb, 0, st.dkp, st) for row in rows], dec, st), st)
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        u = [load(r["u"], row, sb, c0, bv, st) for row in rows]
        store_state(r["inc"], row_m, c0, transposed_product(k_dec, u, st), st)


def _state_kernel(*refs, names, st: Static):
    """Sequential pass over the chunks for dv columns [iv * bv, (iv + 1) * bv): the float32 state S [dk, bv]
    in registers; per chunk stores h_n = S, then S <- M_n S + H_n (``st.transition``; without beta
    S <- g S + H_n) or D = u - w S (stored as "d" when asked; D = v without beta), S <- g S + k_dec^T D.
    Writes the final state. With an "o" output (``SSDConfig.fuse_out``) also each chunk's output for these
    columns, O = P D + q_g S_n (:func:`_chunk_output`), instead of storing h and D for the output kernel."""
    r = named(refs, names)
    bv, col0, c, kcols, vcols = sequential_program(st)
    fused = "o" in r

    def body(n, s):
        r0, row_m = n * c, n * st.dkp
        if "h" in r:
            store_state(r["h"], row_m, col0, s, st)
        if st.transition:
            inc = load_square(r["inc"], row_m, col0, st, bv)
            if st.has_beta:
                return dot(mm(load_square(r["m"], row_m, 0, st, st.dkp), st), mm(s, st), st) + inc
            return jnp.exp(jnp.sum(load_vec(r["la"], r0, c, st))) * s + inc
        la = load_vec(r["la"], r0, c, st)
        k_dec, decay, gamma = chunk_keys(r, r0, la, st, kcols, gamma=fused)
        if st.has_beta:
            w = load(r["w"], r0, c, 0, st.dkp, st)
            d = load(r["u"], r0, c, col0, bv, st).astype(F32) - dot(w, mm(s, st), st)
            if "d" in r:
                store(r["d"], r0, col0, d, st)
        else:
            d = load(r["v"], r0, c, col0, bv, st, vcols).astype(F32)
        if fused:
            _chunk_output(r, r0, col0, la, gamma, mm(s, st), mm(d, st), st, kcols)
        return decay * s + dot(k_dec, mm(d, st), st, ta=True)

    s = lax.fori_loop(jnp.int32(0), jnp.int32(st.n_chunks), body, state_block(r["s0"], 0, col0, st, bv))
    store_state(r["final"], 0, col0, s, st, user=True)


def _chunk_output(r, r0, col0, la, gamma, h, d, st: Static, kcols):
    """``SSDConfig.fuse_out``: the output of the chunk at row ``r0`` for the dv columns of ``d``, O = P D +
    q_g S_n with P = scale (q k^T * G) and q_g = scale gamma q, as :func:`_output_kernel` forms them on one
    chunk-sized sub-block (h: S_n and d: D in the mm dtype, as that kernel reads them stored)."""
    c = st.chunk
    q = load(r["q"], r0, c, 0, st.dkp, st, kcols)
    k = load(r["k"], r0, c, 0, st.dkp, st, kcols)
    p = mm(p_blocks([q], [k], Decays([la], c), st)[0, 0], st)
    q_g = mm((st.scale * gamma)[:, None] * q.astype(F32), st)
    o = dot(p, d, st) + dot(q_g, h, st)
    store(r["o"], r0, col0, o, st, col_bound(st.dv, st.dvp))


def _output_kernel(*refs, names, st: Static):
    """One chunk: O = P D + q_g S_n, D as :func:`chunk_delta`."""
    r = named(refs, names)
    sb = st.block("out")
    rows = chunk_rows(st, sb)
    nb = len(rows)
    kcols = col_bound(st.dk, st.dkp)
    q = [load(r["q"], row, sb, 0, st.dkp, st, kcols) for row in rows]
    k = [load(r["k"], row, sb, 0, st.dkp, st, kcols) for row in rows]
    dec = chunk_decays(r["la"], rows, sb, st)
    p = {key: mm(x, st) for key, x in p_blocks(q, k, dec, st).items()}
    q_g = [mm((st.scale * dec.gamma(i))[:, None] * q[i].astype(F32), st) for i in range(nb)]
    w = [load(r["w"], row, sb, 0, st.dkp, st) for row in rows] if "w" in r else None
    h_row = pl.program_id(0) * st.dkp
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        h = mm(load_square(r["h"], h_row, c0, st, bv), st)
        d = chunk_delta(r, rows, sb, c0, bv, h, w, st)
        for i in range(nb):
            o = add_all(dot(p[i, j], d[j], st) for j in range(i + 1)) + dot(q_g[i], h, st)
            store(r["o"], rows[i], c0, o, st, col_bound(st.dv, st.dvp))


def precompute_call(st: Static, k, v, la, beta, emit_t: bool = False, emit_kg: bool | None = None) -> dict:
    """The per-chunk parallel precompute: w, u [B, H, T, dkp / dvp] in the input dtype (with beta; with
    ``st.kdec`` also k_dec [B, H, T, dkp], k decayed to its chunk's end, for the state pass), and with
    ``emit_t`` T [B, H, T, C] (row r: row r % C of its chunk's T; input dtype; with ``SSDConfig.store_kg`` also
    "kg": k k^T * G_strict [B, H, T, C] float32, laid out as T, unless ``emit_kg`` is False); M [B, H, N * dkp,
    dkp] (with beta) and H [B, H, N * dkp, dvp] float32 (with ``st.transition``). {} when none of these."""
    bh = k.shape[:2]
    outputs = {}
    if st.has_beta:
        outputs.update(_wu_outputs(st, bh, kg=emit_t and (st.config.store_kg if emit_kg is None else emit_kg)))
        if emit_t:
            outputs["t"] = seq_out(st, bh, st.chunk, st.mm_dtype)
    if st.transition and not st.mh_kernel:
        if st.has_beta:
            outputs["m"] = per_chunk_out(st, bh, st.dkp)
        outputs["inc"] = per_chunk_out(st, bh, st.dvp)
    if not outputs:
        return {}
    inputs = dict(k=seq_arg(k, st, st.dkp), v=seq_arg(v, st, st.dvp), la=(la, vec_spec(st)))
    if st.has_beta:
        inputs["beta"] = (beta, vec_spec(st))
    pre = call(_precompute_kernel, st, st.n_chunks, inputs, outputs, name="ssd_precompute")
    if st.transition and st.mh_kernel:
        pre.update(mh_call(st, k, la, pre))
    return pre


def _wu_outputs(st: Static, bh, kg: bool) -> dict:
    """The with-beta outputs shared by the precompute and the wu kernel: w, u [B, H, T, dkp / dvp] in the input
    dtype, with ``st.kdec`` k_dec, with ``kg`` KG [B, H, T, C] float32."""
    outputs = {"w": seq_out(st, bh, st.dkp, st.mm_dtype), "u": seq_out(st, bh, st.dvp, st.mm_dtype)}
    if st.kdec:
        outputs["kdec"] = seq_out(st, bh, st.dkp, st.mm_dtype)
    if kg:
        outputs["kg"] = seq_out(st, bh, st.chunk, F32)
    return outputs


def _wu_kernel(*refs, names, st: Static):
    """One chunk of the backward's precompute from the saved T (``SSDConfig.save_t``), on one chunk-wide tile:
    w = T (beta gamma k) and u = T (beta v) as [C, C] x [C, d] products; with "kg" also k k^T * G_strict (the wy
    kernel's, ``SSDConfig.store_kg``); with ``st.transition`` M and H; with ``st.kdec`` k_dec stored."""
    r = named(refs, names)
    c = st.chunk
    row = chunk_rows(st, c)[0]
    row_m = pl.program_id(0) * st.dkp
    dec = chunk_decays(r["la"], [row], c, st)
    beta = load_vec(r["beta"], row, c, st)
    k = load(r["k"], row, c, 0, st.dkp, st, col_bound(st.dk, st.dkp))
    if "kg" in r:
        store(r["kg"], row, 0, dot(k, k, st, tb=True) * dec.G(0, 0, strict=True), st)
    t = mm(load(r["t"], row, c, 0, c, st), st)
    w = dot(t, mm((beta * dec.gamma(0))[:, None] * k.astype(F32), st), st)
    store(r["w"], row, 0, w, st)
    k_dec = decayed_keys([k], dec, st)
    if "kdec" in r:
        store(r["kdec"], row, 0, k_dec[0], st)
    if "m" in r:
        store_state(r["m"], row_m, 0, transition_matrix(k_dec, [w], dec, st), st)
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        v = load(r["v"], row, c, c0, bv, st, col_bound(st.dv, st.dvp)).astype(F32)
        u = dot(t, mm(beta[:, None] * v, st), st)
        store(r["u"], row, c0, u, st)
        if "inc" in r:
            store_state(r["inc"], row_m, c0, transposed_product(k_dec, [u], st), st)


def wu_call(st: Static, k, v, la, beta, t) -> dict:
    """The backward's precompute from the forward's saved T (``SSDConfig.save_t``, with beta): the outputs of
    ``precompute_call(..., emit_t=True)``, T itself passed through."""
    bh = k.shape[:2]
    outputs = _wu_outputs(st, bh, kg=st.config.store_kg)
    if st.transition:
        outputs.update(m=per_chunk_out(st, bh, st.dkp), inc=per_chunk_out(st, bh, st.dvp))
    inputs = dict(k=seq_arg(k, st, st.dkp), v=seq_arg(v, st, st.dvp), la=(la, vec_spec(st)),
                  beta=(beta, vec_spec(st)), t=seq_arg(t, st, st.chunk))
    return {**call(_wu_kernel, st, st.n_chunks, inputs, outputs, name="ssd_wu"), "t": t}


def mh_call(st: Static, k, la, pre: dict) -> dict:
    """``SSDConfig.mh_kernel``: {"m": M, "inc": H} [B, H, N * dkp, dkp / dvp] float32 from the stored w and u."""
    bh = k.shape[:2]
    inputs = dict(k=seq_arg(k, st, st.dkp), la=(la, vec_spec(st)), w=seq_arg(pre["w"], st, st.dkp),
                  u=seq_arg(pre["u"], st, st.dvp))
    outputs = {"m": per_chunk_out(st, bh, st.dkp), "inc": per_chunk_out(st, bh, st.dvp)}
    return call(_mh_kernel, st, st.n_chunks, inputs, outputs, name="ssd_mh")


def state_call(st: Static, k, v, la, s0, pre: dict, emit_delta: bool = False, q=None) -> dict:
    """{"final": [B, H, dk, dv] float32, "h": chunk-start states [B, H, N * dkp, dvp] in the input dtype,
    and "d": D [B, H, T, dvp] when ``emit_delta`` (with beta, not ``st.transition``)}; with ``q`` (fused output,
    :func:`fuses_output`) {"final", "o": O [B, H, T, dv] in v's dtype} instead."""
    bh = k.shape[:2]
    inputs = {"la": (la, vec_spec(st))}
    if q is not None:
        inputs.update(q=seq_arg(q, st, st.dkp), k=seq_arg(k, st, st.dkp))
    if st.transition:
        inputs["inc"] = per_chunk_arg(pre["inc"], st)
        if st.has_beta:
            inputs["m"] = per_chunk_arg(pre["m"], st)
    else:
        if "kdec" in pre:
            inputs["kdec"] = seq_arg(pre["kdec"], st, st.dkp)
        elif "k" not in inputs:
            inputs["k"] = seq_arg(k, st, st.dkp)
        if st.has_beta:
            inputs.update(w=seq_arg(pre["w"], st, st.dkp), u=seq_arg(pre["u"], st, st.dvp))
        else:
            inputs["v"] = seq_arg(v, st, st.dvp)
    inputs["s0"] = (s0, mat_spec(st.dkp, st.dvp))
    outputs = {"final": (jax.ShapeDtypeStruct(bh + (st.dk, st.dv), F32), mat_spec(st.dkp, st.dvp))}
    if q is not None:
        outputs["o"] = seq_out(st, bh, st.dvp, v.dtype, full=st.dv)
    else:
        outputs["h"] = per_chunk_out(st, bh, st.dvp, st.mm_dtype)
    if q is None and emit_delta and st.has_beta and not st.transition:
        outputs["d"] = seq_out(st, bh, st.dvp, st.mm_dtype)
    return call(_state_kernel, st, st.dvp // st.state_block_v(), inputs, outputs, sequential=True,
                name="ssd_state")


def delta_args(st: Static, v, pre: dict, states: dict) -> dict:
    """What :func:`chunk_delta` reads: the stored D, or u and w (D formed in the kernel), or v."""
    if "d" in states:
        return {"d": seq_arg(states["d"], st, st.dvp)}
    if st.has_beta:
        return {"u": seq_arg(pre["u"], st, st.dvp), "w": seq_arg(pre["w"], st, st.dkp)}
    return {"v": seq_arg(v, st, st.dvp)}


def output_call(st: Static, q, k, v, la, pre: dict, states: dict):
    """O [B, H, T, dv] in v's dtype."""
    bh = q.shape[:2]
    inputs = dict(q=seq_arg(q, st, st.dkp), k=seq_arg(k, st, st.dkp), la=(la, vec_spec(st)),
                  h=per_chunk_arg(states["h"], st), **delta_args(st, v, pre, states))
    outputs = {"o": seq_out(st, bh, st.dvp, v.dtype, full=st.dv)}
    return call(_output_kernel, st, st.n_chunks, inputs, outputs, name="ssd_out")["o"]


# ----------------------------------------------------------------------------------------------------
# custom_vjp and entry point
# ----------------------------------------------------------------------------------------------------

def forward(st: Static, q, k, v, la, beta, s0, pre: dict | None = None, with_h: bool = False):
    """(o, final state), and the chunk-start states h when ``with_h``; ``pre``: the precompute's outputs when
    already formed."""
    if pre is None:
        pre = precompute_call(st, k, v, la, beta)
    if fuses_output(st):
        assert not with_h, "the fused output pass writes no states"
        states = state_call(st, k, v, la, s0, pre, q=q)
        return states["o"], states["final"]
    states = state_call(st, k, v, la, s0, pre, emit_delta=True)
    out = output_call(st, q, k, v, la, pre, states), states["final"]
    return out + (states["h"],) if with_h else out


def fuses_output(st: Static) -> bool:
    """Whether the forward's state pass forms the output itself (``SSDConfig.fuse_out``; the two-product
    form, where it forms D: not the transition form)."""
    return st.config.fuse_out and not st.transition and st.chunk <= FUSE_OUT_MAX_CHUNK


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ssd(q, k, v, la, beta, s0, st: Static):
    return forward(st, q, k, v, la, beta, s0)


def saves_t(st: Static) -> bool:
    """Whether the forward saves T for the Pallas backward (``SSDConfig.save_t``, with beta)."""
    return st.config.save_t and st.has_beta and st.backward != "xla"


def saves_h(st: Static) -> bool:
    """Whether the forward keeps its chunk-start states for the Pallas backward (``SSDConfig.save_h``, with
    beta; not where the state pass forms the output itself and writes no states)."""
    return st.config.save_h and st.has_beta and st.backward != "xla" and not fuses_output(st)


def _ssd_fwd(q, k, v, la, beta, s0, st):
    """Residuals: the inputs, and T and h as the config asks (None where not saved)."""
    save_t, save_h = saves_t(st), saves_h(st)
    pre = precompute_call(st, k, v, la, beta, emit_t=True, emit_kg=False) if save_t else None
    out = forward(st, q, k, v, la, beta, s0, pre, with_h=save_h)
    return out[:2], (q, k, v, la, beta, s0, pre["t"] if save_t else None, out[2] if save_h else None)


def _ssd_bwd(st, res, cts):
    res, t, h = res[:6], res[6], res[7]
    if st.backward == "xla":
        # the chunked XLA path's backward: the same residuals (the inputs), recomputes in XLA
        from flashlax.fallbacks.linear import _chunked_bwd

        q, k, v, la, beta, s0 = res
        with jax.default_matmul_precision("tensorfloat32" if st.tf32 else "float32"):   # as the forward's
            grads = _chunked_bwd(st.scale, st.chunk, False, ((q, k, v, la, beta), s0), cts)
    else:
        from flashlax.kernels.ssd_bwd import backward

        grads = backward(st, *res, *cts, t=t, h=h)
    # each cotangent typed like its primal (dtype, and the mesh axes it varies over inside shard_map)
    return tuple(None if g is None else cotangent_like(g, x) for g, x in zip(grads, res))


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def make_static(q, k, v, beta, *, scale: float, chunk_size: int, interpret: bool, config: SSDConfig | None,
                device_kind: str | None, backward: str = "auto") -> Static:
    """Checks dtypes and head dims, picks and checks the config; the kernels' static description."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"gated_delta_rule_ssd: q, k, v must share one dtype of float32/bfloat16/float16, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype} (shapes {q.shape}, {k.shape}, {v.shape})")
    seq_len, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    if max(dk, dv) > 256:
        raise ValueError(f"gated_delta_rule_ssd: head dims up to 256 are supported, got q {q.shape}, v {v.shape}")
    kind = device_kind
    if kind is None:
        kind = "cpu-interpret" if interpret else jax.devices()[0].device_kind
    cfg = (ssd_config(dk, dv, q.dtype, kind) if config is None else config).resolved(beta is not None)
    chunk = min(int(chunk_size), cfg.max_chunk)
    check_ssd_config(cfg, dk, dv, chunk, q.dtype, kind)
    if backward not in ("auto", "pallas", "xla"):
        raise ValueError(f"gated_delta_rule_ssd: backward must be 'auto', 'pallas' or 'xla', got {backward!r}")
    if backward == "auto":      # the faster one on the H200 (docs/PERF_NOTES.md, sessions 8, 9, 11 and 14)
        backward = "xla" if beta is not None and max(dk, dv) > 128 else "pallas"
    return Static(backward=backward, config=cfg, scale=float(scale), chunk=chunk, seq_len=seq_len, dk=dk, dv=dv,
                  has_beta=beta is not None, dtype=jnp.dtype(q.dtype), interpret=bool(interpret),
                  tf32=uses_tf32(q.dtype))


@functools.partial(jax.jit, static_argnames=("scale", "return_final_state", "chunk_size", "interpret", "config",
                                             "device_kind", "backward"))
def gated_delta_rule_ssd(q, k, v, log_alpha, beta=None, *, scale: float, initial_state=None,
                         return_final_state: bool = False, chunk_size: int = 64, interpret: bool = False,
                         config: SSDConfig | None = None, device_kind: str | None = None,
                         backward: str = "auto"):
    """Gated delta rule (``beta`` given) or gated linear attention / Mamba-2 SSD (``beta=None``), Pallas.

    q, k: [B, H, T, dk]; v: [B, H, T, dv] (one dtype of float32/bfloat16/float16, dk, dv <= 256);
    log_alpha, beta: [B, H, T]; initial_state: [B, H, dk, dv] or None. Returns o [B, H, T, dv] in v's
    dtype (and the final state [B, H, dk, dv] float32). Differentiable in every array (custom_vjp whose
    residuals are the inputs, plus the UT transform T and the chunk-start states h where the config sets
    ``save_t`` / ``save_h``). ``config``: an SSDConfig (default: :func:`ssd_config` for the device kind);
    a chunk_size above its ``max_chunk`` runs at ``max_chunk`` (the same function). ``backward``: "pallas"
    (the Pallas backward kernels), "xla" (the backward of the chunked XLA path on the same residuals, the
    inputs) or "auto" (the faster on the H200: "xla" with beta and dk or dv over 128, else "pallas";
    docs/PERF_NOTES.md).
    """
    st = make_static(q, k, v, beta, scale=scale, chunk_size=chunk_size, interpret=interpret, config=config,
                     device_kind=device_kind, backward=backward)
    batch, heads, _, dk = q.shape
    dv = v.shape[-1]
    la = log_alpha.astype(F32)
    beta32 = None if beta is None else beta.astype(F32)
    s0 = jnp.zeros((batch, heads, dk, dv), F32) if initial_state is None else initial_state.astype(F32)
    s0 = match_vma(s0, q, k, v, la, beta32)      # inside a caller's shard_map: varies like the inputs
    o, final = _ssd(q, k, v, la, beta32, s0, st)
    return (o, final) if return_final_state else o
