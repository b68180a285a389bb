#!/usr/bin/env bash
# The trainer on one lent GPU, in one go (under 8 minutes): the trainer's tests with CUDA visible, the
# GPU-marked ones included, then bench/trainer_gpu.py at Qwen2-VL-2B's shapes (compiled variants included).
# The device's Python lacks a few of the project's wheels: bring them in .gpu/whl (git-ignored, so name
# `.gpu` in the run's carry):
#   mkdir -p .gpu && cp -r ../shared/gpu-trainer-check/whl .gpu/whl
#   bash bench/trainer_gpu_check.sh "$OUT"        # on the device; logs and summary.txt land in $OUT
#   PY=.venv/bin/python SKIP_INSTALL=1 BENCH_ARGS="--size tiny --steps 1" bash bench/trainer_gpu_check.sh out
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
PY=${PY:-python3}
SITE=${SITE:-/tmp/rawmm-gpu-site}
BENCH_ARGS=${BENCH_ARGS:-"--size real --deadline 270"}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/rawmm-gpu-inductor

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  # a wheel is a zip file: unpacked into a folder on PYTHONPATH it is installed
  "$PY" -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sorted(glob.glob('.gpu/whl/*.whl'))]" \
    "$SITE" > "$OUT/install.log" 2>&1
  echo "install rc=$? $(ls .gpu/whl | wc -l) wheels" >> "$SUMMARY"
fi
export PYTHONPATH=$SITE:$PWD/src:$PWD/operator

# The two-rank torchrun tests ask for a GPU per rank with CUDA visible: they run in make test, on CPU.
start=$(date +%s)
timeout -k 5 180 "$PY" -m pytest -q -p no:cacheprovider -p no:asyncio -m "gpu or not gpu" tests/rl/trainer \
  --ignore=tests/rl/trainer/test_data_parallel.py --ignore=tests/rl/trainer/test_fsdp.py > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(($(date +%s) - start))s $(tail -1 "$OUT/tests.log")" >> "$SUMMARY"

start=$(date +%s)
# shellcheck disable=SC2086
timeout -k 5 300 "$PY" bench/trainer_gpu.py $BENCH_ARGS > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(($(date +%s) - start))s" >> "$SUMMARY"
grep '^SUMMARY: ' "$OUT/bench.log" >> "$SUMMARY"
cat "$SUMMARY"
