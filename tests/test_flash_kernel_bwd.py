"""Tests of the Pallas flash-attention backward (flashlax/kernels/flash_attention_bwd.py).

The kernels run in the Pallas interpreter on CPU (interpret=True) and are compared with jax.vjp of a
float64 reference that materialises the scores. Residuals (out, lse) come from that reference, so these
tests check the backward alone; the forward has its own tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import TOLERANCES, on_gpu, rel_err
from flashlax import masks, score_mods
from flashlax.kernels import flash_attention_bwd as fab
from flashlax.kernels._tiles import TileMod
from flashlax.masks import create_block_mask

# Tiny tiles keep the interpreter fast; the kernels clip them to divisors of the block-mask tiles.
TINY = fab.BwdConfig(block_q_dkv=16, block_kv_dkv=32, block_q_dq=32, block_kv_dq=16, block_delta=32)


# ----------------------------------------------------------------------------------------------------
# float64 reference with materialised scores
# ----------------------------------------------------------------------------------------------------

def reference_attention(q, k, v, *, scale, score_mod=None, mask_mod=None):
    """(out [B, Hq, Lq, Dv], lse [B, Hq, Lq]); fully masked rows give 0 and -inf, with NaN-free gradients."""
    bsz, hq, lq, _ = q.shape
    groups = hq // k.shape[1]
    lkv = k.shape[2]
    kr, vr = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, kr) * scale
    b = jnp.arange(bsz, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(hq, dtype=jnp.int32)[None, :, None, None]
    qi = jnp.arange(lq, dtype=jnp.int32)[None, None, :, None]
    ki = jnp.arange(lkv, dtype=jnp.int32)[None, None, None, :]
    if score_mod is not None:
        s = jnp.broadcast_to(score_mod(s, b, h, qi, ki), s.shape)
    allowed = jnp.ones(s.shape, bool) if mask_mod is None else jnp.broadcast_to(mask_mod(b, h, qi, ki), s.shape)
    s_safe = jnp.where(allowed, s, 0.0)
    row_max = jnp.max(jnp.where(allowed, s_safe, -jnp.inf), axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(allowed, jnp.exp(s_safe - row_max), 0.0)
    denom = e.sum(-1, keepdims=True)
    denom_safe = jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhqk,bhkd->bhqd", e / denom_safe, vr)
    lse = jnp.where(denom[..., 0] > 0, jnp.log(denom_safe[..., 0]) + row_max[..., 0], -jnp.inf)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# Cases: mods are built from their captured arrays, so the kernel receives closure-converted mods
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    bsz: int = 1
    hq: int = 2
    hkv: int = 1
    lq: int = 40
    lkv: int = 40
    d: int = 32
    dv: int | None = None
    mask: str | None = None
    mod: str | None = None
    block_q: int = 32          # block-mask tiles
    block_kv: int = 32
    dtype: str = "float32"
    seed: int = 0
    config: Any = None         # BwdConfig; None: TINY
    dense: bool = False        # mask None only: pass block_mask=None (the dense loops) instead of all-full


def _segments(rng, bsz, length, n_docs):
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(n_docs - 1, length - 1), replace=False))
    ids = np.zeros((bsz, length), np.int32)
    for c in cuts:
        ids[:, c:] += 1
    return ids


def build(case: Case, rng):
    """Returns (mask_mod, mask_captured, mask_builder, score_mod, score_captured, score_builder).

    *_builder(*captured) -> the plain mod; the converted mod takes the captured arrays first.
    """
    mask_caps, mask_builder = (), None
    if case.mask == "causal":
        mask_builder = lambda: masks.causal
    elif case.mask == "sliding":
        mask_builder = lambda: masks.sliding_window(7, 3)
    elif case.mask == "prefix_lm":
        mask_builder = lambda: masks.prefix_lm(5)
    elif case.mask == "headwise":
        # odd query heads see everything, even heads are causal: a block mask per head (Hm = Hq), so
        # the dK/dV program reads a different tile list for each head of its group.
        mask_builder = lambda: (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (h % 2 == 1))
    elif case.mask == "striped":
        # keys in every other block of 16, causal: full-tile lists 0, 2, 4, ... are not consecutive, so
        # both the address-arithmetic run and the index-list loop are exercised.
        mask_builder = lambda: masks.and_masks(masks.causal, lambda b, h, q_idx, kv_idx: (kv_idx // 16) % 2 == 0)
    elif case.mask == "document":
        q_seg = _segments(rng, case.bsz, case.lq, 3)
        # kv ids: a shifted copy, so some query rows find no key of their document (fully masked rows).
        kv_seg = _segments(rng, case.bsz, case.lkv, 3) + (1 if case.seed % 2 else 0)
        mask_caps = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
        mask_builder = masks.document
    elif case.mask is not None:
        raise ValueError(case.mask)
    score_caps, score_builder = (), None
    if case.mod == "softcap":
        score_builder = lambda: score_mods.softcap(2.0)
    elif case.mod == "alibi":
        score_caps = (jnp.asarray(rng.uniform(0.05, 0.5, case.hq)),)
        score_builder = score_mods.alibi
    elif case.mod == "relative_bias":
        score_caps = (jnp.asarray(rng.normal(size=(case.hq, 2 * 9 - 1))),)
        score_builder = score_mods.relative_bias
    elif case.mod is not None:
        raise ValueError(case.mod)
    return mask_caps, mask_builder, score_caps, score_builder


def run_case(case: Case, *, config=TINY, interpret=True):
    rng = np.random.default_rng(case.seed)
    dv = case.dv or case.d
    mask_caps, mask_builder, score_caps, score_builder = build(case, rng)
    # The kernels get closure-converted mods (captured arrays first), as the forward's custom_vjp passes
    # them: a TileMod evaluates the mod with the captured arrays replaced by kernel refs.
    mask_conv = score_conv = None
    kernel_mask_caps = ()
    f32_caps = tuple(jnp.asarray(c, jnp.float32) for c in score_caps)
    if mask_builder is not None:
        mask_tm = TileMod.make(mask_builder(*(jnp.asarray(c) for c in mask_caps)), "mask")
        n_mc = mask_tm.num_captured
        mask_conv = lambda *a: mask_tm(a[:n_mc], *a[n_mc:])
        kernel_mask_caps = tuple(mask_tm.captured)
    if score_builder is not None:
        score_tm = TileMod.make(score_builder(*f32_caps), "score")
        n_sc = score_tm.num_captured
        score_conv = lambda *a: score_tm(a[:n_sc], *a[n_sc:])
        assert n_sc == len(score_caps)
    scale = case.d ** -0.5
    shapes = [(case.bsz, case.hq, case.lq, case.d), (case.bsz, case.hkv, case.lkv, case.d),
              (case.bsz, case.hkv, case.lkv, dv), (case.bsz, case.hq, case.lq, dv)]
    q, k, v, dout = [rng.standard_normal(s) for s in shapes]
    dtype = jnp.dtype(case.dtype)
    # Inputs rounded to the kernel dtype first, so the reference sees the same numbers.
    q, k, v, dout = [np.asarray(jnp.asarray(x, dtype), np.float64) for x in (q, k, v, dout)]
    with jax.enable_x64():
        mcaps64 = tuple(jnp.asarray(c) for c in mask_caps)
        scaps64 = tuple(jnp.asarray(c, jnp.float64) for c in score_caps)

        def f(q_, k_, v_, scaps):
            return reference_attention(
                q_, k_, v_, scale=scale,
                score_mod=None if score_builder is None else score_builder(*scaps),
                mask_mod=None if mask_builder is None else mask_builder(*mcaps64))

        @jax.jit          # one program, not one compile per eager op
        def out_lse_grads(q_, k_, v_, scaps, dout_):
            (out, lse), vjp = jax.vjp(f, q_, k_, v_, scaps)
            return out, lse, vjp((dout_, jnp.zeros_like(lse)))

        out, lse, ref_grads = out_lse_grads(*(jnp.asarray(x) for x in (q, k, v)), scaps64, jnp.asarray(dout))
        ref_grads = jax.tree.map(np.asarray, ref_grads)
        out, lse = np.asarray(out), np.asarray(lse)
    mask_caps32 = tuple(jnp.asarray(c) for c in mask_caps)
    plain_mask = None if mask_builder is None else mask_builder(*mask_caps32)
    block_mask = create_block_mask(plain_mask, case.bsz if case.mask == "document" else None,
                                   case.hq if case.mask == "headwise" else None,
                                   case.lq, case.lkv, block_q=case.block_q, block_kv=case.block_kv)
    if case.dense:
        assert plain_mask is None
        block_mask = None
    args = [jnp.asarray(x, dtype) for x in (q, k, v, out)]
    call = lambda: fab.flash_attention_bwd(
        *args, jnp.asarray(lse, jnp.float32), jnp.asarray(dout, dtype), block_mask=block_mask,
        score_mod=score_conv, mask_mod=mask_conv,
        captured={"score": f32_caps, "mask": kernel_mask_caps},
        scale=scale, config=config, interpret=interpret)
    return call, ref_grads, lse


def check_case(case: Case, *, config=None, tol=None, interpret=True):
    config = config or case.config or TINY
    call, (gq, gk, gv, gcaps), lse = run_case(case, config=config, interpret=interpret)
    dq, dk, dv, dcaps = call()
    assert dq.shape == gq.shape and dq.dtype == jnp.dtype(case.dtype)
    assert dk.shape == gk.shape and dk.dtype == jnp.dtype(case.dtype)
    assert dv.shape == gv.shape and dv.dtype == jnp.dtype(case.dtype)
    tol = tol or 3 * TOLERANCES[case.dtype]
    for name, got, want in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
        err = rel_err(got, want)
        assert err < tol, f"{name}: rel err {err:.2e} >= {tol:.1e} for {case}"
    for got, want in zip(dcaps["score"], gcaps):
        # The gradient of a captured array can vanish exactly (one key per row: P = 1, dS = 0, the sum
        # is pure float32 rounding), so besides the relative error allow an absolute one at the
        # rounding level of a sum of B*Hq*Lq*Lkv terms weighted by offsets up to max(Lq, Lkv).
        atol = 1e-6 * np.sqrt(case.bsz * case.hq * case.lq * case.lkv) * max(case.lq, case.lkv)
        err = np.linalg.norm(np.asarray(got, np.float64) - want)
        assert np.all(np.isfinite(np.asarray(got))) and err <= tol * np.linalg.norm(want) + atol, \
            f"dcaptured: abs err {err:.2e}, |want| {np.linalg.norm(want):.2e} for {case}"
    for got in dcaps["mask"]:
        assert not np.any(np.asarray(got))
    dead = ~np.isfinite(lse)                      # fully masked query rows: exactly zero gradient
    if dead.any():
        assert np.all(np.asarray(dq, np.float64)[dead] == 0.0)
    return dq, dk, dv, dcaps


CASES = [
    Case(),
    Case(mask="causal", hq=3, hkv=1, lq=33, lkv=70, d=64),                 # Lq != Lkv, G=3
    Case(mask="striped", hq=2, hkv=1, lq=90, lkv=90, block_q=16, block_kv=16,
         config=fab.BwdConfig(16, 16, 16, 16, block_delta=32)),
    Case(mask="sliding", hq=4, hkv=1, lq=70, lkv=50, d=96, dv=32),         # G=4, D=96, Dv != D
    Case(mask="document", bsz=2, hq=2, hkv=2, lq=48, lkv=48, seed=1),      # per-batch mask, dead rows
    Case(mask="headwise", hq=4, hkv=2, lq=40, lkv=40),                     # per-head mask inside a group
    Case(mask="prefix_lm", hq=2, hkv=1, lq=37, lkv=37, mod="softcap"),
    Case(mask="causal", hq=4, hkv=2, lq=40, lkv=40, mod="alibi"),
    Case(mask=None, hq=2, hkv=1, lq=29, lkv=35, mod="relative_bias"),
    # block_mask=None: the dense loops (static trip counts, no index arrays), odd edges, G=3
    Case(mask=None, hq=3, hkv=1, lq=45, lkv=77, d=48, dense=True),
    Case(mask=None, hq=2, hkv=1, lq=50, lkv=31, mod="alibi", dense=True),
    # block-mask tiles larger than the backward tiles: sub-tiles past Lq / Lkv inside the last tile
    Case(mask="causal", hq=2, hkv=1, lq=96, lkv=96, block_q=64, block_kv=64),
]


def _case_id(c):
    return f"{c.mask}-{c.mod}-G{c.hq // c.hkv}-{c.lq}x{c.lkv}-d{c.d}{'-dense' * c.dense}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bwd_matches_float64_reference(case):
    check_case(case)


@given(
    groups=st.sampled_from([1, 2, 3, 4]),
    lq=st.integers(1, 80),
    lkv=st.integers(1, 80),
    d=st.sampled_from([32, 64, 96]),
    mask=st.sampled_from([None, "causal", "sliding", "document", "prefix_lm"]),
    mod=st.sampled_from([None, "alibi", "softcap", "relative_bias"]),
    blocks=st.sampled_from([(16, 16), (32, 16), (16, 32), (32, 32)]),
    seed=st.integers(0, 2**16),
)
def test_bwd_property(groups, lq, lkv, d, mask, mod, blocks, seed):
    if mask == "document":
        lq = lkv = max(lq, 4)
    check_case(Case(hq=groups, hkv=1, lq=lq, lkv=lkv, d=d, mask=mask, mod=mod,
                    block_q=blocks[0], block_kv=blocks[1], seed=seed))


def test_bwd_bfloat16():
    check_case(Case(mask="causal", hq=4, hkv=2, lq=48, lkv=48, d=64, dtype="bfloat16"))


def test_fully_masked_rows_give_zero_gradients():
    # Queries 0..7 see no key (the mask allows kv >= q + 8 only for q >= 8): lse = -inf there.
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 8) & (kv_idx <= q_idx)
    rng = np.random.default_rng(3)
    bsz, hq, lq, d = 1, 2, 40, 32
    q, k, v, dout = [jnp.asarray(rng.standard_normal((bsz, hq if i in (0, 3) else 1, lq, d)), jnp.float32)
                     for i in range(4)]
    out, lse = reference_attention(q, k, v, scale=0.2, mask_mod=mask_mod)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :8]))
    bmask = create_block_mask(mask_mod, None, None, lq, lq, block_q=16, block_kv=16)
    dq, dk, dv, _ = fab.flash_attention_bwd(q, k, v, out, lse, dout, block_mask=bmask, score_mod=None,
                                            mask_mod=mask_mod, captured=(), scale=0.2, config=TINY,
                                            interpret=True)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq)[:, :, :8] == 0.0)
    _, vjp = jax.vjp(lambda q_, k_, v_: reference_attention(q_, k_, v_, scale=0.2, mask_mod=mask_mod)[0], q, k, v)
    for got, want in zip((dq, dk, dv), vjp(dout)):
        assert rel_err(got, want) < 1e-4


def test_bwd_is_deterministic():
    call, _, _ = run_case(Case(mask="causal", hq=4, hkv=1, lq=50, lkv=50, mod="alibi", seed=7))
    first, second = call(), call()
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_block_mask_and_refit_mask_agree():
    """block_mask=None (no mask: the backward's dense loops) gives the same bits as an all-full mask with
    the backward's tiles; a causal mask whose tiles (16, 16) are smaller than the
    config's is rebuilt and agrees with one built at the config's tiles."""
    rng = np.random.default_rng(11)
    bsz, hq, hkv, length, d = 1, 4, 2, 45, 32
    q, dout = (jnp.asarray(rng.standard_normal((bsz, hq, length, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((bsz, hkv, length, d)), jnp.float32) for _ in range(2))
    for mask_mod in (None, masks.causal):
        out, lse = reference_attention(q, k, v, scale=0.3, mask_mod=mask_mod)
        run = lambda bm: fab.flash_attention_bwd(q, k, v, out, lse, dout, block_mask=bm, mask_mod=mask_mod,
                                                 scale=0.3, config=TINY, interpret=True)[:3]
        small = None if mask_mod is None else create_block_mask(mask_mod, None, None, length, length,
                                                                  block_q=16, block_kv=16)
        fitted = create_block_mask(mask_mod, None, None, length, length, block_q=32, block_kv=32)
        for a, b in zip(run(small), run(fitted)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family", sorted(fab.BWD_CONFIGS))
def test_shipped_configs_fit_shared_memory(family):
    from flashlax.kernels.configs import SMEM_LIMITS
    for (max_d, cls), cfg in [*fab.BWD_CONFIGS[family].items(), *fab.BWD_DENSE_CONFIGS[family].items()]:
        itemsize = 2 if cls == "16" else 4
        cfg.check_smem(max_d, max_d, itemsize, SMEM_LIMITS[family])
        assert 0 < cfg.smem_bytes(max_d, max_d, itemsize) <= SMEM_LIMITS[family]
    for cfg in [*fab.BWD_CONFIGS["rtx3090"].values(), *fab.BWD_DENSE_CONFIGS["rtx3090"].values()]:  # 99 KB
        assert cfg.smem_bytes(128, 128, 2) <= 101376


@pytest.mark.parametrize("d", [128, 256])
def test_shipped_h200_bf16_tiles_interpreted(d):
    """The H200 bf16 backward tiles (dK/dV 64/128 + dQ 128/128 at D128, 64/32 + 32/64 at D256), interpreted
    at an odd length with a causal mask on 128 x 128 block-mask tiles (so no tile is clipped to a smaller
    block-mask tile): the tile shapes the GPU runs, checked against the reference here too."""
    config = fab.default_bwd_config(d, d, "bfloat16", device_kind="NVIDIA H200")
    assert fab._sub_tile(config.block_kv_dkv, 128) == config.block_kv_dkv
    assert fab._sub_tile(config.block_q_dq, 128) == config.block_q_dq
    check_case(Case(bsz=1, hq=4, hkv=2, lq=150, lkv=150, d=d, mask="causal", block_q=128, block_kv=128,
                    dtype="float32"), config=config)


def test_shipped_h200_dense_tiles_interpreted():
    """The H200 D128 config of unmasked calls (dQ 128/64 s3), interpreted at odd, unequal lengths with no
    mask: the dense static loops with edge tiles, against the reference."""
    config = fab.default_bwd_config(128, 128, "bfloat16", device_kind="NVIDIA H200", dense=True)
    assert config != fab.default_bwd_config(128, 128, "bfloat16", device_kind="NVIDIA H200")
    check_case(Case(bsz=1, hq=4, hkv=2, lq=150, lkv=200, d=128, mask=None, dtype="float32",
                    dense=True), config=config)


def test_config_validation():
    with pytest.raises(ValueError, match="block_q_dkv"):
        fab.BwdConfig(block_q_dkv=48)
    with pytest.raises(ValueError, match="num_warps_dq"):
        fab.BwdConfig(num_warps_dq=3)


def test_smem_check_rejects_oversized_config():
    big = fab.BwdConfig(block_q_dkv=256, block_kv_dkv=256, block_q_dq=256, block_kv_dq=256,
                        num_stages_dkv=4, num_stages_dq=4)
    with pytest.raises(ValueError, match="shared memory"):
        big.check_smem(256, 256, 2, 101376)


# ----------------------------------------------------------------------------------------------------
# Real GPU (device machine): realistic shapes, bf16 and float32
# ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mask", ["causal", None, "document"])
def test_bwd_gpu(dtype, mask):
    case = Case(bsz=1, hq=8, hkv=2, lq=1000, lkv=1000, d=128, mask=mask, mod="softcap" if mask else None,
                block_q=128, block_kv=128, dtype=dtype)
    check_case(case, config=fab.default_bwd_config(128, 128, case.dtype), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "document"])
def test_bwd_gpu_transposed_dkdv(d, mask):
    """No score_mod: the dK/dV pass takes the transposed tile (mask_mod on partial tiles), with each head
    dim's shipped config; odd lengths so edge tiles are masked too."""
    case = Case(bsz=1, hq=8, hkv=2, lq=1000, lkv=1000, d=d, mask=mask, mod=None, block_q=128, block_kv=128,
                dtype="bfloat16")
    check_case(case, config=fab.default_bwd_config(d, d, case.dtype), interpret=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernels_lower_to_triton(dtype):
    """The three kernels go through the Pallas Triton lowering (for an abstract H200, no GPU needed):
    catches what the interpreter accepts but the Triton lowering does not (several indexers on one load,
    non-power-of-two tiles, mixed integer widths)."""
    abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)
    bsz, hq, hkv, length, d = 1, 4, 2, 200, 96
    seg = jnp.asarray(np.repeat(np.arange(3), 70)[None, :length], jnp.int32)
    mask_tm = TileMod.make(masks.and_masks(masks.causal, masks.document(seg)), "mask")
    score_tm = TileMod.make(score_mods.alibi(jnp.linspace(0.1, 0.5, hq)), "score")
    nm, ns = mask_tm.num_captured, score_tm.num_captured
    bmask = create_block_mask(mask_tm.fn, bsz, None, length, length, block_q=128, block_kv=64)
    sd = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))

    def f(q, k, v, out, lse, dout, caps):
        return fab.flash_attention_bwd(
            q, k, v, out, lse, dout, block_mask=bmask, score_mod=lambda *a: score_tm(a[:ns], *a[ns:]),
            mask_mod=lambda *a: mask_tm(a[:nm], *a[nm:]), captured=caps, scale=0.1,
            config=fab.default_bwd_config(d, d, dtype, "NVIDIA H200"))

    caps = {"score": tuple(score_tm.captured), "mask": tuple(mask_tm.captured)}
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(sd((bsz, hq, length, d)), sd((bsz, hkv, length, d)), sd((bsz, hkv, length, d)),
                                sd((bsz, hq, length, d)), sd((bsz, hq, length), "float32"),
                                sd((bsz, hq, length, d)), caps).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("flex_bwd_delta", "flex_bwd_dkdv", "flex_bwd_dq"):
        assert name in text
