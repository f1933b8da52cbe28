"""``bin/replay``: recorded trajectories for offline debugging.

A rollout server started with ``rollout_server.record=true`` keeps every batch it shipped in
``RUN_DIR/recordings/<server_id>/`` (format: rollout_service/RECORDING.md). Three subcommands use
those files:

- ``inspect`` (``show``): the trajectories as text, model tokens (mask 1) and tool/context tokens
  (mask 0) told apart by colour or by explicit markers, or as one self-contained HTML page;
- ``stream`` (``stream``): the batches sent again to a learner over the real protocol, as if the
  rollout server that recorded them were back, so a learner can be debugged on known data;
- ``rerun`` (``rerun``, ``engine``, ``compare``): every episode run again through the real agent
  loop, tools and reward functions with an engine that plays back the recorded model tokens, and
  the result compared with the recording: a tool or reward that is not deterministic, or agent code
  that changed since the recording, shows up as a divergence with its position.

``locate`` finds recordings and the config and model of the run that made them. Modules import
their heavy dependencies (transformers, the rollout service, ZeroMQ) inside functions, so
``bin/replay --help`` stays instant.
"""
