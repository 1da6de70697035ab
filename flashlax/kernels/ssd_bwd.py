"""Backward of the ssd kernels (:mod:`flashlax.kernels.ssd`). The residuals are the inputs; this recomputes.

Per chunk n with start state S_n, the forward is ``D_n = u_n - w_n S_n`` (D = v without beta),
``O_n = P_n D_n + q_g S_n``, ``S_{n+1} = g_n S_n + k_dec^T D_n``. With ``dh_n`` the adjoint of S_{n+1}:

    dD_n = P_n^T dO_n + k_dec dh_n,     dh_{n-1} = q_g^T dO_n + g_n dh_n - w_n^T dD_n

Kernels, in order:
1. forward pieces again: ``ssd.ut_call`` (w, u), ``ssd.state_call`` (chunk states h_n, D_n);
2. ``ssd.output_call(transpose=True)``: P^T dO for every chunk (parallel);
3. ``_reverse_kernel``: the adjoint recurrence, sequential over chunks from the last (one program per
   batch, head and dv block, the float32 adjoint in registers); writes dh_n, dD_n and d initial_state;
4. ``_dqk_kernel`` (parallel): cotangents of P, q_g, w, k_dec and g from dO, D, dD, h, dh, then dq, the
   P and k_dec parts of dk, dw, and log_alpha's gradient through those decays. Without beta it finishes dk
   and d log_alpha, and dv is dD;
5. ``_wy_kernel`` (with beta, parallel): the UT transform's reverse mode (T again from k, beta,
   log_alpha): dv, dbeta, the rest of dk and d log_alpha.
Every output element is written by exactly one program (no atomics): the backward is deterministic.
log_alpha's gradient collects, per position, exactly the terms whose segment contains it (``Decays.grad``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashlax.kernels import ssd
from flashlax.kernels.ssd import (F32, UT_BLOCK, Decays, Static, _cols, _sum, call, chunk_rows, chunk_vectors, ds,
                                  dot, load, load_vec, mat_spec, mm, seq_spec, state_block, store, store_state,
                                  store_vec, ut_blocks, vec_spec)


def _reverse_kernel(*refs, st: Static):
    """Adjoint recurrence for dv columns [iv * bv, (iv + 1) * bv), chunks last to first."""
    if st.has_beta:
        q_ref, k_ref, la_ref, w_ref, do_ref, ddl_ref, dfinal_ref, dh_ref, dd_ref, ds0_ref = refs
    else:
        q_ref, k_ref, la_ref, do_ref, ddl_ref, dfinal_ref, dh_ref, dd_ref, ds0_ref = refs
    bv = st.state_block_v()
    col0 = pl.program_id(0) * bv
    c = st.chunk
    kcols, vcols = _cols(st.dk, st.dkp), _cols(st.dv, st.dvp)

    def body(i, adj):
        n = st.n_chunks - 1 - i
        r0 = n * c
        gamma, e_last, decay = chunk_vectors(load_vec(la_ref, r0, c, st), st)
        store_state(dh_ref, n * st.dkp, col0, adj, st, user=False)
        k_dec = mm(load(k_ref, r0, c, 0, st.dkp, st, kcols).astype(F32) * e_last[:, None], st)
        dd = load(ddl_ref, r0, c, col0, bv, st) + dot(k_dec, mm(adj, st), st)
        # without beta dD is v's gradient: stored in v's dtype and shape
        store(dd_ref, r0, col0, dd, st, None if st.has_beta else vcols)
        q_g = mm((st.scale * gamma)[:, None] * load(q_ref, r0, c, 0, st.dkp, st, kcols).astype(F32), st)
        adj = decay * adj + dot(q_g, load(do_ref, r0, c, col0, bv, st, vcols), st, ta=True)
        if st.has_beta:
            adj = adj - dot(load(w_ref, r0, c, 0, st.dkp, st), mm(dd, st), st, ta=True)
        return adj

    adj = lax.fori_loop(jnp.int32(0), jnp.int32(st.n_chunks), body, state_block(dfinal_ref, 0, col0, st, bv))
    store_state(ds0_ref, 0, col0, adj, st, user=True)


def _dqk_kernel(*refs, st: Static):
    """One chunk: dq, dk (P and k_dec parts; all of it without beta), dw = -dD h^T, d log_alpha (all of it
    without beta)."""
    if st.has_beta:
        q_ref, k_ref, la_ref, d_ref, dd_ref, h_ref, dh_ref, do_ref, dq_ref, dk_ref, dw_ref, dla_ref = refs
    else:
        q_ref, k_ref, la_ref, d_ref, h_ref, dh_ref, do_ref, dq_ref, dk_ref, dla_ref = refs
    sb = st.block()
    rows = chunk_rows(st, sb)
    nb = len(rows)
    pairs = [(i, j) for i in range(nb) for j in range(i + 1)]
    kcols, vcols = _cols(st.dk, st.dkp), _cols(st.dv, st.dvp)
    q = [load(q_ref, r, sb, 0, st.dkp, st, kcols) for r in rows]
    k = [load(k_ref, r, sb, 0, st.dkp, st, kcols) for r in rows]
    dec = Decays([load_vec(la_ref, r, sb, st) for r in rows], sb, st)

    zeros = jnp.zeros((sb, st.dkp), F32)
    d_qg, d_kdec, d_w = [zeros] * nb, [zeros] * nb, [zeros] * nb
    d_p = {key: jnp.zeros((sb, sb), F32) for key in pairs}
    d_decay = 0.0
    h_row = pl.program_id(0) * st.dkp
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        h = plgpu.load(h_ref.at[ds(h_row, st.dkp), ds(c0, bv)])
        dh = plgpu.load(dh_ref.at[ds(h_row, st.dkp), ds(c0, bv)])
        d_decay = d_decay + jnp.sum(h.astype(F32) * dh)
        h, dh = mm(h, st), mm(dh, st)
        do = [load(do_ref, r, sb, c0, bv, st, vcols) for r in rows]
        d = [load(d_ref, r, sb, c0, bv, st, None if st.has_beta else vcols) for r in rows]
        for i in range(nb):
            d_qg[i] = d_qg[i] + dot(do[i], h, st, tb=True)
            d_kdec[i] = d_kdec[i] + dot(d[i], dh, st, tb=True)
        if st.has_beta:
            for i, r in enumerate(rows):
                d_w[i] = d_w[i] - dot(mm(load(dd_ref, r, sb, c0, bv, st), st), h, st, tb=True)
        for i, j in pairs:
            d_p[i, j] = d_p[i, j] + dot(do[i], d[j], st, tb=True)

    gamma = [dec.gamma(i) for i in range(nb)]
    e_last = [dec.e_last(i) for i in range(nb)]
    qk, d_qk = {}, {}
    for i, j in pairs:
        g = dec.G(i, j)
        qk[i, j] = dot(q[i], k[j], st, tb=True)
        d_qk[i, j] = st.scale * d_p[i, j] * g             # d(q k^T) through P = scale (q k^T * G)
    for i in range(nb):
        dq = (st.scale * gamma[i])[:, None] * d_qg[i] + _sum(dot(mm(d_qk[i, j], st), k[j], st) for j in range(i + 1))
        store(dq_ref, rows[i], 0, dq, st, kcols)
        dk = e_last[i][:, None] * d_kdec[i] + _sum(dot(mm(d_qk[m, i], st), q[m], st, ta=True) for m in range(i, nb))
        store(dk_ref, rows[i], 0, dk, st, None if st.has_beta else kcols)
        if st.has_beta:
            store(dw_ref, rows[i], 0, d_w[i], st)
    d_exp = {key: d_qk[key] * qk[key] for key in pairs}
    d_gamma = [st.scale * jnp.sum(q[i].astype(F32) * d_qg[i], axis=1) * gamma[i] for i in range(nb)]
    d_elast = [jnp.sum(k[i].astype(F32) * d_kdec[i], axis=1) * e_last[i] for i in range(nb)]
    dla = dec.grad(d_exp, d_gamma, d_elast, d_decay * dec.chunk_decay())
    for i in range(nb):
        store_vec(dla_ref, rows[i], dla[i], st)


def _wy_kernel(k_ref, v_ref, la_ref, beta_ref, w_ref, u_ref, dw_ref, dd_ref, dk1_ref, dla1_ref,
               dk_ref, dv_ref, dbeta_ref, dla_ref, *, st: Static):
    """One chunk: reverse mode of u = T (beta v), w = T (beta gamma k), T = (I + A)^-1, given du = dD and
    dw; adds dk1 and dla1 (from _dqk_kernel) into the final dk and d log_alpha.

    With d_bv = T^T du and d_bgk = T^T dw: dA = -(d_bv u^T + d_bgk w^T) (T^T du = d_bv, T (beta v) = u)."""
    sb = UT_BLOCK
    rows = chunk_rows(st, sb)
    nb = len(rows)
    pairs = [(i, j) for i in range(nb) for j in range(i + 1)]
    kcols, vcols = _cols(st.dk, st.dkp), _cols(st.dv, st.dvp)
    beta = [load_vec(beta_ref, r, sb, st) for r in rows]
    k = [load(k_ref, r, sb, 0, st.dkp, st, kcols) for r in rows]
    dec = Decays([load_vec(la_ref, r, sb, st) for r in rows], sb, st)
    t, kk, g = ut_blocks(k, beta, dec, st)
    t = {key: mm(x, st) for key, x in t.items()}
    gamma = [dec.gamma(i) for i in range(nb)]
    dw = [mm(load(dw_ref, r, sb, 0, st.dkp, st), st) for r in rows]
    w = [load(w_ref, r, sb, 0, st.dkp, st) for r in rows]
    d_bgk = [_sum(dot(t[i, j], dw[i], st, ta=True) for i in range(j, nb)) for j in range(nb)]
    d_a = {(i, j): -dot(mm(d_bgk[i], st), w[j], st, tb=True) for i, j in pairs}
    dbeta = [jnp.zeros((sb,), F32)] * nb
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        du = [mm(load(dd_ref, r, sb, c0, bv, st), st) for r in rows]
        u = [load(u_ref, r, sb, c0, bv, st) for r in rows]
        d_bv = [_sum(dot(t[i, j], du[i], st, ta=True) for i in range(j, nb)) for j in range(nb)]
        for i, j in pairs:
            d_a[i, j] = d_a[i, j] - dot(mm(d_bv[i], st), u[j], st, tb=True)
        for i, r in enumerate(rows):
            v = load(v_ref, r, sb, c0, bv, st, vcols).astype(F32)
            dbeta[i] = dbeta[i] + jnp.sum(v * d_bv[i], axis=1)
            store(dv_ref, r, c0, beta[i][:, None] * d_bv[i], st, vcols)
    # A = strict(beta_t (k k^T) * G): g is the strict decay, so d_a outside A's support drops out here
    k_bgk = [jnp.sum(k[i].astype(F32) * d_bgk[i], axis=1) for i in range(nb)]
    d_kk = {(i, j): d_a[i, j] * beta[i][:, None] * g[i, j] for i, j in pairs}
    for i in range(nb):
        dbeta[i] = (dbeta[i] + gamma[i] * k_bgk[i]
                    + _sum(jnp.sum(d_a[i, j] * kk[i, j] * g[i, j], axis=1) for j in range(i + 1)))
        dk = ((beta[i] * gamma[i])[:, None] * d_bgk[i] + load(dk1_ref, rows[i], sb, 0, st.dkp, st)
              + _sum(dot(mm(d_kk[i, j], st), k[j], st) for j in range(i + 1))
              + _sum(dot(mm(d_kk[m, i], st), k[m], st, ta=True) for m in range(i, nb)))
        store(dk_ref, rows[i], 0, dk, st, kcols)
        store_vec(dbeta_ref, rows[i], dbeta[i], st)
    d_exp = {key: d_kk[key] * kk[key] for key in pairs}
    dla = dec.grad(d_exp, [beta[i] * k_bgk[i] * gamma[i] for i in range(nb)])
    for i, r in enumerate(rows):
        store_vec(dla_ref, r, dla[i] + load_vec(dla1_ref, r, sb, st), st)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers and the backward driver
# ----------------------------------------------------------------------------------------------------

def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def reverse_call(st: Static, q, k, la, w, do, ddl, dfinal):
    """(dh [B, H, N * dkp, dvp] float32, dD [B, H, T, dvp] float32 (without beta: dv [B, H, T, dv] in v's
    dtype), d initial_state [B, H, dk, dv] float32)."""
    bh = q.shape[:2]
    in_specs = [seq_spec(st, st.dkp), seq_spec(st, st.dkp), vec_spec(st)]
    args = [q, k, la]
    if st.has_beta:
        in_specs.append(seq_spec(st, st.dkp))
        args.append(w)
    in_specs += [seq_spec(st, st.dvp), seq_spec(st, st.dvp), mat_spec(st.dkp, st.dvp)]
    args += [do, ddl, dfinal]
    hrows = st.n_chunks * st.dkp
    dd_shape = _sds(bh + (st.seq_len, st.dvp), F32) if st.has_beta else _sds(bh + (st.seq_len, st.dv), do.dtype)
    out_specs = [mat_spec(hrows, st.dvp), seq_spec(st, st.dvp), mat_spec(st.dkp, st.dvp)]
    out_shape = [_sds(bh + (hrows, st.dvp), F32), dd_shape, _sds(bh + (st.dk, st.dv), F32)]
    return call(functools.partial(_reverse_kernel, st=st), st, st.dvp // st.state_block_v(), bh, in_specs,
                out_specs, out_shape, *args, sequential=True, name="ssd_reverse")


def dqk_call(st: Static, q, k, la, d, dd, h, dh, do):
    """With beta: (dq, dk part float32 [B, H, T, dkp], dw float32 [B, H, T, dkp], d log_alpha part
    float32); without: (dq, dk, d log_alpha)."""
    bh = q.shape[:2]
    hrows = st.n_chunks * st.dkp
    in_specs = [seq_spec(st, st.dkp), seq_spec(st, st.dkp), vec_spec(st), seq_spec(st, st.dvp)]
    args = [q, k, la, d]
    if st.has_beta:
        in_specs.append(seq_spec(st, st.dvp))
        args.append(dd)
    in_specs += [mat_spec(hrows, st.dvp), mat_spec(hrows, st.dvp), seq_spec(st, st.dvp)]
    args += [h, dh, do]
    seq = lambda width, dtype: _sds(bh + (st.seq_len, width), dtype)  # noqa: E731
    if st.has_beta:
        out_specs = [seq_spec(st, st.dkp)] * 3 + [vec_spec(st)]
        out_shape = [seq(st.dk, q.dtype), seq(st.dkp, F32), seq(st.dkp, F32), _sds(bh + (st.seq_len,), F32)]
    else:
        out_specs = [seq_spec(st, st.dkp)] * 2 + [vec_spec(st)]
        out_shape = [seq(st.dk, q.dtype), seq(st.dk, k.dtype), _sds(bh + (st.seq_len,), F32)]
    return call(functools.partial(_dqk_kernel, st=st), st, st.n_chunks, bh, in_specs, out_specs, out_shape,
                *args, name="ssd_dqk")


def wy_call(st: Static, k, v, la, beta, w, u, dw, dd, dk1, dla1):
    """(dk, dv, dbeta float32, d log_alpha float32)."""
    bh = k.shape[:2]
    sk, sv, vec = seq_spec(st, st.dkp), seq_spec(st, st.dvp), vec_spec(st)
    in_specs = [sk, sv, vec, vec, sk, sv, sk, sv, sk, vec]
    out_specs = [sk, sv, vec, vec]
    out_shape = [_sds(bh + (st.seq_len, st.dk), k.dtype), _sds(bh + (st.seq_len, st.dv), v.dtype),
                 _sds(bh + (st.seq_len,), F32), _sds(bh + (st.seq_len,), F32)]
    return call(functools.partial(_wy_kernel, st=st), st, st.n_chunks, bh, in_specs, out_specs, out_shape,
                k, v, la, beta, w, u, dw, dd, dk1, dla1, name="ssd_wy_bwd")


def backward(st: Static, q, k, v, la, beta, s0, do, dfinal):
    """Cotangents (dq, dk, dv, d log_alpha, dbeta or None, d initial_state) of ``ssd._ssd``."""
    do = do.astype(v.dtype)
    dfinal = dfinal.astype(F32)
    if st.has_beta:
        w, u = ssd.ut_call(st, k, v, la, beta)
        _, h, d = ssd.state_call(st, k, la, w, u, s0, emit_delta=True)
    else:
        w = u = None
        _, h, _ = ssd.state_call(st, k, la, None, v, s0, emit_delta=False)
        d = v
    ddl = ssd.output_call(st, q, k, la, do, transpose=True)
    dh, dd, ds0 = reverse_call(st, q, k, la, w, do, ddl, dfinal)
    if not st.has_beta:
        dq, dk, dla = dqk_call(st, q, k, la, d, None, h, dh, do)
        return dq, dk, dd, dla, None, ds0
    dq, dk1, dw, dla1 = dqk_call(st, q, k, la, d, dd, h, dh, do)
    dk, dv, dbeta, dla = wy_call(st, k, v, la, beta, w, u, dw, dd, dk1, dla1)
    return dq, dk, dv, dla, dbeta, ds0
