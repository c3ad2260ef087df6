#!/usr/bin/env python3
"""The plain-torch references of torch_models.py against Hugging Face transformers itself.

  check_transformers.py

For every tiny reference model of this folder (TAG_config.json with its initial weights,
TAG_init.safetensors or the init its golden names): transformers' AutoModelForCausalLM built
from the config and loaded with the weights, and torch_models' model loaded with the same
weights, each computing the logits of step 0's batch in float64 on the CPU; prints the
relative L2 difference per model and exits 1 when one exceeds 1e-5 (transformers computes its
rotary tables in f32, these references in f64 rounded to f32; a wrong formula is off by more
than 1e-2; GPT-2, without rotation, agrees to rounding). The models with experts (Qwen3-MoE,
Mixtral, Qwen2-MoE) go through transformers' from_pretrained on a folder of their files, which
keep one tensor per expert as the Hub's checkpoints do (transformers 5 stacks them as it
loads), and into torch_models' model stacked. Needs torch and transformers (the GPU image has
both; scripts/device-session.sh runs it as the stage reference); without transformers it says
so and exits 0.
"""
import json
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_goldens import batch, load_safetensors, load_tokens, stacked_names  # noqa: E402
from torch_models import CausalLM, GPT2LMHead  # noqa: E402

TAGS = ["tiny", "tiny_tied", "tiny_v5", "tiny_llama3", "tiny_qwen2", "tiny_qwen3", "tiny_gpt2",
        "tiny_qwen3_moe", "tiny_mixtral", "tiny_qwen2_moe"]
MOE = ("qwen3_moe", "mixtral", "qwen2_moe")


def hf_model(transformers, tag, cfg, weights):
    """transformers' model of tag with weights: from the config (loaded by name), or for the
    models with experts from a folder of their files (per-expert tensors, stacked by
    transformers 5 as it loads them). Returns the model and the names it lacked or did not
    take (none for a folder: from_pretrained would have said)."""
    if cfg["model_type"] not in MOE:
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg), torch_dtype=torch.float64,
            attn_implementation="eager")
        missing, unexpected = hf.load_state_dict(weights, strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not cfg["tie_word_embeddings"]]
        return hf, missing, unexpected
    folder = tempfile.mkdtemp(prefix="check-transformers-")
    try:
        shutil.copy(os.path.join(HERE, tag + "_config.json"), os.path.join(folder, "config.json"))
        shutil.copy(init_of(tag), os.path.join(folder, "model.safetensors"))
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, torch_dtype=torch.float64, attn_implementation="eager",
            output_loading_info=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return hf, list(info.get("missing_keys", [])), list(info.get("unexpected_keys", []))


def init_of(tag):
    with open(os.path.join(HERE, tag + "_golden.safetensors"), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n)).get("__metadata__", {})
    return os.path.join(HERE, meta.get("init", tag + "_init.safetensors"))


def main():
    try:
        import transformers
    except ImportError:
        print("check_transformers.py: transformers is not installed: nothing compared")
        return 0
    torch.set_default_dtype(torch.float64)
    x, _ = batch(load_tokens(), 0)
    worst = 0.0
    for tag in TAGS:
        with open(os.path.join(HERE, tag + "_config.json")) as f:
            cfg = json.load(f)
        weights = {k: v.double() for k, v in load_safetensors(init_of(tag)).items()}
        hf, missing, unexpected = hf_model(transformers, tag, cfg, weights)
        hf.eval()
        ours = GPT2LMHead(cfg) if cfg["model_type"] == "gpt2" else CausalLM(cfg)
        if cfg["model_type"] in MOE:  # the experts stacked, every name taken
            ours.load_state_dict(stacked_names(weights, ours), strict=True)
        else:
            ours.load_state_dict(weights, strict=False)
        with torch.no_grad():
            a = hf(x).logits
            b = ours(x)
        err = float((a - b).norm() / b.norm())
        worst = max(worst, err)
        print("%-12s %-22s relative L2 %.3g%s" % (
            tag, type(hf).__name__, err,
            "" if not (missing or unexpected) else
            " (missing %s, unexpected %s)" % (missing, unexpected)))
        if missing or unexpected:
            worst = 1.0
    print("transformers %s, torch %s: worst %.3g" % (transformers.__version__, torch.__version__,
                                                     worst))
    return 1 if worst > 1e-5 else 0


if __name__ == "__main__":
    sys.exit(main())
