"""Rollout: engines that sample tokens, and the multi-turn loop that turns env play into trajectories."""
