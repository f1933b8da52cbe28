"""Seeds and mutators for the fuzz tests: valid encodings of every message type, and deterministic
ways of breaking them (frame surgery, msgpack with the wrong types, huge declared lengths,
extension types, oversize messages).

``cases(seed, n)`` yields ``(category, frames)`` pairs; the same seed always yields the same frames.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
from transport_testkit import MODEL, TOKENIZER, make_batch

from protocol import codec
from protocol.messages import (
    Ack,
    Admit,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Limits,
    MsgType,
    SourceMetrics,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsApplied,
    Welcome,
)
from protocol.weights import NamedBuffer, plan_transfer

Frames = list[bytes]


def wire(frames: list[Any]) -> Frames:
    return [bytes(memoryview(f).cast("B")) for f in frames]


def valid_encodings() -> list[Frames]:
    """At least one valid encoding of every message type (batches of several shapes)."""
    rng = np.random.default_rng(11)
    w = np.arange(40, dtype=np.float32)
    announce, chunks = plan_transfer(
        1,
        [NamedBuffer("w", "float32", (40,), memoryview(w).cast("B"))],
        chunk_bytes=64,
        transfer_id="fuzz-tx",
    )
    msgs: list[Any] = [
        Hello([1, 0], "fuzz-peer", "rollout-server", "fuzz-epoch", MODEL, TOKENIZER, 0, ["x"]),
        Hello([1, 3], "fuzz-peer", "rollout-server", "fuzz-epoch", MODEL, TOKENIZER, -1),
        Hello(
            [1, 3],
            "fuzz-peer",
            "rollout-server",
            "fuzz-epoch",
            MODEL,
            TOKENIZER,
            0,
            ["admission"],
            slots=8,
        ),
        Welcome([1, 0], "learner", "s", 4, 0, 1, 1.0, 10.0, Limits(1 << 20, 64, 4096)),
        TrajectoryBatch(1, make_batch(1, rng=rng, tag="fz")),
        TrajectoryBatch(2, make_batch(3, prompt_len=4, response_len=12, rng=rng, tag="fz")),
        TrajectoryBatch(3, make_batch(2, prompt_len=1, response_len=0, rng=rng, tag="fz")),
        Ack([1, 2], 3, [2]),
        announce,
        *chunks,
        WeightsApplied(1, "fuzz-tx", False, "no", 0.5),
        Heartbeat(1.5, 2),
        Error(3, "bad", False, "HELLO.peer_id", 1, 0),
        Bye("bye"),
        ValidateRequest("fuzz-val", 1, 5.0),
        Admit(4, 1),
        Heartbeat(2.5, 1, 300),
        ValidateResult(
            "fuzz-val",
            1,
            sources=[
                SourceMetrics("s", 2, 1.0, 0.5, 3.0, 1.0, {"answered": 2}, {"acc": 0.5}, {"acc": 2})
            ],
        ),
    ]
    out = [wire(codec.encode(m)) for m in msgs]
    assert {f[0][0] for f in out} == {int(t) for t in MsgType}
    return out


_WRONG = [
    None,
    True,
    False,
    -1,
    0,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5,
    -0.0,
    float("nan"),
    float("inf"),
    "",
    "x",
    "answered",
    "int32",
    "prompt_ids",
    b"\x00",
    [],
    {},
    [1],
    [[1]],
    ["int32"],
    {"a": 1},
    {"k": [1]},
    [None, None],
    msgpack.ExtType(1, b"e"),
]


def _wrong(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(_WRONG))  # fresh: later mutations must not edit the pool


def _mutate_obj(rng: random.Random, o: Any, depth: int = 0) -> Any:
    """Replace one value somewhere inside ``o`` with a value of a (usually) wrong type."""
    if isinstance(o, dict) and o and depth < 6:
        k = rng.choice(list(o))
        roll = rng.random()
        if roll < 0.1:
            del o[k]  # a required field goes missing
        elif roll < 0.15:
            o[f"extra{rng.randrange(9)}"] = _wrong(rng)  # unknown keys are ignored
        else:
            o[k] = _mutate_obj(rng, o[k], depth + 1) if rng.random() < 0.5 else _wrong(rng)
        return o
    if isinstance(o, list) and o and depth < 6:
        i = rng.randrange(len(o))
        roll = rng.random()
        if roll < 0.1:
            del o[i]
        elif roll < 0.2:
            o.append(o[i])
        else:
            o[i] = _mutate_obj(rng, o[i], depth + 1) if rng.random() < 0.5 else _wrong(rng)
        return o
    return _wrong(rng)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


def _random_bytes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def _frame_surgery(rng: random.Random, frames: Frames) -> Frames:
    f = list(frames)
    op = rng.randrange(9)
    i = rng.randrange(len(f))
    if op <= 2 and f[i]:  # flip 1-4 bits
        b = bytearray(f[i])
        for _ in range(rng.randint(1, 4)):
            j = rng.randrange(len(b))
            b[j] ^= 1 << rng.randrange(8)
        f[i] = bytes(b)
    elif op == 3:  # truncate
        f[i] = f[i][: rng.randrange(len(f[i]) + 1)]
    elif op == 4:  # extend
        f[i] = f[i] + _random_bytes(rng, rng.randint(1, 16))
    elif op == 5 and len(f) > 1:  # drop a frame
        del f[i]
    elif op == 6:  # duplicate or insert a frame
        f.insert(i, f[i] if rng.random() < 0.5 else _random_bytes(rng, rng.randrange(32)))
    elif op == 7:  # another type byte (known or not)
        f[0] = (
            bytes((rng.randrange(256),))
            if rng.random() < 0.8
            else _random_bytes(rng, rng.choice([0, 2]))
        )
    else:  # overwrite a byte of the header with a msgpack type marker
        if len(f) > 1 and f[1]:
            b = bytearray(f[1])
            b[rng.randrange(len(b))] = rng.choice(
                [0xC1, 0xC4, 0xC7, 0xD4, 0xD9, 0xDB, 0xDD, 0xDF, 0xFF, 0x00]
            )
            f[1] = bytes(b)
    return f


def _huge(rng: random.Random, valid: list[Frames]) -> Frames:
    """Lengths that promise far more than the frame holds, or than any limit allows."""
    t = bytes((rng.choice(list(MsgType)),))
    kind = rng.randrange(8)
    if kind == 0:  # msgpack containers / strings declaring 4 GiB
        marker = rng.choice([b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9"])
        body = marker + b"\xff\xff\xff\xff" + (b"\x01" if marker == b"\xc9" else b"")
        return [t, body if rng.random() < 0.5 else b"\x81\xa3seq" + body]
    batch = next(
        f
        for f in valid
        if f[0] == bytes((MsgType.TRAJECTORY_BATCH,))
        and len(_unpack(f[1])["meta"]["trajectory_id"]) == 3
    )
    hdr = _unpack(batch[1])
    if kind == 1:
        field = rng.choice(["prompt_len", "response_len"])
        hdr["meta"][field][rng.randrange(3)] = rng.choice([2**31, 2**40, 2**63 - 1, 2**64 - 1])
    elif kind == 2:  # more trajectories than max_trajectories_per_batch
        n = 5000
        hdr["meta"] = {k: (v * n)[:n] for k, v in hdr["meta"].items()}
    elif kind == 3:
        hdr["seq"] = rng.choice([2**63 - 1, 2**64 - 1])
        return [batch[0], _pack(hdr), *batch[2:]]
    elif kind == 4:  # chunk part declaring a huge size
        chunk = next(f for f in valid if f[0] == bytes((MsgType.WEIGHTS_CHUNK,)))
        h = _unpack(chunk[1])
        h["parts"][0]["nbytes"] = rng.choice([2**40, 2**63 - 1])
        return [chunk[0], _pack(h), *chunk[2:]]
    elif kind == 5:  # announce of an absurd tensor
        return [
            bytes((MsgType.WEIGHTS_ANNOUNCE,)),
            _pack(
                {
                    "version": 1,
                    "transfer_id": "x",
                    "num_chunks": 2**40,
                    "tensors": [
                        {
                            "name": "w",
                            "dtype": "float32",
                            "shape": [2**40, 2**40],
                            "nbytes": 2**62,
                            "checksum": 0,
                        }
                    ],
                }
            ),
        ]
    elif kind == 6:  # a frame claims less than the header says
        return [batch[0], batch[1], *(f[: len(f) // 2] for f in batch[2:])]
    else:
        hdr["meta"]["trajectory_id"] = ["x" * 70_000, *hdr["meta"]["trajectory_id"][1:]]
    return [batch[0], _pack(hdr), *batch[2:]]


def _ext(rng: random.Random, valid: list[Frames]) -> Frames:
    f = list(rng.choice(valid))
    if rng.random() < 0.3:  # negative codes (-1 is msgpack's timestamp) need raw bytes
        code = rng.randrange(-128, 0)
        data = _random_bytes(rng, rng.choice([4, 8])) if code == -1 else _random_bytes(rng, 1)
        marker = {1: b"\xd4", 4: b"\xd6", 8: b"\xd7"}[len(data)]
        f[1] = b"\x81\xa3seq" + marker + (code & 0xFF).to_bytes(1, "big") + data
        return f
    ext = msgpack.ExtType(rng.randrange(0, 128), _random_bytes(rng, rng.randrange(12)))
    hdr = _unpack(f[1])
    if isinstance(hdr, dict) and hdr and rng.random() < 0.7:
        k = rng.choice(list(hdr))
        hdr[k] = ext if rng.random() < 0.5 else [ext]
        f[1] = _pack(hdr)
    else:
        f[1] = _pack(ext)
    return f


def _non_map(rng: random.Random) -> Frames:
    t = bytes((rng.choice(list(MsgType)),))
    return [
        t,
        _pack(rng.choice([None, 1, -5, 1.25, "hello", b"bin", [1, 2], [], True, [{"seq": 1}]])),
    ]


def _too_large(rng: random.Random, max_message_bytes: int) -> Frames:
    """Over the receiver's limit but under ZeroMQ's MAXMSGSIZE guard (which would drop the peer)."""
    t = bytes((rng.choice(list(MsgType)),))
    size = max_message_bytes + rng.randint(1, max_message_bytes // 2)
    return [t, _pack({"seq": 1}), bytes(size)]


def cases(seed: int, n: int, *, max_message_bytes: int) -> Iterator[tuple[str, Frames]]:
    rng = random.Random(seed)
    valid = valid_encodings()
    makers: list[tuple[float, str, Callable[[], Frames]]] = [
        (
            0.18,
            "random-frames",
            lambda: [
                _random_bytes(rng, rng.choice([0, 1, 1, 2, 8, 40, 300]))
                for _ in range(rng.randint(1, 7))
            ],
        ),
        (0.34, "frame-surgery", lambda: _repeat(rng, _frame_surgery, rng.choice(valid))),
        (0.26, "wrong-types", lambda: _wrong_types(rng, rng.choice(valid))),
        (0.06, "huge-lengths", lambda: _huge(rng, valid)),
        (0.05, "ext-types", lambda: _ext(rng, valid)),
        (0.04, "non-map-header", lambda: _non_map(rng)),
        (0.005, "too-large", lambda: _too_large(rng, max_message_bytes)),
        (0.065, "valid", lambda: list(rng.choice(valid))),
    ]
    weights = [w for w, _, _ in makers]
    for _ in range(n):
        _, name, make = rng.choices(makers, weights)[0]
        yield name, make()


def _repeat(
    rng: random.Random, op: Callable[[random.Random, Frames], Frames], frames: Frames
) -> Frames:
    for _ in range(rng.randint(1, 3)):
        frames = op(rng, frames)
    return frames


def _wrong_types(rng: random.Random, frames: Frames) -> Frames:
    hdr = _unpack(frames[1])
    for _ in range(rng.randint(1, 3)):
        hdr = _mutate_obj(rng, hdr)
    return [frames[0], _pack(hdr), *frames[2:]]
