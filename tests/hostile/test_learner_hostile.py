"""A real bin/learner under hostile peers (issue 16): bounded memory, typed refusals, a quiet log.

One learner (intake, tiny model, configs/default.yaml: max_model_len 768, response budget 256) serves
the whole module; each test measures its RSS growth (/proc VmRSS, sampled while the attack runs)
and ends with a fresh valid rollout server handshaking and getting a batch acknowledged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from hostile_testkit import (
    LearnerProcess,
    MiB,
    Peer,
    RssWatch,
    serves_a_valid_peer,
    trajectory,
)

from protocol.errors import ErrorCode
from protocol.messages import Ack, Error, MsgType
from protocol.zmq_auth import use_token

pytestmark = pytest.mark.integration
RSS_BOUND = 300 * MiB


@pytest.fixture(scope="module")
def learner(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LearnerProcess]:
    tmp = tmp_path_factory.mktemp("hostile")
    lp = LearnerProcess(tiny_model, tmp / "run")
    try:
        yield lp
    finally:
        lp.stop()


def test_two_gigabytes_in_one_message_before_hello(learner: LearnerProcess) -> None:
    """16 frames of 128 MiB (one reused buffer, zero-copy: the sender allocates 128 MiB once),
    no HELLO, from a peer that holds the token (one without never gets a message in:
    test_learner_auth). libzmq refuses the first frame by its announced size (MAXMSGSIZE is the
    largest frame a valid message of this run has) and drops the connection before buffering it."""
    watch = RssWatch(learner)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)
    use_token(dealer, learner.token)
    dealer.connect(learner.address)
    buf = memoryview(bytearray(128 * MiB))
    try:
        dealer.send_multipart([bytes((MsgType.HELLO,)), *[buf] * 16], copy=False)
        growth = watch.sample_for(6.0)
    finally:
        dealer.close(linger=0)
    assert growth < RSS_BOUND, f"RSS grew by {growth / MiB:.0f} MiB"
    serves_a_valid_peer(learner, "after-2gb")
    assert watch.sample() < RSS_BOUND
    print(f"\n2 GiB before HELLO: learner RSS +{watch.growth / MiB:.1f} MiB (peak)")


def test_million_token_trajectory_is_refused_and_training_goes_on(learner: LearnerProcess) -> None:
    """After a valid HELLO: a trajectory of 1,048,576 tokens (within every protocol limit, 1365x
    max_model_len) and one whose response is over the response budget get typed TOO_LARGE naming
    the field and the limit, refer to their batch (the sender drops it), take no credit and are
    never acknowledged; the same peer's next batch and a fresh peer's are."""
    watch = RssWatch(learner)
    p = Peer(learner, "long-trajectories")
    try:
        welcome = p.handshake()
        credits = welcome.credits
        answer = p.send_batch([trajectory(8, 16), trajectory((1 << 20) - 200, 200)])
        watch.sample()
        assert isinstance(answer, Error), answer
        assert answer.code == ErrorCode.TOO_LARGE
        assert answer.field == "trajectories[1].prompt_len+response_len"
        assert "768" in answer.message and "max_model_len" in answer.message, answer.message

        answer = p.send_batch([trajectory(8, 257)])
        assert isinstance(answer, Error) and answer.code == ErrorCode.TOO_LARGE, answer
        assert answer.field == "trajectories[0].response_len" and "256" in answer.message, answer

        assert p.conn.credits == credits, "a refused batch cost a credit"
        answer = p.send_batch([trajectory(500, 256)])  # exactly at both limits
        assert isinstance(answer, Ack), answer
    finally:
        p.close()
    serves_a_valid_peer(learner, "after-long")
    assert watch.sample() < RSS_BOUND, f"RSS grew by {watch.growth / MiB:.0f} MiB"


def test_flood_of_invalid_frames_writes_little_log(learner: LearnerProcess) -> None:
    """20,000 invalid messages, before and after a HELLO, write < 10 bytes of log each (200 kB);
    the suppressed ones are summed up in a line, counted in intake_stats.json. Runs last: it stops
    the learner."""
    watch = RssWatch(learner)
    log0 = learner.log_bytes
    junk = [
        [b"\x63", b"\x80"],  # unknown type
        [bytes((MsgType.HEARTBEAT,)), b"\xc1"],  # header not msgpack
        [bytes((MsgType.HEARTBEAT,)), msgpack.packb({"time": "x"})],  # invalid field
        [bytes((MsgType.TRAJECTORY_BATCH,))],  # one frame
    ]
    n = 20_000
    for peer in ("before HELLO", "after HELLO"):
        p = Peer(learner, "flooder")
        if peer == "after HELLO":
            p.handshake()
        for i in range(n // 2):
            p.sock.send_multipart(junk[i % len(junk)])
            if i % 1000 == 0:
                while p.sock.poll(0):
                    p.sock.recv_multipart()  # the ERRORs answered meanwhile
                watch.sample()
        # The probe goes through the same pipe: once answered, every junk message was handled.
        p.sock.send_multipart([bytes((MsgType.HEARTBEAT,)), msgpack.packb({"time": "probe"})])
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the learner did not answer the probe"
            if p.sock.poll(1000) and b"probe" in b"".join(p.sock.recv_multipart()):
                break
        p.close()
        watch.sample()
    grown = learner.log_bytes - log0
    serves_a_valid_peer(learner, "after-flood")
    assert watch.sample() < RSS_BOUND, f"RSS grew by {watch.growth / MiB:.0f} MiB"
    assert grown < 10 * n, f"{grown} bytes of log for {n} invalid messages"
    print(
        f"\n{n} invalid messages: {grown} bytes of log, learner RSS +{watch.growth / MiB:.1f} MiB"
    )

    assert learner.stop() == 0
    text = learner.log.read_text()
    assert "suppressed" in text
    stats = json.loads((learner.run_dir / "intake_stats.json").read_text())
    assert stats["violations"] >= n and stats["violations_log_suppressed"] >= n - 100, stats
    assert stats["violations_too_large"] >= 2, stats
