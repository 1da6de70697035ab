"""The implementations a suite times: flashlax's own paths and the peers (jax_xla, jax_cudnn, torch_sdpa).

Every runner takes the suite's inputs in flashlax's heads-first layout ``[B, H, L, D]`` and says how to
convert them into its own layout *outside* the timed region (``prepare``) and its output and gradients back
(``finish``), so peers are timed on their native layout and compared against the same reference.

Peers, all on the same inputs, in the same process and run:

* ``jax_xla``: ``jax.nn.dot_product_attention(implementation="xla")`` in BTNH. jax handles GQA itself when
  Hq is a multiple of Hkv (it reshapes queries into groups), so K/V are passed unrepeated, which is what
  a jax user writes.
* ``jax_cudnn``: the same with ``implementation="cudnn"`` (GPU only; cuDNN wants bf16/fp16).
* ``torch_sdpa``: ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` on tensors
  copied from the same inputs (only when torch is importable).

Masks the peers cannot express natively get an explicit boolean ``[Lq, Lkv]`` mask (decode: new token ``i``
sees the cache up to position ``Lkv - Lq + i``; jax's and torch's ``is_causal`` are top-left aligned).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import flashlax
from flashlax import dispatch
from flashlax.bench import harness

JAX_PEERS = ("jax_xla", "jax_cudnn")
TORCH_PEERS = ("torch_sdpa", "torch_flex")
# jax's in-tree Pallas Triton flash attention (deprecated upstream; no GQA, so K/V are repeated in the timed
# function, as its users must do). GPU only here: in the interpreter it would only time the interpreter.
PALLAS_MHA = "jax_pallas_mha"


@dataclasses.dataclass
class Runner:
    """One implementation in a suite.

    fn: ``fn(*inputs) -> out`` on prepared inputs (jax arrays, or torch tensors when kind == "torch").
    prepare / finish: layout conversion of each input (cotangent included) / of the output and each
    gradient, applied outside timing. extra: fields added to the row (e.g. decode's num_splits).
    """

    name: str
    fn: Callable
    kind: str = "jax"  # "jax" | "torch"
    prepare: Callable[[Any], Any] = lambda x: x
    finish: Callable[[Any], Any] = lambda x: x
    extra: dict = dataclasses.field(default_factory=dict)


def _to_btnh(x):
    return jnp.swapaxes(x, 1, 2) if getattr(x, "ndim", 0) == 4 else x


def unavailable(name: str, exc: BaseException) -> Runner:
    """A runner that raises ``exc`` when called: its rows become error rows."""

    def fn(*_):
        raise exc

    return Runner(name, fn)


# ----------------------------------------------------------------------------------------------------------
# jax peers


def jax_sdpa(name: str, *, causal: bool = False, dense_mask: np.ndarray | None = None,
             local_window: int | None = None, scale: float | None = None) -> Runner:
    """jax.nn.dot_product_attention in BTNH; ``dense_mask [Lq, Lkv]`` bool when the mask is not causal/full."""
    if name not in JAX_PEERS:
        raise ValueError(f"unknown jax peer {name!r}")
    implementation = name.removeprefix("jax_")
    if implementation == "cudnn" and not harness.on_gpu():
        return unavailable(name, RuntimeError("jax_cudnn requires a GPU backend."))
    mask = None if dense_mask is None else jnp.asarray(dense_mask)[None, None]
    window = None if local_window is None else (local_window, 0)

    def fn(query, key, value):
        return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale, is_causal=causal,
                                            local_window_size=window, implementation=implementation)

    return Runner(name, fn, prepare=_to_btnh, finish=_to_btnh)


def jax_pallas_mha(*, causal: bool = False, scale: float | None = None) -> Runner:
    """``jax.experimental.pallas.ops.gpu.attention.mha`` in BTNH with K/V repeated to Hq heads (it has no
    GQA) inside the timed function; its default block sizes (128/128 forward, 32 backward)."""
    if not harness.on_gpu():
        return unavailable(PALLAS_MHA, RuntimeError(f"{PALLAS_MHA} requires a GPU backend."))
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():  # the module warns that it is deprecated in favour of tokamax
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415

    def fn(query, key, value):
        group = query.shape[2] // key.shape[2]
        key, value = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
        sm_scale = query.shape[-1] ** -0.5 if scale is None else scale
        return pallas_attention.mha(query, key, value, None, sm_scale=sm_scale, causal=causal)

    return Runner(PALLAS_MHA, fn, prepare=_to_btnh, finish=_to_btnh)


# ----------------------------------------------------------------------------------------------------------
# torch peers


def _torch_io(torch, device: str):
    """(prepare, finish): jax array -> torch tensor on ``device``; torch tensor -> float numpy."""

    def prepare(x):
        array = np.array(jax.device_get(x))  # a writable copy: torch.from_numpy warns on read-only arrays
        if array.dtype == jnp.bfloat16:  # numpy bf16 (ml_dtypes) does not cross into torch directly
            return torch.from_numpy(array.astype(np.float32)).to(device=device, dtype=torch.bfloat16)
        return torch.from_numpy(array).to(device)

    def finish(t):
        return np.asarray(t.detach().float().cpu().numpy())

    return prepare, finish


def _torch_device(torch, torch_device: str | None) -> str:
    return torch_device or ("cuda" if harness.on_gpu() and torch.cuda.is_available() else "cpu")


def torch_sdpa(*, causal: bool = False, dense_mask: np.ndarray | None = None, scale: float | None = None,
               torch_device: str | None = None) -> Runner:
    torch = harness.torch_module()
    if torch is None:
        return unavailable("torch_sdpa", RuntimeError("torch is not installed."))
    device = _torch_device(torch, torch_device)
    mask = None if dense_mask is None else torch.from_numpy(np.array(dense_mask, dtype=bool)).to(device)
    functional = torch.nn.functional
    prepare, finish = _torch_io(torch, device)

    def fn(query, key, value):
        return functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal,
                                                       scale=scale, enable_gqa=key.shape[1] != query.shape[1])

    return Runner("torch_sdpa", fn, kind="torch", prepare=prepare, finish=finish, extra={"torch_device": device})


def torch_flex(*, batch: int, lq: int, lkv: int, mask: str = "full", window: int | None = None,
               segment_ids: np.ndarray | None = None, scale: float | None = None,
               torch_device: str | None = None) -> Runner:
    """torch FlexAttention under ``torch.compile`` (its fast path) with a torch BlockMask built once, outside
    timing, for ``mask`` in full / causal / sliding_window (``window`` keys back) / document (``segment_ids
    [B, L]`` and causal). GPU only: on CPU torch compiles flex attention into a slow loop nobody times."""
    torch = harness.torch_module()
    if torch is None:
        return unavailable("torch_flex", RuntimeError("torch is not installed."))
    device = _torch_device(torch, torch_device)
    if not device.startswith("cuda"):
        return unavailable("torch_flex", RuntimeError("torch_flex requires a CUDA device."))
    from torch.nn.attention import flex_attention as torch_flex_module  # noqa: PLC0415

    if mask == "full":
        mask_fn = None
    elif mask == "causal":
        def mask_fn(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    elif mask == "sliding_window":
        def mask_fn(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    elif mask == "document":
        segments = torch.from_numpy(np.asarray(segment_ids, dtype=np.int32)).to(device)

        def mask_fn(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (segments[b, q_idx] == segments[b, kv_idx])
    else:
        return unavailable("torch_flex", ValueError(f"torch_flex: unknown mask {mask!r}"))
    block_mask = None if mask_fn is None else torch_flex_module.create_block_mask(
        mask_fn, batch if mask == "document" else None, None, lq, lkv, device=device)
    compiled = torch.compile(torch_flex_module.flex_attention, dynamic=False)
    prepare, finish = _torch_io(torch, device)

    def fn(query, key, value):
        return compiled(query, key, value, block_mask=block_mask, scale=scale,
                        enable_gqa=key.shape[1] != query.shape[1])

    return Runner("torch_flex", fn, kind="torch", prepare=prepare, finish=finish, extra={"torch_device": device})


def torch_sync(torch_device: str):
    torch = harness.torch_module()

    def sync(out):
        if torch_device.startswith("cuda"):
            torch.cuda.synchronize()
        return out

    return sync


# ----------------------------------------------------------------------------------------------------------
# flashlax's own paths


# Names of flashlax's implementations before they were the dispatcher's own (seed files, old commands):
# accepted on the command line and when loading old results, never written.
LEGACY_NAMES = {"flex_native": ("flex_attention", None), "flex_repeat": ("flex_attention", "repeat"),
                "flex_xla": ("flex_attention", "xla"), "flex_pallas": ("flex_attention", "pallas"),
                "decode_xla": ("decode_attention", "xla"), "decode_pallas": ("decode_attention", "pallas")}


def canonical_impl(name: str, op: str, backend: str | None = None) -> str:
    """The dispatcher's name for ``name``: a legacy name (``flex_native`` = the backend's default) is
    translated, anything else is returned as it is (op names are checked where runners are made)."""
    legacy = LEGACY_NAMES.get(name)
    if legacy is None:
        return name
    legacy_op, impl = legacy
    if name == "flex_native":
        return dispatch.default_impl(op, backend)  # the op's default path on the backend
    return impl


def flex_runner(impl: str, *, mask_mod=None, block_mask=None, scale: float | None = None,
                interpret: bool = False) -> Runner:
    """flashlax.flex_attention with one implementation by its dispatcher name (xla, repeat, pallas)."""

    def fn(q, k, v):
        return flashlax.flex_attention(q, k, v, mask_mod=mask_mod, block_mask=block_mask, scale=scale,
                                       impl=impl, interpret=interpret)

    return Runner(impl, fn, extra={"op": "flex_attention", **({"interpret": True} if interpret else {})})


def decode_runner(impl: str, *, scale: float | None = None, interpret: bool = False) -> Runner:
    """flashlax.decode_attention with one implementation by its dispatcher name (xla, pallas)."""

    def fn(q, k_cache, v_cache):
        return flashlax.decode_attention(q, k_cache, v_cache, scale=scale, impl=impl, interpret=interpret)

    return Runner(impl, fn, extra={"op": "decode_attention", **({"interpret": True} if interpret else {})})


PAGED_IMPLS = {"pallas_paged64": ("pallas", 64), "pallas_paged16": ("pallas", 16),
               "xla_paged16": ("xla", 16)}
JAX_PAGED = "jax_paged"   # jax.experimental.pallas.ops.gpu.paged_attention (Lq 1, GPU)


def page_pool(cache, page_size: int, perm):
    """Contiguous [B, H, L, D] -> pool [B * L / page_size, H, page_size, D] whose slot perm[n] holds logical
    page n (batch-major: page j of sequence b is n = b * L / page_size + j)."""
    batch, heads, length, dim = cache.shape
    pages = length // page_size
    logical = jnp.swapaxes(cache.reshape(batch, heads, pages, page_size, dim), 1, 2)
    logical = logical.reshape(batch * pages, heads, page_size, dim)
    return jnp.zeros_like(logical).at[perm].set(logical)


def shuffled_pages(batch: int, pages: int, page_size: int):
    """(perm int [batch * pages], block_table int32 [batch, pages]): a fixed shuffled page order (seeded by
    the page size) for :func:`page_pool`, and the table that reads it back."""
    perm = np.random.default_rng(page_size).permutation(batch * pages)
    return perm, perm.reshape(batch, pages).astype(np.int32)


def jax_paged_blocks(pages: int, page_size: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for JAX's ``paged_attention``: its defaults, 16 splits and 128
    keys per compute block, cut to divisors of the sequence's pages as it requires."""
    k_splits = math.gcd(16, pages)
    return k_splits, math.gcd(max(1, 128 // page_size), pages // k_splits)


def paged_decode_runner(name: str, cache_shape: tuple[int, int, int, int], *, interpret: bool = False) -> Runner:
    """decode_attention on a paged cache (``PAGED_IMPLS``: impl and page size): the contiguous K/V inputs
    [B, Hkv, L, D] become a page pool in shuffled order outside the timing; the block table is a constant of
    the timed function."""
    impl, page_size = PAGED_IMPLS[name]
    batch, _, length, _ = cache_shape
    if length % page_size:
        return unavailable(name, ValueError(f"KV length {length} is not a multiple of page size {page_size}"))
    perm, table = shuffled_pages(batch, length // page_size, page_size)

    def prepare(x):
        return page_pool(x, page_size, perm) if getattr(x, "shape", None) == tuple(cache_shape) else x

    def fn(q, k_pool, v_pool):
        return flashlax.decode_attention(q, k_pool, v_pool, block_table=jnp.asarray(table), impl=impl,
                                         interpret=interpret)

    return Runner(name, fn, prepare=prepare,
                  extra={"op": "decode_attention", "page_size": page_size, "paged_impl": impl,
                         **({"interpret": True} if interpret else {})})


def jax_paged_runner(cache_shape: tuple[int, int, int, int], q_len: int, *, page_size: int = 64) -> Runner:
    """JAX's in-tree Pallas ``paged_attention`` (GPU, one new token): its pool layout [Hkv, pages, page_size,
    D] and the query scaled by 1/sqrt(D) (it applies no scale) prepared outside the timing; its defaults (16
    splits, 128 keys per compute block, both cut to divisors of the sequence's pages)."""
    if not harness.on_gpu():
        return unavailable(JAX_PAGED, RuntimeError(f"{JAX_PAGED} requires a GPU backend."))
    if q_len != 1:
        return unavailable(JAX_PAGED, NotImplementedError(f"{JAX_PAGED} takes one new token, got Lq {q_len}"))
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as mod  # noqa: PLC0415
    batch, _, length, dim = cache_shape
    perm, table = shuffled_pages(batch, length // page_size, page_size)
    k_splits, per_block = jax_paged_blocks(length // page_size, page_size)

    def prepare(x):
        if getattr(x, "shape", None) == tuple(cache_shape):
            return jnp.swapaxes(page_pool(x, page_size, perm), 0, 1)
        if getattr(x, "ndim", 0) == 4 and x.shape[2] == 1:    # the query
            return (x * dim ** -0.5).astype(x.dtype)
        return x

    def fn(q, k_pool, v_pool):
        lens = jnp.full((batch,), length, jnp.int32)
        out = mod.paged_attention(q[:, :, 0], k_pool, v_pool, jnp.asarray(table), lens, k_splits=k_splits,
                                  pages_per_compute_block=per_block)
        return out[:, :, None]

    return Runner(JAX_PAGED, fn, prepare=prepare, extra={"page_size": page_size})


def chosen_num_splits(impl: str, batch: int, kv_heads: int, max_len: int) -> int | None:
    """The num_splits decode_attention picks when ``num_splits=None``: ``choose_num_splits(batch, kv_heads,
    max_len)`` of the module that implements ``impl`` (default: the backend's), else of the XLA fallback;
    None when neither exposes one."""
    import importlib  # noqa: PLC0415

    modules = []
    entry = dispatch.TABLE["decode_attention"].get(impl)
    if entry is not None and entry.target:
        modules.append(entry.target.partition(":")[0])
    modules.append("flashlax.fallbacks.decode")
    for module_name in modules:
        try:
            chooser = getattr(importlib.import_module(module_name), "choose_num_splits", None)
            if chooser is not None:
                return int(chooser(batch, kv_heads, max_len))
        except Exception:
            continue
    return None


def linear_runner(name: str, *, chunk_size: int, interpret: bool = False) -> Runner:
    def fn(q, k, v, log_alpha, beta):
        return flashlax.gated_delta_rule(q, k, v, log_alpha, beta, chunk_size=chunk_size, impl=name,
                                         interpret=interpret)

    return Runner(name, fn, extra={"op": "gated_delta_rule", **({"interpret": True} if interpret else {})})
