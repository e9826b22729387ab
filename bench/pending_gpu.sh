#!/usr/bin/env bash
# The GPU measurements this tree still owes (issue 36), each part sized for one device call (<= 10 minutes),
# writing under $OUT/<part>. Run from the repository root on the GPU machine with the cp312 site tarball
# carried (`carry: [".gpusite"]`; DESIGN.md says how to build it):
#     bash bench/pending_gpu.sh kernels      # CUDA parity tests + the kernels against what they replace
#     bash bench/pending_gpu.sh rmsnorm-tune # the RMSNorm backward's launch shapes at the hidden widths
#     bash bench/pending_gpu.sh moe          # qwen3-moe steps: the host-decided optimizer step vs this tree
#     bash bench/pending_gpu.sh moe-kernels  # qwen3-moe steps: the RMSNorm and SwiGLU-probs kernels off vs on
#     bash bench/pending_gpu.sh dense        # the 1.5B at 12,288 vs 24,576 tokens per micro-batch
#     bash bench/pending_gpu.sh moe-logprob  # qwen3-moe, log-prob passes at 49,152 tokens (against `moe`'s preset)
#     bash bench/pending_gpu.sh dense-logprob  # the 1.5B, log-prob passes at 49,152 (against `dense`'s b12k)
#     bash bench/pending_gpu.sh realistic    # qwen3-moe, realistic response lengths vs the preset
#     bash bench/pending_gpu.sh profile      # a torch profile of the qwen3-moe update and log-prob passes
# Parts `moe*`, `realistic` and `profile` need an H200 (the update's peak is ~102 GiB); on an 80 GiB card set
# PENDING_SET="--set actor.ppo_max_token_len_per_gpu=12288 --set cluster.device_memory_gib=80
# --set ref.megatron.param_offload=true" (added to every step run; side-by-side ratios stay comparable).
set -u
part="${1:?usage: bash bench/pending_gpu.sh kernels|rmsnorm-tune|moe|moe-kernels|moe-logprob|dense|dense-logprob|realistic|profile}"
out="${OUT:-/tmp/pending_gpu}/$part"
mkdir -p "$out"
if [ -f .gpusite/site312.tar.xz ] && [ ! -d /tmp/site312 ]; then
  tar -xJf .gpusite/site312.tar.xz -C /tmp
fi
export PYTHONPATH="/tmp/site312:$PWD"
export RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
# (No commit is recorded here: the device gets the working tree, but its .git may be an older snapshot, whose
# `git log` named another commit; the caller names the commit it sent.)

case "$part" in
  kernels)
    if python3 -c "import pytest, hypothesis" 2>/dev/null; then
      python3 -m pytest -q -p no:cacheprovider tests/megatron/test_swiglu_probs_kernels.py \
        tests/megatron/test_rms_norm_kernels.py tests/megatron/test_triton_gather_sum.py 2>&1 \
        | tail -30 | tee "$out/pytest.txt"
    else
      echo "pytest or hypothesis missing: the CUDA parity tests did not run" | tee "$out/pytest.txt"
    fi
    python3 bench/train_kernels_gpu.py --only swigluprobs,rmsnorm,gathersum --out "$out" 2>&1 | tail -20
    ;;
  rmsnorm-tune)
    # The backward's tiles are untuned at hidden widths (1,024: no gain over torch's; docs/benchmarks.md):
    # pick TILE_ELEMENTS / TILES / num_warps from this sweep, then run `kernels` again.
    python3 bench/train_kernels_gpu.py --only rmsnorm-tune --out "$out" 2>&1 | tail -40
    ;;
  moe)
    # The optimizer step decided on the host with megatron's per-parameter loops (before the eleventh
    # session) against this tree, side by side.
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen3-moe-grpo --steps 3 --workloads preset:off,preset \
      --off-env RLPLAN_BENCH_TRAIN_KERNELS_OFF=deviceguard,foreach --out "$out" 2>&1 | tail -20
    ;;
  moe-kernels)
    # The twelfth session's kernels (RMSNorm, the experts' SwiGLU x probability) off against on: their
    # device time saved against the host time their launches add (the passes are partly host-bound).
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen3-moe-grpo --steps 3 --workloads preset:off,preset \
      --off-env RLPLAN_BENCH_TRAIN_KERNELS_OFF=swigluprobs,rmsnorm --out "$out" 2>&1 | tail -20
    ;;
  dense)
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen2.5-1.5b-grpo --steps 3 --workloads preset \
      --out "$out/b12k" 2>&1 | tail -8
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen2.5-1.5b-grpo --steps 3 --workloads preset \
      --set actor.ppo_max_token_len_per_gpu=24576 --set cluster.device_memory_gib=139 \
      --out "$out/b24k" 2>&1 | tail -8
    ;;
  moe-logprob)
    # The log-prob passes at twice the update's token budget (actor / ref.log_prob_max_token_len_per_gpu):
    # half the micro-batches, whose per-micro-batch host cost bounds a MoE forward pass.
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen3-moe-grpo --steps 3 --workloads preset \
      --set actor.log_prob_max_token_len_per_gpu=49152 --set ref.log_prob_max_token_len_per_gpu=49152 \
      --out "$out" 2>&1 | tail -8
    ;;
  dense-logprob)
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen2.5-1.5b-grpo --steps 3 --workloads preset \
      --set actor.log_prob_max_token_len_per_gpu=49152 --set ref.log_prob_max_token_len_per_gpu=49152 \
      --out "$out" 2>&1 | tail -8
    ;;
  realistic)
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen3-moe-grpo --steps 3 --workloads realistic,preset \
      --out "$out" 2>&1 | tail -20
    ;;
  profile)
    python3 bench/grpo_step_gpu.py ${PENDING_SET:-} --preset qwen3-moe-grpo --steps 2 --workloads preset \
      --set profile.tool=torch --set profile.steps=2 \
      --set "profile.roles=actor_update actor_compute_log_prob" --out "$out" 2>&1 | tail -8
    find "$out" -name trace.json -delete  # too large to bring back; grpo_step_gpu.py kept its trace_gaps_*.json
    ;;
  *)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
