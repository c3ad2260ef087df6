#!/usr/bin/env python3
"""Golden values for the C Llama, computed by an independent plain-PyTorch Llama.

Builds the model of docs/design.md, "The reference model and training math" (Hugging Face
LlamaForCausalLM math and names) in plain torch (torch_models.py), writes random initial
weights to a safetensors file and loads them back, then runs on the project's corpus with the
project's data order:
  - one forward and backward on step 0's batch: logits, loss, every parameter's gradient;
  - STEPS AdamW steps (parameter groups, gradient clipping, warmup + cosine schedule):
    the per-step losses and, for the Qwen and GPT-2 variants, every trained parameter under
    "trained.NAME" (tied ones once, as transformers saves them).
Outputs go next to this script, TAG_config.json, TAG_init.safetensors (or the init of another
variant, named in the golden's metadata "init") and TAG_golden.safetensors, for these variants:
  tiny         untied embeddings, rope_theta 1e4 at the top level (transformers 4's form)
  tiny_tied    tied embeddings
  tiny_v5      rope_parameters {rope_theta 5e5, rope_type default}, transformers 5's form
  tiny_llama3  rope_theta 5e5 and llama3 rope scaling in rope_scaling (transformers 4's form);
               tiny_llama3_v5_config.json holds the same model in rope_parameters (5's form)
  tiny_qwen2   Qwen2: biases on q, k and v (random, as every init here), rope_theta 1e6
  tiny_qwen3   Qwen3: q_norm and k_norm, head_dim 24 (hidden 64 / 4 heads is 16), tied
  tiny_gpt2    GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm with bias, fused c_attn,
               Conv1D weights [in, out], GELU's tanh form, tied; dim 64, 2 layers, 4 heads
  tiny_qwen3_moe  Qwen3-MoE: layer 0 a sparse block (4 experts of 32, top-2 renormalised),
               layer 1 dense (mlp_only_layers); its weight files (init, trained.*) name each
               expert as Hugging Face does, its gradients (grad.*) the C model's stacked names
  tiny_qwen3_moe_aux  the same with the routers' load-balancing loss (output_router_logits,
               router_aux_loss_coef 0.1), from tiny_qwen3_moe's init
  tiny_qwen2_moe  Qwen2-MoE: Qwen2's attention biases, layer 0 dense and layer 1 sparse
               (decoder_sparse_step 2: 4 experts of 32, top-2 not renormalised, and a shared
               expert of 40 gated by a sigmoid), the routers' load-balancing loss (0.05)
  tiny_mixtral Mixtral: Llama's attention, both layers sparse (block_sparse_moe: 4 experts of
               48, w1, w3 and w2 each expert's tensors in its files, top-2 renormalised), the
               routers' load-balancing loss (router_aux_loss_coef 0.02)
and llama31_inv_freq.json: the rotary frequencies of Llama 3.1 8B's config (head_dim 128), as
transformers' llama3 rope type defines them.

Needs torch (Debian: apt-get install python3-torch); CI does not run this script. Rerunning
it on one machine reproduces its files byte for byte (fixed seeds, one CPU thread); on another
CPU the gradients may differ in the last bits (measured: up to 7e-8 absolute).

  make_goldens.py [TAG...]             every variant, or the ones named
  make_goldens.py logits HFDIR ID...   the logits of a Hugging Face folder (config.json and an
                                       F32 model.safetensors, as fsdp-ckpt export-hf writes)
                                       for one sequence, as JSON, for comparing with the C
                                       model's (build/tests/hf_logits HFDIR ID...)
"""
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

from torch_models import CausalLM, GPT2LMHead, inv_freqs, load_balancing_loss, rope_params

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "data", "corpus.txt")

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=160, vocab_size=256, max_position_embeddings=64,
              rope_theta=10000.0, rms_norm_eps=1e-5)
BATCH, SEQ, STEPS = 2, 32, 10
TRAIN = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_norm=1.0,
             warmup=3, min_ratio=0.1,
             # groups: first match wins (fnmatch on the FQN)
             groups=[("*norm*", None, 0.0), ("model.embed_tokens.*", 1e-3, None)])
SEED = 1234


# ---------------------------------------------------------------- safetensors (independent)

ST_DTYPES = {torch.float32: "F32", torch.int64: "I64"}


def save_safetensors(path, tensors, metadata=None):
    header, blobs, pos = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.numpy().tobytes()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", e
        b, end = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[b:end]), dtype=torch.float32).reshape(e["shape"])
    return out


# ---------------------------------------------------------------- data and schedule

def load_tokens():
    with open(CORPUS, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.int64)


def batch(tokens, step, micro=0, grad_accum=1, dp_size=1, dp_rank=0):
    G = dp_size * BATCH
    span = len(tokens) - SEQ
    xs, ys = [], []
    for b in range(BATCH):
        j = dp_rank * BATCH + b
        s = ((step * grad_accum + micro) * G + j) * SEQ % span
        xs.append(tokens[s:s + SEQ])
        ys.append(tokens[s + 1:s + SEQ + 1])
    return torch.stack(xs), torch.stack(ys)


def lr_factor(s):
    W, S, r = TRAIN["warmup"], STEPS, TRAIN["min_ratio"]
    if s < W:
        return (s + 1) / W
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * (s - W) / max(1, S - W)))


def param_groups(model):
    import fnmatch
    groups = {}
    for name, p in model.named_parameters():
        lr, wd = TRAIN["lr"], TRAIN["weight_decay"]
        for pat, glr, gwd in TRAIN["groups"]:
            if fnmatch.fnmatchcase(name, pat):
                lr = glr if glr is not None else lr
                wd = gwd if gwd is not None else wd
                break
        groups.setdefault((lr, wd), []).append(p)
    return [dict(params=ps, lr=lr, weight_decay=wd, base_lr=lr) for (lr, wd), ps in groups.items()]


# ---------------------------------------------------------------- main

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
QWEN = dict(rope_theta=1000000.0, use_sliding_window=False, rms_norm_eps=1e-6)
MOE = dict(QWEN, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
           attention_bias=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
           output_router_logits=False)
MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], rope_theta=1000000.0,
               num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
               output_router_logits=True, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
               sliding_window=None)
QWEN2_MOE = dict(QWEN, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
                 output_router_logits=True, router_aux_loss_coef=0.05)
VARIANTS = [  # tag, config changes, tied, the variant whose init is reused (None: a new one)
    ("tiny", {}, False, None),
    ("tiny_tied", {}, True, None),
    ("tiny_v5", dict(rope_theta=None,
                     rope_parameters=dict(rope_theta=500000.0, rope_type="default")), False, "tiny"),
    ("tiny_llama3", dict(rope_theta=500000.0, max_position_embeddings=512,
                         rope_scaling=dict(LLAMA3, rope_type="llama3")), False, "tiny"),
    ("tiny_qwen2", dict(QWEN, model_type="qwen2", architectures=["Qwen2ForCausalLM"]), False,
     None),
    ("tiny_qwen3", dict(QWEN, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=24,
                        attention_bias=False), True, None),
    ("tiny_gpt2", dict(model_type="gpt2"), True, None),
    ("tiny_qwen3_moe", dict(MOE), False, None),
    ("tiny_qwen3_moe_aux", dict(MOE, output_router_logits=True, router_aux_loss_coef=0.1),
     False, "tiny_qwen3_moe"),
    ("tiny_mixtral", dict(MIXTRAL), False, None),
    ("tiny_qwen2_moe", dict(QWEN2_MOE), False, None),
]
# GPT-2 as transformers' GPT2Config writes it (no dropout: the C model has none)
GPT2_CONFIG = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2,
                   n_head=4, n_inner=None, n_positions=64, vocab_size=256,
                   layer_norm_epsilon=1e-5, activation_function="gelu_new",
                   initializer_range=0.02, tie_word_embeddings=True, attn_pdrop=0.0,
                   embd_pdrop=0.0, resid_pdrop=0.0)


def hf_names(tensors):
    """The tensors under Hugging Face's names: stacked experts (P.experts.N [E, a, b]) one
    tensor per expert, P.experts.J.N.weight [a, b], as Qwen3-MoE's files hold them."""
    out = {}
    for name, t in tensors.items():
        head, _, leaf = name.rpartition(".")
        if t.dim() == 3 and (head == "experts" or head.endswith(".experts")):
            for j in range(t.shape[0]):
                out["%s.%d.%s.weight" % (head, j, leaf)] = t[j]
        else:
            out[name] = t
    return out


def stacked_names(tensors, model):
    """The inverse of hf_names for the model's parameters."""
    out = dict(tensors)
    for name, p in model.named_parameters():
        head, _, leaf = name.rpartition(".")
        if p.dim() == 3 and (head == "experts" or head.endswith(".experts")):
            out[name] = torch.stack([out.pop("%s.%d.%s.weight" % (head, j, leaf))
                                     for j in range(p.shape[0])])
    return out


def write_config(tag, cfg):
    with open(os.path.join(HERE, tag + "_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def run(tag, changes, tied, init_tag):
    gpt2 = changes.get("model_type") == "gpt2"
    if gpt2:
        cfg = dict(GPT2_CONFIG, tie_word_embeddings=tied)
    else:
        cfg = dict(CONFIG, tie_word_embeddings=tied, model_type="llama", hidden_act="silu",
                   architectures=["LlamaForCausalLM"])
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    write_config(tag, cfg)

    torch.manual_seed(SEED + tied)
    model = GPT2LMHead(cfg) if gpt2 else CausalLM(cfg)
    if init_tag is None:
        init = {}
        for name, p in model.named_parameters():  # shared parameters appear once
            if name.endswith("norm.weight") or (".ln_" in name and name.endswith(".weight")):
                init[name] = 1.0 + 0.1 * torch.randn(p.shape)
            else:
                init[name] = 0.02 * torch.randn(p.shape)
        init_tag = tag
        save_safetensors(os.path.join(HERE, tag + "_init.safetensors"), hf_names(init),
                         {"format": "pt"})
    loaded = stacked_names(load_safetensors(os.path.join(HERE, init_tag + "_init.safetensors")),
                           model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(loaded[name])

    tokens = load_tokens()
    V = cfg["vocab_size"]
    x, y = batch(tokens, 0)
    def with_aux(loss):  # the MoE models' training loss with output_router_logits
        if cfg.get("output_router_logits"):
            loss = loss + cfg["router_aux_loss_coef"] * load_balancing_loss(model, cfg)
        return loss

    logits = model(x)
    loss = with_aux(F.cross_entropy(logits.view(-1, V).float(), y.view(-1)))
    loss.backward()
    golden = {"logits": logits.detach(), "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        golden["grad." + name] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(param_groups(model), betas=(TRAIN["beta1"], TRAIN["beta2"]),
                            eps=TRAIN["eps"], foreach=False)
    losses = []
    for s in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * lr_factor(s)
        x, y = batch(tokens, s)
        loss = with_aux(F.cross_entropy(model(x).view(-1, V).float(), y.view(-1)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["max_norm"])
        opt.step()
        losses.append(loss.item())
    golden["train_losses"] = torch.tensor(losses, dtype=torch.float32)
    if cfg["model_type"] in ("qwen2", "qwen3", "gpt2", "qwen3_moe", "mixtral", "qwen2_moe"):
        trained = hf_names({name: p.detach().clone() for name, p in model.named_parameters()})
        for name, t in trained.items():
            golden["trained." + name] = t
    meta = {"batch_size": str(BATCH), "seq_len": str(SEQ), "steps": str(STEPS),
            "torch_version": torch.__version__}
    if init_tag != tag:
        meta["init"] = init_tag + "_init.safetensors"
    save_safetensors(os.path.join(HERE, tag + "_golden.safetensors"), golden, meta)
    print(f"{tag}: loss {golden['loss'].item():.6f}, losses " +
          " ".join(f"{v:.4f}" for v in losses))
    return cfg


def write_rope_references(llama3_cfg):
    """The same llama3 model in transformers 5's form, and Llama 3.1 8B's frequencies."""
    v5 = {k: v for k, v in llama3_cfg.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(rope_params(llama3_cfg))
    write_config("tiny_llama3_v5", v5)
    rope = dict(rope_theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)
    out = {"rope_parameters": rope, "head_dim": 128,
           "inv_freq": [float(v) for v in inv_freqs(rope, 128)]}
    with open(os.path.join(HERE, "llama31_inv_freq.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def logits(folder, ids):
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    model = CausalLM(c)
    weights = load_safetensors(os.path.join(folder, "model.safetensors"))
    if c.get("tie_word_embeddings"):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.int64))[0]
    print(json.dumps({"logits": out.tolist()}))
    return 0


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if len(sys.argv) > 2 and sys.argv[1] == "logits":
        return logits(sys.argv[2], [int(a) for a in sys.argv[3:]])
    only = sys.argv[1:]  # TAG...: those variants alone (the others' files left as they are)
    cfgs = {tag: run(tag, changes, tied, init) for tag, changes, tied, init in VARIANTS
            if not only or tag in only}
    if "tiny_llama3" in cfgs:
        write_rope_references(cfgs["tiny_llama3"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
