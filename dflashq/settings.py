"""Run configuration: one TOML file per run, every key overridable by `DFLASHQ_<SECTION>_<KEY>` or a flag.

Precedence, lowest first: defaults, the TOML file, environment (`REDIS_URL`, then `DFLASHQ_*`), flags
(`--set section.key=value`, or the dedicated flags the CLI maps onto the same keys).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
from pathlib import Path

from dflashq import defaults
from dflashq.exceptions import ConfigError


@dataclasses.dataclass
class RedisSettings:
    url: str = defaults.REDIS_URL
    outage_seconds: float = defaults.REDIS_OUTAGE_SECONDS


@dataclasses.dataclass
class StoreSettings:
    path: str = defaults.STORE_PATH
    retention: str = defaults.RETENTION
    codec: str = defaults.CODEC


@dataclasses.dataclass
class ModelSettings:
    path: str = defaults.MODEL_PATH
    layer_ids: list[int] = dataclasses.field(default_factory=lambda: list(defaults.LAYER_IDS))
    trust_remote_code: bool = defaults.TRUST_REMOTE_CODE
    dtype: str = defaults.DTYPE


@dataclasses.dataclass
class DataSettings:
    paths: list[str] = dataclasses.field(default_factory=lambda: list(defaults.DATA_PATHS))
    max_length: int = defaults.MAX_LENGTH
    on_long: str = defaults.ON_LONG
    chunk_tokens: int = defaults.CHUNK_TOKENS
    sort_window: int = defaults.SORT_WINDOW
    min_supervised_tokens: int = defaults.MIN_SUPERVISED_TOKENS
    tokenize_processes: int = defaults.TOKENIZE_PROCESSES
    tokenize_batch: int = defaults.TOKENIZE_BATCH
    rejects_file: str = defaults.REJECTS_FILE


@dataclasses.dataclass
class BackpressureSettings:
    max_backlog: int = defaults.MAX_BACKLOG
    max_store_bytes: int = defaults.MAX_STORE_BYTES
    poll_seconds: float = defaults.POLL_SECONDS


@dataclasses.dataclass
class WorkersSettings:
    batch_tokens: int = defaults.BATCH_TOKENS
    heartbeat_seconds: float = defaults.HEARTBEAT_SECONDS
    worker_ttl: int = defaults.WORKER_TTL
    job_timeout: int = defaults.JOB_TIMEOUT
    compress_level: int = defaults.COMPRESS_LEVEL
    writer_threads: int = defaults.WRITER_THREADS
    writers: int = defaults.WRITERS
    fused_kernels: bool = defaults.FUSED_KERNELS
    max_splits: int = defaults.MAX_SPLITS


@dataclasses.dataclass
class TrainSettings:
    num_layers: int = defaults.NUM_LAYERS
    block_size: int = defaults.BLOCK_SIZE
    num_anchors: int = defaults.NUM_ANCHORS
    mask_token_id: int = defaults.MASK_TOKEN_ID
    learning_rate: float = defaults.LEARNING_RATE
    warmup_ratio: float = defaults.WARMUP_RATIO
    weight_decay: float = defaults.WEIGHT_DECAY
    grad_clip: float = defaults.GRAD_CLIP
    epochs: int = defaults.EPOCHS
    total_steps: int = defaults.TOTAL_STEPS
    chunks_per_step: int = defaults.CHUNKS_PER_STEP
    parallel: str = defaults.PARALLEL
    rank_timeout_seconds: float = defaults.RANK_TIMEOUT_SECONDS
    checkpoint_every_steps: int = defaults.CHECKPOINT_EVERY_STEPS
    checkpoint_every_minutes: float = defaults.CHECKPOINT_EVERY_MINUTES
    loss_chunk_rows: int = defaults.LOSS_CHUNK_ROWS
    micro_batch_tokens: int = defaults.MICRO_BATCH_TOKENS
    claim_idle_seconds: float = defaults.CLAIM_IDLE_SECONDS
    log_file: str = defaults.TRAIN_LOG
    sliding_window: int = defaults.SLIDING_WINDOW
    rope_theta: float = defaults.ROPE_THETA
    num_attention_heads: int = defaults.NUM_ATTENTION_HEADS
    num_key_value_heads: int = defaults.NUM_KEY_VALUE_HEADS
    head_dim: int = defaults.HEAD_DIM
    intermediate_size: int = defaults.INTERMEDIATE_SIZE
    layer_types: list[str] = dataclasses.field(default_factory=lambda: list(defaults.LAYER_TYPES))
    attention: str = defaults.ATTENTION
    seed: int = defaults.SEED
    architecture: str = defaults.ARCHITECTURE
    conv_kernel_size: int = defaults.CONV_KERNEL_SIZE
    conv_group_size: int = defaults.CONV_GROUP_SIZE
    selector_rank: int = defaults.SELECTOR_RANK
    selector_top_k: int = defaults.SELECTOR_TOP_K


@dataclasses.dataclass
class RegenerateSettings:
    temperature: float = defaults.REGENERATE_TEMPERATURE
    max_new_tokens: int = defaults.REGENERATE_MAX_NEW_TOKENS
    enable_thinking: bool = defaults.REGENERATE_ENABLE_THINKING
    concurrency: int = defaults.REGENERATE_CONCURRENCY
    timeout_seconds: float = defaults.REGENERATE_TIMEOUT_SECONDS
    retries: int = defaults.REGENERATE_RETRIES
    batch_tokens: int = defaults.REGENERATE_BATCH_TOKENS
    batch_fixed_tokens: int = defaults.REGENERATE_BATCH_FIXED_TOKENS
    processes: int = defaults.REGENERATE_PROCESSES
    decoder: str = defaults.REGENERATE_DECODER
    served_model: str = defaults.REGENERATE_SERVED_MODEL
    api_key: str = defaults.REGENERATE_API_KEY


SECTIONS: dict[str, type] = {
    "redis": RedisSettings,
    "store": StoreSettings,
    "model": ModelSettings,
    "data": DataSettings,
    "backpressure": BackpressureSettings,
    "workers": WorkersSettings,
    "train": TrainSettings,
    "regenerate": RegenerateSettings,
}


@dataclasses.dataclass
class Settings:
    run: str = defaults.RUN
    redis: RedisSettings = dataclasses.field(default_factory=RedisSettings)
    store: StoreSettings = dataclasses.field(default_factory=StoreSettings)
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    backpressure: BackpressureSettings = dataclasses.field(default_factory=BackpressureSettings)
    workers: WorkersSettings = dataclasses.field(default_factory=WorkersSettings)
    train: TrainSettings = dataclasses.field(default_factory=TrainSettings)
    regenerate: RegenerateSettings = dataclasses.field(default_factory=RegenerateSettings)
    config_path: str = ""  # where the TOML came from; relative paths in it are relative to its folder
    overrides: list = dataclasses.field(default_factory=list)  # (key, value) given explicitly, for child processes

    @property
    def run_dir(self) -> str:
        """`<store>/<run>`: manifest, blobs, checkpoints, rejects and the embedded Redis live here."""
        return f"{self.store.path.rstrip('/')}/{self.run}"

    def set(self, dotted: str, raw: object) -> None:
        """Set `section.key` (or `run`) from a TOML value or a string, coercing to the field's type."""
        if dotted == "run":
            self.run = _check_run_name(str(raw))
            return
        section_name, _, key = dotted.partition(".")
        if section_name not in SECTIONS or not key:
            raise ConfigError(f"Unknown setting '{dotted}': use run or <section>.<key> with section one of {', '.join(SECTIONS)}.")
        section = getattr(self, section_name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        if key not in fields:
            raise ConfigError(f"Unknown setting '{dotted}': [{section_name}] has keys {', '.join(fields)}.")
        setattr(section, key, _coerce(dotted, raw, typing.get_type_hints(type(section))[key]))

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("config_path")
        data.pop("overrides")
        return data


def _check_run_name(name: str) -> str:
    # The run name ends up in RQ queue names and job ids, which allow only these characters.
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ConfigError(f"Run name '{name}' is invalid: use letters, digits, '_' and '-' only.")
    return name


def _coerce(dotted: str, raw: object, kind: object) -> object:
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return int(float(raw)) if isinstance(raw, str) and "e" in raw.lower() else int(raw)
        if kind is float:
            return float(raw)
        if kind is str:
            if not isinstance(raw, (str, int, float)):
                raise ValueError(raw)
            return str(raw)
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if isinstance(raw, str):
                text = raw.strip()
                raw = json.loads(text) if text.startswith("[") else [p for p in text.split(",") if p.strip()]
            if not isinstance(raw, list):
                raise ValueError(raw)
            return [_coerce(dotted, v.strip() if isinstance(v, str) else v, item) for v in raw]
    except (TypeError, ValueError, json.JSONDecodeError):
        pass
    else:
        raise AssertionError(f"unsupported setting type {kind}")
    name = getattr(kind, "__name__", str(kind))
    raise ConfigError(f"Setting '{dotted}' has value {raw!r}, which is not a valid {name}.")


def _env_overrides(environ: typing.Mapping[str, str]) -> list[tuple[str, str]]:
    out = []
    if environ.get("REDIS_URL"):
        out.append(("redis.url", environ["REDIS_URL"]))
    if environ.get("DFLASHQ_RUN"):
        out.append(("run", environ["DFLASHQ_RUN"]))
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            name = f"DFLASHQ_{section}_{field.name}".upper()
            if name in environ:
                out.append((f"{section}.{field.name}", environ[name]))
    return out


def load(
    config: str | os.PathLike | None = None,
    overrides: typing.Iterable[tuple[str, object]] = (),
    environ: typing.Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings of a run from defaults, a TOML file, the environment and explicit overrides."""
    settings = Settings()
    if config:
        path = Path(config)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"Config file {path} does not exist: check the --config path.") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"Config file {path} is not valid TOML ({exc}): fix that line.") from None
        settings.config_path = str(path.resolve())
        for key, value in data.items():
            if isinstance(value, dict):
                if key not in SECTIONS:
                    raise ConfigError(f"Config file {path} has an unknown section [{key}]: sections are {', '.join(SECTIONS)}.")
                for sub, sub_value in value.items():
                    settings.set(f"{key}.{sub}", sub_value)
            else:
                settings.set(key, value)
        _resolve_relative_paths(settings, path.resolve().parent)
    for dotted, value in _env_overrides(os.environ if environ is None else environ):
        settings.set(dotted, value)
    for dotted, value in overrides:
        settings.set(dotted, value)
        settings.overrides.append((dotted, value))
    _validate(settings)
    return settings


def _resolve_relative_paths(settings: Settings, base: Path) -> None:
    """Paths written in a config file are relative to that file, so a run works from any directory."""

    def resolve(p: str) -> str:
        return p if not p or "://" in p or Path(p).is_absolute() else str(base / p)

    settings.store.path = resolve(settings.store.path)
    settings.model.path = resolve(settings.model.path)
    settings.data.paths = [resolve(p) for p in settings.data.paths]


def _validate(settings: Settings) -> None:
    checks = [
        (settings.store.retention in ("delete", "keep"), "store.retention must be 'delete' or 'keep'"),
        (settings.data.on_long in ("truncate", "drop"), "data.on_long must be 'truncate' or 'drop'"),
        (settings.data.max_length >= 2, "data.max_length must be at least 2"),
        (settings.data.chunk_tokens >= settings.data.max_length, "data.chunk_tokens must be at least data.max_length"),
        (settings.data.tokenize_processes >= 1, "data.tokenize_processes must be at least 1"),
        (settings.data.sort_window >= 1, "data.sort_window must be at least 1"),
        (settings.redis.outage_seconds >= 0, "redis.outage_seconds must be 0 or more"),
        (settings.backpressure.max_backlog >= 1, "backpressure.max_backlog must be at least 1"),
        (settings.backpressure.max_store_bytes >= 1, "backpressure.max_store_bytes must be at least 1"),
        (settings.train.block_size >= 2, "train.block_size must be at least 2"),
        (settings.train.num_layers >= 1, "train.num_layers must be at least 1"),
        (not settings.train.layer_types or len(settings.train.layer_types) == settings.train.num_layers,
         f"train.layer_types lists {len(settings.train.layer_types)} layers but train.num_layers is {settings.train.num_layers}"),
        (settings.train.attention in ("auto", "flex", "sdpa"), "train.attention must be 'auto', 'flex' or 'sdpa'"),
        (settings.train.architecture in ("dflash", "dflash2"), "train.architecture must be 'dflash' or 'dflash2'"),
        (min(settings.train.conv_kernel_size, settings.train.conv_group_size, settings.train.selector_rank,
             settings.train.selector_top_k) >= 1,
         "train.conv_kernel_size, conv_group_size, selector_rank and selector_top_k must each be at least 1"),
        (settings.store.codec in ("bf16", "fp8"), "store.codec must be 'bf16' or 'fp8'"),
        (settings.regenerate.decoder in ("auto", "static", "generate"),
         "regenerate.decoder must be 'auto', 'static' or 'generate'"),
        (settings.train.chunks_per_step >= 1, "train.chunks_per_step must be at least 1"),
        (settings.train.parallel in ("ddp", "fsdp"), "train.parallel must be 'ddp' or 'fsdp'"),
        (settings.train.rank_timeout_seconds > settings.redis.outage_seconds,
         "train.rank_timeout_seconds must be longer than redis.outage_seconds (a rank riding out an outage must not time the others out)"),
        (set(settings.train.layer_types) <= {"full_attention", "sliding_attention"},
         "train.layer_types entries must be 'full_attention' or 'sliding_attention'"),
        (settings.workers.heartbeat_seconds * 2 <= settings.workers.worker_ttl, "workers.worker_ttl must be at least twice workers.heartbeat_seconds"),
        (settings.regenerate.temperature >= 0, "regenerate.temperature must be 0 (greedy) or more"),
        (settings.regenerate.max_new_tokens >= 1, "regenerate.max_new_tokens must be at least 1"),
        (settings.regenerate.concurrency >= 1, "regenerate.concurrency must be at least 1"),
        (settings.regenerate.timeout_seconds > 0, "regenerate.timeout_seconds must be more than 0"),
        (settings.regenerate.retries >= 0, "regenerate.retries must be 0 or more"),
        (settings.regenerate.batch_tokens >= 0, "regenerate.batch_tokens must be at least 1 (or 0: sized from the device)"),
        (settings.regenerate.batch_fixed_tokens >= 0, "regenerate.batch_fixed_tokens must be 0 or more"),
        (settings.regenerate.processes >= 1, "regenerate.processes must be at least 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"Invalid configuration: {message}.")
