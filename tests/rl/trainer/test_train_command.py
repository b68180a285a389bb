"""`rawmm train CONFIG` as a user runs it: clear one-line errors, one JSON line per step."""

from __future__ import annotations

import json

import yaml

from rawmm.cli import main
from rawmm.contract.shared_dir import latest_step


def write_config(path, config) -> str:  # noqa: ANN001
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return str(path)


def test_train_command_runs_steps_and_prints_json_lines(rollouts, tmp_path, capsys):
    rollouts.write(1, rollouts.standard_batch())
    config = write_config(tmp_path / "run.yaml", rollouts.config)
    assert main(["train", config, "--steps", "1", "--batch-timeout", "10"]) == 0
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["event"] == "trainer_step" and line["step"] == 1 and line["images_materialized"] == 4
    assert latest_step(rollouts.config.checkpoints_dir) == 1


def test_missing_batch_is_a_clear_error(rollouts, tmp_path, capsys):
    config = write_config(tmp_path / "run.yaml", rollouts.config)
    assert main(["train", config, "--steps", "1", "--batch-timeout", "0.1"]) == 2
    assert "no rollout batch for step 1" in capsys.readouterr().err


def test_the_batch_wait_defaults_to_the_run_configs_deadline(rollouts, tmp_path, capsys):
    trainer = rollouts.config.trainer.model_copy(update={"batch_timeout_seconds": 1})
    config = write_config(tmp_path / "run.yaml", rollouts.config.model_copy(update={"trainer": trainer}))
    assert main(["train", config, "--steps", "1"]) == 2
    assert "no rollout batch for step 1" in (err := capsys.readouterr().err) and "after 1s" in err


def test_bad_config_fails_before_anything_starts(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: /nowhere, preset: qwen2_vl}\nshared_dir: /tmp/x\ntrainer: {stepz: 3}\n")
    assert main(["train", str(bad)]) == 2
    assert "trainer.stepz" in capsys.readouterr().err


def test_seq_len_must_fit_a_micro_batch(make_config, tmp_path, capsys):
    values = make_config().model_dump(mode="json")  # the model itself refuses to build such a config
    values["trainer"].update(seq_len=1024, micro_batch_tokens=512)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(values))
    assert main(["train", str(config)]) == 2
    assert "seq_len (1024) must not exceed trainer.micro_batch_tokens (512)" in capsys.readouterr().err


def test_unloadable_model_is_a_clear_error(make_config, tmp_path, capsys):
    config = make_config().model_copy(
        update={"model": make_config().model.model_copy(update={"path": str(tmp_path)})}
    )
    assert main(["train", write_config(tmp_path / "run.yaml", config)]) == 2
    assert "cannot load the model" in capsys.readouterr().err


def test_a_checkpoint_without_trainer_state_cannot_be_resumed(make_config, tmp_path, capsys):
    config = make_config()
    config.checkpoints_dir.mkdir(parents=True)
    (config.checkpoints_dir / "step_1").mkdir()
    (config.checkpoints_dir / "latest").write_text("1\n")
    assert main(["train", write_config(tmp_path / "run.yaml", config)]) == 2
    err = capsys.readouterr().err
    assert "cannot resume: " in err and "step_1/trainer_state: no trainer state to resume from" in err
