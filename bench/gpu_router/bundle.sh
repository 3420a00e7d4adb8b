#!/usr/bin/env bash
# Builds what bench/router.py needs (and, with MOLT_BUNDLE_EXTRA, more: bench/gpu_loop/bundle.sh) on the GPU machine (torch 2.11 image, no vLLM, Ray or registry):
# vLLM 0.26.0 (the newest release built for torch 2.11) and Ray 2.60.0 with their pure-Python and
# cp312 dependencies, minus what the image has (torch, triton, numpy, transformers and its stack) and
# what this bench never loads (FlashAttention and MoE kernels, FlashInfer, CUTLASS DSL, video and
# image codecs, the Rust front end, Ray's jars, dashboard build and RLlib), as one xz tarball split
# into parts of at most 62 MB, one part per device call: .gpu/p1, .gpu/p2, ... (.gpu/ is git-ignored
# through .git/info/exclude). bench/gpu_router/run.sh unpacks them there and runs the bench.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps)
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
printf 'vllm==0.26.0\nray==2.60.0\n' >"$work/req.in"
# More requirements, one per line (bench/gpu_loop/bundle.sh adds what the whole loop imports).
printf '%s\n' ${MOLT_BUNDLE_EXTRA:-} >>"$work/req.in"
# Left out of the resolution: in the image, or never loaded on this bench's path.
for name in torch torchaudio torchvision torchcodec triton nvidia-cutlass-dsl quack-kernels tilelang \
  humming-kernels tokenspeed-mla PyNvVideoCodec opencv-python-headless flashinfer-python nvidia-cudnn-frontend; do
  echo "$name; sys_platform == 'never'"
done >"$work/overrides.txt"
uv pip compile "$work/req.in" --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
  --overrides "$work/overrides.txt" --no-header --no-annotate -o "$work/req.txt"
# The image's own: numpy, transformers and what it needs; numba is loaded only for n-gram speculation.
# MOLT_BUNDLE_DROP: more of the image's own, '|'-separated.
grep -v -E "^(numpy|transformers|tokenizers|huggingface-hub|hf-xet|safetensors|jinja2|markupsafe|filelock|fsspec|regex|tqdm|packaging|setuptools|numba|llvmlite|grpcio|apache-tvm-ffi${MOLT_BUNDLE_DROP:+|$MOLT_BUNDLE_DROP})==" \
  "$work/req.txt" >"$work/carry.txt"
# molt's generated stubs need grpcio 1.85.1 with its health, reflection and status packages; xgrammar needs a
# newer tvm-ffi than vLLM 0.26 pins (that pin is for FlashInfer, which is not carried).
printf 'grpcio==1.85.1\ngrpcio-health-checking==1.85.1\ngrpcio-reflection==1.85.1\ngrpcio-status==1.85.1\nredis==8.1.0\napache-tvm-ffi>=0.1.11\n' >>"$work/carry.txt"
python3 -m pip download -q "${platforms[@]}" -d "$work/wheels" -r "$work/carry.txt"
mkdir "$work/site"
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
site=$work/site
# MOLT_BUNDLE_MOE=1 keeps the fused-MoE kernels (topk_softmax, moe_align_block_size) a MoE model needs.
[ -n "${MOLT_BUNDLE_MOE:-}" ] || rm -f "$site"/vllm/_moe_C_stable_libtorch.abi3.so
rm -f "$site"/vllm/vllm_flash_attn/*.so "$site"/vllm/vllm-rs \
  "$site"/vllm/_flashmla*.so "$site"/vllm/_qutlass_C.abi3.so
find "$site/vllm/third_party" -name '*.so' -delete
find "$site/vllm/third_party" -type d -name include -prune -exec rm -rf {} +
rm -rf "$site/ray/jars" "$site/ray/dashboard/client/build" "$site/ray/rllib"
rm -rf .gpu && mkdir -p .gpu
tar -C "$site" -c . | xz -6 -T0 >"$work/site.tar.xz"
split -b 62000000 -a 2 "$work/site.tar.xz" "$work/part-"
index=1
for part in "$work"/part-*; do
  mkdir -p ".gpu/p$index" && mv "$part" ".gpu/p$index/site.tar.xz.$(basename "$part")"
  index=$((index + 1))
done
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
du -sh .gpu/p*
