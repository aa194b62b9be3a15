#!/usr/bin/env bash
# GPU check (a lent H200, < 5 minutes): the Pallas kernel tests compiled for the GPU (not interpret:
# the `interpret` fixture is False off-CPU) and the kernel benchmarks, logs teed to ${OUT}.
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# Installs jax[cuda12] from pip only if jax does not already see a GPU. Exit status: the first
# failing step's (later steps still run, so one broken kernel does not hide the others' results).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu_check.log"; }

has_gpu() { python - <<'EOF' 2>/dev/null
import jax, sys
sys.exit(0 if jax.default_backend() == "gpu" else 1)
EOF
}

if ! has_gpu; then
  log "no GPU visible to jax: installing jax[cuda12] (pinned to the installed jax version)"
  JAX_VERSION="$(python -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 0.10.2)"
  python -m pip install -q "jax[cuda12]==${JAX_VERSION}" 2>&1 | tail -n 5 | tee -a "$OUT/gpu_check.log"
fi
python - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import jax, jaxlib, platform
print("python", platform.python_version(), "jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("backend", jax.default_backend(), "devices", jax.devices())
EOF
python -m pip install -q pytest >/dev/null 2>&1 || true

status=0
log "pytest tests/pallas_kernels (compiled kernels, not interpret)"
timeout 170 python -m pytest tests/pallas_kernels -q -ra --durations=10 -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}; [ "$status" -eq 0 ] && status=$rc
log "pytest exit status $rc"

log "benchmarks: kda dsa mxfp4"
timeout 110 python scripts/bench.py kda dsa mxfp4 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}; [ "$status" -eq 0 ] && status=$rc
log "bench exit status $rc"

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tee -a "$OUT/env.txt"
log "done, status $status; logs in $OUT"
exit "$status"
