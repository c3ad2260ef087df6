#!/usr/bin/env python3
"""PyTorch FSDP2 training of a Llama config: the peer that bench/vs_torch_gpu.py runs beside
fsdp-train.

  torch_fsdp2.py --config configs/llama-100m.json --data TOKENS.u16 [--u32] [--batch 8] [--seq 1024]
                 [--steps 30] [--warmup 5] [--param-dtype bf16] [--reduce-dtype f32]
                 [--lr 3e-4] [--device cuda|cpu] [--no-fsdp] [--compile] [--offload]

The model is the Llama of a Hugging Face config (tests/reference/torch_models.py: RMSNorm,
rotary embedding with rotate_half, grouped-query attention through torch's
scaled_dot_product_attention with is_causal, SwiGLU, untied or tied head), as PyTorch users
write it. It is trained the way TorchTitan does:
with --compile each decoder layer goes through torch.compile first (torch >= 2.0; the
warmup steps then include the compilation), then fully_shard on every decoder layer, then on
the root, with
MixedPrecisionPolicy(param_dtype, reduce_dtype) (and with --offload CPUOffloadPolicy: the
sharded parameters, gradients and optimizer state on the host, the optimizer step there);
AdamW (betas 0.9/0.95, weight decay 0.1, none on the norms; fused, TorchTitan's default, where
torch has it for the parameters' device); gradient clipping at 1.0; the loss in f32. With
--no-fsdp the model trains eagerly in f32 under torch.autocast(param_dtype), as a one-GPU
PyTorch user writes it. A batch is `batch` windows of `seq` tokens (plus the next one) from
the little-endian uint16 (--u32: uint32, for vocabularies past 65536) token file. One process is a world of size 1 (NCCL on the GPU); under
torchrun each rank takes its own windows.

The steps run without a host wait of their own: each step's time is read from CUDA events
(on the CPU, from the clock), the losses after the last step.

Prints one JSON line (rank 0): the median tokens/s of the job over the steps after the warmup
ones, the peak memory torch's allocator held, the first and last loss, the device and the
versions. --device cpu --no-fsdp trains the same model eagerly on the CPU (to check this
script where no GPU is).
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time

from fsdpc_version import version

if "--version" in sys.argv[1:]:  # answered without torch, as the other scripts do
    print(version() % {"prog": os.path.basename(sys.argv[0])})
    sys.exit(0)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
from torch_models import CausalLM  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=version())
    ap.add_argument("--config", required=True, help="a Hugging Face Llama config.json")
    ap.add_argument("--data", required=True, help="little-endian uint16 token file")
    ap.add_argument("--u32", action="store_true", help="the token file holds uint32 tokens")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps not timed")
    ap.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--no-fsdp", action="store_true", help="eager, without fully_shard")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each decoder layer before fully_shard")
    ap.add_argument("--offload", action="store_true",
                    help="FSDP2's CPUOffloadPolicy: sharded state and optimizer on the host")
    a = ap.parse_args()
    if a.steps <= a.warmup or a.warmup < 0 or a.batch < 1 or a.seq < 1:
        ap.error("need batch, seq >= 1 and steps > warmup >= 0")
    if a.offload and a.no_fsdp:
        ap.error("--offload is FSDP2's: it needs fully_shard (drop --no-fsdp)")
    if a.compile and not hasattr(torch, "compile"):
        sys.exit("torch_fsdp2.py: --compile needs torch.compile (torch >= 2.0); this is torch %s"
                 % torch.__version__)
    with open(a.config) as f:
        cfg = json.load(f)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("torch_fsdp2.py: torch sees no CUDA device")

    import torch.distributed as dist
    if not a.no_fsdp:
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                     ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if not a.no_fsdp else 0
    world = dist.get_world_size() if not a.no_fsdp else 1
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    if hasattr(torch, "set_default_device"):  # torch >= 2.0: built where it trains
        with dev:
            model = CausalLM(cfg, a.seq, sdpa=True)
    else:
        model = CausalLM(cfg, a.seq, sdpa=True).to(dev)
    for n, p in model.named_parameters():
        if "norm" not in n:
            nn.init.normal_(p, std=0.02)
    if a.compile:  # each block compiled alone, then wrapped: TorchTitan's order
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    if not a.no_fsdp:
        fully_shard = None
        for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
            try:  # the first from torch 2.6 on; old torch fails in several ways
                m = __import__(where, fromlist=["fully_shard", "MixedPrecisionPolicy"])
                fully_shard, MixedPrecisionPolicy = m.fully_shard, m.MixedPrecisionPolicy
                break
            except Exception as e:  # noqa: BLE001
                why = e
        if fully_shard is None:
            sys.exit("torch_fsdp2.py: torch %s has no FSDP2 fully_shard (torch >= 2.4 has "
                     "it): %s" % (torch.__version__, why))
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[a.param_dtype],
                                                reduce_dtype=DTYPES[a.reduce_dtype])}
        if a.offload:
            kw["offload_policy"] = m.CPUOffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    try:  # fused: one kernel over all parameters (CUDA; the CPU too from torch 2.4)
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), fused=True)
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95))
    autocast = a.no_fsdp and a.param_dtype != "f32"

    raw = open(a.data, "rb").read()
    if a.u32:
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.int16).to(torch.int64) & 0xFFFF
    span = len(tokens) - a.seq
    if span <= 0:
        sys.exit("torch_fsdp2.py: %s holds fewer than seq + 1 tokens" % a.data)
    if int(tokens.max()) >= cfg["vocab_size"]:
        sys.exit("torch_fsdp2.py: a token of %s is outside the vocabulary" % a.data)
    tokens = tokens.to(dev)
    V = cfg["vocab_size"]

    def mark():
        """A point in the step stream: a recorded CUDA event, or the clock on the CPU."""
        if not cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(t0, t1):
        return t0.elapsed_time(t1) / 1e3 if cuda else t1 - t0

    marks, losses = [mark()], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for s in range(a.steps):
        starts = [((s * world + rank) * a.batch + b) * a.seq % span for b in range(a.batch)]
        x = torch.stack([tokens[i:i + a.seq] for i in starts])
        y = torch.stack([tokens[i + 1:i + a.seq + 1] for i in starts])
        with (torch.autocast(dev.type, dtype=DTYPES[a.param_dtype]) if autocast else
              contextlib.nullcontext()):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        marks.append(mark())
    if cuda:
        torch.cuda.synchronize()
    losses = [float(l) for l in losses]
    rates = [world * a.batch * a.seq / seconds(marks[s], marks[s + 1])
             for s in range(a.warmup, a.steps)]
    out = {"tokens_per_s": statistics.median(rates), "steps_timed": len(rates),
           "peak_mem_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
           "first_loss": losses[0], "last_loss": losses[-1],
           "params": sum(p.numel() for p in model.parameters()),
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "world": world, "fsdp": not a.no_fsdp,
           "compile": a.compile, "offload": a.offload}
    if rank == 0:
        print(json.dumps(out), flush=True)
    if not a.no_fsdp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
