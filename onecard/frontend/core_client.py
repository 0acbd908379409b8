"""Process A's handle on the engine core (process B, or a thread in --single-process mode).

Contract (``CoreClient``): ``start()`` begins loading in the background and returns at once;
``wait_ready()`` blocks until B has loaded the model (returns ``EngineInfo``) or raises the start-up error;
``add_request`` / ``abort`` never block; ``get_outputs()`` awaits the next list of ``EngineOutput`` (from any
requests); ``stats`` is the latest ``EngineStats``; ``shutdown()`` stops B. One client per engine.
"""
from __future__ import annotations

import abc

from onecard.protocol import EngineInfo, EngineOutput, EngineRequest, EngineStats


class CoreClient(abc.ABC):
    info: EngineInfo | None = None

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def wait_ready(self, timeout: float | None = None) -> EngineInfo: ...

    @property
    @abc.abstractmethod
    def ready(self) -> bool: ...

    @abc.abstractmethod
    def add_request(self, request: EngineRequest) -> None: ...

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    async def get_outputs(self) -> list[EngineOutput]: ...

    @property
    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...
