"""gated_delta_rule on the GPU, impl "ssd": Pallas kernels (Triton lowering), forward; the backward is in
:mod:`flashlax.kernels.ssd_bwd`.

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
   step; or ``S <- M S + H``: one product (none without beta), D formed later by the output kernel.
3. ``_output_kernel`` (one program per chunk, batch and head): O = P D + q_g S with P recomputed from q, k.

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

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashlax.kernels._tiles import pow2
from flashlax.kernels.configs import SSDConfig, check_ssd_config, ssd_config

F32 = jnp.float32
UT_BLOCK = 16      # sub-block of the UT transform: 16 x 16 diagonal blocks are nilpotent of order 16


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything about one call that is not an array (the custom_vjp's nondiff argument)."""

    config: SSDConfig
    scale: float
    chunk: int
    seq_len: int
    dk: int
    dv: int
    has_beta: bool
    dtype: Any            # q/k/v dtype
    interpret: bool

    @property
    def dkp(self) -> int:
        return max(16, pow2(self.dk))

    @property
    def dvp(self) -> int:
        return max(16, pow2(self.dv))

    @property
    def n_chunks(self) -> int:
        return -(-self.seq_len // self.chunk)

    @property
    def ragged(self) -> bool:
        """Whether the last chunk is partial (then every chunk's loads carry a row mask)."""
        return self.seq_len % self.chunk != 0

    @property
    def transition(self) -> bool:
        return self.config.transition

    @property
    def mm_dtype(self):
        """Operand dtype of the products of data-sized tiles: the input dtype."""
        return jnp.dtype(self.dtype)

    @property
    def f32_precision(self):
        if self.config.f32_dot == "tf32x3" and not self.interpret:
            return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        return lax.Precision.HIGHEST

    def block(self) -> int:
        return min(self.config.block, self.chunk)

    def state_block_v(self) -> int:
        return min(self.config.state_block_v, self.dvp)

    def block_v(self) -> int:
        return min(self.config.block_v, self.dvp)


# ----------------------------------------------------------------------------------------------------
# In-kernel helpers: index masks, masked loads/stores, products
# ----------------------------------------------------------------------------------------------------

def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def ds(start, size: int):
    """pl.ds with an int32 start (Python ints would become int64 under jax_enable_x64 and mix with the
    int32 program ids in the interpreter's dynamic slices)."""
    return pl.ds(jnp.int32(start) if isinstance(start, int) else start, size)


def tri(n: int, op: str):
    """bool [n, n] ``row op col`` (op: ge, gt, le, lt)."""
    row, col = iota((n, n), 0), iota((n, n), 1)
    return {"ge": row >= col, "gt": row > col, "le": row <= col, "lt": row < col}[op]


def load(ref, row0, rows: int, col0, cols: int, st: Static, n_cols: int | None = None):
    """[rows, cols] tile of a [T, width] ref from (row0, col0); 0 past the sequence end (when the last chunk
    is partial) and in columns >= n_cols (head dims padded to powers of two)."""
    mask = None
    if st.ragged:
        ok = (row0 + iota((rows, cols), 0)) < st.seq_len
        mask = ok
    if n_cols is not None:
        ok = (col0 + iota((rows, cols), 1)) < n_cols
        mask = ok if mask is None else mask & ok
    view = ref.at[ds(row0, rows), ds(col0, cols)]
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0.0)


def store(ref, row0, col0, val, st: Static, n_cols: int | None = None):
    rows, cols = val.shape
    mask = None
    if st.ragged:
        mask = (row0 + iota((rows, cols), 0)) < st.seq_len
    if n_cols is not None:
        ok = (col0 + iota((rows, cols), 1)) < n_cols
        mask = ok if mask is None else mask & ok
    plgpu.store(ref.at[ds(row0, rows), ds(col0, cols)], val.astype(ref.dtype), mask=mask)


def load_vec(ref, row0, rows: int, st: Static):
    """[rows] float32 of a [T] ref; 0 past the end (log_alpha 0: no decay; beta 0: no update)."""
    view = ref.at[ds(row0, rows)]
    if not st.ragged:
        return plgpu.load(view).astype(F32)
    return plgpu.load(view, mask=(row0 + iota((rows,), 0)) < st.seq_len, other=0.0).astype(F32)


def store_vec(ref, row0, val, st: Static):
    mask = ((row0 + iota(val.shape, 0)) < st.seq_len) if st.ragged else None
    plgpu.store(ref.at[ds(row0, val.shape[0])], val.astype(ref.dtype), mask=mask)


def dot(a, b, st: Static, ta: bool = False, tb: bool = False):
    """a @ b (a^T with ta, b^T with tb) -> float32; b is cast to a's dtype (Triton needs one element type).
    float32 operands: IEEE float32 for 16 x 16 x 16 products (the UT transform's and the in-block segment
    sums' algebra: cheap either way, and three tensor-core passes would triple their code), otherwise
    st.f32_precision (the config's f32_dot)."""
    if a.dtype != b.dtype:
        b = b.astype(a.dtype)
    small = max(a.shape + b.shape) <= UT_BLOCK
    precision = (lax.Precision.HIGHEST if small else st.f32_precision) if a.dtype == F32 else None
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def mm(x, st: Static):
    """x as an operand of a data-sized product: the input dtype (tensor cores for bf16/f16)."""
    return x.astype(st.mm_dtype)


# ----------------------------------------------------------------------------------------------------
# Decays of one chunk, by sub-blocks
# ----------------------------------------------------------------------------------------------------

def _sum(terms):
    out = 0.0
    for t in terms:
        out = out + t
    return out


class Decays:
    """The decays of one chunk cut into sub-blocks of ``sb`` rows (see the module docstring).

    la: list of float32 [sb] log_alpha blocks (0 past the sequence end). Exponents are assembled from
    per-block pieces, each a sum of terms <= 0: ``c[i]`` (inclusive prefix sums inside block i),
    ``suf[i]`` (exclusive suffix sums), ``tot[i]`` (block sums); inside a diagonal block a masked product.
    """

    def __init__(self, la, sb: int, st: Static):
        self.la, self.sb, self.st, self.nb = la, sb, st, len(la)
        # c[t] = sum_{r <= t} la_r (rows t, columns r: row >= col); suf[s] = sum_{r > s} la_r (row < col)
        self.c = [jnp.sum(jnp.where(tri(sb, "ge"), x[None, :], 0.0), axis=1) for x in la]
        self.suf = [jnp.sum(jnp.where(tri(sb, "lt"), x[None, :], 0.0), axis=1) for x in la]
        self.tot = [jnp.sum(x) for x in la]

    def pre(self, i):
        return _sum(self.tot[:i])

    def post(self, i):
        return _sum(self.tot[i + 1:])

    def gamma(self, i):
        """[sb] exp(sum of log_alpha from the chunk start to each row of block i, inclusive)."""
        return jnp.exp(self.pre(i) + self.c[i])

    def e_last(self, i):
        """[sb] exp(sum of log_alpha after each row of block i to the chunk end): decay to the end."""
        return jnp.exp(self.suf[i] + self.post(i))

    def chunk_decay(self):
        return jnp.exp(_sum(self.tot))

    def diag_seg(self, i):
        """[sb, sb] sum_{s < r <= t} la_r (0 on and above the diagonal): one masked triangular product."""
        sb = self.sb
        ones = jnp.where(tri(sb, "ge"), 1.0, 0.0)
        strict = jnp.where(tri(sb, "gt"), self.la[i][:, None], 0.0)      # [r, s] = la_r for r > s
        return dot(ones, strict, self.st)

    def G(self, i, j, strict: bool = False):
        """[sb, sb] decay from column token (block j) to row token (block i), 0 where not causal (and on
        the diagonal when ``strict``)."""
        if i > j:
            mid = _sum(self.tot[j + 1:i])
            return jnp.exp(self.c[i][:, None] + (mid + self.suf[j][None, :]))
        return jnp.where(tri(self.sb, "gt" if strict else "ge"), jnp.exp(self.diag_seg(i)), 0.0)

    def grad(self, d_exp, d_gamma=None, d_elast=None, d_total=None):
        """Gradient with respect to la (list of [sb]) of scalar functions of the exponents:
        ``d_exp[(i, j)]`` [sb, sb] of G(i, j)'s exponent (j <= i), ``d_gamma[i]`` [sb] of gamma(i)'s,
        ``d_elast[i]`` [sb] of e_last(i)'s, ``d_total`` of chunk_decay()'s. Each la_r collects exactly
        the terms whose segment contains r (no difference of row and column sums that would cancel)."""
        nb, sb = self.nb, self.sb
        zero = jnp.zeros((sb,), F32)
        d_c = [zero if d_gamma is None else d_gamma[i] for i in range(nb)]
        d_suf = [zero if d_elast is None else d_elast[i] for i in range(nb)]
        d_tot = [0.0 if d_total is None else d_total for _ in range(nb)]
        for (i, j), g in d_exp.items():
            if i == j:
                continue
            d_c[i] = d_c[i] + jnp.sum(g, axis=1)
            d_suf[j] = d_suf[j] + jnp.sum(g, axis=0)
            if i - j > 1:
                total = jnp.sum(g)
                for m in range(j + 1, i):
                    d_tot[m] = d_tot[m] + total
        for i in range(nb):
            if d_gamma is not None:
                total = jnp.sum(d_gamma[i])
                for m in range(i):
                    d_tot[m] = d_tot[m] + total
            if d_elast is not None:
                total = jnp.sum(d_elast[i])
                for m in range(i + 1, nb):
                    d_tot[m] = d_tot[m] + total
        before = jnp.where(tri(sb, "lt"), 1.0, 0.0)          # [s, r] = 1 for s < r
        out = []
        for m in range(nb):
            # c[t] = sum_{r <= t} la_r -> d la_r += sum_{t >= r} d_c[t]   (rows r, columns t: row <= col)
            d = jnp.sum(jnp.where(tri(sb, "le"), d_c[m][None, :], 0.0), axis=1)
            # suf[s] = sum_{r > s} la_r -> d la_r += sum_{s < r} d_suf[s]   (rows r, columns s: row > col)
            d = d + jnp.sum(jnp.where(tri(sb, "gt"), d_suf[m][None, :], 0.0), axis=1)
            d = d + d_tot[m]
            if (m, m) in d_exp:
                # inside block m: d la_r += sum_{t >= r} sum_{s < r} d_exp[t, s]
                z = dot(d_exp[(m, m)], before, self.st)                 # [t, r] = sum_{s < r} d_exp[t, s]
                d = d + jnp.sum(jnp.where(tri(sb, "ge"), z, 0.0), axis=0)
            out.append(d)
        return out


# ----------------------------------------------------------------------------------------------------
# The UT transform of one chunk, by 16 x 16 blocks
# ----------------------------------------------------------------------------------------------------

def ut_blocks(k, beta, dec: Decays, st: Static):
    """T = (I + A)^-1 of one chunk with A = strictly_lower(diag(beta) K K^T * G), by 16 x 16 blocks.

    k: list of [16, dk] blocks (input dtype), beta: list of float32 [16]. Returns (T, KK, G_strict):
    dicts over block pairs (i, j), j <= i, of float32 [16, 16]. A diagonal block a is nilpotent (a^16 = 0),
    so (I + a)^-1 = (I - a)(I + a^2)(I + a^4)(I + a^8): six 16 x 16 products. Below the diagonal, block
    forward substitution: T_ij = -T_ii sum_{j <= m < i} A_im T_mj.
    """
    nb = len(k)
    kk, g_strict, a = {}, {}, {}
    for i in range(nb):
        for j in range(i + 1):
            kk[i, j] = dot(k[i], k[j], st, tb=True)
            g_strict[i, j] = dec.G(i, j, strict=True)
            a[i, j] = beta[i][:, None] * kk[i, j] * g_strict[i, j]
    eye = jnp.where(iota((UT_BLOCK, UT_BLOCK), 0) == iota((UT_BLOCK, UT_BLOCK), 1), 1.0, 0.0)
    t = {}
    for i in range(nb):
        x = a[i, i]
        x2 = dot(x, x, st)
        x4 = dot(x2, x2, st)
        x8 = dot(x4, x4, st)
        inv = dot(dot(dot(eye - x, eye + x2, st), eye + x4, st), eye + x8, st)
        t[i, i] = inv
        for j in range(i):
            t[i, j] = -dot(inv, _sum(dot(a[i, m], t[m, j], st) for m in range(j, i)), st)
    return t, kk, g_strict


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------

def _cols(n: int, padded: int) -> int | None:
    """Column bound for loads/stores of a user array (None when the head dim is already a power of two)."""
    return None if n == padded else n


def chunk_rows(st: Static, sb: int):
    """Absolute first rows of the sub-blocks of this program's chunk (program axis 0)."""
    base = pl.program_id(0) * st.chunk
    return [base + i * sb for i in range(st.chunk // sb)]


def named(refs, names):
    """The kernel's refs by name (the wrappers pass inputs and outputs as ordered dicts)."""
    return dict(zip(names, refs))


def chunk_vectors(la, st: Static):
    """(gamma [C], e_last [C], chunk decay) of one whole chunk from its log_alpha [C] (masked sums, no
    cumulative-sum differences): gamma_t = exp(sum_{r <= t}), e_last_s = exp(sum_{r > s})."""
    c = st.chunk
    gamma = jnp.exp(jnp.sum(jnp.where(tri(c, "ge"), la[None, :], 0.0), axis=1))
    e_last = jnp.exp(jnp.sum(jnp.where(tri(c, "lt"), la[None, :], 0.0), axis=1))
    return gamma, e_last, jnp.exp(jnp.sum(la))


def load_square(ref, row0, col0, st: Static, cols: int):
    """[dkp, cols] tile of one of our per-chunk [N * dkp, width] arrays (chunk states, M, H, R)."""
    return plgpu.load(ref.at[ds(row0, st.dkp), ds(col0, cols)])


def state_block(ref, row0, col0, st: Static, bv: int):
    """[dk, bv] of a per-(batch, head) [dk, dv] state ref (user arrays: masked to dk, dv)."""
    mask = ((iota((st.dkp, bv), 0) < st.dk) & (col0 + iota((st.dkp, bv), 1) < st.dv))
    return plgpu.load(ref.at[ds(row0, st.dkp), ds(col0, bv)], mask=mask, other=0.0).astype(F32)


def store_state(ref, row0, col0, val, st: Static, user: bool = False):
    mask = None
    if user:
        shape = val.shape
        mask = (iota(shape, 0) < st.dk) & (col0 + iota(shape, 1) < st.dv)
    plgpu.store(ref.at[ds(row0, val.shape[0]), ds(col0, val.shape[1])], val.astype(ref.dtype), mask=mask)


def _precompute_kernel(*refs, names, st: Static):
    """One chunk. With beta: w = T (beta gamma k) [C, dk], u = T (beta v) [C, dv]; with ``st.transition``
    also M = g I - k_dec^T w [dk, dk] and H = k_dec^T u [dk, dv] (float32). Without beta (transition only):
    H = k_dec^T v."""
    r = named(refs, names)
    sb = UT_BLOCK
    rows = chunk_rows(st, sb)
    nb = len(rows)
    row_m = pl.program_id(0) * st.dkp
    k = [load(r["k"], row, sb, 0, st.dkp, st, _cols(st.dk, st.dkp)) for row in rows]
    dec = Decays([load_vec(r["la"], row, sb, st) for row in rows], sb, st)
    if st.transition:
        k_dec = [mm(dec.e_last(i)[:, None] * k[i].astype(F32), st) for i in range(nb)]
    if st.has_beta:
        beta = [load_vec(r["beta"], row, sb, st) for row in rows]
        t, _, _ = ut_blocks(k, beta, dec, st)
        t = {key: mm(x, st) for key, x in t.items()}
        kb = [mm((beta[j] * dec.gamma(j))[:, None] * k[j].astype(F32), st) for j in range(nb)]
        w = [_sum(dot(t[i, j], kb[j], st) for j in range(i + 1)) for i in range(nb)]
        for i in range(nb):
            store(r["w"], rows[i], 0, w[i], st)
        if st.transition:
            eye = jnp.where(iota((st.dkp, st.dkp), 0) == iota((st.dkp, st.dkp), 1), dec.chunk_decay(), 0.0)
            store_state(r["m"], row_m, 0, eye - _sum(dot(k_dec[i], mm(w[i], st), st, ta=True) for i in range(nb)), st)
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        x = [load(r["v"], row, sb, c0, bv, st, _cols(st.dv, st.dvp)).astype(F32) for row in rows]
        if st.has_beta:
            vb = [mm(beta[j][:, None] * x[j], st) for j in range(nb)]
            x = [_sum(dot(t[i, j], vb[j], st) for j in range(i + 1)) for i in range(nb)]     # u
            for i in range(nb):
                store(r["u"], rows[i], c0, x[i], st)
        if st.transition:
            store_state(r["inc"], row_m, c0, _sum(dot(k_dec[i], mm(x[i], st), st, ta=True) for i in range(nb)), st)


def _state_kernel(*refs, names, st: Static):
    """Sequential pass over the chunks for dv columns [iv * bv, (iv + 1) * bv): the float32 state S [dk, bv]
    in registers; per chunk stores h_n = S, then S <- M_n S + H_n (``st.transition``; without beta
    S <- g S + H_n) or D = u - w S (stored as "d" when asked; D = v without beta), S <- g S + k_dec^T D.
    Writes the final state."""
    r = named(refs, names)
    bv = st.state_block_v()
    col0 = pl.program_id(0) * bv
    c = st.chunk
    kcols, vcols = _cols(st.dk, st.dkp), _cols(st.dv, st.dvp)

    def body(n, s):
        r0, row_m = n * c, n * st.dkp
        store_state(r["h"], row_m, col0, s, st)
        if st.transition:
            inc = load_square(r["inc"], row_m, col0, st, bv)
            if st.has_beta:
                return dot(mm(load_square(r["m"], row_m, 0, st, st.dkp), st), mm(s, st), st) + inc
            return jnp.exp(jnp.sum(load_vec(r["la"], r0, c, st))) * s + inc
        _, e_last, decay = chunk_vectors(load_vec(r["la"], r0, c, st), st)
        if st.has_beta:
            w = load(r["w"], r0, c, 0, st.dkp, st)
            d = load(r["u"], r0, c, col0, bv, st).astype(F32) - dot(w, mm(s, st), st)
            if "d" in r:
                store(r["d"], r0, col0, d, st)
        else:
            d = load(r["v"], r0, c, col0, bv, st, vcols).astype(F32)
        k_dec = mm(load(r["k"], r0, c, 0, st.dkp, st, kcols).astype(F32) * e_last[:, None], st)
        return decay * s + dot(k_dec, mm(d, st), st, ta=True)

    s = lax.fori_loop(jnp.int32(0), jnp.int32(st.n_chunks), body, state_block(r["s0"], 0, col0, st, bv))
    store_state(r["final"], 0, col0, s, st, user=True)


def p_blocks(q, k, dec: Decays, st: Static):
    """P = scale (Q K^T * G) of one chunk by sub-blocks: {(i, j): float32 [sb, sb]}, j <= i."""
    return {(i, j): st.scale * dot(q[i], k[j], st, tb=True) * dec.G(i, j)
            for i in range(len(q)) for j in range(i + 1)}


def chunk_delta(r, rows, sb, c0, bv, h, w, st: Static):
    """D = u - w S_n of one chunk's sub-blocks for columns [c0, c0 + bv) (mm dtype), or the stored D ("d"),
    or v without beta. h: S_n [dkp, bv] (mm dtype); w: the chunk's w blocks."""
    if "d" in r:
        return [load(r["d"], row, sb, c0, bv, st) for row in rows]
    if not st.has_beta:
        return [load(r["v"], row, sb, c0, bv, st, _cols(st.dv, st.dvp)) for row in rows]
    return [mm(load(r["u"], row, sb, c0, bv, st).astype(F32) - dot(w[i], h, st), st) for i, row in enumerate(rows)]


def _output_kernel(*refs, names, st: Static):
    """One chunk: O = P D + q_g S_n, D as :func:`chunk_delta`."""
    r = named(refs, names)
    sb = st.block()
    rows = chunk_rows(st, sb)
    nb = len(rows)
    kcols = _cols(st.dk, st.dkp)
    q = [load(r["q"], row, sb, 0, st.dkp, st, kcols) for row in rows]
    k = [load(r["k"], row, sb, 0, st.dkp, st, kcols) for row in rows]
    dec = Decays([load_vec(r["la"], row, sb, st) for row in rows], sb, st)
    p = {key: mm(x, st) for key, x in p_blocks(q, k, dec, st).items()}
    q_g = [mm((st.scale * dec.gamma(i))[:, None] * q[i].astype(F32), st) for i in range(nb)]
    w = [load(r["w"], row, sb, 0, st.dkp, st) for row in rows] if "w" in r else None
    h_row = pl.program_id(0) * st.dkp
    bv = st.block_v()
    for c0 in range(0, st.dvp, bv):
        h = mm(load_square(r["h"], h_row, c0, st, bv), st)
        d = chunk_delta(r, rows, sb, c0, bv, h, w, st)
        for i in range(nb):
            o = _sum(dot(p[i, j], d[j], st) for j in range(i + 1)) + dot(q_g[i], h, st)
            store(r["o"], rows[i], c0, o, st, _cols(st.dv, st.dvp))


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers. Grids: (chunk or dv block, head, batch); arrays [B, H, T, ...] are read through a
# whole-sequence block of their (batch, head) and sliced in the kernel. Per-chunk [dk, x] arrays (chunk
# states, M, H, R) are [B, H, N * dkp, x].
# ----------------------------------------------------------------------------------------------------

def seq_spec(st: Static, width: int):
    return pl.BlockSpec((None, None, st.seq_len, width), lambda g, h, b: (b, h, 0, 0))


def vec_spec(st: Static):
    return pl.BlockSpec((None, None, st.seq_len), lambda g, h, b: (b, h, 0))


def mat_spec(rows: int, cols: int):
    return pl.BlockSpec((None, None, rows, cols), lambda g, h, b: (b, h, 0, 0))


def seq_arg(x, st: Static, width: int):
    return x, seq_spec(st, width)


def seq_out(st: Static, bh, width: int, dtype, full: int | None = None):
    """A [B, H, T, width] output (``full``: its true width when the block is padded to ``width``)."""
    return jax.ShapeDtypeStruct(bh + (st.seq_len, width if full is None else full), dtype), seq_spec(st, width)


def vec_out(st: Static, bh):
    return jax.ShapeDtypeStruct(bh + (st.seq_len,), F32), vec_spec(st)


def per_chunk_out(st: Static, bh, cols: int, dtype=F32):
    rows = st.n_chunks * st.dkp
    return jax.ShapeDtypeStruct(bh + (rows, cols), dtype), mat_spec(rows, cols)


def per_chunk_arg(x, st: Static):
    return x, mat_spec(x.shape[2], x.shape[3])


def call(kernel, st: Static, grid0: int, inputs: dict, outputs: dict, *, sequential=False, name: str) -> dict:
    """pallas_call of ``kernel(*refs, names=..., st=st)`` with named inputs {name: (array, spec)} and
    outputs {name: (ShapeDtypeStruct, spec)}; returns the outputs by name."""
    cfg = st.config
    bh = next(iter(inputs.values()))[0].shape[:2]
    names = tuple(inputs) + tuple(outputs)
    params = plgpu.CompilerParams(num_warps=cfg.state_warps if sequential else cfg.num_warps,
                                  num_stages=cfg.state_stages if sequential else 1)
    outs = pl.pallas_call(
        functools.partial(kernel, names=names, st=st), grid=(grid0, bh[1], bh[0]),
        in_specs=[spec for _, spec in inputs.values()], out_specs=[spec for _, spec in outputs.values()],
        out_shape=[sds for sds, _ in outputs.values()], compiler_params=params, interpret=st.interpret,
        name=name)(*[x for x, _ in inputs.values()])
    return dict(zip(outputs, outs))


def precompute_call(st: Static, k, v, la, beta) -> dict:
    """The per-chunk parallel precompute: w, u [B, H, T, dkp / dvp] in the input dtype (with beta); M [B, H,
    N * dkp, dkp] (with beta) and H [B, H, N * dkp, dvp] float32 (with ``st.transition``). {} when neither."""
    bh = k.shape[:2]
    outputs = {}
    if st.has_beta:
        outputs["w"] = seq_out(st, bh, st.dkp, st.mm_dtype)
        outputs["u"] = seq_out(st, bh, st.dvp, st.mm_dtype)
    if st.transition:
        if st.has_beta:
            outputs["m"] = per_chunk_out(st, bh, st.dkp)
        outputs["inc"] = per_chunk_out(st, bh, st.dvp)
    if not outputs:
        return {}
    inputs = dict(k=seq_arg(k, st, st.dkp), v=seq_arg(v, st, st.dvp), la=(la, vec_spec(st)))
    if st.has_beta:
        inputs["beta"] = (beta, vec_spec(st))
    return call(_precompute_kernel, st, st.n_chunks, inputs, outputs, name="ssd_precompute")


def state_call(st: Static, k, v, la, s0, pre: dict, emit_delta: bool = False) -> dict:
    """{"final": [B, H, dk, dv] float32, "h": chunk-start states [B, H, N * dkp, dvp] in the input dtype,
    and "d": D [B, H, T, dvp] when ``emit_delta`` (with beta, not ``st.transition``)}."""
    bh = k.shape[:2]
    inputs = {"la": (la, vec_spec(st))}
    if st.transition:
        inputs["inc"] = per_chunk_arg(pre["inc"], st)
        if st.has_beta:
            inputs["m"] = per_chunk_arg(pre["m"], st)
    else:
        inputs["k"] = seq_arg(k, st, st.dkp)
        if st.has_beta:
            inputs.update(w=seq_arg(pre["w"], st, st.dkp), u=seq_arg(pre["u"], st, st.dvp))
        else:
            inputs["v"] = seq_arg(v, st, st.dvp)
    inputs["s0"] = (s0, mat_spec(st.dkp, st.dvp))
    outputs = {"final": (jax.ShapeDtypeStruct(bh + (st.dk, st.dv), F32), mat_spec(st.dkp, st.dvp)),
               "h": per_chunk_out(st, bh, st.dvp, st.mm_dtype)}
    if emit_delta and st.has_beta and not st.transition:
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

def forward(st: Static, q, k, v, la, beta, s0):
    """(o, final state)."""
    pre = precompute_call(st, k, v, la, beta)
    states = state_call(st, k, v, la, s0, pre, emit_delta=True)
    return output_call(st, q, k, v, la, pre, states), states["final"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ssd(q, k, v, la, beta, s0, st: Static):
    return forward(st, q, k, v, la, beta, s0)


def _ssd_fwd(q, k, v, la, beta, s0, st):
    return forward(st, q, k, v, la, beta, s0), (q, k, v, la, beta, s0)       # residuals: the inputs only


def _ssd_bwd(st, res, cts):
    from flashlax.kernels.ssd_bwd import backward

    return backward(st, *res, *cts)


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def make_static(q, k, v, beta, *, scale: float, chunk_size: int, interpret: bool, config: SSDConfig | None,
                device_kind: str | None) -> Static:
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
    cfg = ssd_config(dk, dv, q.dtype, kind) if config is None else config
    chunk = min(int(chunk_size), cfg.max_chunk)
    check_ssd_config(cfg, dk, dv, chunk, q.dtype, kind)
    return Static(config=cfg, scale=float(scale), chunk=chunk, seq_len=seq_len, dk=dk, dv=dv,
                  has_beta=beta is not None, dtype=jnp.dtype(q.dtype), interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("scale", "return_final_state", "chunk_size", "interpret", "config",
                                             "device_kind"))
def gated_delta_rule_ssd(q, k, v, log_alpha, beta=None, *, scale: float, initial_state=None,
                         return_final_state: bool = False, chunk_size: int = 64, interpret: bool = False,
                         config: SSDConfig | None = None, device_kind: str | None = None):
    """Gated delta rule (``beta`` given) or gated linear attention / Mamba-2 SSD (``beta=None``), Pallas.

    q, k: [B, H, T, dk]; v: [B, H, T, dv] (one dtype of float32/bfloat16/float16, dk, dv <= 256);
    log_alpha, beta: [B, H, T]; initial_state: [B, H, dk, dv] or None. Returns o [B, H, T, dv] in v's
    dtype (and the final state [B, H, dk, dv] float32). Differentiable in every array (custom_vjp whose
    residuals are the inputs). ``config``: an SSDConfig (default: :func:`ssd_config` for the device kind);
    a chunk_size above its ``max_chunk`` runs at ``max_chunk`` (the same function).
    """
    st = make_static(q, k, v, beta, scale=scale, chunk_size=chunk_size, interpret=interpret, config=config,
                     device_kind=device_kind)
    batch, heads, _, dk = q.shape
    dv = v.shape[-1]
    la = log_alpha.astype(F32)
    beta32 = None if beta is None else beta.astype(F32)
    s0 = jnp.zeros((batch, heads, dk, dv), F32) if initial_state is None else initial_state.astype(F32)
    o, final = _ssd(q, k, v, la, beta32, s0, st)
    return (o, final) if return_final_state else o
