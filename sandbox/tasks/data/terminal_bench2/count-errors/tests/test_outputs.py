import pathlib
import sys

EXPECTED = ["api 3", "cache 0", "db 2"]
report = pathlib.Path("/app/report.txt")
if not report.is_file():
    sys.exit("no /app/report.txt")
lines = [line.strip() for line in report.read_text().splitlines() if line.strip()]
if lines != EXPECTED:
    sys.exit(f"report {lines} != {EXPECTED}")
