"""Preprocesses an image folder the PyTorch way, the baseline beside
`cargo xtask preprocess --kind image_folder` (`cargo xtask
bench-loader-one --mode image_folder`, which writes the folder and runs
this script on it under the same cores). Prints one JSON line: images,
seconds of the fastest of --repeat passes, images/s.

    python3 bench/torch/torchvision_imagefolder.py DIR --workers 2 [--repeat 3]

For each split (DIR/train, DIR/test): torchvision's `ImageFolder` (PIL
decodes each file), `PILToTensor` (uint8, as headroom's store keeps
pixels, no float conversion), a `DataLoader` with --workers worker
processes (0: in this process) and batches of 256, every batch gathered
into one uint8 tensor with its labels and written with `torch.save`: the
same work as packing the store (decode, fit, write).
"""

import argparse
import json
import os
import tempfile
import time

import torch
import torchvision
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def one_pass(root, workers, out_dir):
    images = 0
    for split in ("train", "test"):
        folder = datasets.ImageFolder(
            os.path.join(root, split),
            transform=transforms.Compose(
                [transforms.Grayscale(1), transforms.PILToTensor()]
            ),
        )
        loader = DataLoader(
            folder,
            batch_size=256,
            num_workers=workers,
            shuffle=False,
            persistent_workers=False,
        )
        pixels, labels = [], []
        for x, y in loader:
            pixels.append(x)
            labels.append(y)
        pixels = torch.cat(pixels)
        labels = torch.cat(labels)
        torch.save({"pixels": pixels, "labels": labels}, os.path.join(out_dir, split + ".pt"))
        images += len(labels)
    return images


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    best = None
    images = 0
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(max(1, args.repeat)):
            start = time.perf_counter()
            images = one_pass(args.dir, args.workers, out_dir)
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
    print(
        json.dumps(
            {
                "reader": f"torchvision {torchvision.__version__} ImageFolder + PIL, "
                f"{args.workers} workers",
                "images": images,
                "seconds": best,
                "images_per_s": images / best,
            }
        )
    )


if __name__ == "__main__":
    main()
