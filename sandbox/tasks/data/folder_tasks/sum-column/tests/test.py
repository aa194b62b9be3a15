import sys

try:
    with open("total.txt", encoding="utf-8", errors="replace") as f:
        got = f.read().strip()
except OSError:
    sys.exit("total.txt is missing")
sys.exit(0 if got == "195" else f"total.txt holds {got[:40]!r}, not the north total")
