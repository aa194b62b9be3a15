#!/bin/bash
cd /app
for f in logs/*.log; do echo "$(basename "$f" .log) $(grep -c ERROR "$f")"; done > report.txt
