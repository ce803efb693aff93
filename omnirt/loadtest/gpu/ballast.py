"""A smaller GPU from a larger one: hold all but `--leave-gib` of GPU 0's free memory in this process while a command
runs, so that the command sees the free memory of a smaller card (an 80 GB H100 standing in for a 48 GB L40S).

    python3 -m omnirt.loadtest.gpu.ballast --leave-gib 44.4 -- python3 -m omnirt.loadtest.gpu.diag ...

What it cannot make smaller: the card's total (`torch.cuda.mem_get_info`'s second figure), so a start-up sized by
`gpu_memory_utilization` (a share of the total) is sized as on the larger card; size it by free memory
(`gpu_memory_utilization: null`, KV for `max_num_seqs` requests) to see what the smaller card holds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

GIB = 2**30


def hold_bytes(free: int, leave_gib: float) -> int:
    """What to hold so that `leave_gib` stays free; a card with less free than that cannot stand in."""
    hold = free - int(leave_gib * GIB)
    if hold < 0:
        raise SystemExit(f"ballast: {free / GIB:.2f} GiB free, less than the {leave_gib} GiB to leave")
    return hold


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leave-gib", type=float, required=True, help="GiB of GPU 0 left free for the command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    import torch

    free, total = torch.cuda.mem_get_info()
    ballast = torch.empty(hold_bytes(free, args.leave_gib), dtype=torch.uint8, device="cuda")
    free_now, _ = torch.cuda.mem_get_info()
    print(f"ballast: {ballast.numel() / GIB:.2f} GiB held of a {total / GIB:.2f} GiB card; {free_now / GIB:.2f} GiB "
          "free for the command", flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
