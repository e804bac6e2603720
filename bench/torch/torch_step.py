#!/usr/bin/env python3
"""An experiment's training step in PyTorch, timed the way `cargo xtask
bench` times headroom's: forward, loss, backward, clip and AdamW on fixed
random data in the experiment's layout, after a warm-up. The model is the
PyTorch equivalent of the experiment's `[model]` (torch_models.py), and the
step uses its settings: label smoothing, clip norm, AdamW (weight decay on
weights of two or more dimensions), fine-tuning freezes. Prints one JSON
object on stdout, with the parameter counts as headroom counts them, so
that the caller can refuse a ratio between two different models.

The experiment comes as the JSON of the resolved config that `cargo xtask
bench --compare-torch` writes (`--config-json`) or as an experiment file
(`--experiment experiments/tiny_gpt.toml`).

On the CPU: f32, a fixed thread count, eager (`--compile-on-cpu` adds
torch.compile, which was slower than eager on the 2-core EPYC; see docs/measurements/cpu-epyc-avx2.md).
    python3 bench/torch/torch_step.py --experiment experiments/fashion_mnist.toml --threads 2 --batch 128
On a GPU, PyTorch at its best: AMP (f16 autocast with a GradScaler),
channels_last, the fused AdamW and torch.compile (unless --no-compile;
`--compile-mode reduce-overhead` adds CUDA graphs); it reports peak device
memory too.
    python3 bench/torch/torch_step.py --experiment experiments/fashion_mnist.toml --device cuda --batch 512
"""
import argparse
import json
import resource
import sys
import time
import tomllib

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_models import SpecError, apply_finetune, counted_parameters, model_from_spec


def load_config(args):
    if args.config_json:
        with open(args.config_json) as f:
            return json.load(f)
    with open(args.experiment, "rb") as f:
        return tomllib.load(f)


def synthetic_inputs(model, batch, device):
    """Input and target of a step: token ids and next ids; frames and the
    next frames in [0, 1]; images and class labels."""
    generator = torch.Generator().manual_seed(0)
    tokens = model.get("tokens")
    if tokens:
        ids = torch.randint(0, tokens["vocab"], (batch, tokens["length"] + 1), generator=generator)
        return ids[:, :-1].to(device), ids[:, 1:].to(device)
    h, w, c = model["input"]
    images = batch * (model.get("frames") or 1)
    x = torch.randn(images, c, h, w, generator=generator)
    x = x.to(device).contiguous(memory_format=torch.channels_last)
    if model.get("frames"):
        target = torch.rand(images, c, h, w, generator=generator).to(device)
        return x, target.contiguous(memory_format=torch.channels_last)
    classes = next(layer["out"] for layer in reversed(model["layers"]) if "out" in layer)
    return x, torch.randint(0, classes, (batch,), generator=generator).to(device)


def loss_function(config):
    model, train = config["model"], config["train"]
    if train.get("loss", "cross_entropy") != "cross_entropy":
        raise SpecError(f"train.loss = {train['loss']!r}: only cross_entropy is mirrored")
    if model.get("frames"):
        return F.mse_loss
    smoothing = train.get("label_smoothing", 0.0)
    if model.get("tokens"):
        return lambda logits, target: F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), label_smoothing=smoothing
        )
    return lambda logits, target: F.cross_entropy(logits, target, label_smoothing=smoothing)


def optimizer_for(module, settings, cuda):
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": settings.get("weight_decay", 0.0)},
        {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=settings["lr"],
        betas=(settings.get("beta1", 0.9), settings.get("beta2", 0.999)),
        eps=settings.get("eps", 1e-8),
        **({"fused": True} if cuda else {}),
    )


def main():
    parser = argparse.ArgumentParser()
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config-json", help="the resolved config, as cargo xtask bench writes it")
    source.add_argument("--experiment", help="an experiment file (TOML)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-compile", action="store_true", help="GPU: skip torch.compile")
    parser.add_argument(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune"],
        default="default",
        help="torch.compile's mode (reduce-overhead replays CUDA graphs, as headroom does)",
    )
    parser.add_argument(
        "--compile-on-cpu",
        action="store_true",
        help="CPU: torch.compile too (off by default: slower than eager there, see docs/measurements/cpu-epyc-avx2.md)",
    )
    args = parser.parse_args()
    if args.device == "cpu" and args.threads is None:
        parser.error("--threads is required on the CPU")

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    device = torch.device(args.device)
    config = load_config(args)
    try:
        module = model_from_spec(config["model"])
        loss_fn = loss_function(config)
    except SpecError as e:
        sys.exit(f"torch_step.py: {e}")
    apply_finetune(module, config.get("finetune"))
    module = module.to(device=device, memory_format=torch.channels_last)
    parameters, trainable = counted_parameters(module)
    optimizer = optimizer_for(module, config["optimizer"], cuda)
    clip = config["train"].get("clip_norm", 0.0)
    x, target = synthetic_inputs(config["model"], args.batch, device)
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)
    compiled = (cuda and not args.no_compile) or (not cuda and args.compile_on_cpu)
    forward = torch.compile(module, mode=args.compile_mode) if compiled else module
    # With CUDA graphs, a peak reset after the warm-up read 7 MiB at batch
    # 512 on an H100: the memory the graphs replay in was taken while they
    # were recorded, in the warm-up, so the peak covers the warm-up too.
    graphs = compiled and args.compile_mode != "default"
    module.train()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.float16, enabled=cuda):
            loss = loss_fn(forward(x), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], clip)
        scaler.step(optimizer)
        scaler.update()
        return loss

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        if not graphs:
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
        "parameters": parameters,
        "trainable_parameters": trainable,
    }
    report["compiled"] = compiled
    report["compile_mode"] = args.compile_mode if compiled else None
    if cuda:
        report["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
