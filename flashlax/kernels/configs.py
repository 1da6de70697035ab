"""Tile sizes, warps and pipeline stages of the flash-attention forward kernel, per device kind.

A config is an argument of the kernel, never a global. :func:`flash_config` picks one from the device
kind (``jax.devices()[0].device_kind``), the head dims and the dtype; :func:`check_config` rejects one
whose static shared-memory estimate exceeds the device's per-block limit, with a ValueError, before
anything is compiled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# Shared memory one thread block may use (opt-in maximum), bytes.
SMEM_LIMITS: dict[str, int] = {
    "h200": 232448,      # sm_90 (H100/H200): 227 KB
    "rtx3090": 101376,   # sm_86 (RTX 3090/3080, A10): 99 KB
    "default": 101376,   # unknown device: assume the smallest budget we ship configs for
}


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Forward kernel launch parameters: a program owns ``block_q`` query rows of one head and steps
    through the KV sequence ``block_kv`` keys at a time; Triton ``num_warps`` / ``num_stages``.

    pack_gqa: GQA strategy. False: one query head per program, the G heads of a KV group run as
    neighbouring programs and share K/V tiles through L2. True: one program holds the G heads of a KV
    group (block_q // G rows each) so every K/V tile is loaded once for all of them; used when G is a
    power of two, block_q // G >= 16 and the block mask does not depend on the head.

    q_major: launch order. False: heads are the fastest grid axis (the G heads of a KV group run side by
    side). True: query tiles are the fastest (the programs in flight share one head's K/V). Not measured
    yet (session 4 ran out of device time); scripts/gpu_ab.py has the A/B ready.
    """

    block_q: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pack_gqa: bool = False
    q_major: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 16 or val & (val - 1):
                raise ValueError(f"FlashConfig: {name} must be a power of two >= 16, got {val!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"FlashConfig: num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"FlashConfig: num_stages must be a positive int, got {self.num_stages!r}")


def smem_bytes(config: FlashConfig, head_dim: int, head_dim_v: int, dtype, p_in_smem: bool = True,
               tile_reads: int = 0) -> int:
    """Static estimate of the forward kernel's shared memory, bytes.

    Triton stages the q tile once and the streamed K and V tiles once per pipeline stage; before sm_90
    the P tile that feeds the second matmul (P @ V) is counted as round-tripped through shared memory
    for its layout change (``p_in_smem``); Hopper's wgmma reads that operand from registers.
    Each mod read of a captured array indexed by both q_idx and kv_idx (``tile_reads``, e.g. a
    relative-bias table) is a [block_q, block_kv] pointer gather whose float32 result Triton stages
    through shared memory twice for layout changes. Head dims are padded to powers of two.
    On the H200 this formula gave exactly the 360448 bytes Triton asked for with a relative-bias
    score_mod at 128x128 tiles, 3 stages, D=128, bf16.
    """
    item = jnp.dtype(dtype).itemsize
    d, dv = _pow2(head_dim), _pow2(head_dim_v)
    q_tile = config.block_q * d * item
    kv_tiles = config.num_stages * config.block_kv * (d + dv) * item
    p_tile = config.block_q * config.block_kv * item if p_in_smem else 0
    gathers = tile_reads * 2 * config.block_q * config.block_kv * 4
    return q_tile + kv_tiles + p_tile + gathers


def device_family(device_kind: str | None = None) -> str:
    """'h200' (Hopper: H100/H200/H800/GH200), 'rtx3090' (Ampere consumer: 3090/3080/A10) or 'default'."""
    if device_kind is None:
        try:
            device_kind = jax.devices()[0].device_kind
        except RuntimeError:
            device_kind = ""
    kind = device_kind.lower()
    if any(t in kind for t in ("h100", "h200", "h800", "gh200")):
        return "h200"
    if any(t in kind for t in ("3090", "3080", "a10")):
        return "rtx3090"
    return "default"


def smem_limit(device_kind: str | None = None) -> int:
    return SMEM_LIMITS[device_family(device_kind)]


# Forward configs: family -> {(max head dim, dtype class): config}; dtype class "16" (bf16/f16) or "32".
# The largest padded head dim (of D and Dv) picks the entry. Every entry fits its family's limit at
# that head dim (tests/test_kernel_configs.py).
FWD_CONFIGS: dict[str, dict[tuple[int, str], FlashConfig]] = {
    # Measured on the H200 (docs/PERF_NOTES.md). float32 runs its matmuls on the
    # CUDA cores (IEEE, no tf32): large tiles spill registers (64x64 took 11x longer than 64x32).
    "h200": {
        (64, "16"): FlashConfig(128, 128, 4, 3),
        # 96 KB: two programs per SM (see FWD_LONG_DENSE_CONFIGS); masked calls step 64-key kernel tiles
        # inside the default 128-key block-mask tiles (kv_sub in flash_attention.py).
        (128, "16"): FlashConfig(128, 64, 4, 2),
        (256, "16"): FlashConfig(128, 64, 8, 2),
        (64, "32"): FlashConfig(64, 32, 4, 3),
        (128, "32"): FlashConfig(64, 32, 4, 3),
        (256, "32"): FlashConfig(32, 32, 4, 2),
    },
    "rtx3090": {
        (64, "16"): FlashConfig(128, 64, 4, 3),
        (128, "16"): FlashConfig(128, 32, 8, 2),
        (256, "16"): FlashConfig(32, 32, 4, 2),
        (64, "32"): FlashConfig(64, 64, 4, 2),
        (128, "32"): FlashConfig(32, 32, 4, 2),
        (256, "32"): FlashConfig(32, 16, 4, 2),
    },
}
FWD_CONFIGS["default"] = FWD_CONFIGS["rtx3090"]

# Unmasked calls (no block mask, no mask_mod: the dense loop) with more than `min_kv_len` keys, where they
# differ from the table above: family -> {(max head dim, dtype class): (min_kv_len, config)}.
# H200 D128 bf16: the table's 128/64 w4 s2 needs 96 KB of shared memory, so two programs share an SM and
# one's matmuls fill the other's softmax (128/128 w8 s3 needs ~224 KB: one per SM). Session 5, B2 T4096 full
# forward 1.211 -> 1.155-1.168 ms, causal 0.666 -> 0.628-0.643 (scripts/gpu_ab.py, two calls); but B1
# T16384 full took 11.0 ms with it in one benchmark run against 9.08 with 128/128 in session 4, so long
# unmasked calls keep 128/128 w8 s3 (docs/PERF_NOTES.md, session 6).
FWD_LONG_DENSE_CONFIGS: dict[str, dict[tuple[int, str], tuple[int, FlashConfig]]] = {
    "h200": {(128, "16"): (4096, FlashConfig(128, 128, 8, 3))},
    "rtx3090": {},
    "default": {},
}


def flash_config(head_dim: int, head_dim_v: int | None = None, dtype=jnp.bfloat16,
                 device_kind: str | None = None, dense_kv_len: int | None = None) -> FlashConfig:
    """The forward config for this device kind, head dims and input dtype; ``dense_kv_len``: the number of
    keys of an unmasked call (None: a masked call), which may pick an entry of FWD_LONG_DENSE_CONFIGS."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    d = max(_pow2(head_dim), _pow2(head_dim_v))
    if d > 256:
        raise ValueError(f"flash_config: head dims up to 256 are supported, got ({head_dim}, {head_dim_v})")
    cls = "32" if jnp.dtype(dtype).itemsize >= 4 else "16"
    family = device_family(device_kind)
    for max_d in (64, 128, 256):
        if d <= max_d:
            min_kv, long = FWD_LONG_DENSE_CONFIGS[family].get((max_d, cls), (0, None))
            if long is not None and dense_kv_len is not None and dense_kv_len > min_kv:
                return long
            return FWD_CONFIGS[family][(max_d, cls)]
    raise AssertionError("unreachable")


def check_config(config: FlashConfig, head_dim: int, head_dim_v: int, dtype,
                 device_kind: str | None = None, limit: int | None = None, tile_reads: int = 0) -> None:
    """ValueError when ``config`` needs more shared memory than one block may use on the device."""
    limit = smem_limit(device_kind) if limit is None else limit
    need = smem_bytes(config, head_dim, head_dim_v, dtype, p_in_smem=device_family(device_kind) != "h200",
                      tile_reads=tile_reads)
    if need > limit:
        raise ValueError(
            f"flash attention config {config} needs about {need} bytes of shared memory for head dims "
            f"({head_dim}, {head_dim_v}) and dtype {jnp.dtype(dtype).name}, over the device limit of "
            f"{limit} bytes ({device_kind or device_family()}"
            + (f", with {tile_reads} [block_q, block_kv] reads of captured arrays" if tile_reads else "")
            + "); use smaller block_q/block_kv/num_stages")


def shrink_to_fit(config: FlashConfig, head_dim: int, head_dim_v: int, dtype, device_kind: str | None = None,
                  tile_reads: int = 0) -> FlashConfig:
    """The largest step-down of ``config`` that fits the device (halve block_kv to 32, drop pipeline
    stages to 2, halve block_q to 32, then the same down to 16 / 1 stage / 16); used for the automatic config, e.g. when a score
    mod's tile gathers need shared memory. ValueError if even the smallest does not fit."""
    cfg = config
    while True:
        try:
            check_config(cfg, head_dim, head_dim_v, dtype, device_kind, tile_reads=tile_reads)
            return cfg
        except ValueError:
            for floor in (32, 16):
                if cfg.block_kv > floor:
                    cfg = dataclasses.replace(cfg, block_kv=cfg.block_kv // 2)
                elif cfg.num_stages > floor // 16:
                    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
                elif cfg.block_q > floor:
                    cfg = dataclasses.replace(cfg, block_q=cfg.block_q // 2)
                else:
                    continue
                break
            else:
                raise


# ----------------------------------------------------------------------------------------------------
# Decode (flash decoding) kernel: flashlax/kernels/decode.py
# ----------------------------------------------------------------------------------------------------

# Multiprocessors per device family, for num_splits when the device does not report ``core_count``.
NUM_SMS: dict[str, int] = {"h200": 132, "rtx3090": 82, "default": 108}


PAGE_LOOKUPS = ("auto", "rows", "scalars")   # _tiles.Pages.lookup


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Decode kernel launch parameters. One program serves up to ``block_rows`` query rows of one KV group
    (the G query heads x Lq new tokens, padded to a power of two >= 16 in registers) over one split of the
    cache, ``block_kv`` keys per loop step; Triton ``num_warps`` / ``num_stages``.

    num_splits=None picks the most splits whose programs all run at once, ``programs_per_sm`` per
    multiprocessor (at least one split, each at least ``min_split_tiles`` tiles long). Splits are merged in
    the same launch (the last split of a group to finish merges its partials; an atomic counter per group)
    when one program's float32 partials, all splits together, take at most ``merge_in_kernel_kb`` KB
    (one program reads them back: a larger merge is faster spread over the chip by the fused XLA step;
    0: always the XLA step). ``merge_kernel_rows`` > 0: such a larger merge runs as a second Pallas launch
    instead of the XLA step, one program per ``merge_kernel_rows`` rows (a power of two) of a group.
    H200, D128 bf16: one wave of programs was fastest at every measured shape;
    64-key tiles with 4 stages (about 134 KB of shared memory, one program per SM) beat 3 stages at two per
    SM by 2-6% at B1 L65536 and Lq 4-16, and equalled it at B8 / B32 (docs/PERF_NOTES.md).
    """

    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_rows: int = 64
    programs_per_sm: int = 2
    min_split_tiles: int = 4
    merge_in_kernel_kb: int = 128
    merge_kernel_rows: int = 0
    # Paged caches (issue 18): how a tile finds its pages (``_tiles.Pages.lookup``); how many loop steps
    # ahead it reads them (carried in the loop; 0: in the step; more than 1 stops Triton pipelining the
    # loop); ``paged``: (field, value) pairs a paged launch whose tiles span pages uses instead of this
    # config's (e.g. (("num_stages", 3),)). Triton's pipeliner gives loads fed by a pipelined table read in
    # the same step (an indirect load) (stages - 1) // 2 steps of lead instead of stages - 1, and waits on
    # a scalar table read every step: reading one step ahead avoids both (H200, B8 L16384 pages of 16:
    # 1.13x the contiguous kernel's time reading in the step, 1.02x one step ahead; docs/PERF_NOTES.md).
    page_lookup: str = "auto"
    page_prefetch: int = 1
    paged: tuple = ()

    def __post_init__(self):
        try:   # the tile fields obey the flash forward's rules (block_rows is its block_q)
            _as_flash(self, self.block_rows)
        except ValueError as err:
            raise ValueError(f"DecodeConfig: {err} (block_q is block_rows here)") from None
        for name in ("programs_per_sm", "min_split_tiles"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"DecodeConfig: {name} must be a positive int, got {val!r}")
        if isinstance(self.merge_in_kernel_kb, bool) or not isinstance(self.merge_in_kernel_kb, int) \
                or self.merge_in_kernel_kb < 0:
            raise ValueError(f"DecodeConfig: merge_in_kernel_kb must be an int >= 0, got {self.merge_in_kernel_kb!r}")
        if isinstance(self.merge_kernel_rows, bool) or not isinstance(self.merge_kernel_rows, int) \
                or self.merge_kernel_rows < 0 or (self.merge_kernel_rows & (self.merge_kernel_rows - 1)):
            raise ValueError("DecodeConfig: merge_kernel_rows must be 0 or a power of two, got "
                             f"{self.merge_kernel_rows!r}")
        if self.page_lookup not in PAGE_LOOKUPS:
            raise ValueError(f"DecodeConfig: page_lookup must be one of {PAGE_LOOKUPS}, got {self.page_lookup!r}")
        if isinstance(self.page_prefetch, bool) or not isinstance(self.page_prefetch, int) \
                or not 0 <= self.page_prefetch <= 4:
            raise ValueError(f"DecodeConfig: page_prefetch must be an int in 0..4, got {self.page_prefetch!r}")
        if self.paged:
            names = {f.name for f in dataclasses.fields(self)} - {"paged"}
            if not isinstance(self.paged, tuple) or not all(
                    isinstance(p, tuple) and len(p) == 2 and p[0] in names for p in self.paged):
                raise ValueError("DecodeConfig: paged must be a tuple of (field, value) pairs naming other "
                                 f"DecodeConfig fields, got {self.paged!r}")
            try:
                self.for_paged()      # the paged launch's config is valid too
            except ValueError as err:
                raise ValueError(f"DecodeConfig: paged overrides {self.paged!r}: {err}") from None

    def for_paged(self, page_size: int | None = None) -> "DecodeConfig":
        """The config a paged launch runs: this one with the ``paged`` overrides when its tiles span pages
        (``page_size`` not a multiple of ``block_kv``: per-row page lookups) or ``page_size`` is None; a tile
        inside one page runs as the contiguous kernel does."""
        if not self.paged or (page_size is not None and page_size % self.block_kv == 0):
            return self
        return dataclasses.replace(self, paged=(), **dict(self.paged))


def _as_flash(config: DecodeConfig, rows: int) -> FlashConfig:
    """The decode kernel's tiles as the flash forward's: ``rows`` query rows against ``block_kv`` keys."""
    return FlashConfig(block_q=rows, block_kv=config.block_kv, num_warps=config.num_warps,
                       num_stages=config.num_stages)


# family -> {(max head dim, dtype class): config}, as FWD_CONFIGS. Every entry fits its family's shared
# memory at its head dim with block_rows query rows (tests/test_decode_kernel.py). First guesses until
# measured on the H200 (docs/PERF_NOTES.md, "decode_attention Pallas kernel").
DECODE_CONFIGS: dict[str, dict[tuple[int, str], DecodeConfig]] = {
    "h200": {
        (64, "16"): DecodeConfig(128, 4, 3, 64),
        # 4 stages, one program per SM (session 15: 2% faster than 3 stages at two per SM at B1 L65536,
        # 6% at B1 Lq16); tiles spanning pages (per-row page lookups: pages of 16) keep 3 stages at two
        # per SM (1.08-1.11x the contiguous time at 4 stages, one per SM; 1.00-1.09x so); docs/PERF_NOTES.md,
        # decode and "Paged KV caches", session 15.
        # Session 18: pages of 16 at 7 stages, one per SM, the table read in the step (K/V 3 steps of lead
        # behind the vector table read): 1.019 / 1.024x at B1 Lq16 / B4 Lq4 vs 1.097 / 1.036 at 3 stages two
        # per SM with read-ahead (session 16: 1.016-1.044 vs 1.017-1.068 over the five shapes).
        (128, "16"): DecodeConfig(64, 4, 4, 64, programs_per_sm=1,
                                  paged=(("num_stages", 7), ("page_prefetch", 0))),
        (256, "16"): DecodeConfig(64, 4, 2, 32),
        (64, "32"): DecodeConfig(64, 4, 2, 32),
        (128, "32"): DecodeConfig(32, 4, 2, 32),
        (256, "32"): DecodeConfig(32, 4, 2, 16),
    },
    "rtx3090": {
        (64, "16"): DecodeConfig(64, 4, 3, 64),
        (128, "16"): DecodeConfig(64, 4, 2, 64),
        (256, "16"): DecodeConfig(32, 4, 2, 32),
        (64, "32"): DecodeConfig(64, 4, 2, 32),
        (128, "32"): DecodeConfig(32, 4, 2, 32),
        (256, "32"): DecodeConfig(16, 4, 2, 16),
    },
}
DECODE_CONFIGS["default"] = DECODE_CONFIGS["rtx3090"]


def decode_smem_bytes(config: DecodeConfig, rows: int, head_dim: int, head_dim_v: int, dtype,
                      p_in_smem: bool = True, tile_reads: int = 0) -> int:
    """Static shared-memory estimate of the decode kernel, bytes: the flash forward's formula
    (:func:`smem_bytes`) with ``rows`` (a power of two >= 16) query rows per program."""
    return smem_bytes(_as_flash(config, rows), head_dim, head_dim_v, dtype, p_in_smem=p_in_smem,
                      tile_reads=tile_reads)


def decode_config(head_dim: int, head_dim_v: int | None = None, dtype=jnp.bfloat16,
                  device_kind: str | None = None) -> DecodeConfig:
    """The decode config for this device kind, head dims (padded to a power of two, up to 256) and dtype."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    d = max(_pow2(head_dim), _pow2(head_dim_v))
    if d > 256:
        raise ValueError(f"decode_config: head dims up to 256 are supported, got ({head_dim}, {head_dim_v})")
    cls = "32" if jnp.dtype(dtype).itemsize >= 4 else "16"
    table = DECODE_CONFIGS[device_family(device_kind)]
    return table[(min(max_d for max_d in (64, 128, 256) if d <= max_d), cls)]


def check_decode_config(config: DecodeConfig, rows: int, head_dim: int, head_dim_v: int, dtype,
                        device_kind: str | None = None, tile_reads: int = 0) -> None:
    """ValueError when ``config`` with ``rows`` query rows per program does not fit the device's shared
    memory per block (:func:`check_config` of the same tiles)."""
    try:
        check_config(_as_flash(config, rows), head_dim, head_dim_v, dtype, device_kind, tile_reads=tile_reads)
    except ValueError as err:
        raise ValueError(f"decode config {config} with {rows} query rows per program: {err} "
                         "(block_q is block_rows here)") from None


def decode_shrink_to_fit(config: DecodeConfig, rows: int, head_dim: int, head_dim_v: int, dtype,
                         device_kind: str | None = None, tile_reads: int = 0) -> tuple[DecodeConfig, int]:
    """(config, rows) stepped down until they fit, as :func:`shrink_to_fit` steps the flash forward's tiles
    (block_kv, stages, then rows). ValueError if even the smallest does not fit."""
    small = shrink_to_fit(_as_flash(config, rows), head_dim, head_dim_v, dtype, device_kind, tile_reads)
    return dataclasses.replace(config, block_kv=small.block_kv, num_stages=small.num_stages), small.block_q


def num_sms(device_kind: str | None = None) -> int:
    """Multiprocessors of the first device (``core_count`` where jax reports it), else the family's."""
    if device_kind is None:
        try:
            count = getattr(jax.devices()[0], "core_count", None)
            if isinstance(count, int) and count > 0 and jax.devices()[0].platform == "gpu":
                return count
        except RuntimeError:
            pass
    return NUM_SMS[device_family(device_kind)]


# ----------------------------------------------------------------------------------------------------
# gated_delta_rule "ssd" kernels (flashlax/kernels/ssd.py, ssd_bwd.py)
# ----------------------------------------------------------------------------------------------------

# The ssd kernels by name (SSDConfig.warps; the pallas_call names are "ssd_<name>", the wy one "ssd_wy_bwd").
FUSE_OUT_MAX_CHUNK = 64    # SSDConfig.fuse_out: larger chunks run unfused (P [C, C] and the q, k stages)
SSD_KERNELS = ("precompute", "mh", "state", "out", "dout", "reverse", "dqk", "wy", "wu")
SSD_BLOCK_KERNELS = ("mh", "out", "dout", "dqk", "wy")     # the chunk kernels whose sub-block SSDConfig.blocks sets


@dataclasses.dataclass(frozen=True)
class SSDConfig:
    """Launch parameters of the ssd kernels.

    Chunk kernels (one program per chunk, batch and head: the UT transform, the output, the gradients)
    work on ``block`` x ``block`` sub-blocks of the chunk's C x C matrices (the UT transform always on
    16 x 16 ones) and step through dv ``block_v`` columns at a time, with ``num_warps`` warps.
    Sequential kernels (one program per batch, head and ``state_block_v`` columns of dv, a loop over the
    chunks with the float32 state in registers) run ``state_warps`` warps and ``state_stages`` pipeline
    stages. ``max_chunk`` caps the chunk size (a larger requested chunk_size runs at this one: the result is
    the same function). ``f32_dot``: "ieee" (float32 FMA, full precision) or "tf32x3" (three tf32
    tensor-core products, about float32 accuracy); 16-bit inputs use the tensor cores natively. The
    float32 16 x 16 x 16 products of the UT transform's algebra run IEEE unless ``small_f32_dot`` (then
    ``f32_dot`` too: a candidate for the float32 ``wy`` backward kernel, docs/PERF_NOTES.md session 9).
    ``transition``: the sequential passes step ``S <- M_n S + H_n`` with ``M_n = g I - k_dec^T w_n`` and
    ``H_n = k_dec^T u_n`` formed per chunk in parallel beforehand (one [dk, dk] x [dk, bv] product per step
    instead of two [C, dk]-sized ones; without beta no product at all), instead of ``D = u - w S``,
    ``S <- g S + k_dec^T D``. Fewer sequential FLOPs when dk < 2 C. ``transition="without_beta"``: the
    transition form without beta only (with beta the two-product form). ``warps``: per-kernel warp counts
    that override ``num_warps`` / ``state_warps``, as pairs (kernel, warps) with kernel one of
    :data:`SSD_KERNELS`. ``blocks``: per-kernel sub-block sizes that override ``block`` in the chunk kernels
    (mh, out, dout, dqk, wy), as pairs (kernel, block). ``dqk_block_k``: the dqk backward kernel does the dk
    columns in passes of this many (fewer live float32 accumulators at large dk; None: one pass).
    ``reverse_rinc`` (two-product form with beta): the dout kernel also forms the adjoint-independent part
    R_n = q_g^T dO - w^T P^T dO of each reverse step (as in the transition form), so the sequential reverse
    pass chains two products per chunk instead of three and reads neither q nor dO. ``mh_kernel`` (transition
    form with beta): M and H are formed by a kernel of their own from the stored w and u, on ``block``
    sub-blocks, instead of inside the precompute's 16 x 16 UT structure. ``kdec`` (two-product form with
    beta): the precompute also stores k_dec, each key decayed to its chunk's end ([B, H, T, dk], input
    dtype, from the same segment sums as every other decay), and the sequential state pass reads it instead
    of k, so it no longer forms the decay vectors from log_alpha in every step of its chain. ``ut_subst``
    (two-product form with beta, forward): the forward's precompute forms only T's 16 x 16 diagonal blocks
    and solves (I + A) w = beta gamma k and (I + A) u = beta v by block forward substitution, w_i = T_ii
    (x_i - sum_{j<i} A_ij w_j), instead of forming T's blocks below the diagonal first (the backward's
    precompute, which stores T, always forms all of it). ``fuse_out`` (forward, not the transition form): the
    sequential state pass also forms each chunk's output O = P D + q_g S_n for its dv columns as it goes (P
    from q and k, as the output kernel does), so the forward stores neither the chunk states nor D and runs
    no output kernel (the backward, which recomputes the states, is unchanged); for chunks up to
    :data:`FUSE_OUT_MAX_CHUNK` (a larger chunk runs unfused: the same function). ``without_beta``: pairs
    (field, value) that override this config's fields when ``beta`` is None (gated linear attention runs
    other kernels, with other best launches, than the delta rule); :meth:`resolved` applies them.
    ``store_p`` (backward): the dout kernel, which forms P = scale (q k^T * G) anyway, also stores it ([B, H, T,
    C] float32) and the dqk kernel reads it: log_alpha's gradient through P is dP * P, so dqk forms no q k^T
    product. ``store_kg`` (backward, with beta): the backward's precompute, which forms k k^T * G_strict
    for the UT transform anyway, also stores it ([B, H, T, C] float32) and the wy kernel reads it instead of
    forming k k^T. Each drops one data-sized product per chunk for one [T, C] float32 write and read.
    ``wy_pack`` (backward, with beta, dk and dv padded to one width in one ``block_v``): the wy kernel pairs
    the dk and dv columns of dw and du (and of w and u) into one operand, so its T^T products and dA take one
    product per sub-block pair each instead of two (half as many products, each twice as wide).
    ``dqk_pack`` (backward; the dqk kernel on one chunk-wide sub-block, one dk pass, dD formed there and one
    dv block as wide as the chunk): dk = e_last D dh^T + dQK^T q as one product over paired columns, and
    log_alpha's gradient through e_last from D and k_dec dh^T (formed for dD anyway) instead of D dh^T.
    ``dqk_pair_do`` (backward; the dqk kernel on one chunk-wide sub-block, one dk pass, one dv block, dk padded
    to the chunk): dP = dO D^T and dO h^T as one product, dO [D^T | h^T] over paired columns.
    ``dqk_lean`` (backward; the dqk kernel on one chunk-wide sub-block, one dk pass, one dv block): the same
    products in an order that keeps fewer float32 tiles live (inputs loaded at first use, operands dying
    early); the pairing options do not apply to it.
    ``save_t`` (with beta, Pallas backward): the forward under differentiation also stores the UT transform's
    T ([B, H, T, C] in the input dtype: one more residual the size of a [T, C] input) and the backward forms
    w = T (beta gamma k) and u = T (beta v) from it instead of inverting again (as fla saves its A).
    ``save_h`` (with beta, Pallas backward, the output not fused into the state pass): the forward under
    differentiation also keeps the chunk-start states h it writes for its output kernel ([B, H, N dk, dv] in
    the input dtype: one more residual the size of a [T, dv] input) and the backward skips its state pass.
    """

    block: int = 16
    block_v: int = 64
    num_warps: int = 4
    state_block_v: int = 32
    state_warps: int = 4
    state_stages: int = 2
    max_chunk: int = 128
    f32_dot: str = "ieee"
    transition: bool | str = False
    small_f32_dot: bool = False
    warps: tuple = ()
    blocks: tuple = ()
    dqk_block_k: int | None = None
    reverse_rinc: bool = False
    mh_kernel: bool = False
    kdec: bool = False
    ut_subst: bool = False
    fuse_out: bool = False
    without_beta: tuple = ()
    store_p: bool = False
    store_kg: bool = False
    wy_pack: bool = False
    dqk_pack: bool = False
    dqk_pair_do: bool = False
    dqk_lean: bool = False
    save_t: bool = False
    save_h: bool = False

    def __post_init__(self):
        for name in ("block", "block_v", "state_block_v", "max_chunk", "dqk_block_k"):
            val = getattr(self, name)
            if name == "dqk_block_k" and val is None:
                continue
            if not isinstance(val, int) or val < 16 or val & (val - 1):
                raise ValueError(f"SSDConfig: {name} must be a power of two >= 16, got {val!r}")
        for name in ("num_warps", "state_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"SSDConfig: {name} must be 1, 2, 4, 8 or 16, got {getattr(self, name)!r}")
        if not isinstance(self.state_stages, int) or self.state_stages < 1:
            raise ValueError(f"SSDConfig: state_stages must be a positive int, got {self.state_stages!r}")
        if self.f32_dot not in ("ieee", "tf32x3"):
            raise ValueError(f"SSDConfig: f32_dot must be 'ieee' or 'tf32x3', got {self.f32_dot!r}")
        for name in ("reverse_rinc", "mh_kernel", "kdec", "ut_subst", "fuse_out", "store_p", "store_kg", "wy_pack",
                     "dqk_pack", "dqk_pair_do", "dqk_lean", "save_t", "save_h"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SSDConfig: {name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.small_f32_dot, bool):
            raise ValueError(f"SSDConfig: small_f32_dot must be a bool, got {self.small_f32_dot!r}")
        for pair in self.warps:
            if not (isinstance(pair, tuple) and len(pair) == 2 and pair[0] in SSD_KERNELS
                    and pair[1] in (1, 2, 4, 8, 16)):
                raise ValueError(f"SSDConfig: warps must be pairs (kernel, warps) with kernel one of {SSD_KERNELS} "
                                 f"and warps 1, 2, 4, 8 or 16, got {self.warps!r}")
        for pair in self.blocks:
            if not (isinstance(pair, tuple) and len(pair) == 2 and pair[0] in SSD_BLOCK_KERNELS
                    and isinstance(pair[1], int) and pair[1] >= 16 and not pair[1] & (pair[1] - 1)):
                raise ValueError(f"SSDConfig: blocks must be pairs (kernel, block) with kernel one of "
                                 f"{SSD_BLOCK_KERNELS} and block a power of two >= 16, got {self.blocks!r}")
        if not (isinstance(self.transition, bool) or self.transition == "without_beta"):
            raise ValueError(f"SSDConfig: transition must be a bool or 'without_beta', got {self.transition!r}")
        tunable = {f.name for f in dataclasses.fields(self)} - {"without_beta"}
        if not (isinstance(self.without_beta, tuple) and all(
                isinstance(pair, tuple) and len(pair) == 2 and pair[0] in tunable for pair in self.without_beta)):
            raise ValueError(f"SSDConfig: without_beta must be pairs (field, value) with field one of "
                             f"{sorted(tunable)}, got {self.without_beta!r}")
        if self.without_beta:
            self.resolved(False)         # the overridden config must be valid too

    def resolved(self, has_beta: bool) -> "SSDConfig":
        """The config the kernels run: without beta, this one with ``without_beta``'s overrides applied."""
        if has_beta or not self.without_beta:
            return self
        return dataclasses.replace(self, without_beta=(), **dict(self.without_beta))


def ssd_smem_bytes(config: SSDConfig, head_dim_k: int, head_dim_v: int, chunk: int, dtype) -> int:
    """Static estimate of the largest shared-memory need among the ssd kernels, bytes.

    Sequential kernels: Triton's pipeliner buffers the tile that feeds the state product once per stage
    ([C, dk] w, or q in the reverse pass; M_n [dk, dk] float32 in the transition form); the other dot
    operands are staged once for their layout change: a [C, dk] tile, the [dk, state_block_v] float32 state
    and a [C, state_block_v] float32 tile. Chunk kernels (no pipelined loop): the operands of their largest
    dot, a [dk, block_v] float32 tile against a [block, dk] one (with wy_pack or dqk_pack two [block, dk + dv]
    ones; with save_t the wu kernel's chunk-wide tiles). Head dims padded to powers of two (at least
    16). A heuristic in the spirit of :func:`smem_bytes`, not yet compared with a compiled kernel's own
    number.
    """
    item = jnp.dtype(dtype).itemsize
    dk, dv = max(16, _pow2(head_dim_k)), max(16, _pow2(head_dim_v))
    c = min(chunk, config.max_chunk)
    bv = min(config.state_block_v, dv)
    sequential = config.state_stages * c * dk * item + c * dk * item + dk * bv * 4 + c * bv * 4
    if config.fuse_out and c <= FUSE_OUT_MAX_CHUNK:   # the forward's state pass also streams q and k, stages P
        sequential += 2 * config.state_stages * c * dk * item + c * c * 4
    if config.transition:       # M_n [dk, dk] float32 streamed per stage, staged once more as an operand
        sequential = (config.state_stages + 1) * dk * dk * 4 + 2 * dk * bv * 4
    block = max([config.block] + [b for _, b in config.blocks])
    chunked = dk * min(config.block_v, dv) * 4 + min(block, c) * dk * 4
    if config.wy_pack or config.dqk_pack or config.dqk_pair_do:   # paired operands: two [block, dk + dv] tiles
        chunked = max(chunked, 2 * min(block, c) * (dk + dv) * 4)
    if config.save_t:     # the wu kernel: [C, C] T against a [C, block_v] tile, and k k^T on [C, dk] tiles
        chunked = max(chunked, c * c * 4 + c * max(dk, min(config.block_v, dv)) * 4, 2 * c * dk * 4)
    return max(sequential, chunked)


# family -> {(max padded head dim, dtype class): config}. Untuned entries carry the defaults.
SSD_CONFIGS: dict[str, dict[tuple[int, str], SSDConfig]] = {
    # H200 (session 7, docs/PERF_NOTES.md): Triton's IEEE float32 dot runs on the FMA units and made the
    # float32 forward slower than chunked (3.29 vs 2.85 ms at B2 H8 T8192 dk64); three tf32 passes
    # ("tf32x3") gave 1.27 ms with 3e-7 relative difference from chunked. 64-row sub-blocks (one chunk)
    # in the output and gradient kernels: four large products instead of about 28 small ones.
    "h200": {
        # dk <= 64: the transition form (M_n is [dk, dk] per chunk; at 128 and above it would be 2-4x the
        # bytes of k and its sequential product as long as the two-dot form's). float32 with beta: the
        # two-product form, whose forward is faster (1.06 vs 1.19 ms at B2 H8 T8192; per kernel, session 9:
        # precompute 0.232 + state 0.581 + out 0.247 vs 0.662 + 0.277 + 0.253) and backward kernels the same
        # (7.27 vs 7.22 ms); without beta the transition form (no product in the sequential chain, 0.385 ms).
        # Session 11 (the wy kernel reads T from the backward's precompute): wy on 16-row sub-blocks (f32 dk64
        # 1.08 ms vs 1.21 on one 64-row tile and 4.95 recomputing T; bf16 dk128 0.92 vs 2.31 / 3.19 at 8 warps),
        # 3 stages in the sequential passes (state 0.494 vs 0.579 ms at 2), dqk at bf16 dk128 in two passes of
        # 64 dk columns with 4 warps (2.71 vs 3.73 ms in one pass at 8 warps). 4 warps beat 8 in every kernel
        # tried at these shapes (docs/PERF_NOTES.md). Session 12: dk 64 float32 in the transition form with
        # beta too, M and H from their own kernel (mh_kernel): forward 0.820 vs 0.984 ms, fwd+bwd 5.18 vs 5.95
        # (precompute 0.235 + mh 0.104 + state 0.222 + out 0.255; reverse 0.210 vs 0.690). Session 13: bf16
        # dk128's output kernel at 4 warps (0.148 vs 0.244 ms at 8; forward 1.11 vs 1.22 ms end to end); float32
        # dk128's precompute at 4 warps (0.952 vs 6.18 ms at 8: the forward was 7.90 ms against chunked's 3.74).
        # Session 14 (per-kernel warp sweep, gpu_ssd.py --warp-sweep): bf16 dk128's precompute at 2 warps (0.266
        # vs 0.560 ms at 8, 0.315 at 4, 0.520 at 1; its backward form 0.277 vs 0.580); float32 dk128's output
        # and dout kernels at 4 warps (0.407 vs 0.672, 0.159 vs 0.235 ms; its dqk stays at 8: 2.69 at 4, 2.40);
        # bf16 dk256's output and state kernels at 4 warps (B2 H8 T4096: 0.322 vs 0.500, 0.404 vs 0.651 ms; dqk
        # 7.65 at 4 vs 6.00). Session 16: bf16 dk128 with the stored k_dec (kdec): state 0.395 -> 0.251 ms,
        # precompute 0.266 -> 0.309, forward 0.812 -> 0.709, fwd+bwd 4.03 -> 3.86 (3 stages: the same).
        # Session 18: bf16 dk128's forward precompute by block forward substitution (ut_subst): precompute
        # 0.312 -> 0.274 ms, forward 0.747 -> 0.703 in one process (gpu_ssd_ab.py; at 4 warps 0.343 / 0.760).
        # Session 23 (gpu_ssd.py variants, B2 H8 T8192): without beta, 32 dv columns per step in the chunk
        # kernels: dqk 0.892 vs 1.134 ms, fwd+bwd 1.320 vs 1.592 (with beta dqk 1.186 vs 1.060: not there).
        # Session 24 (gpu_ssd_ab.py, B2 H8 T8192 with beta, fwd+bwd 3.687 ms shipped): store_p and store_kg
        # 3.446 (dqk 1.059 -> 0.994, wy 1.066 -> 0.872); with wy_pack 3.397 (wy 0.815), its wy on 32-row
        # sub-blocks 3.171 (wy 0.576), on one 64-row tile **2.905** (wy 0.304). Not measured without beta (the
        # session 23 launch stays there: store_p off). Session 29 (gpu_ssd_ab.py, one process): dqk_lean and
        # save_t, fwd+bwd 2.915 -> **2.552** ms (dqk 1.001 -> 0.793; at 8 dqk warps 2.645), gradients within
        # 2.1e-7 of the previous entry's; `python -m flashlax.bench` 2.617 ms (fla 2.62). Session 31 (the same
        # A/B): save_h (the forward keeps the chunk-start states, the backward runs no state pass) 2.531 ->
        # **2.300** ms (dqk 0.785; the wu kernel at 8 warps with it 2.484, dqk at 2 stages 9.15), gradients
        # within 2.1e-7; `python -m flashlax.bench` **2.349** ms (fla 2.62), residual_mb 32.25 -> 64.25.
        (64, "32"): SSDConfig(block=64, block_v=64, state_block_v=16, state_stages=3, f32_dot="tf32x3",
                              transition=True, mh_kernel=True, blocks=(("wy", 64),), store_p=True,
                              store_kg=True, wy_pack=True, save_h=True, dqk_lean=True, save_t=True,
                              without_beta=(("block_v", 32), ("store_p", False))),
        (128, "32"): SSDConfig(block=64, block_v=64, num_warps=8, state_block_v=16, state_stages=2,
                               f32_dot="tf32x3", warps=(("wy", 4), ("precompute", 4), ("out", 4), ("dout", 4))),
        (256, "32"): SSDConfig(block=16, block_v=32, num_warps=8, state_block_v=16, state_warps=8,
                               state_stages=1, max_chunk=64, f32_dot="tf32x3"),
        (64, "16"): SSDConfig(block=64, block_v=64, state_block_v=32, state_stages=2, f32_dot="tf32x3",
                              transition=True),
        (128, "16"): SSDConfig(block=64, block_v=64, num_warps=8, state_block_v=32,
                               f32_dot="tf32x3", blocks=(("wy", 16),), dqk_block_k=64,
                               warps=(("wy", 4), ("dqk", 4), ("out", 4), ("precompute", 2)), kdec=True,
                               ut_subst=True, fuse_out=True, state_stages=3),
        (256, "16"): SSDConfig(block=16, block_v=32, num_warps=8, state_block_v=16, state_warps=8,
                               state_stages=1, max_chunk=64, f32_dot="tf32x3", warps=(("out", 4), ("state", 4))),
    },
    # RTX 3090: not run on one (no such machine here); its float32 and tf32 rates are about equal, so IEEE.
    "rtx3090": {
        (64, "32"): SSDConfig(block=16, block_v=64, state_block_v=16, state_stages=2, max_chunk=64),
        (128, "32"): SSDConfig(block=16, block_v=32, state_block_v=16, state_stages=1, max_chunk=64),
        (256, "32"): SSDConfig(block=16, block_v=16, num_warps=8, state_block_v=16, state_warps=8,
                               state_stages=1, max_chunk=32),
        (64, "16"): SSDConfig(block=16, block_v=64, state_block_v=32, state_stages=2, max_chunk=64),
        (128, "16"): SSDConfig(block=16, block_v=32, state_block_v=16, state_stages=2, max_chunk=64),
        (256, "16"): SSDConfig(block=16, block_v=16, num_warps=8, state_block_v=16, state_warps=8,
                               state_stages=1, max_chunk=32),
    },
}
SSD_CONFIGS["default"] = SSD_CONFIGS["rtx3090"]


def ssd_config(head_dim_k: int, head_dim_v: int, dtype, device_kind: str | None = None) -> SSDConfig:
    """The ssd config for this device kind, head dims (up to 256) and input dtype."""
    d = max(_pow2(head_dim_k), _pow2(head_dim_v))
    if d > 256:
        raise ValueError(f"ssd_config: head dims up to 256 are supported, got ({head_dim_k}, {head_dim_v})")
    cls = "32" if jnp.dtype(dtype).itemsize >= 4 else "16"
    table = SSD_CONFIGS[device_family(device_kind)]
    return table[(64 if d <= 64 else 128 if d <= 128 else 256, cls)]


def check_ssd_config(config: SSDConfig, head_dim_k: int, head_dim_v: int, chunk: int, dtype,
                     device_kind: str | None = None, limit: int | None = None) -> None:
    """ValueError when ``config`` needs more shared memory (:func:`ssd_smem_bytes`) than the device allows."""
    limit = smem_limit(device_kind) if limit is None else limit
    need = ssd_smem_bytes(config, head_dim_k, head_dim_v, chunk, dtype)
    if need > limit:
        raise ValueError(
            f"ssd config {config} needs about {need} bytes of shared memory for head dims ({head_dim_k}, "
            f"{head_dim_v}), chunk {chunk} and dtype {jnp.dtype(dtype).name}, over the device limit of "
            f"{limit} bytes ({device_kind or device_family()}); use smaller state_block_v / state_stages / "
            "max_chunk")


# ----------------------------------------------------------------------------------------------------
# kernel_options: PyTorch FlexAttention's names for the kernel configuration
# ----------------------------------------------------------------------------------------------------

# name -> (pass, field): "fwd" sets a FlashConfig field, "bwd" a BwdConfig field (flash_attention_bwd.py).
# Unprefixed BLOCK_M / BLOCK_N are the forward's tiles; unprefixed num_warps / num_stages set both passes; a
# fwd_ / bwd_ prefixed name wins over the unprefixed one. pack_gqa and q_major are flashlax's own.
KERNEL_OPTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "BLOCK_M": (("fwd", "block_q"),),
    "BLOCK_N": (("fwd", "block_kv"),),
    "num_warps": (("fwd", "num_warps"), ("bwd", "num_warps_dkv"), ("bwd", "num_warps_dq")),
    "num_stages": (("fwd", "num_stages"), ("bwd", "num_stages_dkv"), ("bwd", "num_stages_dq")),
    "fwd_BLOCK_M": (("fwd", "block_q"),),
    "fwd_BLOCK_N": (("fwd", "block_kv"),),
    "fwd_num_warps": (("fwd", "num_warps"),),
    "fwd_num_stages": (("fwd", "num_stages"),),
    "bwd_BLOCK_M1": (("bwd", "block_q_dkv"),),
    "bwd_BLOCK_N1": (("bwd", "block_kv_dkv"),),
    "bwd_BLOCK_M2": (("bwd", "block_q_dq"),),
    "bwd_BLOCK_N2": (("bwd", "block_kv_dq"),),
    "bwd_num_warps": (("bwd", "num_warps_dkv"), ("bwd", "num_warps_dq")),
    "bwd_num_stages": (("bwd", "num_stages_dkv"), ("bwd", "num_stages_dq")),
    "pack_gqa": (("fwd", "pack_gqa"),),
    "q_major": (("fwd", "q_major"),),
}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """``kernel_options`` parsed: FlashConfig fields for the forward, BwdConfig fields for the backward."""

    fwd: dict
    bwd: dict

    @property
    def fixed_tiles(self) -> bool:
        """The forward's tiles were chosen by the caller (a block mask with other tiles is rebuilt)."""
        return "block_q" in self.fwd or "block_kv" in self.fwd


def parse_kernel_options(options, op: str = "flex_attention") -> KernelOptions:
    """Validates a ``kernel_options`` dict (names and values) and sorts it into forward / backward config
    fields. ValueError names the option; the shared-memory check needs the device and is the kernel's
    (:func:`check_config`)."""
    if options is None:
        return KernelOptions({}, {})
    if not isinstance(options, dict):
        raise ValueError(f"{op}: kernel_options must be a dict or None, got {type(options).__name__}")
    unknown = sorted(set(options) - set(KERNEL_OPTIONS))
    if unknown:
        raise ValueError(f"{op}: unknown kernel_options {unknown}; flashlax accepts {sorted(KERNEL_OPTIONS)}")
    fields: dict[str, dict] = {"fwd": {}, "bwd": {}}
    # Unprefixed names first, so fwd_ / bwd_ names override them.
    for name in sorted(options, key=lambda n: n.startswith(("fwd_", "bwd_"))):
        value = options[name]
        flag = name in ("pack_gqa", "q_major")
        if (flag and not isinstance(value, bool)) or \
                (not flag and (isinstance(value, bool) or not isinstance(value, (int, np.integer)))):
            raise ValueError(f"{op}: kernel_options[{name!r}] must be {'a bool' if flag else 'an int'}, "
                             f"got {value!r}")
        for which, field in KERNEL_OPTIONS[name]:
            fields[which][field] = value if flag else int(value)
    # Value rules (powers of two >= 16, warps 1..16, stages >= 1) are FlashConfig's; the backward's fields
    # obey the same rules.
    names = ("block_q", "block_kv", "num_warps", "num_stages")
    checks = [fields["fwd"]] + [{n: fields["bwd"][f"{n}_{p}"] for n in names if f"{n}_{p}" in fields["bwd"]}
                                for p in ("dkv", "dq")]
    for check in checks:
        try:
            FlashConfig(**check)
        except ValueError as err:
            raise ValueError(f"{op}: kernel_options {options}: {err}") from None
    return KernelOptions(fields["fwd"], fields["bwd"])
