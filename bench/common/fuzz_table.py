"""`make fuzz`'s table: each target's inputs tried and whether it held, from the report lines
tests/fuzz/test_fuzz.py appends (`FTRUN_FUZZ_REPORT`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    path = Path(sys.argv[1])
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print("| target | inputs tried | failures |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['target']} | {row['inputs']:,} | {row.get('failures', 0)} |")


if __name__ == "__main__":
    main()
