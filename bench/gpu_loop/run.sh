#!/usr/bin/env bash
# On the GPU machine, from the repository root: `molt up recipes/gpu-1.toml` on one GPU with what
# bench/gpu_loop/bundle.sh carried. One call per part (bash bench/gpu_loop/run.sh --stage, carrying
# .gpu/p1, then .gpu/p2, ...), the last carrying the last part and .gpu/redis, without --stage:
#   bash bench/gpu_loop/run.sh [--steps N] [--set table.key=value ...]
# Writes to $OUT: the run's metrics, logs and settings, GPU memory per process once a second, and
# summary.json (bench/gpu_loop/summary.py).
set -euo pipefail
source bench/gpu_router/site.sh "$@"
out=${OUT:-/tmp/molt-out}
mkdir -p "$out" /tmp/molt-bin /tmp/molt-meta/molt_router-0.1.0.dist-info
# molt runs from its source tree here: console scripts and vLLM's plugin entry points by hand.
printf 'Metadata-Version: 2.1\nName: molt-router\nVersion: 0.1.0\n' >/tmp/molt-meta/molt_router-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\nmolt_wait = molt.router.vllm_wait:register\nmolt_versions = molt.router.version_counts:register\n' \
  >/tmp/molt-meta/molt_router-0.1.0.dist-info/entry_points.txt
for entry in molt=molt.launcher.cli molt-router=molt.router.__main__ molt-broadcaster=molt.broadcaster.__main__ \
  molt-learner=molt.learner.__main__ molt-agent-pool=molt.agent_pool.__main__ ray=ray.scripts.scripts; do
  name=${entry%%=*}
  printf '#!/bin/sh\nexec python3 -c "import sys; from %s import main; sys.exit(main())" "$@"\n' "${entry#*=}" >/tmp/molt-bin/$name
  chmod +x /tmp/molt-bin/$name
done
if [ -f .gpu/redis/redis-server.bin ]; then
  mkdir -p /tmp/molt-redis && cp .gpu/redis/* /tmp/molt-redis/
fi
# Debian's redis-server is redis-check-rdb under another name: it picks its mode by argv[0].
printf '#!/bin/bash\nexport LD_LIBRARY_PATH=/tmp/molt-redis\nexec -a redis-server /tmp/molt-redis/redis-server.bin "$@"\n' \
  >/tmp/molt-bin/redis-server
chmod +x /tmp/molt-bin/redis-server
export PATH=/tmp/molt-bin:$PATH
src=$(ls -d "$root"/libs/*/src "$root"/services/*/src "$root"/apps/*/src | tr '\n' ':')
export PYTHONPATH=/tmp/molt-site:/tmp/molt-meta:$src
redis-server --version
model=${MOLT_GPU_MODEL:-/tmp/models/qwen3-0.5b}  # bench/gpu_moe/loop.sh builds its own
[ -d $model ] || python3 bench/gpu_loop/build_model.py --out $model
# The CUDA IPC weight group between two processes on this GPU, before the loop relies on it.
python3 -m pytest -q -p no:cacheprovider -m gpu libs/molt-core/tests/test_weight_ipc.py 2>&1 | tail -5
(while true; do
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | sed "s/^/$(date +%s) /"
  sleep 1
done) >"$out/gpu-memory.txt" 2>&1 &
sampler=$!
status=0
timeout 480 molt up recipes/gpu-1.toml --set router.engine.model_path=$model --set learner.model_path=$model \
  --set agent_pool.tokenizer_path=$model --set 'router.engine.engine_args={attention_backend="TRITON_ATTN"}' \
  "$@" 2>&1 | tee "$out/molt-up.txt" | tail -40 || status=$?
kill $sampler || true
run=runs/gpu-1
cp $run/metrics.jsonl $run/settings.json "$out/" 2>/dev/null || true
tar -czf "$out/logs.tgz" $run/logs 2>/dev/null || true
python3 bench/gpu_loop/summary.py $run "$out/gpu-memory.txt" $model >"$out/summary.json" || true
cat "$out/summary.json"
exit $status
