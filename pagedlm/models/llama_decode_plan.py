"""A small decode step of a Llama-family model (Llama, Qwen2) as a flat list of prepared C
kernel calls over persistent buffers.

The modules' forward spends ~0.3 ms of Python per layer on a decode step (module calls,
argument checks, small tensor allocations): a third of a batch-1 step with packed GGUF
weights, a fifth with bf16 ones, a few percent of a batch-64 one. The plan makes the same
kernel calls, in the same order, on the same values, so its hidden states equal the modules'
bit for bit; its arguments are checked once, when it is built. vLLM's CUDA graphs play this
part on GPUs.

It applies (`LlamaDecodePlan.supports`) when every linear runs a kernel the plan replays
(`_linear_kind`: packed groups, GGUF or int8, whose GEMV or GEMM writes straight into columns
of the fused outputs; bf16 weights of the small-batch kernels, blocked for AVX-512 BF16, dense
for AMX; or any other unquantized weight, through the modules' own `linear`, copied into the
plan's buffer: fp32 on every CPU, bf16 on AVX2), the C attention backend runs, one dtype
holds activations, norms and the KV cache, and tensor parallelism is off. The model runner
keeps one plan per batch size, up to `max_rows` (64) sequences, for decode-only steps without
LoRA adapters or speculative decoding; all share one set of buffers (`DecodeBuffers`). A
plan keeps the tensors it was built from; `current()` is False once any of them was replaced
(weights reloaded, KV cache re-allocated after sleep), and the runner builds a new one.
PAGEDLM_DISABLE_DECODE_PLAN=1 turns it off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedlm.attention.cpu_attn import CPUAttentionBackend, CPUAttentionMetadata
from pagedlm.distributed import get_tp_group
from pagedlm.kernels import cpu as kc
from pagedlm.kernels import gguf as kg
from pagedlm.kernels.cpu import SMALL_BATCH_ROWS
from pagedlm.kernels.cpu_attention import paged_decode_args, reshape_and_cache_args
from pagedlm.layers.activation import SiluAndMul
from pagedlm.layers.attention import Attention
from pagedlm.layers.layernorm import RMSNorm
from pagedlm.layers.linear import linear as dense_linear
from pagedlm.layers.quantization.base import UnquantizedLinearMethod
from pagedlm.layers.quantization.gguf import (
    GEMV_ROWS,
    PackedLinearMethod,
    silu_and_mul_weight,
    takes_gemv,
)
from pagedlm.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

MAX_ROWS = SMALL_BATCH_ROWS  # the packed GGUF GEMM and the small-batch bf16 kernel reach here

# How a call reports success: C kernels return 1 (0: out of memory), the attention kernel 0
# (-1: out of memory), reshape_and_cache 0 (else: slots out of range); torch methods return
# tensors.
_OK_NONZERO, _OK_ZERO, _NO_STATUS = 1, 0, None


def _linear_kind(linear: nn.Module) -> str | None:
    """Which kernel the layer runs on a small batch: "gguf" (every group packed: the integer
    GEMV / GEMM), "blocked" (a bf16 weight in the AVX-512 BF16 small-batch layout next to its
    prepacked copy: `gemv_bf16_blocked`), "amx" (the dense bf16 weight next to its prepacked
    copy: AMX `small_batch_linear`), "dense" (any other unquantized weight: the modules'
    `linear`, oneDNN or the AVX2 small-batch kernel), or None (a path the plan does not
    replay)."""
    method = linear.quant_method
    if isinstance(method, PackedLinearMethod):
        return "gguf" if all(g.packed is not None for g in linear.packed_groups) else None
    if type(method) is not UnquantizedLinearMethod:
        return None
    w, bias = linear.weight, linear.bias
    bf16 = (
        linear.packed_weight is not None
        and w.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
    )
    if bf16 and w.dim() == 4:
        return "blocked"
    # AMX keeps the dense weight for its small-batch kernel; its shape rules, checked here
    amx = bf16 and w.dim() == 2 and kc.small_batch_linear_isa() == "amx"
    return "amx" if amx and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0 else "dense"


def _dense_linear_into(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> None:
    """y = the layer's method on x, as the modules compute it (`UnquantizedLinearMethod`)."""
    y.copy_(dense_linear(x, linear.weight, linear.bias, linear.packed_weight))


class DecodeBuffers:
    """The persistent inputs and activations of decode plans, for up to `rows` sequences;
    the plan of n sequences uses the first n rows of each."""

    def __init__(self, model: LlamaForCausalLM, rows: int, max_blocks: int) -> None:
        first = model.model.layers[0]
        attn: LlamaAttention = first.self_attn
        self.rows, self.dtype = rows, first.input_layernorm.weight.dtype
        hidden, inter = first.input_layernorm.weight.shape[0], first.mlp.down_proj.input_size

        def new(*shape: int, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return torch.zeros(rows, *shape, dtype=dtype)

        # per-step inputs, copied in by LlamaDecodePlan.run
        self.positions, self.slots, self.seq_lens = (new(dtype=torch.int64) for _ in range(3))
        self.block_table = new(max_blocks, dtype=torch.int64)
        # activations
        self.residual, self.x, self.h, self.o, self.out = (new(hidden) for _ in range(5))
        self.qkv = new(attn.q_size + 2 * attn.kv_size)
        self.query = new(attn.num_heads, attn.head_dim)  # contiguous queries (rows > 1)
        self.attn_out = new(attn.q_size)
        self.gate_up, self.act = new(2 * inter), new(inter)


class LlamaDecodePlan:
    """The decode step of `model` for exactly `rows` sequences (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, rows: int, buffers: DecodeBuffers) -> None:
        lib = kc.cpu_kernels()
        assert lib is not None and 1 <= rows <= self.max_rows(model) <= buffers.rows
        inner = model.model
        self.model, self.rows = model, rows
        self._watched = self._sources(model)
        self.dtype = buffers.dtype
        for name, buffer in vars(buffers).items():  # this step's rows of each buffer
            if isinstance(buffer, torch.Tensor):
                setattr(self, name, buffer[:rows])
        self.calls: list[tuple[Callable, tuple, int | None]] = []  # (fn, args, status kind)
        self._biases: list[torch.Tensor] = []  # dtype copies whose pointers the calls hold
        for i, layer in enumerate(inner.layers):
            self._layer(lib, layer, first_layer=i == 0)
        self._norm(lib, inner.norm, self.x, self.residual, self.out)

    # ------------------------------------------------------------------------ eligibility

    @staticmethod
    def max_rows(model: nn.Module) -> int:
        """The most sequences a plan of `model` replays: MAX_ROWS, or GEMV_ROWS where packed
        GGUF layers would take a dequantized float GEMM past that (neither AVX-512 VNNI nor
        AVX2)."""
        lib = kc.cpu_kernels()
        has_gguf = any(isinstance(m.quant_method, PackedLinearMethod)
                       for m in model.modules() if hasattr(m, "quant_method"))  # fmt: skip
        integer = lib is not None and (lib.gguf_gemm_compiled() or takes_gemv(MAX_ROWS))
        return MAX_ROWS if integer or not has_gguf else GEMV_ROWS

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether `model` has exactly the structure and kernels the plan replays."""
        if not isinstance(model, LlamaForCausalLM) or kc.cpu_kernels() is None:
            return False
        if get_tp_group().world_size != 1 or kg.gguf_isa() is None:
            return False
        if (
            not isinstance(Attention.backend, CPUAttentionBackend)
            or Attention.backend.kernels is None
        ):
            return False
        inner = model.model
        if type(inner).forward is not LlamaModel.forward:
            return False
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(layer).forward is not LlamaDecoderLayer.forward:
                return False
            if type(attn).forward is not LlamaAttention.forward or attn.use_qk_norm:
                return False
            if type(mlp).forward is not LlamaMLP.forward or type(mlp.act_fn) is not SiluAndMul:
                return False
            if attn.attn.attn_type != "decoder":
                return False
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(_linear_kind(linear) for linear in linears):
                return False
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(norm) is not RMSNorm for norm in norms):
                return False
        # one dtype for activations, norms and KV caches: the modules' C paths then run
        dtype = inner.embed_tokens.weight.dtype
        alike = [inner.norm.weight]
        for layer in inner.layers:
            alike += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            alike.append(layer.self_attn.attn.kv_cache)
        same = all(t is not None and t.dtype == dtype for t in alike)
        return dtype in (torch.bfloat16, torch.float32) and same

    @staticmethod
    def _sources(model: LlamaForCausalLM) -> list[tuple[dict, str, object, int]]:
        """(namespace, name, value, data pointer) of everything the plan's pointers come from:
        parameters (whose `.data` a weight update may swap), the packed groups, KV caches,
        RoPE tables; read through the namespaces directly, so `current()` costs microseconds."""
        out: list[tuple[dict, str, object, int]] = []

        def watch(ns: dict, *names: str) -> None:
            for name in names:
                v = ns.get(name)
                # an mkldnn (oneDNN-prepacked) tensor has no data pointer: identity alone
                dense = isinstance(v, nn.Parameter) and not v.is_mkldnn
                out.append((ns, name, v, v.data_ptr() if dense else 0))

        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                watch(norm._parameters, "weight")
            watch(attn.attn.__dict__, "kv_cache")
            watch(attn.rotary_emb._buffers, "cos_cache", "sin_cache")
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                watch(linear._parameters, "weight", "bias")
                watch(linear.__dict__, "quant_method", "packed_groups", "packed_weight")
                for group in linear.__dict__.get("packed_groups", ()):
                    watch(group.__dict__, "packed")
        watch(model.model.norm._parameters, "weight")
        return out

    def current(self) -> bool:
        """False once a tensor the plan was built from has been replaced (or a parameter's
        data swapped)."""
        return all(
            ns.get(name) is v and (not ptr or v.data_ptr() == ptr)  # type: ignore[union-attr]
            for ns, name, v, ptr in self._watched
        )

    # --------------------------------------------------------------------------- building

    def _norm(self, lib, norm: RMSNorm, x, residual, out) -> None:
        args = kc.rms_norm_args(x, residual, norm.weight, norm.eps, norm.offset, out)
        self.calls.append((lib.rms_norm, args, _OK_NONZERO))

    def _linear(self, lib, linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """y = linear(x) as the layer's method computes it for these rows: one GEMV per packed
        GGUF group, into its columns of y; the small-batch kernel on a bf16 weight; or the
        modules' own dense path."""
        bias = linear.bias
        kind = _linear_kind(linear)
        if kind == "dense":
            self.calls.append((_dense_linear_into, (x, linear, y), _NO_STATUS))
            return
        if kind == "blocked":
            args = kc.blocked_linear_args(x, linear.weight, bias, y)
            self.calls.append((lib.gemv_bf16_blocked, args, _OK_NONZERO))
            return
        if kind == "amx":
            args = kc.amx_linear_args(x, linear.weight, bias, y)
            self.calls.append((lib.small_batch_linear, args, _OK_NONZERO))
            return
        gemv = takes_gemv(self.rows)  # as gguf_linear chooses
        for g in linear.packed_groups:
            b = None if bias is None else bias[g.offset : g.offset + g.rows].to(self.dtype)
            if b is not None:
                self._biases.append(b)
            columns = y[:, g.offset : g.offset + g.rows]
            if gemv:
                _, args = kg.gemv_args(x, g.packed, b, out=columns)
                fn = lib.gguf_gemv
            else:
                _, name, args = kg.gemm_args(x, g.packed, b, out=columns)
                fn = getattr(lib, name)
            self.calls.append((fn, args, _OK_NONZERO))

    def _gate_up_act(self, lib, gate_up: nn.Module) -> None:
        """act = silu(gate) * up of h: one `int8_gemm_amx` pass where gate_up is one int8
        weight that the GEMM takes at these rows (as LlamaMLP computes it), else gate_up's
        product, then silu_and_mul."""
        packed = silu_and_mul_weight(gate_up, self.rows)
        if packed is not None:
            bias = gate_up.bias
            if bias is not None:
                bias = bias.to(self.dtype)
                self._biases.append(bias)
            _, name, args = kg.gemm_args(self.h, packed, bias, out=self.act, silu_and_mul=True)
            self.calls.append((getattr(lib, name), args, _OK_NONZERO))
            return
        self._linear(lib, gate_up, self.h, self.gate_up)
        args = kc.silu_and_mul_args(self.gate_up, self.act)
        self.calls.append((lib.silu_and_mul, args, _OK_NONZERO))

    def _layer(self, lib, layer: LlamaDecoderLayer, first_layer: bool) -> None:
        attn, mlp, rows = layer.self_attn, layer.mlp, self.rows
        if first_layer:  # the embedding is in `residual`: norm it alone (residual stays)
            self._norm(lib, layer.input_layernorm, self.residual, None, self.h)
        else:
            self._norm(lib, layer.input_layernorm, self.x, self.residual, self.h)
        self._linear(lib, attn.qkv_proj, self.h, self.qkv)
        q = self.qkv[:, : attn.q_size]
        k = self.qkv[:, attn.q_size : attn.q_size + attn.kv_size]
        v = self.qkv[:, attn.q_size + attn.kv_size :]
        rope = attn.rotary_emb
        args = kc.rotary_embedding_args(
            self.positions, q, k, rope.cos_cache, rope.sin_cache, attn.head_dim
        )
        self.calls.append((lib.rotary_embedding, args, _OK_NONZERO))
        layer_attn = attn.attn
        k_cache, v_cache = layer_attn.kv_cache[0], layer_attn.kv_cache[1]
        kv_heads, head_size = k_cache.shape[2:]
        new_k, new_v = (t.view(rows, kv_heads, head_size) for t in (k, v))
        args = reshape_and_cache_args(new_k, new_v, k_cache, v_cache, self.slots)
        self.calls.append((lib.reshape_and_cache, args, _OK_ZERO))
        query = q.view(rows, attn.num_heads, attn.head_dim)
        if rows > 1:  # the kernel reads contiguous queries
            self.calls.append((self.query.copy_, (query,), _NO_STATUS))
            query = self.query
        args = paged_decode_args(
            query,
            k_cache,
            v_cache,
            self.block_table,
            self.seq_lens,
            self.attn_out.view(query.shape),
            layer_attn.scale,
            layer_attn.sliding_window,
            layer_attn.k_scale,
            layer_attn.v_scale,
        )
        self.calls.append((lib.paged_decode_attention, args, _OK_ZERO))
        self._linear(lib, attn.o_proj, self.attn_out, self.o)
        self._norm(lib, layer.post_attention_layernorm, self.o, self.residual, self.h)
        self._gate_up_act(lib, mlp.gate_up_proj)
        self._linear(lib, mlp.down_proj, self.act, self.x)

    # ---------------------------------------------------------------------------- running

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: CPUAttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [rows, hidden] after the final norm (a buffer the next run reuses)."""
        assert metadata.decode_block_table is not None and metadata.decode_seq_lens is not None
        self.positions.copy_(positions)
        self.slots.copy_(metadata.slot_mapping)
        table = metadata.decode_block_table
        self.block_table[:, : table.shape[1]].copy_(table)
        self.seq_lens.copy_(metadata.decode_seq_lens)
        self.residual.copy_(self.model.model.embed_tokens(input_ids))
        for fn, args, ok in self.calls:
            status = fn(*args)
            if ok is not None and (status != 0) != (ok == _OK_NONZERO):
                # reshape_and_cache: slots outside the cache; the others: out of memory
                raise RuntimeError(f"decode plan: C kernel {fn.__name__} failed ({status})")
        return self.out
