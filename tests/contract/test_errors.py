import pickle

import pytest

from rawmm.contract import REASONS, InvalidImageRef


def test_every_design_reason_is_exported_once() -> None:
    assert len(set(REASONS)) == len(REASONS) == 13
    assert {"malformed_ref", "outside_offload_root", "fingerprint_mismatch", "count_mismatch"} <= set(REASONS)


def test_invalid_image_ref_keeps_reason_and_message_through_pickle() -> None:
    error = InvalidImageRef("hash_mismatch", "bytes differ")
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.reason, clone.message) == ("hash_mismatch", "bytes differ")
    assert isinstance(clone, ValueError)


def test_unknown_reason_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown InvalidImageRef reason"):
        InvalidImageRef("oops", "x")
