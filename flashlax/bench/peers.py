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
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import flashlax
from flashlax import dispatch
from flashlax.bench import harness

JAX_PEERS = ("jax_xla", "jax_cudnn")
TORCH_PEERS = ("torch_sdpa",)


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


# ----------------------------------------------------------------------------------------------------------
# torch peer


def torch_sdpa(*, causal: bool = False, dense_mask: np.ndarray | None = None, scale: float | None = None,
               torch_device: str | None = None) -> Runner:
    torch = harness.torch_module()
    if torch is None:
        return unavailable("torch_sdpa", RuntimeError("torch is not installed."))
    device = torch_device or ("cuda" if harness.on_gpu() and torch.cuda.is_available() else "cpu")
    mask = None if dense_mask is None else torch.from_numpy(np.array(dense_mask, dtype=bool)).to(device)
    functional = torch.nn.functional

    def prepare(x):
        array = np.array(jax.device_get(x))  # a writable copy: torch.from_numpy warns on read-only arrays
        if array.dtype == jnp.bfloat16:  # numpy bf16 (ml_dtypes) does not cross into torch directly
            return torch.from_numpy(array.astype(np.float32)).to(device=device, dtype=torch.bfloat16)
        return torch.from_numpy(array).to(device)

    def finish(t):
        return np.asarray(t.detach().float().cpu().numpy())

    def fn(query, key, value):
        return functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal,
                                                       scale=scale, enable_gqa=key.shape[1] != query.shape[1])

    return Runner("torch_sdpa", fn, kind="torch", prepare=prepare, finish=finish, extra={"torch_device": device})


def torch_sync(torch_device: str):
    torch = harness.torch_module()

    def sync(out):
        if torch_device.startswith("cuda"):
            torch.cuda.synchronize()
        return out

    return sync


# ----------------------------------------------------------------------------------------------------------
# flashlax's own paths


def flex_runner(name: str, *, mask_mod=None, block_mask=None, scale: float | None = None,
                interpret: bool = False) -> Runner:
    """``flex_native`` (the backend's default path), ``flex_repeat``, or ``flex_<impl>`` for any impl."""
    impl = None if name == "flex_native" else name.removeprefix("flex_")

    def fn(q, k, v):
        return flashlax.flex_attention(q, k, v, mask_mod=mask_mod, block_mask=block_mask, scale=scale,
                                       impl=impl, interpret=interpret)

    return Runner(name, fn, extra={"interpret": True} if interpret else {})


def decode_runner(name: str, *, scale: float | None = None, interpret: bool = False) -> Runner:
    """``flex_native`` = decode_attention's default impl, or ``decode_<impl>`` for one impl by name."""
    impl = None if name == "flex_native" else name.removeprefix("decode_")

    def fn(q, k_cache, v_cache):
        return flashlax.decode_attention(q, k_cache, v_cache, scale=scale, impl=impl, interpret=interpret)

    return Runner(name, fn, extra={"interpret": True} if interpret else {})


def chosen_num_splits(impl: str | None, batch: int, kv_heads: int, max_len: int) -> int | None:
    """The num_splits decode_attention picks when ``num_splits=None``: ``choose_num_splits(batch, kv_heads,
    max_len)`` of the module that implements ``impl`` (default: the backend's), else of the XLA fallback;
    None when neither exposes one."""
    import importlib  # noqa: PLC0415

    name = impl or dispatch.default_impl("decode_attention")
    modules = []
    entry = dispatch.TABLE["decode_attention"].get(name)
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

    return Runner(name, fn, extra={"interpret": True} if interpret else {})


def default_backend_impl(op: str) -> str:
    return dispatch.default_impl(op)
