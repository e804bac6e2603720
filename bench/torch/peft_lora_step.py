"""transformers + peft's LoRA step on a Hugging Face model directory: the
PyTorch side of `cargo xtask bench-llm --compare-peft`.

Loads DIR with AutoModelForCausalLM (dtype as asked), puts peft's LoRA on
the target modules (r, alpha, no dropout), turns on gradient checkpointing
(use_reentrant=False, as the recipe has it) and times full micro-steps on
random token ids of one sequence each: forward with labels, backward, and
AdamW on the adapters (foreach on the CPU, fused on a GPU). Prints one JSON
line: tokens/s, seconds per sequence, peak RSS (and peak GPU memory).

    python3 bench/torch/peft_lora_step.py --model DIR --seq 1024 --steps 2
"""

import argparse
import json
import resource
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--target", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    config = LoraConfig(
        r=args.r,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        target_modules=args.target.split(","),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    load_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    fused = args.device != "cpu"
    opt = torch.optim.AdamW(params, lr=2e-4, fused=fused, foreach=not fused)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)

    def step():
        ids = torch.randint(0, vocab, (1, args.seq), generator=gen).to(args.device)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss)

    for _ in range(args.warmup):
        step()
    if args.device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if args.device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    report = {
        "side": "transformers+peft",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "seq": args.seq,
        "steps": args.steps,
        "seconds_per_sequence": seconds / args.steps,
        "tokens_per_s": args.seq * args.steps / seconds,
        "load_s": load_s,
        "loss": loss,
        "adapter_params": sum(p.numel() for p in params),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.device != "cpu":
        report["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
        report["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
