"""Several transformers engines in child processes sharing one device, behind the Engine interface.

Transformers' generate is bound by the CPU core that launches its kernels: with a small target one core runs at
100% while the GPU is mostly idle. regenerate.processes = N starts N
TransformersEngines (spawned processes, each its own CUDA context on the same device, each sizing its KV cache from
1/N of the free memory) and deals every respond() call's histories out among them. Where the KV budget rather than
the core bounds the rows in flight (long prompts), N processes hold no more rows than one; `benchmarks/regenerate.py`
measures which case a target and device are in.
"""

from __future__ import annotations

import multiprocessing

from dflashq.exceptions import DflashqError
from dflashq.settings import Settings
from producers.conversation import Conversation
from producers.engines import Engine, Reply, TransformersEngine


def _serve(conn, settings: Settings, device: str, share: float) -> None:
    """A child: load the engine, say its batch size, then answer batches until told to stop (None) or orphaned."""
    try:
        engine = TransformersEngine(settings, device, memory_share=share)
        conn.send(engine.batch_size)
        while (histories := conn.recv()) is not None:
            conn.send(engine.respond(histories))
    except DflashqError as exc:  # the parent ends with this sentence
        conn.send(exc)
    except EOFError:  # the parent is gone
        pass


def _size(history: Conversation) -> int:
    # characters as a stand-in for tokens: enough to give every process a similar mix of lengths
    return sum(len(str(m.get("content") or "")) for m in history.messages)


class EngineProcesses:
    """`processes` TransformersEngines on `device`; each respond() deals the histories out longest first, round
    robin (every process gets a similar mix, and each sorts its share into length-sorted batches again), and returns
    the replies in order. A process that dies (killed, out of host memory) ends the run with one sentence."""

    def __init__(self, settings: Settings, device: str, processes: int):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._children = []
        try:
            sizes = []
            for _ in range(processes):
                parent, child = context.Pipe()
                proc = context.Process(target=_serve, args=(child, settings, device, 1.0 / processes), daemon=True)
                proc.start()
                child.close()  # the child's end lives in the child only: its death reads as EOF here
                self._children.append((proc, parent))
                # one at a time: each child sees the memory the ones before it left free
                sizes.append(self._receive(len(self._children) - 1))
            self.batch_size = sum(sizes)
        except BaseException:
            self.close()
            raise

    def _receive(self, index: int):
        try:
            message = self._children[index][1].recv()
        except (EOFError, OSError):  # a dead child's pipe reads as EOF, or as reset while data was in flight
            raise self._died(index) from None
        if isinstance(message, DflashqError):
            raise message
        return message

    def _died(self, index: int) -> DflashqError:
        proc = self._children[index][0]
        proc.join(timeout=10)
        return DflashqError(f"regenerate engine process {index} died (exit code {proc.exitcode}); lower "
                            f"regenerate.processes or regenerate.batch_tokens and run again (records done are kept).")

    def respond(self, histories: list[Conversation]) -> list[Reply]:
        order = sorted(range(len(histories)), key=lambda i: _size(histories[i]), reverse=True)
        shares = [order[k::len(self._children)] for k in range(len(self._children))]
        for index, ((_, conn), share) in enumerate(zip(self._children, shares)):
            try:
                conn.send([histories[i] for i in share])
            except OSError:  # BrokenPipeError, ConnectionResetError: it is gone
                raise self._died(index) from None
        replies: list[Reply | None] = [None] * len(histories)
        for index, share in enumerate(shares):
            for i, reply in zip(share, self._receive(index)):
                replies[i] = reply
        return replies

    def __enter__(self) -> EngineProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for proc, conn in self._children:
            try:
                conn.send(None)
            except OSError:  # already gone
                pass
        for proc, conn in self._children:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
            conn.close()
        self._children = []


def local_engine(settings: Settings, device: str) -> Engine:
    """The transformers engine of regenerate.processes processes on `device`; a context manager that frees the device."""
    if settings.regenerate.processes > 1:
        return EngineProcesses(settings, device, settings.regenerate.processes)
    return TransformersEngine(settings, device)
