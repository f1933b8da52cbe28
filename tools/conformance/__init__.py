"""Protocol conformance suite: checks a live learner or rollout server against protocol/.

Two roles, one registry of checks per role (``registry``):
- ``--role learner``: the suite plays rollout servers (``peer``: raw DEALER sockets sending frames
  built by ``protocol.codec``, and frames corrupted by hand) against a learner's ROUTER. Every check
  opens fresh sockets under a fresh peer_id, so the checks are independent (``checks_learner``).
- ``--role rollout-server``: the suite binds a ROUTER and plays the learner (``fake_learner``); one
  rollout server connects and the checks run in a fixed order on that one connection, because
  later checks need the state earlier ones built (``checks_rollout``).

Checks never sleep where a reply is expected: they poll with a deadline and, on failure, report
what did arrive. ``runner`` runs the checks and collects results, ``report`` prints them, ``cli``
is the command line (``bin/conformance``). Nothing heavy is imported here so ``--help`` is instant.
"""
