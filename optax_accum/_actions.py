"""What a user does with an ``accumulate`` state besides ``update``: flush, discard, apply.

One spelling per action: :func:`flush` closes the open window (or pass
``flush=True`` with the last microbatch to any update), :func:`discard` drops
it, :func:`update_and_apply` is ``tx.update`` plus ``optax.apply_updates``
(fused for the transformation ``accumulate`` returns). The Flax integrations call
these, and a ``weight`` that a wrapper would drop is refused (``_delivery``).
docs/design.md maps the modules.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum import _delivery, _numerics, _pitfalls
from optax_accum._accumulate import Accumulation
from optax_accum._state import (
  AccumulationState,
  find_state,
  find_states,
  is_variable,
  map_states,
  unwrap,
)

PyTree = Any


def _zeros_like(tree: PyTree) -> PyTree:
  """Zeros like ``tree``; Flax variables stay variables (holding zeros)."""

  def zero(x):
    return x.replace(jnp.zeros_like(unwrap(x))) if is_variable(x) else jnp.zeros_like(x)

  return jax.tree.map(zero, tree, is_leaf=is_variable)


def _empty_window(s: AccumulationState) -> AccumulationState:
  return s._replace(mini_step=_zeros_like(s.mini_step), window=_zeros_like(s.window))


def discard(opt_state: PyTree) -> PyTree:
  """Drops the open (partial) window: its gradients, weights and losses.

  For an epoch whose last window should not be applied (a changed data order, a bad shard).
  The inner state, counters and loss scale stay; ``num_microbatches`` keeps counting.

  Args:
    opt_state: any optimizer state containing ``accumulate`` states (every one is reset), or
      Flax's ``nnx.Optimizer.opt_state`` (assign the result back to it).

  Returns:
    The state with the open window(s) emptied; one without an ``accumulate`` state unchanged.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
    >>> params = {'w': jnp.zeros(2)}
    >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params)
    >>> state = optax_accum.discard(state)
    >>> int(optax_accum.metrics(state).mini_step), float(optax_accum.metrics(state).pending_weight)
    (0, 0.0)
  """
  _pitfalls.check_state(opt_state, AccumulationState)
  return map_states(_empty_window, opt_state)


def flush(
  tx: optax.GradientTransformation, state: PyTree, params: PyTree, **extra_args: Any
) -> tuple[PyTree, PyTree]:
  """Closes the current (possibly incomplete) window without a new gradient.

  The mean divides by the weight accumulated so far (by 2 for the last two examples of an
  epoch, not by ``every_k``); the flush is not counted as a microbatch. Flushing an empty
  window is a no-op: zero updates, inner state unchanged, nothing counted. The flush reaches
  ``accumulate`` through the state (its ``flush_pending`` flag, set for this one call), so it
  works through any wrapper, even one that passes no extra arguments (``optax.lookahead``).

  Args:
    tx: :func:`optax_accum.accumulate`'s transformation, or any transformation containing
      it (an ``optax.chain``, ``optax.lookahead``, say); other members see an all-zero
      gradient.
    state: the optimizer state of ``tx``.
    params: the current params, as ``tx.update`` takes them (``optax.lookahead``'s
      ``LookaheadParams`` too); zero gradients shaped like the window go through ``tx``.
    **extra_args: forwarded to ``tx.update`` (for a ``tx`` that takes extra arguments). The
      inner optimizer's ``value`` is the window's weighted mean ``value``; a ``value`` passed
      here is ignored.

  Returns:
    ``(updates, new_state)``, exactly like ``tx.update``: apply the updates
    with ``optax.apply_updates``.

  Raises:
    ValueError: if ``state`` holds no :class:`AccumulationState` (flushing a
      plain optimizer would run a real step on zero gradients), or several,
      or if ``state`` is not a state of ``tx`` for these ``params`` (its tree,
      shapes or dtypes differ from ``tx.init(params)``'s).
    TypeError: ``extra_args`` for a ``tx`` that takes none.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
    >>> params = {'w': jnp.zeros(())}
    >>> state = tx.init(params)
    >>> for y in (9.0, 10.0):  # two microbatches of a 4-window, gradients -y
    ...   _, state = tx.update({'w': jnp.asarray(-y)}, state, params)
    >>> updates, state = optax_accum.flush(tx, state, params)
    >>> updates['w']  # the mean of the two, not divided by 4
    Array(9.5, dtype=float32)
  """
  _check_belongs(tx, state, params)
  _pitfalls.check_state(state, AccumulationState)
  if not find_states(state):
    raise ValueError(
      f"flush needs the state of optax_accum.accumulate (or of a chain containing it), got "
      f"a {type(state).__name__} without one: flushing a plain optimizer would run a real "
      "step on zero gradients."
    )
  s = find_state(state)  # exactly one
  extra_args = {k: v for k, v in extra_args.items() if k != "value"}
  if isinstance(tx, optax.GradientTransformationExtraArgs):
    extra_args["value"] = _numerics.guarded_divide(s.window.value_sum, s.window.value_weight)
  elif extra_args:
    raise TypeError(
      f"flush got extra arguments {sorted(extra_args)} for a tx that takes none (a plain "
      "optax.GradientTransformation): leave them out."
    )
  marked = map_states(lambda a: a._replace(flush_pending=_true_like(a.flush_pending)), state)
  return tx.update(_zero_grads(s, params), marked, params, **extra_args)


def _true_like(flag: Any) -> Any:
  """True where ``flag`` was (a Flax variable stays a variable)."""
  true = jnp.ones_like(unwrap(flag))
  return flag.replace(true) if is_variable(flag) else true


def _zero_grads(s: AccumulationState, params: PyTree) -> PyTree:
  """Zero gradients for a flush, shaped like what ``tx.update`` takes: like the params (through
  ``optax.masked`` and ``multi_transform`` too, whose windows hold ``MaskedNode`` leaves), like
  the fast params of ``optax.lookahead``'s ``LookaheadParams``, or, without params, like the
  window's sums."""
  if isinstance(params, optax.LookaheadParams):
    params = params.fast
  if params is None:
    return jax.tree.map(jnp.zeros_like, s.window.grad_sum)
  return optax.tree.zeros_like(params)


def _check_belongs(tx: optax.GradientTransformation, state: PyTree, params: PyTree) -> None:
  """Raises unless ``state`` has the tree, shapes and dtypes of ``tx.init(params)``."""
  if not find_states(state):
    return  # flush says what is missing
  expected = jax.eval_shape(tx.init, params)
  leaves = lambda t: [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(t)]
  same = jax.tree.structure(expected) == jax.tree.structure(state)
  if not same or leaves(expected) != leaves(state):
    raise ValueError(
      "flush(tx, state, params): state is not a state of tx for these params (its tree, "
      "shapes or dtypes differ from tx.init(params)). Pass the transformation that "
      "produced state (the same optax.chain and inner optimizer) and the params it was "
      "initialized with."
    )


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: PyTree,
  opt_state: PyTree,
  params: PyTree,
  **extra_args: Any,
) -> tuple[PyTree, PyTree]:
  """``tx.update`` then ``optax.apply_updates``, fused when ``tx`` is ``accumulate(...)`` itself.

  The recommended train step (donate params and state, so that a microstep
  between boundaries costs what ``acc += weight * grads`` costs):

  .. code-block:: python

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      params, opt_state = optax_accum.update_and_apply(
        tx, grads, opt_state, params, weight=batch_weight)
      return params, opt_state, loss

  For the transformation :func:`optax_accum.accumulate` returned,
  the params pass through its ``lax.cond`` (no update buffer is written), with the same
  arithmetic as ``tx.update`` + ``optax.apply_updates``. Any other ``tx`` (an ``optax.chain``
  containing ``accumulate``, say) runs exactly those two, re-writing the params between
  boundaries (about 2x the fused traffic; docs/performance.md). Under ``jax.vmap`` over
  states the ``lax.cond`` becomes a select: still exact, only the saving is lost.

  Args:
    tx: any optax transformation; ``accumulate(...)`` itself for the fused path.
    grads: gradient of the microbatch's mean loss, a tree like ``params``.
    opt_state: the state of ``tx``.
    params: the current params (required: they are what is updated).
    **extra_args: forwarded to ``tx.update`` (``weight``, ``flush``, ``value``,
      and extra args of the inner optimizer).

  Returns:
    ``(new_params, new_opt_state)``, each with the structure and dtypes of its
    input (params cast like ``params``, as ``optax.apply_updates`` does).

  Raises:
    ValueError: if ``params`` is None on the fused path; if a wrapper around ``accumulate``
      dropped ``weight``, ``flush`` or ``value`` (``optax.lookahead``), naming it; otherwise
      what ``tx.update`` raises.
    TypeError: ``weight``, ``flush`` or ``value`` for a ``tx`` that takes no extra arguments.

  Warns:
    PitfallWarning: one ``weight`` given to several ``accumulate`` states (an
      ``optax.multi_transform`` of accumulators: docs/porting.md shows one weight each).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for g, w in ((jnp.array([1., 3.]), 1), (jnp.array([4., 0.]), 3)):
    ...   params, state = optax_accum.update_and_apply(tx, {'w': g}, state, params, weight=w)
    >>> params['w']  # 1 - (1 * [1, 3] + 3 * [4, 0]) / 4
    Array([-2.25, 0.25], dtype=float32)
  """
  if isinstance(tx, Accumulation):
    return tx.update_and_apply(grads, opt_state, params, **extra_args)
  _pitfalls.check_state(opt_state, AccumulationState)  # what sits around accumulate
  _pitfalls.check_shared_weight(opt_state, AccumulationState, extra_args)
  with _delivery.expect(tx, opt_state, extra_args):  # a wrapper must not drop weight=
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state
