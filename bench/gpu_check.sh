#!/usr/bin/env bash
# The real-vLLM checks on a CUDA GPU, in one go (< 10 minutes on one GPU): the raw-ref vs vLLM-native
# equivalence tests (tiny Qwen2-VL, Qwen3-VL and Kimi K2.5, whose MLA and MoE then run on vLLM's GPU
# kernels), the weight-update, error and engine-death tests, all on GPU-shaped tiny checkpoints (attention
# head_dim 128, `rawmm tiny-model --gpu-shape`), then the multi-turn
# benchmark. Needs the GPU stack: pip install -c constraints.txt -e '.[dev,inference]' (vllm 0.32).
#   bash bench/gpu_check.sh [OUTDIR]        # logs and figures in OUTDIR (default: gpu-check-<time>)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"

"$PY" - <<'PY' | tee "$OUT/versions.txt"
import torch, transformers, vllm
print(f"torch {torch.__version__} cuda {torch.version.cuda} device {torch.cuda.get_device_name(0)}")
print(f"transformers {transformers.__version__} vllm {vllm.__version__}")
assert torch.cuda.is_available(), "no CUDA device"
PY

# The vLLM test modules build their checkpoints with head_dim 128 when RAWMM_TINY_GPU_SHAPE=1.
RAWMM_TINY_GPU_SHAPE=1 timeout 540 "$PY" -m pytest -q -p no:cacheprovider \
  tests/serving/test_vllm_qwen2_vl.py tests/serving/test_vllm_qwen3_vl.py tests/serving/test_vllm_kimi_k25.py \
  tests/serving/test_vllm_engine_unit.py tests/serving/test_vllm_disconnect.py \
  --durations=5 2>&1 | tee "$OUT/tests.txt"

RAWMM_TINY_GPU_SHAPE=1 timeout 150 "$PY" bench/vllm_multiturn.py --rollouts 8 --turns 10 2>&1 | tee "$OUT/vllm_multiturn.txt"
echo "gpu check done: $OUT"
