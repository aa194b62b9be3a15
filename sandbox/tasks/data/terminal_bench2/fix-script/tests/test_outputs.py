import subprocess
import sys

CASES = {"3 1 4 1 5 9": ("3.83", "3.50"), "10 2 7": ("6.33", "7.00"), "5": ("5.00", "5.00"),
         "-1.5 4 2.5 8": ("3.25", "3.25")}
for i, (numbers, expected) in enumerate(CASES.items()):
    path = f"/tmp/stats_case_{i}.txt"
    with open(path, "w") as f:
        f.write("\n".join(numbers.split()) + "\n")
    out = subprocess.run([sys.executable, "/app/stats.py", path], capture_output=True, text=True,
                         timeout=10)
    got = tuple(out.stdout.split())
    if got != expected:
        sys.exit(f"{numbers}: got {got}, expected {expected}")
