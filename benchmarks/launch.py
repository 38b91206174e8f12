"""A small launcher between the benchmark and each measured process, so that the peak memory read is
the process's own.

    python -S benchmarks/launch.py USAGE_FILE CMD [ARGS...]

Linux keeps a process's peak resident size across exec, counting the memory of the process that forked
it: children forked straight from the benchmark (by then a large process itself) all read its size.
This launcher is a few MB, so the peak of the child it forks and waits for is the child's own. It writes
{"maxrss_kb", "cpu_s"} of that child to USAGE_FILE and exits with the child's exit status.
"""

import json
import os
import sys

usage_file, cmd = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(usage_file, "w") as f:
    json.dump({"maxrss_kb": usage.ru_maxrss, "cpu_s": usage.ru_utime + usage.ru_stime}, f)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
