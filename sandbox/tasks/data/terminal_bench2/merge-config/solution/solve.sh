#!/bin/bash
awk -F= '{v[$1]=$2} END {for (k in v) print k "=" v[k]}' /opt/defaults/app.ini /app/overrides.ini \
  | sort > /app/merged.ini
