"""`dflashq regenerate --engine vllm`: the target in vLLM's offline engine, behind the Engine interface.

vLLM batches continuously (a finished row's slot is refilled at once), pages the KV cache and replays CUDA graphs,
for every architecture it serves; dflashq only renders the chat template, hands token ids over and turns the
generated ids into Replies exactly as the transformers engine does (producers/engines.py), so both write the same
records. Needs the `vllm` extra and a CUDA GPU.
"""

from __future__ import annotations

import os
import tempfile
from typing import Protocol

from dflashq import defaults
from dflashq.exceptions import ConfigError, InputError
from dflashq.settings import Settings
from dflashq.target import eos_ids_of_folder
from dflashq.vllm_target import engine_environment, import_vllm, prepare_target
from producers.conversation import Conversation
from producers.engines import BATCHES_PER_CALL, Reply, chat_prompts, decoded_reply
from producers.tokenize import load_tokenizer


class TokenGenerator(Protocol):
    """Token ids in, generated token ids out: the one call the engine makes of vLLM."""

    max_model_len: int  # prompt + generated tokens a request may hold

    def generate(self, rows: list[list[int]], sampling: dict) -> list[list[int]]:
        """The generated ids of every row, in order; `sampling` holds vLLM SamplingParams fields."""
        ...

    def close(self) -> None: ...


class OfflineLLM:
    """vLLM's offline `LLM` on one GPU, loaded once; a text-only hybrid folder is wrapped as vLLM needs it."""

    def __init__(self, path: str, dtype: str, seed: int, trust_remote_code: bool, device: str):
        vllm = import_vllm()
        if not device.startswith("cuda"):
            raise ConfigError(f"regenerate --engine vllm runs on a CUDA GPU, not on {device}; pass --device cuda:N.")
        if ":" in device:  # vLLM takes the first visible GPU
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", device.split(":", 1)[1])
        for key, value in engine_environment().items():
            os.environ.setdefault(key, value)
        self._workdir = tempfile.TemporaryDirectory(prefix="dflashq-vllm-")
        model, extra = prepare_target(path, self._workdir.name)
        self._sampling_params = vllm.SamplingParams
        self.llm = vllm.LLM(model=model, tokenizer=path, dtype="bfloat16" if dtype == "auto" else dtype, seed=seed,
                            trust_remote_code=trust_remote_code,
                            gpu_memory_utilization=defaults.VLLM_GPU_MEMORY_UTILIZATION, **extra)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def generate(self, rows: list[list[int]], sampling: dict) -> list[list[int]]:
        params = self._sampling_params(**sampling, detokenize=False)  # the engine decodes with the target's tokenizer
        outputs = self.llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def close(self) -> None:
        """Stop vLLM's engine process, which holds the GPU memory it reserved, before the caller goes on."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        self._workdir.cleanup()


class VllmEngine:
    """regenerate's Engine over a TokenGenerator (vLLM's offline engine unless one is given): every history of a
    respond() call goes to vLLM at once, which schedules them itself; a history whose prompt leaves no room under
    the engine's max_model_len gets an error Reply (kept for the next run) instead of failing the call."""

    def __init__(self, settings: Settings, device: str = "cuda:0", generator: TokenGenerator | None = None):
        self.options = settings.regenerate
        model = settings.model
        self.tokenizer = load_tokenizer(model.path, model.trust_remote_code)
        if not self.tokenizer.chat_template:
            raise InputError(f"The tokenizer in {model.path} has no chat template; add one to regenerate with it.")
        self.eos_ids = eos_ids_of_folder(model.path, self.tokenizer)
        self.generator = generator or OfflineLLM(model.path, model.dtype, settings.train.seed, model.trust_remote_code, device)
        self.sampling = {"temperature": self.options.temperature, "max_tokens": self.options.max_new_tokens,
                         "stop_token_ids": sorted(self.eos_ids), "seed": settings.train.seed}
        self.batch_size = BATCHES_PER_CALL * defaults.VLLM_MAX_NUM_SEQS

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.generator.close()

    def respond(self, histories: list[Conversation]) -> list[Reply]:
        replies, prompts = chat_prompts(self.tokenizer, histories, self.options.enable_thinking)
        limit = self.generator.max_model_len
        runnable = []
        for index, ids in prompts:
            if len(ids) >= limit:
                replies[index] = Reply(error=f"prompt of {len(ids)} tokens leaves no room under vLLM's max_model_len {limit}")
            else:
                runnable.append((index, ids))
        if runnable:
            generated = self.generator.generate([ids for _, ids in runnable], self.sampling)
            for (index, _), tokens in zip(runnable, generated):
                replies[index] = decoded_reply(self.tokenizer, tokens, self.eos_ids)
        return replies
