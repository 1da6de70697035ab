"""The README's "API in brief" block runs as written, and its outputs match the references."""

import pathlib
import re

import numpy as np

from flashlax.reference import attention_reference

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _api_block() -> str:
    text = README.read_text()
    section = text[text.index("## API in brief"):text.index("## Implementations")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "README: expected one python block under 'API in brief'"
    return blocks[0]


def test_readme_api_block_runs():
    ns: dict = {}
    exec(compile(_api_block(), str(README), "exec"), ns)       # noqa: S102 (our own README)
    q, k, v = (np.asarray(ns[n], np.float64) for n in ("q", "k", "v"))
    B, Hq, Hkv, L, D = ns["B"], ns["Hq"], ns["Hkv"], ns["L"], ns["D"]
    # decode: the last 4 positions of each row's valid cache, checked against the materialised reference
    kv_lens = np.asarray(ns["kv_lens"])
    out = np.asarray(ns["out"])
    assert out.shape == (B, Hq, 4, D) and np.isfinite(out).all()
    for b, n in enumerate(kv_lens):
        ref = attention_reference(q[b:b + 1, :, :4], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                  mask_mod=lambda bb, h, i, j, n=n: j <= i + n - 4)[0]
        np.testing.assert_allclose(out[b:b + 1], ref, rtol=2e-4, atol=2e-5)
    o, state = np.asarray(ns["o"]), np.asarray(ns["state"])
    assert o.shape == (B, Hkv, L, D) and state.shape == (B, Hkv, D, D)
    flashlax = ns["flashlax"]
    args = (ns["q"][:, :Hkv], ns["kn"], ns["v"], ns["log_alpha"], ns["beta"])
    o_ref, state_ref = flashlax.gated_delta_rule(*args, return_final_state=True, impl="recurrent")
    np.testing.assert_allclose(o, np.asarray(o_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, np.asarray(state_ref), rtol=1e-4, atol=1e-4)
    assert "xla" in flashlax.available_impls("flex_attention")
