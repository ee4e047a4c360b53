"""The opt-in `vllm` alias: module paths, same objects, version, refusal over a real vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv

import pytest

from tests.ecosystem.conftest import REPO


def test_alias_reexports_pagedlm_objects_under_vllm_paths(run_client, tiny_qwen2) -> None:
    out = run_client(
        f"""
        import importlib.metadata as md, json
        import pagedlm, vllm
        from vllm import LLM, SamplingParams, TokensPrompt, AsyncLLMEngine, AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.outputs import RequestOutput, PoolingRequestOutput
        from vllm.inputs import TextPrompt
        from vllm.inputs.llm import TokensPrompt as TP2
        from vllm.engine.arg_utils import EngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.config import VllmConfig
        from vllm.tokenizers import get_tokenizer
        from vllm.transformers_utils.tokenizer import get_tokenizer as gt2
        from vllm.entrypoints.chat_utils import resolve_hf_chat_template
        from vllm.renderers.hf import resolve_chat_template
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError
        from vllm.v1.metrics.reader import Counter
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.distributed import cleanup_dist_env_and_memory
        from vllm.utils.network_utils import get_ip, get_open_port
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        from vllm.exceptions import VLLMValidationError
        from vllm.logprobs import Logprob
        from vllm.platforms import current_platform
        from vllm.tasks import PoolingTask, SupportedTask
        from vllm.config import AttentionConfig, StructuredOutputsConfig, CompilationConfig
        import vllm.attention
        from vllm.benchmarks.datasets import get_samples
        from vllm.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as ABE2
        from vllm.v1.executor import Executor
        from vllm.worker.worker import Worker
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        from vllm.utils import get_ip as get_ip_old, get_open_port as get_open_port_old
        from vllm.config import LoadFormat, RunnerOption
        from vllm.config.model import ConvertOption
        from vllm.logger import init_logger
        from vllm.sequence import Logprob as SequenceLogprob
        from vllm.sampling_params import StructuredOuputsParams
        from vllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
        import vllm.envs
        import pagedlm.executor.abstract, pagedlm.worker.worker
        import pagedlm.distributed.weight_transfer.ipc_engine as ipc
        import pagedlm.distributed.weight_transfer.base as wt_base
        import pagedlm.platforms, pagedlm.config
        import pagedlm.engine.async_llm as a, pagedlm.outputs as o, pagedlm.lora.request as lr

        same = [
            LLM is pagedlm.LLM, SamplingParams is pagedlm.SamplingParams,
            AsyncLLMEngine is a.AsyncLLM is AsyncLLM, AsyncEngineArgs is pagedlm.AsyncEngineArgs,
            RequestOutput is o.RequestOutput, TP2 is TokensPrompt, gt2 is get_tokenizer,
            vllm.outputs.PoolingRequestOutput is o.PoolingRequestOutput,
            vllm.sampling_params.SamplingParams is SamplingParams,
            LoRARequest is lr.LoRARequest,
            current_platform is pagedlm.platforms.current_platform, current_platform.is_cpu(),
            StructuredOutputsConfig is pagedlm.config.StructuredOutputsConfig,
            AttentionBackendEnum is ABE2, Executor is pagedlm.executor.abstract.Executor,
            Worker is pagedlm.worker.worker.Worker, get_ip_old is get_ip,
            IPCWeightTransferEngine is ipc.IPCWeightTransferEngine,
            WeightTransferInitRequest is wt_base.WeightTransferInitRequest,
            SequenceLogprob is Logprob, StructuredOuputsParams is StructuredOutputsParams,
            vllm.envs.VLLM_TORCH_PROFILER_USE_GZIP is True, init_logger("x").name == "x",
            current_platform.get_device_total_memory() > 0, not current_platform.supports_fp8(),
        ]
        llm = LLM({str(tiny_qwen2)!r}, dtype="float32", max_model_len=64)
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        tok = get_tokenizer({str(tiny_qwen2)!r})
        errors = {{}}
        for name, call in [
            ("pp", lambda: LLM({str(tiny_qwen2)!r}, pipeline_parallel_size=2)),
            ("lora_request", lambda: llm.generate("x", SamplingParams(max_tokens=1),
                lora_request=LoRARequest("a", 1, "/nowhere"), use_tqdm=False)),
            ("missing", lambda: vllm.initialize_ray_cluster),
            ("nccl", lambda: NCCLWeightTransferEngine()),
            ("impl", lambda: LLM({str(tiny_qwen2)!r}, model_impl="transformers")),
            ("ext_tp", lambda: LLM({str(tiny_qwen2)!r}, tensor_parallel_size=2,
                distributed_executor_backend="external_launcher")),
            ("attention_config", lambda: AttentionConfig(backend="FLASH_ATTN")),
            ("attention", lambda: vllm.attention.AttentionBackendEnum),
            ("samples", lambda: get_samples(None, None)),
            ("envs", lambda: vllm.envs.VLLM_USE_V1),
            ("reasoning", lambda: ReasoningParserManager()),
            ("backend", lambda: LLM({str(tiny_qwen2)!r},
                attention_backend=AttentionBackendEnum.FLASH_ATTN.value)),
        ]:
            try:
                call()
            except Exception as e:
                errors[name] = type(e).__name__ + ": " + str(e)
        choice = llm.generate("x", SamplingParams(max_tokens=4, temperature=0,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False)
        print(json.dumps(dict(
            choice=choice[0].outputs[0].text,
            same=same, version=md.version("vllm"), dunder=vllm.__version__,
            isinstance=isinstance(outs[0], RequestOutput), errors=errors,
            chat=resolve_hf_chat_template(tok, None, None) == tok.chat_template,
            file=vllm.__file__, pagedlm_file=pagedlm.__file__,
            port=0 < get_open_port() < 65536 and bool(get_ip()),
        )))
        """
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert all(got["same"]), got["same"]
    assert got["version"] == got["dunder"] == "0.19.0+pagedlm"
    assert got["isinstance"] and got["chat"] and got["port"]
    assert got["pagedlm_file"].startswith(str(REPO))
    errs = got["errors"]
    assert errs["pp"].startswith("NotImplementedError: pipeline_parallel_size=2")
    assert got["choice"] in ("yes", "no")  # structured outputs through the alias's params
    assert errs["lora_request"].startswith("ValueError: Got lora_request")
    assert errs["ext_tp"].startswith(
        "NotImplementedError: distributed_executor_backend='external_launcher' with"
    )
    assert errs["nccl"].startswith("ValueError: Invalid weight transfer backend: 'nccl'")
    assert errs["impl"].startswith("NotImplementedError: model_impl='transformers'")
    assert errs["missing"].startswith("AttributeError: vllm.initialize_ray_cluster is not provided")
    assert errs["attention_config"].startswith(
        "NotImplementedError: vllm.config.AttentionConfig is not provided by pagedlm"
    )
    assert errs["attention"].startswith("AttributeError: pagedlm's vllm alias has no vllm.att")
    assert errs["samples"].startswith("NotImplementedError: vllm.benchmarks.datasets.get_samp")
    assert errs["reasoning"].startswith("NotImplementedError: vllm.reasoning.ReasoningParserMa")
    assert errs["envs"].startswith("AttributeError: vllm.envs.VLLM_USE_V1: pagedlm does not read")
    assert errs["backend"].startswith("NotImplementedError: attention_backend='FLASH_ATTN'")


@pytest.mark.slow
def test_alias_refuses_to_build_over_a_real_vllm(tmp_path) -> None:
    """A venv holding a (fake) real vLLM distribution: building the alias there fails."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dist = os.path.join(site, "vllm-0.10.0.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm\nVersion: 0.10.0\nSummary: An engine\n")
    cmd = [
        str(py),
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--target",
        str(tmp_path / "t"),
        str(REPO / "compat" / "vllm-alias"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert (
        "Refusing to install pagedlm's `vllm` alias: a real vLLM (0.10.0)"
        in proc.stdout + proc.stderr
    )
    os.remove(os.path.join(dist, "METADATA"))
    os.rmdir(dist)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t" / "vllm" / "_pagedlm_alias.py").exists()
    assert sys.executable  # the test venv itself was never touched
