"""What verl's own trainer loads by file path for bench/vs_verl.py: our calculator as a verl function
tool (``calculator_tool.py``) and our math reward as a verl reward function (``reward.py``).

Design: both sides of the comparison must see the same prompts, the same tool outputs and the same
scores, so these files wrap the project's own implementations instead of re-writing them. verl
imports them by path in its Ray workers; the repository root is on their ``PYTHONPATH``.
"""
