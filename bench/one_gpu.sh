#!/usr/bin/env bash
# Issue 29's one-GPU comparisons, each pair in one sitting (bench/RESULTS.md). On the GPU machine, after
# `source .whlb/install-on-gpu.sh` (ray and msgspec from ../shared/gpu/prepare-wheels.sh):
#   bash bench/one_gpu.sh trainer [--compile]   the 0.5B trainer with and without shared prompts (must 2's command)
#   bash bench/one_gpu.sh e2e                   the 0.5B GRPO workload end to end (must 4's command), shared prompts
#                                               on and off
#   bash bench/one_gpu.sh overlap               the same workload, colocated taking turns and colocated.overlap=true
#   bash bench/one_gpu.sh reward                the same workload scored by a reward worker, then in the hybrid
#                                               worker itself (reward.num_workers=0)
# Logs and each run's output go under $OUT.
set -u
OUT=${OUT:-/tmp/one_gpu}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MESHRL_CACHE=/tmp/mc
W="--models 0.5b --etas 1 --warmup 3 --samples-per-prompt 8 --samples-per-step 64 --prompt-len 128 --response-len 256"
E2E="placement=colocated rollout.num_workers=1 --tokens-per-microbatch 32768 trainer.compile=true"
e2e() {  # name, then overrides
  local name=$1; shift
  timeout 280 python3 bench/e2e_gpu.py $W --steps "${STEPS:-40}" $E2E "$@" --out "$OUT/e2e_$name" > "$OUT/e2e_$name.log" 2>&1
  echo "$name:"; tail -4 "$OUT/e2e_$name.log"
}
case "$1" in
  trainer)
    G="--dp 1 --samples 64 --prompt-len 128 --response-len 256 --warmup 3 --steps 8 --no-save --tokens-per-microbatch 32768 ${2:-}"
    for share in false true; do
      python3 bench/gpu_trainer.py $G --share-prompts $share > "$OUT/trainer_share_$share.log" 2>&1
      echo "share_prompts=$share ${2:-}:"; grep -E "^\| 0 |^losses per" "$OUT/trainer_share_$share.log" || tail -20 "$OUT/trainer_share_$share.log"
    done ;;
  e2e) for share in true false; do e2e "share_$share" trainer.share_prompts=$share; done ;;
  overlap) e2e turns colocated.overlap=false; e2e overlap colocated.overlap=true ;;
  reward) e2e reward_worker reward.num_workers=1; e2e in_rollout reward.num_workers=0 ;;
  *) echo "usage: bash bench/one_gpu.sh trainer [--compile] | e2e | overlap | reward"; exit 2 ;;
esac
