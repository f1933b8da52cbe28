"""Golden vectors (tests/protocol/vectors): each decodes to the expected values, re-encodes to the
same frames byte for byte, matches the manifest, and the generator reproduces the committed files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import msgpack
import numpy as np
import pytest
import xxhash

from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import ChunkPart, Hello, Limits, MsgType, TensorSpec
from protocol.weights import WeightAssembler

VECTORS = Path(__file__).resolve().parent / "vectors"
MANIFEST = json.loads((VECTORS / "manifest.json").read_text())
NAMES = sorted(n.removesuffix(".bin") for n in MANIFEST["files"])


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "protocol_golden_vectors_generate", VECTORS / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(name: str) -> list[bytes]:
    frames = msgpack.unpackb((VECTORS / f"{name}.bin").read_bytes(), raw=False)
    assert isinstance(frames, list) and all(isinstance(f, bytes) for f in frames)
    return frames


def reencode(frames: list[bytes]) -> list[bytes]:
    """Decoded and encoded again, in the batch form the frames have (1.5: 13 frames)."""
    numbers = codec.peek_type(frames) is MsgType.TRAJECTORY_BATCH and len(frames) == 13
    return [
        bytes(memoryview(f).cast("B"))
        for f in codec.encode(codec.decode(frames), number_frames=numbers)
    ]


def test_every_message_type_has_a_vector() -> None:
    types = {MANIFEST["files"][f"{n}.bin"]["type"] for n in NAMES}
    assert types == {t.name for t in MsgType}
    on_disk = {p.name for p in VECTORS.glob("*.bin")}
    assert on_disk == set(MANIFEST["files"])


@pytest.mark.parametrize("name", NAMES)
def test_vector_matches_manifest(name: str) -> None:
    entry = MANIFEST["files"][f"{name}.bin"]
    assert hashlib.sha256((VECTORS / f"{name}.bin").read_bytes()).hexdigest() == entry["sha256"]
    frames = load(name)
    assert len(frames) == entry["frames"] and codec.peek_type(frames).name == entry["type"]


@pytest.mark.parametrize("name", [n for n in NAMES if n != "hello_newer_minor"])
def test_vector_reencodes_byte_for_byte(name: str) -> None:
    frames = load(name)
    assert reencode(frames) == frames


def test_generator_reproduces_the_committed_files() -> None:
    gen = _generator()
    assert gen.differences(VECTORS) == []
    assert {f"{n}.bin" for n in gen.build()} == set(MANIFEST["files"])


# -- field values -------------------------------------------------------------------------------------
def test_hello() -> None:
    h = codec.decode(load("hello"))
    assert isinstance(h, Hello)
    assert (h.protocol_version, h.peer_id, h.role, h.epoch, h.policy_version, h.capabilities) == (
        [1, 0],
        "rollout-0",
        "rollout-server",
        "epoch-0001",
        3,
        ["weights-v1"],
    )
    assert (h.model.name, h.model.sha256, h.model.vocab_size) == ("tiny-model", "1" * 64, 512)
    assert (h.tokenizer.name, h.tokenizer.sha256) == ("tiny-tokenizer", "2" * 64)


def test_hello_from_a_newer_minor_version() -> None:
    frames = load("hello_newer_minor")
    raw = msgpack.unpackb(frames[1])
    # the vector has them
    assert raw["max_inflight_batches"] == 8 and raw["model"]["quantization"] == "fp8"
    h = codec.decode(frames)
    assert (
        h.protocol_version == [1, 7] and h.peer_id == "rollout-0" and h.model.name == "tiny-model"
    )
    # re-encoding drops what this version does not know, and is otherwise the 1.0 HELLO
    again = reencode(frames)
    assert again[1] == load("hello")[1].replace(msgpack.packb([1, 0]), msgpack.packb([1, 7]), 1)


def test_welcome() -> None:
    w = codec.decode(load("welcome"))
    assert (w.peer_id, w.session_id, w.credits, w.policy_version, w.next_seq) == (
        "learner",
        "session-0001",
        4,
        7,
        3,
    )
    assert (w.heartbeat_interval_s, w.heartbeat_timeout_s) == (1.0, 10.0)
    assert w.limits == Limits(256 << 20, 4096, 1 << 20)


def test_trajectory_batch_with_two_trajectories() -> None:
    frames = load("trajectory_batch")
    b = codec.decode(frames)
    assert b.seq == 42 and [t.trajectory_id for t in b.trajectories] == ["traj-0001", "traj-0002"]
    t1, t2 = b.trajectories
    assert t1.prompt_ids.tolist() == [1, 2, 3] and t1.response_ids.tolist() == [10, 11, 12, 13]
    assert t1.response_mask.tolist() == [1, 1, 0, 1] and t1.versions.tolist() == [3, 3, 3, 4]
    assert t1.rollout_logprobs.tolist() == [-0.5, -0.25, 0.0, -1.5]
    assert (
        t1.reward,
        t1.termination,
        t1.num_turns,
        t1.source_server,
        t1.data_source,
        t1.agent_type,
    ) == (1.0, "answered", 2, "rollout-0", "gsm8k", "tool")
    assert t1.reward_extras == {
        "correct": True,
        "score": 0.75,
        "judge": "exact",
    } and t1.timings == {"generate_s": 1.5}
    assert t2.prompt_ids.tolist() == [1, 2] and t2.rollout_logprobs.tolist() == [-2.0, -0.125]
    assert (t2.reward, t2.is_snapshot, t2.snapshot_index, t2.termination) == (
        -0.5,
        True,
        1,
        "length",
    )
    # column frames: little-endian raw bytes, the batch's trajectories concatenated
    assert frames[2] == np.array([1, 2, 3, 1, 2], "<i4").tobytes()
    assert frames[4] == bytes([1, 1, 0, 1, 1, 1])
    assert frames[5] == np.array([-0.5, -0.25, 0.0, -1.5, -2.0, -0.125], "<f4").tobytes()


def test_trajectory_batch_with_number_frames() -> None:
    """The 1.5 form of the same batch: same token frames, then one frame per number column."""
    old, new = load("trajectory_batch"), load("trajectory_batch_numbers")
    assert new[2:7] == old[2:7] and len(new) == 13
    a, b = codec.decode(old), codec.decode(new)
    assert a.seq == b.seq and a.trajectories.meta == b.trajectories.meta
    assert new[7] == np.array([1.0, -0.5], "<f8").tobytes()  # reward
    assert new[8] == np.array([0, 1], "<i4").tobytes()  # snapshot_index
    assert new[9] == bytes([0, 1])  # is_snapshot
    assert new[10] == np.array([2, 1], "<i4").tobytes()  # num_turns
    assert new[11] == np.array([3, 2], "<i4").tobytes()  # prompt_len
    assert new[12] == np.array([4, 2], "<i4").tobytes()  # response_len
    assert codec.header_form(new) == old  # what a sender sends a 1.4 learner


def test_ack() -> None:
    a = codec.decode(load("ack"))
    assert (a.seqs, a.credits, a.duplicates) == ([41, 42], 2, [41])


def test_weights_announce_and_multi_part_chunk() -> None:
    ann = codec.decode(load("weights_announce"))
    assert (ann.version, ann.transfer_id, ann.num_chunks, ann.checksum_algo) == (
        7,
        "0123456789abcdef0123456789abcdef",
        2,
        "xxh3_64",
    )
    a = np.array([0.5, -1.0, 2.0], "<f4").tobytes()
    b = np.array([[1, -2], [3, -4]], "<i4").tobytes()
    assert ann.tensors == [
        TensorSpec("layer0.bias", "float32", [3], 12, xxhash.xxh3_64_intdigest(a)),
        TensorSpec("layer1.index", "int32", [2, 2], 16, xxhash.xxh3_64_intdigest(b)),
    ]
    frames = load("weights_chunk")
    chunk = codec.decode(frames)
    assert (chunk.transfer_id, chunk.version, chunk.index) == (ann.transfer_id, 7, 0)
    assert chunk.parts == [ChunkPart(0, 0, 12), ChunkPart(1, 0, 8)]  # spans both tensors
    assert frames[2:] == [a, b[:8]]
    asm = WeightAssembler()
    # chunk 1 of 2 is not in the vectors
    assert asm.announce(ann) is None and asm.chunk(chunk) is None
    assert asm.in_progress == ann


def test_weights_applied_heartbeat_bye() -> None:
    w = codec.decode(load("weights_applied"))
    assert (w.version, w.transfer_id, w.ok, w.error, w.apply_time_s) == (
        7,
        "0123456789abcdef0123456789abcdef",
        True,
        "",
        0.25,
    )
    hb = codec.decode(load("heartbeat"))
    assert (hb.time, hb.policy_version) == (1234.5, 7)
    assert codec.decode(load("bye")).reason == "rollout server shutting down"


def test_error() -> None:
    e = codec.decode(load("error"))
    assert (e.code, e.fatal, e.field, e.ref_type, e.ref_seq) == (
        ErrorCode.INVALID_FIELD,
        False,
        "trajectories[1].rollout_logprobs[0]",
        MsgType.TRAJECTORY_BATCH,
        42,
    )
    assert e.message.startswith("trajectories[1].rollout_logprobs[0]")
