"""The trainer's tensors as the sender reads them: a model's released (name, tensor) pairs with a
cheap fingerprint, so the per-tensor resolution happens once per parameter layout, not per update.

Governing idea: a refit sends the same tensors every time (the trainer updates its parameters in
place), so what an update must check is only that the layout did not change. ``ParamWatch``
keeps a module's parameter tuple and reads their addresses / in-place version counters with one
C-level ``map`` each (no Python work per tensor; ~20 us for the 717 parameters of the M3-shaped
benchmark model on a server core), re-enumerating the parameters only when some module
registered a parameter since (a global registration hook: replacing a ``Parameter`` object is
seen too). ``ReleasedTensors`` is what ``Policy.named_released_tensors`` hands the sender: the
master weights in released naming, plus, when the trainer keeps one, the low-precision copy it
refreshes with an attested cast (``cast_copy.CastCopy``), which the direct refit sends instead.
"""

from __future__ import annotations

import operator

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

from m3_rollout.model.loading import RELEASED_PREFIX, iter_released_tensors

_registrations = 0  # parameters registered on any module of this process (the hook below)


def _count_registration(module, name, param):
    global _registrations
    _registrations += 1


register_module_parameter_registration_hook(_count_registration)

_version = operator.attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr


class ParamWatch:
    """A module's parameters, enumerated once (again only after a parameter registration
    anywhere), with their addresses and in-place version counters read in one C-level pass each.

    ``addresses()``: tuple of ``data_ptr``s (a re-pointed parameter, ``p.data = x``, changes it);
    ``version()``: the sum of the version counters (each only grows, so the sum is unchanged iff
    no parameter was written in place through torch since; ``p.data.copy_`` and raw-pointer
    writes, e.g. a Triton kernel, do not count). NOTE: ``Module._apply`` under
    ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` swaps parameter objects
    without registering them; nothing here sees that (the default ``.to()`` re-points in place).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._seen = -1
        self._params: tuple[torch.Tensor, ...] = ()

    def params(self) -> tuple[torch.Tensor, ...]:
        if self._seen != _registrations:
            self._params = tuple(self.module.parameters())
            self._seen = _registrations
        return self._params

    def addresses(self) -> tuple[int, ...]:
        return tuple(map(_data_ptr, self.params()))

    def version(self) -> int:
        return sum(map(_version, self.params()))


class ReleasedTensors:
    """The (released name, tensor) pairs of ``model`` (``iter_released_tensors``), re-iterable,
    with a cheap fingerprint: the parameters' addresses.

    A ``WeightSender`` whose ``named_tensors()`` returns one resolves the pairs (4,195 views at
    M3 shapes, milliseconds of Python) once and reuses them, the update header and the
    receivers' copy plans for as long as the fingerprint is unchanged: the trainer updates its
    parameters in place, and a re-pointed parameter (a new storage) changes the fingerprint.
    The cached views keep the old storages alive, so an address cannot be reused meanwhile.

    ``cast``: the trainer's low-precision copy of ``model`` (``cast_copy.CastCopy``, master =
    ``model``); a direct refit whose wire dtypes are the copy's sends the copy, validated from the
    flags its cast produced, instead of casting ``model`` again. Iterating always yields ``model``'s
    own tensors (what checkpoints and the bucket path read).
    """

    def __init__(self, model: torch.nn.Module, prefix: str = RELEASED_PREFIX, cast=None):
        if cast is not None and cast.master is not model:
            raise ValueError("ReleasedTensors: the cast copy's master is another model")
        self.model, self.prefix, self.cast = model, prefix, cast
        self._watch = ParamWatch(model)

    def __iter__(self):
        return iter_released_tensors(self.model, self.prefix)

    def fingerprint(self) -> tuple:
        """(id of the model, every parameter's data_ptr); O(parameters) C-level reads."""
        return (id(self.model), self._watch.addresses())
