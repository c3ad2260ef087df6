"""Malformed input: the documented message from every rank, a non-zero exit, fast."""
import os
import re
import struct
import subprocess
import sys
import time

from common import (BASE, EXE, MPIRUN, MPI_ARGS, ROOT, TOOL, check, kill_session, losses, mkdtemp,
                    ranks_saying, run, sh)


def errors():
    tmp = mkdtemp()
    data = os.path.join(ROOT, "data", "corpus.txt")
    base = BASE.replace("{data}", data)
    tp_base = base.replace("dp_shard: -1", "dp_shard: 1\n  tp: 2").replace("n_kv_heads: 1",
                                                                          "n_kv_heads: 2")
    def tp_plan(rules):
        return tp_base.replace("parallelize:\n",
                               "parallelize:\n  tensor_parallel:\n    plan: {%s}\n" % rules)
    odd = os.path.join(tmp, "odd.bin")
    with open(odd, "wb") as f:
        f.write(b"\x01\x02\x03")
    with open(data, "rb") as f:
        corpus = f.read()
    llmc_as_text = os.path.join(tmp, "llmc.bin")  # an llm.c token file under format: text
    with open(llmc_as_text, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, 600, *([0] * 253)) + bytes(1200))
    # (name, plan text or None for BASE, extra args, expected message regex)
    cases = [
        ("--set with an empty value", None, ["--set", "data.seq_len="],
         r"--set data\.seq_len=: no value after '='"),
        # "" (a template's unset variable) is no path: not the key left out, which would
        # train without saving or evaluating
        ("an empty checkpoint.dir", base + 'checkpoint:\n  dir: ""\n', [],
         r"bad\d*\.yaml:\d+:\d+: checkpoint\.dir: an empty path: give a path, or null to leave "
         r"it unset"),
        ("an empty log.metrics on the command line", None, ["--set", "log.metrics=''"],
         r"--set log\.metrics='': log\.metrics: an empty path"),
        ("an empty eval.path on the command line", None, ["--set", 'eval.path=""'],
         r'--set eval\.path="": eval\.path: an empty path'),
        # a data pattern over the folder checkpoint.dir lies in (which the run makes first)
        ("a data.path pattern matching checkpoint.dir", None,
         ["--set", "data.path=" + os.path.join(tmp, "dd", "*"), "--set",
          "checkpoint.dir=" + os.path.join(tmp, "dd", "ck")],
         r"data\.path: the pattern '\S+/dd/\*' matches checkpoint\.dir '\S+/dd/ck'"),
        ("a data.path pattern matching a folder made for checkpoint.dir", None,
         ["--set", "data.path=" + os.path.join(tmp, "de", "*"), "--set",
          "checkpoint.dir=" + os.path.join(tmp, "de", "ck", "run1")],
         r"data\.path: the pattern '\S+/de/\*' matches '\S+/de/ck', a folder of checkpoint\.dir "
         r"'\S+/de/ck/run1'"),
        # a section given null takes --set keys as if it were absent (no duplicate key)
        ("--set into a section set to null", None,
         ["--set", "model=null", "--set", "model.dimm=32"],
         r"--set model\.dimm=32: model\.dimm: unknown key; did you mean 'dim'\?"),
        ("--set into a section left empty", base + "eval:\n", ["--set", "eval.pathh=x"],
         r"eval\.pathh: unknown key; did you mean 'path'\?"),
        ("a rotary theta for GPT-2", base, ["--set", "model.architecture=gpt2", "--set",
                                            "model.rope_theta=1000000"],
         r"model\.rope_theta: gpt2 has no rotary embedding \(its positions are learned\)"),
        ("an mp_policy for a head tied to the embedding", base.replace(
            'units: ["model.layers.*"]',
            'units: ["model.layers.*", model.embed_tokens, {match: lm_head, mp_policy: '
            '{param_dtype: bf16}}]'), ["--set", "model.tie_embeddings=true"],
         r"units item 'lm_head': lm_head computes with the parameters of the unit it joins \(a "
         r"tied head, with the token embedding's\), so its mp_policy would not apply"),

        ("an llm.c token file read as text", base.replace(data, llmc_as_text), [],
         r"llmc\.bin: starts with llm\.c's header \(magic 20240520\).*data\.format: llmc"),
        ("syntax error", "mesh: [1, 2\n", [], r"bad\d*\.yaml:\d+:\d+: not valid YAML"),
        ("wrong type", base.replace("seq_len: 16", "seq_len: abc"), [],
         r"bad\d*\.yaml:16:12: data\.seq_len: expected an integer, got 'abc'"),
        ("unknown top-level key", base + "trian:\n  steps: 3\n", [],
         r"trian: unknown key; did you mean 'train'\?"),
        ("unknown key like no key", base + "foo:\n  x: 1\n", [],
         r"foo: unknown key \(expected one of: mesh, model, moe, "),
        ("unknown nested key", base.replace("  dim: 32", "  dimm: 32"), [],
         r"model\.dimm: unknown key; did you mean 'dim'\?"),
        ("negative mesh size", base.replace("dp_shard: -1", "dp_shard: -3"), [],
         r"mesh\.dp_shard: -3 is out of range"),
        ("zero mesh size", base.replace("dp_shard: -1", "dp_shard: 0"), [],
         r"mesh\.dp_shard: a mesh size must be positive"),
        ("mesh product differs from the world", base.replace("dp_shard: -1", "dp_shard: 3"), [],
         r"mesh: dp_replicate x dp_shard x tp = 1 x 3 x 1 = 3, but the world has 2 ranks"),
        ("integer reshard not dividing dp_shard", base.replace(
            'units: ["model.layers.*"]', 'units: ["model.layers.*"]\n    reshard_after_forward: 3'),
         [], r"\.yaml:14:\d+: parallelize\.fully_shard\.reshard_after_forward: 3 is above "
             r"mesh\.dp_shard=2"),
        ("integer reshard 1, which PyTorch reads as false", base.replace(
            'units: ["model.layers.*"]', 'units: ["model.layers.*"]\n    reshard_after_forward: 1'),
         [], r"fully_shard\.reshard_after_forward: 1 is ambiguous: .*write false to keep them "
             r"whole"),
        ("a unit's integer reshard not dividing dp_shard", base.replace(
            'units: ["model.layers.*"]',
            'units: [{match: "model.layers.*", reshard_after_forward: 3}]'),
         [], r"fully_shard\.units\[0\]\.reshard_after_forward: 3 is above "
             r"mesh\.dp_shard=2"),
        ("missing data file", base.replace(data, "/nonexistent/tokens.bin"), [],
         r"data\.path: cannot read '/nonexistent/tokens\.bin'"),
        ("unit pattern matching nothing", base.replace('"model.layers.*"', '"model.blocks.*"'),
         [], r"units\[0\]: 'model\.blocks\.\*' matches no module"),
        ("shard_dims pattern matching nothing", base.replace(
            'units: ["model.layers.*"]',
            'units: ["model.layers.*"]\n    shard_dims: {"model.blocks.*.weight": 1}'), [],
         r"bad\d*\.yaml:\d+:\d+: parallelize\.fully_shard\.shard_dims: 'model\.blocks\.\*\.weight' "
         r"matches no parameter \(parameters here: model\.embed_tokens\.weight, "),
        ("shard dimension a parameter does not have", base.replace(
            'units: ["model.layers.*"]', 'units: ["model.layers.*"]\n    shard_dims: {"model.layers.*.mlp.*.weight": 1}'),
         ["--set",
            'parallelize.fully_shard.shard_dims."model.norm.weight"=1'],
         r"--set parallelize\.fully_shard\.shard_dims\.\"model\.norm\.weight\"=1: "
         r"parallelize\.fully_shard\.shard_dims: parameter model\.norm\.weight has 1 "
         r"dimension; 'model\.norm\.weight' gives it dimension 1 \(from -1 to 0\)"),
        ("shard dimension not an integer", base.replace(
            'units: ["model.layers.*"]',
            'units: ["model.layers.*"]\n    shard_dims: {"lm_head.weight": last}'), [],
         r"fully_shard\.shard_dims\.lm_head\.weight: expected an integer, got 'last'"),
        ("optimizer_sharding neither shard nor full", base.replace(
            'units: ["model.layers.*"]', 'units: ["model.layers.*"]\n    optimizer_sharding: all'),
         [], r"fully_shard\.optimizer_sharding: expected shard .* or full .*, got 'all'"),
        ("optimizer_sharding full with offload", base.replace(
            "dp_shard: -1", "dp_replicate: 2\n  dp_shard: 1").replace(
            'units: ["model.layers.*"]', 'units: ["model.layers.*"]\n    offload: true\n'
            '    optimizer_sharding: full'), [],
         r"bad\d*\.yaml:\d+:\d+: parallelize\.fully_shard\.optimizer_sharding: full does not "
         r"compose with offload: true yet \(use shard\)"),
        ("empty file", "", [], r"the plan is empty"),
        ("binary garbage", b"\x00\x01\xff\xfe garbage \x80\x81", [], r"not valid YAML"),
        ("huge number", base.replace("batch_size: 2", "batch_size: 99999999999999999999999"),
         [], r"data\.batch_size: 99999999999999999999999 is out of range"),
        ("duplicate key", base + "data:\n  seq_len: 8\n", [],
         r"data: duplicate key \(first given at .*bad\d*\.yaml:14:1\)"),
        ("tp not dividing the key/value heads", tp_base.replace("n_kv_heads: 2", "n_kv_heads: 1"),
         [], r"mesh\.tp: 2 does not divide model\.n_kv_heads=1"),
        ("unknown tp style", tp_plan("lm_head: diagonal"), [],
         r"tensor_parallel\.plan\.lm_head: unknown style 'diagonal'"),
        ("unknown tp layout", tp_plan("lm_head: {style: colwise, output: sideways}"), [],
         r"plan\.lm_head: output: expected replicate, shard\(1\) or shard\(-1\)"),
        ("tp pattern matching nothing", tp_plan("model.blocks.*.mlp: prepare_input"), [],
         r"bad\d*\.yaml:\d+:\d+: parallelize\.tensor_parallel\.plan: 'model\.blocks\.\*\.mlp' "
         r"matches no module"),
        ("tp style on the wrong layer", tp_plan("model.norm: colwise"), [],
         r"tensor parallel: model\.norm: colwise applies to linear, conv1d and embedding layers, not to a "
         r"module of kind 'rmsnorm'"),
        ("lm_head logits left split", tp_plan("lm_head: colwise"), [],
         r"plan\.lm_head: the loss needs whole logits"),
        ("k_proj left whole beside a split q_proj",
         tp_plan("model.layers.*.self_attn.q_proj: colwise, "
                 "model.layers.*.self_attn.v_proj: colwise, "
                 "lm_head: {style: colwise, output: replicate}"), [],
         r"model\.layers\.0\.self_attn's q_proj is split over tp \(rule "
         r"'model\.layers\.\*\.self_attn\.q_proj'\) and its k_proj is not \(no rule\): q_proj, "
         r"k_proj and v_proj must split their heads alike"),
        ("up_proj output whole beside a split gate_proj",
         tp_plan("model.layers.*.mlp.gate_proj: colwise, "
                 "model.layers.*.mlp.up_proj: {style: colwise, output: replicate}, "
                 "lm_head: {style: colwise, output: replicate}"), [],
         r"model\.layers\.0\.mlp's gate_proj is split over tp .* and its up_proj is not \(its "
         r"rule outputs whole\): gate_proj and up_proj must split their features alike"),
        ("sequence not divisible by tp", tp_base.replace("seq_len: 16", "seq_len: 15").replace(
            "parallelize:\n", "parallelize:\n  tensor_parallel:\n    sequence_parallel: true\n"),
         [], r"data\.seq_len: 15 is not divisible by mesh\.tp=2"),
        ("unknown dtype", base.replace('units: ["model.layers.*"]',
                                       'units: ["model.layers.*"]\n    mp_policy: {param_dtype: f8}'),
         [], r"mp_policy\.param_dtype: expected f32, bf16 or f16, got 'f8'"),
        ("not a boolean", base.replace("  max_seq_len: 64", "  max_seq_len: 64\n  tie_embeddings: maybe"),
         [], r"model\.tie_embeddings: expected true or false, got 'maybe'"),
        ("--set without a value", None, ["--set", "train.steps"], r"--set train\.steps: expected key\.path=value"),
        ("--set with an unknown key", None, ["--set", "train.stepz=3"],
         r"--set train\.stepz=3: train\.stepz: unknown key; did you mean 'steps'\?"),
        ("--set with a bad value", None, ["--set", "optim.lr=-1"],
         r"--set optim\.lr=-1: optim\.lr: -1 is out of range"),
        ("--set with a list's quote unclosed", None,
         ["--set", "parallelize.fully_shard.units=['model.layers.*]"],
         r"--set parallelize\.fully_shard\.units=\['model\.layers\.\*\]: a quote in the list "
         r"is not closed"),
        ("--set with a nested list", None, ["--set", "parallelize.fully_shard.units=[[a], b]"],
         r"units\[0\]: expected a mapping of keys \(match, \.\.\.\)"),
        ("--set with a flow value that is not YAML", None,
         ["--set", "parallelize.fully_shard.units=[{match: model.layers.*]"],
         r"--set parallelize\.fully_shard\.units=\[\{match: model\.layers\.\*\]: the value is "
         r"not valid YAML: did not find expected ',' or '\}' while parsing a flow mapping"),
        ("--set with a pattern read as an alias", None,
         ["--set", "parallelize.fully_shard.units=[{match: *norm*}]"],
         r"not valid YAML: .* alias \(at character 15\); a pattern that starts with '\*' goes in "
         r"quotes: '\*norm\*'"),
        ("--set with a flow value followed by more", None,
         ["--set", "parallelize.fully_shard.mp_policy={param_dtype: bf16} junk"],
         r"mp_policy=\{param_dtype: bf16\} junk: the value is not valid YAML: did not find "
         r"expected <document start>"),
        ("--set with a pattern read as an undefined alias", None,
         ["--set", "parallelize.fully_shard.units=[{match: *norm, reshard_after_forward: true}]"],
         r"not valid YAML: found undefined alias \(at character \d+\); a pattern that starts "
         r"with '\*' goes in quotes"),
        ("--set with an empty list item", None, ["--set", "parallelize.fully_shard.units=[a,,b]"],
         r"--set parallelize\.fully_shard\.units=\[a,,b\]: a list item is empty"),
        ("--set with a list item in the wrong place", None,
         ["--set", "parallelize.fully_shard.units=['model.layers.*'x]"],
         r"expected ',' after a quoted list item"),
        ("inconsistent model", base.replace("n_heads: 2", "n_heads: 3"), [], r"bad\d*\.yaml:\d+:\d+: model: "),
        ("top level not a mapping", "- mesh\n- model\n", [], r"expected a mapping of sections"),
        # a plan is one document, a byte-order mark only at its start (one there is read)
        ("two YAML documents", base + "---\ntrain:\n  steps: 7\n", [],
         r"bad\d*\.yaml:\d+:1: a second YAML document \('---'\): a plan is one document"),
        ("a second YAML document that is not valid", base + "---\ntrain: {steps: 7\n", [],
         r"bad\d*\.yaml:\d+:1: not valid YAML: did not find expected ',' or '\}'"),
        ("a byte-order mark after the first", ("\ufeff\ufeff" + base).encode(), [],
         r"bad\d*\.yaml:1: a byte-order mark \(U\+FEFF\) where only the file's start may have one"),
        ("missing plan file", "MISSING", [], r"cannot open the plan .*missing\.yaml: No such file"),
        ("unknown option", None, ["--frobnicate"], r"unknown option '--frobnicate'"),
        ("a tensor-parallel rule given twice", None,
         ["--set", "parallelize.tensor_parallel.plan={lm_head: colwise, lm_head: rowwise}"],
         r"parallelize\.tensor_parallel\.plan: 'lm_head' appears twice"),
        ("a shard_dims pattern that never applies", None,
         ["--set", 'parallelize.fully_shard.shard_dims={"model.layers.*.mlp.*_proj.weight": 1, '
                   '"model.layers.*.mlp.down_proj.weight": 0}'],
         r"every parameter 'model\.layers\.\*\.mlp\.down_proj\.weight' matches is taken by the "
         r"earlier 'model\.layers\.\*\.mlp\.\*_proj\.weight'"),
        ("a parameter group that never applies", None,
         ["--set", 'optim.param_groups={"*": {weight_decay: 0}, "*norm*": {lr: 1e-4}}'],
         r"optim\.param_groups: every parameter '\*norm\*' matches is taken by the earlier '\*'"),
        ("a quoted --set value: a string without its quotes", None,
         ["--set", "data.format='bytes'"], r"data\.format: expected text, u16, u32 or llmc, got "
                                           r"'bytes'"),
        ("a --set value not UTF-8", None, ["--set", "data.path=x\udcff.txt"],
         r"--set data\.path=x\.\.\.: not valid UTF-8 at byte 12 \(0xff\)"),
        ("-v without --dry-run", None, ["-v"], r"-v goes with --dry-run"),
        ("--verbose without --dry-run", None, ["--verbose"], r"--verbose goes with --dry-run"),
        ("eval.interval without eval.path", base + "eval:\n  interval: 5\n", [],
         r"eval\.interval: 5 needs eval\.path"),
        ("missing eval file", base + "eval:\n  path: /nonexistent/val.bin\n", [],
         r"eval\.path: cannot read '/nonexistent/val\.bin'"),
        ("no eval batches", base + "eval:\n  path: %s\n  batches: 0\n" % data, [],
         r"eval\.batches: 0 is out of range"),
        ("two sizes of -1", base.replace("dp_shard: -1", "dp_shard: -1\n  dp_replicate: -1"), [],
         r"mesh: at most one size may be -1"),
        ("sequence longer than the model's", base.replace("seq_len: 16", "seq_len: 128"), [],
         r"data\.seq_len: 128 exceeds model\.max_seq_len=64"),
        ("unknown data format", base.replace("  seq_len: 16", "  format: csv\n  seq_len: 16"), [],
         r"data\.format: expected text, u16, u32 or llmc, got 'csv'"),
        ("units not a list", base.replace('units: ["model.layers.*"]', 'units: "model.layers.*"'),
         [], r"units: expected a list of module patterns"),
        ("checkpoint.load not a checkpoint", base + "checkpoint:\n  load: /nonexistent/step-5\n", [],
         r"bad\d*\.yaml:21:9: checkpoint\.load: '/nonexistent/step-5' does not exist"),
        ("checkpoint.load: AUTO", base + "checkpoint:\n  dir: ck\n  load: AUTO\n", [],
         r"checkpoint\.load: '\S+AUTO' does not exist \(resuming the newest checkpoint of "
         r"checkpoint\.dir is auto, in lower case\)"),
        ("checkpoint.interval without a folder", base + "checkpoint:\n  interval: 5\n", [],
         r"checkpoint\.interval: 5 needs checkpoint\.dir"),
        ("checkpoint.keep without a folder", base + "checkpoint:\n  keep: 2\n", [],
         r"checkpoint\.keep: 2 needs checkpoint\.dir \(nothing is saved without it\)"),
        ("checkpoint.async without a folder", base + "checkpoint:\n  async: true\n", [],
         r"checkpoint\.async: true needs checkpoint\.dir"),
        ("train.time_limit without a folder", base.replace("train:\n", "train:\n  time_limit: 60\n"),
         [], r"train\.time_limit: 60 s needs checkpoint\.dir"),
        ("checkpoint.overwrite without a folder", base + "checkpoint:\n  overwrite: true\n", [],
         r"checkpoint\.overwrite: true needs checkpoint\.dir"),
        ("checkpoint.verify with nothing to load", base + "checkpoint:\n  verify: true\n", [],
         r"checkpoint\.verify: true checks a checkpoint before loading it, and none is loaded"),
        # hostile input ends at once: no blocking open, no quadratic parse
        ("plan path is a FIFO", "FIFO", [], r"cannot open the plan .*fifo\.yaml: is a FIFO, not a "
         r"regular file"),
        ("data path is a FIFO", base.replace(data, os.path.join(tmp, "fifo.yaml")), [],
         r"data\.path: cannot read '.*fifo\.yaml': not a regular file"),
        ("data path is a folder", base.replace(data, tmp), [], r"is a folder|not a regular file"),
        ("flow lists nested 400,000 deep", "mesh: " + "[" * 400000 + "]" * 400000 + "\n", [],
         r"bad\d*\.yaml:1:\d+: collections nested more than 64 deep"),
        ("block lists nested 400,000 deep", "mesh:\n  " + "- " * 400000 + "x\n", [],
         r"bad\d*\.yaml:2:\d+: collections nested more than 64 deep"),
        ("a 2 MB plan", base + "#" + "x" * 2000000 + "\n", [],
         r"bad\d*\.yaml: \d+ bytes, more than the 1048576 this file may have"),
        ("param group matching nothing", base + "optim:\n  param_groups:\n    \"model.nope.*\": "
         "{lr: 0.1}\n", [], r"optim\.param_groups: 'model\.nope\.\*' matches no parameter"),
        ("param group given twice", base + "optim:\n  param_groups:\n    \"*norm*\": {lr: 0.1}\n"
         "    \"*norm*\": {lr: 0.2}\n", [], r"optim\.param_groups: '\*norm\*' appears twice"),
        ("unknown sharding_strategy", None, ["--set", "parallelize.fully_shard.sharding_strategy="
                                                      "FULLY"],
         r"sharding_strategy: expected FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, "
         r"_HYBRID_SHARD_ZERO2 or NO_SHARD, got 'FULLY'"),
        ("zero_stage 1", None, ["--set", "parallelize.fully_shard.zero_stage=1"],
         r"zero_stage: expected 3 \(.*FULL_SHARD\) or 2 \(.*SHARD_GRAD_OP\), got '1'"),
        ("sharding_strategy and zero_stage", None,
         ["--set", "parallelize.fully_shard.zero_stage=3", "--set",
          "parallelize.fully_shard.sharding_strategy=FULL_SHARD"],
         r"give sharding_strategy or zero_stage, not both"),
        ("sharding_strategy against reshard_after_forward", None,
         ["--set", "parallelize.fully_shard.sharding_strategy=SHARD_GRAD_OP", "--set",
          "parallelize.fully_shard.reshard_after_forward=true"],
         r"reshard_after_forward: disagrees with parallelize\.fully_shard\.sharding_strategy = "
         r"SHARD_GRAD_OP \(which means reshard_after_forward false\): give one"),
        ("sharding_strategy against the mesh", None,
         ["--set", "parallelize.fully_shard.sharding_strategy=NO_SHARD", "--set",
          "mesh.dp_shard=2"],
         r"mesh\.dp_shard: 2 disagrees with parallelize\.fully_shard\.sharding_strategy = "
         r"NO_SHARD"),
        ("unknown train.nonfinite", base.replace("  steps: 2", "  steps: 2\n  nonfinite: ignore"), [],
         r"train\.nonfinite: expected stop or skip, got 'ignore'"),
        ("train.deterministic not a boolean", None, ["--set", "train.deterministic=yes"],
         r"--set train\.deterministic=yes: train\.deterministic: expected true or false, got 'yes'"),
        ("unknown train.device", None, ["--set", "train.device=gpu"],
         r"--set train\.device=gpu: train\.device: expected auto, cpu or cuda, got 'gpu'"),
        # the CPU modes hide the devices (CUDA_VISIBLE_DEVICES above)
        ("train.device cuda without a device", None, ["--set", "train.device=cuda"],
         r"train\.device: cuda: (this rank sees no CUDA device .*|the library was built without "
         r"CUDA): ask for the CPU \(cpu\), or for auto"),
        # a value given by --set is named as given, not by a line of the file
        ("--set mesh size against the world", None, ["--set", "mesh.dp_shard=3"],
         r"--set mesh\.dp_shard=3: mesh: dp_replicate x dp_shard x tp = 1 x 3 x 1 = 3, but the "
         r"world has 2 ranks"),
        ("--set data.path missing", None, ["--set", "data.path=/nonexistent/t.bin"],
         r"--set data\.path=/nonexistent/t\.bin: data\.path: cannot read"),
        ("--set reshard_after_forward not dividing", None,
         ["--set", "parallelize.fully_shard.reshard_after_forward=3"],
         r"--set parallelize\.fully_shard\.reshard_after_forward=3: parallelize\.fully_shard\."
         r"reshard_after_forward: 3 is above mesh\.dp_shard=2"),
        ("--set seq_len too long", None, ["--set", "data.seq_len=128"],
         r"--set data\.seq_len=128: data\.seq_len: 128 exceeds model\.max_seq_len=64"),
        ("--set key path with an open quote", None, ["--set", 'optim.param_groups."*norm*.lr=1'],
         r"a quote in the key path is not closed"),
        # model.init_from with architecture keys: all of them named at once
        ("init_from with model keys", base.replace("  dim: 32", "  init_from: %s\n  dim: 32" % tmp),
         [], r"model: the architecture comes from .*/config\.json with model\.init_from; remove "
             r"model\.dim, model\.n_layers, model\.n_heads, model\.n_kv_heads, model\.ffn_dim, "
             r"model\.vocab_size, model\.max_seq_len$"),
        # data.global_batch_size states batch_size x data-parallel ranks x grad_accum
        # a batch error names the --set of a batch key, not another of the data section's
        ("global batch with another --set in data", None,
         ["--set", "data.global_batch_size=6", "--set", "data.seq_len=8"],
         r"--set data\.global_batch_size=6: data\.global_batch_size: 6 is not a multiple"),
        ("global batch not a multiple", None, ["--set", "data.global_batch_size=6"],
         r"data\.global_batch_size: 6 is not a multiple of data\.batch_size 2 x 2 data-parallel "
         r"ranks = 4 samples a micro-batch"),
        ("global batch against grad_accum", None,
         ["--set", "data.global_batch_size=8", "--set", "data.grad_accum=3"],
         r"data\.global_batch_size: 8 is not data\.batch_size 2 x 2 data-parallel ranks x "
         r"data\.grad_accum 3 = 12"),
        # --dry-run refuses what the run would
        ("--dry-run, u16 tokens in an odd-sized file",
         base.replace(data, odd).replace("  seq_len: 16", "  format: u16\n  seq_len: 16"),
         ["--dry-run"], r"data file .*odd\.bin: 3 bytes is not a whole number of uint16 tokens"),
    ]
    os.mkfifo(os.path.join(tmp, "fifo.yaml"))
    def one(k):
        name, text, extra, want = cases[k]
        path = os.path.join(tmp, "bad%d.yaml" % k)
        if text == "MISSING":
            path = os.path.join(tmp, "missing.yaml")
        elif text == "FIFO":
            path = os.path.join(tmp, "fifo.yaml")
        else:
            mode = "wb" if isinstance(text, bytes) else "w"
            with open(path, mode) as f:
                f.write(text if text is not None else base)
        try:
            return run(2, [path] + extra, timeout=60)
        except subprocess.TimeoutExpired:
            return None, 60.0

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, range(len(cases))))
    for (name, _, _, want), (p, secs) in zip(cases, results):
        if p is None:
            check(False, "%s: finishes (timed out)" % name)
            continue
        # the same error on both ranks: printed once, naming both
        once = len([l for l in p.stderr.splitlines() if re.search(want, l)]) == 1
        both = ranks_saying(p.stderr, want) == {"0", "1"}
        good = p.returncode != 0 and both and once and secs < 30
        check(good, "%s: exit %d in %.1fs, said once for both ranks /%s/"
              % (name, p.returncode, secs, want))
        if not good:
            print(p.stderr[-1500:])
    check(len(cases) >= 20, "%d malformed inputs" % len(cases))
    # token ids are checked where each batch reads them, naming the file and the byte offset;
    # the start-up reads only sizes and headers, and the evaluation's batches. The corpus as
    # uint16 tokens with an id past the vocabulary: at token 100 only rank 1's batch of the
    # second step reads it (samples of 17 tokens from 96 and 112); at the end of the file, the
    # two steps never read it; in the evaluation's first batch, it is refused before step 1.
    for name, at, fmt, vocab, step_lines, want in (
            ("a text file beyond a vocabulary of 50", None, "text", 50, 0,
             r"data file \S+corpus\.txt: the token at byte offset \d+ has id \d+, outside the "
             r"vocabulary of 50"),
            ("an id of 300 read by rank 1 in step 2", 100, "u16", 256, 1,
             r"data file \S+bad\.u16: the token at byte offset 200 has id 300, outside the "
             r"vocabulary of 256"),
            ("an id of 300 that no step reads", len(corpus), "u16", 256, 2, None),
            ("eval tokens: an id of 300 in the first batch", 5, "eval", 256, 0,
             r"eval\.path: data file \S+bad\.u16: the token at byte offset 10 has id 300, "
             r"outside the vocabulary of 256")):
        path, text = data, base.replace("vocab_size: 256", "vocab_size: %d" % vocab)
        if at is not None:
            path = os.path.join(tmp, "bad.u16")
            tokens = list(corpus[:at]) + [300] + list(corpus[at:])
            with open(path, "wb") as f:
                f.write(struct.pack("<%dH" % len(tokens), *tokens))
        if fmt == "u16":
            text = text.replace(data, path).replace("  seq_len: 16", "  format: u16\n  seq_len: 16")
        elif fmt == "eval":
            text += "eval:\n  path: %s\n  format: u16\n" % path
        plan = os.path.join(tmp, "vocab.yaml")
        with open(plan, "w") as f:
            f.write(text + "log:\n  interval: 1\n")
        metrics = os.path.join(tmp, "vocab.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        p, secs = run(2, [plan, "--metrics", metrics], timeout=60)
        lines = len(re.findall(r"^step\s+\d+/", p.stdout, re.M))
        if os.path.exists(metrics):  # every step line has its metrics line
            with open(metrics) as f:
                lines = min(lines, sum(1 for _ in f))
        if want is None:
            check(p.returncode == 0 and lines == step_lines,
                  "%s: trains (the start reads no token)" % name)
            continue
        said = ranks_saying(p.stderr, want)
        check(p.returncode != 0 and said == {"0", "1"} and lines == step_lines and secs < 30,
              "%s: stopped after %d step line(s), every rank naming the file and offset /%s/" %
              (name, step_lines, want[:50]))
        if said != {"0", "1"}:
            print(p.stderr[-1500:])
    # the same tokens as text, uint16, uint32 and llm.c's files (three shards by a pattern,
    # uint16 and uint32 ones mixed) train the same model
    got = {}
    for fmt, width in (("text", 0), ("u16", 2), ("u32", 4), ("llmc", 0)):
        path = data
        if width:
            path = os.path.join(tmp, "corpus." + fmt)
            with open(path, "wb") as f:
                f.write(struct.pack("<%d%s" % (len(corpus), "H" if width == 2 else "I"), *corpus))
        if fmt == "llmc":
            path = os.path.join(tmp, "shard_*.bin")
            cut = [0, 40, 100, len(corpus)]  # the two steps read tokens 0-128: all three
            for k in range(3):
                part = corpus[cut[k]:cut[k + 1]]
                magic, version, code = (20240801, 7, "I") if k == 1 else (20240520, 1, "H")
                with open(os.path.join(tmp, "shard_%d.bin" % k), "wb") as f:
                    f.write(struct.pack("<256i", magic, version, len(part), *([0] * 253)))
                    f.write(struct.pack("<%d%s" % (len(part), code), *part))
        plan = os.path.join(tmp, "format-%s.yaml" % fmt)
        with open(plan, "w") as f:
            f.write(base.replace(data, path).replace("  seq_len: 16",
                                                     "  format: %s\n  seq_len: 16" % fmt))
        metrics = os.path.join(tmp, "format-%s.jsonl" % fmt)
        p, _ = run(2, [plan, "--metrics", metrics])
        got[fmt] = [r["loss"] for r in losses(metrics)] if p.returncode == 0 else p.stderr[-500:]
    check(len(got["text"]) == 2 and got["text"] == got["u16"] == got["u32"] == got["llmc"],
          "data.format text, u16, u32 and llmc (three files by a pattern) of the same tokens "
          "give bit-identical losses (%s)" % got)
    # one rank fails alone mid-run (its samples are cut from the token file): the other is
    # stopped at once instead of waiting in the step's collectives until the watchdog, and
    # both name the file
    big = os.path.join(tmp, "big.txt")
    with open(big, "wb") as f:
        f.write(corpus * 64)  # no wrap-around for 150,000 steps
    plan = os.path.join(tmp, "shrink.yaml")
    with open(plan, "w") as f:
        f.write(base.replace(data, big).replace("steps: 2", "steps: 1000000") +
                "log:\n  interval: 1\n")
    cmd = [MPIRUN] + MPI_ARGS + ["-n", "2", EXE, plan]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    import threading
    steps = []

    def read_steps():
        for line in proc.stdout:
            m = re.match(r"step\s+(\d+)/", line)
            if m:
                steps.append(int(m.group(1)))
    threading.Thread(target=read_steps, daemon=True).start()
    t = time.time()
    while not steps and time.time() - t < 120:
        time.sleep(0.05)
    # step s (from 0) reads tokens 64 s .. 64 s + 32 on rank 0 and 64 s + 32 .. 64 s + 64 on
    # rank 1 (batch 2 x 16 per rank): at 64 s + 40 bytes, rank 1 alone fails at step s
    fail = (steps[-1] if steps else 0) + 3000
    os.truncate(big, 64 * fail + 40)
    t = time.time()
    try:
        err = proc.stderr.read() if proc.wait(timeout=120) is not None else ""
        secs = time.time() - t
    except subprocess.TimeoutExpired:
        err, secs = "", None
    kill_session(proc.pid)
    said = ranks_saying(err, r"data file .*big\.txt: (cannot read tokens \d+-\d+: |changed "
                             r"since the run opened it \()the file is shorter than when it was "
                             r"opened")
    check(secs is not None and secs < 60 and proc.returncode != 0 and said == {"0", "1"},
          "a token file cut mid-run fails one rank: the job ends in %s s (the watchdog: 600 s), "
          "both ranks name the file (%s)" % ("%.1f" % secs if secs else "never", sorted(said)))
    if said != {"0", "1"}:
        print(err[-1500:])
    # the token file replaced mid-run (another file renamed over it): the run stops, saved,
    # naming it, rather than train on other samples
    swap = os.path.join(tmp, "swap.txt")
    with open(swap, "wb") as f:
        f.write(corpus * 64)
    plan = os.path.join(tmp, "swap.yaml")
    ck = os.path.join(tmp, "ck-swap")
    with open(plan, "w") as f:
        f.write(base.replace(data, swap).replace("steps: 2", "steps: 1000000") +
                "log:\n  interval: 1\ncheckpoint:\n  dir: %s\n" % ck)
    proc = subprocess.Popen([EXE, plan], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    time.sleep(2)
    with open(swap + ".new", "wb") as f:
        f.write(b"a" * 200000)
    os.rename(swap + ".new", swap)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
    check(proc.returncode == 1 and re.search(r"data file .*swap\.txt: changed since the run "
                                             r"opened it \(another file at its path\)", err)
          and re.search(r"stopping after step \d+ on the error below; saved", err) is not None,
          "a token file replaced mid-run stops the run, saved, naming it (exit %s: %s)"
          % (proc.returncode, err.strip()[-300:]))
    # a module with parameters and no tensor-parallel rule given a shard of its input (a norm
    # on sequence shards, Qwen3's head norms on each rank's heads) would train another model:
    # refused on every rank at the first forward, naming it and the rule it needs
    tp_plan = os.path.join(ROOT, "configs", "tp.yaml")
    no_norm = os.path.join(mkdtemp(), "tp-no-norm.yaml")
    with open(tp_plan) as f, open(no_norm, "w") as g:
        g.write(f.read().replace("      model.norm: sequence_parallel\n", "").replace(
            "../data/", os.path.join(ROOT, "data") + "/"))
    for plan, sets, want in (
            (no_norm, [], r"tensor parallel: model\.norm has parameters and no rule, but its "
             r"input comes shard\(1\).*sequence_parallel for a norm on sequence shards"),
            (tp_plan, ["model.architecture=qwen3",
                       "parallelize.tensor_parallel.sequence_parallel=false"],
             r"tensor parallel: model\.layers\.0\.self_attn\.q_norm has parameters and no "
             r"rule, but its input comes shard\(-1\).*headwise"),
            # and a unit's output dtype that the head, outside every unit, does not take
            (os.path.join(ROOT, "configs", "fsdp.yaml"),
             ["mesh.dp_shard=2", "parallelize.fully_shard.mp_policy.output_dtype=bf16"],
             r"lm_head: its input is not of its parameters' dtype \(a unit's mp_policy "
             r"output_dtype, or the compute dtype a unit before it returns, which no unit casts "
             r"for lm_head: make it a unit of its own with parameters")):
        p, _ = run(2, [plan, "--set", "train.steps=2"] + sum((["--set", x] for x in sets), []),
                   timeout=120)
        said = ranks_saying(p.stderr, want)
        check(p.returncode != 0 and said == {"0", "1"} and "step " not in p.stdout,
              "refused on both ranks at the first forward, naming the module /%s/ (%s)"
              % (want[:50], p.stderr.strip()[-200:]))
    # every program: --help and --version answer at once; a wrong flag or value is an error
    build = os.path.join(os.path.dirname(EXE), "..")
    tool = lambda name: os.path.join(build, "tools", name)
    bench = lambda name: os.path.join(build, "bench", name)
    version = r"\(fsdpc\) \d+\.\d+\.\d+"
    for argv, ok, want in [
            ([EXE, "--version"], True, version), ([EXE, "--help"], True, r"usage: fsdp-train"),
            ([EXE, "--stpes", "5"], False, r"unknown option '--stpes'"),
            ([EXE, "c.yaml", "--metrics", "a.jsonl", "--metrics=b.jsonl"], False,
             r"--metrics given twice \('a\.jsonl' and 'b\.jsonl'\): a run writes one"),
            ([EXE, "c.yaml", "--plot=a.svg", "--plot", "b.svg"], False, r"--plot given twice"),
            ([TOOL, "--version"], True, version), ([TOOL, "--help"], True, r"usage: fsdp-ckpt"),
            ([TOOL, "--bogus"], False, r"fsdp-ckpt: unknown option '--bogus'\nusage:"),
            ([TOOL, "bogus"], False, r"unknown command 'bogus' \(inspect, verify"),
            ([TOOL, "verify", "x", "--bogus"], False,
             r"verify: unknown option '--bogus' \(it takes one folder\)"),
            ([TOOL, "import-hf", "a", "b", "--dtype", "bf16"], False,
             r"import-hf: unknown option '--dtype' \(it takes HFDIR OUT\)"),
            ([TOOL, "inspect", "a", "b"], False, r"inspect takes one folder, got 2 arguments"),
            ([tool("fsdp-demo"), "--help"], True, r"usage: mpirun -n 4 fsdp-demo"),
            ([tool("fsdp-demo"), "--version"], True, version),
            ([tool("fsdp-demo"), "extra"], False, r"unknown argument 'extra'"),
            ([bench("bench-train-tiny"), "--help"], True, r"usage: bench-train-tiny .*\n.*loss "
             r"curve(.|\n)*--steps N"),
            ([bench("bench-train-tiny"), "--version"], True, version),
            ([bench("bench-train-tiny"), "--steps", "abc"], False,
             r"--steps: expected an integer from 1 to \d+, got 'abc'"),
            ([bench("bench-train-tiny"), "--stpes", "5"], False, r"unknown option '--stpes'"),
            ([bench("bench-train-tiny"), "--lr", "-1"], False, r"--lr: expected a positive number"),
            ([bench("bench-fsdp-step"), "--reshard", "banana"], False,
             r"--reshard: expected auto, true, false or an integer N, got 'banana'"),
            ([bench("bench-fsdp-step"), "--help"], True, r"--reshard auto\|true\|false\|N"),
            ([bench("bench-ac-memory"), "--batch"], False, r"--batch needs a value"),
            ([bench("bench-pipeline"), "--help"], True, r"--microbatches M"),
            ([bench("bench-pipeline"), "--layers", "0"], False,
             r"--layers: expected an integer from 1 to \d+, got '0'"),
            ([bench("bench-ckpt-load"), "--reps", "0"], False,
             r"--reps: expected an integer from 1 to 64, got '0'"),
            ([bench("bench-ckpt-load"), "stray"], False, r"unexpected argument 'stray'"),
            ([tool("fsdp-plan"), "--help"], True, r"usage: fsdp-plan convert"),
            ([tool("fsdp-plan"), "--version"], True, version),
            ([tool("fsdp-plan"), "convert", "a.yaml", "--to", "x"], False,
             r"unknown option '--to'"),
            ([tool("fsdp-plan"), "convert", "a.yaml", "-o"], False, r"-o needs a file name"),
            ([tool("fsdp-plot"), "--help"], True, r"usage: fsdp-plot METRICS.jsonl\.\.\. -o"),
            ([tool("fsdp-plot"), "--version"], True, version),
            ([tool("fsdp-plot"), "--bins", "3"], False, r"unknown option '--bins'"),
            ([tool("fsdp-plot"), "m.jsonl"], False, r"no -o OUT.svg given"),
            ([EXE, os.path.join(ROOT, "configs", "debug.yaml"), "--plot", "x.svg"], False,
             r"--plot draws the metrics file: give --metrics PATH or log.metrics"),
            ([sys.executable, os.path.join(ROOT, "bench", "vs_llmc_gpu.py"), "--help"], True,
             r"usage: vs_llmc_gpu.py"),
            ([sys.executable, os.path.join(ROOT, "bench", "big_model.py"), "--version"], True,
             version),
            ([sys.executable, os.path.join(ROOT, "bench", "vs_torch_cpu.py"), "--version"], True,
             version),
            ([sys.executable, os.path.join(ROOT, "bench", "torch_fsdp2.py"), "--version"], True,
             version),
            ([sys.executable, os.path.join(ROOT, "bench", "vs_llmc_gpu.py")], True,
             r"no llm.c checkout to compare with")]:
        p = sh(argv, timeout=60)
        out = p.stdout + p.stderr
        good = (p.returncode == 0) == ok and re.search(want, out) is not None
        check(good, "%s: exit %d, says /%s/" % (" ".join([os.path.basename(argv[0])] + argv[1:]),
                                                 p.returncode, want))
        if not good:
            print(out[-1000:])
    # started by torchrun or a plain srun, each process would be alone: refused, saying how
    debug = os.path.join(ROOT, "configs", "debug.yaml")
    for env, want in [({"WORLD_SIZE": "4", "RANK": "2"},
                       r"WORLD_SIZE=4 says 4 processes were started, but this one's MPI world "
                       r"has 1 rank \(torchrun.*launch with mpirun -n 4"),
                      ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"},
                       r"SLURM_STEP_NUM_TASKS=2 .*\(srun without an MPI plugin\?\).*"
                       r"srun --mpi=pmix -n 2"),
                      ({"WORLD_SIZE": "1"}, None)]:
        p = sh([EXE, debug, "--set", "train.steps=1"], timeout=60, env=env)
        good = p.returncode == 0 if want is None else (
            p.returncode != 0 and re.search(want, p.stderr) is not None and "step" not in p.stdout)
        check(good, "fsdp-train alone with %s: %s (exit %d)" % (
            env, "trains" if want is None else "refused, /%s/" % want, p.returncode))
        if not good:
            print(p.stdout[-500:], p.stderr[-1000:])
        # a dry run trains nothing: it plans from one process under any launcher's settings
        p = sh([EXE, debug, "--dry-run", "--world", "4", "--set", "mesh.dp_shard=-1"],
               timeout=60, env=env)
        check(p.returncode == 0 and "planned from one process" in p.stdout,
              "fsdp-train --dry-run --world 4 with %s: planned (exit %d)" % (env, p.returncode))
        if p.returncode != 0:
            print(p.stderr[-500:])
    # ranks reading different copies of data.path (a relative path from another folder on
    # each rank): refused on both, each naming its count, before any step
    tmpd = mkdtemp()
    corpus = open(os.path.join(ROOT, "data", "corpus.txt"), "rb").read()
    for r, size in ((0, 50000), (1, 40000)):
        os.makedirs(os.path.join(tmpd, "r%d" % r))
        with open(os.path.join(tmpd, "r%d" % r, "d.txt"), "wb") as f:
            f.write(corpus[:size])
    each = ('cd %s/r$OMPI_COMM_WORLD_RANK && exec %s %s --set data.path=d.txt --set '
            'train.steps=2 --set mesh.dp_shard=2' % (tmpd, os.path.abspath(EXE),
                                                     os.path.abspath(debug)))
    p = sh([MPIRUN] + MPI_ARGS + ["-n", "2", "sh", "-c", each], timeout=60)
    check(p.returncode != 0 and "'d.txt' holds 50000 tokens on this rank, between 40000 and "
          "50000 on the ranks: every rank must read the same data" in p.stderr and
          "holds 40000 tokens on this rank" in p.stderr and "step 1" not in p.stdout,
          "ranks reading data files of different sizes: refused before step 1 (%s)"
          % p.stderr.strip()[-300:])
    # a warmup longer than the run: warned of, the schedule kept as the plan says
    p = sh([EXE, debug, "--dry-run", "--set", "schedule.warmup_steps=20", "--set",
            "train.steps=4"], timeout=60)
    check(p.returncode == 0 and "warning: schedule.warmup_steps 20 exceeds train.steps 4: the "
          "rate rises to" in p.stderr, "a warmup longer than the run is warned of (%s)"
          % p.stderr.strip()[-200:])
    # a bad FSDPC_PG: refused on every rank, reported once for all of them
    p = sh([MPIRUN] + MPI_ARGS + ["-n", "4", EXE, debug], timeout=60, env={"FSDPC_PG": "bogus"})
    check(p.returncode != 0 and p.stderr.count("FSDPC_PG=bogus") == 1 and
          ranks_saying(p.stderr, r"FSDPC_PG=bogus: expected native, staged or staged-lazy") ==
          {"0", "1", "2", "3"},
          "FSDPC_PG=bogus on 4 ranks: one line for the 4 ranks (%s)" % p.stderr.strip()[-200:])
    # more kernel threads than the CPUs the process may run on: trains, warning that steps slow
    for threads in ["2", "1"]:
        p = sh(["taskset", "-c", "0", EXE, debug, "--set", "train.steps=1"], timeout=60,
               env={"OMP_NUM_THREADS": threads})
        warned = re.search(r"warning: 2 kernel threads \(OMP_NUM_THREADS\) but rank 0 may run "
                           r"on 1 CPU", p.stdout) is not None
        check(p.returncode == 0 and warned == (threads == "2"),
              "OMP_NUM_THREADS=%s on one CPU: trains, %s (exit %d)" % (
                  threads, "warns" if threads == "2" else "no warning", p.returncode))
