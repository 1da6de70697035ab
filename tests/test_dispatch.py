"""The dispatcher: one (op, backend) -> implementation table, defaults, and its errors."""

import jax.numpy as jnp
import pytest

from flashlax import available_impls, dispatch


def test_available_impls_on_cpu_lists_only_xla_paths():
    assert available_impls("gated_delta_rule", backend="cpu") == ("recurrent", "chunked", "chunked_fat")
    assert available_impls("flex_attention", backend="cpu") == ("xla", "repeat")
    assert available_impls("decode_attention", backend="cpu") == ("xla",)


def test_available_impls_on_gpu_adds_kernels():
    for op in dispatch.OPS:
        assert set(available_impls(op, backend="cpu")) <= set(available_impls(op, backend="gpu"))
    assert "pallas" in available_impls("flex_attention", backend="cuda")
    # a kernel is listed on GPU once it has an implementation (ssd is registered before it is written)
    has_ssd = dispatch.TABLE["gated_delta_rule"]["ssd"].target is not None
    assert ("ssd" in available_impls("gated_delta_rule", backend="gpu")) == has_ssd


@pytest.mark.parametrize("op", dispatch.OPS)
def test_default_impl_is_available(op):
    for backend in ("cpu", "gpu"):
        assert dispatch.default_impl(op, backend) in available_impls(op, backend=backend)
    assert dispatch.resolve_name(op, None, backend="cpu") == dispatch.default_impl(op, "cpu")


def test_cpu_defaults():
    assert dispatch.default_impl("gated_delta_rule", "cpu") == "chunked"
    assert dispatch.default_impl("flex_attention", "cpu") == "xla"
    entry, fn = dispatch.resolve("gated_delta_rule", None, backend="cpu")
    assert entry.name == "chunked" and fn.__name__ == "gated_delta_rule_chunked"
    # how it runs per backend: one (batch, head) slice at a time on CPU, batched on GPU
    assert fn.keywords == {"sequential_heads": True}
    _, gpu_fn = dispatch.resolve("gated_delta_rule", "chunked", backend="gpu")
    assert not hasattr(gpu_fn, "keywords") and gpu_fn.__name__ == "gated_delta_rule_chunked"


def test_gated_delta_rule_default_by_dtype_and_head_dim():
    """GPU: ssd, except float32 with a head dim over 128 (chunked: ssd unmeasured there, minutes of
    compile); CPU: chunked always."""
    from flashlax.linear import default_impl
    assert default_impl(jnp.float32, 128, 128, backend="gpu") == "ssd"
    assert default_impl(jnp.bfloat16, 256, 256, backend="gpu") == "ssd"
    assert default_impl(jnp.float32, 256, 64, backend="gpu") == "chunked"
    assert default_impl(jnp.float32, 64, 192, backend="gpu") == "chunked"
    assert default_impl(jnp.bfloat16, 64, 64, backend="cpu") == "chunked"


def test_resolve_returns_the_named_function():
    for name in ("recurrent", "chunked", "chunked_fat"):
        entry, fn = dispatch.resolve("gated_delta_rule", name, backend="cpu")
        assert entry.name == name and entry.kind == "xla"
        assert fn.__name__ == f"gated_delta_rule_{name}"


def test_unknown_impl_lists_valid_names():
    with pytest.raises(ValueError, match=r"gated_delta_rule: unknown impl 'triton'; valid: "
                                         r"recurrent, chunked, chunked_fat, ssd"):
        dispatch.resolve("gated_delta_rule", "triton", backend="cpu")


def test_gpu_kernel_on_cpu_raises_runtime_error():
    with pytest.raises(RuntimeError, match=r"^ssd requires an accelerator backend\.$"):
        dispatch.resolve("gated_delta_rule", "ssd", backend="cpu")
    with pytest.raises(RuntimeError, match=r"^pallas requires an accelerator backend\.$"):
        dispatch.resolve_name("flex_attention", "pallas", backend="cpu")
    # interpret=True lets a GPU kernel be chosen on CPU (the Pallas interpreter)
    assert dispatch.resolve_name("gated_delta_rule", "ssd", interpret=True, backend="cpu") == "ssd"
    assert dispatch.resolve_name("gated_delta_rule", "ssd", backend="gpu") == "ssd"


def test_unknown_op():
    for call in (lambda: available_impls("softmax"), lambda: dispatch.default_impl("softmax"),
                 lambda: dispatch.resolve("softmax", None)):
        with pytest.raises(ValueError, match=r"unknown op 'softmax'; valid ops: flex_attention, "
                                             r"decode_attention, gated_delta_rule"):
            call()


def test_backend_family():
    assert dispatch.backend_family("cuda") == dispatch.backend_family("rocm") == "gpu"
    assert dispatch.backend_family("cpu") == "cpu"
