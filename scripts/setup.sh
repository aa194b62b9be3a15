#!/usr/bin/env bash
# Idempotent setup for a fresh Debian 12 machine with Python 3.11, run as root:
#
#   bash scripts/setup.sh            # a virtual environment in .venv (then: .venv/bin/python ...,
#                                    # or `source .venv/bin/activate`)
#   bash scripts/setup.sh --system   # install into the current python3 instead (Colab, or an
#                                    # environment you manage yourself, e.g. an activated conda/venv)
#
# What it does:
#   - Debian packages: bubblewrap (sandbox isolation); libjemalloc2 (the allocator the scripts
#     run on, runtime/xla_env.py); python3 (the interpreter used inside the
#     sandbox must be readable by an unprivileged uid, so it is Debian's /usr/bin/python3);
#     python3-venv when the venv module cannot create environments (Debian splits it out).
#   - user namespaces enabled where a sysctl disables them (bubblewrap runs unprivileged).
#   - this repository installed editable with its [test] extra (and inspect-evals without its
#     dependencies: AgentBench's task data), into .venv (created from
#     $PYTHON, default /usr/bin/python3: on Debian 12 that interpreter is "externally managed"
#     (PEP 668), so pip refuses to install into it directly) or, with --system, into $PYTHON
#     (default python3).
# Re-running it changes nothing once everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=venv
for arg in "$@"; do
  case "$arg" in
    --system) mode=system ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (use --system, or nothing for .venv)" >&2; exit 2 ;;
  esac
done

apt_install() {
  if [ "$(id -u)" != 0 ]; then
    echo "setup.sh: missing Debian packages $*; run as root or: sudo apt-get install -y $*" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "$@" >/dev/null
}

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
[ -x /usr/bin/python3 ] || need_apt+=(python3)
# jemalloc: the scripts run on it (runtime/xla_env.py:use_jemalloc; glibc re-faults XLA:CPU's
# large temporary buffers on every step). Optional: without it they run on glibc's malloc.
if ! compgen -G "/usr/lib/*-linux-gnu/libjemalloc.so.2" >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    need_apt+=(libjemalloc2)
  else
    echo "setup.sh: libjemalloc2 is not installed; the scripts will use glibc's malloc (slower" \
         "steps, runtime/xla_env.py): sudo apt-get install -y libjemalloc2" >&2
  fi
fi
if [ ${#need_apt[@]} -gt 0 ]; then apt_install "${need_apt[@]}"; fi

# The sandbox runs bubblewrap unprivileged (as a per-slot uid): it needs user namespaces.
if [ "$(id -u)" = 0 ]; then
  [ "$(cat /proc/sys/kernel/unprivileged_userns_clone 2>/dev/null || echo 1)" != 0 ] || sysctl -qw kernel.unprivileged_userns_clone=1
  [ "$(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo 1)" != 0 ] || sysctl -qw user.max_user_namespaces=15000
  [ "$(cat /proc/sys/kernel/apparmor_restrict_unprivileged_userns 2>/dev/null || echo 0)" != 1 ] || sysctl -qw kernel.apparmor_restrict_unprivileged_userns=0
fi

if [ "$mode" = venv ]; then
  base=${PYTHON:-/usr/bin/python3}
  venv=${VENV:-.venv}
  if [ ! -x "$venv/bin/python" ]; then
    # Debian ships venv without ensurepip unless python3-venv is installed.
    if ! "$base" -c "import venv, ensurepip" >/dev/null 2>&1; then
      ver=$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      apt_install "python${ver}-venv"
    fi
    rm -rf "$venv"  # a half-made environment from an interrupted run
    "$base" -m venv "$venv"
  fi
  PY=$venv/bin/python
  stamp=$venv/.kpj-installed
else
  PY=${PYTHON:-python3}
  stamp=.cache/.installed-$("$PY" -c 'import sys, hashlib; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:8])')
fi

if ! "$PY" -c "import model, rl, sandbox, pallas_kernels, jax, flax, grain, orbax.checkpoint, pytest" >/dev/null 2>&1 \
   || [ ! -e "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
  "$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
  mkdir -p "$(dirname "$stamp")" && touch "$stamp"
fi
# AgentBench's OS tasks (sandbox/tasks/agentbench.py) are read from inspect-evals' data files;
# the package is never imported, so its dependencies (inspect_ai, Docker tooling) are left out
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('inspect_evals') is None)" 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "inspect-evals==0.28.0"
fi
