"""The RL trainer: reads rollout batches, trains the policy, writes checkpoints."""
