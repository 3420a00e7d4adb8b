#!/usr/bin/env bash
# On the GPU machine, from the repository root: keeps each carried part (.gpu/pN, one per call, since a
# call carries at most 64 MiB), and once all are there unpacks them and runs bench/router.py with this
# script's arguments. Usage, one call per part, the last with the bench's arguments:
#   bash bench/gpu_router/run.sh --stage            (carry .gpu/p1; then .gpu/p2; ...)
#   bash bench/gpu_router/run.sh --paths unary,stream --hidden-size 1024 --layers 24 --dtype bfloat16 ...
set -euo pipefail
stash=/root/molt-gpu-stash
mkdir -p "$stash"
for part in .gpu/p*/site.tar.xz.part-*; do [ -e "$part" ] && cp "$part" "$stash/"; done
if [ "${1:-}" = "--stage" ]; then
  ls -la "$stash"
  exit 0
fi
if [ ! -d /tmp/molt-site ]; then  # unpacked whole or not at all: a missing part fails here, every time
  rm -rf /tmp/molt-site.partial && mkdir -p /tmp/molt-site.partial
  cat "$stash"/site.tar.xz.part-* | xz -d -T0 | tar -x -C /tmp/molt-site.partial
  # The FlashAttention kernels are not carried (Triton attention runs instead): let the package import.
  sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # molt bench: FA kernels not carried/' \
    /tmp/molt-site.partial/vllm/vllm_flash_attn/__init__.py
  mv /tmp/molt-site.partial /tmp/molt-site
fi
root=$PWD
export PYTHONPATH=$root/bench/gpu_router:/tmp/molt-site:$root/libs/molt-core/src:$root/libs/molt-proto/src:$root/libs/molt-algos/src:$root/services/rollout-router/src
# FlashInfer is not carried either; without it vLLM samples with PyTorch (the bench asks for no top-p/top-k).
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, torch.cuda.get_device_name(0))"
cd bench && exec python3 router.py --router-wait spin --direct-wait spin --engine-arg 'attention_backend="TRITON_ATTN"' "$@"
