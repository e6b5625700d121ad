"""ragen-pl's experiments: the SmolLM2-135M CPU readout runs, beside the library.

They plug into ragen-pl through its public extension points only, as a third-party package would:

* :mod:`ragen_pl_experiments.readout`: model hooks (``ragen_pl.model_hooks``): the centred / whitened / token readout
  head on the LM head, and a standardised value head;
* :mod:`ragen_pl_experiments.update`: ``ReadoutUpdate`` (``ragen_pl.updates``), which fits those before the first
  update and runs the head alone on a frozen trunk;
* :mod:`ragen_pl_experiments.warm_starts`: the effective and state-only SmolLM2 warm starts (``ragen_pl.models``).

Their configs are in ``experiments/configs/``, their research scripts in ``experiments/benchmarks/``, their report in
the docs (Experiments).
"""
