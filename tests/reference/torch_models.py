"""Plain-PyTorch models with Hugging Face's math and parameter names, independent of this
project's code: the references its goldens come from (make_goldens.py) and the models its
benchmarks train beside it (bench/vs_torch_cpu.py, bench/torch_fsdp2.py).

  CausalLM(config, seq=None, sdpa=False)   the causal LM of a config.json's dict: Llama, and
                                           Qwen2 (biases on q, k, v) and Qwen3 (q_norm and
                                           k_norm on each head, its own head_dim) by the
                                           config's model_type
  GPT2LMHead(config, sdpa=False)           GPT2LMHeadModel: learned positions, LayerNorm
                                           with bias, the fused c_attn, Conv1D weights
                                           stored [in, out], GELU's tanh form, tied head

With sdpa=False attention is computed as written (scores, causal mask, softmax in f32), the
form the goldens use; with sdpa=True through torch's scaled_dot_product_attention, as a
PyTorch user trains. The rotary tables cover `seq` positions (default the config's
max_position_embeddings) and are computed for more when a batch is longer.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)


def rope_params(c):
    """The rotary embedding's parameters from either config form: transformers 4 (rope_theta at
    the top level, rope_scaling for scaled types) or transformers 5 (rope_parameters)."""
    p = dict(c.get("rope_scaling") or {})
    p.update(c.get("rope_parameters") or {})
    p.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    p.setdefault("rope_type", p.get("type", "default"))
    return p


def inv_freqs(p, head_dim):
    """Hugging Face's rope types: default, linear and llama3 (in float64)."""
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    inv_freq = p["rope_theta"] ** (-i / head_dim)
    kind = p["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / p["factor"]
    assert kind == "llama3", kind
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(seq, head_dim, params):
    """cos and sin [seq, head_dim] in f32, computed in float64 (position by position, so the
    first T rows do not depend on seq)."""
    inv_freq = inv_freqs(params, head_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def exact_attention(q, k, v):
    """Causal attention of q [B, H, T, D] over k, v [B, Hkv, T, D], as written."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.full((T, T), float("-inf"), device=q.device).triu(1)
    return torch.softmax((s + mask).float(), dim=-1).to(q.dtype) @ v


def sdpa_attention(q, k, v):
    """The same through scaled_dot_product_attention where torch has it (torch >= 2.0)."""
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    if sdpa is None:
        return exact_attention(q, k, v)
    if q.shape[1] != k.shape[1]:
        try:
            return sdpa(q, k, v, is_causal=True, enable_gqa=True)
        except TypeError:  # torch < 2.5
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return sdpa(q, k, v, is_causal=True)


def is_qwen3(c):
    return c.get("model_type") in ("qwen3", "qwen3_moe")


def head_dim(c):
    """The attention head size: head_dim when given (Qwen3's default 128), else hidden / heads."""
    if c.get("head_dim"):
        return c["head_dim"]
    return 128 if c.get("model_type") == "qwen3" else c["hidden_size"] // c["num_attention_heads"]


class Attention(nn.Module):
    def __init__(self, c, sdpa):
        super().__init__()
        self.h, self.kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = head_dim(c)
        self.attend = sdpa_attention if sdpa else exact_attention
        d, kind = c["hidden_size"], c.get("model_type", "llama")
        qwen2 = kind in ("qwen2", "qwen2_moe")
        qkv_bias = (qwen2 and c.get("qkv_bias", True)) or bool(c.get("attention_bias"))
        o_bias = not qwen2 and bool(c.get("attention_bias"))
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=o_bias)
        if is_qwen3(c):
            self.q_norm = RMSNorm(self.hd, c["rms_norm_eps"])
            self.k_norm = RMSNorm(self.hd, c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd)
        k = self.k_proj(x).view(B, T, self.kv, self.hd)
        if hasattr(self, "q_norm"):  # each head normalised over its features, before rope
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = self.attend(q, k, v).transpose(1, 2).reshape(B, T, self.h * self.hd)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, c, f=None):
        super().__init__()
        d, f = c["hidden_size"], f or c["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def is_mixtral(c):
    return c.get("model_type") == "mixtral"


def num_experts(c):
    """Qwen3-MoE's num_experts, Mixtral's num_local_experts."""
    return c["num_local_experts"] if is_mixtral(c) else c.get("num_experts", 0)


class Experts(nn.Module):
    """The experts' SwiGLU weights, stacked: gate and up [E, ffn, dim], down [E, dim, ffn], under
    the names the C model gives them (gate_proj, up_proj, down_proj; Mixtral's w1, w3, w2)."""
    def __init__(self, e, d, f, names):
        super().__init__()
        self.names = names
        for name, shape in zip(names, ((e, f, d), (e, f, d), (e, d, f))):
            setattr(self, name, nn.Parameter(torch.empty(*shape)))

    def weights(self, e):
        return [getattr(self, n)[e] for n in self.names]


class SparseMoE(nn.Module):
    """Qwen3-MoE's, Mixtral's and Qwen2-MoE's sparse block as transformers computes it: router
    logits, softmax in f32, the top-k probabilities (renormalised with norm_topk_prob; always
    by Mixtral), and each expert's tokens through its SwiGLU MLP, added back weighted by their
    routing weight; Qwen2-MoE adds a shared expert over every token, scaled by the sigmoid of
    its gate."""
    def __init__(self, c):
        super().__init__()
        d, self.E, self.k = c["hidden_size"], num_experts(c), c["num_experts_per_tok"]
        self.norm = is_mixtral(c) or bool(c.get("norm_topk_prob"))
        self.gate = nn.Linear(d, self.E, bias=False)
        if is_mixtral(c):
            self.experts = Experts(self.E, d, c["intermediate_size"], ("w1", "w3", "w2"))
        else:
            self.experts = Experts(self.E, d, c["moe_intermediate_size"],
                                   ("gate_proj", "up_proj", "down_proj"))
        if c.get("model_type") == "qwen2_moe":
            self.shared_expert = MLP(c, c["shared_expert_intermediate_size"])
            self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        xf = x.reshape(-1, x.shape[-1])
        self.router_logits = self.gate(xf)  # for the load-balancing loss
        probs = F.softmax(self.router_logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.k, dim=-1)
        if self.norm:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(xf)
        for e in range(self.E):
            tok, slot = torch.where(top_i == e)
            gate, up, down = self.experts.weights(e)
            h = F.silu(xf[tok] @ gate.t()) * (xf[tok] @ up.t())
            out.index_add_(0, tok, (h @ down.t()) * top_w[tok, slot, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        return out.reshape(x.shape)


def load_balancing_loss(model, c):
    """transformers' load_balancing_loss_func over every sparse block's router logits of the
    last forward (no attention mask): num_experts * sum over experts of the share of top-k
    choices (constant) times the mean router probability."""
    logits = torch.cat([m.router_logits for m in model.modules() if isinstance(m, SparseMoE)])
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    _, chosen = torch.topk(probs, c["num_experts_per_tok"], dim=-1)
    mask = F.one_hot(chosen, num_experts(c)).float()  # [rows, k, E]
    tokens_per_expert = mask.mean(dim=0)
    prob_per_expert = probs.mean(dim=0)
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * num_experts(c)


def layer_is_moe(c, i):
    """Qwen3-MoE's rule: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer;
    Mixtral's: every layer."""
    if is_mixtral(c):
        return True
    return (c.get("model_type") in ("qwen3_moe", "qwen2_moe") and c.get("num_experts", 0) > 0 and
            i not in (c.get("mlp_only_layers") or []) and
            (i + 1) % c.get("decoder_sparse_step", 1) == 0)


class Block(nn.Module):
    def __init__(self, c, sdpa, i=0):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c, sdpa)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        # Mixtral's sparse block is block_sparse_moe in its files
        self.ffn_name = "block_sparse_moe" if is_mixtral(c) else "mlp"
        setattr(self, self.ffn_name, SparseMoE(c) if layer_is_moe(c, i) else MLP(c))

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + getattr(self, self.ffn_name)(self.post_attention_layernorm(h))


class Body(nn.Module):
    def __init__(self, c, seq, sdpa):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c, sdpa, i) for i in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.head_dim = head_dim(c)
        self.rope = rope_params(c)
        cos, sin = rope_tables(seq, self.head_dim, self.rope)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids):
        T = ids.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        if T > self.cos.shape[0]:
            cos, sin = (t.to(ids.device) for t in rope_tables(T, self.head_dim, self.rope))
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class CausalLM(nn.Module):
    def __init__(self, c, seq=None, sdpa=False):
        super().__init__()
        self.model = Body(c, seq or c.get("max_position_embeddings", 2048), sdpa)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids):
        return self.lm_head(self.model(ids))


# ---------------------------------------------------------------- GPT-2

class Conv1D(nn.Module):
    """Hugging Face's Conv1D: a linear layer whose weight is stored [in, out]."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2Attention(nn.Module):
    def __init__(self, c, sdpa):
        super().__init__()
        d = c["n_embd"]
        self.h, self.hd = c["n_head"], d // c["n_head"]
        self.attend = sdpa_attention if sdpa else exact_attention
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.c_attn(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, self.hd).transpose(1, 2) for t in (q, k, v))
        o = self.attend(q, k, v).transpose(1, 2).reshape(B, T, D)
        return self.c_proj(o)


class GPT2MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["n_embd"]
        inner = c.get("n_inner") or 4 * d
        self.c_fc = Conv1D(d, inner)
        self.c_proj = Conv1D(inner, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, c, sdpa):
        super().__init__()
        d, eps = c["n_embd"], c.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = GPT2Attention(c, sdpa)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = GPT2MLP(c)

    def forward(self, x):
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class GPT2Body(nn.Module):
    def __init__(self, c, sdpa):
        super().__init__()
        d = c["n_embd"]
        self.wte = nn.Embedding(c["vocab_size"], d)
        self.wpe = nn.Embedding(c["n_positions"], d)
        self.h = nn.ModuleList(GPT2Block(c, sdpa) for _ in range(c["n_layer"]))
        self.ln_f = nn.LayerNorm(d, eps=c.get("layer_norm_epsilon", 1e-5))

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            h = block(h)
        return self.ln_f(h)


class GPT2LMHead(nn.Module):
    def __init__(self, c, sdpa=False):
        super().__init__()
        self.transformer = GPT2Body(c, sdpa)
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # GPT-2's head is always tied

    def forward(self, ids):
        return self.lm_head(self.transformer(ids))
