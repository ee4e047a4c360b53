"""A Ray Data LLM image chat job, written against vLLM's names only (runs on pagedlm via the alias).

    python ray_data_llm_image_job.py MODEL WORKDIR

reads WORKDIR/in.parquet (written here: an id and a JSON conversation per row), runs Ray's
vLLM processor with its multimodal stages on a local 2-CPU Ray cluster with CPU-only
placement bundles, writes WORKDIR/out (parquet) and prints one line `RESULT [...]`.

Stages: PrepareMultimodal (vllm.entrypoints.chat_utils.parse_chat_messages_async: image parts
become {"type": "image"} parts, the images go to `multimodal_data`) -> ChatTemplate -> Tokenize
-> vLLMEngine (TokensPrompt with multi_modal_data) -> Detokenize.

Ray's ChatTemplate stage always loads `transformers.AutoProcessor`; for a Qwen2.5-VL model
folder that builds Qwen2_5_VLProcessor, whose video processor needs torchvision. Its
`model_source` therefore points at a copy of the tokenizer files only, where AutoProcessor
returns the tokenizer (the template is the tokenizer's). The content format is "openai" as
vLLM's "auto" picks for a template that loops over content parts (so does LLM.chat).
"""

import json
import os
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.llm import vLLMEngineProcessorConfig

from tests.ecosystem.ray_chat_rows import build_llm_processor
from tests.ecosystem.ray_image_rows import conversations, image_request, image_result

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

model, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
rows = [json.dumps(c) for c in conversations()]
pq.write_table(pa.table({"id": list(range(len(rows))), "conversation": rows}), f"{work}/in.parquet")
template_dir = f"{work}/chat-template-tokenizer"
os.makedirs(template_dir, exist_ok=True)
for name in TOKENIZER_FILES:
    if os.path.exists(f"{model}/{name}"):
        shutil.copy(f"{model}/{name}", template_dir)

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
small = {"num_cpus": 0.1}  # the CPU stages share the 2 CPUs with the engine actor
processor = build_llm_processor(
    vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs={"dtype": "float32", "max_model_len": 512},
        concurrency=1,
        batch_size=2,
        # CPU-only placement: without it Ray reserves one GPU per engine replica.
        placement_group_config={"bundles": [{"CPU": 1}]},
        prepare_multimodal_stage={
            "enabled": True,
            "chat_template_content_format": "openai",
            **small,
        },
        chat_template_stage={"enabled": True, "model_source": template_dir, **small},
        tokenize_stage={"enabled": True, **small},
        detokenize_stage={"enabled": True, **small},
    ),
    preprocess=image_request,
    postprocess=image_result,
    preprocess_map_kwargs=small,
    postprocess_map_kwargs=small,
)
print("STAGES " + json.dumps(processor.list_stage_names()))
# Read first: the file-listing task takes a whole CPU, which a 2-CPU cluster cannot spare
# once the engine actor holds its bundle (on a real cluster, skip the materialize()).
ds = ray.data.read_parquet(f"{work}/in.parquet").materialize()
processor(ds).write_parquet(f"{work}/out", ray_remote_args=small)
ray.shutdown()

result = sorted(pq.read_table(f"{work}/out").to_pylist(), key=lambda r: r["id"])
print("RESULT " + json.dumps(result))
