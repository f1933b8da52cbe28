"""Inference engines behind one small interface (``base.Engine``), chosen by
``rollout_server.engine``: vLLM's AsyncLLM in process, or the scripted engine for tests."""
