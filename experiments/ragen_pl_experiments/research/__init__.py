"""The research scripts of the SmolLM2 readout runs, each runnable as ``python -m
ragen_pl_experiments.research.<name>``: ``real_llm`` (train and evaluate SmolLM2 on an env), ``readout_rl`` (a linear
learner on the model's hidden states), ``head_geometry`` (what the head reads), ``probe_reading`` and
``probe_solver_sft`` (what a probe or SFT on the solver can read off the states), ``policy_reading`` (what a trained
policy reads). Their findings are in the docs (Experiments: SmolLM2 on CPU)."""
