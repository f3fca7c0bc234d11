"""The CPU of a command's whole process tree: `python bench/tree_cpu.py CMD ARGS...` runs CMD as a child
subreaper (Linux), so the processes it leaves behind (a fork server, an `mlflow server` stopped with
killpg, a runner's orphaned workers) are reparented here and reaped, and their CPU counts too; it prints
user, sys and their total in seconds and the wall time to stderr and exits with CMD's status.

How the test suite's cuts were measured (bench/RESULTS.md, session 17), e.g.
`python bench/tree_cpu.py .venv/bin/python -m pytest -q -p no:randomly -n 0 tests/test_detector.py`."""
import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36

if __name__ == "__main__":
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    t0 = time.time()
    rc = subprocess.call(sys.argv[1:])
    while True:  # every descendant, orphans included
        try:
            os.wait()
        except ChildProcessError:
            break
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"CPU user {r.ru_utime:.1f} sys {r.ru_stime:.1f} total {r.ru_utime + r.ru_stime:.1f} "
          f"wall {time.time() - t0:.1f} rc {rc}", file=sys.stderr)
    sys.exit(rc)
