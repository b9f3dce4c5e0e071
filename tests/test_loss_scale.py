"""The loss-scale rule on its own: ``static_loss_scale``, ``dynamic_loss_scale``, ``adjust``.

Everything through ``accumulate`` is in ``tests/test_step.py``. Expected values here
are a hand-worked table and an independent plain-Python model of PyTorch's
``torch.amp.GradScaler`` update (``_amp_update_scale_``) with our floor and ceiling added.
"""

import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

# ---------------------------------------------------------------------------------------------
# Factories: defaults and validation.


def test_dynamic_defaults_are_pytorch_gradscaler_defaults():
  # torch.amp.GradScaler(init_scale=2.**16, growth_factor=2., backoff_factor=.5,
  # growth_interval=2000); floor and ceiling are ours.
  s = optax_accum.dynamic_loss_scale()
  assert isinstance(s, optax_accum._loss_scale.DynamicLossScale)
  assert (s.init_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (
    65536.0,
    2.0,
    0.5,
    2000,
  )
  assert (s.min_scale, s.max_scale) == (1.0, 2.0**24)
  assert s.initial_scale() == 65536.0


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=float("nan")), "growth_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=2.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=-3), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("inf"), max_scale=2.0**24), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=-1.0), "min_scale"),
    (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), "min_scale"),
    (dict(max_scale=float("inf")), "max_scale"),
    (dict(init_scale=2.0**25), "init_scale"),  # above the default max_scale
    (dict(init_scale=0.5), "init_scale"),  # below the default min_scale
  ],
)
def test_dynamic_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optax_accum.dynamic_loss_scale(**kwargs)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("-inf"), float("nan")])
def test_static_rejects_bad_values(value):
  with pytest.raises(ValueError, match="static_loss_scale"):
    optax_accum.static_loss_scale(value)


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_accum.static_loss_scale(1e39),
    lambda: optax_accum.dynamic_loss_scale(max_scale=1e39),
    lambda: optax_accum.dynamic_loss_scale(init_scale=1e39, max_scale=1e39),
  ],
  ids=["static", "dynamic-max", "dynamic-init"],
)
def test_factories_reject_scales_that_are_inf_in_float32(make):
  with pytest.raises(ValueError):
    make()


def test_accumulate_rejects_a_non_loss_scale():
  with pytest.raises(TypeError, match="loss_scale"):
    optax_accum.accumulate(optax.sgd(1.0), 2, loss_scale=1024.0)


# ---------------------------------------------------------------------------------------------
# The rule.

# A hand-worked table. init 2**10, growth x2 after 2 applied windows, backoff x0.5,
# floor 2**8, ceiling 2**12. Each row: window finite?, scale after, streak after.
HAND_TABLE = [
  (True, 1024.0, 1),
  (True, 2048.0, 0),  # 2 applied windows: grow, restart the streak
  (False, 1024.0, 0),  # overflow: back off once, restart the streak
  (True, 1024.0, 1),
  (False, 512.0, 0),  # the streak of 1 is lost
  (False, 256.0, 0),
  (False, 256.0, 0),  # floor: 128 < min_scale
  (True, 256.0, 1),
  (True, 512.0, 0),
  (True, 512.0, 1),
  (True, 1024.0, 0),
  (True, 1024.0, 1),
  (True, 2048.0, 0),
  (True, 2048.0, 1),
  (True, 4096.0, 0),
  (True, 4096.0, 1),
  (True, 4096.0, 0),  # ceiling: 8192 > max_scale; the streak still restarts
  (True, 4096.0, 1),
  (False, 2048.0, 0),
]


def test_dynamic_rule_against_hand_table():
  rule = optax_accum.dynamic_loss_scale(
    init_scale=2.0**10, growth_interval=2, min_scale=2.0**8, max_scale=2.0**12
  )
  adjust = jax.jit(chex.assert_max_traces(rule.adjust, n=1))
  scale = jnp.asarray(rule.initial_scale(), jnp.float32)
  streak = jnp.zeros((), jnp.int32)
  for i, (finite, want_scale, want_streak) in enumerate(HAND_TABLE):
    scale, streak = adjust(scale, streak, jnp.asarray(finite))
    assert scale.dtype == jnp.float32 and streak.dtype == jnp.int32
    assert (float(scale), int(streak)) == (want_scale, want_streak), f"window {i + 1}"


def test_ceiling_that_is_not_a_power_of_two_is_reached_exactly():
  rule = optax_accum.dynamic_loss_scale(init_scale=4.0, growth_interval=1, max_scale=20.0)
  scale, streak = jnp.float32(4.0), jnp.int32(0)
  seen = []
  for _ in range(4):
    scale, streak = rule.adjust(scale, streak, jnp.asarray(True))
    seen.append(float(scale))
  assert seen == [8.0, 16.0, 20.0, 20.0]


def test_floor_that_is_not_a_power_of_two_is_reached_exactly():
  rule = optax_accum.dynamic_loss_scale(init_scale=16.0, min_scale=3.0)
  scale, streak = jnp.float32(16.0), jnp.int32(0)
  seen = []
  for _ in range(4):
    scale, streak = rule.adjust(scale, streak, jnp.asarray(False))
    seen.append(float(scale))
  assert seen == [8.0, 4.0, 3.0, 3.0]


def test_static_rule_never_moves():
  rule = optax_accum.static_loss_scale(128.0)
  assert rule.initial_scale() == 128.0
  scale, streak = jnp.float32(128.0), jnp.int32(0)
  for finite in [True, False, True, True, False] * 3:
    scale, streak = rule.adjust(scale, streak, jnp.asarray(finite))
    assert (float(scale), int(streak)) == (128.0, 0)


def test_rule_is_clean_under_strict_dtype_promotion():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**4, growth_interval=1, max_scale=2.0**5)
  with jax.numpy_dtype_promotion("strict"):
    scale, streak = jax.jit(rule.adjust)(jnp.float32(16.0), jnp.int32(0), jnp.asarray(True))
  assert (float(scale), int(streak)) == (32.0, 0)


def _gradscaler_reference(config, flags):
  """Plain-Python model of PyTorch's ``_amp_update_scale_`` plus our floor and ceiling.

  PyTorch (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp): on inf, scale *= backoff and the
  growth tracker resets; otherwise the tracker grows and, on reaching growth_interval, the scale
  is multiplied by growth_factor (if finite) and the tracker resets. float32 arithmetic.
  """
  f32 = np.float32
  scale, tracker = f32(config["init_scale"]), 0
  out = []
  for finite in flags:
    if not finite:
      scale = max(f32(scale * f32(config["backoff_factor"])), f32(config["min_scale"]))
      tracker = 0
    else:
      tracker += 1
      if tracker == config["growth_interval"]:
        scale = min(f32(scale * f32(config["growth_factor"])), f32(config["max_scale"]))
        tracker = 0
    out.append((float(scale), tracker))
  return out


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(
  growth_interval=st.integers(1, 4),
  growth_factor=st.sampled_from([1.5, 2.0, 4.0]),
  backoff_factor=st.sampled_from([0.25, 0.5, 0.75]),
  log2_min=st.integers(-2, 3),
  log2_span=st.integers(0, 6),
  flags=st.lists(st.booleans(), min_size=1, max_size=25),
)
def test_dynamic_rule_matches_gradscaler_model(
  growth_interval, growth_factor, backoff_factor, log2_min, log2_span, flags
):
  config = dict(
    init_scale=2.0 ** (log2_min + log2_span // 2),
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
    min_scale=2.0**log2_min,
    max_scale=2.0 ** (log2_min + log2_span) * 1.25 if log2_span else 2.0**log2_min,
  )
  if config["init_scale"] > config["max_scale"]:
    config["init_scale"] = config["max_scale"]
  rule = optax_accum.dynamic_loss_scale(**config)
  scale, streak = jnp.asarray(rule.initial_scale(), jnp.float32), jnp.zeros((), jnp.int32)
  got = []
  for finite in flags:
    scale, streak = rule.adjust(scale, streak, jnp.asarray(finite))
    got.append((float(scale), int(streak)))
  assert got == _gradscaler_reference(config, flags)
  assert all(config["min_scale"] <= s <= config["max_scale"] for s, _ in got)
  assert all(math.isfinite(s) for s, _ in got)


@pytest.mark.parametrize(
  "make, error",
  [
    (lambda: optax_accum._loss_scale.StaticLossScale(-3.0), ValueError),
    (lambda: optax_accum._loss_scale.DynamicLossScale(backoff_factor=2.0), ValueError),
    (lambda: optax_accum._loss_scale.DynamicLossScale(growth_interval=True), TypeError),
    (lambda: optax_accum.dynamic_loss_scale(init_scale="1"), TypeError),
    (lambda: optax_accum.dynamic_loss_scale(growth_interval=float("inf")), ValueError),
  ],
)
def test_classes_validate_like_the_factories(make, error):
  with pytest.raises(error):
    make()
