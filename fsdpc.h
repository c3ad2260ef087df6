/*
 * fsdpc: the whole API in one include. Installed as <fsdpc/fsdpc.h>; each header it includes
 * can also be included alone, as <fsdpc/core/tensor.h> (pkg-config's flags put both the
 * include folder and its fsdpc/ folder on the path).
 */
#ifndef FSDPC_FSDPC_H
#define FSDPC_FSDPC_H

#include "checkpoint/ckpt_reshard.h"
#include "checkpoint/dcp.h"
#include "checkpoint/hf_weights.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/train_ckpt.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/file.h"
#include "core/kernels.h"
#include "core/status.h"
#include "core/tensor.h"
#include "dtensor/dtensor.h"
#include "dtensor/placement.h"
#include "fully_shard/fsdp.h"
#include "mesh/mesh.h"
#include "mesh/pg.h"
#include "mesh/world.h"
#include "models/llama/llama.h"
#include "models/llama/llama_plan.h"
#include "nn/autograd.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/moe.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "parallel/parallel_plan.h"
#include "parallel/parallelize.h"
#include "parallel/pipeline.h"
#include "parallel/pp_schedule.h"
#include "parallel/tensor_parallel.h"
#include "train/data.h"
#include "train/hf_convert.h"
#include "train/llama_cost.h"
#include "train/plan.h"
#include "train/plot.h"
#include "train/train.h"
#include "train/trainer.h"

#endif
