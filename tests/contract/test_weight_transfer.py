"""The weight-transfer contract: the bucket plan both ends cut the stream with, and the bodies' checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rawmm.contract.weight_transfer import TransferInit, TransferUpdate, plan_buckets


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
