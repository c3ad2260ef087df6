#!/usr/bin/env python3
"""fsdp-train against PyTorch FSDP2 on one GPU, one after the other.

Both train the same model, batch, mixed precision and optimizer.

  vs_torch_gpu.py [--exe build/tools/fsdp-train] [--config configs/llama-100m.json]
                  [--batch 8] [--seq 1024] [--steps 30] [--warmup 5] [--param-dtype bf16]
                  [--reduce-dtype f32] [--python PYTHON] [--peak-tflops X] [--keep DIR]
                  [--profile] [--torch-compile] [--torch-eager] [--offload]
                  [--also-env NAME=VALUE]...

Both sides train the config's model (a Hugging Face config.json of Llama, Qwen2, Qwen3 or their
mixtures of experts; a vocabulary past 65536 takes uint32 token files) at world size 1 on the first visible GPU:
fully_shard on every decoder layer and on the root with the same mixed-precision policy
(param_dtype, reduce_dtype), AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1, none on
the norms), clipping at 1.0, windows of the same random token file. fsdp-train runs a plan
written from the config (train.device: cuda; its metrics file gives each step's tokens/s and
the accounting layer's peak bytes); torch runs bench/torch_fsdp2.py with PYTHON (default: this
interpreter). Printed for each: the median tokens/s of the steps after the warmup ones, MFU
(6 x parameters x tokens/s over the GPU's dense bf16 peak: 989 TFLOP/s for H100 SXM and H200,
or --peak-tflops; with experts, the parameters a token's products take), peak memory and the first and last loss; then fsdpc's ratio to torch.
With --torch-compile torch also runs with each decoder layer through torch.compile before
fully_shard (TorchTitan's order), with --torch-eager without FSDP (the model in f32 under
torch.autocast, as a one-GPU user trains it), each a row of its own with fsdpc's ratio to it.
With --offload both keep the sharded state on the host (fsdpc's fully_shard offload: true,
torch's CPUOffloadPolicy), the optimizer step there. Each --also-env NAME=VALUE runs fsdp-train again with that in its environment (a faster path
turned off, e.g. FSDPC_GROUPED_GEMM=0: the experts' products one by one), a row of its own with
fsdpc's ratio to it. With --profile fsdp-train runs under FSDPC_PROFILE=1 and its kernel table (device time per
kernel, summed over the run) is printed first (the timers add a little to its tokens/s).
Then attention alone: bench-attention against torch's scaled_dot_product_attention at B=8,
T=1024, 16 heads of 128, causal, bf16 (median forward and forward + backward times, and the
ratio of the latter). Then the step's matrix products alone: bench-matmul over the config's
linear layers at batch x seq tokens in param_dtype, cuBLASLt against cublasGemmEx (its table,
and a step's products in milliseconds on each path).

Without a CUDA device (or with an fsdp-train built without CUDA) it says so and exits 0; where
PYTHON has no torch it prints fsdpc's figures alone.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile

from fsdpc_version import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAKS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
         ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0)]  # dense bf16 TFLOP/s
def u32(cfg):
    """Whether the vocabulary needs uint32 token files (Qwen's 151936 does)."""
    return cfg["vocab_size"] > 65536


def plan_text(cfg, a, data):
    return """mesh:
  dp_shard: 1
model:
  config: %s
  seed: 0
parallelize:
  fully_shard:
    units: ["model.layers.*"]
    offload: %s
    mp_policy: {param_dtype: %s, reduce_dtype: %s}
optim:
  lr: 3.0e-4
  weight_decay: 0.1
  beta2: 0.95
  clip_grad_norm: 1.0
  param_groups:
    "*norm*": {weight_decay: 0.0}
data:
  path: %s
  format: %s
  seq_len: %d
  batch_size: %d
train:
  steps: %d
  device: cuda
log:
  interval: %d
""" % (os.path.abspath(a.config), "true" if a.offload else "false", a.param_dtype, a.reduce_dtype,
       data, "u32" if u32(cfg) else "u16", a.seq, a.batch, a.steps, a.steps)


def sparse_layer(cfg, i):
    """Whether layer i holds experts (Qwen3-MoE's and Qwen2-MoE's rule; Mixtral's: all)."""
    kind = cfg.get("model_type", "llama")
    if kind == "mixtral":
        return True
    if kind not in ("qwen3_moe", "qwen2_moe") or not cfg.get("num_experts"):
        return False
    step = cfg.get("decoder_sparse_step", 1) or 1
    return i not in cfg.get("mlp_only_layers", []) and (i + 1) % step == 0


def params_of(cfg):
    """The model's parameters, and those a token's products take (all but the experts it is
    not routed to): the latter give MFU, 6 x active parameters x tokens/s."""
    d, f, v = cfg["hidden_size"], cfg.get("intermediate_size", 0), cfg["vocab_size"]
    h, kv, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    kind = cfg.get("model_type", "llama")
    hd = cfg.get("head_dim") or (128 if kind == "qwen3" else d // h)
    attn = d * (h * hd) * 2 + d * (kv * hd) * 2 + 2 * d
    bias = kind not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias"))
    attn += (h * hd + 2 * kv * hd if kind in ("qwen2", "qwen2_moe") or bias else 0)
    attn += d if bias else 0
    attn += 2 * hd if kind in ("qwen3", "qwen3_moe") else 0
    total = active = v * d * (1 if cfg.get("tie_word_embeddings", False) else 2) + d
    for i in range(L):
        if not sparse_layer(cfg, i):
            total += attn + 3 * d * f
            active += attn + 3 * d * f
            continue
        E = cfg.get("num_local_experts") or cfg["num_experts"]
        ef = f if kind == "mixtral" else cfg["moe_intermediate_size"]
        shared = 3 * d * cfg.get("shared_expert_intermediate_size", 0)
        shared += d if shared else 0  # the shared expert's gate
        total += attn + d * E + 3 * d * ef * E + shared
        active += attn + d * E + 3 * d * ef * cfg["num_experts_per_tok"] + shared
    return total, active


def gpu_name():
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=30)
        return p.stdout.strip() if p.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def peak_tflops(name, given):
    if given:
        return given
    for key, tf in PEAKS:
        if key in name:
            return tf
    return 0.0


def run_fsdpc(a, plan, metrics, extra_env=None):
    env = dict(os.environ, FSDPC_PROFILE="1") if a.profile else dict(os.environ)
    env.update(extra_env or {})
    p = subprocess.run([a.exe, plan, "--metrics", metrics], capture_output=True, text=True,
                       env=env)
    if p.returncode != 0:
        sys.exit("fsdp-train failed (exit %d):\n%s%s" % (p.returncode, p.stdout[-2000:],
                                                          p.stderr[-3000:]))
    if a.profile:  # the kernel table fsdp-train ends with
        table = p.stdout[p.stdout.find("kernels of rank 0"):]
        print(table.rstrip() + "\n")
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    timed = [r["tokens_per_s"] for r in rows if r["step"] > a.warmup]
    return {"tokens_per_s": statistics.median(timed),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}


def run_torch(a, data, flags=()):
    """bench/torch_fsdp2.py with flags: its JSON figures and None, or None and why not."""
    try:
        subprocess.run([a.python, "-c", "import torch"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None, "%s has no torch" % a.python
    p = subprocess.run([a.python, os.path.join(ROOT, "bench", "torch_fsdp2.py"), "--config",
                        a.config, "--data", data, "--batch", str(a.batch), "--seq", str(a.seq),
                        "--steps", str(a.steps), "--warmup", str(a.warmup), "--param-dtype",
                        a.param_dtype, "--reduce-dtype", a.reduce_dtype] +
                       (["--offload"] if a.offload else []) +
                       (["--u32"] if data.endswith(".u32") else []) + list(flags),
                       capture_output=True, text=True)
    if p.returncode != 0 and flags:  # the plain run's figures still stand
        return None, "torch_fsdp2.py %s failed (exit %d): %s" % (
            " ".join(flags), p.returncode,
            (p.stderr.strip().splitlines() or ["no output"])[-1])
    if p.returncode != 0:
        sys.exit("torch_fsdp2.py failed (exit %d):\n%s" % (p.returncode, p.stderr[-3000:]))
    return json.loads(p.stdout.strip().splitlines()[-1]), None


TORCH_ATTENTION = r"""
import json, sys, time
import torch
import torch.nn.functional as F
B, T, H, D, reps = (int(a) for a in sys.argv[1:6])
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, dy = (torch.rand(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
               for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
fwd, both = [], []
for r in range(reps + 2):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    y.backward(dy)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    if r >= 2:
        fwd.append(t1 - t0)
        both.append(t2 - t0)
fwd.sort()
both.sort()
print(json.dumps({"forward_ms": 1e3 * fwd[len(fwd) // 2],
                  "forward_backward_ms": 1e3 * both[len(both) // 2]}))
"""


def attention(a):
    """bench-attention and torch's scaled_dot_product_attention at B=8, T=1024, 16 heads of
    128, causal, bf16: the median forward and forward + backward times of each."""
    shape = ["8", "1024", "16", "128", "20"]
    p = subprocess.run([a.attention_exe, "--device", "cuda", "--dtype", "bf16", "--batch",
                        shape[0], "--seq", shape[1], "--heads", shape[2], "--head-dim", shape[3],
                        "--reps", shape[4]], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("bench-attention failed:\n" + p.stderr[-3000:])
    lines = p.stdout.strip().splitlines()
    ours = json.loads(lines[-1])
    path = [l for l in lines if l.startswith("path: ")]
    theirs = None
    t = subprocess.run([a.python, "-c", TORCH_ATTENTION] + shape, capture_output=True, text=True)
    if t.returncode == 0:
        theirs = json.loads(t.stdout.strip().splitlines()[-1])
    print("attention 8 x 1024, 16 heads of 128, causal, bf16: fsdpc forward %.3f ms, "
          "forward + backward %.3f ms" % (ours["forward_ms"], ours["forward_backward_ms"]))
    if path:
        print("  fsdpc " + path[0])
    if theirs:
        print("  torch scaled_dot_product_attention: forward %.3f ms, forward + backward %.3f ms;"
              " fsdpc / torch time: %.2fx" % (theirs["forward_ms"], theirs["forward_backward_ms"],
                                             ours["forward_backward_ms"] /
                                             theirs["forward_backward_ms"]))
    else:
        print("  torch: not run (%s)" % (t.stderr.strip().splitlines() or ["no output"])[-1])


def matmul(a):
    """bench-matmul over the config's linear layers, cuBLASLt against cublasGemmEx."""
    p = subprocess.run([a.matmul_exe, "--device", "cuda", "--config", a.config, "--dtype",
                        a.param_dtype, "--tokens", str(a.batch * a.seq)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("bench-matmul failed:\n" + p.stderr[-3000:])
    print("\n".join(l for l in p.stdout.strip().splitlines() if not l.startswith("{")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=version())
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "tools", "fsdp-train"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "llama-100m.json"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--param-dtype", choices=["f32", "bf16", "f16"], default="bf16")
    ap.add_argument("--reduce-dtype", choices=["f32", "bf16", "f16"], default="f32")
    ap.add_argument("--python", default=sys.executable, help="the Python that has torch")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--keep", help="write the plan, tokens and metrics here and keep them")
    ap.add_argument("--attention-exe", help="bench-attention (default: beside --exe's build)")
    ap.add_argument("--matmul-exe", help="bench-matmul (default: beside --exe's build)")
    ap.add_argument("--profile", action="store_true",
                    help="run fsdp-train with FSDPC_PROFILE=1 and print its kernel table")
    ap.add_argument("--torch-compile", action="store_true",
                    help="also run torch with torch.compile on each decoder layer")
    ap.add_argument("--torch-eager", action="store_true",
                    help="also run torch without FSDP, under autocast")
    ap.add_argument("--offload", action="store_true",
                    help="sharded state on the host on both sides (torch's CPUOffloadPolicy)")
    ap.add_argument("--also-env", action="append", default=[], metavar="NAME=VALUE",
                    help="run fsdp-train again with NAME=VALUE in its environment (a path "
                         "turned off, e.g. FSDPC_GROUPED_GEMM=0): a row of its own")
    a = ap.parse_args()
    for kv in a.also_env:
        if "=" not in kv or not kv.split("=", 1)[0]:
            ap.error("--also-env takes NAME=VALUE, not '%s'" % kv)
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(a.exe))), "bench")
    a.attention_exe = a.attention_exe or os.path.join(bench_dir, "bench-attention")
    a.matmul_exe = a.matmul_exe or os.path.join(bench_dir, "bench-matmul")
    if a.offload and a.torch_eager:
        ap.error("--torch-eager trains without FSDP, so without its offload: drop one")
    if a.steps <= a.warmup or a.warmup < 0 or a.batch < 1 or a.seq < 1:
        ap.error("need --batch, --seq >= 1 and --steps > --warmup >= 0")
    if not os.access(a.exe, os.X_OK):
        sys.exit("vs_torch_gpu.py: %s is not a program (build first, or give --exe)" % a.exe)
    with open(a.config) as f:
        cfg = json.load(f)
    work = a.keep or tempfile.mkdtemp(prefix="fsdpc-vs-torch-")
    os.makedirs(work, exist_ok=True)
    try:
        data = os.path.join(work, "tokens.u32" if u32(cfg) else "tokens.u16")
        n = max(1 << 20, 2 * a.batch * (a.seq + 1))
        rng = random.Random(0)
        with open(data, "wb") as f:
            f.write(struct.pack("<%d%s" % (n, "I" if u32(cfg) else "H"),
                                *(rng.randrange(cfg["vocab_size"]) for _ in range(n))))
        plan = os.path.join(work, "plan.yaml")
        with open(plan, "w") as f:
            f.write(plan_text(cfg, a, data))
        p = subprocess.run([a.exe, plan, "--dry-run"], capture_output=True, text=True)
        if p.returncode != 0 and "train.device: cuda:" in p.stderr:
            why = p.stderr.strip().splitlines()[0].split("train.device: cuda: ", 1)[-1]
            print("vs_torch_gpu.py: no GPU to compare on (%s)" % why.split(": ask for")[0])
            return 0
        if p.returncode != 0:
            sys.exit("fsdp-train --dry-run failed:\n" + p.stderr[-3000:])
        ours = run_fsdpc(a, plan, os.path.join(work, "metrics.jsonl"))
        variants = []  # (label, figures) of fsdp-train under each --also-env
        for i, kv in enumerate(a.also_env):
            name, value = kv.split("=", 1)
            variants.append(("fsdpc " + kv, run_fsdpc(
                a, plan, os.path.join(work, "metrics-%d.jsonl" % i), {name: value})))
        theirs, why = run_torch(a, data)
        extra = []  # (label, the run's figures, why it has none)
        for wanted, flag, label in ((a.torch_eager, "--no-fsdp", "torch eager (autocast)"),
                                    (a.torch_compile, "--compile", "torch FSDP2 + compile")):
            if theirs and wanted:
                extra.append((label,) + run_torch(a, data, [flag]))
        name = gpu_name() or (theirs or {}).get("device", "")
        peak = peak_tflops(name, a.peak_tflops)
        total, nparams = params_of(cfg)
        counted = "{:,} parameters".format(total)
        if nparams != total:
            counted += " ({:,} a token's: MFU's)".format(nparams)
        print("%s; %s, %s, batch %d x %d, param %s, reduce %s; median of steps "
              "%d-%d" % (name or "GPU", os.path.basename(a.config), counted, a.batch, a.seq,
                         a.param_dtype, a.reduce_dtype, a.warmup + 1, a.steps))
        print("%-28s %12s %7s %12s %20s" % ("", "tokens/s", "MFU", "peak memory", "loss"))
        sides = [("fsdpc fsdp-train", ours)] + variants
        if theirs:
            sides.append(("torch %s FSDP2" % theirs["torch"], theirs))
        sides += [(label, r) for label, r, _ in extra if r]
        for label, r in sides:
            mfu = ("%6.2f%%" % (100 * 6 * nparams * r["tokens_per_s"] / (peak * 1e12))
                   if peak else "     ?")
            print("%-28s %12.0f %7s %9.2f GiB %9.4f -> %.4f" % (
                label, r["tokens_per_s"], mfu, r["peak_mem_bytes"] / 2 ** 30, r["first_loss"],
                r["last_loss"]))
        for label, r in variants:
            print("fsdpc / %s: %.3fx tokens/s" % (label, ours["tokens_per_s"] / r["tokens_per_s"]))
        if theirs:
            print("fsdpc / torch FSDP2%s: %.3fx tokens/s" % (
                " + CPUOffloadPolicy" if a.offload else "",
                ours["tokens_per_s"] / theirs["tokens_per_s"]))
        else:
            print("torch: not run (%s)" % why)
        for label, r, why_not in extra:
            if r:
                print("fsdpc / %s: %.3fx tokens/s" % (label, ours["tokens_per_s"] /
                                                       r["tokens_per_s"]))
            else:
                print("%s: not run (%s)" % (label, why_not))
        if not peak:
            print("MFU: unknown peak for '%s' (give --peak-tflops)" % name)
        if os.access(a.attention_exe, os.X_OK):
            attention(a)
        else:
            print("attention: %s not found (give --attention-exe)" % a.attention_exe)
        if os.access(a.matmul_exe, os.X_OK):
            matmul(a)
        else:
            print("matrix products: %s not found (give --matmul-exe)" % a.matmul_exe)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
