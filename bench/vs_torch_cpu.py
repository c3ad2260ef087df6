#!/usr/bin/env python3
"""fsdpc against torch eager on the CPU: the same Llama, batch and optimizer, one thread each.

  vs_torch_cpu.py BENCH_TRAIN_TINY [--rounds 3] [--steps 30] [--only tiny|small|100m]
                  [--threads N]

For each model (configs/llama-tiny.json and llama-small.json at 8 x 64, llama-100m.json at
2 x 64) it runs bench-train-tiny and an equivalent torch loop in turns (fsdpc, torch, fsdpc,
...), ROUNDS times each, and prints the median steady-state tokens/s of both and their ratio.
The torch model is the plain-PyTorch Llama of tests/reference/torch_models.py (the model the
goldens come from), trained as bench-train-tiny trains: fp32, AdamW (betas 0.9/0.95,
weight decay 0.1, none on norms), gradient clipping at 1.0, warmup + cosine schedule. The
first step of each run is not counted. With --threads N (> 1) both sides run N threads
(OMP_NUM_THREADS, torch.set_num_threads), and fsdpc also runs on one thread in the same rounds:
the last column is fsdpc's N-thread over its 1-thread tokens/s. Needs torch (Debian: apt-get
install python3-torch).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from fsdpc_version import version

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODELS = {"tiny": ("llama-tiny.json", 8, 64), "small": ("llama-small.json", 8, 64),
          "100m": ("llama-100m.json", 2, 64)}
EVERY = 5  # steps per timed window


def thread_env(n):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(n), OMP_NUM_THREADS=str(n),
               MKL_NUM_THREADS=str(n))
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def fsdpc(exe, config, batch, seq, steps, threads):
    """Median tokens/s of bench-train-tiny's timed windows after step 0."""
    p = subprocess.run([exe, "--config", config, "--batch", str(batch), "--seq", str(seq),
                        "--steps", str(steps), "--every", str(EVERY)],
                       capture_output=True, text=True, env=thread_env(threads))
    if p.returncode not in (0, 1):  # 1: the loss did not go down (too few steps to say)
        sys.exit("bench-train-tiny failed:\n" + p.stderr)
    rows = re.findall(r"^\s*(\d+)\s+\S+\s+\S+\s+(\d+)\s*$", p.stdout, re.M)
    rates = [float(r) for s, r in rows if int(s) > 0]
    return statistics.median(rates)


TORCH_LOOP = r"""
import json, math, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[8]))
from torch_models import CausalLM
cfg = json.load(open(sys.argv[2]))
cfg.setdefault("tie_word_embeddings", False)
batch, seq, steps, every = (int(a) for a in sys.argv[3:7])
torch.manual_seed(0)
model = CausalLM(cfg)
decay = [p for n, p in model.named_parameters() if "norm" not in n]
no_decay = [p for n, p in model.named_parameters() if "norm" in n]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
tokens = torch.tensor(list(open(sys.argv[7], "rb").read()), dtype=torch.int64)
V, warm = cfg["vocab_size"], max(1, steps // 10)
span = len(tokens) - seq
rates, t = [], time.perf_counter()
for s in range(steps):
    f = (s + 1) / warm if s < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))
    for g in opt.param_groups:
        g["lr"] = 3e-3 * f
    starts = [((s * batch + b) * seq) % span for b in range(batch)]
    x = torch.stack([tokens[a:a + seq] for a in starts])
    y = torch.stack([tokens[a + 1:a + seq + 1] for a in starts])
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if s == 0 or (s + 1) % every == 0:
        now = time.perf_counter()
        if s > 0:
            rates.append(every * batch * seq / (now - t))
        t = now
rates.sort()
print(json.dumps({"tokens_per_s": rates[len(rates) // 2], "torch": torch.__version__}))
"""


def torch_eager(config, batch, seq, steps, threads):
    p = subprocess.run([sys.executable, "-c", TORCH_LOOP, os.path.join(ROOT, "tests", "reference"),
                        config, str(batch), str(seq), str(steps), str(EVERY),
                        os.path.join(ROOT, "data", "corpus.txt"), str(threads)],
                       capture_output=True, text=True, env=thread_env(threads))
    if p.returncode != 0:
        sys.exit("the torch loop failed:\n" + p.stderr)
    return json.loads(p.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=version())
    ap.add_argument("exe", help="bench-train-tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", choices=sorted(MODELS))
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.steps < 2 * EVERY or a.rounds < 1 or a.threads < 1:
        ap.error("--steps must be at least %d, --rounds and --threads at least 1" % (2 * EVERY))
    try:
        import torch  # noqa: F401  (the loop runs in a child; fail early and clearly)
    except ImportError:
        sys.exit("vs_torch_cpu.py: torch is not installed (Debian: apt-get install python3-torch)")
    n = a.threads
    print("%-6s %8s %14s %14s %8s" % ("model", "batch", "fsdpc tok/s", "torch tok/s", "ratio") +
          ("  (%d threads each) %14s %10s" % (n, "fsdpc 1 thread", "%d/1" % n) if n > 1 else ""))
    for name, (cfg, batch, seq) in MODELS.items():
        if a.only and name != a.only:
            continue
        config = os.path.join(ROOT, "configs", cfg)
        ours, theirs, single = [], [], []
        for _ in range(a.rounds):
            ours.append(fsdpc(a.exe, config, batch, seq, a.steps, n))
            theirs.append(torch_eager(config, batch, seq, a.steps, n))
            if n > 1:
                single.append(fsdpc(a.exe, config, batch, seq, a.steps, 1))
        o, t = statistics.median(ours), statistics.median(theirs)
        line = "%-6s %8s %14.0f %14.0f %7.2fx" % (name, "%dx%d" % (batch, seq), o, t, o / t)
        if n > 1:
            one = statistics.median(single)
            line += "  %18s %14.0f %9.2fx" % ("", one, o / one)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
