#!/usr/bin/env bash
# One prepared GPU check for a machine with ONE CUDA GPU (written for an H200): it turns a lent GPU
# into cost-model evidence in one call, without network.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        # from the repository root; OUT_DIR defaults to ./gpu_check_out
#
# PLAN3D_PROFILE names the hardware profile the predictions use (default h200-141gb; h100-sxm-80gb on an H100).
#
# 1. `plan3d validate` of a small plan on 1 rank (NCCL): measured against predicted per term
#    (weights, gradients, Adam states, saved activations, torch.cuda.max_memory_allocated/reserved,
#    step time) and the verdict.
# 2. One tensor-parallel shard (t = 8) of two Llama-3-70B layers at sequence 8192 in bf16
#    (tests/test_validate_gpu.py): peak memory and compute time against the estimate.
# 3. The GEMM microbenchmark of `plan3d calibrate` on this GPU (bf16, the cost model's shapes)
#    against the peak of that profile.
#
# With PLAN3D_GPU_CHECK_ALL=1 it then runs what the 2026-12-05 H100 lease ran (benchmarks/data/h100_*.json): the
# kernel sweep, the sustained GEMM rate, and the caching-allocator check (docs/cost-model.md, docs/memory.md).
#
# Needs python3 with torch (CUDA), numpy, pyyaml, rich, typer; pydantic is installed from wheels in
# $PLAN3D_WHEELS (a folder of .whl files, no index) when python3 lacks it. Every step has its own
# time limit; the whole script stays under 3 minutes on an H200.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PROFILE=${PLAN3D_PROFILE:-h200-141gb}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c "import pydantic" 2>/dev/null; then
    if [ -z "${PLAN3D_WHEELS:-}" ] || [ ! -d "${PLAN3D_WHEELS}" ]; then
        echo "gpu_check: $PY has no pydantic; set PLAN3D_WHEELS to a folder with its wheels" >&2
        exit 2
    fi
    SITE=$(mktemp -d)
    trap 'rm -rf "$SITE"' EXIT
    "$PY" -m pip install --quiet --no-index --find-links "$PLAN3D_WHEELS" --target "$SITE" pydantic
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi

"$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), "gpu_check: no CUDA device"
print(f"== device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

echo "== 1. validate, 1 rank, NCCL"
timeout 120 "$PY" - "$OUT" "$PROFILE" <<'EOF'
import json
import sys

from planner.presets import load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec
from planner.validate import launch

out = sys.argv[1]
hw = load_hardware(sys.argv[2])
sc = Scenario(model=load_model("llama3-8b"), hardware=hw,
              training=TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096),
              plan=Plan(tp=1, pp=1, dp=8, micro_batch_size=1, recompute="selective"))
mini, outcome = launch.validate_local(sc, steps=5, scale=8.0, max_ranks=1, backend="nccl", timeout_s=110,
                                      hardware=hw, time_factor=None)
report = outcome.report
json.dump(report, open(f"{out}/validate.json", "w"), indent=2)
if not outcome.ok:
    print("\n".join(outcome.message))
    sys.exit(1)
print("ran:", "; ".join(report["changed"]))
print(f"{'term':<34}{'predicted':>14}{'measured':>14}{'error':>10}")
for row in report["memory"] + report["device_memory"]:
    print(f"{row['metric'] + ' (MiB)':<34}{row['predicted'] / 2**20:>14.3f}{row['measured'] / 2**20:>14.3f}"
          f"{100 * row['rel_error']:>+9.2f}%")
    if row.get("reserved"):
        print(f"{'max_memory_reserved (MiB)':<34}{'':>14}{row['reserved'] / 2**20:>14.3f}")
st = report["step_time"]
print(f"{'step time (ms)':<34}{1e3 * st['predicted_s']:>14.3f}{1e3 * st['measured_s']:>14.3f}{100 * st['rel_error']:>+9.1f}%")
for t in report["terms"]:
    print(f"{t['term'] + ' (ms)':<34}{1e3 * t['predicted_s']:>14.3f}{1e3 * t['measured_s']:>14.3f}{100 * t['rel_error']:>+9.1f}%")
ref = report.get("reference")
if ref:
    print(f"{'first loss vs single process':<34}{ref['reference_loss']:>14.6f}{ref['first_loss']:>14.6f}"
          f"{100 * ref['rel_error']:>+9.4f}%")
print(f"verdict: {report['verdict']}" + "".join(f"\n  {r}" for r in report["reasons"]))
EOF

echo "== 2. one TP shard of Llama-3-70B (2 layers, seq 8192, bf16)"
timeout 120 "$PY" -m pytest -q -s -p no:cacheprovider tests/test_validate_gpu.py 2>&1 | tee "$OUT/tp_shard.txt" || true

echo "== 3. GEMM rate (calibrate, 1 rank, bf16) against $PROFILE"
timeout 120 "$PY" - "$OUT" "$PROFILE" <<'EOF'
import sys

from planner.presets import load_hardware
from planner.validate import launch

base = load_hardware(sys.argv[2])
spec, text = launch.calibrate_local(base, backend="nccl", ranks=1, timeout_s=110, quick=False)
open(f"{sys.argv[1]}/{sys.argv[2]}-calibrated.yaml", "w").write(text)
print("\n".join(launch.calibration_summary(base, spec)))
EOF
if [ "${PLAN3D_GPU_CHECK_ALL:-0}" = 1 ]; then  # the kernel tables and the allocator check (about 4 more minutes)
    echo "== 4. kernel sweep (benchmarks/gpu_kernels.py)"
    timeout 300 "$PY" benchmarks/gpu_kernels.py "$OUT/kernels.json" || true
    echo "== 5. sustained GEMM rate under the power limit (benchmarks/gpu_sustained.py)"
    timeout 120 "$PY" benchmarks/gpu_sustained.py "$OUT/sustained.json" 20 || true
    echo "== 6. the caching-allocator check (benchmarks/gpu_allocator_check.py, built on meta as torchtitan builds)"
    timeout 200 "$PY" benchmarks/gpu_allocator_check.py "$OUT/allocator_check_meta.json" --meta-init || true
fi
echo "== done: $OUT"
