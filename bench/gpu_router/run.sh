#!/usr/bin/env bash
# On the GPU machine, from the repository root: stages the carried parts and unpacks them
# (bench/gpu_router/site.sh), then runs bench/router.py with this script's arguments. Usage, one call
# per part, the last with the bench's arguments:
#   bash bench/gpu_router/run.sh --stage            (carry .gpu/p1; then .gpu/p2; ...)
#   bash bench/gpu_router/run.sh --paths unary,stream --hidden-size 1024 --layers 24 --dtype bfloat16 ...
set -euo pipefail
source bench/gpu_router/site.sh "$@"
export PYTHONPATH=$root/bench/gpu_router:/tmp/molt-site:$root/libs/molt-core/src:$root/libs/molt-proto/src:$root/libs/molt-algos/src:$root/services/rollout-router/src
cd bench && exec python3 router.py --router-wait spin --direct-wait spin --engine-arg 'attention_backend="TRITON_ATTN"' "$@"
