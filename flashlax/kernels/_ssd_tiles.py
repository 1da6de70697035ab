"""In-kernel helpers and pallas_call plumbing shared by the ssd kernels (flashlax/kernels/ssd.py, ssd_bwd.py):
the calls' static description, masked tile loads and stores, products with the precision rules, the decays
of a chunk by sub-blocks (and their reverse mode), the UT transform by 16 x 16 blocks, P, D, and named
refs / BlockSpecs for pallas_call. See ssd.py's docstring for the algorithm and the numerics.
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

from flashlax.kernels._tiles import pow2, sum_all
from flashlax.parallel.vma import out_struct
from flashlax.kernels.configs import SSDConfig

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
    backward: str = "pallas"   # "pallas": the Pallas backward kernels; "xla": the chunked XLA backward
    tf32: bool = False         # float32 products in one tf32 pass: the caller asked (flashlax/_precision.py)

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
        """Whether the sequential passes run in the transition form (``SSDConfig.transition``)."""
        if self.config.transition == "without_beta":
            return not self.has_beta
        return self.config.transition

    @property
    def mh_kernel(self) -> bool:
        """Whether the transition form's M and H are formed by their own kernel (``SSDConfig.mh_kernel``; with
        beta only), not by the precompute."""
        return self.config.mh_kernel and self.has_beta and self.transition

    @property
    def kdec(self) -> bool:
        """Whether the precompute stores k_dec for the state pass (``SSDConfig.kdec``; the two-product form
        with beta only: without beta there is no precompute, the transition form has no k in its chain)."""
        return self.config.kdec and self.has_beta and not self.transition

    @property
    def reverse_rinc(self) -> bool:
        """Whether the two-product form's reverse pass takes R_n from the dout kernel
        (``SSDConfig.reverse_rinc``; with beta only: without beta the transition form is that already)."""
        return self.config.reverse_rinc and self.has_beta and not self.transition

    @property
    def mm_dtype(self):
        """Operand dtype of the products of data-sized tiles: the input dtype."""
        return jnp.dtype(self.dtype)

    @property
    def f32_precision(self):
        """Precision of float32 products larger than 16 x 16 x 16: one tf32 pass when the caller asked for it
        (``tf32``), else the config's ``f32_dot``. The interpreter (CPU) computes every product in IEEE."""
        if self.tf32 and not self.interpret:
            return lax.Precision.DEFAULT
        if self.config.f32_dot == "tf32x3" and not self.interpret:
            return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        return lax.Precision.HIGHEST

    def block(self, kernel: str) -> int:
        """Sub-block of the chunk kernel ``kernel`` (SSDConfig.blocks, else SSDConfig.block), at most C."""
        return min(dict(self.config.blocks).get(kernel, self.config.block), self.chunk)

    def dqk_block_k(self) -> int:
        """dk columns per pass of the dqk kernel (SSDConfig.dqk_block_k, default all of them)."""
        return min(self.config.dqk_block_k or self.dkp, self.dkp)

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
    sums' algebra: three tensor-core passes would triple their code) unless the config's small_f32_dot,
    otherwise st.f32_precision (the config's f32_dot)."""
    if a.dtype != b.dtype:
        b = b.astype(a.dtype)
    small = max(a.shape + b.shape) <= UT_BLOCK and not st.config.small_f32_dot
    precision = (lax.Precision.HIGHEST if small else st.f32_precision) if a.dtype == F32 else None
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def mm(x, st: Static):
    """x as an operand of a data-sized product: the input dtype (tensor cores for bf16/f16)."""
    return x.astype(st.mm_dtype)


# ----------------------------------------------------------------------------------------------------
# Decays of one chunk, by sub-blocks
# ----------------------------------------------------------------------------------------------------

def add_all(terms):
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

    def __init__(self, la, sb: int):
        self.la, self.sb, self.nb = la, sb, len(la)
        # c[t] = sum_{r <= t} la_r (rows t, columns r: row >= col); suf[s] = sum_{r > s} la_r (row < col)
        self.c = [jnp.sum(jnp.where(tri(sb, "ge"), x[None, :], 0.0), axis=1) for x in la]
        self.suf = [jnp.sum(jnp.where(tri(sb, "lt"), x[None, :], 0.0), axis=1) for x in la]
        self.tot = [jnp.sum(x) for x in la]

    def pre(self, i):
        return add_all(self.tot[:i])

    def post(self, i):
        return add_all(self.tot[i + 1:])

    def gamma(self, i):
        """[sb] exp(sum of log_alpha from the chunk start to each row of block i, inclusive)."""
        return jnp.exp(self.pre(i) + self.c[i])

    def e_last(self, i):
        """[sb] exp(sum of log_alpha after each row of block i to the chunk end): decay to the end."""
        return jnp.exp(self.suf[i] + self.post(i))

    def chunk_decay(self):
        return jnp.exp(add_all(self.tot))

    def diag_seg(self, i):
        """[sb, sb] sum_{s < r <= t} la_r (0 on and above the diagonal): a cumulative sum down each column of
        the strictly lower masked log_alpha ([r, s] = la_r for r > s), as the XLA path's ``_decays``: each
        entry sums only its own segment (one sign, no cancellation). Not a product with a triangular ones
        matrix: in float32 that runs as three tf32 passes (docs/PERF_NOTES.md, session 12)."""
        return jnp.cumsum(jnp.where(tri(self.sb, "gt"), self.la[i][:, None], 0.0), axis=0)

    def prefix_before(self, x):
        """[sb, sb] [t, r] = sum_{s < r} x[t, s]: an exclusive cumulative sum along the rows."""
        return jnp.cumsum(x, axis=1) - x

    def G(self, i, j, strict: bool = False):
        """[sb, sb] decay from column token (block j) to row token (block i), 0 where not causal (and on
        the diagonal when ``strict``)."""
        if i > j:
            mid = add_all(self.tot[j + 1:i])
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
            if i - j > 1:     # one axis at a time (see sum_all)
                total = sum_all(g)
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
        out = []
        for m in range(nb):
            # c[t] = sum_{r <= t} la_r -> d la_r += sum_{t >= r} d_c[t]   (rows r, columns t: row <= col)
            d = jnp.sum(jnp.where(tri(sb, "le"), d_c[m][None, :], 0.0), axis=1)
            # suf[s] = sum_{r > s} la_r -> d la_r += sum_{s < r} d_suf[s]   (rows r, columns s: row > col)
            d = d + jnp.sum(jnp.where(tri(sb, "gt"), d_suf[m][None, :], 0.0), axis=1)
            d = d + d_tot[m]
            if (m, m) in d_exp:
                # inside block m: d la_r += sum_{t >= r} sum_{s < r} d_exp[t, s]
                z = self.prefix_before(d_exp[(m, m)])                   # [t, r] = sum_{s < r} d_exp[t, s]
                d = d + jnp.sum(jnp.where(tri(sb, "ge"), z, 0.0), axis=0)
            out.append(d)
        return out


def chunk_decays(ref, rows, sb: int, st: Static) -> Decays:
    """The Decays of one chunk, its log_alpha read from ``ref`` in [sb] pieces at ``rows``."""
    return Decays([load_vec(ref, row, sb, st) for row in rows], sb)


# ----------------------------------------------------------------------------------------------------
# The UT transform of one chunk, by 16 x 16 blocks
# ----------------------------------------------------------------------------------------------------

def ut_diagonal(k, beta, dec: Decays, st: Static):
    """The pieces of T = (I + A)^-1 of one chunk, A = strictly_lower(diag(beta) K K^T * G), by 16 x 16 blocks.

    k: list of [16, dk] blocks (input dtype), beta: list of float32 [16]. Returns (A, KK, G_strict, inv):
    dicts over block pairs (i, j), j <= i, of float32 [16, 16], and inv[i] = (I + A_ii)^-1. A diagonal block a
    is nilpotent (a^16 = 0), so (I + a)^-1 = (I - a)(I + a^2)(I + a^4)(I + a^8): six 16 x 16 products.
    """
    nb = len(k)
    kk, g_strict, a = {}, {}, {}
    for i in range(nb):
        for j in range(i + 1):
            kk[i, j] = dot(k[i], k[j], st, tb=True)
            g_strict[i, j] = dec.G(i, j, strict=True)
            a[i, j] = beta[i][:, None] * kk[i, j] * g_strict[i, j]
    eye = jnp.where(iota((UT_BLOCK, UT_BLOCK), 0) == iota((UT_BLOCK, UT_BLOCK), 1), 1.0, 0.0)
    inv = []
    for i in range(nb):
        x = a[i, i]
        x2 = dot(x, x, st)
        x4 = dot(x2, x2, st)
        x8 = dot(x4, x4, st)
        inv.append(dot(dot(dot(eye - x, eye + x2, st), eye + x4, st), eye + x8, st))
    return a, kk, g_strict, inv


def ut_blocks(k, beta, dec: Decays, st: Static):
    """T = (I + A)^-1 of one chunk by 16 x 16 blocks (see :func:`ut_diagonal`): the diagonal blocks in closed
    form, below the diagonal block forward substitution T_ij = -T_ii sum_{j <= m < i} A_im T_mj. Returns (T,
    KK, G_strict): dicts over block pairs (i, j), j <= i, of float32 [16, 16]."""
    a, kk, g_strict, inv = ut_diagonal(k, beta, dec, st)
    t = {}
    for i in range(len(k)):
        t[i, i] = inv[i]
        for j in range(i):
            t[i, j] = -dot(inv[i], add_all(dot(a[i, m], t[m, j], st) for m in range(j, i)), st)
    return t, kk, g_strict


def ut_apply(t_mm, rhs, st: Static):
    """X = T rhs from T's blocks on and below the diagonal as product operands (:func:`mm`): rhs a list of
    float32 [16, cols] blocks. Returns the float32 blocks of X."""
    rhs = [mm(x, st) for x in rhs]
    return [add_all(dot(t_mm[i, j], rhs[j], st) for j in range(i + 1)) for i in range(len(rhs))]


def ut_solve(a_mm, inv_mm, rhs, st: Static):
    """X = (I + A)^-1 rhs by block forward substitution, X_i = T_ii (rhs_i - sum_{j<i} A_ij X_j): rhs a list of
    float32 [16, cols] blocks; a_mm / inv_mm the blocks below the diagonal of A and T's diagonal blocks as
    product operands (:func:`mm`). Returns the float32 blocks of X."""
    out = []
    for i, x in enumerate(rhs):
        if i:
            x = x - add_all(dot(a_mm[i, j], mm(out[j], st), st) for j in range(i))
        out.append(dot(inv_mm[i], mm(x, st), st))
    return out


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------

def col_bound(n: int, padded: int) -> int | None:
    """Column bound for loads/stores of a user array (None when the head dim is already a power of two)."""
    return None if n == padded else n


def sequential_program(st: Static):
    """(dv columns per program, this program's first column, chunk size, dk and dv column bounds) of a
    sequential kernel (grid axis 0: dv blocks)."""
    bv = st.state_block_v()
    return (bv, pl.program_id(0) * bv, st.chunk, col_bound(st.dk, st.dkp), col_bound(st.dv, st.dvp))


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
    e_last = jnp.exp(jnp.sum(jnp.where(tri(st.chunk, "lt"), la[None, :], 0.0), axis=1))
    return chunk_gamma(la, st), e_last, jnp.exp(jnp.sum(la))


def chunk_gamma(la, st: Static):
    """gamma [C] of :func:`chunk_vectors` alone."""
    return jnp.exp(jnp.sum(jnp.where(tri(st.chunk, "ge"), la[None, :], 0.0), axis=1))


def chunk_keys(r, r0, la, st: Static, kcols, gamma: bool = False):
    """(k_dec [C, dkp] mm dtype, chunk decay, gamma [C] or None) of the chunk at row ``r0`` for a sequential
    pass: k_dec read as stored by the precompute (``r["kdec"]``, SSDConfig.kdec) or formed from ``r["k"]`` and
    log_alpha ``la`` [C]; gamma only when asked (None otherwise)."""
    if "kdec" in r:
        return (load(r["kdec"], r0, st.chunk, 0, st.dkp, st), jnp.exp(jnp.sum(la)),
                chunk_gamma(la, st) if gamma else None)
    g, e_last, decay = chunk_vectors(la, st)
    k_dec = mm(load(r["k"], r0, st.chunk, 0, st.dkp, st, kcols).astype(F32) * e_last[:, None], st)
    return k_dec, decay, g if gamma else None


def load_square(ref, row0, col0, st: Static, cols: int, rows: int | None = None):
    """[dkp (or rows), cols] tile of one of our per-chunk [N * dkp, width] arrays (chunk states, M, H, R)."""
    return plgpu.load(ref.at[ds(row0, st.dkp if rows is None else rows), ds(col0, cols)])


def state_block(ref, row0, col0, st: Static, bv: int):
    """[dk, bv] of a per-(batch, head) [dk, dv] state ref (user arrays: masked to dk, dv)."""
    mask = ((iota((st.dkp, bv), 0) < st.dk) & (col0 + iota((st.dkp, bv), 1) < st.dv))
    return plgpu.load(ref.at[ds(row0, st.dkp), ds(col0, bv)], mask=mask, other=0.0).astype(F32)


def store_chunk_matrix(ref, rows, blocks: dict, st: Static):
    """One chunk's lower-triangular [C, C] matrix from its sub-blocks ``blocks`` {(i, j): [sb, sb]}, j <= i, into
    a [T, C] ref (row r: row r % C of its chunk's matrix): every block, the zero ones above the diagonal too,
    so a reader may cut the chunk into other sub-blocks (T, and SSDConfig.store_p / store_kg's P and KG)."""
    sb = next(iter(blocks.values())).shape[0]
    zero = jnp.zeros((sb, sb), F32)
    for i, row in enumerate(rows):
        for j in range(len(rows)):
            store(ref, row, j * sb, blocks[i, j] if j <= i else zero, st)


def store_state(ref, row0, col0, val, st: Static, user: bool = False):
    mask = None
    if user:
        shape = val.shape
        mask = (iota(shape, 0) < st.dk) & (col0 + iota(shape, 1) < st.dv)
    plgpu.store(ref.at[ds(row0, val.shape[0]), ds(col0, val.shape[1])], val.astype(ref.dtype), mask=mask)


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
        return [load(r["v"], row, sb, c0, bv, st, col_bound(st.dv, st.dvp)) for row in rows]
    return [mm(load(r["u"], row, sb, c0, bv, st).astype(F32) - dot(w[i], h, st), st) for i, row in enumerate(rows)]


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
    warps = dict(cfg.warps).get(name.removeprefix("ssd_").removesuffix("_bwd"),
                                cfg.state_warps if sequential else cfg.num_warps)
    params = plgpu.CompilerParams(num_warps=warps, num_stages=cfg.state_stages if sequential else 1)
    arrays = [x for x, _ in inputs.values()]
    # inside a caller's shard_map (check_vma=True) each output varies over the mesh axes its inputs vary over
    out_shape = [out_struct(sds.shape, sds.dtype, *arrays) for sds, _ in outputs.values()]
    outs = pl.pallas_call(
        functools.partial(kernel, names=names, st=st), grid=(grid0, bh[1], bh[0]),
        in_specs=[spec for _, spec in inputs.values()], out_specs=[spec for _, spec in outputs.values()],
        out_shape=out_shape, compiler_params=params, interpret=st.interpret, name=name)(*arrays)
    return dict(zip(outputs, outs))
