#!/usr/bin/env bash
# On the GPU machine: `molt up recipes/gpu-1.toml` (bench/gpu_loop/run.sh) on the tiny MoE with routing
# replay on: each token's experts captured in the CUDA engine, carried through the router and the
# agent-pool, replayed in the CUDA learner. Staged as bench/gpu_moe/run.sh is (the last call carries
# the last part and .gpu/redis, as bench/gpu_loop/bundle.sh built them with MOLT_BUNDLE_MOE=1).
set -euo pipefail
model=/tmp/models/tiny-moe
if [ "${1:-}" != "--stage" ] && [ ! -d $model ]; then
  src=$(ls -d libs/*/src | tr '\n' ':')
  PYTHONPATH=$src python3 -c "from pathlib import Path; from molt.core.tiny_model import build; build(Path('$model'), moe=True, arch='qwen3')"
fi
MOLT_GPU_MODEL=$model exec bash bench/gpu_loop/run.sh "$@" --set rollout.routing_replay=true \
  --set 'learner.backend="torch"' --set router.engine.max_model_len=256 --set agent_pool.max_tokens=8 \
  --set router.sampling.max_tokens_default=8 --set router.sampling.max_tokens_cap=16 --set learner.max_steps=12 \
  --set learner.optimizer.total_steps=12 --set learner.optimizer.lr=1e-4
