#!/usr/bin/env bash
# Idempotent set-up of the peers' virtual environments used by the side-by-side benchmarks
# (`python scripts/bench.py peer`, benchmarks/grpo_peer.py). Each peer gets its own environment so
# its pins never touch the project's; both use jax 0.10.2, as the project does, so the comparison
# runs on the same XLA.
#
#   bash scripts/setup_peers.sh                  # into ~/peer-venvs (or $PEER_VENVS)
#   bash scripts/setup_peers.sh --dir /opt/peers # somewhere else (then export PEER_VENVS=/opt/peers
#                                                # for the benchmark)
#   bash scripts/setup_peers.sh tunix            # only one of: tunix ejkernel
#
#   DIR/tunix     google-tunix 0.1.7, jax/jaxlib 0.10.2, flax 0.12.8 (GRPO and sampler peer)
#   DIR/ejkernel  ejkernel 0.0.80.3, jax/jaxlib 0.10.2 (the KDA kernel peer)
#
# An environment whose pinned packages are already installed at these versions is left alone
# (re-running changes nothing); one that is missing or incomplete is created / completed with pip.
set -euo pipefail

dir="${PEER_VENVS:-$HOME/peer-venvs}"
python="${PYTHON:-python3}"
peers=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) [ $# -ge 2 ] || { echo "setup_peers.sh: --dir needs a directory" >&2; exit 2; }
           dir="$2"; shift 2 ;;
    --dir=*) dir="${1#--dir=}"; shift ;;
    tunix|ejkernel) peers+=("$1"); shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "setup_peers.sh: unknown argument '$1' (peers: tunix ejkernel; option: --dir DIR)" >&2
       exit 2 ;;
  esac
done
[ ${#peers[@]} -gt 0 ] || peers=(tunix ejkernel)

pins() {  # the pinned requirements of one peer
  case "$1" in
    tunix) echo "google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8" ;;
    ejkernel) echo "ejkernel==0.0.80.3 jax==0.10.2 jaxlib==0.10.2" ;;
  esac
}

installed() {  # 0 when every pin of $2 is installed at its version in the venv $1
  local venv="$1" req name want have
  [ -x "$venv/bin/python" ] || return 1
  for req in $2; do
    name="${req%%==*}"
    want="${req##*==}"
    have="$("$venv/bin/python" -c 'import sys, importlib.metadata as m
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    print("")' "$name" 2>/dev/null)" || return 1
    [ "$have" = "$want" ] || return 1
  done
}

mkdir -p "$dir"
for peer in "${peers[@]}"; do
  venv="$dir/$peer"
  req="$(pins "$peer")"
  if installed "$venv" "$req"; then
    echo "setup_peers.sh: $venv already has $req"
    continue
  fi
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv" || {
      echo "setup_peers.sh: '$python -m venv' failed; on Debian: apt-get install -y python3-venv" >&2
      exit 1
    }
  fi
  # shellcheck disable=SC2086
  "$venv/bin/pip" install --quiet $req
  installed "$venv" "$req" || { echo "setup_peers.sh: $venv still lacks one of: $req" >&2; exit 1; }
  echo "setup_peers.sh: $venv ready ($req)"
done
