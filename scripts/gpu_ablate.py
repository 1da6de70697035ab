"""Where the ssd backward's dqk and wy kernels spend their time: each kernel timed with parts of its work
patched out (timing only: the patched kernels compute wrong values). One process, B2 H8 T8192 dk=dv 64
float32 with beta (the shipped H200 config) unless --bf16 (B2 H16 T8192 dk=dv 128 bfloat16).

Ablations (monkeypatches applied while the kernel is traced):
  base      the shipped kernel;
  tf32      float32 products in one tf32 pass instead of three (tf32x3): the cost of full precision;
  nograd    Decays.grad returns its d_gamma / d_elast inputs (no log_alpha-gradient algebra);
  nosumall  sum_all (whole-tile reductions) returns one element;
  nodecay   Decays.G returns ones (no exp of the decay matrices);
  oldseg    the in-block segment sums and log_alpha's prefix sums as masked products (through session 12)
            instead of cumulative sums;
  smalltc   the UT transform's 16 x 16 x 16 float32 products on the tensor cores as tf32x3 (small_f32_dot)
            instead of IEEE float32 FMAs (a config change: the same values to float32 rounding);
  smalltf32 those products in one tf32 pass (and every float32 product: Static.tf32);
  nout      T = I (ut_blocks skipped: what the UT transform costs the precompute);
  ut-kk, ut-inv, ut-merge, ut-decay
            the UT transform with one part skipped: K K^T products (a constant instead), the diagonal
            blocks' inverses (I - a instead of six products), the off-diagonal merges (zero blocks), the
            decays (the strict mask instead of exp of segment sums). Session 13 (bf16 dk128): precompute
            0.571 ms, nout 0.109: the UT transform is 80% of it, and neither tensor-core 16 x 16 products
            (smalltc 0.691) nor whole-chunk 64 x 64 ones (0.53 at 4 warps) made it cheaper.
  st-vec    the state kernel's per-chunk decay vectors (chunk_vectors: masked [C, C] sums and exps) as ones:
            what forming them in every sequential step costs;
  st-nostore
            the state kernel stores neither the chunk states h nor D (the final state only): what the per-step
            stores cost;
  all       everything above together (not st-*).

  python3 scripts/gpu_ablate.py --out $OUT [--kernels dqk,wy,out,dout] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_ssd  # noqa: E402
from _gpu_common import log  # noqa: E402

from flashlax.kernels import _ssd_tiles, ssd, ssd_bwd  # noqa: E402


@contextlib.contextmanager
def patched(name, st):
    saved = []

    def setattr_(obj, attr, value):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    names = {"tf32", "nograd", "nosumall", "nodecay"} if name == "all" else {name}
    if "tf32" in names:
        setattr_(_ssd_tiles.Static, "f32_precision", property(lambda self: lax.Precision.DEFAULT))
    if "nograd" in names:
        setattr_(_ssd_tiles.Decays, "grad", lambda self, d_exp, d_gamma=None, d_elast=None, d_total=None: [
            (d_gamma[i] if d_gamma is not None else 0.0) + (d_elast[i] if d_elast is not None else 0.0)
            + jnp.zeros((self.sb,), jnp.float32) for i in range(self.nb)])
    if "nosumall" in names:
        for mod in (ssd_bwd, _ssd_tiles):
            if hasattr(mod, "sum_all"):
                setattr_(mod, "sum_all", lambda x: x[0, 0])
    if "oldseg" in names:
        def diag_seg(self, i):
            ones = jnp.where(_ssd_tiles.tri(self.sb, "ge"), 1.0, 0.0)
            strict = jnp.where(_ssd_tiles.tri(self.sb, "gt"), self.la[i][:, None], 0.0)
            return _ssd_tiles.dot(ones, strict, st)

        def prefix_before(self, x):
            return _ssd_tiles.dot(x, jnp.where(_ssd_tiles.tri(self.sb, "lt"), 1.0, 0.0), st)
        setattr_(_ssd_tiles.Decays, "diag_seg", diag_seg)
        setattr_(_ssd_tiles.Decays, "prefix_before", prefix_before)
    if "st-vec" in names:
        setattr_(_ssd_tiles, "chunk_vectors", lambda la, st_: (1.0 + 0.0 * la, 1.0 + 0.0 * la, 1.0 + 0.0 * jnp.sum(la)))
    if "st-nostore" in names:
        real_store_state, real_store = ssd.store_state, ssd.store
        setattr_(ssd, "store_state", lambda ref, row0, col0, val, st_, user=False: (
            real_store_state(ref, row0, col0, val, st_, user=user) if user else None))
        setattr_(ssd, "store", lambda ref, *a, **kw: None)
    if "nodecay" in names:
        setattr_(_ssd_tiles.Decays, "G", lambda self, i, j, strict=False: jnp.ones((self.sb, self.sb), jnp.float32))
    def patch_ut(fn):       # the kernel modules call ut_blocks by the name they imported
        for mod in (ssd, ssd_bwd):
            if hasattr(mod, "ut_blocks"):
                setattr_(mod, "ut_blocks", fn)

    variant = st
    if name in ("smalltc", "smalltf32"):
        variant = dataclasses.replace(st, config=dataclasses.replace(st.config, small_f32_dot=True),
                                      tf32=name == "smalltf32")
    if name.startswith("ut-"):
        def ut_part_skipped(k, beta, dec, st_, skip=name[3:]):
            tiles = _ssd_tiles
            nb, sb = len(k), tiles.UT_BLOCK
            eye = jnp.where(tiles.iota((sb, sb), 0) == tiles.iota((sb, sb), 1), 1.0, 0.0)
            strict = jnp.where(tiles.tri(sb, "gt"), 1.0, 0.0)
            kk, g, a, t = {}, {}, {}, {}
            for i in range(nb):
                for j in range(i + 1):
                    kk[i, j] = 0.01 + 0.0 * eye if skip == "kk" else tiles.dot(k[i], k[j], st_, tb=True)
                    g[i, j] = (strict if i == j else 1.0 + 0.0 * eye) if skip == "decay" else dec.G(i, j, strict=True)
                    a[i, j] = beta[i][:, None] * kk[i, j] * g[i, j]
            for i in range(nb):
                x = a[i, i]
                if skip == "inv":
                    inv = eye - x
                else:
                    x2 = tiles.dot(x, x, st_)
                    x4 = tiles.dot(x2, x2, st_)
                    x8 = tiles.dot(x4, x4, st_)
                    inv = tiles.dot(tiles.dot(tiles.dot(eye - x, eye + x2, st_), eye + x4, st_), eye + x8, st_)
                t[i, i] = inv
                for j in range(i):
                    t[i, j] = 0.0 * eye if skip == "merge" else -tiles.dot(
                        inv, tiles.add_all(tiles.dot(a[i, m], t[m, j], st_) for m in range(j, i)), st_)
            return t, kk, g
        patch_ut(ut_part_skipped)
    if name == "nout":
        def ut_identity(k, beta, dec, st_):
            nb, sb = len(k), _ssd_tiles.UT_BLOCK
            eye = jnp.where(_ssd_tiles.iota((sb, sb), 0) == _ssd_tiles.iota((sb, sb), 1), 1.0, 0.0)
            t = {(i, j): eye if i == j else jnp.zeros((sb, sb), jnp.float32) for i in range(nb) for j in range(i + 1)}
            return t, dict(t), dict(t)
        patch_ut(ut_identity)
    try:
        yield variant
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--kernels", default="dqk,wy,out,dout")
    p.add_argument("--ablations", default="base,tf32,nograd,nosumall,nodecay,all")
    args = p.parse_args()
    if args.smoke:
        gpu_ssd.BENCH_KW.update(reps=1, min_iters=1, target_ms=0.0)
    shape = (1, 2, 100, 16) if args.smoke else (2, 16, 8192, 128) if args.bf16 else (2, 8, 8192, 64)
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    b, h, t, d = shape
    q, k, v, la, beta, do = gpu_ssd.inputs(b, h, t, d, d, dtype, seed=7, with_beta=True)
    st = ssd.make_static(q, k, v, beta, scale=d ** -0.5, chunk_size=64, interpret=args.smoke, config=None,
                         device_kind=None)
    log("config", st.config)
    all_args = gpu_ssd.kernel_args(st, q, k, v, la, beta, do)
    results = []
    for name in args.kernels.split(","):
        for ab in args.ablations.split(","):
            jax.clear_caches()
            with patched(ab, st) as st_ab:
                res = gpu_ssd.guarded(f"{name} {ab}", gpu_ssd.timed, gpu_ssd.kernel_fn(name, st_ab), *all_args[name])
            if res is not None:
                results.append(dict(kernel=name, ablation=ab, ms=res[0]))
                log(f"{name:8s} {ab:9s} {res[0]:.4f} ms")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ablate.json"), "w") as f:
            json.dump(dict(shape=shape, dtype=str(jnp.dtype(dtype)), results=results), f, indent=1)


if __name__ == "__main__":
    main()
