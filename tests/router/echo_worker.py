"""``EchoWorker``: a test stand-in for the worker actor that needs no model (tests only)."""

from __future__ import annotations

import asyncio
import time

import ray

from pdserve.decode_worker.messages import RequestDelta, WorkerRequest, WorkerStats

MAX_MODEL_LEN = 2048
VOCAB = 49152
EOS = 2
REJECT_TOKEN = VOCAB - 1  # a prompt that starts with it is refused by add_request (a worker's own check)


@ray.remote(num_cpus=0)
class EchoWorker:
    """Test stand-in for a worker actor: output token k is prompt token k (cyclically).

    Finishes with "stop" on EOS (unless ignore_eos) or a stop token id, with "length" at
    max_tokens. Every step (``step_s``) emits one token for every running request, and
    ``next_outputs`` returns all deltas since the previous call, like the real worker.
    """

    def __init__(self, name: str, step_s: float = 0.004, total_blocks: int = 1024):
        self.name = name
        self.step_s = step_s
        self.total_blocks = total_blocks
        self.running: dict[str, dict] = {}
        self.received: list[WorkerRequest] = []
        self.aborted: list[str] = []
        self.outbox: list[RequestDelta] = []
        self.ready = asyncio.Event()
        self.loop_task = None

    async def add_request(self, req: WorkerRequest) -> None:
        if req.prompt_token_ids[0] == REJECT_TOKEN:
            raise ValueError("the echo worker refuses prompts that start with REJECT_TOKEN")
        self.received.append(req)
        self.running[req.request_id] = {"req": req, "n": 0, "t0": time.monotonic()}
        if self.loop_task is None:
            self.loop_task = asyncio.get_running_loop().create_task(self._steps())

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if self.running.pop(request_id, None) is not None:
            self._emit(RequestDelta(request_id, [], finish_reason="abort"))

    async def next_outputs(self) -> list[RequestDelta]:
        await self.ready.wait()
        self.ready.clear()
        out, self.outbox = self.outbox, []
        return out

    async def stats(self) -> WorkerStats:
        used = sum(1 for _ in self.running)
        return WorkerStats(self.name, "colocated", len(self.running), 0, 0,
                           self.total_blocks - used, self.total_blocks, 16)

    async def model_info(self) -> dict:
        return {"model": "echo", "max_model_len": MAX_MODEL_LEN, "vocab_size": VOCAB,
                "eos_token_ids": [EOS]}

    async def log(self) -> tuple[list[WorkerRequest], list[str]]:
        return self.received, self.aborted

    def _emit(self, delta: RequestDelta) -> None:
        self.outbox.append(delta)
        self.ready.set()

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for rid, st in list(self.running.items()):
                req: WorkerRequest = st["req"]
                p = req.params
                token = req.prompt_token_ids[st["n"] % len(req.prompt_token_ids)]
                st["n"] += 1
                finish = None
                if token in p.stop_token_ids or (token == EOS and not p.ignore_eos):
                    finish = "stop"
                elif st["n"] >= p.max_tokens:
                    finish = "length"
                delta = RequestDelta(rid, [token], logprobs=[-0.5] if p.logprobs else None,
                                     finish_reason=finish)
                if finish:
                    del self.running[rid]
                    delta.num_prompt_tokens = len(req.prompt_token_ids)
                    delta.num_output_tokens = st["n"]
                    delta.timings = {"queued": 0.001, "prefill": 0.002,
                                     "decode": time.monotonic() - st["t0"]}
                self._emit(delta)
