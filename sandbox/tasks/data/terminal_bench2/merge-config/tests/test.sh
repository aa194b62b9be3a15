#!/bin/bash
# Terminal-Bench 2 verifier: here the exit code decides (no reward file).
expected=$'cache=on\nlog_level=debug\nport=8080\ntimeout=30\nworkers=8'
[ -f /app/merged.ini ] || exit 1
[ "$(grep -v '^[[:space:]]*$' /app/merged.ini)" = "$expected" ]
