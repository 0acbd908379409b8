"""The model runner's lifecycle: what ``EngineCore`` calls, in this order (typing Protocols; imports no torch).

1. ``runner_factory(config)`` builds the runner, which loads the weights (``weights_bytes``);
2. ``precompile()`` (GPU only) compiles every kernel variant before the first real launch; the summary or None;
3. ``determine_num_blocks()`` sizes the KV pool (GPU: profiles a forward at the token budget) in blocks of
   ``block_bytes``; it raises ``ConfigError`` when one max-model-len sequence does not fit;
4. ``initialize_kv_cache(num_blocks)`` allocates the pool (``kv_cache_bytes`` in all);
5. ``capture_graphs()`` (GPU, unless --enforce-eager) records the decode (and, with --speculative-config, verify)
   CUDA graphs over that pool;
6. ``initialize_host_tier()`` (with --kv-offloading-size) allocates the host KV tier and returns its blocks;
then once per step ``execute(sched)``, which is ``submit(sched).result()``; with async scheduling the core
submits step n+1 before it reads step n's ``result()``.
Which stages run is the core's decision (device and options); a runner does what it is asked. ``ModelRunner``
(runner/model_runner.py) is the real one; test doubles implement the same members.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from onecard.runner.step_io import RunnerOutput, SchedulerOutput


class PendingStep(Protocol):
    """A submitted step; ``result()`` waits for its sampled ids (the step's one host sync) and returns them."""

    def result(self) -> RunnerOutput: ...


class Runner(Protocol):
    """The stages of a model runner, in the order the engine core calls them (see the module docstring)."""

    weights_bytes: int
    device_name: str | None                  # the GPU's name (the speculative cost model reads it); None off a GPU

    @property
    def block_bytes(self) -> int: ...        # one KV block, all layers, K and V

    @property
    def kv_cache_bytes(self) -> int: ...     # the allocated pool (0 before initialize_kv_cache)

    def precompile(self) -> dict | None: ...

    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def capture_graphs(self) -> None: ...

    def initialize_host_tier(self) -> int: ...

    def submit(self, sched: SchedulerOutput) -> PendingStep: ...

    def execute(self, sched: SchedulerOutput) -> RunnerOutput: ...
