#!/bin/bash
cd /app
sed -i 's|sum(nums) // len(nums)|sum(nums) / len(nums)|' stats.py
sed -i 's|median = nums\[len(nums) // 2\]|s = sorted(nums); k = len(s) // 2; median = s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2|' stats.py
