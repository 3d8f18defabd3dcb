"""Draft architectures: the interface a speculative draft provides, and loading one.

A draft plugin subclasses :class:`DraftModel` (an ``mlx.nn.Module``) and
registers the class through ``register_drafts`` under the name its checkpoints
carry in ``config.json``'s ``architectures[0]``. The core builds it with the
target in hand (``DraftModel(config, target)``), so that it can borrow the
target's ``embed_tokens`` and ``raw_logits``, asks it which target layers it reads
(``taps``) and how many tokens a round may draft (``max_depth``), checks it against
the target with :meth:`validate`, loads its weights strictly, and then only ever
talks to it through :meth:`DraftModel.new_session` and the :class:`DraftSession`
it returns. A block draft's settings (DFlash's kind) are :mod:`.block_draft`'s.

The speculative round (:class:`mlxrunner.batch.Scheduler`'s, for one sequence or many)
knows nothing else about a draft: per generation it calls ``prefill`` with the prompt's
tapped target states, and per round ``propose(current, pos, n)`` then ``commit`` with the
tapped states of the tokens the round committed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from ..errors import DraftConfigError, ModelFolderError
from ..host import manager as plugins
from .config_bounds import check_config
from .distribution import Distribution
from .interface import Model, compute_dtype_of, weight_precision_of
from .loading import install_weights, read_config, read_json, read_weights, weight_files
from .safetensors import check_safetensors

if TYPE_CHECKING:  # pragma: no cover
    from ..decode.sampler import Sampler

BUNDLE_PREFIX = "draft."
"""Tensor-name prefix of a draft stored beside its target in one bundle."""

DraftT = TypeVar("DraftT", bound="DraftModel")


@dataclass
class DraftProposal:
    """The tokens a draft proposes for one round, and what they were drawn from.

    ``tokens`` [N] int32. ``probs`` holds q_i, the distribution row i was drawn
    from: dense ``[N, V]`` when ``ids`` is None, else sparse ``[N, K]`` over the
    candidate ids ``ids`` [N, K] (unique within a row). At temperature 0 the
    draft's choice is a point mass (:meth:`point_mass`). All lazy arrays.
    """

    tokens: mx.array
    probs: mx.array
    ids: mx.array | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def point_mass(cls, tokens: mx.array) -> DraftProposal:
        """Deterministic proposals: q_i is one on ``tokens[i]``."""
        tokens = tokens.reshape(-1).astype(mx.int32)
        return cls(tokens, mx.ones((tokens.shape[0], 1), dtype=mx.float32), tokens[:, None])

    def distribution(self) -> Distribution:
        """q as the sampler's :class:`~mlxrunner.model.distribution.Distribution` (rows =
        drafts)."""
        return Distribution(self.probs.astype(mx.float32), self.ids)


class DraftSession:
    """One generation's draft state: the context built from the target's tapped states.

    Positions are absolute: the context holds rows ``0 .. pos-1`` (every token the
    target has already run), ``current`` sits at ``pos``. Subclasses implement
    :meth:`prefill`, :meth:`propose` and :meth:`commit`.
    """

    def __init__(self, draft: DraftModel, sampler: Sampler) -> None:
        self.draft = draft
        self.sampler = sampler
        self.temperature = float(sampler.options.temperature)

    def bind_target_caches(self, caches: Sequence[Any] | None) -> None:
        """The target's caches of this generation, read-only (as ``make_cache`` lists them;
        None: let go of them). Whoever runs the generation binds them before the prefill and
        before each round's :meth:`propose`, since a batch moves a sequence's caches into
        its rows: a draft that attends over the target's keys and values
        (``reads_target_caches``) keeps them; the default ignores them."""

    def extend_tokens(self, ids: Sequence[int]) -> None:
        """The token ids the generation commits, in order: the prompt before prefill, then
        the first token, then each round's emitted tokens before that round's
        :meth:`commit`. A draft that pairs a position's state with the token after it (an
        MTP head) keeps them; the default ignores them."""

    def prefill(self, tapped: mx.array) -> None:
        """Context rows for the prompt: ``tapped`` [1, P, len(taps) * hidden]. Called once per
        prefill chunk, in order: the first call's rows sit at positions 0..P-1."""
        raise NotImplementedError

    def propose(self, current: int, pos: int, n: int) -> DraftProposal:
        """Propose ``n`` tokens to follow ``current`` (at ``pos``); 1 <= n <= max_depth.

        Draw with the request's temperature only (through :meth:`draw`, so a
        seeded request stays reproducible); record each row's distribution.
        Nothing the block computes may stay in the context.
        """
        raise NotImplementedError

    def commit(self, tapped: mx.array) -> None:
        """The round committed the tokens at ``pos .. pos+a`` (``current`` and ``a`` accepted
        drafts); ``tapped`` [1, a+1, len(taps) * hidden] are their states from the verify
        forward. Append them to the context and drop whatever the round's block left behind."""
        raise NotImplementedError

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate with the target's caches after each prefill chunk."""
        return []

    # -- helpers for subclasses ---------------------------------------------
    def draw(self, probs: mx.array, ids: mx.array | None = None) -> mx.array:
        """One draw per row of ``probs`` from the request's random stream: [R] int32.

        Dense rows return token ids; with ``ids`` the chosen ``ids`` entries; rows of a
        sparse ``probs`` without ``ids`` return the chosen column (a slot index).
        """
        if probs.ndim == 1:
            probs = probs[None]
        return self.sampler.draw(Distribution(probs.astype(mx.float32), ids))


class _Borrowed:
    """Holds the target outside the draft's parameter tree (an ``nn.Module`` would adopt it)."""

    __slots__ = ("target",)

    def __init__(self, target: Model) -> None:
        self.target = target


class DraftModel(nn.Module):
    """Base class of draft architectures.

    Built as ``cls(config, target)`` from the draft's parsed ``config.json`` (or the target's,
    for a draft its checkpoint carries). A subclass declares :attr:`taps` (the target layers
    whose states it reads) and :attr:`max_depth` (most drafts a round), and makes sessions
    (:meth:`new_session`). The base keeps the target out of its own parameters and gives
    :meth:`embed_tokens` and :meth:`raw_logits` that are the target's. Keep parsed settings
    in plain attributes or dataclasses (an ``nn.Module`` treats dict attributes as parameter
    trees). A block draft (DFlash's kind) subclasses :class:`~mlxrunner.plugin.BlockDraft`.
    """

    #: a session may change its depth from round to round (the core's depth controller);
    #: False: always draft ``max_depth`` (budget permitting)
    adaptive_depth: bool = False
    #: the draft attends over the target's own caches (a Gemma 4 assistant): it cannot run
    #: beside a target sharded over several processes, whose caches each hold a part
    reads_target_caches: bool = False
    #: what errors call the taps (a draft format's own name for them)
    taps_setting: str = "taps"

    def __init__(self, config: dict[str, Any], target: Model) -> None:
        super().__init__()
        self._config = MappingProxyType(dict(config))
        self._borrowed = _Borrowed(target)

    # -- the contract ----------------------------------------------------------
    @property
    def config(self) -> Mapping[str, Any]:
        """The parsed config.json (read-only)."""
        return self._config

    @property
    def target(self) -> Model:
        return self._borrowed.target

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose states the draft reads, ascending (the sessions get them
        joined: ``[1, rows, len(taps) * hidden]``)."""
        raise NotImplementedError(f"{type(self).__name__} declares no taps")

    @property
    def max_depth(self) -> int:
        """Most drafts a round proposes."""
        raise NotImplementedError(f"{type(self).__name__} declares no max_depth")

    def new_session(self, sampler: Sampler) -> DraftSession:
        """A fresh per-generation session drawing from ``sampler``'s stream."""
        raise NotImplementedError

    @classmethod
    def config_for_checkpoint(cls, config: dict[str, Any],
                              tensor_names: Iterable[str]) -> dict[str, Any]:
        """The config to build with, given the checkpoint's tensor names (a subclass may
        settle optional parts this way). The base changes nothing."""
        return dict(config)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint names to this module's names; drop what is not used."""
        return weights

    def validate(self, target: Model) -> None:
        """Check this draft fits ``target``; raise one clear :class:`DraftConfigError`. The
        base checks the taps and the depth; a subclass adds its own checks."""
        name = type(self).__name__
        if not target.supports_taps:
            raise DraftConfigError(f"{type(target).__name__} does not expose layer taps, "
                                   f"which the {name} draft needs")
        taps, what = list(self.taps), self.taps_setting
        if not taps:
            raise DraftConfigError(f"{name}: {what} is empty")
        if any(b <= a for a, b in zip(taps, taps[1:])):
            raise DraftConfigError(f"{name}: {what} {taps} are not strictly ascending")
        layers = target.num_layers
        bad = [t for t in taps if not 0 <= t < layers]
        if bad:
            raise DraftConfigError(f"{name}: {what} {bad} are outside the target's "
                                   f"{layers} layers (0..{layers - 1})")
        if self.max_depth < 1:
            raise DraftConfigError(f"{name}: a round must draft at least 1 token, this draft "
                                   f"drafts at most {self.max_depth}")

    # -- the target's embedding and head -------------------------------------------
    def embed_tokens(self, ids: mx.array) -> mx.array:
        """Token embeddings: the target's (a draft with its own table overrides this)."""
        return self.target.embed_tokens(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        """The output head on normalised hidden states: the target's."""
        return self.target.raw_logits(hidden)

    # -- facts -------------------------------------------------------------------
    @property
    def dtype(self) -> mx.Dtype:
        return compute_dtype_of(self)

    @property
    def weight_precision(self) -> str:
        """The draft's own weights' precision (never mixed with the target's)."""
        return weight_precision_of(self)


# -- loading -------------------------------------------------------------------------


def _bundle_draft_config(folder: Path) -> dict[str, Any] | None:
    """A bundle's draft config: ``draft_config.json``, else config.json's ``draft_config``."""
    candidate = folder / "draft_config.json"
    if candidate.exists():
        config = read_json(candidate, "draft config")
        return config if isinstance(config, dict) else None
    inner = read_config(folder).get("draft_config")
    return inner if isinstance(inner, dict) else None


def load_draft(path: str | Path, target: Model, *, bundle: bool = False,
               dtype: str | mx.Dtype | None = None) -> DraftModel | None:
    """The draft of ``path`` built for ``target``, weights loaded strictly.

    ``path`` is a draft folder (``config.json`` + safetensors, plain tensor
    names), or with ``bundle=True`` a model folder whose safetensors also hold
    the draft's tensors under ``draft.``; its config is ``draft_config.json`` or
    the ``draft_config`` object of ``config.json``. A bundle without ``draft.``
    tensors gives None. The class is the registered draft named by the config's
    ``architectures[0]``. Errors: :class:`DraftConfigError` when the draft does
    not fit the target, :class:`ModelFolderError` for a broken folder.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: draft folder not found")
    if bundle:
        try:
            files = weight_files(folder)
        except ModelFolderError:
            return None
        holding = [f for f in files
                   if any(n.startswith(BUNDLE_PREFIX) for n in check_safetensors(f))]
        if not holding:
            return None
        config = _bundle_draft_config(folder)
        if config is None:
            raise DraftConfigError(f"{folder}: the weights hold draft.* tensors but there is no "
                                   "draft config (draft_config.json or config.json's draft_config)")
        weights = {k[len(BUNDLE_PREFIX):]: v for k, v in read_weights(holding).items()
                   if k.startswith(BUNDLE_PREFIX)}
        where = folder
    else:
        config = read_json(folder / "config.json", "config.json")
        if not isinstance(config, dict):
            raise ModelFolderError(f"{folder / 'config.json'}: expected a JSON object")
        weights = read_weights(weight_files(folder))
        where = folder
    archs = config.get("architectures") or []
    if not archs:
        raise DraftConfigError(f"{where}: draft config names no architecture "
                               "(architectures[0], e.g. DFlashDraftModel)")
    cls = plugins.lookup("drafts", str(archs[0]),
                         suggestion="try `pip install mlxrunner-dflash`").obj
    draft = build_draft(cls, config, target, weights.keys())
    install_weights(draft, config, weights, where, dtype, what=f"draft {archs[0]}")
    return draft


def build_draft(cls: type[DraftT], config: Mapping[str, Any], target: Model,
                tensor_names: Iterable[str] = ()) -> DraftT:
    """Construct and validate a draft (random weights until loaded)."""
    config = cls.config_for_checkpoint(dict(config), tensor_names)
    check_config(config, cls, where="draft config")
    try:
        draft = cls(config, target)
    except DraftConfigError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftConfigError(f"{cls.__name__}: bad draft config ({type(exc).__name__}: "
                               f"{exc})") from None
    try:
        draft.validate(target)
    except NotImplementedError:  # a subclass of the base before it stopped reading them
        raise DraftConfigError(
            f"{cls.__name__}: a draft declares its taps and max_depth (a block draft whose "
            "config gives target_layer_ids, block_size and mask_token_id subclasses "
            "mlxrunner.plugin.BlockDraft)") from None
    return draft
