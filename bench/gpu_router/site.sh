# Sourced by bench/gpu_router/run.sh and bench/gpu_loop/run.sh on the GPU machine, from the repository
# root: keeps each carried part (.gpu/pN, one per call, since a call carries at most 64 MiB) in a stash
# that outlives the call while the machine stays warm; with --stage it stops there. Once all parts are
# there it unpacks them (whole or not at all) and exports the environment the carried vLLM needs.
stash=/root/molt-gpu-stash
mkdir -p "$stash"
for part in .gpu/p*/site.tar.xz.part-*; do [ -e "$part" ] && cp "$part" "$stash/"; done
if [ "${1:-}" = "--stage" ]; then
  ls -la "$stash"
  exit 0
fi
if [ ! -d /tmp/molt-site ]; then  # a missing part fails here, every time
  rm -rf /tmp/molt-site.partial && mkdir -p /tmp/molt-site.partial
  cat "$stash"/site.tar.xz.part-* | xz -d -T0 | tar -x -C /tmp/molt-site.partial
  # The FlashAttention kernels are not carried (Triton attention runs instead): let the package import.
  sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # molt bench: FA kernels not carried/' \
    /tmp/molt-site.partial/vllm/vllm_flash_attn/__init__.py
  mv /tmp/molt-site.partial /tmp/molt-site
fi
root=$PWD
# FlashInfer is not carried either; without it vLLM samples with PyTorch.
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=/tmp/molt-site python3 -c "import torch, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, torch.cuda.get_device_name(0))"
