from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from rawmm.contract.shared_dir import LATEST, TRAIN_STATE, checkpoint_dir, latest_step, train_state_dir
from rawmm.rl.trainer.checkpoint import save_checkpoint
from rawmm.rl.trainer.train_state import MissingTrainState, load_train_state


@pytest.fixture
def base(tiny_qwen2_vl: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint plus a weights index and a chat template, as a hub release has them."""
    base = tmp_path / "base"
    base.mkdir()
    for source in tiny_qwen2_vl.iterdir():
        (base / source.name).write_bytes(source.read_bytes())
    (base / "model.safetensors.index.json").write_text("{}")
    (base / "chat_template.jinja").write_text("{{ messages }}")
    return base


def trained(base: Path, scale: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The base model after one AdamW step on `scale * sum(params)`: moments and weights differ from 0."""
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (scale * sum(p.sum() for p in model.parameters())).backward()
    optimizer.step()
    return model, optimizer


def test_no_checkpoint_means_step_zero(tmp_path):
    assert latest_step(tmp_path / "checkpoints") == 0


def test_save_writes_a_complete_dir_then_latest(base, tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = trained(base, 1.0)
    saved = save_checkpoint(model, optimizer, base, root, 1, is_main=True)
    assert saved == checkpoint_dir(root, 1) == root / "step_1"
    names = {p.name for p in saved.iterdir()}
    assert {"chat_template.jinja", "tokenizer.json", "config.json", "model.safetensors", TRAIN_STATE} <= names
    assert "model.safetensors.index.json" not in names  # the base's weights files are not copied
    assert (saved / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    before, after = load_file(base / "model.safetensors"), load_file(saved / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    assert latest_step(root) == 1 and (root / LATEST).read_text() == "1\n"
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []


def test_train_state_restores_weights_optimizer_and_step(base, tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = trained(base, 1.0)
    save_checkpoint(model, optimizer, base, root, 3, is_main=True)
    fresh, fresh_optimizer = trained(base, -2.0)  # other weights, other moments
    assert load_train_state(fresh, fresh_optimizer, train_state_dir(root, 3)) == 3
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
    want, got = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert want.keys() == got.keys()
    for index, state in want.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[index][key], state[key]), (index, key)


def test_only_the_newest_checkpoint_keeps_the_train_state(base, tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = trained(base, 1.0)
    save_checkpoint(model, optimizer, base, root, 1, is_main=True)
    save_checkpoint(model, optimizer, base, root, 2, is_main=True)
    assert train_state_dir(root, 2).is_dir() and not train_state_dir(root, 1).exists()
    assert (checkpoint_dir(root, 1) / "model.safetensors").is_file()  # the engines' weights stay
    with pytest.raises(MissingTrainState, match="no trainer state"):
        load_train_state(model, optimizer, train_state_dir(root, 1))


def test_leftover_staging_and_rerun_step_are_replaced(base, tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = trained(base, 1.0)
    save_checkpoint(model, optimizer, base, root, 2, is_main=True)
    (root / "step_2" / "stale").write_text("from the first try")
    (root / "step_3.tmp").mkdir()
    (root / "step_3.tmp" / "partial").write_text("crashed mid-write")
    save_checkpoint(model, optimizer, base, root, 2, is_main=True)
    save_checkpoint(model, optimizer, base, root, 3, is_main=True)
    assert not (root / "step_2" / "stale").exists()
    assert not (root / "step_3" / "partial").exists() and not (root / "step_3.tmp").exists()
    assert latest_step(root) == 3


def test_garbage_latest_is_an_error(tmp_path):
    (tmp_path / LATEST).write_text("step three")
    with pytest.raises(ValueError, match="should hold a step number"):
        latest_step(tmp_path)


def test_gathered_tied_weights_are_written_once_as_for_an_unsharded_model(tiny_qwen2_vl, tmp_path):
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from rawmm.rl.trainer.checkpoint import _share_tied

    config = AutoConfig.from_pretrained(tiny_qwen2_vl)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = True
    model = Qwen2VLForConditionalGeneration(config)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    model.save_pretrained(tmp_path / "unsharded")
    # A full-state-dict gather returns one tensor per name, tied or not.
    gathered = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.save_pretrained(tmp_path / "gathered", state_dict=_share_tied(model, gathered))
    want = load_file(tmp_path / "unsharded" / "model.safetensors")
    got = load_file(tmp_path / "gathered" / "model.safetensors")
    assert got.keys() == want.keys() and "lm_head.weight" not in got
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
