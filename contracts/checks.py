"""Rule checking shared by every contract and every plugin function that takes tensors.

A :class:`Checks` collects violations of one call — field, rule, where — and raises them all at once as a
:class:`~lossplug.BatchValidationError`. Rules over tensor *values* are queued as 0-d flags and resolved together
with a single device→host synchronisation; the offending positions are only looked up for the rules that failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .errors import BatchValidationError, Violation, describe_positions

Tensor = torch.Tensor

#: what each dtype kind accepts, and how a violation names it
DTYPE_KINDS: dict[str, tuple[Callable[[Tensor], bool], str]] = {
    "float": (lambda t: t.is_floating_point(), "a float"),
    "bool": (lambda t: t.dtype == torch.bool, "a bool"),
    "int": (lambda t: not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool, "an int"),
    "number": (lambda t: not t.is_complex() and t.dtype != torch.bool, "a real (int or float)"),
}


def on_host(t: Tensor) -> bool:
    """Whether ``t``'s values can be read without a device synchronisation (a CPU tensor): rules then test
    reductions in Python right away instead of queueing flag tensors for the single synchronisation."""
    return t.device.type == "cpu"


def any_of(bad: Tensor, dim: int | None = None) -> Tensor:
    """``bad.any(dim)``; for a bool tensor through a ``uint8`` max, which the CPU vectorises (its bool ``any`` is a
    scalar loop: ~30× slower on a million elements)."""
    if bad.dtype != torch.bool or bad.numel() == 0 or (dim is not None and bad.shape[dim] == 0):
        return bad.any() if dim is None else bad.any(dim)
    as_bytes = bad.view(torch.uint8)
    return (as_bytes.amax() if dim is None else as_bytes.amax(dim)).bool()


class Checks:
    """The violations of one call (a contract, a plugin function), raised together by :meth:`raise_if_any`."""

    def __init__(self, contract: str):
        self.contract = contract
        self.violations: list[Violation] = []
        self._pending: list[tuple[Tensor | bool, Callable[[], list[Violation]]]] = []
        self._resolved: dict[int, Callable[[bool], None]] = {}
        self._device: torch.device | None = None
        self._device_of = ""

    def fail(self, field: str, rule: str, where: str = "") -> None:
        self.violations.append(Violation(field, rule, where))

    def when_any(self, bad: Tensor, field: str, rule: str, noun: str = "rows") -> None:
        """Report ``rule`` for ``field`` (with the offending places) if any element of ``bad`` is set."""
        self._pending.append((any_of(bad), lambda: [Violation(field, rule, describe_positions(bad, noun=noun))]))

    def when_not_finite(self, t: Tensor, field: str, rule: str = "must be finite", noun: str = "rows") -> None:
        """Report ``rule`` for ``field`` if any element of the float tensor ``t`` is NaN or ±inf.

        The test is the sum's finiteness (one reduction, no temporary; any NaN or inf reaches the sum): only if the
        sum is not finite are the elements tested — finite values whose sum overflows then report nothing."""
        if not t.is_floating_point() or t.numel() == 0:
            self.when_any(~torch.isfinite(t), field, rule, noun)
            return

        def find() -> list[Violation]:
            bad = ~torch.isfinite(t)
            return [Violation(field, rule, describe_positions(bad, noun=noun))] if bool(any_of(bad)) else []

        total = t.sum(dtype=torch.float64 if t.element_size() < 4 else t.dtype)
        # on the CPU the value is on the host already: a Python test, no flag kernels
        self._pending.append((not math.isfinite(total.item()) if on_host(t) else ~torch.isfinite(total), find))

    def when(self, flag: Tensor, field: str, rule: str, where: str = "") -> None:
        """Report ``rule`` for ``field`` if the 0-d boolean tensor ``flag`` is set (resolved with the same sync)."""
        self._pending.append((flag.reshape(()), lambda: [Violation(field, rule, where)]))

    def when_flag(
        self, flag: Tensor | bool, find: Callable[[], list[Violation]], resolved: Callable[[bool], None] | None = None
    ) -> None:
        """If ``flag`` (a 0-d bool tensor, or a bool already known on the host) is set, report what ``find()``
        finds: a cheap combined test whose positions are only looked up when it fails. ``resolved(flag)`` is called
        with the flag's value once it is known (with the single synchronisation)."""
        if resolved is not None:
            self._resolved[len(self._pending)] = resolved
        self._pending.append((flag, find))

    def dtype(self, name: str, t: Tensor, kind: str) -> bool:
        """``t``'s dtype is of ``kind`` (float, bool, int, number); False, with a violation, if not."""
        accepts, noun = DTYPE_KINDS[kind]
        if accepts(t):
            return True
        hint = " (convert with .bool() once you know it holds only 0/1)" if kind == "bool" else ""
        self.fail(name, f"must be {noun} tensor, got {t.dtype}{hint}")
        return False

    def tensor(
        self,
        name: str,
        t: object,
        *,
        kind: str = "float",
        ndim: tuple[int, ...] | None = None,
        shape: tuple[int, ...] | None = None,
        like: str = "",
    ) -> bool:
        """Type, dtype, rank, shape and device rules of one tensor argument; False if any failed."""
        if not isinstance(t, torch.Tensor):
            self.fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
            return False
        ok = self.dtype(name, t, kind)
        if ndim is not None and t.ndim not in ndim:
            want = " or ".join(f"{n}-d" for n in ndim)
            self.fail(name, f"must be {want}, got shape {list(t.shape)}")
            ok = False
        elif shape is not None and tuple(t.shape) != tuple(shape):
            self.fail(name, f"shape must match {like or 'the batch'} {list(shape)}, got {list(t.shape)}")
            ok = False
        if self._device is None:
            self._device, self._device_of = t.device, name
        elif t.device != self._device:
            self.fail(name, f"must be on {self._device_of}'s device {self._device}, got {t.device}")
            ok = False
        return ok

    def number(
        self,
        name: str,
        value: object,
        *,
        ge: float | None = None,
        gt: float | None = None,
        allow_inf: bool = False,
        integer: bool = False,
    ) -> bool:
        """Rules of a scalar parameter: a real number, finite (unless ``allow_inf``), and bounded below."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            self.fail(name, f"must be {'an int' if integer else 'a number'}, got {type(value).__name__} {value!r}")
            return False
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            self.fail(name, f"must be finite, got {value}")
            return False
        if ge is not None and value < ge:
            self.fail(name, f"must be >= {ge}, got {value}")
            return False
        if gt is not None and value <= gt:
            self.fail(name, f"must be > {gt}, got {value}")
            return False
        return True

    def raise_if_any(self) -> None:
        if self._pending:
            tensors = [flag for flag, _ in self._pending if isinstance(flag, Tensor)]
            synced = iter(torch.stack(tensors).tolist() if tensors else ())
            flags = [next(synced) if isinstance(flag, Tensor) else flag for flag, _ in self._pending]
            for i, (flag, (_, find)) in enumerate(zip(flags, self._pending)):
                if i in self._resolved:
                    self._resolved[i](bool(flag))
                if flag:
                    self.violations.extend(find())
            self._pending.clear()
            self._resolved.clear()
        if self.violations:
            raise BatchValidationError(self.contract, self.violations)
