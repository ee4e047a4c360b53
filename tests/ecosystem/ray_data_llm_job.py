"""A Ray Data LLM batch job, written against vLLM's names only (runs on pagedlm via the alias).

    python ray_data_llm_job.py MODEL WORKDIR

reads WORKDIR/in.parquet (written here), runs a chat processor and an embedding processor on a
local 2-CPU Ray cluster with CPU-only placement bundles, writes WORKDIR/chat and WORKDIR/embed
(parquet) and prints one line `RESULT {"chat": [...], "embed": [...]}`.
"""

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.llm import vLLMEngineProcessorConfig

from tests.ecosystem.ray_chat_rows import build_llm_processor, chat_request, chat_result, questions

model, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
pq.write_table(pa.table({"id": list(range(8)), "question": questions(8)}), f"{work}/in.parquet")

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
small = {"num_cpus": 0.1}  # the CPU stages share the 2 CPUs with the engine actor
common = dict(
    model_source=model,
    engine_kwargs={"dtype": "float32", "max_model_len": 128},
    concurrency=1,
    batch_size=4,
    # CPU-only placement: without it Ray reserves one GPU per engine replica.
    placement_group_config={"bundles": [{"CPU": 1}]},
)
chat = build_llm_processor(
    vLLMEngineProcessorConfig(
        **common,
        chat_template_stage={"enabled": True, **small},
        tokenize_stage={"enabled": True, **small},
        detokenize_stage={"enabled": True, **small},
    ),
    preprocess=chat_request,
    postprocess=chat_result,
    preprocess_map_kwargs=small,
    postprocess_map_kwargs=small,
)
embed = build_llm_processor(
    vLLMEngineProcessorConfig(
        **common,
        task_type="embed",
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
    ),
    preprocess=lambda row: {"prompt": row["question"]},
    postprocess=lambda row: {
        "id": row["id"],
        "prompt": row["prompt"],
        "embedding": [float(x) for x in row["embeddings"]],
    },
    preprocess_map_kwargs=small,
    postprocess_map_kwargs=small,
)
# Read first: the file-listing task takes a whole CPU, which a 2-CPU cluster cannot spare
# once the engine actor holds its bundle (on a real cluster, skip the materialize()).
ds = ray.data.read_parquet(f"{work}/in.parquet").materialize()
chat(ds).write_parquet(f"{work}/chat", ray_remote_args=small)
embed(ds).write_parquet(f"{work}/embed", ray_remote_args=small)
ray.shutdown()

result = {
    name: sorted(pq.read_table(f"{work}/{name}").to_pylist(), key=lambda r: r["id"])
    for name in ("chat", "embed")
}
print("RESULT " + json.dumps(result))
