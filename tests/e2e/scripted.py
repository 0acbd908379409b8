"""A scripted token source behind the real engine interface, for driving exact texts through the server.

``ScriptedRunner`` stands in for the model runner inside the real ``EngineCore`` (real scheduler, KV-cache
manager, aborts, stats); it "samples" the token ids of a scripted reply: the first trigger substring found in
the decoded prompt picks the reply, else the default one. Once a reply is used up it emits EOS (or keeps
repeating its last token when the request ignores EOS). ``ScriptedCoreClient`` is the lead's
``ThreadCoreClient`` with that runner plugged in, so everything from ``add_request`` on is the real code.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from onecard.config import EngineConfig
from onecard.frontend import core_client as cc
from onecard.protocol import TokenLogprobs
from onecard.runner.step_io import RunnerOutput, SchedulerOutput


@dataclass
class Script:
    tokenizer: object
    default: str = "Hello there, friend."
    replies: list[tuple[str, str]] = field(default_factory=list)

    def reply_ids(self, prompt_ids: list[int]) -> list[int]:
        prompt = self.tokenizer.decode(prompt_ids)
        for trigger, reply in self.replies:
            if trigger in prompt:
                return list(self.tokenizer.encode(reply, add_special_tokens=False))
        return list(self.tokenizer.encode(self.default, add_special_tokens=False))


@dataclass(slots=True)
class _Done:
    """A step whose output is already on the host (a PendingStep without torch)."""

    output: RunnerOutput

    def result(self) -> RunnerOutput:
        return self.output


class ScriptedRunner:
    weights_bytes = 1 << 20
    device_name = None

    def __init__(self, config: EngineConfig, script: Script, num_blocks: int = 64, gate: threading.Event | None = None):
        self.config = config
        self.script = script
        self.num_blocks = num_blocks
        self.eos = config.model.eos_token_ids[0]
        self.gate = gate                          # start-up waits on it (tests of 503 while loading)
        self._replies: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}   # request id → the prompt ids the engine was given
        self.steps = 0
        # Tests of mid-stream behaviour: once a request has `hold_after` outputs, steps wait for `release`.
        self.hold_after: int | None = None
        self.release = threading.Event()
        self.step_delay = 0.0                     # seconds per step (long streams in process tests)

    # the runner lifecycle (onecard/runner/lifecycle.py): no kernels, no graphs, no host tier
    def precompile(self) -> None:
        return None

    def determine_num_blocks(self) -> int:
        if self.gate is not None:
            self.gate.wait(30)
        return self.num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def capture_graphs(self) -> None:
        return None

    def initialize_host_tier(self) -> int:
        return 0

    @property
    def block_bytes(self) -> int:
        return self.config.cache.block_size * 64

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def submit(self, sched: SchedulerOutput) -> _Done:
        return _Done(self.execute(sched))

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        if self.step_delay and sched.scheduled:
            time.sleep(self.step_delay)
        if self.hold_after is not None and any(s.request.num_output_tokens >= self.hold_after
                                               for s in sched.scheduled):
            self.release.wait(30)
        for rid in sched.finished_request_ids | sched.preempted_request_ids:
            self._replies.pop(rid, None)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        for s in sched.scheduled:
            if not s.samples:
                continue
            req = s.request
            self.prompts[req.request_id] = list(req.prompt_token_ids)
            reply = self._replies.setdefault(req.request_id, self.script.reply_ids(req.prompt_token_ids))
            k = req.num_output_tokens
            if k < len(reply):
                tok = reply[k]
            else:
                tok = reply[-1] if req.sampling_params.ignore_eos and reply else self.eos
            sampled[req.request_id] = tok
            if req.sampling_params.logprobs is not None:
                alt = (tok + 1) % 100 + 3
                logprobs[req.request_id] = TokenLogprobs(token_id=tok, logprob=-0.25, rank=1,
                                                         top={tok: -0.25, alt: -1.5})
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)


class ScriptedCoreClient(cc.ThreadCoreClient):
    def __init__(self, config: EngineConfig, script: Script, gate: threading.Event | None = None,
                 num_blocks: int = 64):
        super().__init__(config)
        self.runner = ScriptedRunner(config, script, num_blocks=num_blocks, gate=gate)

    def _core_factory(self, config: EngineConfig):
        """The real engine loop runs over a real EngineCore whose runner is our scripted one."""
        from onecard.core.engine_core import EngineCore

        self.engine_core = EngineCore(config, runner_factory=lambda _c: self.runner)
        return self.engine_core


@dataclass
class FixedReply:
    """A Script that needs no tokenizer: every prompt gets the same reply ids (for process B in tests)."""

    ids: list[int]

    def reply_ids(self, prompt_ids: list[int]) -> list[int]:
        return list(self.ids)


def scripted_process_core(config: EngineConfig, *, reply_ids: list[int], step_delay: float = 0.0):
    """A core factory for ``ProcessCoreClient(core_factory=functools.partial(scripted_process_core, ...))``:
    the real EngineCore over a ScriptedRunner, built inside process B (so tests can kill a real process).
    No tokenizer is loaded in B (transformers would pull in torch: seconds of start-up on a busy box)."""
    from onecard.core.engine_core import EngineCore

    runner = ScriptedRunner(config, FixedReply(reply_ids))
    runner.step_delay = step_delay
    return EngineCore(config, runner_factory=lambda _c: runner)
