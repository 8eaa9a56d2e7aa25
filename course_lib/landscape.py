"""The landscape around the course: accelerator generations and the frameworks that ship its techniques.

Two tables (lists of dicts, one dict per row, every row with a ``source``) and a renderer:

* :data:`HARDWARE`: per accelerator, the numbers the course's estimates take as inputs (peak dense
  16-bit and FP8 FLOP/s for ``course_lib.estimate.training_seconds``, HBM size for the memory
  calculators, HBM and interconnect bandwidth for the alpha-beta models of notebooks 03 and 07, power
  for ``course_lib.estimate.training_cost``). Peak figures are *dense*: vendors also print twice
  these numbers "with sparsity" (2:4 structured sparsity, which dense training does not use).
  A cell the vendor does not publish is ``None``, never a guess.
* :data:`FRAMEWORKS`: per framework, under which name it offers each technique of the course, and
  :data:`COURSE_MODULES`, the ``course_lib`` module that builds the same idea from scratch.
* :func:`markdown_table`: either table (or any list of dicts) as a Markdown table, for
  ``IPython.display.Markdown`` in a notebook.

Units: TFLOP/s = 1e12 FLOP/s, GB = 1e9 bytes, TB/s = 1e12 bytes/s, interconnect GB/s per chip as the
vendor states it (NVLink: total over both directions, e.g. H100's 900 GB/s is 450 GB/s each way).
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["HARDWARE", "FRAMEWORKS", "TECHNIQUES", "COURSE_MODULES", "markdown_table"]

HARDWARE: list[dict] = [
    {
        "name": "NVIDIA V100 SXM2 32GB", "year": 2017, "format_16bit": "FP16",
        "tflops_16bit": 125.0, "tflops_fp8": None, "hbm_gb": 32.0, "hbm_tbps": 0.9,
        "interconnect": "NVLink 2", "interconnect_gbps": 300.0, "tdp_watts": 300,
        "source": "NVIDIA Tesla V100 datasheet, https://www.nvidia.com/en-us/data-center/v100/ "
                  "(no BF16: the tensor cores take FP16)",
    },
    {
        "name": "NVIDIA A100 SXM 80GB", "year": 2020, "format_16bit": "BF16",
        "tflops_16bit": 312.0, "tflops_fp8": None, "hbm_gb": 80.0, "hbm_tbps": 2.039,
        "interconnect": "NVLink 3", "interconnect_gbps": 600.0, "tdp_watts": 400,
        "source": "NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/",
    },
    {
        "name": "NVIDIA H100 SXM", "year": 2022, "format_16bit": "BF16",
        "tflops_16bit": 989.4, "tflops_fp8": 1978.9, "hbm_gb": 80.0, "hbm_tbps": 3.35,
        "interconnect": "NVLink 4", "interconnect_gbps": 900.0, "tdp_watts": 700,
        "source": "NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/ (1,979 BF16 "
                  "and 3,958 FP8 TFLOPS are printed with sparsity; dense is half)",
    },
    {
        "name": "NVIDIA H200 SXM", "year": 2024, "format_16bit": "BF16",
        "tflops_16bit": 989.4, "tflops_fp8": 1978.9, "hbm_gb": 141.0, "hbm_tbps": 4.8,
        "interconnect": "NVLink 4", "interconnect_gbps": 900.0, "tdp_watts": 700,
        "source": "NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/ (the H100's "
                  "chip with HBM3e; compute printed with sparsity, dense is half)",
    },
    {
        "name": "NVIDIA B200 (HGX, 1000 W)", "year": 2024, "format_16bit": "BF16",
        "tflops_16bit": 2250.0, "tflops_fp8": 4500.0, "hbm_gb": 180.0, "hbm_tbps": 8.0,
        "interconnect": "NVLink 5", "interconnect_gbps": 1800.0, "tdp_watts": 1000,
        "source": "NVIDIA HGX B200 specifications, https://www.nvidia.com/en-us/data-center/hgx/ "
                  "(per GPU of an 8-GPU board; printed with sparsity, dense is half)",
    },
    {
        "name": "AMD Instinct MI300X", "year": 2023, "format_16bit": "BF16",
        "tflops_16bit": 1307.4, "tflops_fp8": 2614.9, "hbm_gb": 192.0, "hbm_tbps": 5.3,
        "interconnect": "Infinity Fabric", "interconnect_gbps": 896.0, "tdp_watts": 750,
        "source": "AMD Instinct MI300X datasheet, "
                  "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (dense; "
                  "7 Infinity Fabric links of 128 GB/s)",
    },
    {
        "name": "Google TPU v4", "year": 2021, "format_16bit": "BF16",
        "tflops_16bit": 275.0, "tflops_fp8": None, "hbm_gb": 32 * 2**30 / 1e9, "hbm_tbps": 1.2,
        "interconnect": "ICI, 3D torus (4096-chip pod)", "interconnect_gbps": None, "tdp_watts": None,
        "source": "Google Cloud TPU v4 documentation, https://cloud.google.com/tpu/docs/v4 (32 GiB "
                  "HBM2; measured power 90/170/192 W min/mean/max, no TDP stated)",
    },
    {
        "name": "Google TPU v5p", "year": 2023, "format_16bit": "BF16",
        "tflops_16bit": 459.0, "tflops_fp8": None, "hbm_gb": 95.0, "hbm_tbps": 2.765,
        "interconnect": "ICI, 3D torus (8960-chip pod)", "interconnect_gbps": 4800 / 8,
        "tdp_watts": None,
        "source": "Google Cloud TPU v5p documentation, https://cloud.google.com/tpu/docs/v5p "
                  "(inter-chip interconnect 4800 Gbps = 600 GB/s per chip)",
    },
]

#: The techniques of the course, in the order the notebooks teach them.
TECHNIQUES = ("collectives", "data_parallel", "zero_fsdp", "tensor_parallel", "pipeline_parallel",
              "expert_parallel", "activation_checkpointing", "mixed_precision", "device_mesh",
              "checkpointing")

#: The ``course_lib`` module that implements each technique from scratch. ``fault`` (saving and
#: resuming training) is the checkpointing notebook's module.
COURSE_MODULES = {
    "collectives": "collectives", "data_parallel": "data_parallel", "zero_fsdp": "zero",
    "tensor_parallel": "tensor_parallel", "pipeline_parallel": "pipeline", "expert_parallel": "moe",
    "activation_checkpointing": "recompute", "mixed_precision": "precision", "device_mesh": "mesh",
    "checkpointing": "fault",
}

#: What each framework calls the course's techniques (``None``: not provided by the framework itself).
#: Names are taken from each project's documentation (``source``).
FRAMEWORKS: list[dict] = [
    {
        "name": "Horovod",
        "collectives": "hvd.allreduce / hvd.allgather / hvd.broadcast (NCCL, MPI or Gloo)",
        "data_parallel": "hvd.DistributedOptimizer (ring all-reduce of gradients)",
        "zero_fsdp": None, "tensor_parallel": None, "pipeline_parallel": None, "expert_parallel": None,
        "activation_checkpointing": None,
        "mixed_precision": "hvd.Compression.fp16 (16-bit gradients on the wire only)",
        "device_mesh": None,
        "checkpointing": "save on rank 0, hvd.broadcast_parameters on restart",
        "source": "https://horovod.readthedocs.io/en/stable/ ; Sergeev & Del Balso 2018, arXiv:1802.05799",
    },
    {
        "name": "DeepSpeed",
        "collectives": "deepspeed.comm",
        "data_parallel": "deepspeed.initialize (the engine all-reduces gradients)",
        "zero_fsdp": "ZeRO stage 1-3 (\"zero_optimization\": {\"stage\": 1|2|3}), ZeRO-Offload / ZeRO-Infinity",
        "tensor_parallel": "AutoTP; Megatron-DeepSpeed for 3D parallelism",
        "pipeline_parallel": "deepspeed.pipe.PipelineModule",
        "expert_parallel": "deepspeed.moe.layer.MoE(ep_size=...)",
        "activation_checkpointing": "deepspeed.checkpointing.checkpoint (\"activation_checkpointing\" config)",
        "mixed_precision": "\"fp16\" (dynamic loss scaling) / \"bf16\" config sections",
        "device_mesh": None,
        "checkpointing": "engine.save_checkpoint / load_checkpoint; universal checkpointing",
        "source": "https://www.deepspeed.ai/docs/config-json/ ; https://deepspeed.readthedocs.io ; "
                  "Rajbhandari et al. 2020, arXiv:1910.02054",
    },
    {
        "name": "Megatron-LM (Megatron Core)",
        "collectives": "torch.distributed groups from megatron.core.parallel_state",
        "data_parallel": "megatron.core.distributed.DistributedDataParallel",
        "zero_fsdp": "--use-distributed-optimizer (optimizer states sharded, ZeRO-1-like)",
        "tensor_parallel": "--tensor-model-parallel-size (with --sequence-parallel)",
        "pipeline_parallel": "--pipeline-model-parallel-size (1F1B; interleaved with virtual stages)",
        "expert_parallel": "--expert-model-parallel-size",
        "activation_checkpointing": "--recompute-granularity full|selective",
        "mixed_precision": "--bf16 / --fp16; --fp8-format (Transformer Engine)",
        "device_mesh": "parallel_state.initialize_model_parallel (tp, pp, dp groups)",
        "checkpointing": "--save / --load (distributed checkpoint format)",
        "source": "https://github.com/NVIDIA/Megatron-LM ; https://docs.nvidia.com/megatron-core/ ; "
                  "Shoeybi et al. 2019, arXiv:1909.08053; Narayanan et al. 2021, arXiv:2104.04473",
    },
    {
        "name": "Colossal-AI",
        "collectives": "torch.distributed (through colossalai.cluster)",
        "data_parallel": "TorchDDPPlugin",
        "zero_fsdp": "LowLevelZeroPlugin (stage 1/2), GeminiPlugin (ZeRO-3, chunk-based), TorchFSDPPlugin",
        "tensor_parallel": "HybridParallelPlugin(tp_size=...) via Shardformer",
        "pipeline_parallel": "HybridParallelPlugin(pp_size=...)",
        "expert_parallel": "MoeHybridParallelPlugin(ep_size=...)",
        "activation_checkpointing": "gradient checkpointing of the boosted model",
        "mixed_precision": "Booster(mixed_precision='fp16'|'bf16') / the plugins' precision=",
        "device_mesh": "ProcessGroupMesh (the hybrid plugin's dp x pp x tp groups)",
        "checkpointing": "booster.save_model / save_optimizer (sharded, CheckpointIO)",
        "source": "https://colossalai.org/docs/basics/booster_plugins ; "
                  "https://colossalai.org/docs/basics/booster_api/ ; Li et al. 2023, arXiv:2110.14883",
    },
    {
        "name": "OneFlow",
        "collectives": "implied by SBP conversions between global tensors (boxing)",
        "data_parallel": "global tensors: data sbp=split(0), weights sbp=broadcast",
        "zero_fsdp": "nn.Graph config.enable_zero (ZeRO stages)",
        "tensor_parallel": "weights sbp=split(0) or split(1): SBP signatures of matmul",
        "pipeline_parallel": "a placement per stage (flow.placement), nn.Graph gradient accumulation",
        "expert_parallel": None,
        "activation_checkpointing": "nn.Graph module config activation_checkpointing = True",
        "mixed_precision": "nn.Graph config.enable_amp",
        "device_mesh": "flow.placement over a 2-D rank array, 2-D SBP",
        "checkpointing": "flow.save / flow.load of global tensors",
        "source": "https://docs.oneflow.org/en/master/parallelism/02_sbp.html ; "
                  "https://docs.oneflow.org/en/master/parallelism/06_pipeline.html ; "
                  "Yuan et al. 2021, arXiv:2110.15032",
    },
    {
        "name": "PyTorch (FSDP2, DTensor, torchtitan)",
        "collectives": "torch.distributed (all_reduce, reduce_scatter_tensor, all_gather_into_tensor)",
        "data_parallel": "DistributedDataParallel",
        "zero_fsdp": "fully_shard (FSDP2, on DTensor); ZeroRedundancyOptimizer",
        "tensor_parallel": "parallelize_module with ColwiseParallel / RowwiseParallel / SequenceParallel",
        "pipeline_parallel": "torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B, interleaved)",
        "expert_parallel": "torchtitan's expert parallelism (on DTensor); none in torch itself",
        "activation_checkpointing": "torch.utils.checkpoint (selective: create_selective_checkpoint_contexts)",
        "mixed_precision": "torch.autocast + torch.amp.GradScaler; FSDP2 MixedPrecisionPolicy",
        "device_mesh": "init_device_mesh",
        "checkpointing": "torch.distributed.checkpoint (DCP, resharding on load)",
        "source": "https://pytorch.org/docs/stable/distributed.html ; "
                  "https://github.com/pytorch/torchtitan ; Liang et al. 2024, arXiv:2410.06511",
    },
    {
        "name": "JAX",
        "collectives": "jax.lax.psum / all_gather / psum_scatter / ppermute / all_to_all in shard_map",
        "data_parallel": "jit with the batch sharded over a mesh axis (NamedSharding)",
        "zero_fsdp": "parameters and optimizer state sharded over the data axis (NamedSharding)",
        "tensor_parallel": "NamedSharding / PartitionSpec on weight axes (GSPMD), or shard_map",
        "pipeline_parallel": None,
        "expert_parallel": "shard_map with jax.lax.all_to_all",
        "activation_checkpointing": "jax.checkpoint (jax.remat) with checkpoint policies",
        "mixed_precision": "bfloat16 dtypes chosen per array (no autocast)",
        "device_mesh": "jax.sharding.Mesh / jax.make_mesh",
        "checkpointing": "Orbax (orbax.checkpoint)",
        "source": "https://docs.jax.dev/en/latest/sharded-computation.html ; "
                  "https://docs.jax.dev/en/latest/gradient-checkpointing.html ; "
                  "Xu et al. 2021 (GSPMD), arXiv:2105.04663",
    },
]


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Iterable[dict], columns: Sequence) -> str:
    """``rows`` as a Markdown table with the given ``columns``.

    A column is a key, or a ``(key, header)`` pair. ``None`` shows as an empty cell, floats with four
    significant digits, ``|`` is escaped. Raises ``ValueError`` for a key no row has (a typo), and for
    no rows or no columns.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("rows is empty: nothing to show")
    cols = [(c, c) if isinstance(c, str) else tuple(c) for c in columns]
    if not cols:
        raise ValueError("columns is empty: name at least one key")
    for key, _ in cols:
        if not any(key in r for r in rows):
            known = sorted({k for r in rows for k in r})
            raise ValueError(f"no row has the key {key!r}; the rows have {known}")
    lines = ["| " + " | ".join(_cell(h) for _, h in cols) + " |",
             "|" + "|".join(" --- " for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines)
