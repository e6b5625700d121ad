"""ragen-pl's product benchmarks: each prints its figures side by side in one run. Run them as scripts
(``python benchmarks/envs.py``) or, for the ones that build on another (``findings``, ``vs_trl``), as modules from the
repository root (``python -m benchmarks.findings``)."""
