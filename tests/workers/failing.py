"""Every cycle, rank 1 exits with code 3 at once; the others wait to be stopped."""

import os
import sys
import time

if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(600)
