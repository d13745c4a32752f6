"""Two gloo ranks; rank 1 fails (exit 1) after joining the group, as a crashed rank does."""

import os
import sys

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        sys.stderr.write("rank 1: failing on purpose\n")
        os._exit(1)
    dist.barrier()  # rank 0 waits for a rank that is gone; torchrun stops it
