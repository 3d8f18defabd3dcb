"""Conformance checks an architecture plugin runs on its model: ``mlxrunner.testing``.

Every check takes a loaded :class:`mlxrunner.Model` (tiny, random weights, float32 on
the CPU is the intended setting) and raises ``AssertionError`` with a message that
names what differs and by how much. They rely only on the Model interface and the
cache contract of :class:`mlxrunner.Cache`, so they apply to any mix of layer kinds
(full attention, sliding rings, recurrent state, layers without a cache)::

    from mlxrunner.testing import run_conformance

    def test_my_architecture_conforms():
        model = mlxrunner.load_model("tests/fixtures/tiny-my-model")
        run_conformance(model, prompt_len=12, draft_len=4)

Checks:

- :func:`check_prefill_decode`: a full forward equals prefill + token-by-token decode.
- :func:`check_taps`: the tapped hidden states have the right shape, each tap equals
  the same tap requested alone, logits do not change when taps are requested, and (when
  the model exposes ``layers``) tap ``t`` depends on layer ``t`` and not on layer ``t + 1``.
- :func:`check_taps_against`: taps equal an independent reference's hidden states
  (transformers' ``output_hidden_states``, entry ``t + 1`` for layer ``t``).
- :func:`check_cache_rollback`: the speculative round's snapshot / restore leaves every
  cache exactly as a plain run over the committed tokens would.
- :func:`check_compiled_step`: the core's traced forwards (decode steps, verify blocks with
  rollback) give what the eager forward gives, and are actually used (``run_conformance``
  names it only where the model's caches can be traced).
- :func:`run_conformance`: all of the above on random prompts.
- ``check_speculative_greedy``: defined in :mod:`mlxrunner.testing.speculative`
  and re-exported here (see "hook-in point" at the end of this module).

Output-parser helpers (``fresh_parser``, ``fixed_chunks``, ``chunkings``,
``feed_in_chunks``) are defined in :mod:`mlxrunner.testing.parsing` and re-exported here.

Default tolerances suit float32; pass a larger ``atol`` for bf16/fp16 or quantized models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .. import settings
from ..cache import Cache, prefix_cache_for
from ..decode.plain import prefill
from ..decode.step import compiled_steps, forward
from ..model.interface import Model
from ..nn.host_ops import unhosted

__all__ = [
    "compiled_steps",
    "forward",
    "check_cache_rollback",
    "check_compiled_step",
    "check_prefill_decode",
    "check_taps",
    "check_taps_against",
    "default_taps",
    "prefill",
    "prefix_cache_for",
    "random_prompt",
    "run_conformance",
]

DEFAULT_ATOL = 1e-4

IdsLike = Any  # mx.array, numpy array or nested lists of token ids, [B, L] or [L]


# -- helpers -----------------------------------------------------------------

def random_prompt(vocab_size: int, batch: int = 1, length: int = 8, seed: int = 0) -> mx.array:
    """Deterministic random token ids ``[batch, length]`` (int32), drawn from ``seed`` alone."""
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, vocab_size, (batch, length)).astype(np.int32))


def default_taps(num_layers: int) -> list[int]:
    """First, middle and last layer (ascending, without repeats)."""
    return sorted({0, num_layers // 2, num_layers - 1})


def _as_ids(ids: IdsLike) -> mx.array:
    arr = mx.array(np.asarray(ids, dtype=np.int32)) if not isinstance(ids, mx.array) else ids
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"token ids must be [B, L] with L >= 1, got shape {tuple(arr.shape)}")
    return arr.astype(mx.int32)


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)
    return np.asarray(x)


def _assert_close(actual: Any, expected: Any, atol: float, what: str) -> float:
    """Max abs error of ``actual`` against ``expected``; AssertionError when above ``atol``."""
    a = _to_numpy(actual).astype(np.float64)
    e = _to_numpy(expected).astype(np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape}, expected {e.shape}")
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if (nan_a != nan_e).any():
        idx = tuple(int(i) for i in np.argwhere(nan_a != nan_e)[0])
        raise AssertionError(f"{what}: NaN mismatch at index {idx} "
                             f"(got {a[idx]}, expected {e[idx]})")
    diff = np.where(nan_a, 0.0, np.abs(a - e))
    if diff.size == 0:
        return 0.0
    err = float(diff.max())
    if not err <= atol:
        idx = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), diff.shape))
        raise AssertionError(f"{what}: max |error| {err:.3g} > atol {atol:g} at index {idx} "
                             f"(got {a[idx]:.6g}, expected {e[idx]:.6g})")
    return err


def _fresh_caches(model: Model) -> list[Cache | None]:
    caches = list(model.make_cache())
    if len(caches) != model.num_layers:
        raise AssertionError(f"make_cache() returned {len(caches)} entries for "
                             f"{model.num_layers} layers (one per layer, None where a layer "
                             "keeps no state of its own)")
    for i, c in enumerate(caches):
        if c is not None and not isinstance(c, Cache):
            raise AssertionError(f"make_cache()[{i}] is {type(c).__name__}, "
                                 "not an mlxrunner.Cache (or None)")
    return caches


def _live(caches: Sequence[Cache | None]) -> list[tuple[int, Cache]]:
    return [(i, c) for i, c in enumerate(caches) if c is not None]


def _forward(model: Model, ids: mx.array, caches: Sequence[Cache | None] | None = None,
             taps: Sequence[int] | None = None) -> Any:
    """One forward, evaluated together with the caches it touched."""
    out = model(ids, caches, taps=taps) if taps is not None else model(ids, caches)
    arrays = list(out) if isinstance(out, tuple) else [out]
    state = [s for _, c in _live(caches or []) for s in c.state]
    mx.eval(*arrays, *state)
    return out


def _logits(model: Model, ids: mx.array, caches: Sequence[Cache | None] | None = None,
            what: str = "logits") -> mx.array:
    out = _forward(model, ids, caches)
    if isinstance(out, tuple):
        raise AssertionError(f"{what}: the model returned a tuple without taps requested")
    expected = (ids.shape[0], ids.shape[1], model.vocab_size)
    if tuple(out.shape) != expected:
        raise AssertionError(f"{what}: shape {tuple(out.shape)}, expected [B, L, V] = {expected}")
    return out


def _assert_offsets(caches: Sequence[Cache | None], expected: int, when: str) -> None:
    wrong = [(i, c.offset) for i, c in _live(caches) if c.offset != expected]
    if wrong:
        shown = ", ".join(f"layer {i}: {off}" for i, off in wrong[:4])
        raise AssertionError(f"{when}: cache offsets should be {expected}, got {shown}")


# -- prefill / decode --------------------------------------------------------

def check_prefill_decode(model: Model, ids: IdsLike, atol: float = DEFAULT_ATOL, *,
                         prefill_len: int | None = None) -> None:
    """A full forward without caches equals a cached prefill then token-by-token decode.

    Also checks that a one-shot forward through fresh caches equals the cache-free one,
    and that every cache's offset counts the tokens it has seen.
    """
    ids = _as_ids(ids)
    L = ids.shape[1]
    full = _logits(model, ids, None, "forward without cache")

    caches = _fresh_caches(model)
    one_shot = _logits(model, ids, caches, "forward through fresh caches")
    _assert_close(one_shot, full, atol, "forward through fresh caches vs without cache")
    _assert_offsets(caches, L, f"after a forward of {L} tokens")

    p = max(1, L // 2) if prefill_len is None else prefill_len
    if not 1 <= p <= L:
        raise ValueError(f"prefill_len must be in 1..{L}, got {p}")
    caches = _fresh_caches(model)
    rows = [_logits(model, ids[:, :p], caches, f"prefill of {p} tokens")]
    _assert_offsets(caches, p, f"after a prefill of {p} tokens")
    for i in range(p, L):
        rows.append(_logits(model, ids[:, i:i + 1], caches, f"decode step at position {i}"))
        _assert_offsets(caches, i + 1, f"after decoding position {i}")
    stepped = mx.concatenate(rows, axis=1)
    _assert_close(stepped, full, atol,
                  f"prefill {p} + decode {L - p} tokens vs one full forward (logits [B, L, V])")


# -- taps --------------------------------------------------------------------

def _tapped(model: Model, ids: mx.array, taps: Sequence[int]) -> tuple[mx.array, mx.array]:
    out = _forward(model, ids, None, taps=list(taps))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise AssertionError(f"forward with taps={list(taps)} must return (logits, tapped), "
                             f"got {type(out).__name__}")
    logits, tapped = out
    B, L = ids.shape
    expected = (B, L, len(taps) * model.hidden_size)
    if tuple(tapped.shape) != expected:
        raise AssertionError(f"taps={list(taps)}: tapped shape {tuple(tapped.shape)}, expected "
                             f"[B, L, len(taps) * hidden] = {expected}")
    return logits, tapped


def _tap_slice(tapped: mx.array, index: int, hidden: int) -> mx.array:
    return tapped[..., index * hidden:(index + 1) * hidden]


@contextmanager
def _perturbed(layer: nn.Module, seed: int):
    """Add noise to a layer's float parameters for the duration of the block."""
    original = layer.parameters()
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(original))
    keys = mx.random.split(mx.random.key(seed), max(len(flat), 1))
    noisy = []
    for (name, value), key in zip(flat, keys):
        if mx.issubdtype(value.dtype, mx.floating):
            scale = max(float(mx.abs(value.astype(mx.float32)).mean()), 0.1)
            noise = 0.5 * scale * mx.random.normal(value.shape, key=key)
            value = value + noise.astype(value.dtype)
        noisy.append((name, value))
    layer.update(tree_unflatten(noisy))
    try:
        yield
    finally:
        layer.update(original)


def _check_tap_layer_index(model: Model, ids: mx.array, taps: Sequence[int],
                           atol: float) -> None:
    """Tap ``t`` must move when layer ``t`` changes and stay put when layer ``t + 1`` does."""
    layers = model.layers
    hidden = model.hidden_size
    for t in taps:
        _, base = _tapped(model, ids, [t])
        with _perturbed(layers[t], seed=1000 + t):
            _, moved = _tapped(model, ids, [t])
        change = float(mx.abs(moved - base).max())
        if not change > atol:
            raise AssertionError(f"tap {t} did not change when layer {t}'s parameters were "
                                 f"perturbed (max change {change:.3g}): is it taken before "
                                 f"layer {t} instead of after it?")
        if t + 1 < len(layers):
            with _perturbed(layers[t + 1], seed=2000 + t):
                _, later = _tapped(model, ids, [t])
            _assert_close(_tap_slice(later, 0, hidden), base, atol,
                          f"tap {t} changed when layer {t + 1}'s parameters were perturbed (is "
                          f"it taken after layer {t + 1} instead of layer {t}?)")


def _has_layer_list(model: Model) -> bool:
    layers = getattr(model, "layers", None)
    return isinstance(layers, (list, tuple)) and len(layers) == model.num_layers


def check_taps(model: Model, prompt_ids: IdsLike, taps: Sequence[int],
               atol: float = DEFAULT_ATOL, *, check_layer_index: bool | None = None) -> None:
    """The tap contract of the Model interface.

    - ``model(ids, taps=taps)`` returns ``(logits, tapped)`` with ``tapped`` of shape
      ``[B, L, len(taps) * hidden]``;
    - its logits equal the forward without taps;
    - slice ``i`` of ``tapped`` equals the forward with ``taps=[taps[i]]`` alone;
    - with ``check_layer_index`` (default: when ``model.layers`` is a list of
      ``num_layers`` modules), perturbing layer ``t``'s parameters changes tap ``t``
      and perturbing layer ``t + 1``'s does not, which catches taps taken one layer
      too early or too late. Parameters are restored afterwards.
    """
    ids = _as_ids(prompt_ids)
    taps = [int(t) for t in taps]
    if not model.supports_taps:
        raise AssertionError(f"{type(model).__name__}.supports_taps is False")
    n = model.num_layers
    if not taps or any(not 0 <= t < n for t in taps) or taps != sorted(set(taps)):
        raise ValueError(f"taps must be ascending distinct layers in 0..{n - 1}, got {taps}")
    plain = _logits(model, ids, None, "forward without taps")
    logits, tapped = _tapped(model, ids, taps)
    _assert_close(logits, plain, atol, f"logits with taps={taps} vs without taps")
    hidden = model.hidden_size
    for i, t in enumerate(taps):
        _, alone = _tapped(model, ids, [t])
        _assert_close(_tap_slice(tapped, i, hidden), alone, atol,
                      f"slice {i} of taps={taps} (layer {t}) vs taps=[{t}] alone")
    if check_layer_index is None:
        check_layer_index = _has_layer_list(model)
    if check_layer_index:
        if not _has_layer_list(model):
            raise AssertionError("check_layer_index needs model.layers: a list of "
                                 f"num_layers = {n} modules")
        _check_tap_layer_index(model, ids, taps, atol)


def check_taps_against(model: Model, ids: IdsLike, taps: Sequence[int],
                       reference_hidden_states: Sequence[Any], atol: float = DEFAULT_ATOL, *,
                       last_entry_is_normed: bool = True) -> None:
    """Taps equal an independent reference's hidden states.

    ``reference_hidden_states`` follows transformers' ``output_hidden_states``: ``num_layers
    + 1`` arrays ``[B, L, hidden]`` (or one array with that leading axis), entry 0 the
    embeddings and entry ``t + 1`` the residual stream after layer ``t``. transformers puts
    the *final-normed* state in the last entry, while taps are taken before the final norm,
    so a tap on the last layer is skipped unless ``last_entry_is_normed=False`` says the
    reference's last entry is the pre-norm state.
    """
    ids = _as_ids(ids)
    taps = [int(t) for t in taps]
    n = model.num_layers
    reference = [_to_numpy(h) for h in reference_hidden_states]
    if len(reference) != n + 1:
        raise ValueError(f"reference_hidden_states has {len(reference)} entries; expected "
                         f"num_layers + 1 = {n + 1} (embeddings first)")
    _, tapped = _tapped(model, ids, taps)
    hidden = model.hidden_size
    for i, t in enumerate(taps):
        if t == n - 1 and last_entry_is_normed:
            continue
        ours = _to_numpy(_tap_slice(tapped, i, hidden))
        try:
            _assert_close(ours, reference[t + 1], atol,
                          f"tap {t} vs reference hidden_states[{t + 1}]")
        except AssertionError as exc:
            # Name the likely cause when the tap matches a neighbouring layer instead.
            for other in (t, t + 2):
                comparable = other <= n and not (other == n and last_entry_is_normed)
                if comparable and ours.shape == reference[other].shape and np.allclose(
                        ours, reference[other], rtol=0, atol=atol):
                    layer = "the embeddings" if other == 0 else f"layer {other - 1}"
                    raise AssertionError(f"{exc}; it matches hidden_states[{other}] (after "
                                         f"{layer}): the tap index is off by one") from None
            raise


# -- cache rollback ------------------------------------------------------------

def check_cache_rollback(model: Model, prompt_ids: IdsLike, draft_len: int,
                         accepted: int | Sequence[int], atol: float = DEFAULT_ATOL, *,
                         seed: int = 0, follow_up: int = 2) -> None:
    """Snapshot/restore of the speculative round equals a plain run over committed tokens.

    Like the speculative round: prefill ``prompt[:-1]`` (the last prompt token is the
    ``current`` token, not yet run); then per round (one per entry of ``accepted``):
    schedule snapshots at ``pos+1 .. pos+N`` (``N = draft_len``) on every cache, run one
    forward over ``[current, d_0 .. d_{N-1}]`` with random drafts, restore every cache to
    ``pos + 1 + accepted`` (the current offset when all were accepted), discard the
    snapshots, and commit the accepted drafts plus a correction token that becomes the next
    ``current``. Finally decode ``follow_up`` tokens one at a time.

    Compared with one plain forward over every committed token (fresh caches): the
    verify rows of the accepted prefix, the follow-up logits, and the cache offsets
    at every step. Layers whose cache is ``None`` are skipped.
    """
    ids = _as_ids(prompt_ids)
    B, P = ids.shape
    rounds = [int(accepted)] if isinstance(accepted, (int, np.integer)) else \
        [int(a) for a in accepted]
    if draft_len < 1:
        raise ValueError(f"draft_len must be >= 1, got {draft_len}")
    if not rounds or any(not 0 <= a <= draft_len for a in rounds):
        raise ValueError(f"accepted must be in 0..draft_len={draft_len}, got {rounds}")
    if follow_up < 1:
        raise ValueError(f"follow_up must be >= 1, got {follow_up}")
    V = model.vocab_size
    rng = np.random.default_rng(seed)

    committed = np.array(ids)  # every committed token; the last is `current` (not yet run)
    caches = _fresh_caches(model)
    if P > 1:
        _logits(model, ids[:, :-1], caches, f"prefill of {P - 1} tokens")
    _assert_offsets(caches, P - 1, f"after a prefill of {P - 1} tokens")

    verify_rows: list[tuple[int, mx.array]] = []  # (first position, accepted rows)
    for r, a in enumerate(rounds):
        pos = committed.shape[1] - 1
        drafts = rng.integers(0, V, (B, draft_len)).astype(np.int32)
        for _, c in _live(caches):
            c.schedule_snapshots(range(pos + 1, pos + draft_len + 1))
        block = mx.array(np.concatenate([committed[:, -1:], drafts], axis=1))
        verify = _logits(model, block, caches, f"round {r}: verify forward over "
                                               f"{draft_len + 1} tokens")
        _assert_offsets(caches, pos + draft_len + 1, f"round {r}: after the verify forward")
        keep = pos + 1 + a
        for i, c in _live(caches):
            try:
                c.restore(keep)
            except Exception as exc:
                raise AssertionError(f"round {r}: layer {i} ({type(c).__name__}) failed to "
                                     f"restore to offset {keep}: {exc}") from exc
            c.discard_snapshots()
        mx.eval(*[s for _, c in _live(caches) for s in c.state])
        _assert_offsets(caches, keep, f"round {r}: after restore({keep}) with {a} of "
                                      f"{draft_len} drafts accepted")
        verify_rows.append((pos, verify[:, :a + 1]))
        # The correction differs from the rejected draft, as a real rejection's would.
        correction = rng.integers(0, V, (B, 1)).astype(np.int32)
        if a < draft_len:
            correction = np.where(correction == drafts[:, a:a + 1], (correction + 1) % V,
                                  correction).astype(np.int32)
        committed = np.concatenate([committed, drafts[:, :a], correction], axis=1)

    extra = rng.integers(0, V, (B, follow_up - 1)).astype(np.int32)
    start = committed.shape[1] - 1
    committed = np.concatenate([committed, extra], axis=1)
    decoded = []
    for k in range(follow_up):
        step = mx.array(committed[:, start + k:start + k + 1])
        decoded.append(_logits(model, step, caches, f"decode step {k} after the rounds"))
        _assert_offsets(caches, start + k + 1, f"decode step {k} after the rounds")

    fresh = _fresh_caches(model)
    if [c is None for c in fresh] != [c is None for c in caches]:
        raise AssertionError("make_cache() returned a different pattern of None entries "
                             "on a second call")
    plain = _logits(model, mx.array(committed), fresh, "plain forward over committed tokens")
    _assert_offsets(fresh, committed.shape[1], "plain forward over committed tokens")
    for r, (pos, rows) in enumerate(verify_rows):
        _assert_close(rows, plain[:, pos:pos + rows.shape[1]], atol,
                      f"round {r}: verify logits of the accepted prefix vs a plain run")
    history = f"accepted per round {rounds} of {draft_len}"
    _assert_close(mx.concatenate(decoded, axis=1), plain[:, start:], atol,
                  f"logits decoded after rollback ({history}) vs a plain run over the "
                  "committed tokens")


# -- everything ----------------------------------------------------------------

def check_compiled_step(model: Model, prompt_ids: IdsLike, *, steps: int = 5, block: int = 4,
                        rounds: int = 4, taps: Sequence[int] | None = None,
                        atol: float = DEFAULT_ATOL, seed: int = 0,
                        require_replay: bool = True) -> int:
    """The core's traced forwards equal the eager forward and serve: after a prefill of
    ``prompt_ids``, ``steps`` one-token steps, ``rounds`` verify blocks of ``block`` tokens
    (snapshots scheduled, taps requested, rolled back to random accepted counts), then
    ``steps`` more steps; each forward's logits (and taps) through the compiled step are
    compared with the same forward run eagerly on caches of their own. Returns how many
    forwards replayed a trace (with ``require_replay``, AssertionError when none did: tracing
    did not apply, e.g. a cache class of the plugin's own, or switched itself off)."""
    ids = _as_ids(prompt_ids)
    vocab = model.vocab_size
    rng = np.random.default_rng(seed)
    use_taps = model.supports_taps
    chosen = (default_taps(model.num_layers) if taps is None else list(taps)) if use_taps \
        else None
    script: list[tuple[mx.array, int]] = []  # (ids, tokens to keep) per forward
    for _ in range(steps):
        script.append((random_prompt(vocab, ids.shape[0], 1, int(rng.integers(1 << 30))), 1))
    for _ in range(rounds):
        keep = int(rng.integers(1, block + 1))
        script.append((random_prompt(vocab, ids.shape[0], block, int(rng.integers(1 << 30))),
                       keep))
    for _ in range(steps):
        script.append((random_prompt(vocab, ids.shape[0], 1, int(rng.integers(1 << 30))), 1))

    def run(compiled: bool) -> list[Any]:
        outs = []
        # eager forwards as MLX's operations, as a trace computes (not the host's layers)
        with settings.overridden(compile=compiled), unhosted():
            caches = _fresh_caches(model)
            _forward(model, ids, caches)
            offset = ids.shape[1]
            for step_ids, keep in script:
                n = step_ids.shape[1]
                live = [c for _, c in _live(caches)]
                for c in live:
                    c.schedule_snapshots(range(offset + 1, offset + n))
                with_taps = n > 1 and chosen is not None
                out = forward(model, step_ids, caches, chosen if with_taps else None)
                arrays = list(out) if with_taps else [out]
                mx.eval(*arrays, *[a for c in live for a in c.state])
                outs.append(arrays)
                if keep < n:
                    for c in live:
                        c.restore(offset + keep)
                for c in live:
                    c.discard_snapshots()
                offset += keep
        return outs

    steps_before = compiled_steps(model)
    steps_before.clear()
    steps_before.enabled = True
    eager, traced = run(False), run(True)
    for i, (want, got) in enumerate(zip(eager, traced)):
        for j, (w, g) in enumerate(zip(want, got)):
            what = ("logits", "taps")[j]
            _assert_close(g, w, atol, f"compiled step: forward {i} ({script[i][0].shape[1]} "
                          f"tokens) {what}")
    states = compiled_steps(model)
    if not states.enabled:
        raise AssertionError(f"compiled step: tracing switched itself off: {states.fallback}")
    replays = states.replays()
    if replays == 0 and require_replay:
        raise AssertionError("compiled step: no forward replayed a trace (the caches' "
                             "trace_key said None, or tracing does not apply)")
    return replays


def run_conformance(model: Model, *, seed: int = 0, batch: int = 1, prompt_len: int = 12,
                    draft_len: int = 4, accepted: int | Sequence[int] | None = None,
                    rounds: int = 3, taps: Sequence[int] | None = None,
                    atol: float = DEFAULT_ATOL,
                    draft_factory: Callable[..., Any] | None = None) -> list[str]:
    """Run every check on random prompts drawn from ``seed``; return the names of those run.

    Plain values only, so hypothesis can drive it (``@given(seed=..., prompt_len=...)``).
    ``accepted=None`` runs ``rounds`` rounds that accept 0, then all ``draft_len``, then
    random counts. ``taps=None`` taps the first, middle and last layer; taps are skipped
    when the model sets ``supports_taps = False``. For sliding-window layers choose a
    ``prompt_len`` beyond the window so that rollback runs on a wrapped ring.

    ``draft_factory`` (``draft_factory(model) -> draft``) adds the speculative check
    ``check_speculative_greedy(model, draft_factory, prompt_ids=..., seed=...)`` from
    :mod:`mlxrunner.testing.speculative`.
    """
    if prompt_len < 1 or batch < 1:
        raise ValueError(f"prompt_len and batch must be >= 1, got {prompt_len}, {batch}")
    prompt = random_prompt(model.vocab_size, batch, prompt_len, seed)
    ran = []
    check_prefill_decode(model, prompt, atol)
    ran.append("prefill_decode")
    if model.supports_taps:
        chosen = default_taps(model.num_layers) if taps is None else list(taps)
        check_taps(model, prompt, chosen, atol)
        ran.append("taps+layer_index" if _has_layer_list(model) else "taps")
    if accepted is None:
        rng = np.random.default_rng(seed)
        accepted = ([0, draft_len] + [int(a) for a in rng.integers(0, draft_len + 1, rounds)]
                    )[:rounds]
    check_cache_rollback(model, prompt, draft_len, accepted, atol, seed=seed)
    ran.append("cache_rollback")
    if check_compiled_step(model, prompt, block=draft_len + 1, atol=atol, seed=seed,
                           require_replay=False):
        ran.append("compiled_step")
    if draft_factory is not None:
        _speculative_check()(model, draft_factory, prompt_ids=prompt, seed=seed)
        ran.append("speculative_greedy")
    return ran


# -- speculative decoding: hook-in point -----------------------------------------
# ``check_speculative_greedy`` (and any other speculative checks) live in .speculative,
# written together with the speculative round. Every name in its ``__all__`` (or, without
# one, ``check_speculative_greedy`` when defined) is re-exported here, so that module grows
# without edits to this one. Imported last: it may use the helpers above.

def _speculative_check() -> Callable[..., None]:
    check = globals().get("check_speculative_greedy")
    if check is None:
        raise NotImplementedError("mlxrunner.testing.speculative does not define "
                                  "check_speculative_greedy yet")
    return check


from . import speculative as _speculative  # noqa: E402


def _reexport(module: Any) -> None:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in ("check_speculative_greedy",) if hasattr(module, n)]
    for name in names:
        globals()[name] = getattr(module, name)
        if name not in __all__:
            __all__.append(name)


_reexport(_speculative)

from . import parsing as _parsing  # noqa: E402

_reexport(_parsing)
