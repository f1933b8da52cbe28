"""Code shared by the learner and the rollout server: configuration, logging, run directories, CLI.

Nothing here imports torch, vLLM or Ray, so entrypoints stay fast to start (`--help`, `--check`).
"""
