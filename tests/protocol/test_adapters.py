"""An adapter-only (LoRA) weight update is told by its names and checked against the receiver's
model before anything is allocated (`protocol.adapters`, SPEC §8): pairs of one rank within what
the receiver serves, shapes that fit the module, floating dtypes; a receiver that serves no
adapters says so."""

from __future__ import annotations

import pytest

from protocol.adapters import adapter_name, adapter_parts, adapter_rank, is_adapter_update
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import TensorSpec, WeightsAnnounce
from protocol.weights import ModelManifest, WeightAssembler

Q, V = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
BASE = {
    f"{Q}.weight": ("bfloat16", (64, 32)),
    f"{V}.weight": ("bfloat16", (16, 32)),
    "model.norm.weight": ("bfloat16", (32,)),
}


def spec(name: str, shape: tuple[int, ...], dtype: str = "float32") -> TensorSpec:
    size = 2 if dtype == "bfloat16" else 4
    n = 1
    for d in shape:
        n *= d
    return TensorSpec(name, dtype, list(shape), n * size, 0)


def adapter(rank: int = 4, dtype: str = "float32") -> list[TensorSpec]:
    return [
        spec(adapter_name(Q, "A"), (rank, 32), dtype),
        spec(adapter_name(Q, "B"), (64, rank), dtype),
        spec(adapter_name(V, "A"), (rank, 32), dtype),
        spec(adapter_name(V, "B"), (16, rank), dtype),
    ]


def problems(specs: list[TensorSpec], max_rank: int = 8) -> list[str]:
    return [p for _, p in ModelManifest(BASE, lora_max_rank=max_rank).problems(specs)]


def test_names_tell_an_adapter_apart_from_full_weights() -> None:
    assert adapter_parts(adapter_name(Q, "A")) == (Q, "A")
    assert adapter_parts(f"{Q}.weight") is None
    assert adapter_parts("base_model.model..lora_A.weight") is None  # no module
    assert is_adapter_update([s.name for s in adapter()])
    assert not is_adapter_update(list(BASE))
    assert adapter_rank({s.name: s.shape for s in adapter(rank=4)}) == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_adapter_that_fits_passes(dtype: str) -> None:
    assert problems(adapter(dtype=dtype)) == []
    assert problems(adapter()[:2]) == []  # only some linears targeted


@pytest.mark.parametrize(
    ("specs", "want"),
    [
        (adapter(rank=16), "rank 16, this server serves up to 8"),
        (adapter()[1:], "lora_A is missing"),
        (
            [*adapter()[:1], spec(adapter_name(Q, "B"), (64, 2))],
            "do not fit its weight [64, 32]",
        ),
        ([spec(adapter_name(Q, "A"), (4, 33)), adapter()[1]], "do not fit"),
        (
            [
                spec(adapter_name("model.norm", "A"), (4, 32)),
                spec(adapter_name("model.norm", "B"), (32, 4)),
            ],
            "model.norm is not a linear layer",
        ),
        ([*adapter(), adapter()[0]], "announced twice"),
        ([*adapter(), spec(f"{Q}.weight", (64, 32))], "is not a LoRA adapter tensor"),
        ([spec(adapter_name(Q, "A"), (4, 32), "int8"), adapter()[1]], "is not floating"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_naming_why(
    specs: list[TensorSpec], want: str
) -> None:
    got = problems(specs)
    assert any(want in p for p in got), got


def test_a_receiver_that_serves_no_adapters_says_how_to_fix_it() -> None:
    assembler = WeightAssembler(manifest=ModelManifest(BASE))
    announce = WeightsAnnounce(3, "t", adapter(), num_chunks=1)
    with pytest.raises(ProtocolError) as e:
        assembler.announce(announce, now=0.0)
    assert e.value.code == ErrorCode.INVALID_FIELD and e.value.field == "tensors"
    assert "does not serve adapters" in str(e.value) and "lora_rank > 0" in str(e.value)


def test_an_adapter_is_received_in_chunks_like_full_weights() -> None:
    assembler = WeightAssembler(manifest=ModelManifest(BASE, lora_max_rank=8))
    announce = WeightsAnnounce(3, "t", adapter(), num_chunks=1)
    assert assembler.announce(announce, now=0.0) is None  # waits for its chunk
    assert assembler.in_progress == announce
