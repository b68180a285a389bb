"""Two FSDP trainer ranks (torchrun, gloo) broadcast their sharded weights to the replicas named in argv:
``broadcast_ranks.py MODEL CHECKPOINT URL...``. Every parameter is moved first, as a training step would;
rank 0 also writes the same weights as a checkpoint (the gathered full state dict) for the comparison."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForImageTextToText

from rawmm.rl.trainer.distributed import init_distributed, shutdown_distributed
from rawmm.rl.trainer.fsdp import load_from_rank0, meta_model, shard_model
from rawmm.rl.trainer.weight_broadcast import BroadcastSender
from rawmm.rl.trainer.weight_sync_client import HttpWeightSyncClient


def main() -> None:
    model_dir, checkpoint, urls = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist = init_distributed()
    model: Any
    if dist.is_main:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    else:
        from pathlib import Path

        model = meta_model(Path(model_dir), trust_remote_code=False)
    full = model.state_dict() if dist.is_main else {}
    shard_model(model, dist.device)
    load_from_rank0(model, full, dist.device)
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.mul_(1.0 + 0.01 * (index % 5)).add_(0.003)
    client = HttpWeightSyncClient(urls) if dist.is_main else None
    sender = BroadcastSender.trainer_init(model, client, master_address="127.0.0.1", bucket_bytes=32 * 1024)
    report = sender.send_weights("fsdp")
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main:
        assert report is not None
        model.save_pretrained(checkpoint, state_dict=weights, safe_serialization=True)
        print(json.dumps({"versions": report.versions, "bytes_sent": report.bytes_sent}), flush=True)
    sender.shutdown()
    if client is not None:
        client.close()
    shutdown_distributed()


if __name__ == "__main__":
    main()
