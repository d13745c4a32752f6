"""A job that holds /dev/shm: two DataLoader workers hand 16 MiB batches over shared memory."""

import time

import torch
from torch.utils.data import DataLoader, Dataset


class Items(Dataset):
    def __len__(self) -> int:
        return 160

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(256, 1024)  # 1 MiB


if __name__ == "__main__":
    for _batch in DataLoader(Items(), batch_size=16, num_workers=2, prefetch_factor=4):
        time.sleep(0.4)  # the trainer is slow: batches wait in /dev/shm
