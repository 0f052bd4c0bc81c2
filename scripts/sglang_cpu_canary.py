"""Let SGLang 0.5.23's own KV canary (``--kv-canary log|raise``) run on a CPU, for the opt-in tests.

Installed by ``scripts/setup-sglang.sh`` into the SGLang venv's site-packages, with a ``.pth`` line
that imports it at every interpreter start, so that the launcher and the scheduler process it spawns
both have it. It changes nothing until SGLang imports one of the three modules below, and then only
what that module does for a CPU device; a CUDA device takes SGLang's own code unchanged.

SGLang means its canary to run off CUDA: its write, verify and plan kernels fall back to torch
references on any device that is not ``cuda`` (``kernels/ops/kv_canary/_dispatch.py``). Three pieces
of the canary's plumbing around those kernels assume an accelerator all the same, and each stops a
CPU server before its first answer:

1. ``srt/utils/common.py`` ``create_device_stream`` calls ``torch.cpu.Stream(device=...)``, but
   ``torch.cpu.Stream`` takes only ``priority`` (``TypeError`` in ``CanaryManager.__init__``). Here a
   CPU device gets a plain ``torch.cpu.Stream()``.
2. ``srt/utils/phase_checker.py`` ``SimplePhaseChecker.update`` launches a one-program Triton kernel
   (the canary's own pre/post-forward state machine), and Triton has no CPU driver ("0 active
   drivers"). Here a CPU device runs the same five steps in torch: if the assert is on and the phase
   is not the expected one, raise; then store the next phase.
3. ``srt/kv_canary/runner/future_tensor.py`` ``FutureTensors.device_to_host`` stages a copy to pinned
   host memory on a side stream and records an event; pinned memory needs an accelerator
   (``RuntimeError``). On a CPU the tensors already are host tensors: here they are cloned (the
   device copy SGLang makes first) and handed back with an event that is already complete.

The canary's checks themselves (what is written into each slot, what a read verifies, what it logs)
are SGLang's own code, unchanged: this module only carries their results on a CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _cpu(device: Any) -> bool:
    return getattr(device, "type", str(device).split(":", 1)[0]) == "cpu"


def _fix_create_device_stream(module: ModuleType) -> None:
    original = module.create_device_stream

    def create_device_stream(device: Any) -> Any:
        import torch

        return torch.cpu.Stream() if _cpu(device) else original(device)

    module.create_device_stream = create_device_stream


def _fix_phase_checker(module: ModuleType) -> None:
    checker = module.SimplePhaseChecker
    original = checker.update

    def update(self: Any, *, expect_phase: int, next_phase: int, caller_name: str = "") -> None:
        if not _cpu(self._device):
            original(self, expect_phase=expect_phase, next_phase=next_phase, caller_name=caller_name)
            return
        if int(self._enable_assert_device[0]) != 0 and int(self._phase) != int(expect_phase):
            raise AssertionError(
                f"SimplePhaseChecker: phase mismatch (caller {caller_name!r}, expected {int(expect_phase)}, "
                f"next {int(next_phase)}, actual {int(self._phase)})"
            )
        self._phase.fill_(int(next_phase))

    checker.update = update


class _CopyDone:
    """The event of a copy that finished when it returned."""

    def synchronize(self) -> None:
        return None


def _fix_future_tensors(module: ModuleType) -> None:
    futures = module.FutureTensors
    original = futures.device_to_host.__func__

    def device_to_host(cls: type, xs_device: Any, *, d2h_stream: Any) -> Any:
        import torch

        entries = xs_device if isinstance(xs_device, dict) else {module._DUMMY_DICT_KEY: xs_device}
        first = next((x for x in entries.values() if isinstance(x, torch.Tensor)), None)
        if first is None or not _cpu(first.device):
            return original(cls, xs_device, d2h_stream=d2h_stream)
        copied = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
        return cls(_data=copied, _event=_CopyDone(), _retained_device_clones=None)

    futures.device_to_host = classmethod(device_to_host)


#: The modules whose CPU path is mended, each as soon as SGLang has executed it.
FIXES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.utils.common": _fix_create_device_stream,
    "sglang.srt.utils.phase_checker": _fix_phase_checker,
    "sglang.srt.kv_canary.runner.future_tensor": _fix_future_tensors,
}


class _ThenFix(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, fix: Callable[[ModuleType], None]) -> None:
        self._inner, self._fix = inner, fix

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._fix(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Find the modules above as Python would, and mend each once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        fix = FIXES.get(fullname)
        if fix is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenFix(spec.loader, fix)
        return spec


def install() -> None:
    """Put the finder first, once (the ``.pth`` line calls this at interpreter start)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
