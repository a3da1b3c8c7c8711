"""A worker for tests/test_forkserver.py: what a forked worker sees, and how it ends.

forked_probe.py report [CODE]   one JSON line on stdout (what a fresh interpreter would show)
forked_probe.py raise           an uncaught RuntimeError
forked_probe.py interrupt       an uncaught KeyboardInterrupt
forked_probe.py sysexit MSG     SystemExit(MSG)
forked_probe.py sleep           "sleeping" on stdout, then sleep
forked_probe.py grandchild      start a sleeping child in our process group, print its pid, sleep
forked_probe.py finale          a non-daemon thread and an atexit hook print after main returns
forked_probe.py mark PATH       create PATH, then exit 0
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

PREWARMED = ("email.mime.text", "numpy", "torch")


def report(code: int) -> None:
    numpy_random = sys.modules.get("numpy.random")
    torch = sys.modules.get("torch")
    print(
        json.dumps(
            {
                "argv": sys.argv,
                "orig_argv": sys.orig_argv,
                "path0": sys.path[0],
                "cwd": os.getcwd(),
                "env": dict(os.environ),
                "file": __file__,
                "name": __name__,
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "pgid": os.getpgid(0),
                "sid": os.getsid(0),
                "stdin": os.readlink("/proc/self/fd/0"),
                "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
                "threads": len(os.listdir("/proc/self/task")),
                "write_through": sys.stdout.write_through,
                "line_buffering": sys.stdout.line_buffering,
                "stdout_is_original": sys.stdout is sys.__stdout__,
                "stdio_buffers": [type(s.buffer).__name__ for s in (sys.stdout, sys.stderr)],
                "root_logging": [logging.root.level, len(logging.root.handlers)],
                "handlers": [str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)],
                "faulthandler": faulthandler.is_enabled(),
                "ftrun_modules": sorted(m for m in sys.modules if m.startswith("ftrun")),
                "modules": sorted(m for m in PREWARMED if m in sys.modules),
                "colorsys": "colorsys" in sys.modules,  # imported by no one but a preload
                "random": random.random(),
                "numpy_random": numpy_random.random() if numpy_random else None,
                "torch_seed": torch.initial_seed() if torch else None,
            }
        )
    )
    sys.exit(code)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "report":
        report(int(args[0]) if args else 0)
    elif mode == "raise":
        raise RuntimeError("boom")
    elif mode == "interrupt":
        raise KeyboardInterrupt
    elif mode == "sysexit":
        raise SystemExit(args[0])
    elif mode == "sleep":
        print("sleeping", flush=True)
        time.sleep(600)
    elif mode == "grandchild":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
    elif mode == "finale":
        atexit.register(lambda: print("atexit ran", flush=True))

        def late() -> None:
            time.sleep(0.2)
            print("thread done", flush=True)

        threading.Thread(target=late).start()
        print("main done", flush=True)
    elif mode == "mark":
        open(args[0], "w").close()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
