"""`trainer.compile`: every repeated block compiled in place gives eager mode's loss and gradients on each
family (fp32, CPU), and a compiled run reproduces its batch's logprobs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from rollout_kit import RolloutFactory, loss_and_grads, shared_image_micro_batch

from rawmm.config import RunConfig
from rawmm.contract import OffloadStore
from rawmm.rl.trainer.blocks import compile_blocks, repeated_blocks
from rawmm.rl.trainer.distributed import init_distributed
from rawmm.rl.trainer.loop import Trainer

pytestmark = pytest.mark.slow  # each family compiles its blocks on CPU: tens of seconds


@pytest.fixture(scope="module")
def compiler_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One for the module: a graph that an earlier test compiled loads from it, not compiled again."""
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(autouse=True)
def compiler_in_tmp(compiler_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The compiler's caches (kernels, and the precompiled headers it writes under the system temp directory
    whatever its cache dir says) in the module's temp dir, and a compiler that forgets every graph it
    traced."""
    from torch._inductor import codecache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compiler_cache))
    for attribute in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):
        if hasattr(codecache, attribute):
            monkeypatch.setattr(codecache, attribute, str(compiler_cache / "headers" / attribute.lower()))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: each test counts its own graphs
    yield
    torch._dynamo.reset()


def compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_the_repeated_blocks_are_every_decoder_layer_and_vision_block(tiny_qwen2_vl: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl, dtype=torch.float32)
    text, vision = model.config.text_config, model.config.vision_config
    blocks = repeated_blocks(model)
    assert len(blocks) == text.num_hidden_layers + vision.depth
    assert len({type(block).__name__ for block in blocks}) == 2


def test_compiled_blocks_give_eager_loss_and_gradients(
    family_model: tuple[Path, str], tmp_path: Path
) -> None:
    from transformers import AutoModelForImageTextToText

    model_dir, preset = family_model
    m, materializer = shared_image_micro_batch(model_dir, preset, OffloadStore(tmp_path / "images"))
    eager = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    compiled = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    names = [name for name, _ in compiled.named_parameters()]
    blocks = compile_blocks(compiled)
    assert blocks == len(repeated_blocks(eager))
    assert [name for name, _ in compiled.named_parameters()] == names  # checkpoints keep their keys

    loss_eager, grads_eager, _ = loss_and_grads(eager, m, materializer, once=True)
    loss_compiled, grads_compiled, _ = loss_and_grads(compiled, m, materializer, once=True)

    assert compiled_graphs() > 0, "no graph was compiled"
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-6)
    assert grads_compiled.keys() == grads_eager.keys()
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_compiled_run_reproduces_its_batchs_logprobs(
    make_config: Callable[..., RunConfig], rollouts: RolloutFactory
) -> None:
    samples = rollouts.standard_batch()
    rollouts.write(1, samples)
    trainer = Trainer(make_config(compile=True), init_distributed())
    [result] = trainer.run(1, batch_timeout=5)
    assert compiled_graphs() > 0, "no graph was compiled"
    assert result.compiled_blocks == len(repeated_blocks(trainer.model))  # the step line says so
    # the logprobs came from this very model, eager and fp32: as test_trainer's bound
    assert result.logprob_diff_mean < 1e-4 and result.clipped_fraction == 0.0
    assert torch.isfinite(torch.tensor(result.loss))
