"""What this process keeps resident of a mapped file (Linux's /proc/self/smaps)."""

from __future__ import annotations

from pathlib import Path

HAS_SMAPS = Path("/proc/self/smaps").exists()


def resident_kb(path: Path | str) -> tuple[int, int]:
    """(mappings of `path` in this process, their resident kB)."""
    count = rss = 0
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header
            inside = len(fields) > 5 and fields[5] == str(path)
            count += inside
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1])
    return count, rss
