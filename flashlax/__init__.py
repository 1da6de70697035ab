"""flashlax: attention kernels for JAX (Pallas GPU kernels with pure-XLA fallbacks)."""

from flashlax import masks, score_mods
from flashlax.attention import AuxOutput, AuxRequest, dot_product_attention, flex_attention
from flashlax.decoding import decode_attention
from flashlax.dispatch import available_impls
from flashlax.linear import gated_delta_rule
from flashlax.masks import BlockMask, create_block_mask

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "available_impls",
    "create_block_mask",
    "decode_attention",
    "dot_product_attention",
    "flex_attention",
    "gated_delta_rule",
    "masks",
    "score_mods",
]
__version__ = "0.1.0"


def __dir__() -> list[str]:
    """The public API only (the implementation modules stay importable, e.g. ``flashlax.dispatch``)."""
    return sorted(__all__ + ["__version__"])
