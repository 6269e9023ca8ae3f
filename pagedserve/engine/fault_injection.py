"""Fault injection for tests: make the real model forward raise, mid-way, in chosen steps.

The forward raises in its last decoder layer, after the earlier layers wrote their K/V into the step's new
blocks: exactly the state a real failure leaves behind. Tests use it to prove that a failed step fails only
its own requests and leaves no trace in the prefix cache.

In-process: `engine.fault_injector = FaultInjector(engine.runner.model, lambda out: ...)`.
For a server process: PAGEDSERVE_FAULT_INJECT_TOKEN=<token id> fails every step that schedules a request
whose prompt contains that token id.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from pagedserve import envs
from pagedserve.core.scheduler import SchedulerOutput



class InjectedFault(RuntimeError):
    """The failure a FaultInjector makes the forward raise."""


class FaultInjector:
    def __init__(self, model: nn.Module, should_fail: Callable[[SchedulerOutput], bool]) -> None:
        self.should_fail = should_fail
        self.num_injected = 0
        self._armed = False
        model.layers[-1].register_forward_pre_hook(self._hook)

    def arm(self, out: SchedulerOutput) -> None:
        """Called by the engine before each forward."""
        self._armed = self.should_fail(out)

    def _hook(self, module: nn.Module, args: tuple) -> None:
        if self._armed:
            self._armed = False
            self.num_injected += 1
            raise InjectedFault("injected fault in the model forward (test hook)")

    @classmethod
    def from_env(cls, model: nn.Module) -> "FaultInjector | None":
        token = envs.PAGEDSERVE_FAULT_INJECT_TOKEN
        if not token:
            return None
        token_id = int(token)
        return cls(model, lambda out: any(token_id in s.request.prompt_token_ids for s in out.scheduled))
