"""PyTorch equivalents of headroom models, built from an experiment's
`[model]` table (the same layer list, the same defaults), for side-by-side
timing (`cargo xtask bench --compare-torch`, torch_step.py) and the
whole-job comparison (torch_fashion_mnist.py).

Layouts: images are NCHW tensors in channels_last memory (headroom's NHWC);
token ids are [n, t] int64; frame sequences are folded into the batch,
[n·f, c, h, w] (sample s's frames at s·f ..), as headroom folds them, so
the per-frame layers are the image layers and `conv_lstm` unfolds them.

Parameter counts match headroom's layer for layer, with one exception
`counted_parameters` accounts for: nn.LSTM keeps two bias vectors
(b_ih, b_hh) where headroom keeps one.

`model.checkpoint` = "blocks" or "all" wraps each residual,
basic_block and transformer_block in torch.utils.checkpoint (headroom's
"all" also segments the other layers, and its conv_lstm recomputes per
time step; PyTorch has no such built-in and keeps every step here).
"""
import math
import tomllib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def experiment(name):
    """An experiment file of this repository as a dict (TOML)."""
    with open(EXPERIMENTS / name, "rb") as f:
        return tomllib.load(f)


class SpecError(ValueError):
    """A model table this module cannot mirror, naming the layer."""


class Residual(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class BasicBlock(nn.Module):
    """conv3x3+BN+ReLU, conv3x3+BN, add the input, ReLU."""

    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
            nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c),
        )

    def forward(self, x):
        return F.relu(self.body(x) + x)


class Checkpointed(nn.Module):
    """Keeps only its input in training; reruns `inner` in backward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            return ckpt.checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


class GlobalAvgPool(nn.Module):
    def forward(self, x):
        return x.mean((2, 3))


class UnetSkip(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return torch.cat([x, self.body(x)], dim=1)


class Embedding(nn.Module):
    def __init__(self, vocab, dim, length, positions):
        super().__init__()
        self.table = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.02) if positions else None

    def forward(self, ids):
        y = self.table(ids)
        return y + self.positions if self.positions is not None else y


class LoraLinear(nn.Module):
    """y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ with W and b frozen, s = alpha / r."""

    def __init__(self, fan_in, out, bias, r, alpha):
        super().__init__()
        self.base = nn.Linear(fan_in, out, bias=bias)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, fan_in) / math.sqrt(fan_in))
        self.lora_b = nn.Parameter(torch.zeros(out, r))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


def linear(fan_in, out, bias=True, lora=None):
    if lora is None:
        return nn.Linear(fan_in, out, bias=bias)
    r = lora["r"]
    return LoraLinear(fan_in, out, bias, r, lora.get("alpha", r))


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, lora):
        super().__init__()
        if width % heads:
            raise SpecError(f"heads = {heads} does not divide the width {width}")
        self.heads = heads
        self.qkv = linear(width, 3 * width, lora=lora)
        self.proj = linear(width, width, lora=lora)

    def forward(self, x):
        n, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(n, t, c))


class TransformerBlock(nn.Module):
    """Pre-norm: x + drop(attn(ln(x))), then x + drop(mlp(ln(x)))."""

    def __init__(self, width, heads, mlp_ratio, dropout, lora):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, lora)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_ratio * width), nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * width, width),
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Lstm(nn.Module):
    def __init__(self, fan_in, hidden):
        super().__init__()
        self.lstm = nn.LSTM(fan_in, hidden, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


class ConvLstm(nn.Module):
    """Over each sample's `frames` frames folded in the batch; gates i, f,
    g, o from one convolution of [x_t, h_{t-1}], zero initial state."""

    def __init__(self, channels, hidden, kernel, frames):
        super().__init__()
        self.hidden, self.frames = hidden, frames
        self.conv = nn.Conv2d(channels + hidden, 4 * hidden, kernel, 1, kernel // 2, bias=True)

    def forward(self, x):
        nf, c, h, w = x.shape
        seq = x.reshape(nf // self.frames, self.frames, c, h, w)
        state = x.new_zeros(nf // self.frames, self.hidden, h, w)
        cell = torch.zeros_like(state)
        outputs = []
        for t in range(self.frames):
            step = torch.cat([seq[:, t], state], dim=1).contiguous(memory_format=torch.channels_last)
            i, f, g, o = self.conv(step).chunk(4, dim=1)
            cell = torch.sigmoid(f) * cell + torch.sigmoid(i) * torch.tanh(g)
            state = torch.sigmoid(o) * torch.tanh(cell)
            outputs.append(state)
        return torch.stack(outputs, dim=1).reshape(nf, self.hidden, h, w)


class Builder:
    """Walks the layer list as headroom's builder does, tracking the shape
    between layers: ("image", c), ("vector", features), ("sequence", c)."""

    def __init__(self, model):
        self.model = model
        self.tokens = model.get("tokens")
        self.frames = model.get("frames")
        self.checkpoint = model.get("checkpoint", "none") != "none"

    def build(self):
        if self.tokens:
            shape = ("ids", self.tokens["length"])
        else:
            h, w, c = self.model["input"]
            shape = ("image", c, h, w)
        layers, _ = self.layers(self.model["layers"], shape, "model.layers")
        return nn.Sequential(*layers)

    def layers(self, specs, shape, path):
        built = []
        for i, spec in enumerate(specs):
            layer, shape = self.layer(spec, shape, f"{path}[{i}]")
            built.append(layer)
        return built, shape

    def layer(self, spec, shape, path):
        kind = spec.get("type")
        build = getattr(self, f"layer_{kind}", None)
        if build is None:
            raise SpecError(f"{path}: layer type {kind!r} has no PyTorch equivalent here")
        try:
            return build(spec, shape, path)
        except (KeyError, IndexError, TypeError) as e:
            raise SpecError(f"{path}: {kind} on {shape}: {e!r}") from e

    def block(self, module):
        return Checkpointed(module) if self.checkpoint else module

    def layer_conv(self, spec, shape, path):
        _, c, h, w = shape
        k, stride = spec.get("kernel", 3), spec.get("stride", 1)
        pad = spec.get("padding")
        pad = k // 2 if pad is None else pad
        out = spec["out"]
        conv = nn.Conv2d(c, out, k, stride, pad, bias=spec.get("bias", False))
        size = lambda n: (n + 2 * pad - k) // stride + 1
        return conv, ("image", out, size(h), size(w))

    def layer_batch_norm(self, spec, shape, path):
        eps, momentum = spec.get("eps", 1e-5), spec.get("momentum", 0.1)
        norm = nn.BatchNorm2d if shape[0] == "image" else nn.BatchNorm1d
        return norm(shape[1], eps=eps, momentum=momentum), shape

    def layer_relu(self, spec, shape, path):
        return nn.ReLU(), shape

    def layer_silu(self, spec, shape, path):
        return nn.SiLU(), shape

    def layer_gelu(self, spec, shape, path):
        return nn.GELU(approximate="tanh"), shape

    def layer_dropout(self, spec, shape, path):
        return nn.Dropout(spec["p"]), shape

    def layer_residual(self, spec, shape, path):
        body, out = self.layers(spec["layers"], shape, f"{path}.layers")
        return self.block(Residual(nn.Sequential(*body))), out

    def layer_basic_block(self, spec, shape, path):
        return self.block(BasicBlock(shape[1])), shape

    def layer_global_avg_pool(self, spec, shape, path):
        return GlobalAvgPool(), ("vector", shape[1])

    def layer_flatten(self, spec, shape, path):
        _, c, h, w = shape
        return nn.Flatten(), ("vector", c * h * w)

    def layer_linear(self, spec, shape, path):
        return nn.Linear(shape[1], spec["out"], bias=spec.get("bias", True)), (shape[0], spec["out"])

    def layer_lora_linear(self, spec, shape, path):
        layer = linear(shape[1], spec["out"], spec.get("bias", True), spec["lora"])
        return layer, (shape[0], spec["out"])

    def layer_layer_norm(self, spec, shape, path):
        return nn.LayerNorm(shape[1], eps=spec.get("eps", 1e-5)), shape

    def layer_embedding(self, spec, shape, path):
        dim = spec["dim"]
        embed = Embedding(self.tokens["vocab"], dim, shape[1], spec.get("positions", False))
        return embed, ("sequence", dim)

    def layer_causal_self_attention(self, spec, shape, path):
        return CausalSelfAttention(shape[1], spec["heads"], spec.get("lora")), shape

    def layer_transformer_block(self, spec, shape, path):
        block = TransformerBlock(
            shape[1], spec["heads"], spec.get("mlp_ratio", 4), spec.get("dropout", 0.0), spec.get("lora")
        )
        return self.block(block), shape

    def layer_lstm(self, spec, shape, path):
        return Lstm(shape[1], spec["hidden"]), ("sequence", spec["hidden"])

    def layer_upsample2x(self, spec, shape, path):
        _, c, h, w = shape
        return nn.Upsample(scale_factor=2, mode="nearest"), ("image", c, 2 * h, 2 * w)

    def layer_unet_skip(self, spec, shape, path):
        body, out = self.layers(spec["layers"], shape, f"{path}.layers")
        return UnetSkip(nn.Sequential(*body)), ("image", shape[1] + out[1], shape[2], shape[3])

    def layer_conv_lstm(self, spec, shape, path):
        if not self.frames:
            raise SpecError(f"{path}: conv_lstm needs model.frames")
        _, c, h, w = shape
        hidden = spec["hidden"]
        return ConvLstm(c, hidden, spec.get("kernel", 3), self.frames), ("image", hidden, h, w)


def model_from_spec(model):
    """The nn.Module of an experiment's `[model]` table."""
    return Builder(model).build()


def is_adapter(name):
    return name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")


def apply_finetune(module, finetune):
    """`finetune.train`: "lora" trains the adapters only, "full" every
    weight but the adapters (as headroom freezes them); without
    `[finetune]` a LoRA layer's base stays frozen."""
    mode = (finetune or {}).get("train")
    if mode is None:
        return
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter(name) == (mode == "lora"))


def counted_parameters(module):
    """(all, trainable) parameters as headroom counts them."""
    total = trainable = 0
    for name, p in module.named_parameters():
        if name.endswith("bias_hh_l0"):
            continue
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable
