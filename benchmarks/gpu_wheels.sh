#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the lent H200 (torch 2.11 + CUDA 13, transformers 5.17, Python 3.12,
# no network; /work/.library/device/KINDS.md lists what it has), downloaded here into .whl/ (ignored by git), and
# their size against the 64 MiB that a call may carry together with the checkout.
#
#   benchmarks/gpu_wheels.sh [DEST]      # default DEST: .whl in the checkout; PYTHON=... picks the pip (python3)
#
# What and why (each one version: two of a package stop the install there):
#   transformers 5.24.0   the model calls create_causal_mask(cache=...) (5.24); 5.25 would need huggingface-hub >= 2.4
#                         and `kernels`, which the machine lacks (its hub is 1.33)
#   datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19
#                         PretrainTrainer imports hf_pretrain.data, which reads with datasets (mfu_bf16,
#                         straggler_2proc, telemetry_overhead); pyarrow, pandas, xxhash, fsspec are there. datasets 5.2
#                         declares pyarrow >= 24 and fsspec <= 2026.9.0: gpu_check.json's env details give both
#   torchao 0.18.0        the fp8 recipe (fp8_vs_bf16): the release built for torch >= 2.11 (its C++ extensions load
#                         only there); float8 training itself runs torch._scaled_mm from Python
#   liger-kernel 0.8.5    torch 2.11 has no F.linear_cross_entropy: without Liger the model computes the full logits
#                         (and the memory estimate prices them); with it, the chunked loss runs on the GPU (Triton 3.6
#                         is there)
# All are pure-Python or abi3 wheels for x86-64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$dest/" "$exclude" 2>/dev/null || echo "/$dest/" >>"$exclude"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
    transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0 liger-kernel==0.8.5
wheels=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
du -b "$dest"/*.whl | awk '{printf "%7.1f MiB  %s\n", $1 / 1048576, $2}'
awk -v w="$wheels" -v t="$tree" 'BEGIN {
    printf "wheels %.1f MiB + tracked checkout %.1f MiB = %.1f MiB of the 64 MiB a call carries\n", w / 1048576, t / 1048576, (w + t) / 1048576
}'
