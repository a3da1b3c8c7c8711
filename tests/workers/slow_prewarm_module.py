"""A prewarm module that takes SLOW_PREWARM_S seconds to import (default 3), then writes its
monotonic end to SLOW_PREWARM_MARK: the fork server's deep import in the cycle tests."""

import os
import time

time.sleep(float(os.environ.get("SLOW_PREWARM_S", "3")))
IMPORTED_AT = time.monotonic()
if os.environ.get("SLOW_PREWARM_MARK"):
    with open(os.environ["SLOW_PREWARM_MARK"], "w") as mark:
        mark.write(repr(IMPORTED_AT))
