#!/usr/bin/env bash
# Install rlplan's missing dependencies on the lent GPU machine (Python 3.12 image, no network) from
# wheels carried in .gpuwhl/ (+ .gpuwhl2/ holding the second half of the ray wheel, which alone exceeds
# one call's transfer limit). Usage: source bench/device_setup.sh
set -e
mkdir -p /tmp/stage
cp .gpuwhl/*.whl /tmp/stage/ 2>/dev/null || true
cp .gpuwhl2/*.whl /tmp/stage/ 2>/dev/null || true  # e.g. trl and what it needs, for the TRL column
[ -f .gpuwhl/ray.part.aa ] && cp .gpuwhl/ray.part.aa /tmp/stage/
[ -f .gpuwhl2/ray.part.ab ] && cp .gpuwhl2/ray.part.ab /tmp/stage/
if [ -f /tmp/stage/ray.part.aa ] && [ -f /tmp/stage/ray.part.ab ]; then
  cat /tmp/stage/ray.part.aa /tmp/stage/ray.part.ab > /tmp/stage/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
fi
if ls /tmp/stage/ray-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/stage/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
export RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set +e
