"""WeightsGuard: closed unless a token and a weights root are configured; the token in constant time; paths
confined to the root after resolving symlinks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rawmm.contract.weights_token import WEIGHTS_TOKEN_ENV, auth_headers, new_token
from rawmm.serving.guard import WEIGHTS_DISABLED, WeightsGuard, WeightsRefused


def refusal(call, *args) -> tuple[int, str]:
    with pytest.raises(WeightsRefused) as info:
        call(*args)
    return info.value.status, info.value.reason


def test_without_a_token_or_a_root_every_request_is_refused(tmp_path: Path) -> None:
    for guard in (
        WEIGHTS_DISABLED,
        WeightsGuard(token=None, root=tmp_path),
        WeightsGuard(token="t", root=None),
    ):
        assert refusal(guard.authorize, "Bearer t") == (403, "weights_disabled")


def test_the_token_must_be_sent_as_a_bearer_header(tmp_path: Path) -> None:
    guard = WeightsGuard(token="s3cret", root=tmp_path)
    guard.authorize("Bearer s3cret")
    guard.authorize("bearer s3cret ")
    assert refusal(guard.authorize, None) == (403, "missing_token")
    assert refusal(guard.authorize, "s3cret") == (403, "missing_token")
    for wrong in ("Bearer s3cre", "Bearer s3cret2", "Bearer ", "Bearer \udcff"):
        assert refusal(guard.authorize, wrong) == (403, "invalid_token")


def test_paths_are_confined_to_the_root_after_resolving_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "checkpoints", tmp_path / "elsewhere"
    (root / "step_1").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "inner").symlink_to(root / "step_1", target_is_directory=True)
    guard = WeightsGuard.from_env(root)
    assert guard.confine(str(root / "step_1")) == (root / "step_1").resolve()
    assert guard.confine(str(root / "inner")) == (root / "step_1").resolve()
    for escape in (outside, root / "link", root / ".." / "elsewhere", tmp_path / "checkpoints-evil"):
        assert refusal(guard.confine, str(escape)) == (403, "outside_weights_root")
    for bad in ("step_1", f"{root}/\ud800", f"{root}/{'a' * 300}", f"{root}/x\x00", "/a" * 3000):
        assert refusal(guard.confine, bad) == (400, "malformed_path")


def test_the_token_travels_in_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(WEIGHTS_TOKEN_ENV, raising=False)
    assert auth_headers() == {} and WeightsGuard.from_env(tmp_path).token is None
    token = new_token()
    assert len(token) >= 40 and token != new_token()
    monkeypatch.setenv(WEIGHTS_TOKEN_ENV, token)
    assert auth_headers() == {"Authorization": f"Bearer {token}"}
    WeightsGuard.from_env(tmp_path).authorize(auth_headers()["Authorization"])
