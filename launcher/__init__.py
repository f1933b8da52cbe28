"""bin/train's launcher: one training job on this machine, every process of it supervised.

Where to read: `launcher.main` (the command) -> `launcher.plan` (config -> children, ports) ->
`launcher.supervisor` (the loop: start, follow, restart, stop) with `launcher.children` (process
groups, stopping, the sweep) and `launcher.console` (the event channel's reader, progress, summary).
Imports go one way, main -> supervisor -> plan / children / console; nothing here is imported by
the learner or the rollout servers, which talk to it only through ``RUN_DIR/events.jsonl``
(`common.run_events`) and the files they already write.
"""
