#!/usr/bin/env python3
"""The reference ResNet in PyTorch, timed the way `cargo xtask bench` times
headroom: one training step (forward, backward, AdamW step) on random
Fashion-MNIST-shaped data, after a warm-up, channels_last, a fixed thread
count. Prints one JSON object per batch size on stdout.

    python3 bench/torch_resnet.py --threads 2 --batch 128 --steps 20
"""
import argparse
import json
import resource
import time

import torch
import torch.nn as nn


def conv_bn_relu(cin, cout, stride):
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(
            *conv_bn_relu(c, c, 1), nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + x)


def reference_resnet():
    return nn.Sequential(
        *conv_bn_relu(1, 32, 1), BasicBlock(32),
        *conv_bn_relu(32, 64, 2), BasicBlock(64),
        *conv_bn_relu(64, 128, 2), BasicBlock(128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = reference_resnet().to(memory_format=torch.channels_last)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    x = torch.randn(args.batch, 1, 28, 28).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - started
    print(json.dumps({
        "framework": "pytorch",
        "version": torch.__version__,
        "batch": args.batch,
        "threads": args.threads,
        "steps": args.steps,
        "samples_per_sec": args.batch * args.steps / seconds,
        "step_ms": seconds / args.steps * 1e3,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "parameters": params,
    }))


if __name__ == "__main__":
    main()
