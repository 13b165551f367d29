"""Test-only shim that lets real megatron-core DDP + GPTModel run on a CPU-only torch.

megatron-core allocates buffers on ``torch.cuda.current_device()`` and forks the CUDA RNG state
around TP-parallel init/dropout.  On CPU we point the former at the CPU and make the latter a
null context (dropout is 0 in these tests, so no RNG stream matters).  Nothing here is imported by
trainmon itself: it only makes the real framework's hook points reachable on a CPU machine.
"""
from __future__ import annotations

import contextlib

import torch


def install() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def _null_fork(self, name=None):  # noqa: ARG001
        yield

    mrandom.CudaRNGStatesTracker.fork = _null_fork
    mrandom.CudaRNGStatesTracker.add = lambda self, name, seed: self.states_.__setitem__(name, None)


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None) -> None:
    from megatron.core import parallel_state

    install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)
    from megatron.core.tensor_parallel import random as mrandom
    mrandom.get_cuda_rng_tracker().add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, 1234)


def gpt_model(layers: int = 2, hidden: int = 16, heads: int = 2, vocab: int = 32, seq: int = 8,
              pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
              **config):
    """A tiny real ``GPTModel`` (local spec, fp32, dropout 0) on the CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, masked_softmax_fusion=False,
                            persist_layer_norm=False, **config)
    kwargs = {} if vp_stage is None else {"vp_stage": vp_stage}
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=seq, pre_process=pre_process, post_process=post_process,
                    **kwargs), cfg


def megatron_ddp(model, cfg, overlap: bool = False, dist_opt: bool = False, bucket_size: int | None = None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=overlap, use_distributed_optimizer=dist_opt,
                                            bucket_size=bucket_size, grad_reduce_in_fp32=True)
    return DistributedDataParallel(cfg, ddp_cfg, model)
