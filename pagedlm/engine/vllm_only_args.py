"""vLLM EngineArgs fields pagedlm has no behaviour for: accepted at vLLM's default, refused by name.

A script or test fixture that passes one of these at vLLM's own default runs; any other value
raises NotImplementedError naming the field, the reason and what to use instead (never a
TypeError, never silently ignored). Each entry is ``name: accepted values``, the first being
vLLM 0.32's default (None where vLLM's default is a config object); a value is accepted by
equality. tests/fixtures/vllm_fields.json (scripts/record_vllm_fields.py) lists vLLM's fields;
tests/unit/test_vllm_fields.py checks that every one is here or an EngineArgs field of its own.
"""

from __future__ import annotations

from typing import Any

from pagedlm.sampling_options import same_value

_MULTIMODAL = (
    "pagedlm takes images with these options at their defaults (video, audio and embeddings "
    "are not implemented)"
)
_MULTIMODAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "allowed_media_domains": (None,),
    "enable_mm_embeds": (False,),
    "interleave_mm_strings": (False,),
    "media_io_kwargs": ({},),
    "mm_processor_cache_type": ("lru",),
    "mm_hasher_algorithm": ("blake3",),
    "mm_shm_cache_max_object_size_mb": (128,),
    "mm_encoder_only": (False,),
    "mm_encoder_tp_mode": ("weights",),
    "mm_encoder_attn_backend": (None,),
    "mm_encoder_attn_dtype": (None,),
    "mm_encoder_fp8_scale_path": (None,),
    "mm_encoder_fp8_scale_save_path": (None,),
    "mm_encoder_fp8_scale_save_margin": (1.5,),
    "io_processor_plugin": (None,),
    "renderer_num_workers": (1,),
    # pagedlm never profiles a vision encoder nor loads one: True is what it does anyway
    "skip_mm_profiling": (False, True),
    "language_model_only": (False, True),
    "video_pruning_rate": (None,),
    "video_pruning_method": ("evs",),
    "mm_tensor_ipc": ("direct_rpc",),
    "mm_processor_device": ("auto",),
    "mm_ipc_gpu_memory_gb": (0,),
    "mm_device_do_normalize": (True,),
    "default_mm_loras": (None,),
    "enable_tower_connector_lora": (False,),
    "enable_mm_processor_stats": (False,),
    "ec_transfer_config": (None,),
    "ec_manager_config": (None,),
}

_KERNELS = "a CUDA kernel, graph or compilation option; pagedlm runs its own eager CPU kernels"
_KERNEL_FIELDS: dict[str, tuple[Any, ...]] = {
    "cudagraph_capture_sizes": (None,),
    "max_cudagraph_capture_size": (None,),
    "ir_op_priority": (None,),
    "moe_backend": ("auto",),
    "linear_backend": ("auto",),
    "sparse_indexer_topk_backend": ("auto",),
    "kernel_config": (None,),
    "enable_flashinfer_autotune": (None, False),
    "attention_backend": (None,),
    "attention_config": (None,),  # vLLM's pooling test fixtures pass None explicitly
    # switches that turn off something pagedlm never does: both values run the same code
    "disable_cascade_attn": (None, False, True),
    "disable_custom_all_reduce": (False, True),
    "sleep_mode_offload_cudagraph": (False, True),
    "optimization_level": (2, 0, 1, 3),  # compile levels; pagedlm is eager at every level
    "performance_mode": ("balanced",),
    "enable_cumem_allocator": (False,),
    "enable_nccl_comm_suspend": (False,),
    "cudagraph_metrics": (False,),
    "enable_layerwise_nvtx_tracing": (False,),
    "jit_monitor_mode": ("warn",),
    "jit_monitor_verbose": (False,),
    "enable_shm_tensor_arena": (False,),
    "use_fp64_gumbel": (False,),
    "gdn_prefill_backend": (None,),
    "kda_prefill_backend": (None,),
    "kda_decode_backend": (None,),
    "swa_bounded_replay": (True,),
    "kv_sharing_fast_prefill": (False,),
    "ray_workers_use_nsight": (False,),
}

_ARCHITECTURES = (
    "pagedlm serves dense decoder and encoder models (Llama, Qwen2/3, Gemma3, BERT): no "
    "mixture-of-experts, Mamba or hybrid layers"
)
_ARCHITECTURE_FIELDS: dict[str, tuple[Any, ...]] = {
    "enable_return_routed_experts": (False,),
    "enable_expert_parallel": (False,),
    "enable_ep_weight_filter": (False,),
    "all2all_backend": ("allgather_reducescatter",),
    "enable_elastic_ep": (False,),
    "elastic_ep_max_dp_size": (None,),
    "enable_dbo": (False,),
    "ubatch_size": (0,),
    "dbo_decode_token_threshold": (32,),
    "dbo_prefill_token_threshold": (512,),
    "eplb_config": (None,),
    "enable_eplb": (False,),
    "expert_placement_strategy": ("linear",),
    "enable_mixed_moe_lora_format": (False,),
    "enable_moe_shared_loras": (False,),
    "mamba_config": (None,),
    "mamba_cache_dtype": ("auto",),
    "mamba_ssm_cache_dtype": ("auto",),
    "mamba_block_size": (None,),
    "mamba_cache_mode": ("none",),
    "mamba_backend": (None,),
    "mamba_ssu_algorithm": (None,),
    "enable_mamba_cache_stochastic_rounding": (False,),
    "mamba_cache_philox_rounds": (0,),
    "enable_mamba_shared_prefix_checkpoint": (False,),
    "replayssm_buffer_len": (16,),
    "use_replayssm": (False,),
    "prefix_match_unit": (None,),
    # one KV cache manager for every layer: disabling the hybrid one is what pagedlm does
    "disable_hybrid_kv_cache_manager": (None, False, True),
    "aux_output_config": (None,),
    "engram_config": (None,),
    "diffusion_config": (None,),
    "kv_cache_dtype_skip_layers": ([],),
    "enable_hc_sp": (False,),
}

_DISTRIBUTED = (
    "pagedlm runs tensor parallelism on one machine (tensor_parallel_size) and data "
    "parallelism as separate processes (examples/data_parallel.py, or Ray Data across nodes: "
    "docs/ecosystem.md); multi-node, context-parallel and disaggregated serving are not "
    "supported"
)
_DISTRIBUTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "master_addr": ("127.0.0.1",),
    "master_port": (29501,),
    "nnodes": (1,),
    "pipeline_parallel_size": (1,),
    "node_rank": (0,),
    "distributed_timeout_seconds": (None,),
    "cpu_distributed_timeout_seconds": (None,),
    "numa_bind": (False,),
    "numa_bind_nodes": (None,),
    "numa_bind_cpus": (None,),
    "device_ids": (None,),
    "prefill_context_parallel_size": (1,),
    "decode_context_parallel_size": (1,),
    "dcp_comm_backend": (None,),
    "dcp_q_replicate": (None,),
    "dcp_kv_cache_interleave_size": (1,),
    "cp_kv_cache_interleave_size": (None,),
    "data_parallel_rank": (None,),
    "data_parallel_start_rank": (None,),
    "data_parallel_size_local": (None,),
    "data_parallel_address": (None,),
    "data_parallel_rpc_port": (None,),
    "data_parallel_hybrid_lb": (False,),
    "data_parallel_external_lb": (False,),
    "data_parallel_multi_port_external_lb": (False,),
    "data_parallel_backend": ("mp",),
    "dp_sync_interval": (16,),
    "disable_nccl_for_dp_synchronization": (None,),
    "enable_batch_sharded_sampling": (None,),
    "_api_process_count": (1,),
    "_api_process_rank": (0,),
    "kv_transfer_config": (None,),
    "kv_events_config": (None,),
    "kv_offloading_size": (None,),
    "kv_offloading_backend": ("native",),
    "enable_fault_tolerance": (False,),
    "fault_tolerance_config": (None,),
    "shutdown_timeout": (0,),
}

_LOADING = (
    "a model-loading option pagedlm lacks: it loads a local Hugging Face directory, "
    "a .gguf file or a packaged model (hub ids through huggingface_hub's cache: set HF_HOME "
    "to move it)"
)
_LOADING_FIELDS: dict[str, tuple[Any, ...]] = {
    "model_weights": ("",),
    "hf_config_path": (None,),
    "download_dir": (None,),
    "safetensors_load_strategy": (None,),
    "safetensors_prefetch_num_threads": (8,),
    "safetensors_prefetch_block_size": (16777216,),
    "config_format": ("auto",),
    "max_parallel_loading_workers": (None,),
    "offload_backend": ("auto",),
    "cpu_offload_gb": (0,),
    "cpu_offload_params": (None, set()),
    "offload_group_size": (0,),
    "offload_num_in_group": (1,),
    "offload_prefetch_step": (1,),
    "offload_params": (None, set()),
    "code_revision": (None,),
    "model_class_overrides": ({},),
    "quantization_config": (None,),
    "allow_deprecated_quantization": (False,),
    "model_loader_extra_config": ({},),
    "ignore_patterns": (["original/**/*"],),
    "use_tqdm_on_load": (True,),
    "pt_load_map_location": ("cpu",),
    "disable_sliding_window": (False,),
    "tokens_only": (False,),
    "worker_cls": ("auto",),
    "worker_extension_cls": ("",),
    "fully_sharded_loras": (False,),
    "lora_dtype": ("auto",),
    "lora_target_modules": (None,),
    "specialize_active_lora": (False,),
    "max_lora_cls_labels": (None,),
    "sleep_preserve_parameter_names": ([],),
    "fail_on_environ_validation": (False,),
    "additional_config": ({},),
}

_SCHEDULING = (
    "a scheduler option pagedlm lacks; its scheduler takes max_num_seqs, "
    "max_num_batched_tokens, long_prefill_token_threshold, enable_chunked_prefill and "
    "scheduling_policy"
)
_SCHEDULING_FIELDS: dict[str, tuple[Any, ...]] = {
    "max_num_scheduled_tokens": (None,),
    "long_prefill_token_threshold_adaptive": (False,),
    "max_num_active_seqs": (None,),
    "max_num_queued_reqs": (None,),
    "max_num_queued_tokens": (None,),
    "enable_trace_replay": (False,),
    "scheduler_reserve_full_isl": (True,),
    "prefill_schedule_interval": (1,),
    "watermark": (0.0,),
    "scheduler_cls": (None,),
    "prefix_cache_retention_interval": (0,),
    "stream_interval": (1,),
}

_OBSERVABILITY = (
    "a tracing or metrics option pagedlm lacks; it keeps vLLM's Prometheus-named "
    "metrics (LLM.get_metrics() with disable_log_stats=False) and logs through the "
    "'pagedlm' logger (configure it with logging)"
)
_OBSERVABILITY_FIELDS: dict[str, tuple[Any, ...]] = {
    "aggregate_engine_logging": (False,),
    "show_hidden_metrics_for_version": (None,),
    "otlp_traces_endpoint": (None,),
    "collect_detailed_traces": (None,),
    "per_request_spec_decode_metrics": ("none",),
    "kv_cache_metrics": (False,),
    "kv_cache_metrics_sample": (0.01,),
    "custom_histogram_buckets": (None,),
    "enable_mfu_metrics": (False,),
    "enable_logging_iteration_details": (False,),
    "logging_config": (None,),
    "log_level": (None,),
    "log_config_file": (None,),
}

_GENERATION = (
    "reasoning parsers, watermarks, custom logits processors, pooler overrides and prompt "
    "embeddings are not implemented yet (logit_bias, allowed_token_ids, bad_words and "
    "structured outputs are per-request alternatives)"
)
_GENERATION_FIELDS: dict[str, tuple[Any, ...]] = {
    "reasoning_parser": ("", None),
    "reasoning_parser_plugin": (None,),
    "reasoning_config": (None,),
    "watermark_config": (None,),
    "logits_processors": (None,),
    "pooler_config": (None,),
    "enable_prompt_embeds": (False,),
}

VLLM_ONLY_ENGINE_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    name: (accepted, why)
    for fields, why in (
        (_MULTIMODAL_FIELDS, _MULTIMODAL),
        (_KERNEL_FIELDS, _KERNELS),
        (_ARCHITECTURE_FIELDS, _ARCHITECTURES),
        (_DISTRIBUTED_FIELDS, _DISTRIBUTED),
        (_LOADING_FIELDS, _LOADING),
        (_SCHEDULING_FIELDS, _SCHEDULING),
        (_OBSERVABILITY_FIELDS, _OBSERVABILITY),
        (_GENERATION_FIELDS, _GENERATION),
    )
    for name, accepted in fields.items()
}
"""name -> (the values accepted, vLLM's default first; why others are refused)."""


def check_vllm_only_args(values: dict[str, Any]) -> None:
    """Raise NotImplementedError naming the first field given a value pagedlm cannot honour."""
    for name, value in values.items():
        accepted, why = VLLM_ONLY_ENGINE_ARGS[name]
        if not any(same_value(value, a) for a in accepted):
            raise NotImplementedError(
                f"{name}={value!r:.80} is not supported by pagedlm: {why}. Accepted: "
                f"{', '.join(map(repr, accepted))}."
            )
