# Issue 25 on one H200 (bench/RESULTS.md, "SGLang as the pipeline's rollout engine"). On the GPU machine, after
# `. .sglwheels/install.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD` (ray from .whlb in the same warm machine):
#   bash bench/sglang_one_gpu.sh both|cast|group   (both: torch then sglang tensor; cast: sglang tensor then group; group)
set -u
W="--models 0.5b --etas 1 --warmup 2 --samples-per-prompt 8 --samples-per-step 64 --prompt-len 128 --response-len 256"
S=(rollout.engine.backend=sglang rollout.engine.sglang.attention_backend=triton rollout.engine.sglang.sampling_backend=pytorch 'rollout.engine.sglang.extra_args={grammar-backend: none, mm-feature-transport: cpu}')
export MESHRL_CACHE=/tmp/mc
nvidia-smi --query-gpu=memory.used --format=csv
if [ "$1" = both ]; then
  (time python3 bench/e2e_gpu.py $W --steps 8 placement=colocated rollout.num_workers=1 --out $OUT/torch) > $OUT/torch.log 2>&1
  tail -5 $OUT/torch.log
  (time python3 bench/e2e_gpu.py $W --steps 6 placement=colocated rollout.num_workers=1 "${S[@]}" --out $OUT/sgl) > $OUT/sgl.log 2>&1
  tail -5 $OUT/sgl.log
elif [ "$1" = cast ]; then
  (time python3 bench/e2e_gpu.py $W --steps 6 placement=colocated rollout.num_workers=1 "${S[@]}" --out $OUT/sgl) > $OUT/sgl.log 2>&1
  tail -3 $OUT/sgl.log
  (time python3 bench/e2e_gpu.py $W --steps 6 placement=colocated rollout.num_workers=1 "${S[@]}" rollout.engine.sglang.transport=group --out $OUT/group) > $OUT/group.log 2>&1
  tail -3 $OUT/group.log
else
  (time python3 bench/e2e_gpu.py $W --steps 6 placement=colocated rollout.num_workers=1 "${S[@]}" rollout.engine.sglang.transport=group --out $OUT/group) > $OUT/group.log 2>&1
  tail -5 $OUT/group.log
fi
nvidia-smi --query-gpu=memory.used --format=csv; pgrep -f "sglang.launch_server" | grep -v $$ || echo "no sglang server left"
python3 - <<'PY'
import json, os, glob, statistics as st
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*/*/eta*/metrics.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    syn = [r for r in rows if "sync/total_s" in r or any(k.startswith("sync/") for k in r)]
    keys = sorted({k for r in syn for k in r if k.startswith("sync/")})
    print(f)
    for k in keys:
        v = [r[k] for r in syn if k in r]
        print(f"  {k}: median {st.median(v):.4g} sum {sum(v):.4g} n {len(v)}")
for f in sorted(glob.glob(f"{out}/*/e2e.md")):
    print(f); print(open(f).read())
PY
