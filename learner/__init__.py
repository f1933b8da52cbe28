"""The learner: consumes trajectory streams, computes advantages, trains with Ray + FSDP, and
publishes new weights. So far it holds the intake service (``intake``); training arrives next."""
