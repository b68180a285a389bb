"""Reinforcement learning: samples, packing, environments, orchestrator, trainer."""
