"""Tests of flashlax/kernels/configs.py: every shipped forward config fits its device's shared memory."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from flashlax.kernels import configs
from flashlax.kernels.configs import (FWD_CONFIGS, FWD_LONG_DENSE_CONFIGS, SMEM_LIMITS, FlashConfig, check_config,
                                      flash_config, smem_bytes)

KINDS = {"h200": "NVIDIA H200", "rtx3090": "NVIDIA GeForce RTX 3090", "default": "Some Future GPU"}


def _entries(family):
    entries = list(FWD_CONFIGS[family].items()) + [(k, cfg) for k, (_, cfg) in FWD_LONG_DENSE_CONFIGS[family].items()]
    for (max_d, cls), cfg in entries:
        yield max_d, (jnp.float32 if cls == "32" else jnp.bfloat16), cfg


def test_rtx3090_entries_fit_99kb():
    assert SMEM_LIMITS["rtx3090"] == 101376
    for max_d, dtype, cfg in _entries("rtx3090"):
        need = smem_bytes(cfg, max_d, max_d, dtype)
        assert need <= 101376, (max_d, dtype, cfg, need)
        check_config(cfg, max_d, max_d, dtype, KINDS["rtx3090"])
        if dtype == jnp.bfloat16:
            check_config(cfg, max_d, max_d, jnp.float16, KINDS["rtx3090"])


@pytest.mark.parametrize("family", ["h200", "default"])
def test_other_entries_fit_their_device(family):
    for max_d, dtype, cfg in _entries(family):
        check_config(cfg, max_d, max_d, dtype, KINDS[family])


def test_every_family_covers_head_dims_and_dtypes():
    for family, kind in KINDS.items():
        for d in (32, 64, 96, 128, 192, 256):
            for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
                cfg = flash_config(d, d, dtype, kind)
                check_config(cfg, d, d, dtype, kind)
    assert flash_config(128, 128, jnp.bfloat16, KINDS["h200"]) == FWD_CONFIGS["h200"][(128, "16")]
    min_kv, long = FWD_LONG_DENSE_CONFIGS["h200"][(128, "16")]
    assert long != FWD_CONFIGS["h200"][(128, "16")]
    assert flash_config(128, 128, jnp.bfloat16, KINDS["h200"], dense_kv_len=min_kv) == FWD_CONFIGS["h200"][(128, "16")]
    assert flash_config(128, 128, jnp.bfloat16, KINDS["h200"], dense_kv_len=min_kv + 1) == long
    assert flash_config(64, 64, jnp.bfloat16, KINDS["h200"], dense_kv_len=64) == FWD_CONFIGS["h200"][(64, "16")]
    assert flash_config(96, 64, jnp.float32, KINDS["rtx3090"]) == FWD_CONFIGS["rtx3090"][(128, "32")]


def test_device_family():
    assert configs.device_family("NVIDIA H200") == "h200"
    assert configs.device_family("NVIDIA H100 80GB HBM3") == "h200"
    assert configs.device_family("NVIDIA GeForce RTX 3090") == "rtx3090"
    assert configs.device_family("cpu") == "default"


def test_oversized_config_is_rejected_before_compiling():
    big = FlashConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match="101376"):
        check_config(big, 128, 128, jnp.bfloat16, KINDS["rtx3090"])
    with pytest.raises(ValueError, match="shared memory"):
        check_config(dataclasses.replace(big, num_stages=4), 256, 256, jnp.bfloat16, KINDS["h200"])


def test_smem_estimate_grows_with_tiles_and_dtype():
    cfg = FlashConfig(64, 64, 4, 2)
    base = smem_bytes(cfg, 64, 64, jnp.bfloat16)
    assert smem_bytes(cfg, 64, 64, jnp.float32) == 2 * base
    assert smem_bytes(dataclasses.replace(cfg, num_stages=3), 64, 64, jnp.bfloat16) > base
    assert smem_bytes(cfg, 96, 96, jnp.bfloat16) == smem_bytes(cfg, 128, 128, jnp.bfloat16)   # padded to pow2


@pytest.mark.parametrize("bad", [dict(block_q=48), dict(block_kv=8), dict(num_warps=3), dict(num_stages=0)])
def test_invalid_config_values(bad):
    with pytest.raises(ValueError):
        FlashConfig(**{**dict(block_q=64, block_kv=64, num_warps=4, num_stages=2), **bad})


def test_flash_config_rejects_head_dim_over_256():
    with pytest.raises(ValueError, match="256"):
        flash_config(320, 320, jnp.bfloat16, KINDS["h200"])


def test_tile_gathers_count_and_shrink():
    """A relative-bias score_mod gathers a [block_q, block_kv] tile: at 128x128, 3 stages, D=128 bf16 the
    estimate is the 360448 bytes Triton asked for on the H200 (with the long unmasked config), so the
    automatic config steps down."""
    cfg = FWD_LONG_DENSE_CONFIGS["h200"][(128, "16")][1]
    assert (cfg.block_q, cfg.block_kv, cfg.num_stages) == (128, 128, 3)
    assert smem_bytes(cfg, 128, 128, jnp.bfloat16, p_in_smem=False, tile_reads=1) == 360448
    with pytest.raises(ValueError, match="captured"):
        check_config(cfg, 128, 128, jnp.bfloat16, KINDS["h200"], tile_reads=1)
    for family, kind in KINDS.items():
        for d in (64, 128, 256):
            for dtype in (jnp.bfloat16, jnp.float32):
                small = configs.shrink_to_fit(flash_config(d, d, dtype, kind), d, d, dtype, kind, tile_reads=2)
                check_config(small, d, d, dtype, kind, tile_reads=2)
    assert configs.shrink_to_fit(cfg, 128, 128, jnp.bfloat16, KINDS["h200"], tile_reads=1).block_kv == 64
