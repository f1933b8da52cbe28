"""Rollout servers: vLLM engines running multi-turn agent episodes and streaming trajectories."""
