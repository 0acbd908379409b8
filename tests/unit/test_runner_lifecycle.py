"""The runner lifecycle protocol (onecard/runner/lifecycle.py) and how EngineCore drives it.

The real ``ModelRunner`` and the tests' scripted runner carry every member of the protocol with compatible
signatures (read with ``inspect``: no model is loaded); the engine core calls the stages in the documented order,
each one exactly when the device and options ask for it (GPU: precompile and graphs, --enforce-eager: no graphs,
--kv-offloading-size: the host tier), and with async scheduling it submits steps rather than executing them;
process B's loop (core/engine_loop.py) drives that core from its messages.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from onecard.config import EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.protocol import EngineRequest
from onecard.runner.lifecycle import Runner
from onecard.runner.step_io import RunnerOutput
from onecard.sampling_params import SamplingParams
from tests.e2e.scripted import ScriptedRunner

MODEL = "onecard/data/onecard-tiny-coder"


def _members(proto: type) -> dict[str, object]:
    return {n: v for n, v in vars(proto).items() if not n.startswith("_")} | dict.fromkeys(proto.__annotations__)


@pytest.mark.parametrize("cls", [pytest.param("ModelRunner", id="ModelRunner"), ScriptedRunner])
def test_runners_implement_every_stage(cls):
    if cls == "ModelRunner":
        from onecard.runner.model_runner import ModelRunner as cls
    members = _members(Runner)
    assert {"precompile", "determine_num_blocks", "initialize_kv_cache", "capture_graphs", "initialize_host_tier",
            "submit", "execute", "block_bytes", "kv_cache_bytes", "weights_bytes"} <= set(members)
    for name, want in members.items():
        if want is None:                                     # a data attribute (set in __init__): read the source
            assert f"self.{name} =" in inspect.getsource(cls) or hasattr(cls, name), (cls, name)
            continue
        have = getattr(cls, name, None)
        assert have is not None, (cls, name)
        if isinstance(want, property):
            assert isinstance(have, property), (cls, name)
            continue
        want_params = list(inspect.signature(want).parameters.values())
        have_params = list(inspect.signature(have).parameters.values())
        assert [p.name for p in have_params[:len(want_params)]] == [p.name for p in want_params], (cls, name)
        assert all(p.default is not inspect.Parameter.empty for p in have_params[len(want_params):]), (cls, name)


class RecordingRunner:
    """A runner that records the lifecycle calls (the real engine core around it)."""

    weights_bytes = 1 << 20
    device_name = None

    def __init__(self, config):
        self.config = config
        self.calls: list[str] = []
        self.num_blocks = 0

    def precompile(self) -> dict | None:
        self.calls.append("precompile")
        return None

    def determine_num_blocks(self) -> int:
        self.calls.append("determine_num_blocks")
        return 40

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.calls.append(f"initialize_kv_cache({num_blocks})")
        self.num_blocks = num_blocks

    def capture_graphs(self) -> None:
        self.calls.append("capture_graphs")

    def initialize_host_tier(self) -> int:
        self.calls.append("initialize_host_tier")
        return 8

    @property
    def block_bytes(self) -> int:
        return 1024

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def execute(self, sched) -> RunnerOutput:
        self.calls.append("execute")
        return self._sample(sched)

    def submit(self, sched):
        self.calls.append("submit")
        out = self._sample(sched)
        return type("Done", (), {"result": lambda _self: out})()

    def _sample(self, sched) -> RunnerOutput:
        return RunnerOutput(sampled_token_ids={s.request.request_id: 5 for s in sched.scheduled if s.samples})


def _core(device: str = "cpu", enforce_eager: bool = False, **kw) -> EngineCore:
    config = EngineArgs(model=MODEL, device="cpu", max_model_len=128, **kw).create_config()
    # the device is the core's decision input; the recording runner touches no GPU
    config = dataclasses.replace(config, device=device, enforce_eager=enforce_eager)
    return EngineCore(config, runner_factory=RecordingRunner)


@pytest.mark.parametrize(("device", "eager", "kw", "stages"), [
    ("cpu", False, {}, ["determine_num_blocks", "initialize_kv_cache(40)"]),
    ("cuda", False, {}, ["precompile", "determine_num_blocks", "initialize_kv_cache(40)", "capture_graphs"]),
    ("cuda", True, {}, ["precompile", "determine_num_blocks", "initialize_kv_cache(40)"]),
    ("cpu", False, {"kv_offloading_size": 0.001},
     ["determine_num_blocks", "initialize_kv_cache(40)", "initialize_host_tier"]),
])
def test_engine_core_calls_the_stages_in_order(device, eager, kw, stages):
    core = _core(device, eager, **kw)
    assert core.runner.calls == stages
    assert core.info.num_gpu_blocks == 40 and core.info.kv_cache_bytes == 40 * 1024
    assert core.info.num_host_blocks == (8 if kw else 0)
    assert core.scheduler.kv_block_bytes == 1024


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_go_through_execute_or_submit(async_scheduling):
    core = _core(async_scheduling=async_scheduling)
    core.add_request(EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                   sampling_params=SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.0))
    outs = []
    for _ in range(20):
        if not core.has_unfinished():
            break
        outs += core.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == [5, 5, 5] and outs[-1].finish_reason is not None
    steps = [c for c in core.runner.calls if c in ("execute", "submit")]
    assert steps and set(steps) == {"submit" if async_scheduling else "execute"}


def test_engine_loop_admits_steps_aborts_and_stops():
    """Process B's loop (core/engine_loop.py) over the real core: every waiting message is taken before a step,
    a request that cannot be admitted gets its own error output, an abort answers at once, STOP ends it; every
    message B sends is tagged by the protocol's own ``MessageKind`` members (the tags' one home)."""
    from onecard.config import ConfigError
    from onecard.core.engine_loop import run_engine_loop
    from onecard.protocol import Abort, MessageKind

    def request(rid: str, max_tokens: int) -> EngineRequest:
        return EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], arrival_time=0.0,
                             sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    config = EngineArgs(model=MODEL, device="cpu", max_model_len=128).create_config()
    # turn 1 takes a and b, then steps; turn 2 takes the abort, steps (a ends); turn 3 waits idle for "stop"
    inbox = [request("a", 2), request("b", 50), None, Abort(["b"]), None, MessageKind.STOP]
    waits: list[float | None] = []

    def recv(timeout):
        waits.append(timeout)
        return inbox.pop(0)

    sent: list[tuple] = []
    run_engine_loop(config, recv, sent.append, recording_core)
    assert sent[0][0] is MessageKind.READY and sent[0][1].num_gpu_blocks == 40
    outs = [o for m in sent[1:] for o in m[1]]
    a = [t for o in outs if o.request_id == "a" for t in o.new_token_ids]
    assert a == [5, 5]
    b_end = [o for o in outs if o.request_id == "b" and o.finish_reason is not None]
    assert len(b_end) == 1 and b_end[0].finish_reason.name == "ABORT"
    assert [m[0] for m in sent] == [MessageKind.READY, MessageKind.OUT, MessageKind.OUT]   # one OUT per turn
    assert all(type(m[0]) is MessageKind for m in sent)
    assert waits == [None, 0.0, 0.0, 0.0, 0.0, None]                       # blocks only while idle

    def bad_config(_config):
        raise ConfigError("--max-model-len=9 does not fit")

    sent.clear()
    run_engine_loop(config, recv, sent.append, bad_config)
    assert sent == [(MessageKind.ERROR, "--max-model-len=9 does not fit", True)]
    assert sent[0][0] is MessageKind.ERROR


def test_process_a_and_b_speak_the_same_tags():
    """Both ends of the channel, as they run: A's thread client starts B's loop over the real core, is told
    READY (wait_ready returns the core's info), gets its OUT messages as outputs, and its STOP ends B's loop
    (the thread exits); a start-up failure reaches A as ERROR (a ConfigError from wait_ready)."""
    import asyncio

    from onecard.config import ConfigError
    from onecard.frontend.core_client import ThreadCoreClient

    class Client(ThreadCoreClient):
        _core_factory = staticmethod(recording_core)

    config = EngineArgs(model=MODEL, device="cpu", max_model_len=128).create_config()
    client = Client(config)
    client.start()
    assert client.wait_ready(timeout=60).num_gpu_blocks == 40
    client.add_request(EngineRequest(request_id="a", prompt_token_ids=[1, 2, 3], arrival_time=0.0,
                                     sampling_params=SamplingParams(max_tokens=2, ignore_eos=True)))

    async def tokens() -> list[int]:
        got: list[int] = []
        while True:
            for out in await asyncio.wait_for(client.get_outputs(), 60):
                got += out.new_token_ids
                if out.finished:
                    return got

    assert asyncio.run(tokens()) == [5, 5]
    client.shutdown()
    assert client._thread is not None and not client._thread.is_alive()     # STOP was understood
    assert client.dead is None

    def bad_config(_config):
        raise ConfigError("--max-model-len=9 does not fit")

    class Failing(ThreadCoreClient):
        _core_factory = staticmethod(bad_config)

    failing = Failing(config)
    failing.start()
    with pytest.raises(ConfigError, match="--max-model-len=9"):
        failing.wait_ready(timeout=60)



def recording_core(config) -> EngineCore:
    return EngineCore(config, runner_factory=RecordingRunner)
