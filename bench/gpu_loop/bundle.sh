#!/usr/bin/env bash
# Builds what `molt up recipes/gpu-1.toml` needs on the GPU machine (torch 2.11 image: no vLLM, Ray,
# Redis or pydantic): bench/gpu_router/bundle.sh's vLLM 0.26.0 + Ray 2.60.0 tarball (.gpu/p1, p2, ...)
# plus the packages the other services import, and a redis-server with the libraries the image may
# lack (.gpu/redis, carried with the last part). bench/gpu_loop/run.sh stages and runs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
MOLT_BUNDLE_EXTRA="pydantic-settings==2.16.3 protobuf==7.36.2 anthropic==2.16.0 math-verify==0.9.0 datasets==5.2.0" \
  MOLT_BUNDLE_DROP="pyarrow|pandas|sympy|mpmath|pillow|scipy|aiohttp|requests|urllib3|pyyaml|psutil|msgpack|cloudpickle|xxhash|multidict|yarl|frozenlist|aiosignal|propcache|attrs|certifi|idna|charset-normalizer|click|rich|pygments" \
  bash bench/gpu_router/bundle.sh
mkdir -p .gpu/redis
cp "$(readlink -f "$(command -v redis-server)")" .gpu/redis/redis-server.bin
for lib in liblzf.so.1 libjemalloc.so.2 libatomic.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$lib" .gpu/redis/
done
du -sh .gpu/*
