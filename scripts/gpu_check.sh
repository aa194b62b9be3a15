#!/usr/bin/env bash
# GPU check (a lent H200, < 6 minutes): cross-platform lowering of every Pallas kernel path, each
# kernel against its reference and timed against the XLA path, the Pallas kernel tests compiled
# for the GPU (not interpret: the `interpret` fixture is False off-CPU) and the kernel
# benchmarks. notebooks/kernels.ipynb runs the same steps. Logs and results go to ${OUT}
# (default /tmp/gpu_check):
#   env.txt, gpu_check.log, summary.json (per-step exit status),
#   lowering.{log,json}   python -m pallas_kernels.lowering (cuda + tpu, small + bench shapes)
#   check_{small,bench}.{log,json}  python -m pallas_kernels.check: numerics + speed table
#                         (--dry-run: small shapes in interpret mode only)
#   pytest.{log,xml}      pytest tests/pallas_kernels (JUnit XML)
#   bench.{log,json}      scripts/bench.py kda dsa mxfp4
#
#   bash scripts/gpu_check.sh              # on the GPU machine, from anywhere
#   bash scripts/gpu_check.sh --dry-run    # any machine, CPU included: environment, the lowering
#                                          # sweep, test collection, benchmark imports; no GPU run
#
# Installs jax[cuda12] with pip only if jax does not already see a GPU (and not in --dry-run).
# Exit status: the first failing step's (later steps still run, so one broken kernel does not
# hide the others' results); 3 when no GPU is visible outside --dry-run.
set -uo pipefail

cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-/tmp/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu_check.log"; }

has_gpu() { "$PY" - <<'EOF' 2>/dev/null
import jax, sys
sys.exit(0 if jax.default_backend() == "gpu" else 1)
EOF
}

status=0
declare -A rcs
step_rc() {  # name rc
  rcs[$1]=$2
  log "$1 exit status $2"
  [ "$status" -eq 0 ] && status=$2
}

if [ "$DRY" -eq 0 ] && ! has_gpu; then
  log "no GPU visible to jax: installing jax[cuda12] (pinned to the installed jax version)"
  JAX_VERSION="$("$PY" -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 0.10.2)"
  timeout 120 "$PY" -m pip install -q "jax[cuda12]==${JAX_VERSION}" 2>&1 | tail -n 5 \
    | tee -a "$OUT/gpu_check.log"
fi
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import jax, jaxlib, platform
print("python", platform.python_version(), "jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("backend", jax.default_backend(), "devices", jax.devices())
EOF
"$PY" -m pip install -q pytest >/dev/null 2>&1 || true

log "lowering: every kernel path, fwd + bwd, for cuda and tpu (python -m pallas_kernels.lowering)"
timeout 300 "$PY" -m pallas_kernels.lowering --json "$OUT/lowering.json" 2>&1 \
  | tee "$OUT/lowering.log"
step_rc lowering "${PIPESTATUS[0]}"

check() {  # size: every kernel vs its reference, timed against the XLA path
  log "check ($1 shapes): python -m pallas_kernels.check --size $1"
  timeout 150 "$PY" -m pallas_kernels.check --size "$1" --json "$OUT/check_$1.json" 2>&1 \
    | tee "$OUT/check_$1.log"
  step_rc "check_$1" "${PIPESTATUS[0]}"
}

if [ "$DRY" -eq 1 ]; then
  check small  # interpret mode off-GPU
  log "dry run: collecting tests/pallas_kernels and importing the benchmarks"
  "$PY" -m pytest tests/pallas_kernels --collect-only -q -p no:cacheprovider 2>&1 | tail -n 3 \
    | tee "$OUT/pytest.log"
  step_rc collect "${PIPESTATUS[0]}"
  "$PY" - <<'EOF' 2>&1 | tee "$OUT/bench.log"
import importlib, sys
sys.path.insert(0, "scripts")
import bench
for name in ("kda", "dsa", "mxfp4"):
    mod = importlib.import_module(bench.BENCHMARKS[name])
    assert callable(mod.run), name
print("benchmarks import: kda dsa mxfp4")
EOF
  step_rc bench_import "${PIPESTATUS[0]}"
elif ! has_gpu; then
  log "no GPU visible to jax after the install attempt: skipping the compiled tests and benchmarks"
  [ "$status" -eq 0 ] && status=3
  rcs[gpu]=3
else
  check small
  check bench
  log "pytest tests/pallas_kernels (compiled kernels, not interpret)"
  timeout 170 "$PY" -m pytest tests/pallas_kernels -q -ra --durations=10 -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
  step_rc pytest "${PIPESTATUS[0]}"

  log "benchmarks: kda dsa mxfp4"
  timeout 110 "$PY" scripts/bench.py kda dsa mxfp4 --json "$OUT/bench.json" 2>&1 \
    | tee "$OUT/bench.log"
  step_rc bench "${PIPESTATUS[0]}"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null \
    | tee -a "$OUT/env.txt"
fi

{
  printf '{"status": %s, "dry_run": %s' "$status" "$([ "$DRY" -eq 1 ] && echo true || echo false)"
  for k in "${!rcs[@]}"; do printf ', "%s": %s' "$k" "${rcs[$k]}"; done
  printf '}\n'
} > "$OUT/summary.json"
log "done, status $status; results in $OUT"
exit "$status"
