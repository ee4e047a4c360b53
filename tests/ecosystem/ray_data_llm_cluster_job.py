"""The Ray Data LLM chat job of ray_data_llm_job.py, on an existing (multi-node) Ray cluster.

    RAY_ADDRESS=HOST:PORT python ray_data_llm_cluster_job.py MODEL WORKDIR REPLICAS

connects to the running cluster (RAY_ADDRESS, and RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH when it
uses token authentication), runs the chat processor with REPLICAS engine replicas of one CPU
each, writes WORKDIR/chat (parquet) and prints one line
`RESULT {"chat": [...], "nodes": [...], "engines": [...], "engine_nodes_used": N}`:
the rows, the cluster's nodes, each engine replica's actor with the node it ran on, and the
number of nodes the engine stage's tasks ran on (from the dataset's stats).
"""

import json
import os
import re
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.llm import vLLMEngineProcessorConfig

from tests.ecosystem.ray_chat_rows import build_llm_processor, chat_request, chat_result, questions

model, work, replicas = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(work, exist_ok=True)
rows = 8 * replicas  # batches of 4: two per replica
table = pa.table({"id": list(range(rows)), "question": questions(rows)})
pq.write_table(table, f"{work}/in.parquet")

# An explicit address, never "auto": on a shared machine "auto" may find another cluster.
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
deadline = time.monotonic() + 60
while sum(n["Alive"] for n in ray.nodes()) < replicas and time.monotonic() < deadline:
    time.sleep(1)
ctx = ray.data.DataContext.get_current()
ctx.enable_progress_bars = False
# So that every replica gets batches (the test checks where they ran): start the pipeline only
# once all replicas are up, and hand each batch to the least busy replica. By default Ray Data
# starts with the first replica ready and prefers the replica on the node holding the data.
ctx.wait_for_min_actors_s = 600
ctx.execution_options.actor_locality_enabled = False

# Each node has 1 CPU and each replica takes 1: one replica per node. The light stages take no
# CPU reservation (0), otherwise they would hold part of a node's only CPU and a replica could
# not be placed (on nodes with spare cores give them fractional or whole CPUs instead).
light = {"num_cpus": 0}
stage = {"enabled": True, "concurrency": 1, **light}
chat = build_llm_processor(
    vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs={"dtype": "float32", "max_model_len": 128},
        # (min, max): exactly `replicas` engines. A plain int n is an autoscaling pool of
        # 1..n in Ray 2.60, which a job this small never scales past 1.
        concurrency=(replicas, replicas),
        batch_size=4,
        # CPU-only placement: without it Ray reserves one GPU per engine replica.
        placement_group_config={"bundles": [{"CPU": 1}]},
        chat_template_stage=stage,
        tokenize_stage=stage,
        detokenize_stage=stage,
    ),
    preprocess=chat_request,
    postprocess=chat_result,
    preprocess_map_kwargs=light,
    postprocess_map_kwargs=light,
)
# Read first (the file-listing task takes a whole CPU, which the replicas hold later), in one
# block per batch (a block is never split between replicas).
ds = ray.data.read_parquet(f"{work}/in.parquet").repartition(rows // 4).materialize()
out = chat(ds).materialize()
stats = out.stats()
out.write_parquet(f"{work}/chat", ray_remote_args=light)

# Where the replicas ran: the engine stage's actors in the GCS actor table (dead ones included).
engines = [
    {"actor_id": a["ActorID"], "class": a["ActorClassName"], "node_id": a["Address"]["NodeID"]}
    for a in ray._private.state.actors().values()
    if "vLLMEngineStageUDF" in (a.get("ActorClassName") or "") + (a.get("Name") or "")
]
# ...and the nodes the engine stage's tasks (batches) ran on, from Ray Data's stats.
used = None
for block in stats.split("\nOperator ")[1:]:
    if "vLLMEngineStageUDF" in block.splitlines()[0]:
        found = re.search(r"Tasks per node: .*; (\d+) nodes used", block)
        used = int(found.group(1)) if found else None
nodes = [
    {"node_id": n["NodeID"], "alive": n["Alive"], "cpus": n["Resources"].get("CPU", 0)}
    for n in ray.nodes()
]
ray.shutdown()

chat_rows = sorted(pq.read_table(f"{work}/chat").to_pylist(), key=lambda r: r["id"])
result = {"chat": chat_rows, "nodes": nodes, "engines": engines, "engine_nodes_used": used}
print("STATS\n" + stats)
print("RESULT " + json.dumps(result))
