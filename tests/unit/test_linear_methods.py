"""Linear methods (layers/quantization): GGUF blocks kept packed and int8 W8A8 (quantized at
load, or a compressed-tensors checkpoint's), each against dequantize-then-matmul; the method
chosen by `set_quantization` or the checkpoint's config; bad values refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedlm.kernels.cpu import cpu_kernels
from pagedlm.kernels.gguf_pack import dequantize_packed, quantize_activations
from pagedlm.kernels.gguf_quants import dequantize
from pagedlm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from pagedlm.layers.quantization import (
    UnquantizedLinearMethod,
    set_quantization,
)
from pagedlm.layers.quantization.gguf import GGUFLinearMethod, GGUFRawTensor
from pagedlm.layers.quantization.int8 import (
    CompressedTensorsW8A8LinearMethod,
    Int8LinearMethod,
    quantize_per_channel,
)
from pagedlm.models.llama import LlamaMLP
from tests.unit.test_gguf_matmul import _raw

T = GGMLQuantizationType


def _raw_tensor(t: GGMLQuantizationType, rows: int, cols: int, seed: int) -> GGUFRawTensor:
    raw = _raw(t, rows, cols, seed, moderate=True)
    data = torch.from_numpy(raw.reshape(rows, -1).copy())
    return GGUFRawTensor(data, t, (rows, cols))


def _dense(r: GGUFRawTensor) -> torch.Tensor:
    return dequantize(r.data, r.ggml_type, tuple(r.shape))


def _quant_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Half a quantization step per activation element (plus fp32 rounding)."""
    _, d = quantize_activations(x)
    step = d.double().repeat_interleave(32, dim=1) / 2
    return step @ w.double().abs().T + (x.double().abs() @ w.double().abs().T) * 2**-20 + 1e-6


@pytest.mark.parametrize("rows", [1, 5, 40])  # GEMV, integer GEMM (or dequantized tiles)
def test_gguf_qkv_with_mixed_types_and_bias(rows) -> None:
    """q/k Q5_0 and v Q8_0 (as Qwen2 Q4_K_M files mix them): two packed groups, one matmul
    each; every output row equals dequantize-then-matmul within the activation rounding."""
    with set_quantization("gguf"):
        layer = QKVParallelLinear(128, 16, 4, 2, bias=True)
    assert isinstance(layer.quant_method, GGUFLinearMethod) and layer.weight.is_meta
    shards = {
        "q": _raw_tensor(T.Q5_0, 64, 128, 1),
        "k": _raw_tensor(T.Q5_0, 32, 128, 2),
        "v": _raw_tensor(T.Q8_0, 32, 128, 3),
    }
    for sid in ("v", "q", "k"):  # any order
        layer.weight.weight_loader(layer.weight, shards[sid], sid)
    bias = torch.randn(128)
    for sid, (off, size) in {"q": (0, 64), "k": (64, 32), "v": (96, 32)}.items():
        layer.bias.weight_loader(layer.bias, bias[off : off + size], sid)
    layer.process_weights_after_loading()
    assert layer.weight is None
    assert [(g.offset, g.rows, g.packed.ggml_type) for g in layer.packed_groups] == [
        (0, 96, T.Q5_0),
        (96, 32, T.Q8_0),
    ]
    w = torch.cat([_dense(shards[s]) for s in "qkv"])
    x = torch.randn(rows, 128)
    got = layer(x)
    want = F.linear(x.double(), w.double(), bias.double())
    assert ((got.double() - want).abs() <= _quant_bound(x, w)).all()


def test_gguf_dense_shards_and_all_dense_layers() -> None:
    """Tensors without a packed kernel arrive dequantized: mixed layers keep a dense group;
    an all-dense layer becomes an unquantized one (prepacked, small-batch kernels)."""
    with set_quantization("gguf"):
        mixed = MergedColumnParallelLinear(64, [32, 32])
        dense = ReplicatedLinear(64, 32)
    up = _raw_tensor(T.Q4_0, 32, 64, 4)
    gate = torch.randn(32, 64)
    mixed.weight.weight_loader(mixed.weight, gate, 0)
    mixed.weight.weight_loader(mixed.weight, up, 1)
    mixed.process_weights_after_loading()
    assert [g.packed is None for g in mixed.packed_groups] == [True, False]
    x = torch.randn(3, 64)
    w = torch.cat([gate, _dense(up)])
    assert ((mixed(x).double() - x.double() @ w.double().T).abs() <= _quant_bound(x, w)).all()

    dw = torch.randn(32, 64)
    dense.weight.weight_loader(dense.weight, dw)
    dense.process_weights_after_loading()
    assert isinstance(dense.quant_method, UnquantizedLinearMethod)
    torch.testing.assert_close(dense(x), F.linear(x, dw), atol=1e-5, rtol=1e-5)


def test_gguf_layer_reports_rows_never_loaded() -> None:
    with set_quantization("gguf"):
        layer = MergedColumnParallelLinear(64, [32, 32])
    layer.weight.weight_loader(layer.weight, _raw_tensor(T.Q8_0, 32, 64, 5), 1)
    with pytest.raises(ValueError, match="rows 0..32 were not loaded"):
        layer.process_weights_after_loading()


def test_gguf_raw_tensor_slices_whole_blocks_only() -> None:
    r = _raw_tensor(T.Q8_0, 8, 128, 6)
    cols = r.narrow(1, 64, 64)
    assert cols.shape == (8, 64)
    torch.testing.assert_close(_dense(cols), _dense(r)[:, 64:], atol=0, rtol=0)
    torch.testing.assert_close(_dense(r.narrow(0, 2, 3)), _dense(r)[2:5], atol=0, rtol=0)
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        r.narrow(1, 16, 32)
    block, size = GGML_QUANT_SIZES[T.Q8_0]
    with pytest.raises(ValueError, match="does not hold"):
        GGUFRawTensor(torch.zeros(8, 3 * size, dtype=torch.uint8), T.Q8_0, (8, 128))


def _int8_layer(method: str, dtype: torch.dtype, k: int = 128, n: int = 48):
    with set_quantization(method), torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            return ReplicatedLinear(k, n, bias=True)
        finally:
            torch.set_default_dtype(torch.float32)


def _check_int8(layer, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """layer(x) = x (q * scale)^T + bias within the activations' int8 rounding (per 32 values
    in the GEMV, per 128 in the GEMM; the bound of the coarser), for decode and prefill rows."""
    wq = q.double() * scale.double()[:, None]
    for rows in (1, 3, 37):
        x = torch.randn(rows, q.shape[1]).to(dtype)
        want = x.double() @ wq.T + layer.bias.double()
        _, d = quantize_activations(x.float(), 128)
        step = d.double().repeat_interleave(128, dim=1) / 2
        bound = step @ wq.abs().T + 1e-4 + (2e-2 * want.abs() if dtype == torch.bfloat16 else 0)
        assert ((layer(x).double() - want).abs() <= bound).all(), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_w8a8_equals_its_dequantized_matmul(dtype) -> None:
    layer = _int8_layer("int8", dtype)
    assert isinstance(layer.quant_method, Int8LinearMethod)
    w = torch.randn(48, 128)
    w[3] = 0  # an all-zero channel
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, torch.randn(48))
    layer.process_weights_after_loading()
    (group,) = layer.packed_groups
    assert layer.weight is None and group.packed.qs.dtype == torch.uint8
    q, scale = quantize_per_channel(w.to(dtype))
    assert (q.float() * scale[:, None] - w.to(dtype).float()).abs().max() <= scale.max() / 2
    torch.testing.assert_close(  # the packed copy holds q and the scales exactly
        dequantize_packed(group.packed), q.float() * scale[:, None], atol=0, rtol=0
    )
    _check_int8(layer, q, scale, dtype)


@pytest.mark.parametrize("fused", ["qkv", "gate_up"])
def test_int8_layer_is_quantized_when_its_last_shard_loads(fused) -> None:
    """The dense weight lives only until every shard is in (one layer's dense weight at a
    time while a checkpoint loads); the packed rows are each shard's, in order. gate/up's
    input goes per token to the AMX GEMM, qkv's per 128 values."""
    with set_quantization("int8"):
        if fused == "qkv":
            layer = QKVParallelLinear(128, 16, 4, 2)
            shards = {"q": 64, "k": 32, "v": 32}
        else:
            layer = MergedColumnParallelLinear(128, [48, 80])
            shards = {0: 48, 1: 80}
    weights = {sid: torch.randn(rows, 128) for sid, rows in shards.items()}
    for sid, w in weights.items():
        assert layer.weight is not None, f"quantized before shard {sid!r} loaded"
        layer.weight.weight_loader(layer.weight, w, sid)
    assert layer.weight is None  # quantized at the last shard, before finalize
    layer.process_weights_after_loading()  # a no-op now
    q, scale = quantize_per_channel(torch.cat(list(weights.values())))
    (group,) = layer.packed_groups
    torch.testing.assert_close(
        dequantize_packed(group.packed), q.float() * scale[:, None], atol=0, rtol=0
    )
    assert group.packed.activation_block == (None if fused == "gate_up" else 128)


@pytest.mark.skipif(
    cpu_kernels() is None
    or not (cpu_kernels().int8_gemm_amx_supported() or cpu_kernels().int8_gemm_vnni_compiled()),
    reason="no per-channel int8 GEMM (AMX-INT8 or AVX-512 VNNI)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_mlp_computes_silu_and_mul_with_gate_up(dtype) -> None:
    """Prefill rows of an int8 MLP take gate_up's fused pass (the same bits as gate_up, then
    SiluAndMul); decode-sized batches and a layer under a forward hook (LoRA) do not."""
    with set_quantization("int8"), torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            mlp = LlamaMLP(128, 64, "silu", bias=False)
        finally:
            torch.set_default_dtype(torch.float32)
    gate_up = mlp.gate_up_proj
    gate_up.weight.weight_loader(gate_up.weight, torch.randn(64, 128), 0)
    gate_up.weight.weight_loader(gate_up.weight, torch.randn(64, 128), 1)
    x = torch.randn(40, 128).to(dtype)
    fused = gate_up.silu_and_mul(x)
    assert fused is not None and torch.equal(fused, mlp.act_fn(gate_up(x)))
    assert torch.equal(mlp._gate_up_act(x), fused)
    assert gate_up.silu_and_mul(x[:2]) is None  # the GEMV's batches
    for register in (gate_up.register_forward_hook, gate_up.register_forward_pre_hook):
        handle = register(lambda module, *args: None)
        assert gate_up.silu_and_mul(x) is None
        handle.remove()
    assert gate_up.silu_and_mul(x[0]) is None  # one row (1-D): the GEMV's, as `apply` counts


def test_int8_off_the_kernel_shapes_keeps_the_dequantized_weight() -> None:
    layer = _int8_layer("int8", torch.float32, k=96)  # K % 64 != 0: no packed layout
    w = torch.randn(48, 96)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, torch.randn(48))
    layer.process_weights_after_loading()
    assert layer.packed_groups[0].packed is None
    q, scale = quantize_per_channel(w)
    x = torch.randn(5, 96)
    want = F.linear(x, q.float() * scale[:, None], layer.bias)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


def test_compressed_tensors_fused_layer_loads_int8_shards_and_scales() -> None:
    """q/k/v as a compressed-tensors checkpoint holds them: int8 weights and [N, 1] scales,
    each loaded into its rows of the fused layer."""
    with set_quantization("compressed-tensors"):
        layer = QKVParallelLinear(128, 16, 4, 2, bias=True)
    assert isinstance(layer.quant_method, CompressedTensorsW8A8LinearMethod)
    qs, scales = {}, {}
    for sid, rows in {"q": 64, "k": 32, "v": 32}.items():
        qs[sid], s = quantize_per_channel(torch.randn(rows, 128))
        scales[sid] = s[:, None].to(torch.bfloat16)  # as llm-compressor writes it
        layer.weight.weight_loader(layer.weight, qs[sid], sid)
        layer.weight_scale.weight_loader(layer.weight_scale, scales[sid], sid)
        layer.bias.weight_loader(layer.bias, torch.randn(rows), sid)
    layer.process_weights_after_loading()
    assert not hasattr(layer, "weight_scale") and layer.weight is None
    q = torch.cat([qs[s] for s in "qkv"])
    scale = torch.cat([scales[s].float().reshape(-1) for s in "qkv"])
    _check_int8(layer, q, scale, torch.float32)


def test_unknown_quantization_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match="'awq' is not supported; supported: gguf, int8, compressed-tensors"
    ):
        with set_quantization("awq"):
            pass


def test_engine_args_quantization_rules(monkeypatch) -> None:
    from pagedlm.engine.arg_utils import EngineArgs

    with pytest.raises(NotImplementedError, match="quantization='awq'.*'gguf', 'int8'"):
        EngineArgs(quantization="awq")
    assert EngineArgs().resolve_quantization(is_gguf=True) == "gguf"
    assert EngineArgs().resolve_quantization(is_gguf=False) is None
    assert EngineArgs(quantization="int8").resolve_quantization(is_gguf=False) == "int8"
    for method in ("int8", "compressed-tensors"):
        with pytest.raises(ValueError, match=f"'{method}' is for Hugging Face.*already quantized"):
            EngineArgs(quantization=method).resolve_quantization(is_gguf=True)
    with pytest.raises(ValueError, match="needs a .gguf model"):
        EngineArgs(quantization="gguf").resolve_quantization(is_gguf=False)
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    assert EngineArgs().resolve_quantization(is_gguf=True) is None
    assert EngineArgs(quantization="gguf").resolve_quantization(is_gguf=True) == "gguf"


def test_checkpoint_quantization_config_rules() -> None:
    """vLLM's rule: a checkpoint's quantization_config names its method; a different
    `quantization` is an error; methods and compressed-tensors schemes pagedlm cannot run
    are refused by name."""
    import copy
    from types import SimpleNamespace

    from pagedlm.engine.arg_utils import EngineArgs
    from scripts.make_w8a8_checkpoint import QUANTIZATION_CONFIG

    def config(path: str = "", value: object = None):
        """The W8A8 config with `path` ("a.b": a dotted path in it) set to `value`."""
        qc = copy.deepcopy(QUANTIZATION_CONFIG)
        if path:
            *parents, leaf = path.split(".")
            node = qc
            for part in parents:
                node = node[part]
            node[leaf] = value
        return SimpleNamespace(quantization_config=qc)

    resolve = EngineArgs().resolve_quantization
    assert resolve(False, config()) == "compressed-tensors"
    assert EngineArgs(quantization="compressed-tensors").resolve_quantization(False, config())
    with pytest.raises(ValueError, match="quantized with 'compressed-tensors'.*'int8' was"):
        EngineArgs(quantization="int8").resolve_quantization(False, config())
    with pytest.raises(ValueError, match="has no quantization_config"):
        EngineArgs(quantization="compressed-tensors").resolve_quantization(False, object())
    group = "config_groups.group_0."
    refused = {
        group + "weights.strategy": ("group", "weights.strategy='group'"),
        group + "weights.num_bits": (4, "weights.num_bits=4"),
        group + "input_activations.dynamic": (False, "input_activations.dynamic=False"),
        group + "input_activations": (None, "no input_activations"),
        "format": ("pack-quantized", "format 'pack-quantized'"),
        "ignore": (["lm_head", "re:.*gate$"], "ignore entries"),
    }
    for path, (value, message) in refused.items():
        with pytest.raises(NotImplementedError, match=message):
            resolve(False, config(path, value))
    awq = SimpleNamespace(quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(NotImplementedError, match="quantized with 'awq' do not load"):
        resolve(False, awq)


def test_without_c_kernels_the_torch_twin_computes(monkeypatch) -> None:
    monkeypatch.setattr("pagedlm.kernels.gguf.cpu_kernels", lambda: None)
    with set_quantization("gguf"):
        layer = ReplicatedLinear(64, 32)
    r = _raw_tensor(T.Q5_0, 32, 64, 7)
    layer.weight.weight_loader(layer.weight, r)
    layer.process_weights_after_loading()
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), F.linear(x, _dense(r)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q8_0, T.Q4_K])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_embedding_rows_equal_the_decoded_table(qtype, dtype) -> None:
    """An untied GGUF table stays in its blocks: a lookup decodes only its rows, to exactly
    what decoding the whole table (as before) gives; the dense parameter holds no memory."""
    from pagedlm.layers.vocab_embedding import VocabParallelEmbedding

    rows, cols = 40, 256
    raw = _raw_tensor(qtype, rows, cols, seed=3)
    want = dequantize(raw.data, raw.ggml_type, (rows, cols), dtype)
    with torch.device("cpu"):
        table = VocabParallelEmbedding(rows, cols)
    table.weight.data = table.weight.data.to(dtype)
    table.weight.weight_loader(table.weight, raw)
    assert table.weight.is_meta and table.weight.dtype == dtype
    ids = torch.tensor([[0, 39, 7], [7, 12, 1]])
    got = table(ids)
    assert got.dtype == dtype and got.shape == (2, 3, cols)
    assert torch.equal(got, want[ids])
