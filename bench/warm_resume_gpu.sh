# run.warm_resume on one H200 with real SGLang 0.5.17 (bench/RESULTS.md, "A resume keeps the SGLang server").
# On the GPU machine, after `. .sglwheels/install.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD` (ray from
# .whlb in the same warm machine):
#   bash bench/warm_resume_gpu.sh true     # then: bash bench/warm_resume_gpu.sh false
# The main job, colocated on one GPU with a launched SGLang server (weights over a gloo group); the trainer kills
# itself in its 6th train step (MESHRL_FAULTS) and run.auto_resume resumes the run from the step-4 checkpoint,
# keeping the rollout worker and its server (true) or starting every role again (false).
set -u
mode=$1
S=(rollout.engine.backend=sglang rollout.engine.sglang.attention_backend=triton rollout.engine.sglang.sampling_backend=pytorch
   'rollout.engine.sglang.extra_args={grammar-backend: none, mm-feature-transport: cpu}' rollout.engine.sglang.transport=group)
export MESHRL_CACHE=/tmp/mc
mkdir -p "$OUT/faults_$mode"
(time MESHRL_FAULTS=trainer.train_step=6 MESHRL_FAULTS_DIR="$OUT/faults_$mode" python3 examples/async_ppo.py \
  --config examples/async_ppo_gpu.yaml placement=colocated trainer.device=cuda rollout.engine.device=cuda \
  run.total_steps=10 run.eval_every=0 run.checkpoint_every=4 run.auto_resume=true run.warm_resume="$mode" "${S[@]}" \
  run.output_dir="$OUT/run_$mode") > "$OUT/$mode.log" 2>&1
grep -E "recover|kept|sglang:|held-out|^real" "$OUT/$mode.log"
pgrep -f "sglang.launch_server" > /dev/null && echo "an sglang server is left" || echo "no sglang server left"
python3 - "$OUT/run_$mode/metrics.jsonl" "$mode" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r.get("kind") == "restart":
        print(f"warm_resume={sys.argv[2]}: {r['role']} died at step {r['failed_at_step']}, back at step "
              f"{r['resumed_at_step']} after {r['recovery_s']:.1f} s, kept {r.get('kept')}")
PY
