"""The cluster-scale simulator of ``bench/simulate.py``: ``costs`` reads the benches' JSON,
``model`` is the discrete-event model that drives the project's own admission and staleness code."""
