#!/usr/bin/env bash
# Issue 50's run on a machine of several GPUs, in one device call (kind nvidia-h200-x2/-x4/-x8;
# carry [".gpu", ".cuda_ext_xz"]), so that a lent machine is not spent on set-up:
#   source .gpu/setup.sh && bash tools/multi_gpu_session.sh
# 1. the NCCL suites over every GPU (tests/distributed with RECOM_TEST_DEVICE=cuda): every sharding
#    type's forward and fused training against the unsharded module (MLPerf DLRM-DCNv2's tables
#    planned by the planner among them), checkpoints (a world of 2
#    saved, loaded at 1 and at every GPU, fused optimizer state included), managed-collision and
#    feature-processed wrappers, VBE KJTs, EmbeddingCollection sharding, parameter-server shards;
# 2. the planner's plans on this host's topology (MLPerf DLRM-DCNv2's tables; a 1,000-table model);
# 3. python -m recom_rec.bench --workloads sharded-dlrm at worlds 1, 2, 4, 8 up to the GPUs here.
# Logs under $OUT. Each part has its own time limit (PARITY_TIMEOUT, PLAN_TIMEOUT, DLRM_TIMEOUT);
# PARTS picks the parts (default "parity plans dlrm"), so that a run split over two device calls
# (10 minutes each at most) does "parity" in one and "plans dlrm" in the next.
set -o pipefail
PARTS="${PARTS:-parity plans dlrm}"
part() { [[ " $PARTS " == *" $1 "* ]]; }
source .gpu/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
t0=$(date +%s)
STAGES="" bash tools/gpu_session.sh | tail -2  # the CUDA kernels: the carried build, or built here
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== $gpus GPUs ($(( $(date +%s) - t0 )) s)"

if part parity; then
echo "== parity, checkpoints, wrappers over NCCL ($(( $(date +%s) - t0 )) s)"
# (RECOM_DIST_STEPS: the parity cases train 20 steps, not the fast suite's 3)
RECOM_TEST_DEVICE=cuda RECOM_DIST_STEPS=20 timeout -s INT -k 20 ${PARITY_TIMEOUT:-300} python3 -m pytest -v -rfE --tb=short \
  --durations=15 -p no:cacheprovider tests/distributed > "$OUT/parity.log" 2>&1
tail -3 "$OUT/parity.log"; grep -E " (FAILED|ERROR)( |$)" "$OUT/parity.log" | head -20
grep -E "^resharded|^checkpoint " "$OUT/parity.log" | head -12
fi

if part plans; then
echo "== plans on this host ($(( $(date +%s) - t0 )) s)"
timeout ${PLAN_TIMEOUT:-240} python3 - "$gpus" > "$OUT/plans.log" 2>&1 <<'EOF'
import sys, torch
from torch import nn
from torchrec import EmbeddingBagConfig
from fbgemm_gpu.split_embedding_configs import EmbOptimType
import recom_rec
from recom_rec.bench.random_layouts import dcnv2
from recom_rec.distributed import EmbeddingBagCollectionSharder
from recom_rec.distributed.planner import build_plan

world = int(sys.argv[1])
hbm = torch.cuda.get_device_properties(0).total_memory
sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                      "learning_rate": 0.01})
many = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=50_000 + 997 * i, embedding_dim=16 + 16 * (i % 4),
                           feature_names=[f"f{i}"]) for i in range(1000)]
for name, tables, batch in (("MLPerf DLRM-DCNv2", dcnv2(small=False).tables(), 16384), ("1,000 tables", many, 512)):
    model = nn.Module()
    model.ebc = recom_rec.EmbeddingBagCollection(tables, device="meta")
    print(f"== {name} on {world} GPUs (HBM {hbm >> 30} GiB each, batch {batch} a rank)", flush=True)
    build_plan(model, [sharder], world_size=world, compute_device="cuda", batch_size=batch, hbm_cap=hbm,
               local_world_size=world)
EOF
grep "^==" "$OUT/plans.log"; tail -2 "$OUT/plans.log"
fi

if part dlrm; then
echo "== sharded-dlrm ($(( $(date +%s) - t0 )) s)"
worlds=$(python3 -c "print(' '.join(str(w) for w in (1, 2, 4, 8) if w <= $gpus))")
timeout ${DLRM_TIMEOUT:-300} python3 -m recom_rec.bench --workloads sharded-dlrm --worlds $worlds --iters 20 \
  --out "$OUT/dlrm" 2>&1 | tee "$OUT/dlrm.full.log" | grep -E "^sharded-dlrm|^ +[0-9]+ +(recom_rec|torchrec)|^  world|^ranks" \
  | tee "$OUT/dlrm.log"
fi
echo "== done ($(( $(date +%s) - t0 )) s)"
