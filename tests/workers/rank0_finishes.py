"""Rank 0 finishes at once; every other rank runs until it is stopped."""

import os
import sys
import time

if os.environ["RANK"] == "0":
    sys.exit(0)
time.sleep(600)
