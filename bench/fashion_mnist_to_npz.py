"""Writes Fashion-MNIST as a directory of preprocessed .npz batches, the
layout `data.format = "tensors"` reads: OUT/train/partNNN.npz and
OUT/test/partNNN.npz, each with `x` (uint8 [rows, 28, 28, 1]) and `y`
(int64 [rows]). Used to measure the lazy tensor-file workflow
(docs/measurements).

    python3 bench/fashion_mnist_to_npz.py [--rows 5000] [--src DIR] OUT
"""

import argparse
import gzip
import os

import numpy as np


def read_idx(path):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=5000, help="rows per file")
    parser.add_argument("--src", default="/usr/share/datasets/fashion-mnist")
    args = parser.parse_args()
    for split, stem in [("train", "train"), ("test", "t10k")]:
        images = read_idx(os.path.join(args.src, f"{stem}-images-idx3-ubyte.gz"))
        labels = read_idx(os.path.join(args.src, f"{stem}-labels-idx1-ubyte.gz"))
        folder = os.path.join(args.out, split)
        os.makedirs(folder, exist_ok=True)
        for k, start in enumerate(range(0, len(images), args.rows)):
            x = images[start : start + args.rows].reshape(-1, 28, 28, 1)
            y = labels[start : start + args.rows].astype(np.int64)
            np.savez(os.path.join(folder, f"part{k:03}.npz"), x=x, y=y)
        print(f"{split}: {len(images)} rows in {k + 1} files under {folder}")


if __name__ == "__main__":
    main()
