#!/usr/bin/env python3
"""fsdp-train end to end, one mode a run:

  test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT MODE

  configs       every shipped plan at its world size: loss goes down; fp32 plans match
                debug.yaml step for step (1e-5); PyTorch's losses; plots; converted plans;
                evaluation; shuffling; model.config; Qwen2, Qwen3 and GPT-2 against
                PyTorch and under FSDP, HSDP and TP; padded vocabulary tables
  errors        malformed input: documented message from every rank, non-zero exit, fast
  dry-run       --dry-run's estimates against a real run's counters; bf16 AdamW moments; the
                messages' wording
  checkpoint    saving, resuming under other plans
  ckpt-tool     fsdp-ckpt inspect, export-hf (read by an independent parser), import-hf;
                Qwen2 and Qwen3 through import-hf, reshard and export-hf
  ckpt-corrupt  damaged checkpoints given to fsdp-train: named errors; hostile headers,
                non-finite steps, load: auto, the watchdog, verify
  ckpt-damage   the damage table: every damage x resume on 1 and 3 ranks and every
                fsdp-ckpt command that reads it
  gpu           checkpoints of GPU shards (skips, 77, without a GPU)
  gpu-multi     several ranks sharing the GPU against one CPU rank (skips, 77, without one)
  operations    final saves, signals, the time limit, the folder lock, refusals before the
                first step, links and outputs
  pipeline      mesh.pp: every schedule, composed with FSDP, HSDP and TP, against one rank;
                point-to-point bytes; checkpoints across pipeline layouts; refusals

Each mode lives in a module of this folder; common.py holds what they share.
"""
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (after the path)

# mode: (module, function) in the order they run
MODES = {
    "configs": [("configs", "configs"), ("configs", "pytorch"), ("plots_converts", "plots"),
                ("plots_converts", "converts"), ("configs", "evaluation"),
                ("configs", "shuffling"), ("configs", "model_config"), ("configs", "family"),
                ("configs", "padded_vocab")],
    "errors": [("errors", "errors")],
    "dry-run": [("dry_run", "dry_run"), ("dry_run", "peak_moments"), ("dry_run", "state_dtype"),
                ("dry_run", "tp_reduce_dtype"), ("dry_run", "messages")],
    "checkpoint": [("checkpoints", "checkpoints")],
    "ckpt-tool": [("ckpt_tool", "ckpt_tool"), ("ckpt_tool", "ckpt_any_model"),
                  ("ckpt_tool", "ckpt_family"), ("ckpt_tool", "gpt2_hub")],
    "ckpt-corrupt": [("ckpt_corrupt", "ckpt_corrupt")],
    "ckpt-damage": [("ckpt_damage", "ckpt_damage")],
    "gpu": [("gpu", "gpu")],
    "gpu-multi": [("gpu", "gpu_multi")],
    "operations": [("operations", "operations")],
    "pipeline": [("pipeline", "pipeline")],
}


def main(argv):
    if len(argv) != 5 or argv[4] not in MODES:
        sys.stderr.write("usage: test_plans.py FSDP_TRAIN MPIRUN SOURCE_ROOT MODE (%s)\n" %
                         ", ".join(MODES))
        return 2
    common.setup(*argv[1:5])
    for module, function in MODES[argv[4]]:  # imported after setup: they take its names
        getattr(importlib.import_module(module), function)()
    return common.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
