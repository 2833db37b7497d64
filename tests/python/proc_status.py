"""This process's /proc/self/status fields and its peak-RSS reset, for the
Python sides of the benchmarks (the C++ side: tests/testing/proc_status.h)."""


def status_kb(key):
    """The field `key` of /proc/self/status in kB (VmRSS, VmHWM, ...); -1 when absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def clear_refs():
    """VmHWM := VmRSS (writes 5 to /proc/self/clear_refs); False where that fails."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
