"""Every default value of dflashq, in one place (rq's habit)."""

RUN = "default"

# [redis]
REDIS_URL = ""  # empty: ops starts a private redis-server in the run directory
REDIS_OUTAGE_SECONDS = 300.0  # a lost connection is retried (with backoff) this long before a command gives up

# [store]
STORE_PATH = "dflashq-runs"
RETENTION = "delete"  # "delete": blob removed once trained; "keep": later epochs read the store
CODEC = "bf16"  # hidden states in blobs: "bf16" (the target dtype, lossless) or "fp8" (e4m3 + a scale per token and layer)

# [model]
MODEL_PATH = ""
LAYER_IDS: tuple[int, ...] = ()  # empty: the DFlash rule for train.num_layers (z-lab convention)
TRUST_REMOTE_CODE = False
DTYPE = "auto"  # bf16 on GPU, float32 on CPU

# [data]
DATA_PATHS: tuple[str, ...] = ()
MAX_LENGTH = 4096
ON_LONG = "truncate"  # or "drop"
CHUNK_TOKENS = 16384
SORT_WINDOW = 256  # samples sorted by length within windows of this many before packing (1: dataset order)
MIN_SUPERVISED_TOKENS = 2
TOKENIZE_PROCESSES = 2
TOKENIZE_BATCH = 64
REJECTS_FILE = "rejects.jsonl"

# [backpressure]
MAX_BACKLOG = 64
MAX_STORE_BYTES = 50 * 1024**3
POLL_SECONDS = 0.5

# [workers]
BATCH_TOKENS = 16384
HEARTBEAT_SECONDS = 5
WORKER_TTL = 30  # a worker silent this long is dead; its chunk is re-queued
# A queued chunk that no queue list, registry or worker has held this long is re-queued (workers/recovery.py); far
# above the milliseconds between a live worker's pop and RQ recording the start
ORPHAN_SECONDS = 30
JOB_TIMEOUT = 3600
COMPRESS_LEVEL = 1  # on bf16 states level 1 compresses about as well as 3, in about half the time
WRITER_THREADS = 4  # zstd's threads per blob
WRITERS = 2  # blobs encoded and written at once, each on its own thread: a second keeps a fast forward from waiting
FUSED_KERNELS = True  # flash-linear-attention's kernels for the hybrid Qwen layers on a GPU (workers/fused_kernels.py)
MAX_SPLITS = 4

# [regenerate]
REGENERATE_TEMPERATURE = 0.0  # 0: greedy
REGENERATE_MAX_NEW_TOKENS = 4096  # per assistant turn (data.max_length cuts longer samples anyway)
REGENERATE_ENABLE_THINKING = True  # what Qwen3-style templates do by default; templates without the switch ignore it
REGENERATE_CONCURRENCY = 64  # endpoint engine: requests in flight
REGENERATE_TIMEOUT_SECONDS = 600.0  # endpoint engine: one request, a whole non-streamed response
REGENERATE_RETRIES = 5  # endpoint engine: after connection errors, timeouts, 5xx, 429 and malformed bodies
# transformers engine: rows x (longest prompt + max_new_tokens) per batch; 0 = sized from the device: a decode step
# costs about the same for 1 row as for hundreds, so throughput grows with rows until memory runs out
REGENERATE_BATCH_TOKENS = 0
REGENERATE_MEMORY_FRACTION = 0.4  # on a GPU the KV cache may take this share of free memory
REGENERATE_MAX_ROWS = 1024  # beyond it the per-step logits and sampling outgrow what more rows gain
REGENERATE_CPU_BATCH_TOKENS = 65536  # batch_tokens 0 on the CPU
# transformers engine: what one more decode batch costs, in cached tokens; batches are cut where padding rows to the
# longest would cost more (producers/decode_batches.py). Fitted on a small target (docs/performance.md); a larger
# target reads more cache per token, so its fixed part is worth fewer tokens; a very large value packs batches full.
REGENERATE_BATCH_FIXED_TOKENS = 200_000
# transformers engine: processes sharing the device (generate is bound by the core launching its kernels)
REGENERATE_PROCESSES = 1
# transformers engine: how a batch is decoded. "static": a static KV cache with each decode step replayed as one CUDA
# graph (producers/static_decoder.py; greedy, attention-only Llama/Mistral/Qwen2/Qwen3 targets); "generate":
# Transformers' generate; "auto": static on a GPU where it applies, else generate.
REGENERATE_DECODER = "auto"
REGENERATE_API_KEY = ""  # endpoint engine: sent as `Authorization: Bearer <key>` (vLLM/SGLang --api-key); better in the environment
REGENERATE_SERVED_MODEL = ""  # endpoint engine: empty = the first model the server's /v1/models lists
# vLLM engines (regenerate --engine vllm, eval --engine vllm): the GPU share vLLM may take for weights and KV blocks,
# and the rows it schedules at once (vLLM's own default), which sizes regenerate's calls
VLLM_GPU_MEMORY_UTILIZATION = 0.85
VLLM_MAX_NUM_SEQS = 256

# `up`: e / (e + t), the share of a node's GPUs that train before any run of the same name measured its own rates e
# (a GPU worker's tokens/s) and t (a trainer rank's): extraction on G - T GPUs keeps T ranks busy at T = G e / (e + t).
# The ratio of a Qwen3.6-27B target's rates on one GPU (docs/performance.md, how up splits the GPUs).
TRAINER_GPU_SHARE = 0.46

# dashboard
DASHBOARD_HOST = "127.0.0.1"
DASHBOARD_PORT = 9181

# [train]
NUM_LAYERS = 5
BLOCK_SIZE = 16
NUM_ANCHORS = 512
MASK_TOKEN_ID = -1  # -1: chosen from the target tokenizer (trainer/mask_token.py says how)
LEARNING_RATE = 6e-4
WARMUP_RATIO = 0.04
# train.attention sdpa: blocks per SDPA call (trainer.attention_mask.dense_groups); more calls cut fewer scores
SDPA_GROUP_BLOCKS = 64
UNKNOWN_HORIZON_WARMUP_STEPS = 50  # warm-up while the epoch's size is unknown (trainer.step.WarmupCosine)
WEIGHT_DECAY = 0.0
GRAD_CLIP = 1.0
EPOCHS = 6
TOTAL_STEPS = 0  # 0: estimated from the chunks admitted per epoch
CHUNKS_PER_STEP = 1  # per rank: one optimizer step averages the gradients of every rank's chunks (N ranks x this)
PARALLEL = "ddp"  # with several ranks: "ddp" (a full replica per rank) or "fsdp" (FSDP2: weights and AdamW state sharded)
# A collective that waits longer than this fails, so ranks never wait for ever on a dead one; it must outlast a Redis
# outage ridden through (redis.outage_seconds) and rank 0 writing a checkpoint while the others wait at the barrier.
RANK_TIMEOUT_SECONDS = 1800.0
CHECKPOINT_EVERY_STEPS = 200
CHECKPOINT_EVERY_MINUTES = 10.0
LOSS_CHUNK_ROWS = 2048
MICRO_BATCH_TOKENS = 8192  # padded tokens per forward/backward; a chunk's micro-batches make one optimizer step
CLAIM_IDLE_SECONDS = 60.0  # stream entries a dead trainer left pending this long are claimed
# `up` starts a trainer whose step ran out of memory again this many times in a row (with its backoff) before it
# stops the run: another process may hold the GPU for a while; a step that never fits fails every time
OUT_OF_MEMORY_RETRIES = 3
TRAIN_LOG = "train_log.jsonl"
READ_AHEAD_THREADS = 2  # host threads decoding blobs while a step trains: the next step's, and with retention keep after epoch 0 this many steps beyond it (trainer.prefetch)
SLIDING_WINDOW = 2048  # used only by layers that train.layer_types makes sliding
# Drafter shape; 0 / empty = the default. Attention: the released drafters' 32 query / 8 kv heads of 128 whatever the
# hidden size (vLLM and SGLang shard heads: TP 1/2/4/8 must divide them); a target under hidden size 1024 (test and
# demo models) keeps its own attention shape. Layers: full attention in every one (stock vLLM refuses mixed
# layouts without its V2 model runner). The MLP width follows the target.
NUM_ATTENTION_HEADS = 0
NUM_KEY_VALUE_HEADS = 0
HEAD_DIM = 0
INTERMEDIATE_SIZE = 0
LAYER_TYPES: tuple[str, ...] = ()
DRAFTER_ATTENTION = (32, 8, 128)  # query heads, kv heads, head_dim
# "auto": compiled flex_attention on a GPU (block-sparse, fused; compiling it takes minutes on a host whose compile
# cache is cold), a dense-mask SDPA elsewhere; "sdpa" everywhere needs no compilation (small drafters, short runs)
ATTENTION = "auto"
OWN_ATTENTION_BELOW_HIDDEN = 1024
ROPE_THETA = 10_000_000.0
SEED = 0
# "dflash" or "dflash2" (trainer/dflash2.py): DFlash2 adds grouped dynamic convolutions and a candidate selector; these
# sizes are the published Qwen3.8-27B-DFlash2 drafter's
ARCHITECTURE = "dflash"
CONV_KERNEL_SIZE = 2
CONV_GROUP_SIZE = 16
SELECTOR_RANK = 256
SELECTOR_TOP_K = 16
