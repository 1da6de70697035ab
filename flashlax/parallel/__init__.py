"""flashlax on meshes of devices, on JAX's own machinery (``jax.shard_map``, XLA's SPMD partitioner and the
collectives ``ppermute``, ``psum``, ``all_gather``); nothing distributed is home-made.

- :mod:`~flashlax.parallel.vma`: loop carries and Pallas outputs inside ``shard_map`` (``check_vma=True``).
- :mod:`~flashlax.parallel.shard`: every op per shard of the batch and head axes of its inputs' shardings,
  and the dispatch of ``context_axis=`` to the modules below.
- :mod:`~flashlax.parallel.auto`: the Pallas kernels per shard on Auto meshes (``custom_partitioning``).
- :mod:`~flashlax.parallel.ring`: ring attention for ``flex_attention`` (context parallelism).
- :mod:`~flashlax.parallel.sequence`: ``decode_attention`` over a sequence-sharded KV cache and
  ``gated_delta_rule`` over a sequence-sharded input.
"""
