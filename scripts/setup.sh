#!/usr/bin/env bash
# Idempotent setup for a fresh Debian 12 machine with Python 3.11, run as root:
#   - Debian packages: bubblewrap (sandbox isolation), python3 (the interpreter used inside the
#     sandbox must be readable by an unprivileged uid, so it is Debian's /usr/bin/python3).
#   - this repository installed editable with its [test] extra.
# Re-running it changes nothing once everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
[ -x /usr/bin/python3 ] || need_apt+=(python3)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup.sh: missing Debian packages ${need_apt[*]}; run as root or: sudo apt-get install -y ${need_apt[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# The sandbox runs bubblewrap unprivileged (as a per-slot uid): it needs user namespaces.
if [ "$(id -u)" = 0 ]; then
  [ "$(cat /proc/sys/kernel/unprivileged_userns_clone 2>/dev/null || echo 1)" != 0 ] || sysctl -qw kernel.unprivileged_userns_clone=1
  [ "$(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo 1)" != 0 ] || sysctl -qw user.max_user_namespaces=15000
  [ "$(cat /proc/sys/kernel/apparmor_restrict_unprivileged_userns 2>/dev/null || echo 0)" != 1 ] || sysctl -qw kernel.apparmor_restrict_unprivileged_userns=0
fi
PY=${PYTHON:-python3}
if ! "$PY" -c "import model, rl, sandbox, pallas_kernels, jax, flax, grain, orbax.checkpoint, pytest" >/dev/null 2>&1 \
   || [ setup.cfg -nt .cache/.installed ]; then
  "$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
  mkdir -p .cache && touch .cache/.installed
fi
