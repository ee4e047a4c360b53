"""The multiprocess executor: one spawned process per rank, joined by torch.distributed.

Each rank's process holds a Worker and answers calls sent over its own pipe (cloudpickle, so
callables travel too, with VLLM_ALLOW_INSECURE_SERIALIZATION=1). Failure handling, the reason
this file exists:
- the engine waits for every rank's reply at once and also watches every worker's process
  sentinel, so a dead worker raises WorkerDiedError naming its rank within moments, never a
  hang (even when the other ranks wait for it inside a collective);
- a rank whose call raises: its error reaches the caller once the other ranks answer, or after
  PAGEDLM_RANK_FAILURE_GRACE s when they are stuck waiting for it; stuck workers are restarted
  (model reloaded, start-up calls replayed) unless a call changed them beyond that;
- Ctrl-C never splits a message from its bookkeeping, and the next call drains the replies
  an interrupted one left;
- workers die with the engine: they ignore Ctrl-C (the engine shuts them down), ask the kernel
  for SIGKILL when their parent dies (Linux), and exit when their pipe closes;
- the engine stops them on `shutdown()`, when the executor is garbage-collected and at exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle

from pagedlm import envs
from pagedlm.config import VllmConfig
from pagedlm.executor.abstract import Executor, note_rank, run_method

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine needed it."""


def resolve_cpu_binding(world_size: int) -> list[list[int] | None]:
    """CPU ids of each rank, from VLLM_CPU_OMP_THREADS_BIND ('auto', 'nobind' or '0-3|4-7')."""
    spec = envs.VLLM_CPU_OMP_THREADS_BIND
    if spec == "nobind":
        return [None] * world_size
    if spec != "auto":
        ranks = spec.split("|")
        if len(ranks) != world_size:
            raise ValueError(
                f"VLLM_CPU_OMP_THREADS_BIND={spec!r} names {len(ranks)} ranks, the engine has "
                f"{world_size}; give one CPU list per rank, separated by '|'."
            )
        return [_parse_cpu_list(r) for r in ranks]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < world_size:  # more ranks than CPUs: ranks share them round-robin
        return [[cpus[r % len(cpus)]] for r in range(world_size)]
    per_rank = len(cpus) // world_size
    return [cpus[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]


def _parse_cpu_list(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_callables_allowed(method: Any, args: tuple, kwargs: dict[str, Any] | None) -> None:
    """Code sent to worker processes runs there unchecked: as in vLLM, a callable (the method
    itself, or an argument such as apply_model's function) needs
    VLLM_ALLOW_INSECURE_SERIALIZATION=1. Methods called by name need nothing."""
    values = [method, *args, *(kwargs or {}).values()]
    if envs.VLLM_ALLOW_INSECURE_SERIALIZATION or not any(
        callable(v) and not isinstance(v, str | type) for v in values
    ):
        return
    raise ValueError(
        "collective_rpc / apply_model with a callable sends pickled code to the worker "
        "processes, which pagedlm (like vLLM) only does when you opt in: set "
        "VLLM_ALLOW_INSECURE_SERIALIZATION=1, or call a Worker method by name."
    )


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C waits until the block is done (the pipes' bookkeeping stays whole), then acts as
    it would have; the wait for replies outside it stays interruptible. Only the main thread
    runs signal handlers, so only there is anything to defer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    frames: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: frames.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if frames and callable(previous):
            previous(signal.SIGINT, frames[0])
        elif frames and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def worker_start_method() -> str:
    """VLLM_WORKER_MULTIPROC_METHOD when set (fork, spawn or forkserver), else spawn: forking
    a process whose OpenMP threads have run can hang the child (GNU libgomp), and a spawned
    worker never re-runs the user's script (`_hidden_main`), so none needs an
    `if __name__ == "__main__":` guard."""
    method = envs.VLLM_WORKER_MULTIPROC_METHOD or "spawn"
    if method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"VLLM_WORKER_MULTIPROC_METHOD={method!r}: use fork, spawn or forkserver.")
    return method


@contextlib.contextmanager
def _hidden_main() -> Iterator[None]:
    """While worker processes start, the main module shows neither a file nor a module name,
    so spawn does not import it in the child (which would run a script's module-level
    `LLM(...)` again): a worker needs nothing from it, callables travel by value."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (no orphaned workers)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pack_error(error: BaseException) -> bytes:
    text = "".join(traceback.format_exception(error))
    try:
        return cloudpickle.dumps((error, text))
    except Exception:
        return cloudpickle.dumps((RuntimeError(f"{type(error).__name__}: {error}"), text))


def _worker_main(
    conn: Connection,
    vllm_config: VllmConfig,
    rank: int,
    init_method: str,
    cpu_ids: list[int] | None,
) -> None:
    """Entry point of a worker process: build the Worker, then serve calls until shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    from pagedlm.worker.worker import Worker

    try:
        worker = Worker(
            vllm_config, rank=rank, distributed_init_method=init_method, cpu_ids=cpu_ids
        )
        worker.init_device()
        worker.load_model()
    except BaseException as e:
        conn.send_bytes(cloudpickle.dumps(("error", _pack_error(e), False)))
        return
    conn.send_bytes(cloudpickle.dumps(("ok", None, False)))
    while True:
        try:
            method, args, kwargs = cloudpickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine is gone
            return
        if method == _SHUTDOWN:
            return
        try:
            result = run_method(worker, method, args, kwargs)
            reply = cloudpickle.dumps(("ok", result, worker.take_weights_changed()))
        except BaseException as e:
            reply = cloudpickle.dumps(("error", _pack_error(e), worker.take_weights_changed()))
        conn.send_bytes(reply)


def _stop_workers(processes: list[mp.Process], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(cloudpickle.dumps((_SHUTDOWN, (), {})))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(2)
        if p.is_alive():
            p.kill()
            p.join(1)
    for conn in conns:
        conn.close()


# Calls that leave the workers as a fresh start would (after the engine's start-up), and calls
# whose effect a restart replays in order; any other call (weight updates, sleep, profiling,
# callables) makes the workers' state unreproducible, and a rank failure then ends the engine.
_STATELESS_CALLS = frozenset(
    {
        "execute_model", "reset_requests", "get_kv_cache_bytes_per_block",
        "determine_available_memory", "check_health",
        "check_weights_present", "list_loras", "check_can_sleep",
    }
)  # fmt: skip
_REPLAYED_CALLS = frozenset({"initialize_kv_cache", "add_lora", "remove_lora", "pin_lora"})


class MultiprocExecutor(Executor):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self._replayed: list[tuple[str, tuple, dict[str, Any]]] = []  # in call order
        self._unrestartable_by: str | None = None  # the call that made restarts unsafe
        self._start_workers()

    def _start_workers(self) -> None:
        world = self.parallel_config.world_size
        vllm_config = self.vllm_config
        ctx = mp.get_context(worker_start_method())
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.processes: list[mp.Process] = []
        self.conns: list[Connection] = []
        for rank, cpu_ids in enumerate(resolve_cpu_binding(world)):
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(
                target=_worker_main,
                args=(child_conn, vllm_config, rank, init_method, cpu_ids),
                name=f"pagedlm-worker-{rank}",
                daemon=True,
            )
            with _hidden_main():
                process.start()
            child_conn.close()
            self.processes.append(process)
            self.conns.append(parent_conn)
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.conns)
        self._pending = [1] * world  # the "ready" reply
        try:
            self._collect("init", envs.PAGEDLM_WORKER_START_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d worker processes ready", world)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if self.is_failed:
            raise WorkerDiedError("A worker process died earlier; create a new LLM.")
        check_callables_allowed(method, args, kwargs)
        self._drain()
        self._note_state_change(method, args, kwargs or {})
        self._send(method, args, kwargs or {})
        return self._collect(method, timeout)

    def _send(self, method: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        payload = cloudpickle.dumps((method, args, kwargs))
        with _sigint_deferred():  # a message and its count go together
            for rank, conn in enumerate(self.conns):
                conn.send_bytes(payload)
                self._pending[rank] += 1

    def _collect(self, method: str | Callable[..., Any], timeout: float | None) -> list[Any]:
        """Every rank's reply (of the ranks owing one), waited for together: the first error is
        raised as soon as the other ranks have answered, or once they have not within
        PAGEDLM_RANK_FAILURE_GRACE s (`_abandon_stuck_ranks`)."""
        ranks = [r for r, n in enumerate(self._pending) if n > 0]  # all, but when draining
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: dict[int, tuple[str, Any]] = {}
        error: tuple[int, BaseException] | None = None
        while len(replies) < len(ranks):
            missing = [r for r in ranks if r not in replies]
            rank, reply = self._recv_any(missing, deadline, method)
            if rank is None:
                if error is not None:
                    self._abandon_stuck_ranks(error, len(missing))
                raise TimeoutError(
                    f"collective_rpc({method!r}) got no reply from worker ranks {missing} within "
                    "the timeout"
                )
            replies[rank] = reply
            status, value, weights_changed = reply
            self._weights_changed = self._weights_changed or weights_changed
            if status == "error" and error is None:
                exc, text = cloudpickle.loads(value)
                if hasattr(exc, "add_note"):
                    exc.add_note(f"Worker traceback:\n{text}")
                error = (rank, note_rank(exc, rank, method))
                grace = time.monotonic() + envs.PAGEDLM_RANK_FAILURE_GRACE
                deadline = grace if deadline is None else min(deadline, grace)
        if error is not None:
            raise error[1]
        return [replies[rank][1] for rank in ranks]

    def _recv_any(
        self, ranks: list[int], deadline: float | None, method: Any
    ) -> tuple[int | None, tuple[str, Any]]:
        """The next reply of any of `ranks` (None at the deadline); meanwhile any worker's
        death raises WorkerDiedError."""
        conns = {self.conns[r]: r for r in ranks}
        sentinels = {p.sentinel: r for r, p in enumerate(self.processes)}
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait([*conns, *sentinels], timeout=remaining)
        for conn in ready:
            if conn in conns:
                rank = conns[conn]
                try:
                    with _sigint_deferred():  # never half a message, never a reply uncounted
                        reply = cloudpickle.loads(conn.recv_bytes())
                        self._pending[rank] -= 1
                except (EOFError, OSError):
                    self._fail(rank, method)
                return rank, reply
        dead = [sentinels[s] for s in ready if s in sentinels]
        if dead:
            self._fail(dead[0], method)
        return None, ("", None, False)

    def _note_state_change(self, method: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """Record what a restart must replay, or the first call it could not reproduce."""
        if not isinstance(method, str):
            self._unrestartable_by = self._unrestartable_by or "a callable"
        elif method in _STATELESS_CALLS:
            return
        elif method in _REPLAYED_CALLS:
            self._replayed.append((method, args, kwargs))
        elif self._unrestartable_by is None:
            self._unrestartable_by = method

    def _abandon_stuck_ranks(self, error: tuple[int, BaseException], num_stuck: int) -> None:
        """Ranks wait inside a collective for a failed one: stop every worker, then start them
        anew (the model reloaded, the replayed calls run again) where nothing else changed
        their state; else the engine is done. Raises the failed rank's error either way."""
        rank, exc = error
        why = (
            f"{num_stuck} other rank(s) did not answer within {envs.PAGEDLM_RANK_FAILURE_GRACE} "
            f"s after rank {rank} failed (they wait for it inside a collective)"
        )
        self._pending = [0] * len(self.conns)
        self.shutdown()
        if self._unrestartable_by is None:
            logger.warning("%s: restarting the worker processes", why)
            try:
                self._start_workers()
                for method, args, kwargs in self._replayed:
                    self._send(method, args, kwargs)
                    self._collect(method, None)
            except BaseException as restart_error:
                self.is_failed = True
                self.shutdown()
                raise WorkerDiedError(f"{why}; restarting the workers failed.") from restart_error
            note = f"{why}, so the workers were restarted; the engine goes on."
        else:
            self.is_failed = True
            note = (
                f"{why}, so the workers were stopped; they cannot be restarted as they were "
                f"({self._unrestartable_by!r} changed their state since start): create a new LLM."
            )
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        raise exc

    def _fail(self, rank: int, method: Any) -> None:
        process = self.processes[rank]
        process.join(1)
        self.is_failed = True
        self.shutdown()
        raise WorkerDiedError(
            f"Worker rank {rank} died unexpectedly (exit code {process.exitcode}) during "
            f"{method!r}; the engine cannot continue. Check its log above (out of memory?)."
        )

    def _drain(self) -> None:
        """Discard replies left behind by an earlier call that timed out or was interrupted."""
        while any(self._pending) and not self.is_failed:
            try:
                self._collect("an earlier call", None)
            except WorkerDiedError:
                raise
            except Exception as e:  # that call's error was never delivered
                logger.warning("An interrupted call failed on a worker: %s", e)
        if self.is_failed:
            raise WorkerDiedError("The workers were stopped after a failure; create a new LLM.")

    def shutdown(self) -> None:
        self._finalizer()
