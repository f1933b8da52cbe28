"""Agent-facing tools (calculator, sandboxed python, answer/finish) behind ``base.Tool``."""
