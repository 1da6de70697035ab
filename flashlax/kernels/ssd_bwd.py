"""Backward of the ssd kernels (:mod:`flashlax.kernels.ssd`). The residuals are the inputs; this recomputes.

Per chunk n with start state S_n, the forward is ``D_n = u_n - w_n S_n`` (D = v without beta),
``O_n = P_n D_n + q_g S_n``, ``S_{n+1} = g_n S_n + k_dec^T D_n``. With ``dh_n`` the adjoint of S_{n+1}:

    dD_n = P_n^T dO_n + k_dec dh_n,     dh_{n-1} = q_g^T dO_n + g_n dh_n - w_n^T dD_n
                                                 = M_n^T dh_n + R_n,   R_n = q_g^T dO_n - w_n^T P_n^T dO_n

Kernels, in order:
1. the forward's precompute and state pass again (w, u, M, H; chunk start states h_n, and D_n in the
   two-product form);
2. ``_dout_kernel`` (parallel): P^T dO for every chunk, and R_n in the transition form;
3. ``_reverse_kernel``: the adjoint recurrence, sequential over chunks from the last (one program per
   batch, head and dv block, the float32 adjoint in registers); writes dh_n and d initial_state, and dD_n
   in the two-product form;
4. ``_dqk_kernel`` (parallel): cotangents of P, q_g, w, k_dec and g from dO, D, dD, h, dh (D and dD formed
   here in the transition form), then dq, the P and k_dec parts of dk, dw, and log_alpha's gradient through
   those decays. Without beta it finishes dk and d log_alpha, and dv is dD;
5. ``_wy_kernel`` (with beta, parallel): the UT transform's reverse mode (T read: the precompute of step 1
   stores it here): dv, dbeta, the rest of dk and d log_alpha.
Every output element is written by exactly one program (no atomics): the backward is deterministic.
log_alpha's gradient collects, per position, exactly the terms whose segment contains it (``Decays.grad``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashlax.kernels import ssd
from flashlax.kernels._ssd_tiles import (F32, Static, add_all, call, chunk_decays, chunk_delta, chunk_rows,
                                         chunk_keys, col_bound, dot, load, load_square, load_vec, mat_spec, mm,
                                         named, p_blocks, per_chunk_arg, per_chunk_out, seq_arg, seq_out,
                                         sequential_program, state_block, store, store_chunk_matrix, store_state,
                                         store_vec, vec_out, vec_spec)
from flashlax.kernels._tiles import sum_all


def _dout_kernel(*refs, names, st: Static):
    """One chunk: P^T dO (float32); with ``st.transition`` or ``st.reverse_rinc`` also R = q_g^T dO - w^T P^T dO
    [dk, dv], the part of the adjoint step that does not depend on the adjoint; with ``SSDConfig.store_p`` P
    itself ([C, C] per chunk, float32)."""
    r = named(refs, names)
    sb = st.block("dout")
    rows = chunk_rows(st, sb)
    nb = len(rows)
    kcols, vcols = col_bound(st.dk, st.dkp), col_bound(st.dv, st.dvp)
    q = [load(r["q"], row, sb, 0, st.dkp, st, kcols) for row in rows]
    k = [load(r["k"], row, sb, 0, st.dkp, st, kcols) for row in rows]
    dec = chunk_decays(r["la"], rows, sb, st)
    p = p_blocks(q, k, dec, st)
    if "p" in r:        # SSDConfig.store_p, float32
        store_chunk_matrix(r["p"], rows, p, st)
    p = {key: mm(x, st) for key, x in p.items()}
    if "rinc" in r:
        q_g = [mm((st.scale * dec.gamma(i))[:, None] * q[i].astype(F32), st) for i in range(nb)]
        w = [load(r["w"], row, sb, 0, st.dkp, st) for row in rows] if st.has_beta else None
    row_m = pl.program_id(0) * st.dkp
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        do = [load(r["do"], row, sb, c0, bv, st, vcols) for row in rows]
        ddl = [add_all(dot(p[i, j], do[i], st, ta=True) for i in range(j, nb)) for j in range(nb)]
        for j in range(nb):
            store(r["ddl"], rows[j], c0, ddl[j], st)
        if "rinc" in r:
            rinc = add_all(dot(q_g[i], do[i], st, ta=True) for i in range(nb))
            if st.has_beta:
                rinc = rinc - add_all(dot(w[j], mm(ddl[j], st), st, ta=True) for j in range(nb))
            store_state(r["rinc"], row_m, c0, rinc, st)


def _reverse_kernel(*refs, names, st: Static):
    """Adjoint recurrence for dv columns [iv * bv, (iv + 1) * bv), chunks last to first: stores dh_n (the
    adjoint of S_{n+1}), then adj <- M_n^T adj + R_n (``st.transition``; without beta g adj + R_n), or
    dD = P^T dO + k_dec adj (stored; without beta it is dv), adj <- q_g^T dO + g adj - w^T dD; with
    ``st.reverse_rinc`` the same with R_n from the dout kernel: x = k_dec adj, dD = P^T dO + x (stored),
    adj <- g adj + R_n - w^T x (two products in the chain instead of three, no q or dO read)."""
    r = named(refs, names)
    bv, col0, c, kcols, vcols = sequential_program(st)

    def body(i, adj):
        n = st.n_chunks - 1 - i
        r0, row_m = n * c, n * st.dkp
        store_state(r["dh"], row_m, col0, adj, st)
        if st.transition:
            rinc = load_square(r["rinc"], row_m, col0, st, bv)
            if st.has_beta:
                return dot(mm(load_square(r["m"], row_m, 0, st, st.dkp), st), mm(adj, st), st, ta=True) + rinc
            return jnp.exp(jnp.sum(load_vec(r["la"], r0, c, st))) * adj + rinc
        k_dec, decay, gamma = chunk_keys(r, r0, load_vec(r["la"], r0, c, st), st, kcols, gamma="rinc" not in r)
        if "rinc" in r:
            x = dot(k_dec, mm(adj, st), st)
            store(r["dd"], r0, col0, load(r["ddl"], r0, c, col0, bv, st) + x, st)
            return (decay * adj + load_square(r["rinc"], row_m, col0, st, bv)
                    - dot(load(r["w"], r0, c, 0, st.dkp, st), mm(x, st), st, ta=True))
        dd = load(r["ddl"], r0, c, col0, bv, st) + dot(k_dec, mm(adj, st), st)
        store(r["dd"], r0, col0, dd, st, None if st.has_beta else vcols)
        q_g = mm((st.scale * gamma)[:, None] * load(r["q"], r0, c, 0, st.dkp, st, kcols).astype(F32), st)
        adj = decay * adj + dot(q_g, load(r["do"], r0, c, col0, bv, st, vcols), st, ta=True)
        if st.has_beta:
            adj = adj - dot(load(r["w"], r0, c, 0, st.dkp, st), mm(dd, st), st, ta=True)
        return adj

    adj = lax.fori_loop(jnp.int32(0), jnp.int32(st.n_chunks), body, state_block(r["dfinal"], 0, col0, st, bv))
    store_state(r["ds0"], 0, col0, adj, st, user=True)


def _dqk_kernel(*refs, names, st: Static):
    """One chunk: dq, dk (P and k_dec parts; all of it without beta), dw = -dD h^T, d log_alpha (all of it
    without beta). D as :func:`ssd.chunk_delta`; dD read ("dd") or formed as P^T dO + k_dec dh and stored
    ("dd_out": the UT kernel's du, or dv without beta).

    The dk columns are done in passes of ``st.dqk_block_k()`` (SSDConfig.dqk_block_k; one pass by default):
    each pass accumulates the [C, bk] cotangents of q_g, k_dec and w for its columns over the dv blocks and
    writes dq, dk, dw there, so three [C, bk] float32 accumulators are live instead of three [C, dk] ones.
    The first pass also forms dP = dO D^T (and stores dD when formed here); q k^T (for log_alpha's gradient)
    adds up over the passes (with ``SSDConfig.store_p`` it is not formed: P, read, stands in for it). With
    several passes D and dD are read again (or formed again) per pass."""
    r = named(refs, names)
    sb = st.block("dqk")
    rows = chunk_rows(st, sb)
    nb = len(rows)
    pairs = [(i, j) for i in range(nb) for j in range(i + 1)]
    kcols, vcols = col_bound(st.dk, st.dkp), col_bound(st.dv, st.dvp)
    bk = st.dqk_block_k()
    whole = bk == st.dkp
    dec = chunk_decays(r["la"], rows, sb, st)
    gamma = [dec.gamma(i) for i in range(nb)]
    e_last = [dec.e_last(i) for i in range(nb)]
    w = [load(r["w"], row, sb, 0, st.dkp, st) for row in rows] if "w" in r else None
    k_dec = None
    if "ddl" in r:
        k_dec = [mm(e_last[i][:, None] * load(r["k"], row, sb, 0, st.dkp, st, kcols).astype(F32), st)
                 for i, row in enumerate(rows)]
    h_row = pl.program_id(0) * st.dkp
    bv = st.block_v()
    d_p = {key: jnp.zeros((sb, sb), F32) for key in pairs}
    qk = {key: jnp.zeros((sb, sb), F32) for key in pairs}
    d_qk = None
    d_decay = 0.0
    d_gamma = [jnp.zeros((sb,), F32)] * nb
    d_elast = [jnp.zeros((sb,), F32)] * nb
    pack = dqk_packs(st, r)
    pair_do = dqk_pairs_do(st)
    for k0 in range(0, st.dkp, bk):
        first = k0 == 0
        q = [load(r["q"], row, sb, k0, bk, st, kcols) for row in rows]
        k = [load(r["k"], row, sb, k0, bk, st, kcols) for row in rows]
        zeros = jnp.zeros((sb, bk), F32)
        d_qg, d_kdec, d_w = [zeros] * nb, [zeros] * nb, [zeros] * nb
        for c0 in range(0, st.dvp, bv):
            h = load_square(r["h"], h_row + k0, c0, st, bv, bk)
            dh = load_square(r["dh"], h_row + k0, c0, st, bv, bk)
            d_decay = d_decay + sum_all(h.astype(F32) * dh)
            h, dh = mm(h, st), mm(dh, st)
            h_all = h if whole else mm(load_square(r["h"], h_row, c0, st, bv), st)
            do = [load(r["do"], row, sb, c0, bv, st, vcols) for row in rows]
            d = chunk_delta(r, rows, sb, c0, bv, h_all, w, st)
            for i in range(nb):
                if not pair_do:
                    d_qg[i] = d_qg[i] + dot(do[i], h, st, tb=True)
                if not pack:
                    d_kdec[i] = d_kdec[i] + dot(d[i], dh, st, tb=True)
            if st.has_beta or "dd_out" in r:
                if "dd" in r:
                    dd = [load(r["dd"], row, sb, c0, bv, st) for row in rows]
                else:
                    dh_all = dh if whole else mm(load_square(r["dh"], h_row, c0, st, bv), st)
                    x = [dot(k_dec[i], dh_all, st) for i in range(nb)]
                    dd = [load(r["ddl"], row, sb, c0, bv, st) + x[i] for i, row in enumerate(rows)]
                    if pack:    # e_last (k . D dh^T) = rowsum(D * x) with x = k_dec dh, formed for dD anyway
                        d_elast[0] = jnp.sum(d[0].astype(F32) * x[0], axis=1)
                    if first:
                        for i, row in enumerate(rows):
                            store(r["dd_out"], row, c0, dd[i], st, None if st.has_beta else vcols)
                if st.has_beta:
                    for i in range(nb):
                        d_w[i] = d_w[i] - dot(mm(dd[i], st), h, st, tb=True)
            if first and pair_do:     # dO [D^T | h^T] = [dP | dO h^T], one product over paired columns
                d_p[0, 0], d_qg[0] = _unpair(dot(do[0], _pair(d[0].T, h.T), st))
            elif first:
                for i, j in pairs:
                    d_p[i, j] = d_p[i, j] + dot(do[i], d[j], st, tb=True)
        if first:      # d(q k^T) through P = scale (q k^T * G)
            d_qk = {key: st.scale * d_p[key] * dec.G(*key) for key in pairs}
        if "p" not in r:
            for i, j in pairs:
                qk[i, j] = qk[i, j] + dot(q[i], k[j], st, tb=True)
        for i in range(nb):
            dq = (st.scale * gamma[i])[:, None] * d_qg[i] + add_all(dot(mm(d_qk[i, j], st), k[j], st)
                                                                   for j in range(i + 1))
            store(r["dq"], rows[i], k0, dq, st, kcols)
            if pack:     # [e_last D | dQK^T] [dh | q^T]^T = e_last D dh^T + dQK^T q, one product
                dk = dot(_pair(mm(e_last[0][:, None] * d[0].astype(F32), st), mm(d_qk[0, 0], st).T),
                         _pair(dh, q[0].T), st, tb=True)
            else:
                dk = e_last[i][:, None] * d_kdec[i] + add_all(dot(mm(d_qk[m, i], st), q[m], st, ta=True)
                                                               for m in range(i, nb))
            store(r["dk"], rows[i], k0, dk, st, None if st.has_beta else kcols)
            if st.has_beta:
                store(r["dw"], rows[i], k0, d_w[i], st)
            d_gamma[i] = d_gamma[i] + jnp.sum(q[i].astype(F32) * d_qg[i], axis=1)
            if not pack:
                d_elast[i] = d_elast[i] + jnp.sum(k[i].astype(F32) * d_kdec[i], axis=1)
    if "p" in r:       # d_qk * q k^T = dP * scale (q k^T * G) = dP * P (SSDConfig.store_p)
        d_exp = {(i, j): d_p[i, j] * load(r["p"], rows[i], sb, j * sb, sb, st) for i, j in pairs}
    else:
        d_exp = {key: d_qk[key] * qk[key] for key in pairs}
    d_gamma = [st.scale * d_gamma[i] * gamma[i] for i in range(nb)]
    if not pack:     # (packed: formed with e_last already in x = k_dec dh)
        d_elast = [d_elast[i] * e_last[i] for i in range(nb)]
    dla = dec.grad(d_exp, d_gamma, d_elast, d_decay * dec.chunk_decay())
    for i in range(nb):
        store_vec(r["dla"], rows[i], dla[i], st)


def _dqk_lean_kernel(*refs, names, st: Static):
    """:func:`_dqk_kernel` on one chunk-wide tile (one dk pass, one dv block), its steps ordered so that few
    [C, C]-sized float32 tiles are live at once (``SSDConfig.dqk_lean``): each input is loaded where it is
    used (q twice, k up to three times: one load kept live across the dD and dw products spills more), each
    product's operands die as early as the algebra allows, and the row sums of log_alpha's gradient are taken
    as soon as their tiles exist; its P part is reduced last, when only dP * P is live (``scripts/
    offline_ptxas.py``, session 25: spill stores 3128 -> 968 bytes; one k load for k_dec and D dh^T: 1004)."""
    r = named(refs, names)
    c = st.chunk
    row = chunk_rows(st, c)[0]
    kcols, vcols = col_bound(st.dk, st.dkp), col_bound(st.dv, st.dvp)
    dec = chunk_decays(r["la"], [row], c, st)
    h_row = pl.program_id(0) * st.dkp
    h = load_square(r["h"], h_row, 0, st, st.dvp, st.dkp)
    dh = load_square(r["dh"], h_row, 0, st, st.dvp, st.dkp)
    d_total = sum_all(h.astype(F32) * dh) * dec.chunk_decay()
    h, dh = mm(h, st), mm(dh, st)
    w = [load(r["w"], row, c, 0, st.dkp, st)] if "w" in r else None
    d = chunk_delta(r, [row], c, 0, st.dvp, h, w, st)[0]
    e_last = dec.e_last(0)
    if st.has_beta or "dd_out" in r:
        if "dd" in r:
            dd = load(r["dd"], row, c, 0, st.dvp, st)
        else:
            k_dec = mm(e_last[:, None] * load(r["k"], row, c, 0, st.dkp, st, kcols).astype(F32), st)
            dd = load(r["ddl"], row, c, 0, st.dvp, st) + dot(k_dec, dh, st)
            store(r["dd_out"], row, 0, dd, st, None if st.has_beta else vcols)
        if st.has_beta:
            store(r["dw"], row, 0, -dot(mm(dd, st), h, st, tb=True), st)
    k = load(r["k"], row, c, 0, st.dkp, st, kcols)
    d_kdec = dot(d, dh, st, tb=True)
    d_elast = e_last * jnp.sum(k.astype(F32) * d_kdec, axis=1)
    dk = e_last[:, None] * d_kdec
    do = load(r["do"], row, c, 0, st.dvp, st, vcols)
    d_qg = dot(do, h, st, tb=True)
    q = load(r["q"], row, c, 0, st.dkp, st, kcols)
    gamma = dec.gamma(0)
    d_gamma = st.scale * gamma * jnp.sum(q.astype(F32) * d_qg, axis=1)
    dq = (st.scale * gamma)[:, None] * d_qg
    d_p = dot(do, d, st, tb=True)
    d_qk = st.scale * d_p * dec.G(0, 0)
    if "p" in r:       # d_qk * q k^T = dP * P (SSDConfig.store_p)
        d_exp = d_p * load(r["p"], row, c, 0, c, st)
    else:
        d_exp = d_qk * dot(q, k, st, tb=True)
    d_qk = mm(d_qk, st)
    store(r["dq"], row, 0, dq + dot(d_qk, load(r["k"], row, c, 0, st.dkp, st, kcols), st), st, kcols)
    store(r["dk"], row, 0, dk + dot(d_qk, load(r["q"], row, c, 0, st.dkp, st, kcols), st, ta=True), st,
          None if st.has_beta else kcols)
    dla = dec.grad({(0, 0): d_exp}, [d_gamma], [d_elast], d_total)[0]
    store_vec(r["dla"], row, dla, st)


def dqk_lean(st: Static) -> bool:
    """Whether the dqk kernel is :func:`_dqk_lean_kernel` (``SSDConfig.dqk_lean`` and one tile)."""
    return st.config.dqk_lean and _dqk_one_tile(st)


def wy_packs(st: Static) -> bool:
    """Whether the wy kernel pairs its dk and dv columns into one operand (``SSDConfig.wy_pack``: needs dk and dv
    padded to one width, in one dv block)."""
    return st.config.wy_pack and st.dkp == st.dvp and st.block_v() == st.dvp


def _dqk_one_tile(st: Static) -> bool:
    """The dqk kernel works on one tile: one sub-block of the whole chunk, one dk pass, one dv block."""
    return st.block("dqk") == st.chunk and st.dqk_block_k() == st.dkp and st.block_v() == st.dvp


def dqk_packs(st: Static, r) -> bool:
    """Whether the dqk kernel forms dk as one product over paired columns (``SSDConfig.dqk_pack``: one tile,
    dD formed here, and dv as wide as the chunk)."""
    return st.config.dqk_pack and _dqk_one_tile(st) and st.dvp == st.chunk and "ddl" in r


def dqk_pairs_do(st: Static) -> bool:
    """Whether the dqk kernel forms dP = dO D^T and dO h^T as one product (``SSDConfig.dqk_pair_do``: one tile,
    and dk as wide as the chunk)."""
    return st.config.dqk_pair_do and _dqk_one_tile(st) and st.dkp == st.chunk


def _pair(a, b):
    """[rows, n] a and b -> [rows, 2n] with their columns interleaved (a's at even, b's at odd): one operand for
    a product that sums over both (the order of a sum's terms is free), through Triton's join."""
    return jnp.stack([a, b], axis=-1).reshape(a.shape[0], 2 * a.shape[1])


def _unpair(x):
    """The inverse of :func:`_pair` (Triton's split)."""
    a, b = jnp.split(x.reshape(x.shape[0], x.shape[1] // 2, 2), 2, axis=-1)
    return a.reshape(a.shape[:2]), b.reshape(b.shape[:2])


def _wy_kernel(*refs, names, st: Static):
    """One chunk: reverse mode of u = T (beta v), w = T (beta gamma k), T = (I + A)^-1, given du = dD and
    dw; adds dk1 and dla1 (from _dqk_kernel) into the final dk and d log_alpha. T is read (the backward's
    precompute stores it), so the chunk is cut into ``st.block("wy")`` sub-blocks (one [C, C] tile at C),
    not necessarily the UT transform's 16 x 16 ones.

    With d_bv = T^T du and d_bgk = T^T dw: dA = -(d_bv u^T + d_bgk w^T) (T^T du = d_bv, T (beta v) = u). With
    ``SSDConfig.store_kg`` k k^T * G_strict is read ("kg"), not formed. With ``SSDConfig.wy_pack`` dw and du
    (and w and u) are paired column by column into one operand, so d_bgk | d_bv = T^T [dw | du] and dA =
    -[d_bgk | d_bv] [w | u]^T take one product per block pair each instead of two."""
    r = named(refs, names)
    sb = st.block("wy")
    rows = chunk_rows(st, sb)
    nb = len(rows)
    pairs = [(i, j) for i in range(nb) for j in range(i + 1)]
    kcols, vcols = col_bound(st.dk, st.dkp), col_bound(st.dv, st.dvp)
    beta = [load_vec(r["beta"], row, sb, st) for row in rows]
    t = {(i, j): load(r["t"], rows[i], sb, j * sb, sb, st) for i, j in pairs}
    dw = [mm(load(r["dw"], row, sb, 0, st.dkp, st), st) for row in rows]
    w = [load(r["w"], row, sb, 0, st.dkp, st) for row in rows]
    dbeta = [jnp.zeros((sb,), F32)] * nb
    bv = st.block_v()
    pack = wy_packs(st)
    if pack:           # SSDConfig.wy_pack: T^T [dw | du] and [d_bgk | d_bv] [w | u]^T, half the products
        du = [mm(load(r["dd"], row, sb, 0, bv, st), st) for row in rows]
        d_x = [add_all(dot(t[i, j], _pair(dw[i], du[i]), st, ta=True) for i in range(j, nb)) for j in range(nb)]
        wu = [_pair(w[j], load(r["u"], row, sb, 0, bv, st)) for j, row in enumerate(rows)]
        d_a = {(i, j): -dot(mm(d_x[i], st), wu[j], st, tb=True) for i, j in pairs}
        d_bgk, d_bv = (list(x) for x in zip(*(_unpair(x) for x in d_x)))
    else:
        d_bgk = [add_all(dot(t[i, j], dw[i], st, ta=True) for i in range(j, nb)) for j in range(nb)]
        d_a = {(i, j): -dot(mm(d_bgk[i], st), w[j], st, tb=True) for i, j in pairs}
    for c0 in range(0, st.dvp, bv):
        if not pack:
            du = [mm(load(r["dd"], row, sb, c0, bv, st), st) for row in rows]
            d_bv = [add_all(dot(t[i, j], du[i], st, ta=True) for i in range(j, nb)) for j in range(nb)]
            u = [load(r["u"], row, sb, c0, bv, st) for row in rows]
            for i, j in pairs:
                d_a[i, j] = d_a[i, j] - dot(mm(d_bv[i], st), u[j], st, tb=True)
        for i, row in enumerate(rows):
            v = load(r["v"], row, sb, c0, bv, st, vcols).astype(F32)
            dbeta[i] = dbeta[i] + jnp.sum(v * d_bv[i], axis=1)
            store(r["dv"], row, c0, beta[i][:, None] * d_bv[i], st, vcols)
    # A = strict(beta_t (k k^T) * G): g is the strict decay, so d_a outside A's support drops out here
    k = [load(r["k"], row, sb, 0, st.dkp, st, kcols) for row in rows]
    dec = chunk_decays(r["la"], rows, sb, st)
    gamma = [dec.gamma(i) for i in range(nb)]
    k_bgk = [jnp.sum(k[i].astype(F32) * d_bgk[i], axis=1) for i in range(nb)]
    if "kg" in r:      # SSDConfig.store_kg: k k^T * G_strict from the precompute
        kg = {(i, j): load(r["kg"], rows[i], sb, j * sb, sb, st) for i, j in pairs}
    else:
        kk = {(i, j): dot(k[i], k[j], st, tb=True) for i, j in pairs}
    d_kk, d_exp = {}, {}
    for i, j in pairs:
        g = dec.G(i, j, strict=True)
        d_akg = d_a[i, j] * g
        d_kk[i, j] = d_akg * beta[i][:, None]
        if "kg" in r:
            dbeta[i] = dbeta[i] + jnp.sum(d_a[i, j] * kg[i, j], axis=1)
            d_exp[i, j] = beta[i][:, None] * (d_a[i, j] * kg[i, j])
        else:
            dbeta[i] = dbeta[i] + jnp.sum(d_akg * kk[i, j], axis=1)
            d_exp[i, j] = d_kk[i, j] * kk[i, j]
    for i, row in enumerate(rows):
        dbeta[i] = dbeta[i] + gamma[i] * k_bgk[i]
        dk = ((beta[i] * gamma[i])[:, None] * d_bgk[i] + load(r["dk1"], row, sb, 0, st.dkp, st)
              + add_all(dot(mm(d_kk[i, j], st), k[j], st) for j in range(i + 1))
              + add_all(dot(mm(d_kk[m, i], st), k[m], st, ta=True) for m in range(i, nb)))
        store(r["dk"], row, 0, dk, st, kcols)
        store_vec(r["dbeta"], row, dbeta[i], st)
    dla = dec.grad(d_exp, [beta[i] * k_bgk[i] * gamma[i] for i in range(nb)])
    for i, row in enumerate(rows):
        store_vec(r["dla"], row, dla[i] + load_vec(r["dla1"], row, sb, st), st)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers and the backward driver
# ----------------------------------------------------------------------------------------------------

def dout_call(st: Static, q, k, la, do, pre: dict) -> dict:
    """{"ddl": P^T dO [B, H, T, dvp] float32, with ``st.transition`` or ``st.reverse_rinc`` "rinc": R [B, H,
    N * dkp, dvp], and with ``SSDConfig.store_p`` "p": P [B, H, T, C] float32}."""
    bh = q.shape[:2]
    inputs = dict(q=seq_arg(q, st, st.dkp), k=seq_arg(k, st, st.dkp), la=(la, vec_spec(st)),
                  do=seq_arg(do, st, st.dvp))
    outputs = {"ddl": seq_out(st, bh, st.dvp, F32)}
    if st.config.store_p:
        outputs["p"] = seq_out(st, bh, st.chunk, F32)
    if st.transition or st.reverse_rinc:
        if st.has_beta:
            inputs["w"] = seq_arg(pre["w"], st, st.dkp)
        outputs["rinc"] = per_chunk_out(st, bh, st.dvp)
    return call(_dout_kernel, st, st.n_chunks, inputs, outputs, name="ssd_dout")


def reverse_call(st: Static, q, k, la, do, pre: dict, dout: dict, dfinal) -> dict:
    """{"dh": adjoints [B, H, N * dkp, dvp] float32, "ds0": d initial_state [B, H, dk, dv] float32, and
    without ``st.transition`` "dd": dD [B, H, T, dvp] float32 (without beta: dv [B, H, T, dv])}."""
    bh = q.shape[:2]
    inputs = {"la": (la, vec_spec(st))}
    if st.transition:
        inputs["rinc"] = per_chunk_arg(dout["rinc"], st)
        if st.has_beta:
            inputs["m"] = per_chunk_arg(pre["m"], st)
    else:
        keys = {"kdec": seq_arg(pre["kdec"], st, st.dkp)} if "kdec" in pre else {"k": seq_arg(k, st, st.dkp)}
        inputs.update(keys, ddl=seq_arg(dout["ddl"], st, st.dvp))
        if st.reverse_rinc:
            inputs["rinc"] = per_chunk_arg(dout["rinc"], st)
        else:
            inputs.update(q=seq_arg(q, st, st.dkp), do=seq_arg(do, st, st.dvp))
        if st.has_beta:
            inputs["w"] = seq_arg(pre["w"], st, st.dkp)
    inputs["dfinal"] = (dfinal, mat_spec(st.dkp, st.dvp))
    outputs = {"dh": per_chunk_out(st, bh, st.dvp),
               "ds0": (jax.ShapeDtypeStruct(bh + (st.dk, st.dv), F32), mat_spec(st.dkp, st.dvp))}
    if not st.transition:
        outputs["dd"] = seq_out(st, bh, st.dvp, F32) if st.has_beta else seq_out(st, bh, st.dvp, do.dtype, st.dv)
    return call(_reverse_kernel, st, st.dvp // st.state_block_v(), inputs, outputs, sequential=True,
                name="ssd_reverse")


def dqk_call(st: Static, q, k, v, la, do, pre: dict, states: dict, dout: dict, rev: dict) -> dict:
    """{"dq", "dk" (with beta: its P / k_dec part, float32 [B, H, T, dkp]), "dla" (float32; with beta its
    part), with beta "dw" float32 [B, H, T, dkp], and "dd_out" (dD, or dv without beta) when the reverse
    pass did not store it}."""
    bh = q.shape[:2]
    inputs = dict(q=seq_arg(q, st, st.dkp), k=seq_arg(k, st, st.dkp), la=(la, vec_spec(st)),
                  do=seq_arg(do, st, st.dvp), h=per_chunk_arg(states["h"], st), dh=per_chunk_arg(rev["dh"], st),
                  **ssd.delta_args(st, v, pre, states))
    if "dd" in rev:
        if st.has_beta:
            inputs["dd"] = seq_arg(rev["dd"], st, st.dvp)
    else:
        inputs["ddl"] = seq_arg(dout["ddl"], st, st.dvp)
    if "p" in dout:
        inputs["p"] = seq_arg(dout["p"], st, st.chunk)
    outputs = {"dq": seq_out(st, bh, st.dkp, q.dtype, st.dk)}
    if st.has_beta:
        outputs.update(dk=seq_out(st, bh, st.dkp, F32), dw=seq_out(st, bh, st.dkp, F32))
    else:
        outputs["dk"] = seq_out(st, bh, st.dkp, k.dtype, st.dk)
    outputs["dla"] = vec_out(st, bh)
    if "dd" not in rev:
        outputs["dd_out"] = seq_out(st, bh, st.dvp, F32) if st.has_beta else seq_out(st, bh, st.dvp, v.dtype, st.dv)
    kernel = _dqk_lean_kernel if dqk_lean(st) else _dqk_kernel
    return call(kernel, st, st.n_chunks, inputs, outputs, name="ssd_dqk")


def wy_call(st: Static, k, v, la, beta, pre: dict, dd, dqk: dict) -> dict:
    """{"dk", "dv", "dbeta" float32, "dla" float32}: the UT transform's reverse mode, dk and dla completed."""
    bh = k.shape[:2]
    sk = lambda x: seq_arg(x, st, st.dkp)  # noqa: E731
    sv = lambda x: seq_arg(x, st, st.dvp)  # noqa: E731
    inputs = dict(k=sk(k), v=sv(v), la=(la, vec_spec(st)), beta=(beta, vec_spec(st)), w=sk(pre["w"]),
                  u=sv(pre["u"]), t=seq_arg(pre["t"], st, st.chunk), dw=sk(dqk["dw"]), dd=sv(dd), dk1=sk(dqk["dk"]), dla1=(dqk["dla"], vec_spec(st)))
    if "kg" in pre:
        inputs["kg"] = seq_arg(pre["kg"], st, st.chunk)
    outputs = dict(dk=seq_out(st, bh, st.dkp, k.dtype, st.dk), dv=seq_out(st, bh, st.dvp, v.dtype, st.dv),
                   dbeta=vec_out(st, bh), dla=vec_out(st, bh))
    return call(_wy_kernel, st, st.n_chunks, inputs, outputs, name="ssd_wy_bwd")


def backward(st: Static, q, k, v, la, beta, s0, do, dfinal, t=None, h=None):
    """Cotangents (dq, dk, dv, d log_alpha, dbeta or None, d initial_state) of ``ssd._ssd``; ``t``: the UT
    transform's T saved by the forward (``SSDConfig.save_t``) or None (formed again); ``h``: the forward's
    chunk-start states (``SSDConfig.save_h``) or None (the state pass runs again)."""
    do = do.astype(v.dtype)
    dfinal = dfinal.astype(F32)
    if t is None:
        pre = ssd.precompute_call(st, k, v, la, beta, emit_t=True)
    else:
        pre = ssd.wu_call(st, k, v, la, beta, t)
    # saved h: no D either (the two-product form's dqk forms it from u and w, ssd.delta_args)
    states = ssd.state_call(st, k, v, la, s0, pre, emit_delta=True) if h is None else {"h": h}
    dout = dout_call(st, q, k, la, do, pre)
    rev = reverse_call(st, q, k, la, do, pre, dout, dfinal)
    dqk = dqk_call(st, q, k, v, la, do, pre, states, dout, rev)
    dd = rev["dd"] if "dd" in rev else dqk["dd_out"]
    if not st.has_beta:
        return dqk["dq"], dqk["dk"], dd, dqk["dla"], None, rev["ds0"]
    wy = wy_call(st, k, v, la, beta, pre, dd, dqk)
    return dqk["dq"], wy["dk"], wy["dv"], wy["dla"], wy["dbeta"], rev["ds0"]
