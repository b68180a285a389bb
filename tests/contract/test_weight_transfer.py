"""The weight-transfer contract: the bucket plan both ends cut the stream with, and the bodies' checks."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rawmm.contract.weight_transfer import (
    ITEMSIZE,
    TransferInit,
    TransferUpdate,
    dtype_name,
    loads_into,
    plan_buckets,
    served_dtype_of,
    wire_dtype,
)


def test_a_torch_dtype_is_named_as_the_wire_names_it() -> None:
    """Every wire name is some torch dtype's name: what the trainer sends, a replica answers and reads."""
    for name in ITEMSIZE:
        assert dtype_name(getattr(torch, name)) == name
        assert torch.empty(0, dtype=getattr(torch, name)).element_size() == ITEMSIZE[name]


def test_buckets_fill_past_the_limit_and_keep_every_tensor_once_in_order() -> None:
    assert plan_buckets([4, 4, 4, 4, 4], 8) == [[0, 1, 2], [3, 4]]
    assert plan_buckets([100, 1, 1], 8) == [[0], [1, 2]]  # a tensor larger than a bucket goes alone
    assert plan_buckets([1, 1], 8) == [[0, 1]]
    sizes = [3, 17, 5, 0, 9, 12, 1]
    flat = [i for bucket in plan_buckets(sizes, 10) for i in bucket]
    assert flat == list(range(len(sizes)))


def test_update_info_sizes_are_wire_bytes() -> None:
    update = TransferUpdate(names=["a", "b"], dtype_names=["float32", "bfloat16"], shapes=[[2, 3], []])
    assert update.sizes() == [24, 2]


@pytest.mark.parametrize(
    "fields",
    [
        {"names": ["a"], "dtype_names": [], "shapes": [[1]]},
        {"names": ["a"], "dtype_names": ["complex64"], "shapes": [[1]]},
        {"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]},
    ],
)
def test_malformed_update_info_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TransferUpdate.model_validate(fields)


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValidationError):
        TransferInit(master_address="127.0.0.1", master_port=1234, rank_offset=2, world_size=2)


def test_floating_tensors_travel_in_the_replicas_narrower_dtype_and_nothing_else_changes() -> None:
    assert wire_dtype("float32", ["bfloat16", "bfloat16"]) == "bfloat16"
    assert wire_dtype("float32", ["float32"]) == "float32"
    assert wire_dtype("bfloat16", ["float32"]) == "bfloat16"  # never widened
    assert wire_dtype("float32", ["bfloat16", "float32"]) == "float32"  # replicas that differ: as held
    assert wire_dtype("float32", ["float16"]) == "float16"
    assert wire_dtype("int64", ["bfloat16"]) == "int64"  # only floating tensors are narrowed
    assert wire_dtype("float32", []) == "float32"  # a non-sending rank knows no replica


def test_a_floating_tensor_loads_into_any_floating_one_and_others_only_into_their_own() -> None:
    assert loads_into("bfloat16", "float32") and loads_into("float32", "bfloat16")
    assert loads_into("int64", "int64")
    assert not loads_into("int64", "float32") and not loads_into("float32", "int32")


def test_a_replica_answers_the_widest_floating_dtype_it_keeps() -> None:
    assert served_dtype_of(["bfloat16", "bfloat16", "int64"]) == "bfloat16"
    assert served_dtype_of(["bfloat16", "float32"]) == "float32"  # vLLM-CPU in bf16: float32 biases
    assert served_dtype_of(["bfloat16", "float16"]) == "float32"  # neither holds the other
    assert served_dtype_of(["float64", "float32"]) == "float64"
    assert served_dtype_of([]) == "float32"
