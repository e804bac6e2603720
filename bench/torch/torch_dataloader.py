#!/usr/bin/env python3
"""The PyTorch DataLoader equivalent of `shard_bench`'s crop+flip rows.

Fashion-MNIST train (IDX, read with numpy), RandomCrop(28, padding=2) +
RandomHorizontalFlip on uint8 (1, 28, 28) tensors, shuffled batches of 256
(drop_last) collated to uint8 tensors, num_workers=2 (persistent). Prints
samples/s as JSON, so it can be run beside

    cargo run --release -p headroom-loader --example shard_bench -- --json

Uses torchvision.transforms.v2 when it is installed, else the same two
transforms written with torch ops (pad with zeros, crop at a uniform offset
in [0, 2 * padding], flip with probability 1/2: what torchvision does).
`--rand-augment` adds torchvision's RandAugment(2, 9) (needs torchvision).

    python3 bench/torch/torch_dataloader.py [--dir DIR] [--workers 2]
        [--epochs 2] [--batch-size 256] [--rand-augment]
"""

import argparse
import gc
import gzip
import json
import os
import resource
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def read_idx(path):
    """An IDX file (raw or gzip) as a numpy uint8 array."""
    opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(directory, stem):
    for name in (stem, stem + ".gz"):
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"{stem}[.gz] not found in {directory}")


class RandomCropFlip:
    """RandomCrop(size, padding) + RandomHorizontalFlip(0.5) on a CHW tensor."""

    def __init__(self, padding):
        self.padding = padding

    def __call__(self, img):
        p = self.padding
        _, h, w = img.shape
        padded = torch.nn.functional.pad(img, (p, p, p, p))
        dy = int(torch.randint(0, 2 * p + 1, (1,)))
        dx = int(torch.randint(0, 2 * p + 1, (1,)))
        out = padded[:, dy : dy + h, dx : dx + w]
        if torch.rand(1).item() < 0.5:
            out = out.flip(-1)
        return out.contiguous()


def transforms(rand_augment):
    try:
        from torchvision.transforms import v2

        ops = [v2.RandomCrop(28, padding=2), v2.RandomHorizontalFlip()]
        if rand_augment:
            ops.append(v2.RandAugment(num_ops=2, magnitude=9))
        return v2.Compose(ops), "torchvision.transforms.v2"
    except ImportError:
        if rand_augment:
            raise SystemExit("--rand-augment needs torchvision")
        return RandomCropFlip(2), "torch ops (torchvision not installed)"


class FashionMnist(Dataset):
    def __init__(self, directory, transform):
        self.images = torch.from_numpy(
            read_idx(find(directory, "train-images-idx3-ubyte")).copy()
        ).unsqueeze(1)  # N, 1, 28, 28 uint8
        self.labels = torch.from_numpy(
            read_idx(find(directory, "train-labels-idx1-ubyte")).astype(np.int64)
        )
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(self.images[i]), self.labels[i]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rand-augment", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    transform, impl = transforms(args.rand_augment)
    ds = FashionMnist(args.dir, transform)
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        prefetch_factor=2 if args.workers > 0 else None,
    )

    def epoch():
        n, checksum = 0, 0
        for x, y in loader:
            assert x.dtype == torch.uint8 and x.shape[1:] == (1, 28, 28)
            n += x.shape[0]
            checksum += int(x[0, 0, 14, 14]) + int(y[0])
        return n

    epoch()  # warm-up: worker start
    t = time.perf_counter()
    samples = sum(epoch() for _ in range(args.epochs))
    secs = time.perf_counter() - t
    # Shut the workers down so that their peak RSS is counted in CHILDREN.
    del loader
    gc.collect()
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "source": "torch DataLoader, in-memory uint8 tensors",
                "augment": "crop+flip" + ("+RA(2,9)" if args.rand_augment else ""),
                "transforms": impl,
                "workers": args.workers,
                "batch_size": args.batch_size,
                "samples_per_s": round(samples / secs),
                "epoch_s": secs / args.epochs,
                "peak_rss_bytes_main": self_rss,
                "peak_rss_bytes_largest_worker": child_rss,
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
