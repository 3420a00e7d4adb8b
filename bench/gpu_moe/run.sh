#!/usr/bin/env bash
# On the GPU machine, from the repository root: routing capture on a CUDA engine and routing replay in
# a CUDA learner, with what `MOLT_BUNDLE_MOE=1 bash bench/gpu_loop/bundle.sh` carried (vLLM 0.26 with
# its fused-MoE kernels). One call per part (bash bench/gpu_moe/run.sh --stage, carrying .gpu/p1, then
# .gpu/p2, ...), the last carrying the last part, without --stage. Test output goes to $OUT.
set -euo pipefail
source bench/gpu_router/site.sh "$@"
out=${OUT:-/tmp/molt-out}
mkdir -p "$out"
src=$(ls -d "$root"/libs/*/src "$root"/services/*/src "$root"/apps/*/src | tr '\n' ':')
export PYTHONPATH=/tmp/molt-site:$src
status=0
# The engine's capture against a CPU fp32 reference forward (the test's child process runs vLLM).
python3 -m pytest -p no:cacheprovider -m gpu -rA tests/contract/test_expert_capture.py 2>&1 |
  tee "$out/capture.txt" | tail -30 || status=$?
# The learner's replay, on CUDA (the trainer takes the GPU where there is one).
python3 -m pytest -p no:cacheprovider -m 'not slow' -rA services/learner/tests/unit/test_replay.py 2>&1 |
  tee "$out/replay.txt" | tail -30 || status=$?
nvidia-smi --query-gpu=name,memory.used --format=csv >"$out/gpu.txt" 2>&1 || true
exit $status
