"""Documentation that runs: every python block of README.md and docs/API.md, and the examples in the public
docstrings; the README's API blocks are also checked against references."""

import doctest
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlax
from flashlax.reference import attention_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _run_blocks(path: pathlib.Path) -> dict:
    ns: dict = {}
    for block in _blocks(path):
        exec(compile(block, str(path), "exec"), ns)       # noqa: S102 (our own docs)
    return ns


def test_readme_blocks_run_and_match_references():
    ns = _run_blocks(ROOT / "README.md")
    assert len(_blocks(ROOT / "README.md")) >= 4          # one per op at least
    q, k, v = (np.asarray(ns[n], np.float64) for n in ("q", "k", "v"))
    B, Hq, Hkv, L, D = ns["B"], ns["Hq"], ns["Hkv"], ns["L"], ns["D"]
    # decode: the last 4 positions of each sequence's valid cache, against the materialised reference
    kv_lens = np.asarray(ns["kv_lens"])
    out = np.asarray(ns["out"])
    assert out.shape == (B, Hq, 4, D) and np.isfinite(out).all()
    for b, n in enumerate(kv_lens):
        ref = attention_reference(q[b:b + 1, :, :4], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                  mask_mod=lambda bb, h, i, j, n=n: j <= i + n - 4)[0]
        np.testing.assert_allclose(out[b:b + 1], ref, rtol=2e-4, atol=2e-5)
    o, state = np.asarray(ns["o"]), np.asarray(ns["state"])
    assert o.shape == (B, Hkv, L, D) and state.shape == (B, Hkv, D, D)
    args = (ns["q"][:, :Hkv], ns["kn"], ns["v"], ns["log_alpha"], ns["beta"])
    o_ref, state_ref = flashlax.gated_delta_rule(*args, return_final_state=True, impl="recurrent")
    np.testing.assert_allclose(o, np.asarray(o_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, np.asarray(state_ref), rtol=1e-4, atol=1e-4)
    assert np.asarray(ns["grads"]).shape == q.shape
    causal = flashlax.flex_attention(ns["q"], ns["k"], ns["v"], mask_mod=flashlax.masks.causal)
    np.testing.assert_allclose(np.asarray(ns["out_cp"]), np.asarray(causal), rtol=1e-5, atol=1e-5)


def test_api_md_blocks_run():
    _run_blocks(ROOT / "docs" / "API.md")


@pytest.mark.parametrize("fn", [flashlax.flex_attention, flashlax.dot_product_attention, flashlax.decode_attention,
                                flashlax.gated_delta_rule, flashlax.create_block_mask])
def test_docstring_examples_run(fn):
    """Each public docstring documents its arguments and errors, and its example runs as shown."""
    doc = fn.__doc__
    for section in ("Args:", "Returns:", "Raises:", "Example:"):
        assert section in doc, f"{fn.__name__}: no {section} section"
    examples = doctest.DocTestParser().get_examples(doc)
    assert examples, f"{fn.__name__}: no example"
    test = doctest.DocTest(examples, {"flashlax": flashlax, "jnp": jnp, "jax": jax}, fn.__name__, None, 0, doc)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0, f"{fn.__name__}: docstring example failed"


def test_public_surface():
    """dir(flashlax) is the API (internal modules stay importable but out of sight)."""
    assert set(dir(flashlax)) == set(flashlax.__all__) | {"__version__"}
    assert flashlax.dispatch.backend_family() in ("cpu", "gpu", "tpu")
