from pathlib import Path

import pytest

from rawmm.rl.trainer.checkpoint import LATEST, checkpoint_dir, latest_step, save_checkpoint


class FakeModel:
    def __init__(self, weights: bytes) -> None:
        self.weights = weights

    def save_pretrained(self, path: Path, safe_serialization: bool) -> None:
        assert safe_serialization
        (path / "model.safetensors").write_bytes(self.weights)
        (path / "config.json").write_text('{"trained": true}')


@pytest.fixture
def base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"base weights")
    (base / "model.safetensors.index.json").write_text("{}")
    (base / "config.json").write_text('{"trained": false}')
    (base / "tokenizer.json").write_text('{"tok": 1}')
    (base / "chat_template.jinja").write_text("{{ messages }}")
    return base


def test_no_checkpoint_means_step_zero(tmp_path):
    assert latest_step(tmp_path / "checkpoints") == 0


def test_save_writes_a_complete_dir_then_latest(base, tmp_path):
    root = tmp_path / "checkpoints"
    saved = save_checkpoint(FakeModel(b"step 1"), base, root, 1)
    assert saved == checkpoint_dir(root, 1) == root / "step_1"
    assert sorted(p.name for p in saved.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (saved / "model.safetensors").read_bytes() == b"step 1"  # trained, not the base weights
    assert (saved / "config.json").read_text() == '{"trained": true}'
    assert (saved / "tokenizer.json").read_text() == '{"tok": 1}'
    assert latest_step(root) == 1 and (root / LATEST).read_text() == "1\n"
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []


def test_leftover_staging_and_rerun_step_are_replaced(base, tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(FakeModel(b"first try"), base, root, 2)
    (root / "step_3.tmp").mkdir()
    (root / "step_3.tmp" / "partial").write_text("crashed mid-write")
    save_checkpoint(FakeModel(b"second try"), base, root, 2)
    save_checkpoint(FakeModel(b"three"), base, root, 3)
    assert (root / "step_2" / "model.safetensors").read_bytes() == b"second try"
    assert not (root / "step_3" / "partial").exists() and not (root / "step_3.tmp").exists()
    assert latest_step(root) == 3


def test_garbage_latest_is_an_error(tmp_path):
    (tmp_path / LATEST).write_text("step three")
    with pytest.raises(ValueError, match="should hold a step number"):
        latest_step(tmp_path)
