"""Golden wire vectors: one file per message, fixed contents, so another implementation (or a later
version of this one) can be checked byte for byte against this encoder.

File format (``NAME.bin``): a msgpack array of binary strings, one per ZeroMQ frame, in order:
``[type byte, msgpack header, *payload frames]``. ``manifest.json`` lists each file with its message
type, frame count and sha256.

    python tests/protocol/vectors/generate.py          # rewrite the files
    python tests/protocol/vectors/generate.py --check  # exit 1 if the files differ from the encoder

Everything here is deterministic (fixed ids, arrays written out, fixed transfer id). A change to
these files is a wire-format change: it needs a protocol version decision, not just a regeneration.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import (
    Ack,
    Admit,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Identity,
    Limits,
    MsgType,
    SourceMetrics,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsApplied,
    Welcome,
)
from protocol.schema import to_wire
from protocol.trajectory import Trajectory
from protocol.weights import NamedBuffer, plan_transfer

HERE = Path(__file__).resolve().parent
MODEL = Identity("tiny-model", "1" * 64, 512)
TOKENIZER = Identity("tiny-tokenizer", "2" * 64, 512)
TRANSFER_ID = "0123456789abcdef0123456789abcdef"


def hello() -> Hello:
    return Hello(
        [1, 0], "rollout-0", "rollout-server", "epoch-0001", MODEL, TOKENIZER, 3, ["weights-v1"]
    )


def weight_tensors() -> list[NamedBuffer]:
    a = np.array([0.5, -1.0, 2.0], dtype="<f4")  # 12 bytes
    b = np.array([[1, -2], [3, -4]], dtype="<i4")  # 16 bytes
    return [
        NamedBuffer("layer0.bias", "float32", (3,), memoryview(a).cast("B")),
        NamedBuffer("layer1.index", "int32", (2, 2), memoryview(b).cast("B")),
    ]


def trajectories() -> list[Trajectory]:
    t1 = Trajectory(
        trajectory_id="traj-0001",
        group_uid="group-01",
        prompt_ids=np.array([1, 2, 3], dtype="<i4"),
        response_ids=np.array([10, 11, 12, 13], dtype="<i4"),
        response_mask=np.array([1, 1, 0, 1], dtype="u1"),
        rollout_logprobs=np.array([-0.5, -0.25, 0.0, -1.5], dtype="<f4"),
        versions=np.array([3, 3, 3, 4], dtype="<i4"),
        reward=1.0,
        source_server="rollout-0",
        data_source="gsm8k",
        agent_type="tool",
        termination="answered",
        num_turns=2,
        reward_extras={"correct": True, "score": 0.75, "judge": "exact"},
        timings={"generate_s": 1.5},
    )
    t2 = Trajectory(
        trajectory_id="traj-0002",
        group_uid="group-01",
        prompt_ids=np.array([1, 2], dtype="<i4"),
        response_ids=np.array([20, 21], dtype="<i4"),
        response_mask=np.array([1, 1], dtype="u1"),
        rollout_logprobs=np.array([-2.0, -0.125], dtype="<f4"),
        versions=np.array([4, 4], dtype="<i4"),
        reward=-0.5,
        snapshot_index=1,
        is_snapshot=True,
        termination="length",
    )
    return [t1, t2]


def messages() -> dict[str, Any]:
    announce, chunks = plan_transfer(7, weight_tensors(), chunk_bytes=20, transfer_id=TRANSFER_ID)
    assert len(chunks[0].parts) == 2  # the first chunk spans both tensors
    return {
        "hello": hello(),
        "welcome": Welcome(
            [1, 0],
            "learner",
            "session-0001",
            4,
            7,
            3,
            1.0,
            10.0,
            Limits(256 << 20, 4096, 1 << 20),
            [],
        ),
        "trajectory_batch": TrajectoryBatch(42, trajectories()),
        "ack": Ack([41, 42], 2, [41]),
        "weights_announce": announce,
        "weights_chunk": chunks[0],
        "weights_applied": WeightsApplied(7, TRANSFER_ID, True, "", 0.25),
        "heartbeat": Heartbeat(1234.5, 7),
        "error": Error(
            int(ErrorCode.INVALID_FIELD),
            "trajectories[1].rollout_logprobs[0]: logprobs must be finite and <= 0",
            False,
            "trajectories[1].rollout_logprobs[0]",
            int(MsgType.TRAJECTORY_BATCH),
            42,
        ),
        "bye": Bye("rollout server shutting down"),
        "validate_request": ValidateRequest("step2-0a1b2c", 7, 600.0),
        "validate_result": ValidateResult(
            "step2-0a1b2c",
            7,
            True,
            "",
            [
                SourceMetrics(
                    "arithmetic",
                    4,
                    1.5,
                    0.375,
                    21.25,
                    1.5,
                    {"answered": 3, "length": 1},
                    {"correct": 0.25},
                    {"correct": 4},
                ),
                SourceMetrics("gsm8k", 0, 0.0, 0.0),
            ],
            0,
            2,
            3,
            12.5,
        ),
        "admit": Admit(8, 7),
        "heartbeat_dropped": Heartbeat(1234.5, 7, 4096),
    }


def on_wire(frames: list[Any]) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in frames]


def newer_minor_hello() -> list[bytes]:
    """HELLO from a hypothetical 1.7 peer: a higher minor and one appended field (and one appended
    nested field), which a 1.0 decoder must ignore."""
    h = to_wire(hello())
    h["protocol_version"] = [1, 7]
    h["model"]["quantization"] = "fp8"
    h["max_inflight_batches"] = 8
    return [bytes((MsgType.HELLO,)), msgpack.packb(h, use_bin_type=True)]


def build() -> dict[str, list[bytes]]:
    msgs = messages()
    vectors = {name: on_wire(codec.encode(msg)) for name, msg in msgs.items()}
    vectors["hello_newer_minor"] = newer_minor_hello()
    # 1.5: the same batch with its per-trajectory numbers as frames; ``trajectory_batch`` stays the
    # 1.3/1.4 form, which every receiver still decodes.
    vectors["trajectory_batch_numbers"] = on_wire(
        codec.encode(msgs["trajectory_batch"], number_frames=True)
    )
    return vectors


def container(frames: list[bytes]) -> bytes:
    return msgpack.packb(frames, use_bin_type=True)


def manifest(vectors: dict[str, list[bytes]]) -> str:
    files = {
        f"{name}.bin": {
            "type": codec.peek_type(frames).name,
            "frames": len(frames),
            "sha256": hashlib.sha256(container(frames)).hexdigest(),
        }
        for name, frames in sorted(vectors.items())
    }
    doc = {
        "format": "msgpack array of bin frames: [type byte, msgpack header, *payload]",
        "files": files,
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def write(out: Path = HERE) -> None:
    vectors = build()
    for name, frames in vectors.items():
        (out / f"{name}.bin").write_bytes(container(frames))
    (out / "manifest.json").write_text(manifest(vectors))


def differences(out: Path = HERE) -> list[str]:
    vectors = build()
    bad = [
        f"{n}.bin"
        for n, f in vectors.items()
        if not (out / f"{n}.bin").is_file() or (out / f"{n}.bin").read_bytes() != container(f)
    ]
    if not (out / "manifest.json").is_file() or (out / "manifest.json").read_text() != manifest(
        vectors
    ):
        bad.append("manifest.json")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="compare instead of writing; exit 1 on a difference"
    )
    args = ap.parse_args()
    if args.check:
        bad = differences()
        print("golden vectors up to date" if not bad else f"differ: {', '.join(bad)}")
        sys.exit(1 if bad else 0)
    write()
    print(f"wrote {len(build())} vectors and manifest.json to {HERE}")


if __name__ == "__main__":
    main()
