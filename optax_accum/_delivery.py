"""Whether a caller's ``weight``, ``flush`` and ``value`` reach ``accumulate`` through wrappers.

``optax.chain``, ``optax.masked`` and Flax pass extra arguments on; ``optax.lookahead`` (plain, or
under ``optax.with_extra_args_support``) does not: a dropped ``weight`` silently weighs every
microbatch 1 (the mean of means). :func:`expect` wraps the ``tx.update`` call of
``update_and_apply`` (and so of the Flax helpers): each ``accumulate`` reached records what it
received (:func:`received`, a trace-time record, nothing in the compiled step), and a wrapper
that dropped an argument raises, named by its state's type. This changes no behaviour: it
only refuses a call that would be silently wrong.

Experimental: the record is a ``ContextVar`` set while ``update_and_apply`` traces
``tx.update``; it relies on the wrapper calling the inner ``update`` during that call (every
optax wrapper does). A wrapper that defers the call (a future optax) makes the check raise
loudly, naming the wrapper, rather than pass (``tests/test_delivery.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Generator, Mapping
from typing import Any

import optax

PyTree = Any

DELIVERED = ("weight", "flush", "value")
_EXPECTED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
  "optax_accum_delivery", default=None
)


def received(extra_args: Mapping[str, Any]) -> None:
  """Records, inside :func:`expect`, the extra arguments an ``accumulate`` update received."""
  calls = _EXPECTED.get()
  if calls is not None:
    calls.append(frozenset(extra_args))


@contextlib.contextmanager
def expect(
  tx: Any, opt_state: PyTree, extra_args: Mapping[str, Any]
) -> Generator[None, None, None]:
  """Raises (after the call) if an ``accumulate`` inside ``tx`` missed one of ``extra_args``'
  ``weight``/``flush``/``value``; before it, if ``tx`` takes no extra arguments at all."""
  from optax_accum._state import find_states

  wanted = frozenset(DELIVERED) & frozenset(extra_args)
  if not wanted or not find_states(opt_state):  # nothing to deliver, or no accumulate: optax's
    yield
    return
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    raise TypeError(_message(sorted(wanted), opt_state, takes_none=True))
  calls: list = []
  token = _EXPECTED.set(calls)
  try:
    yield
  finally:
    _EXPECTED.reset(token)
  missing = sorted({k for got in calls for k in wanted - got})
  if missing:
    raise ValueError(_message(missing, opt_state, takes_none=False))


def wrappers(opt_state: PyTree, state_type: type) -> list[str]:
  """The state types around each ``state_type`` in ``opt_state`` (outermost first), by name."""
  found: list[str] = []

  def walk(node: Any, around: tuple[str, ...]) -> None:
    if isinstance(node, state_type):
      found.extend(n for n in around if n not in found)
      return
    if isinstance(node, Mapping):
      children = list(node.values())
    elif isinstance(node, (tuple, list)):
      children = list(node)
    else:
      return
    named = hasattr(node, "_fields") and not isinstance(node, state_type)
    here = (*around, _qualified(type(node))) if named else around
    for child in children:
      walk(child, here)

  walk(opt_state, ())
  return found


def _qualified(t: type) -> str:
  module = t.__module__.split(".")[0]
  return f"{module}.{t.__name__}"


def _message(missing: list[str], opt_state: PyTree, takes_none: bool) -> str:
  from optax_accum._state import AccumulationState

  names = wrappers(opt_state, AccumulationState) or ["an unnamed wrapper"]
  args = ", ".join(f"{k}=" for k in missing)
  how = (
    "tx takes no extra arguments (a plain optax.GradientTransformation)"
    if takes_none
    else "a wrapper around accumulate dropped them"
  )
  return (
    f"{args} did not reach accumulate: {how}; the state around it is {', '.join(names)} "
    "(optax.lookahead passes no extra argument to what it wraps, with or without "
    "optax.with_extra_args_support). Every microbatch would weigh 1: the mean of means. Put "
    "wrappers inside accumulate where they allow it (optax.chain, masked and multi_transform "
    "forward extra arguments); around a wrapper that must stay outside (lookahead), pass "
    "equal-size microbatches without weight=, and close the last window with "
    "optax_accum.flush(tx, state, params), which reaches accumulate through any wrapper."
  )
