#!/usr/bin/env python3
"""The reference ResNet in PyTorch, timed the way `cargo xtask bench` times
headroom: one training step (forward, backward, clip, AdamW step) on random
Fashion-MNIST-shaped data, after a warm-up, channels_last. Prints one JSON
object on stdout.

On the CPU: f32, a fixed thread count.
    python3 bench/torch_resnet.py --threads 2 --batch 128 --steps 20
On a GPU, PyTorch at its best for this model: AMP (f16 autocast with a
GradScaler), channels_last, the fused AdamW and torch.compile (unless
--no-compile); it reports peak device memory too.
    python3 bench/torch_resnet.py --device cuda --batch 512 --steps 50
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
    parser.add_argument("--threads", type=int)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-compile", action="store_true", help="GPU: skip torch.compile")
    args = parser.parse_args()
    if args.device == "cpu" and args.threads is None:
        parser.error("--threads is required on the CPU")

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    device = torch.device(args.device)
    model = reference_resnet().to(device=device, memory_format=torch.channels_last)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=2e-3, weight_decay=1e-4, **({"fused": True} if cuda else {})
    )
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    x = torch.randn(args.batch, 1, 28, 28, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device=device)
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)
    forward = model if not cuda or args.no_compile else torch.compile(model)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.float16, enabled=cuda):
            loss = loss_fn(forward(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return loss

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    report = {
        "framework": "pytorch",
        "version": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "batch": args.batch,
        "threads": args.threads or 0,
        "steps": args.steps,
        "samples_per_sec": args.batch * args.steps / seconds,
        "step_ms": seconds / args.steps * 1e3,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "parameters": params,
    }
    if cuda:
        report["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        report["compiled"] = not args.no_compile
    print(json.dumps(report))


if __name__ == "__main__":
    main()
