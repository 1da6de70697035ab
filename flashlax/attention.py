"""Front ends of softmax attention: flex_attention and dot_product_attention (STUB, being written)."""


def flex_attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale=None, return_lse=False,
                   impl=None, interpret=False):
    raise NotImplementedError("flex_attention: not written yet")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None):
    raise NotImplementedError("dot_product_attention: not written yet")
