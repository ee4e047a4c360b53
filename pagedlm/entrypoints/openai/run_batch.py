"""`pagedlm run-batch -i requests.jsonl -o results.jsonl [--resume] [engine options]`.

Runs a file in the OpenAI batch format (one `{"custom_id", "method", "url", "body"}` per line)
as `vllm run-batch` does, writing one result line per input line: `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`. A line that cannot run (bad JSON,
missing field, unknown url, invalid parameter, prompt too long, duplicate custom_id) gets an
error record, status 400 with `"error": {"code": 400, "message", "line"}` (`line`: its 1-based
line number in the input), and the job goes on. Nothing is lost:
- The input is streamed: at most 4 * max_num_seqs requests wait in the engine.
- Each result is written when its request finishes (so in completion order, not input order) by
  ONE write() of the whole line, then flushed; fsync every 100 lines or every second.
- Ctrl-C lets the current engine step finish, writes its results and exits with 130 (a second
  Ctrl-C stops at once; a half-written line is cut off).
- --resume keeps the complete valid JSON lines of the output (cuts off a partial last line, drops
  corrupt ones) and skips the input lines already answered, by custom_id or, for error records,
  by `line`. Failed lines are not retried (delete their records to retry). Same input expected.
- Duplicate custom_ids: the first line runs, each later one gets a "duplicate custom_id" error.
Exit status: 0 if every line succeeded (lines kept by --resume included), 1 if any failed, 130 if
interrupted. The summary line and the progress bar go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from pagedlm.engine.arg_utils import EngineArgs, FlexibleArgumentParser
from pagedlm.entrypoints.openai.protocol import URL_HANDLERS, RequestError, ServingContext
from pagedlm.outputs import PoolingRequestOutput

_SYNC_LINES, _SYNC_S = 100, 1.0  # fsync the output at least this often
_SEP = (",", ":")
_SHOWN_ERRORS = 20  # failed lines echoed to stderr
_QUEUE_FACTOR = 4  # requests queued in the engine per max_num_seqs


def _hex() -> str:
    return uuid.uuid4().hex


def _failed_in_step(output: Any) -> bool:
    """A request the engine finished with an error (finish_reason "error"; a pooled output
    without data)."""
    if isinstance(output, PoolingRequestOutput):
        return output.outputs.data is None
    return any(c.finish_reason == "error" for c in output.outputs)


def _record(custom_id: str | None, status: int, request_id: str, body: Any, error: Any) -> dict:
    return {
        "id": f"batch_req_{_hex()}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


class ResultWriter:
    """Appends whole JSON lines to a file (or stdout): one write() per line, then flush; fsync
    every 100 lines or every second. An interrupted write is cut back to the last whole line."""

    def __init__(self, path: str, append: bool) -> None:
        self.is_stdout = path == "-"
        mode = "ab" if append else "wb"
        self.file: Any = sys.stdout.buffer if self.is_stdout else open(path, mode, buffering=0)
        self.committed = 0 if self.is_stdout else os.fstat(self.file.fileno()).st_size
        self.unsynced, self.last_sync = 0, time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        try:
            data = (json.dumps(record, ensure_ascii=False, separators=_SEP) + "\n").encode()
        except UnicodeEncodeError:  # a lone surrogate (a \ud800 escape in the input): escape all
            data = (json.dumps(record, separators=_SEP) + "\n").encode()
        try:
            rest = memoryview(data)
            while rest:  # one write() for a regular file; the loop only guards short writes
                rest = rest[self.file.write(rest) :]
            self.file.flush()
        except BaseException:
            if not self.is_stdout:
                os.ftruncate(self.file.fileno(), self.committed)
            raise
        self.committed += len(data)
        self.unsynced += 1
        self.sync(force=False)

    def sync(self, force: bool = True) -> None:
        """fsync if forced, or if 100 lines or a second have passed since the last time."""
        elapsed = time.monotonic() - self.last_sync
        if self.unsynced and (force or self.unsynced >= _SYNC_LINES or elapsed >= _SYNC_S):
            if not self.is_stdout:
                os.fsync(self.file.fileno())
            self.unsynced, self.last_sync = 0, time.monotonic()

    def close(self) -> None:
        self.sync()
        self.file.flush() if self.is_stdout else self.file.close()


@dataclass
class ResumeState:
    """What an existing output already answers."""

    done_ids: set[str] = field(default_factory=set)  # custom_ids with a successful result
    done_lines: set[int] = field(default_factory=set)  # input lines with an error record
    kept: int = 0
    failed: int = 0

    def add(self, record: dict[str, Any]) -> None:
        self.kept += 1
        error, custom_id = record.get("error"), record.get("custom_id")
        ok = error is None and (record.get("response") or {}).get("status_code", 200) == 200
        self.failed += not ok
        if not ok and isinstance(error, dict) and isinstance(error.get("line"), int):
            self.done_lines.add(error["line"])
        elif isinstance(custom_id, str):
            self.done_ids.add(custom_id)


def _parse_record(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "custom_id" in record else None


def load_existing_output(path: str) -> ResumeState:
    """Read an earlier run's output, repairing it in place: a partial last line (the process died
    while writing it) is cut off; other lines that are not result objects are dropped."""
    state, good_end, bad = ResumeState(), 0, 0
    if not os.path.exists(path):
        return state
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            record = _parse_record(raw)
            if record is not None:
                state.add(record)
            bad += record is None and bool(raw.strip())
            good_end += len(raw)
    if bad:
        print(f"--resume: dropping {bad} corrupt line(s) of {path}", file=sys.stderr)
        with open(path, "rb") as src, open(f"{path}.resume-tmp", "wb") as dst:
            dst.writelines(r for r in src if r.endswith(b"\n") and _parse_record(r) is not None)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(f"{path}.resume-tmp", path)
    elif good_end != os.path.getsize(path):
        print(f"--resume: cutting off a partial last line of {path}", file=sys.stderr)
        os.truncate(path, good_end)
    return state


class _InterruptFlag:
    """First Ctrl-C: stop after the current engine step. Second: KeyboardInterrupt at once."""

    requested, previous = False, None

    def __enter__(self) -> _InterruptFlag:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write("Interrupted: stopping after this step (Ctrl-C again: at once)", file=sys.stderr)


@dataclass
class _Stats:
    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    start: float = field(default_factory=time.monotonic)

    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(time.monotonic() - self.start, 1e-9)


class BatchRunner:
    """Feeds the engine from the input lines and writes each result as it finishes."""

    def __init__(self, ctx: ServingContext, writer: ResultWriter, resume: ResumeState) -> None:
        self.ctx, self.engine, self.writer, self.resume = ctx, ctx.engine, writer, resume
        self.max_queued = _QUEUE_FACTOR * self.engine.vllm_config.scheduler_config.max_num_seqs
        self.pending: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {}
        self.first_line: dict[str, int] = {}  # custom_id -> the line that runs it
        self.stats, self.progress = _Stats(), None

    def run(self, lines: Iterator[tuple[int, bytes]]) -> bool:
        """Process every line; False if interrupted (everything finished is on disk)."""
        exhausted = False
        with _InterruptFlag() as interrupt:
            try:
                while True:
                    while len(self.pending) < self.max_queued and not interrupt.requested:
                        item = next(lines, None)
                        if item is None:
                            exhausted = True
                            break
                        self.handle_line(*item)
                    if exhausted and not self.pending:  # every line read and answered
                        return True
                    if interrupt.requested:
                        return False
                    for output in self.engine.step():
                        if output.finished:
                            self.finish(output)
                    self.writer.sync(force=False)
            except KeyboardInterrupt:
                return False
            finally:
                if self.pending:
                    self.engine.abort_request(list(self.pending))

    def handle_line(self, lineno: int, raw: bytes) -> None:
        custom_id = None
        try:
            try:
                request = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise RequestError(f"The line is not valid UTF-8: {e}") from e
            except json.JSONDecodeError as e:
                raise RequestError(f"Not valid JSON: {e.msg} at column {e.colno}.") from e
            if not isinstance(request, dict):
                raise RequestError("The line must be a JSON object (custom_id, method, url, body).")
            custom_id = request.get("custom_id")
            if not isinstance(custom_id, str):
                got, custom_id = json.dumps(custom_id), None
                raise RequestError(f"'custom_id' must be a string, got {got}.")
            first = self.first_line.setdefault(custom_id, lineno)
            if first == lineno and custom_id in self.resume.done_ids:
                return self._advance()  # answered by an earlier run
            if first != lineno and lineno not in self.resume.done_lines:
                raise RequestError(
                    f"duplicate custom_id {custom_id!r}: line {first} already uses it, and "
                    "custom_ids must be unique (only the first line is run)."
                )
            if lineno not in self.resume.done_lines:
                self._submit(request, custom_id)
                return
        except RequestError as e:
            if lineno not in self.resume.done_lines:
                return self.fail(custom_id, lineno, str(e))
        self._advance()  # an error record from an earlier run answers this line

    def _submit(self, request: dict[str, Any], custom_id: str) -> None:
        if request.get("method") != "POST":
            method = json.dumps(request.get("method"))
            raise RequestError(f"'method' must be \"POST\", got {method}.")
        url = request.get("url")
        handler = URL_HANDLERS.get(url) if isinstance(url, str) else None
        if handler is None:
            supported = ", ".join(URL_HANDLERS)
            raise RequestError(f"Unsupported url {json.dumps(url)}; supported: {supported}.")
        body = request.get("body")
        if not isinstance(body, dict):
            raise RequestError(f"'body' must be a JSON object, got {json.dumps(body)[:60]}.")
        prepared = handler(body, self.ctx)
        request_id = _hex()
        try:
            self.engine.add_request(request_id, prepared.prompt, prepared.params)
        except (ValueError, TypeError, NotImplementedError, OverflowError) as e:
            raise RequestError(str(e)) from e
        self.pending[request_id] = (custom_id, prepared.make_body)

    def finish(self, output: Any) -> None:
        if _failed_in_step(output):
            custom_id, _ = self.pending.pop(output.request_id)
            cause = self.engine.last_step_error
            error = {"code": 500, "message": f"The request failed in a model step: {cause}"}
            self.writer.write(_record(custom_id, 500, output.request_id, None, error))
            self.stats.failed += 1
            self._advance()
            return
        custom_id, make_body = self.pending.pop(output.request_id)
        body = make_body(output)
        self.writer.write(_record(custom_id, 200, output.request_id, body, None))
        self.stats.ok += 1
        self.stats.prompt_tokens += body["usage"]["prompt_tokens"]
        self.stats.completion_tokens += body["usage"].get("completion_tokens", 0)  # 0: embeddings
        self._advance()

    def fail(self, custom_id: str | None, lineno: int, message: str) -> None:
        error = {"code": 400, "message": message, "line": lineno}
        self.writer.write(_record(custom_id, 400, _hex(), None, error))
        self.stats.failed += 1
        if self.stats.failed <= _SHOWN_ERRORS:
            shown = "" if custom_id is None else f" (custom_id {custom_id!r})"
            more = " (no more failures shown)" if self.stats.failed == _SHOWN_ERRORS else ""
            tqdm.write(f"line {lineno}{shown}: {message}{more}", file=sys.stderr)
        self._advance()

    def _advance(self) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(f"{self.stats.tokens_per_s():.1f} tok/s", refresh=False)
            self.progress.update(1)


# ---------------------------------------------------------------------- command
_DESCRIPTION = "Run an OpenAI batch file (JSONL) offline, like `vllm run-batch`."


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("-i", "--input-file", required=True, help="JSONL requests, - for stdin.")
    parser.add_argument("-o", "--output-file", required=True, help="JSONL results, - for stdout.")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="Continue an interrupted run: keep the results in the output file and run only the "
        "input lines that have none.",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="No progress bar (none if stderr is no tty)."
    )
    return EngineArgs.add_cli_args(parser)


def register_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run-batch",
        help="Run a file of OpenAI batch requests (chat, completions, embeddings).",
        description=_DESCRIPTION,
    )
    parser.set_defaults(func=run_batch)
    return add_cli_args(parser)


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def run_batch(args: argparse.Namespace) -> int:
    def error(message: str) -> int:
        print(f"pagedlm run-batch: error: {message}", file=sys.stderr)
        return 2

    if args.resume and args.output_file == "-":
        return error("--resume needs an output file, not stdout")
    try:
        stream = sys.stdin.buffer if args.input_file == "-" else open(args.input_file, "rb")
    except OSError as e:
        return error(f"cannot read the input file: {e}")
    progress, completed = None, False
    try:
        resume = load_existing_output(args.output_file) if args.resume else ResumeState()
        from pagedlm.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
        writer = ResultWriter(args.output_file, append=args.resume)
        served = args.served_model_name or args.model
        served = served[0] if isinstance(served, list) else served
        runner = BatchRunner(ServingContext(engine, served), writer, resume)
        if not args.no_progress and sys.stderr.isatty():
            total = _count_lines(args.input_file)
            progress = tqdm(total=total, desc="Running batch", unit="req", file=sys.stderr)
            runner.progress = progress
        try:
            completed = runner.run((n, raw) for n, raw in enumerate(stream, 1) if raw.strip())
        finally:
            writer.close()
    except KeyboardInterrupt:  # while loading: nothing was written yet
        print("Interrupted before any request ran.", file=sys.stderr)
        return 130
    finally:
        if progress is not None:
            progress.close()
        if stream is not sys.stdin.buffer:
            stream.close()
    s = runner.stats
    summary = (
        f"ok {s.ok}, failed {s.failed}, prompt tokens {s.prompt_tokens}, "
        f"completion tokens {s.completion_tokens}, {s.tokens_per_s():.1f} tok/s"
    )
    if args.resume:
        summary += f" (and {resume.kept} results kept from earlier runs, {resume.failed} failed)"
    print(summary, file=sys.stderr)
    if not completed:
        where = "stdout" if args.output_file == "-" else args.output_file
        print(
            f"Interrupted: the {s.ok + s.failed} results of this run are saved in {where}. "
            "Rerun the same command with --resume to run the remaining lines.",
            file=sys.stderr,
        )
        return 130
    return 1 if s.failed or resume.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = FlexibleArgumentParser(prog="pagedlm run-batch", description=_DESCRIPTION)
    return run_batch(add_cli_args(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
