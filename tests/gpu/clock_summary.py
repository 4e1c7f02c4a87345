"""Summarizes an nvidia-smi clock log taken during a GPU run (tests/gpu/run.sh).

Usage: python3 tests/gpu/clock_summary.py clocks.csv

The log comes from ``nvidia-smi --query-gpu=index,clocks.sm,power.draw,
temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader,nounits
-lms 250``. Per GPU it prints, over the samples where the GPU drew more than
BUSY_WATTS (kernels running), the SM clock's median and minimum, the hottest
temperature, and the throttle reasons seen with how often: so that a slow
episode in a benchmark can be matched with a clock drop on one GPU.
"""

import collections
import sys

BUSY_WATTS = 200.0
# Bits of nvidia-smi's clocks_throttle_reasons.active.
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "sw power cap", 0x8: "hw slowdown",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake"}


def _number(field: str) -> float:
    """A reading, or -1 where nvidia-smi has none ("[N/A]")."""
    try:
        return float(field)
    except ValueError:
        return -1.0


def reasons(mask: int) -> str:
    names = [name for bit, name in REASONS.items() if mask & bit]
    return "+".join(names) or "none"


def main(path: str) -> None:
    samples = collections.defaultdict(list)
    for line in open(path):
        fields = [f.strip() for f in line.split(",")]
        try:
            gpu, sm, mask = fields[0], float(fields[1]), int(fields[4], 16)
        except (ValueError, IndexError):
            continue  # a header or a cut line
        watts, temp = (_number(f) for f in fields[2:4])
        samples[gpu].append((sm, watts, temp, mask))
    for gpu, rows in sorted(samples.items()):
        # Busy: drawing power, or (where the VM hides power) not flagged idle.
        busy = [r for r in rows if (r[1] > BUSY_WATTS if r[1] >= 0 else not r[3] & 0x1)]
        if not busy:
            print(f"GPU {gpu}: {len(rows)} samples, none busy")
            continue
        clocks = sorted(r[0] for r in busy)
        seen = collections.Counter(reasons(r[3]) for r in busy)
        watts = max(r[1] for r in busy)
        print(f"GPU {gpu}: {len(busy)}/{len(rows)} busy samples; SM clock median "
              f"{clocks[len(clocks) // 2]:.0f} MHz, min {clocks[0]:.0f}; max "
              f"{f'{watts:.0f} W' if watts >= 0 else 'power n/a'}, "
              f"{max(r[2] for r in busy):.0f} C; reasons "
              + ", ".join(f"{name} x{count}" for name, count in seen.most_common()))


if __name__ == "__main__":
    main(sys.argv[1])
