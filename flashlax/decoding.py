"""Front end of decode_attention (STUB, being written)."""


def decode_attention(q, k_cache, v_cache, *, kv_lens=None, scale=None, num_splits=None, score_mod=None,
                     mask_mod=None, return_lse=False, impl=None, interpret=False):
    raise NotImplementedError("decode_attention: not written yet")
