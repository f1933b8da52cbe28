"""Reward functions by name (``base.REWARDS``): math answers, QA F1/EM, code tests."""
