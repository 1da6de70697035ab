"""Microbenchmarks and parity report: ``python -m flashlax.bench`` (``--help`` lists the flags).

Modules: ``harness`` (timing, XLA memory analysis, residual sizes, errors, device block), ``peers``
(flashlax paths and jax_xla / jax_cudnn / torch_sdpa runners), ``suites`` (linear, gqa, prefill, decode),
``report`` (tables, ``--report`` plot, ``--compare``), ``quick`` (the main job), ``cli`` (the command line).
"""


def main(argv=None) -> int:
    from flashlax.bench.cli import main as cli_main  # imported lazily: the CLI sets env vars before jax starts

    return cli_main(argv)
