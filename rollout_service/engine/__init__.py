"""Inference engines behind one small interface (``base.Engine``): vLLM's AsyncLLM in process."""
