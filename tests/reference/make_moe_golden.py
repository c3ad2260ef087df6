#!/usr/bin/env python3
"""Golden values for the C MoE block (nn/moe.h), from an independent plain-PyTorch MoE.

The block as transformers' Qwen3-MoE sparse block computes it: router logits x gate^T, softmax
in f32, torch.topk of the probabilities, optionally renormalised to sum 1 (norm_topk_prob),
and for each expert the tokens that chose it through a SwiGLU MLP, down(silu(gate(x)) *
up(x)), added back weighted by their routing weight (index_add_). Weights are random, stacked
as the C block stores them (experts.gate_proj / up_proj [E, ffn, dim], down_proj [E, dim,
ffn]). For each case: the input, the weights, the output, and the gradients of sum(out * r)
for a random r, of the input and of every weight; "load" is the tokens each expert received.

  plain   E 4, top-2, not renormalised
  norm    E 4, top-2, renormalised
  sparse  E 8, top-1, not renormalised (renormalised, top-1 weights are 1: the router would
          get no gradient); some expert receives no token (its gradients are zero)
  shared  E 4, top-2, renormalised, and an ungated shared expert of 10 (DeepSeek-V3's
          shared_experts) added for every token
  sigmoid E 6, top-2, DeepSeek-V3's routing: sigmoid scores, the choice by score plus a
          per-expert bias (expert_bias, no gradient), the chosen scores renormalised and
          scaled by 2.5 (routed_scaling_factor)

Needs torch (Debian: apt-get install python3-torch); CI does not run this script. Writes
tiny_moe_golden.safetensors next to it.
"""
import os

import torch
import torch.nn.functional as F

from make_goldens import save_safetensors

HERE = os.path.dirname(os.path.abspath(__file__))
DIM, FFN, TOKENS = 8, 12, (2, 5)


def moe(x, gate, w_gate, w_up, w_down, k, norm, bias=None, scale=1.0):
    xf = x.reshape(-1, DIM)
    if bias is None:
        probs = F.softmax(xf @ gate.t(), dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, k, dim=-1)
    else:  # DeepSeek-V3: sigmoid scores, the bias only for the choice
        probs = torch.sigmoid(xf @ gate.t())
        _, top_i = torch.topk(probs + bias, k, dim=-1)
        top_w = probs.gather(1, top_i)
    if norm:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w * scale
    out = torch.zeros_like(xf)
    load = torch.zeros(gate.shape[0], dtype=torch.int64)
    for e in range(gate.shape[0]):
        tok, slot = torch.where(top_i == e)
        load[e] = tok.numel()
        h = F.silu(xf[tok] @ w_gate[e].t()) * (xf[tok] @ w_up[e].t())
        out.index_add_(0, tok, (h @ w_down[e].t()) * top_w[tok, slot, None])
    return out.reshape(x.shape), load


def case(name, experts, k, norm, seed, out, shared=0, sigmoid=False):
    g = torch.Generator().manual_seed(seed)
    t = {"x": torch.randn(*TOKENS, DIM, generator=g),
         "gate.weight": torch.randn(experts, DIM, generator=g) * 0.5,
         "experts.gate_proj": torch.randn(experts, FFN, DIM, generator=g) * 0.3,
         "experts.up_proj": torch.randn(experts, FFN, DIM, generator=g) * 0.3,
         "experts.down_proj": torch.randn(experts, DIM, FFN, generator=g) * 0.3,
         "r": torch.randn(*TOKENS, DIM, generator=g)}
    if shared:  # a shared expert of `shared` hidden units, every token through it, ungated
        t["shared_experts.gate_proj.weight"] = torch.randn(shared, DIM, generator=g) * 0.3
        t["shared_experts.up_proj.weight"] = torch.randn(shared, DIM, generator=g) * 0.3
        t["shared_experts.down_proj.weight"] = torch.randn(DIM, shared, generator=g) * 0.3
    if sigmoid:  # a bias large enough to change some choices
        t["expert_bias"] = torch.randn(experts, generator=g) * 0.3
    leaves = {n: v.clone().requires_grad_(True) for n, v in t.items()
              if n not in ("r", "expert_bias")}
    y, load = moe(leaves["x"], leaves["gate.weight"], leaves["experts.gate_proj"],
                  leaves["experts.up_proj"], leaves["experts.down_proj"], k, norm,
                  t.get("expert_bias"), 2.5 if sigmoid else 1.0)
    if shared:
        xs = leaves["x"]
        y = y + (F.silu(xs @ leaves["shared_experts.gate_proj.weight"].t()) *
                 (xs @ leaves["shared_experts.up_proj.weight"].t())) @ \
            leaves["shared_experts.down_proj.weight"].t()
    (y * t["r"]).sum().backward()
    for n, v in t.items():
        out["%s.%s" % (name, n)] = v
    out[name + ".out"] = y.detach()
    out[name + ".load"] = load
    for n, v in leaves.items():
        out["%s.grad.%s" % (name, n)] = v.grad
    return load


def main():
    torch.set_num_threads(1)
    out = {}
    case("plain", 4, 2, False, 11, out)
    case("norm", 4, 2, True, 12, out)
    load = case("sparse", 8, 1, False, 13, out)
    assert (load == 0).any(), "the sparse case must leave an expert without tokens"
    case("shared", 4, 2, True, 14, out, shared=10)
    case("sigmoid", 6, 2, True, 15, out, sigmoid=True)
    save_safetensors(os.path.join(HERE, "tiny_moe_golden.safetensors"), out,
                     {"dim": str(DIM), "ffn": str(FFN)})


if __name__ == "__main__":
    main()
