"""Whether a module's input is referenced from Python only by the call that passed it.

The in-place modules (nn.py) overwrite their input only where nothing can read it afterwards.
This file answers the Python half of that question, the way NumPy's temporary elision does: a
reference count that includes no holder but the call itself means a temporary. How many
references the call itself holds depends on the call path (``module(x)`` runs
``_wrapped_call_impl`` and ``_call_impl`` before ``forward``) and on the CPython version, so the
counts are not hard-coded: ``observe`` is run once by a probe module (nn.py) with a temporary and
with a tensor that a local variable also holds, and a later call is trusted only where it took
the same frames, its caller's bytecode shows a plain ``module(argument)`` call, and its count
equals one the probe saw:

- the temporary's count, where a named tensor's count is higher (``ln(lin(x))``); or
- the named tensor's count, where the caller's bytecode rebinds the local that it passed to the
  call's result (``x = ln(x)``, ``nn.Sequential``'s loop): that local dies at the call.

Anything else (keyword or star arguments, hooks, ``m.__call__(x)``, module-level code, a count
the probe never saw) means "maybe referenced". Blind spots, where a reference can hide:
calling through a bound ``__call__`` kept in a variable (``f = m.__call__; f(t)``) skips two
references that ``m(t)`` holds, so an input with exactly two other holders passes; and a C
function that calls the module for the caller (``itertools.starmap``, ``functools.partial``)
is invisible: the count then reflects that function's references, not the caller's stack, so
where it holds fewer (starmap passes its argument tuple on), one other holder can pass.
"""

from __future__ import annotations

import dis
import sys
from typing import NamedTuple

# Frames from the function that counts: 1 the module's deciding method, 2 forward,
# 3 nn.Module._call_impl, 4 nn.Module._wrapped_call_impl, then the caller.
_CALL_IMPL_DEPTH = 3

# What a call site is: not a plain one-argument call (or one whose argument is a local that lives
# on), a plain call of an expression that is not a bare local, or ``v = f(v)``.
NOT_PLAIN, TEMPORARY_ARG, REBINDS_LOCAL = 0, 1, 2

_LOCAL_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})
# Superinstructions that push two locals (3.13+); the second one is the call's argument.
_PAIR_LOADS = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


class Calibration(NamedTuple):
    temporary: int  # the count observe() saw for a temporary argument
    named: int  # ... for an argument that one local variable of the caller also held
    frames: tuple  # (code, lasti) of _call_impl and of _wrapped_call_impl at the forward call


def observe(x) -> tuple[int, tuple | None]:
    """The probe's measurement: x's reference count and the frames between forward and its
    caller. Must be called as ``forward -> method -> observe(x)``, as ``held_by_call_only`` is."""
    refs = sys.getrefcount(x)
    try:
        call_impl = sys._getframe(_CALL_IMPL_DEPTH)
    except ValueError:
        return refs, None
    wrapped = call_impl.f_back
    if wrapped is None or wrapped.f_back is None:
        return refs, None
    return refs, (call_impl.f_code, call_impl.f_lasti, wrapped.f_code, wrapped.f_lasti)


def held_by_call_only(x, calibration: Calibration) -> bool:
    """True when no Python reference to x outlives this call: it is a temporary, or the local
    that passed it is rebound to the result. Called as ``forward -> method -> this``."""
    refs = sys.getrefcount(x)
    temporary, named, (impl_code, impl_lasti, wrapped_code, wrapped_lasti) = calibration
    try:
        call_impl = sys._getframe(_CALL_IMPL_DEPTH)
    except ValueError:
        return False
    if call_impl.f_code is not impl_code or call_impl.f_lasti != impl_lasti:
        return False  # forward not called from _call_impl's hook-free path
    wrapped = call_impl.f_back
    if wrapped.f_code is not wrapped_code or wrapped.f_lasti != wrapped_lasti:
        return False
    caller = wrapped.f_back
    if caller is None:
        return False
    code, lasti = caller.f_code, caller.f_lasti
    entry = _sites.get((id(code), lasti))
    kind = site_kind(code, lasti) if entry is None else entry[1]
    if kind == TEMPORARY_ARG:
        return refs == temporary < named
    return kind == REBINDS_LOCAL and refs == named


_sites: dict[tuple[int, int], tuple[object, int]] = {}


def site_kind(code, lasti: int) -> int:
    """What the caller's instruction at lasti is: TEMPORARY_ARG (``f(expr)``, one positional
    argument that is not a bare local), REBINDS_LOCAL (``v = f(v)``) or NOT_PLAIN. Cached per
    call site; the cache holds each code object, so its id is not reused while the entry
    exists."""
    key = (id(code), lasti)
    entry = _sites.get(key)
    if entry is None:
        entry = _sites[key] = (code, _analyse(code, lasti))
    return entry[1]


def _analyse(code, lasti: int) -> int:
    instrs = list(dis.get_instructions(code))
    at = next((n for n, ins in enumerate(instrs) if ins.offset == lasti), None)
    if at is None or instrs[at].opname != "CALL" or instrs[at].arg != 1:
        return NOT_PLAIN  # keywords (CALL_KW), *args (CALL_FUNCTION_EX), more arguments
    end = at - 1
    while end >= 0 and instrs[end].opname == "PRECALL":  # 3.11
        end -= 1
    if end < 0 or instrs[end].opname == "KW_NAMES":  # 3.11, 3.12: keyword arguments
        return NOT_PLAIN
    last = instrs[end]
    local = None
    if last.opname in _PAIR_LOADS:  # callable and argument, both locals
        if any(ins.is_jump_target for ins in instrs[end + 1 : at + 1]):
            return NOT_PLAIN
        local = last.argval[1]
    else:
        start = _expression_start(instrs, end)
        if start is None:
            return NOT_PLAIN
        callee = start - 1
        while callee >= 0 and instrs[callee].opname == "PUSH_NULL":  # 3.13+: after the callee
            callee -= 1
        if callee < 0 or any(ins.is_jump_target for ins in instrs[callee + 1 : at + 1]):
            return NOT_PLAIN
        if instrs[callee].argval == "__call__":  # m.__call__(x): a leaner call path
            return NOT_PLAIN
        if start == end and last.opname in _LOCAL_LOADS:
            local = last.argval
    if local is None:
        return TEMPORARY_ARG
    after = instrs[at + 1] if at + 1 < len(instrs) else None
    if after is not None and after.opname in ("STORE_FAST", "STORE_FAST_LOAD_FAST"):
        stored = after.argval[0] if after.opname == "STORE_FAST_LOAD_FAST" else after.argval
        if stored == local:
            return REBINDS_LOCAL
    return NOT_PLAIN  # the local lives on: the count must show it, a lower one is a leaner path


def _expression_start(instrs, end: int) -> int | None:
    """Index of the first instruction of the straight-line code ending at `end` that pushes
    one value (the call's argument); None where that is not plain to see."""
    pushed = 0
    for n in range(end, -1, -1):
        ins = instrs[n]
        if ins.opcode in _JUMPS:
            return None
        try:
            pushed += dis.stack_effect(ins.opcode, ins.arg, jump=False)
        except ValueError:
            return None
        if pushed == 1:
            return n
        if pushed > 1:
            return None
    return None
