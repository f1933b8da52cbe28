"""bin/chaos: a real training job with faults injected at seeded moments, then its invariants.

`run` drives the job and injects the faults of `faults` (processes signalled, the network of
`netproxy`, the disk of `disk`); `check` judges what the run left behind; `state` holds the
records they share; `cli` is the command.
"""
