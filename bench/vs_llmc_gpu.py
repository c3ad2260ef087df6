#!/usr/bin/env python3
"""fsdp-train against llm.c's train_gpt2cu on one GPU: GPT-2 124M (or 350M) from scratch.

  vs_llmc_gpu.py --llmc LLMC_CHECKOUT [--exe build/tools/fsdp-train] [--model 124m|350m]
                 [--batch 16] [--seq 1024] [--steps 30] [--warmup 5] [--cudnn-frontend DIR]
                 [--pad-vocab 128] [--peak-tflops X] [--profile] [--keep DIR]

Builds train_gpt2cu in the llm.c checkout with its own Makefile (make train_gpt2cu
NO_MULTI_GPU=1 NO_USE_MPI=1, and USE_CUDNN=1 when --cudnn-frontend names a cudnn-frontend
checkout or its include folder; cuDNN from the CUDA toolkit or the nvidia-cudnn wheel). Without
--cudnn-frontend, or when that build fails (said so), llm.c uses its own attention. Both
programs then train the same GPT-2 (configs/gpt2-124m.json or gpt2-350m.json; llm.c's -e d12
or d24, random initial weights) on the same random token shards in llm.c's format, batch x seq
tokens a step, bf16 compute with f32 master weights and optimizer state, AdamW lr 3e-4
(constant, as llm.c's defaults), betas 0.9/0.95, no weight decay, clipping at 1.0, no dropout,
one GPU. llm.c: -b BATCH -t SEQ -x STEPS, no sampling,
validation or checkpoints; fsdp-train: a plan written from the config (model.config,
fully_shard per block, mp_policy bf16/f32, train.device cuda; the embedding and head padded to
a multiple of --pad-vocab rows, model.pad_vocab_multiple, 50304 by default, as llm.c pads its
own; 0 leaves them at the vocabulary's 50257).

Printed for each: the median tokens/s of the steps after the warmup ones (llm.c's from the
step times it prints; fsdp-train's from its metrics), MFU by one formula for both (6 x
parameters x tokens/s over the GPU's dense bf16 peak: 989 TFLOP/s for H100 SXM and H200, or
--peak-tflops; parameters as transformers counts GPT-2's, 124,439,808 for 124M), llm.c's own
MFU figure, peak memory (fsdp-train's accounting; llm.c's from nvidia-smi's sampled peak), the
first and last loss, and fsdp-train's ratio to llm.c. With --profile, fsdp-train's kernel table
(FSDPC_PROFILE=1) and bench-matmul's products of the model's shapes follow.

Without a GPU, an fsdp-train built without CUDA, or an llm.c checkout (no train_gpt2.cu in
--llmc), it says so and exits 0.
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

from fsdpc_version import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAKS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
         ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0)]  # dense bf16 TFLOP/s
MODELS = {"124m": ("gpt2-124m.json", "d12"), "350m": ("gpt2-350m.json", "d24")}


def params_of(cfg):
    """GPT-2's parameters as transformers counts them (the tied head once)."""
    d, L, v, p = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"], cfg["n_positions"]
    f = cfg.get("n_inner") or 4 * d
    layer = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * d * f + f + d
    return v * d + p * d + L * layer + 2 * d


def write_shard(path, n, vocab, seed):
    """An llm.c token shard: its 256-int header (magic 20240520, version 1, count), uint16."""
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        f.write(struct.pack("<%dH" % n, *(rng.randrange(vocab) for _ in range(n))))


def plan_text(config, a, train):
    return """mesh:
  dp_shard: 1
model:
  config: %s
  seed: 0
  pad_vocab_multiple: %d
parallelize:
  fully_shard:
    units: ["transformer.h.*"]
    mp_policy: {param_dtype: bf16, reduce_dtype: f32}
optim:
  lr: 3.0e-4
  weight_decay: 0.0
  beta2: 0.95
  clip_grad_norm: 1.0
schedule:
  warmup_steps: 0
  min_lr_ratio: 1.0
data:
  path: %s
  format: llmc
  seq_len: %d
  batch_size: %d
train:
  steps: %d
  device: cuda
log:
  interval: %d
""" % (config, a.pad_vocab, train, a.seq, a.batch, a.steps, a.steps)


def gpu_name():
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=30)
        return p.stdout.strip() if p.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


class PeakMemory:
    """nvidia-smi's used memory of GPU 0, sampled every 0.2 s while a program runs."""

    def __init__(self):
        self.peak, self.stop = 0, False
        self.t = threading.Thread(target=self.loop, daemon=True)

    def loop(self):
        while not self.stop:
            try:
                p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                    "--format=csv,noheader,nounits", "-i", "0"],
                                   capture_output=True, text=True, timeout=10)
                self.peak = max(self.peak, int(p.stdout.strip() or 0) << 20)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.2)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()


def cudnn_paths():
    """cuDNN's include and library folders: the CUDA toolkit's, else the nvidia-cudnn wheel's."""
    if os.path.isfile("/usr/local/cuda/include/cudnn.h"):
        return "/usr/local/cuda/include", "/usr/local/cuda/lib64"
    try:
        import nvidia.cudnn
        wheel = list(nvidia.cudnn.__path__)[0]
        return os.path.join(wheel, "include"), os.path.join(wheel, "lib")
    except ImportError:
        return None, None


def shared_lib(name, dirs):
    """The first NAME.so or NAME.so.N in DIRS or the loader's cache, or None."""
    for d in dirs:
        for f in sorted(os.listdir(d)) if d and os.path.isdir(d) else []:
            if f == name + ".so" or f.startswith(name + ".so."):
                return os.path.join(d, f)
    p = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    m = re.search(r"^\s*%s\.so[.\d]* .*=> (\S+)$" % re.escape(name), p.stdout, re.M)
    return m.group(1) if m else None


def llmc_copy(a, work):
    """A copy of the llm.c checkout to build in (the checkout itself is left as it is). CUDA 13
    dropped cudaMemAdvise's device-number form, which llm.c's fallback to managed memory calls:
    the copy passes the host as a cudaMemLocation instead, as CUDA 12.2 and later accept."""
    dst = os.path.join(work, "llm.c")
    if not os.path.isdir(dst):
        shutil.copytree(a.llmc, dst, ignore=shutil.ignore_patterns("build", "*.o", ".git"))
    path = os.path.join(dst, "llmc", "cuda_utils.cuh")
    with open(path) as f:
        text = f.read()
    old = "cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)"
    new = ("cudaMemAdviseSetPreferredLocation, "
           "cudaMemLocation{cudaMemLocationTypeHost, 0})")
    if old in text:
        with open(path, "w") as f:
            f.write(text.replace(old, new))
        print("vs_llmc_gpu.py: llm.c's cudaMemAdvise call given a cudaMemLocation (CUDA 13)")
    return dst


def make_llmc(a, work, cudnn):
    """make train_gpt2cu, single GPU, no MPI; with cuDNN's attention when CUDNN is true.
    llm.c's Makefile links -lnvidia-ml (and -lcudnn) by their bare names: a folder of links
    gives the linker the driver's libnvidia-ml.so.1 and a wheel's libcudnn.so.9 by those names."""
    links = os.path.join(work, "llmc-lib")
    os.makedirs(links, exist_ok=True)
    libs = [("libnvidia-ml", ["/usr/local/cuda/lib64/stubs"])]
    src = llmc_copy(a, work)
    cmd = ["make", "-C", src, "train_gpt2cu", "NO_MULTI_GPU=1", "NO_USE_MPI=1"]
    env = dict(os.environ)
    if cudnn:
        inc, lib = cudnn_paths()
        if not inc:
            return None, "no cuDNN headers (CUDA toolkit or nvidia-cudnn wheel)"
        front = os.path.abspath(a.cudnn_frontend)
        if os.path.isdir(os.path.join(front, "include")):
            front = os.path.join(front, "include")
        # the Makefile looks for $HOME/cudnn-frontend/include before it takes the path given
        home = os.path.join(work, "llmc-home")
        os.makedirs(home, exist_ok=True)
        if not os.path.exists(os.path.join(home, "cudnn-frontend")):
            os.symlink(os.path.dirname(front), os.path.join(home, "cudnn-frontend"))
        env["HOME"] = home
        libs.append(("libcudnn", [lib]))
        cmd += ["USE_CUDNN=1", "CUDNN_FRONTEND_PATH=" + front,
                "NVCC_INCLUDES=-I%s -I%s" % (front, inc)]
    for name, dirs in libs:
        found = shared_lib(name, dirs)
        if not found:
            return None, "no %s.so to link with" % name
        dst = os.path.join(links, name + ".so")
        if os.path.lexists(dst):
            os.remove(dst)
        os.symlink(found, dst)
    # cudnn-frontend compiles some of its kernels at run time (NVRTC)
    cmd.append("NVCC_LDFLAGS=-L%s -lcublas -lcublasLt -lnvidia-ml%s"
               % (links, " -lcudnn -lnvrtc" if cudnn else ""))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return None, (p.stdout + p.stderr)[-3000:]
    return os.path.join(src, "train_gpt2cu"), None


def build_llmc(a, work):
    """llm.c's train_gpt2cu, with cuDNN's attention when --cudnn-frontend is given and it
    builds (else without, said so); returns the program and how it was built."""
    if a.cudnn_frontend:
        exe, why = make_llmc(a, work, True)
        if exe:
            return exe, "cuDNN attention"
        print("vs_llmc_gpu.py: llm.c with cuDNN did not build; building without it:\n" + why)
    exe, why = make_llmc(a, work, False)
    if not exe:
        sys.exit("vs_llmc_gpu.py: building llm.c failed:\n" + why)
    return exe, "llm.c's own attention"


def run_llmc(a, exe, init, train, val):
    cmd = [exe, "-i", train, "-j", val, "-e", init, "-b", str(a.batch), "-t", str(a.seq),
           "-x", str(a.steps), "-v", str(10 * a.steps), "-s", "0", "-n", "0", "-l", "3e-4",
           "-c", "0.0"]
    env = dict(os.environ)
    lib = cudnn_paths()[1]  # the libraries it was linked with, for the loader
    env["LD_LIBRARY_PATH"] = ":".join(x for x in (lib, "/usr/local/cuda/lib64",
                                                  env.get("LD_LIBRARY_PATH")) if x)
    with PeakMemory() as mem:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(exe),
                           env=env)
    if p.returncode != 0:
        sys.exit("train_gpt2cu failed (exit %d):\n%s" % (p.returncode, (p.stdout + p.stderr)[-3000:]))
    rows = re.findall(r"^step\s+(\d+)/\d+ \| loss ([\d.]+).*?\| ([\d.]+) ms \| (-?[\d.]+)% bf16 MFU",
                      p.stdout, re.M)
    if len(rows) < a.steps:
        sys.exit("train_gpt2cu printed %d step lines of %d:\n%s" % (len(rows), a.steps,
                                                                   p.stdout[-2000:]))
    timed = [a.batch * a.seq / (float(ms) / 1e3) for s, _, ms, _ in rows if int(s) > a.warmup]
    return {"tokens_per_s": statistics.median(timed), "peak_mem_bytes": mem.peak,
            "first_loss": float(rows[0][1]), "last_loss": float(rows[-1][1]),
            "own_mfu": statistics.median(float(r[3]) for r in rows if int(r[0]) > a.warmup)}


def run_fsdpc(a, plan, metrics):
    env = dict(os.environ, FSDPC_PROFILE="1") if a.profile else None
    p = subprocess.run([a.exe, plan, "--metrics", metrics], capture_output=True, text=True,
                       env=env)
    if p.returncode != 0:
        sys.exit("fsdp-train failed (exit %d):\n%s%s" % (p.returncode, p.stdout[-2000:],
                                                          p.stderr[-3000:]))
    if a.profile:  # the kernel table fsdp-train ends with
        print(p.stdout[p.stdout.find("kernels of rank 0"):].rstrip() + "\n")
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    timed = [r["tokens_per_s"] for r in rows if r["step"] > a.warmup]
    return {"tokens_per_s": statistics.median(timed),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=version())
    ap.add_argument("--llmc", help="an llm.c checkout (karpathy/llm.c)")
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "tools", "fsdp-train"))
    ap.add_argument("--model", choices=sorted(MODELS), default="124m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cudnn-frontend", help="the cudnn-frontend checkout llm.c's USE_CUDNN=1 "
                    "needs (default: build llm.c without cuDNN)")
    ap.add_argument("--pad-vocab", type=int, default=128,
                    help="fsdp-train's model.pad_vocab_multiple (0: no padding)")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--profile", action="store_true",
                    help="run fsdp-train with FSDPC_PROFILE=1 and print its kernel table, then "
                    "bench-matmul (beside --exe's build) over the model's products")
    ap.add_argument("--keep", help="write the shards, plan and logs here and keep them")
    a = ap.parse_args()
    if a.steps <= a.warmup or a.warmup < 0 or a.batch < 1 or a.seq < 1:
        ap.error("need --batch, --seq >= 1 and --steps > --warmup >= 0")
    if not a.llmc or not os.path.isfile(os.path.join(a.llmc, "train_gpt2.cu")):
        print("vs_llmc_gpu.py: no llm.c checkout to compare with (--llmc DIR holding "
              "train_gpt2.cu): nothing to do")
        return 0
    if not os.access(a.exe, os.X_OK):
        sys.exit("vs_llmc_gpu.py: %s is not a program (build first, or give --exe)" % a.exe)
    name = gpu_name()
    if not name:
        print("vs_llmc_gpu.py: no GPU here (nvidia-smi fails): nothing to do")
        return 0
    config_name, init = MODELS[a.model]
    config = os.path.join(ROOT, "configs", config_name)
    with open(config) as f:
        cfg = json.load(f)
    work = a.keep or tempfile.mkdtemp(prefix="fsdpc-vs-llmc-")
    os.makedirs(work, exist_ok=True)
    n = max(1 << 21, 2 * (a.steps + 1) * a.batch * (a.seq + 1))
    train, val = os.path.join(work, "train_000001.bin"), os.path.join(work, "val_000000.bin")
    write_shard(train, n, cfg["vocab_size"], 0)
    write_shard(val, 1 << 20, cfg["vocab_size"], 1)
    plan = os.path.join(work, "plan.yaml")
    with open(plan, "w") as f:
        f.write(plan_text(config, a, train))
    p = subprocess.run([a.exe, plan, "--dry-run"], capture_output=True, text=True)
    if p.returncode != 0 and "train.device: cuda:" in p.stderr:
        print("vs_llmc_gpu.py: fsdp-train has no GPU to run on: nothing to do")
        return 0
    if p.returncode != 0:
        sys.exit("fsdp-train --dry-run failed:\n" + p.stderr[-3000:])
    exe, how = build_llmc(a, work)
    ours = run_fsdpc(a, plan, os.path.join(work, "fsdpc.jsonl"))
    theirs = run_llmc(a, exe, init, train, val)
    nparams = params_of(cfg)
    peak = a.peak_tflops or next((tf for key, tf in PEAKS if key in name), 0.0)
    print("GPT-2 %s (%s parameters), %d x %d tokens a step, bf16 / f32 master, on %s; "
          "llm.c with %s" % (a.model, "{:,}".format(nparams), a.batch, a.seq, name, how))
    print("%-10s %12s %8s %12s %12s %10s %10s" % ("", "tokens/s", "MFU", "own MFU", "peak GiB",
                                                  "loss 1", "loss N"))
    for label, r in (("fsdp-train", ours), ("llm.c", theirs)):
        mfu = 6.0 * nparams * r["tokens_per_s"] / (peak * 1e12) if peak else 0.0
        own = "%.1f%%" % r["own_mfu"] if "own_mfu" in r else "-"
        print("%-10s %12.0f %7.1f%% %12s %12.2f %10.4f %10.4f" % (
            label, r["tokens_per_s"], 100 * mfu, own, r["peak_mem_bytes"] / 2**30,
            r["first_loss"], r["last_loss"]))
    print("fsdp-train / llm.c: %.2fx" % (ours["tokens_per_s"] / theirs["tokens_per_s"]))
    if a.profile:
        matmul = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(a.exe))), "bench",
                              "bench-matmul")
        p = subprocess.run([matmul, "--device", "cuda", "--config", config, "--tokens",
                            str(a.batch * a.seq)], capture_output=True, text=True)
        print("\n".join(l for l in (p.stdout + p.stderr).strip().splitlines()
                        if not l.startswith("{")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
