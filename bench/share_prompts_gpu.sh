#!/usr/bin/env bash
# Shared prompts (trainer.share_prompts) on one H200 (bench/RESULTS.md, issue 29). On the GPU machine,
# after `source .whlb/install-on-gpu.sh` (ray and msgspec from ../shared/gpu/prepare-wheels.sh):
#   bash bench/share_prompts_gpu.sh trainer   the 0.5B trainer with and without shared prompts (must 2's command)
#   bash bench/share_prompts_gpu.sh e2e       the 0.5B GRPO workload end to end (must 4's command), with and without
set -u
OUT=${OUT:-/tmp/share_prompts}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MESHRL_CACHE=/tmp/mc
if [ "$1" = trainer ]; then
  G="--dp 1 --samples 64 --prompt-len 128 --response-len 256 --warmup 3 --steps 8 --no-save --tokens-per-microbatch 32768 --compile"
  python3 bench/gpu_trainer.py $G --share-prompts false > "$OUT/trainer_whole_rows.log" 2>&1
  python3 bench/gpu_trainer.py $G --share-prompts true > "$OUT/trainer_shared.log" 2>&1
  for f in "$OUT"/trainer_*.log; do echo "$(basename "$f"):"; grep -E "^\| 0 |^losses" "$f" || tail -20 "$f"; done
else
  W="--models 0.5b --etas 1 --warmup 3 --samples-per-prompt 8 --samples-per-step 64 --prompt-len 128 --response-len 256"
  for share in true false; do
    timeout 280 python3 bench/e2e_gpu.py $W --steps ${STEPS:-40} placement=colocated rollout.num_workers=1 \
      --tokens-per-microbatch 32768 trainer.compile=true trainer.share_prompts=$share --out "$OUT/e2e_$share" \
      > "$OUT/e2e_$share.log" 2>&1
    echo "share_prompts=$share:"; tail -4 "$OUT/e2e_$share.log"
  done
fi
