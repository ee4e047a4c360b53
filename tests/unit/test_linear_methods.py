"""Linear methods (layers/quantization): GGUF blocks kept packed and int8 weight-only, each
against dequantize-then-matmul; the method chosen by `set_quantization`; bad values refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedlm.kernels.gguf_pack import quantize_activations
from pagedlm.kernels.gguf_quants import dequantize
from pagedlm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from pagedlm.layers.quantization import (
    UnquantizedLinearMethod,
    set_quantization,
)
from pagedlm.layers.quantization.gguf import GGUFLinearMethod, GGUFRawTensor
from pagedlm.layers.quantization.int8 import Int8WeightOnlyLinearMethod, quantize_per_channel
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
    assert [(g.offset, g.rows, g.packed.ggml_type) for g in layer.gguf_groups] == [
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
    assert [g.packed is None for g in mixed.gguf_groups] == [True, False]
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_only_equals_its_dequantized_matmul(dtype) -> None:
    with set_quantization("int8"), torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            layer = ReplicatedLinear(96, 48, bias=True)
        finally:
            torch.set_default_dtype(torch.float32)
    assert isinstance(layer.quant_method, Int8WeightOnlyLinearMethod)
    w = torch.randn(48, 96)
    w[3] = 0  # an all-zero channel
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, torch.randn(48))
    layer.process_weights_after_loading()
    assert layer.weight is None and layer.int8_weight.dtype == torch.int8
    q, scale = quantize_per_channel(w.to(dtype))
    assert (q.float() * scale[:, None] - w.to(dtype).float()).abs().max() <= scale.max() / 2
    x = torch.randn(7, 96).to(dtype)
    wq = q.float() * scale.to(dtype).float()[:, None]
    want = F.linear(x.float(), wq, layer.bias.float())
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(layer(x).float(), want, **tol)


def test_unknown_quantization_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'awq' is not supported; supported: gguf, int8"):
        with set_quantization("awq"):
            pass


def test_engine_args_quantization_rules(monkeypatch) -> None:
    from pagedlm.engine.arg_utils import EngineArgs

    with pytest.raises(NotImplementedError, match="quantization='awq'.*'gguf', 'int8'"):
        EngineArgs(quantization="awq")
    assert EngineArgs().resolve_quantization(is_gguf=True) == "gguf"
    assert EngineArgs().resolve_quantization(is_gguf=False) is None
    assert EngineArgs(quantization="int8").resolve_quantization(is_gguf=False) == "int8"
    with pytest.raises(ValueError, match="already quantized"):
        EngineArgs(quantization="int8").resolve_quantization(is_gguf=True)
    with pytest.raises(ValueError, match="needs a .gguf model"):
        EngineArgs(quantization="gguf").resolve_quantization(is_gguf=False)
    monkeypatch.setenv("PAGEDLM_GGUF_DEQUANTIZE", "1")
    assert EngineArgs().resolve_quantization(is_gguf=True) is None
    assert EngineArgs(quantization="gguf").resolve_quantization(is_gguf=True) == "gguf"


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
