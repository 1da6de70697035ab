"""Front end of gated_delta_rule (STUB, being written)."""


def gated_delta_rule(q, k, v, log_alpha, beta=None, *, scale=None, initial_state=None, return_final_state=False,
                     chunk_size=64, impl=None, interpret=False):
    raise NotImplementedError("gated_delta_rule: not written yet")
