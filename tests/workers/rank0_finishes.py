"""Rank 0 prints its cycle info and finishes at once; every other rank runs until stopped."""

import os
import sys
import time
from pathlib import Path

if os.environ["RANK"] == "0":
    print(Path(os.environ["FTRUN_CYCLE_INFO"]).read_text(), flush=True)
    sys.exit(0)
time.sleep(600)
