"""Agent loops: the episode state machine (``episode``), chat rendering to tokens (``rendering``),
tool-call parsers (``parsers``) and the registered agents (``single_turn``, ``tool_agent``)."""
