"""Wire protocol between rollout servers and the learner.

Layers, bottom up (see SPEC.md for the normative description):
- ``errors``, ``version``: typed error codes and the protocol version rule.
- ``schema``: declarative validation of decoded msgpack maps into typed dataclasses.
- ``messages``, ``trajectory``: the message structs; trajectories travel column-wise as raw
  little-endian arrays in extra frames.
- ``codec``: frames <-> messages (msgpack only, never pickle), with size limits.
- ``weights``: chunked weight transfer (manifest, zero-copy chunking, checksummed assembly).
- ``connection``: sans-IO state machines for both ends (no sockets, explicit clock).
- ``zmq_transport``: the ZeroMQ driver of those state machines (asyncio, CURVE optional).
"""

from protocol.errors import ErrorCode, ProtocolError
from protocol.version import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "ErrorCode", "ProtocolError"]
