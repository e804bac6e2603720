#!/usr/bin/env python3
"""The default headroom job (experiments/fashion_mnist.toml) in PyTorch, end
to end, for the wall-time comparison of the whole job: data loading with
torch's DataLoader, training and evaluation included.

The same recipe: the model of experiments/fashion_mnist.toml (built by
torch_models.py), random crop (2 pixels of zero padding) and horizontal
flip, batch 64, AdamW (lr 3e-3,
weight decay 1e-4 on conv and linear weights only, betas 0.9/0.999),
OneCycleLR (pct_start 0.3, div_factor 25, final_div_factor 1e4, cosine),
label smoothing 0.1, gradient clipping at norm 1.0, 5 epochs, test accuracy
with flip test-time augmentation after every epoch. On a GPU PyTorch at its
best for this model: AMP (f16 autocast, GradScaler), channels_last, the
fused AdamW, torch.compile (unless --no-compile) and a DataLoader with
pinned memory and persistent workers. Prints one JSON object on stdout.

    python3 bench/torch/torch_fashion_mnist.py --device cuda --data /usr/share/datasets/fashion-mnist
    python3 bench/torch/torch_fashion_mnist.py --device cpu --threads 2 --train-samples 2048 --epochs 1

`--config-json` (what `cargo xtask bench-job --compare-torch` writes: the
resolved experiment) takes the model and the recipe from that experiment
instead: epochs, batch, lr, weight decay, betas, eps, label smoothing,
clipping, the one-cycle schedule's factors, crop padding, flip and the
test-time augmentation; a recipe this script cannot follow (another
schedule, loss or data format) is refused, naming the key.
"""
import argparse
import gzip
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn

from torch_models import experiment, model_from_spec

MEAN, STD = 0.2860, 0.3530


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    dims = magic & 0xFF
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return np.frombuffer(bytearray(data), dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_split(directory, prefix, limit):
    def find(name):
        for candidate in (name + ".gz", name):
            path = os.path.join(directory, candidate)
            if os.path.exists(path):
                return path
        raise SystemExit(f"{name}(.gz) not found in {directory}")

    images = read_idx(find(f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(find(f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    if limit:
        images, labels = images[:limit], labels[:limit]
    return images, labels


class CropFlip(torch.utils.data.Dataset):
    """u8 images with torchvision's RandomCrop(28, padding=2) and
    RandomHorizontalFlip, done in numpy (no torchvision needed)."""

    def __init__(self, images, labels, pad, flip):
        self.images, self.labels, self.pad, self.flip = images, labels, pad, flip

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        h, w = image.shape
        if self.pad:
            padded = np.zeros((h + 2 * self.pad, w + 2 * self.pad), dtype=np.uint8)
            padded[self.pad : self.pad + h, self.pad : self.pad + w] = image
            dy, dx = np.random.randint(0, 2 * self.pad + 1, size=2)
            image = padded[dy : dy + h, dx : dx + w]
        if self.flip and np.random.rand() < 0.5:
            image = image[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(image)).unsqueeze(0), self.labels[i]


def seed_numpy(worker):
    """Each worker (and epoch) its own numpy stream, from the seed torch gives
    it; without this, forked workers would repeat the same crops."""
    np.random.seed(torch.initial_seed() % 2**32)


def param_groups(model, weight_decay):
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class Recipe:
    """The job's settings: the default experiment's, or those of the
    resolved experiment given as --config-json."""

    def __init__(self, args):
        self.model = experiment("fashion_mnist.toml")["model"]
        self.epochs, self.batch, self.lr = args.epochs, args.batch, args.lr
        self.weight_decay, self.betas, self.eps = 1e-4, (0.9, 0.999), 1e-8
        self.label_smoothing, self.clip_norm = 0.1, 1.0
        self.pct_start, self.div_factor, self.final_div_factor = 0.3, 25.0, 1e4
        self.crop_padding, self.flip, self.tta = 2, True, True
        self.train_samples, self.test_samples = args.train_samples, args.test_samples
        if args.config_json:
            with open(args.config_json) as f:
                self.follow(json.load(f))

    def follow(self, config):
        def refuse(key, value, wanted):
            raise SystemExit(f"torch_fashion_mnist.py: {key} = {value!r}: this script runs {wanted} only")

        data = config.get("data", {})
        if data.get("format", "idx") != "idx":
            refuse("data.format", data.get("format"), "idx (Fashion-MNIST)")
        train, optimizer = config.get("train", {}), config.get("optimizer", {})
        if train.get("loss", "cross_entropy") != "cross_entropy":
            refuse("train.loss", train.get("loss"), "cross_entropy")
        if train.get("accumulate", 1) != 1:
            refuse("train.accumulate", train.get("accumulate"), "1")
        schedule = config.get("schedule", {"kind": "constant"})
        if schedule.get("kind") != "one_cycle":
            refuse("schedule.kind", schedule.get("kind"), "one_cycle")
        self.model = config["model"]
        self.train_samples = data.get("train_samples", 0) or self.train_samples
        self.test_samples = data.get("test_samples", 0) or self.test_samples
        self.epochs, self.batch = train["epochs"], train["batch_size"]
        self.label_smoothing = train.get("label_smoothing", 0.0)
        self.clip_norm = train.get("clip_norm", 0.0)
        self.lr = optimizer["lr"]
        self.weight_decay = optimizer.get("weight_decay", 0.0)
        self.betas = (optimizer.get("beta1", 0.9), optimizer.get("beta2", 0.999))
        self.eps = optimizer.get("eps", 1e-8)
        self.pct_start = schedule.get("pct_start", 0.3)
        self.div_factor = schedule.get("div_factor", 25.0)
        self.final_div_factor = schedule.get("final_div_factor", 1e4)
        augment = config.get("augment", {})
        self.crop_padding = augment.get("crop_padding", 0)
        self.flip = augment.get("flip", False)
        self.tta = config.get("eval", {}).get("tta", "none") == "flip"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--train-samples", type=int, default=0, help="0 = all")
    parser.add_argument("--test-samples", type=int, default=0, help="0 = all")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-json", help="the resolved experiment, as cargo xtask bench-job writes it")
    args = parser.parse_args()
    recipe = Recipe(args)

    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    cuda = args.device == "cuda"
    device = torch.device(args.device)

    train_images, train_labels = load_split(args.data, "train", recipe.train_samples)
    test_images, test_labels = load_split(args.data, "t10k", recipe.test_samples)
    loader = torch.utils.data.DataLoader(
        CropFlip(train_images, train_labels, pad=recipe.crop_padding, flip=recipe.flip),
        batch_size=recipe.batch,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=cuda,
        persistent_workers=args.workers > 0,
        worker_init_fn=seed_numpy,
    )
    test_x = torch.from_numpy(test_images).unsqueeze(1)
    test_y = torch.from_numpy(test_labels)

    model = model_from_spec(recipe.model)
    model = model.to(device=device, memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(
        param_groups(model, recipe.weight_decay), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
        **({"fused": True} if cuda else {})
    )
    total_steps = recipe.epochs * len(loader)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=recipe.lr, total_steps=total_steps, pct_start=recipe.pct_start,
        div_factor=recipe.div_factor, final_div_factor=recipe.final_div_factor, anneal_strategy="cos",
    )
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)
    forward = model if not cuda or args.no_compile else torch.compile(model)

    def normalise(x_u8):
        x = x_u8.to(device, non_blocking=True).float().div_(255.0).sub_(MEAN).div_(STD)
        return x.contiguous(memory_format=torch.channels_last)

    def evaluate():
        model.eval()
        correct = 0
        with torch.no_grad(), torch.autocast(args.device, dtype=torch.float16, enabled=cuda):
            for start in range(0, len(test_y), 1000):
                x = normalise(test_x[start : start + 1000])
                probabilities = forward(x).float().softmax(1)
                if recipe.tta:
                    probabilities = probabilities + forward(x.flip(3)).float().softmax(1)
                correct += (probabilities.argmax(1).cpu() == test_y[start : start + 1000]).sum().item()
        model.train()
        return correct / len(test_y)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # Start-up: imports, reading the data, building the model and loader
    # (the DataLoader's workers start with the first epoch's iterator).
    setup_seconds = time.perf_counter() - started
    epochs = []
    train_seconds = 0.0
    for epoch in range(recipe.epochs):
        epoch_started = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for x_u8, y in loader:
            x, y = normalise(x_u8), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=torch.float16, enabled=cuda):
                loss = loss_fn(forward(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            if recipe.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            loss_sum += loss.detach()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - epoch_started
        train_seconds += seconds
        eval_started = time.perf_counter()
        accuracy = evaluate()
        eval_seconds = time.perf_counter() - eval_started
        epochs.append({
            "epoch": epoch + 1,
            "train_loss": loss_sum.item() / len(loader),
            "train_seconds": seconds,
            "eval_seconds": eval_seconds,
            "test_accuracy": accuracy,
        })
        print(f"epoch {epoch + 1}: {seconds:.1f} s, test accuracy {100 * accuracy:.2f}%", file=sys.stderr)

    report = {
        "framework": "pytorch",
        "version": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "job": f"fashion_mnist: {recipe.epochs} epochs, batch {recipe.batch}, crop {recipe.crop_padding}, "
        f"flip {recipe.flip}, flip TTA {recipe.tta}",
        "compiled": cuda and not args.no_compile,
        "dataloader_workers": args.workers,
        "wall_seconds": time.perf_counter() - started,
        "setup_seconds": setup_seconds,
        "train_seconds": train_seconds,
        "train_samples_per_sec": total_steps * recipe.batch / train_seconds,
        "test_accuracy": epochs[-1]["test_accuracy"] if epochs else None,
        "epochs": epochs,
    }
    if cuda:
        report["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
