"""``--privacy dp``: the flags, the protocol layer, and how DP attaches to a run's parties.

What each setting installs (threat models in :mod:`protocols.dp.label_dp`, :mod:`protocols.dp.rr`,
:mod:`protocols.dp.feature_dp`):

``--dp-mechanism auto`` (default)
    the label mechanism with the best measured utility for the task (:func:`protocols.dp.choice.choose_mechanism`).
``--dp-protect labels --dp-mechanism gradient``
    the label party's backward rule becomes :class:`LabelDPRule` (joint per-sample clipping of the cut-layer rows
    and the head gradient, one calibrated Gaussian); the :class:`DPLayer` refuses any gradient message that leaves
    the label party without having gone through it.
``--dp-protect labels --dp-mechanism rr``
    the label party replaces its training labels once, before training, by randomized response; the layer keeps
    the randomised labels in its state so a resumed run reuses them instead of spending epsilon again.
``--dp-protect labels --dp-mechanism rr-prior``
    randomized response with a prior learned in two stages (:mod:`protocols.dp.staged`): part 1's labels by RR before
    training, part 2's by RRWithPrior when stage 2 starts, the prior being the stage-1 model's prediction.
``--dp-protect labels --dp-mechanism alibi``
    ALIBI (:mod:`protocols.dp.alibi`): each label's one-hot vector plus Laplace noise, once, before training; the label
    party trains on the Bayesian posteriors (:class:`protocols.dp.targets.TargetBackward`).
``--algo ogd | slr | dlr`` (labels from a stream, ``AlgorithmTraits.streamed_labels``)
    ``rr`` only (``auto`` picks it; the rest is refused with its reason): :class:`protocols.dp.stream.StreamRR`,
    installed through the label party's ``install_label_transform`` hook, randomises each label once, as its event
    is taken from the feed; epsilon per stream sample, the ledger charges blocks (a resumed block is released again).
``--dp-protect features``
    every protected feature party clips and noises each training embedding row it releases and trains its bottom
    model with DP-SGD (:class:`FeatureDP`); the layer refuses an embedding message from it that bypassed that.

The noise plan (multiplier, epsilon) is fixed before training by :func:`protocols.dp.config.plan_dp`. Every release
is recorded in the releasing party's ledger before it is made (:mod:`protocols.dp.ledger`), and a run refuses to go
on when finishing would spend more than its budget, counting what interrupted processes released.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from protocols.dp.alibi import alibi_soft_labels
from protocols.dp.choice import choose_mechanism
from protocols.dp.collapse import chance_accuracy, chance_f1, utility_collapse
from protocols.dp.config import LABEL_RELEASE_MECHANISMS, DPConfig, DPPlan, plan_dp
from protocols.dp.feature_dp import FeatureDP
from protocols.dp.label_dp import LabelDPRule
from protocols.dp.ledger import (
    ReleaseLedger,
    epsilon_spent,
    ledger_header,
    releases_per_sample,
    repeated_releases,
    replay_key,
)
from protocols.dp.options import DPOptions
from protocols.dp.private import PARTY_DIRS, STAGE2_FILE, TrainLossKeeper, party_dir
from protocols.dp.rng import NoiseSource, make_noise_source
from protocols.dp.rr import randomized_response
from protocols.dp.staged import TwoStageRR, stage2_epoch_for, stage_split
from protocols.dp.statement import privacy_markdown, privacy_statement, privacy_summary
from protocols.dp.stream import StreamRR
from protocols.dp.targets import TargetBackward
from secvfl.errors import ConfigError, ProtocolError, UnsupportedError
from secvfl.io import write_json_atomic
from secvfl.messages import Message
from secvfl.parties import ProtocolHooks
from secvfl.plugins import ProtocolPlugin, ProtocolSetup
from secvfl.runlock import resume_command
from secvfl.transport.layers import AlgorithmTraits, Layer, Role, Topology

if TYPE_CHECKING:
    from secvfl.algorithms.base import Algorithm, RunContext
    from secvfl.config import TrainConfig
    from secvfl.transport.network import Network

__all__ = ["DPLayer", "DPPlugin", "FeatureDPRelease"]


class DPLayer(Layer):
    """The DP protocol layer: refuses algorithms it cannot serve and releases that bypassed the mechanism."""

    name: ClassVar[str] = "dp"

    def __init__(self, plan: DPPlan, *, secure_rng: bool, protected: list[str] | None = None,
                 replay: str | None = None) -> None:
        self.plan = plan
        self.secure_rng = secure_rng
        self.protected = list(protected or [])
        self.rule: LabelDPRule | None = None
        self.features: dict[str, FeatureDP] = {}
        self.feature_released: dict[str, int] = {}  # party -> step of its last DP-processed output
        self.rr_labels: np.ndarray | None = None
        self.rr_install = None  # callable(labels) installing randomized labels at the label party
        # rr-prior and alibi: the label party trains on released targets through this rule
        self.targets_rule: TargetBackward | None = None
        self.targets_install = None  # callable(targets) installing released targets at the label party
        self.staged: TwoStageRR | None = None  # rr-prior's stages
        self.alibi_targets: np.ndarray | None = None  # alibi's released soft labels
        self.stream: StreamRR | None = None  # rr on a stream: each label randomised as it arrives (online algorithms)
        self.stream_checked = 0  # stream labels released when the label party last sent gradients
        # rr, rr-prior's stage 1, alibi: the labels were randomised by this process (not restored from a checkpoint)
        self.labels_released_here = False
        self.ledgers: dict[str, ReleaseLedger] = {}  # releasing party -> its release ledger (see bind)
        self.replay = replay
        self.run_dir: Path | None = None

    def bind(self, topology: Topology) -> None:
        super().bind(topology)
        # (an algorithm without one label party is refused with its reason when DP attaches to it)
        labels = topology.parties(Role.LABEL)
        releasing = self.protected if self.plan.protects == "features" else labels[:1] if len(labels) == 1 else []
        self.ledgers = {p: ReleaseLedger(p, ledger_header(self.plan, p), self.replay) for p in releasing}

    # -- the release ledger (protocols.dp.ledger) ---------------------------------------------------------------
    def start_epoch(self, net: Network, epoch: int) -> None:
        # written (durably, once the run directory is known) before this process releases anything of the epoch
        if self.plan.config.stream:  # the block's stream samples, randomised as they arrive
            for ledger in self.ledgers.values():
                ledger.record("block", epoch)
            return
        if self.plan.mechanism not in LABEL_RELEASE_MECHANISMS:
            for ledger in self.ledgers.values():
                ledger.record("epoch", epoch)
            return
        part = "stage1" if self.plan.mechanism == "rr-prior" else "labels"
        for ledger in self.ledgers.values():
            if self.labels_released_here and not ledger.recorded(part):
                ledger.record(part, epoch)

    def stored_stage2(self) -> dict[str, Any] | None:
        """rr-prior's stage-2 release, if an earlier process of this run made it (stored before it was used)."""
        if self.run_dir is None:
            return None
        path = party_dir(self.run_dir, self.topology.label_party) / STAGE2_FILE
        if not path.exists():
            return None
        try:
            stored = json.loads(path.read_text())
            if not {"labels", "stage1", "priors", "stage2_epoch"} <= set(stored):
                raise ValueError
            return stored
        except (OSError, UnicodeDecodeError, ValueError, TypeError):
            raise ConfigError(f"rr-prior's stored stage-2 release {path} is damaged; releasing the labels again would "
                              "spend epsilon twice: start a new run (another --out)") from None

    def store_stage2(self, epoch: int) -> None:
        """Keep rr-prior's stage-2 release and record it in the ledger, before the labels are used."""
        assert self.staged is not None
        if self.run_dir is not None:
            write_json_atomic(party_dir(self.run_dir, self.topology.label_party) / STAGE2_FILE,
                              self.staged.state_dict())
        for ledger in self.ledgers.values():
            ledger.record("stage2", epoch)

    def ledger_entries(self) -> list[dict[str, Any]]:
        """The releases recorded so far (every releasing party's ledger holds the same epochs; the longest counts)."""
        return max((ledger.entries for ledger in self.ledgers.values()), key=len, default=[])

    # -- validity ---------------------------------------------------------------------------------------------
    def across_processes(self) -> str | None:
        if self.plan.protects == "labels":
            return None  # every release, its accounting and its ledger are the label party's, in the coordinator
        return ("feature DP releases and accounts in each feature party, while the coordinator reports the privacy "
                "spent; it is not yet gathered across processes")

    def check(self, traits: AlgorithmTraits) -> list[str]:
        problems = []
        if not traits.gradient_based and self.plan.mechanism == "gradient":
            problems.append(f"the gradient mechanism clips and noises gradients, and {traits.name} sends none")
        if self.plan.protects == "labels":
            if traits.shares_labels:
                problems.append(f"{traits.name} sends the labels to the feature parties, so label DP cannot protect them")
            elif traits.labels_at_every_party:
                problems.append(
                    f"every {traits.name} party holds the labels, so there is no party to protect them from; "
                    "use --dp-protect features, or splitnn/vafl/fdml"
                )
        else:
            if traits.aggregation == "none":
                problems.append(f"in {traits.name} no feature rows or embeddings cross party boundaries")
        return problems

    # -- messages ---------------------------------------------------------------------------------------------
    def outbound(self, messages: list[Message], party: str) -> list[Message]:
        role = self.topology.roles.get(party)
        if self.plan.mechanism == "gradient" and self.plan.protects == "labels" and role == Role.LABEL:
            if any(m.kind == "gradient" for m in messages):
                if self.rule is None or not self.rule.pending_release:
                    raise ProtocolError(
                        f"label DP: gradient messages from {party} did not go through the DP backward rule; "
                        "refusing to release them"
                    )
                self.rule.pending_release = False
        if self.stream is not None and role == Role.LABEL and any(m.kind == "gradient" for m in messages):
            # a round's gradients follow the randomisation of that round's label
            if self.stream.released <= self.stream_checked:
                raise ProtocolError(f"label DP: gradient messages from {party} were sent without a stream label "
                                    "randomised for their round; refusing to release them")
            self.stream_checked = self.stream.released
        if self.targets_rule is not None and role == Role.LABEL and any(m.kind == "gradient" for m in messages):
            if not self.targets_rule.pending_release:
                raise ProtocolError(
                    f"label DP: gradient messages from {party} were not computed from the released labels; "
                    "refusing to release them"
                )
            self.targets_rule.pending_release = False
        if self.plan.protects == "features" and party in self.features:
            for m in messages:
                # every output message must belong to the step the party's DP forward last released
                if m.kind in ("embedding", "logits") and self.feature_released.get(party) != m.step:
                    raise ProtocolError(f"feature DP: an output of {party} bypassed clipping and noise; refusing it")
        return messages

    # -- facts and state --------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layer": self.name, "mechanism": self.plan.mechanism, "protects": self.plan.protects,
                             "epsilon": self.plan.epsilon, "delta": self.plan.delta}
        if self.rule is not None:
            d.update(self.rule.describe())
        if self.features:
            d["feature_parties"] = {p: f.describe() for p, f in self.features.items()}
        if self.targets_rule is not None:
            d.update(self.targets_rule.describe())
        if self.staged is not None:
            d["stages"] = self.staged.describe()
        if self.stream is not None:
            d.update(self.stream.describe())
        return d

    def mechanism_state(self) -> dict[str, Any]:
        """What the label-release mechanisms (rr-prior, alibi) have released: a resumed run reuses it instead of
        releasing the labels again (which would spend epsilon twice). Released values only, never true labels."""
        state: dict[str, Any] = {}
        if self.staged is not None:
            state["rr_prior"] = self.staged.state_dict()
        if self.alibi_targets is not None:
            state["alibi_targets"] = self.alibi_targets.tolist()
        if self.targets_rule is not None:
            state["targets_rule"] = self.targets_rule.describe()
        return state

    def load_mechanism_state(self, state: dict[str, Any]) -> None:
        if any(k in state for k in ("rr_prior", "alibi_targets", "rr_labels")):
            self.labels_released_here = False  # the labels an earlier process released are used, not this one's
        if "rr_prior" in state and self.staged is not None:
            self.staged.load_state_dict(state["rr_prior"])
            if self.targets_install is not None:
                self.targets_install(self.staged.likelihoods())
        if "alibi_targets" in state:
            self.alibi_targets = np.asarray(state["alibi_targets"], dtype=np.float64)
            if self.targets_install is not None:
                self.targets_install(self.alibi_targets)
        if "targets_rule" in state and self.targets_rule is not None:
            self.targets_rule.steps = int(state["targets_rule"]["steps"])
            self.targets_rule.rows_trained = int(state["targets_rule"]["rows_trained"])

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.rr_labels is not None:
            # Randomised labels are themselves epsilon-DP, so keeping them is safe; reusing them on resume avoids
            # a second randomized response of the same labels (which would spend epsilon twice).
            state["rr_labels"] = self.rr_labels.tolist()
        if self.rule is not None:
            state["rule"] = {"steps": self.rule.steps, "rows_released": self.rule.rows_released,
                             "clipped_rows": self.rule.clipped_rows}
            if self.rule.posterior is not None:
                state["posterior"] = self.rule.posterior.state_dict()
        state.update(self.mechanism_state())
        if self.stream is not None:
            state["rr_stream"] = self.stream.state_dict()
        # Where each noise stream stands, so a resumed --dp-reproducible run draws the noise an uninterrupted one
        # would (a secure stream gets a fresh key in a new process; its position is kept only for the record).
        state["noise"] = {purpose: source.state_dict() for purpose, source in self.noise_sources().items()}
        state["noise_multiplier"] = self.plan.noise_multiplier
        return state

    def noise_sources(self) -> dict[str, NoiseSource]:
        """Every noise stream that draws during training, by purpose (checkpointed by position)."""
        sources: dict[str, NoiseSource] = {}
        if self.rule is not None:
            sources["label-dp"] = self.rule.noise
        for party, mech in self.features.items():
            sources[f"feature-dp/{party}"] = mech.noise
        if self.stream is not None:
            sources["rr-stream"] = self.stream.noise
        return sources

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, now = state.get("noise_multiplier"), self.plan.noise_multiplier
        if saved is not None and now is not None and not math.isclose(float(saved), float(now), rel_tol=1e-9):
            # --epsilon calibrates the noise for the configured epochs; more epochs would need more noise, and
            # the epochs already trained had less: the run's guarantee would no longer hold.
            raise ConfigError(
                f"this DP run drew noise with multiplier {float(saved):.4g}, but its settings now call for "
                f"{float(now):.4g} (--epsilon calibrates the noise for the planned --epochs, "
                "so it cannot be trained longer); start a new run with the epochs you need, or use --noise-multiplier "
                "(its epsilon is reported for however many epochs are run)"
            )
        sources = self.noise_sources()
        for purpose, position in state.get("noise", {}).items():
            if purpose in sources:
                sources[purpose].load_state_dict(position)
        self.load_mechanism_state(state)
        if "rr_stream" in state and self.stream is not None:
            self.stream.load_state_dict(state["rr_stream"])
            self.stream_checked = self.stream.released
        if "rr_labels" in state:
            self.rr_labels = np.asarray(state["rr_labels"], dtype=np.int64)
            if self.rr_install is not None:
                self.rr_install(self.rr_labels)
        if "rule" in state and self.rule is not None:
            self.rule.steps = int(state["rule"]["steps"])
            self.rule.rows_released = int(state["rule"]["rows_released"])
            self.rule.clipped_rows = float(state["rule"]["clipped_rows"])
            if "posterior" in state and self.rule.posterior_rows is not None:
                from protocols.dp.denoise import LabelPosterior

                p = state["posterior"]
                self.rule.posterior = LabelPosterior(self.rule.posterior_rows, int(p["sums"].shape[1]),
                                                     self.rule.noise_std)
                self.rule.posterior.load_state_dict(p)


class FeatureDPRelease:
    """Feature DP as a party's release rule (:class:`secvfl.parties.ReleaseRule`); the code runs as that party.

    Training rows leave clipped to ``C_e`` and noised; rows of other splits leave clipped (evaluation releases of
    non-training rows are not accounted, so training rows may not be released outside training); the model's
    gradients are per-sample clipped and noised (DP-SGD). A LASER-VFL party's heads train on the released rows, so
    the gradients it sends its peers are post-processing and its heads need no noise of their own.

    The rule holds only its own party's mechanism (its model and noise stream) and the layer's record of release
    steps (public step numbers, which the layer checks outgoing messages against), never the layer itself: that holds
    every protected party's mechanism, hence every protected party's model.
    """

    def __init__(self, mech: FeatureDP, layer: DPLayer) -> None:
        self.mech = mech
        self.released_steps: dict[str, int] = layer.feature_released

    def release(self, party: str, step: int, split: str, out: torch.Tensor, *, train: bool) -> torch.Tensor:
        if split == "train" and not train:
            raise ProtocolError(
                f"feature DP: {party} refuses to release outputs for training rows outside training "
                "(an unaccounted release); evaluate on val/test"
            )
        released = self.mech.release_embeddings(out) if train else self.mech.clip(out)
        self.released_steps[party] = step
        return released

    def model_gradients(
        self, model: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor
    ) -> list[torch.Tensor | None]:
        if model is not self.mech.bottom:
            raise ProtocolError("feature DP: the release rule was installed on a different model than it protects")
        if grad.shape[0] != x.shape[0]:
            raise ProtocolError(f"feature DP: gradient for {grad.shape[0]} rows, batch has {x.shape[0]}")
        grads = self.mech.bottom_gradients(x, grad)
        return [grads.get(n) for n, p in model.named_parameters() if p.requires_grad]


class DPPlugin(ProtocolPlugin):
    name = "differential privacy"
    options_type = DPOptions

    def configure(self, cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> ProtocolSetup | None:
        options = cfg.options_for(DPOptions)
        if options.privacy != "dp":  # DP flags without --privacy dp were refused with the options
            return None
        config = options.config()
        if config.epsilon is not None and math.isinf(config.epsilon):
            raise ConfigError("--epsilon inf means no privacy: run with --privacy none instead")
        n_classes = ctx.data.n_classes
        if config.mechanism == "auto":
            config.mechanism, config.auto_reason = choose_mechanism(
                protects=config.protects, n_classes=n_classes, epochs=cfg.epochs, epsilon=config.epsilon,
                n_train=ctx.rows("train"), gradient_flags=options.gradient_flags(),
                backward_pass=traits.gradient_based, streamed_labels=traits.streamed_labels)
        if traits.streamed_labels:
            refusal = _stream_refusal(config, traits.name)
            if refusal:
                raise UnsupportedError(f"--privacy dp is not valid for algorithm {traits.name!r}: {refusal}")
            config.stream = True
        problems = options.inapplicable(config)
        if problems:
            raise ConfigError("; ".join(problems))
        plan = plan_dp(config, n_train=ctx.rows("train"), epochs=cfg.epochs, batch_size=cfg.batch_size,
                       loss="bce" if n_classes == 2 else "ce")
        if plan.clip_norm_unused and options.dp_clip_norm is not None:
            plan.notes.append("--dp-clip-norm has no effect here: the residual of a cross-entropy loss is bounded "
                              "by the loss itself")
        if plan.clip_mode == "residual" and options.dp_head_weight is not None:
            plan.notes.append("--dp-head-weight has no effect with --dp-clip residual")
        noise = make_noise_source(reproducible=config.reproducible, seed=cfg.seed)
        protected: list[str] = []
        feature_names = [f"party{i}" for i in range(ctx.partition.n_blocks)]
        if config.protects == "features":
            wanted = options.dp_parties
            protected = [p.strip() for p in wanted.split(",") if p.strip()] if wanted else feature_names
            unknown = sorted(set(protected) - set(feature_names))
            if unknown:
                raise ConfigError(f"--dp-parties: unknown parties {unknown}; feature parties are {feature_names}")
        accepted = options.dp_accept_epsilon
        limit = _budget(plan, accepted)
        replay = replay_key(secure=noise.secure, device=str(ctx.device), threads=cfg.threads)
        layer = DPLayer(plan, secure_rng=noise.secure, protected=protected, replay=replay)
        problems = layer.check(traits)
        if problems:
            raise UnsupportedError(f"--privacy dp is not valid for algorithm {traits.name!r}: " + "; ".join(problems))
        before_epoch: list[Callable[[int], None]] = []
        attach = [lambda algo: _attach(algo, layer, plan, noise, cfg, n_classes, before_epoch)]
        # the gradient mechanism's training loss is computed from the true labels: the label party keeps it
        keeper = TrainLossKeeper() if plan.protects == "labels" and plan.mechanism == "gradient" else None

        def start(run_dir: Path | None, trained: int) -> None:
            if run_dir is not None:
                for ledger in layer.ledgers.values():
                    ledger.open(run_dir, trained_epochs=trained)
                layer.run_dir = Path(run_dir)
                if keeper is not None:
                    keeper.open(party_dir(run_dir, layer.topology.label_party), trained_epochs=trained)
            _check_budget(layer, limit, run_dir, trained, cfg.epochs)

        def spent() -> tuple[DPPlan, bool]:
            """The plan as it turned out (epsilon of every release that happened), and whether that is within plan."""
            entries = layer.ledger_entries()
            eps, times = epsilon_spent(plan, entries), releases_per_sample(plan, entries)
            within = eps <= plan.epsilon * (1 + _TOLERANCE)
            if layer.rule is not None:  # the guarantee assumes each row is released at most `releases_per_sample` times
                within = within and layer.rule.rows_released <= plan.n_train * plan.releases_per_sample
            if eps <= plan.epsilon:
                return plan, within
            what = ", ".join(f"{name} released {n} times" for name, n in repeated_releases(entries).items())
            note = (f"releases were repeated after the run was interrupted and resumed ({what or 'more than planned'}), "
                    f"with fresh noise: epsilon {eps:.4g} counts every release that happened (the plan was "
                    f"{plan.epsilon:.4g}" + (f"; allowed by --dp-accept-epsilon {accepted:g}" if accepted else "") + ")")
            return dataclasses.replace(plan, epsilon=eps, releases_per_sample=times, notes=[*plan.notes, note]), within

        def summary() -> dict[str, Any]:
            actual, within = spent()
            s = privacy_summary(actual, secure_rng=noise.secure)
            s["generator"] = noise.describe()["generator"]
            entries = layer.ledger_entries()
            s.update(epsilon_planned=plan.epsilon, epsilon_spent=epsilon_spent(plan, entries),
                     repeated_releases=repeated_releases(entries), within_plan=within)
            if accepted is not None:
                s["epsilon_accepted"] = float(accepted)
            if layer.rule is not None:
                s["released"] = layer.rule.describe()
            if layer.targets_rule is not None:
                s["released"] = layer.describe()
            if layer.stream is not None:
                s["released"] = layer.stream.describe()
            if protected:
                s["protected_parties"] = protected
            if keeper is not None:
                s["train_loss"] = f"kept by the label party ({PARTY_DIRS}/{layer.topology.label_party}/{keeper.FILE})"
            return {"privacy": s}

        chance, majority_f1 = chance_accuracy(ctx.data.y_test), chance_f1(ctx.data.y_test)
        warnings: list[str] = []

        def check_utility(run_summary: dict[str, Any]) -> None:
            warning = utility_collapse(run_summary.get("metrics", {}).get("test", {}), chance, plan, n_classes,
                                       majority_f1=majority_f1)
            if warning:
                warnings.append(warning)
                run_summary.setdefault("privacy", {})["utility_warning"] = warning

        def finish(run_dir: Path | None) -> str:
            actual, _ = spent()
            kw = {"algorithm": traits.name, "protected_parties": protected or None, "n_classes": n_classes,
                  "released": layer.describe(),
                  "train_loss": f"{PARTY_DIRS}/{layer.topology.label_party}/{keeper.FILE}" if keeper else None}
            seed = None if noise.secure else cfg.seed
            text = privacy_statement(actual, secure_rng=noise.secure, seed=seed, **kw)
            if layer.rule is not None and layer.rule.rows_released > plan.n_train * plan.releases_per_sample:
                text += (" WARNING: more per-sample releases happened than the plan accounts for; the stated "
                         "guarantee does NOT hold for this run.")
            if actual.epsilon > limit * (1 + _TOLERANCE):  # only where no run directory let the budget be checked
                text += f" WARNING: that is more than this run's budget of epsilon {limit:.4g}."
            if run_dir is not None:
                from secvfl.io import write_text_atomic

                write_text_atomic(Path(run_dir) / "PRIVACY.md",
                                  privacy_markdown(actual, secure_rng=noise.secure, seed=seed, **kw))
            return "\n".join([text, *warnings])

        return ProtocolSetup(layers=[(20, layer)], attach=attach, summary=summary, on_finish=[finish],
                             on_summary=[check_utility], on_start=[start], private_loss=keeper,
                             before_epoch=before_epoch)


# Relative slack when comparing epsilons: the same releases give the same float, so this only absorbs rounding.
_TOLERANCE = 1e-9


def _budget(plan: DPPlan, accepted: float | None) -> float:
    """The most epsilon the run may spend: the --epsilon asked for (the plan's epsilon under --noise-multiplier),
    raised only by an explicit --dp-accept-epsilon."""
    c = plan.config
    planned = float(c.epsilon) if c.epsilon is not None and c.noise_multiplier is None else plan.epsilon
    if accepted is None:
        return planned
    if accepted < planned:  # (finite and > 0: checked with the options)
        raise ConfigError(f"--dp-accept-epsilon {accepted:g} is below the planned epsilon {planned:.4g}: it can only "
                          "allow a run to spend more than planned; drop it")
    return float(accepted)


def _check_budget(layer: DPLayer, limit: float, run_dir: Path | None, trained: int, epochs: int) -> None:
    """Refuse to train on when finishing would spend more than ``limit``, counting every release in the ledger.

    What finishing releases: every remaining epoch (gradient mechanism, feature DP); the labels, when this process
    randomised them itself (a fresh start); rr-prior's stage 2, unless an earlier process stored it.
    """
    plan = layer.plan
    ledgers = list(layer.ledgers.values())
    if not ledgers:
        return
    ledger = ledgers[0]  # every releasing party's ledger records the same epochs
    future = []
    if plan.config.stream:  # every remaining block's stream samples
        future = [ledger.entry("block", e) for e in range(trained, epochs)]
    elif plan.mechanism in LABEL_RELEASE_MECHANISMS:
        if layer.labels_released_here:
            future.append(ledger.entry("stage1" if plan.mechanism == "rr-prior" else "labels", trained))
        if layer.staged is not None and not layer.staged.stage2_done and layer.stored_stage2() is None:
            future.append(ledger.entry("stage2", layer.staged.stage2_epoch))
    else:
        future = [ledger.entry("epoch", e) for e in range(trained, epochs)]
    entries = layer.ledger_entries()
    finish = epsilon_spent(plan, entries + future)
    if finish <= limit * (1 + _TOLERANCE):
        return
    repeats = ", ".join(f"{name} released {n} times" for name, n in repeated_releases(entries + future).items())
    allow = math.ceil(finish * 1000) / 1000
    # a directory that already holds this run's config.toml continues with --resume, from a checkpoint or (killed in
    # its first epoch) from its beginning
    resumable = run_dir is not None and (Path(run_dir) / "config.toml").is_file()
    how = (f"`{resume_command(run_dir, '--dp-accept-epsilon', f'{allow:g}')}`" if resumable else
           f"the same command with --dp-accept-epsilon {allow:g}")
    raise ConfigError(
        f"differential privacy: finishing this run would spend epsilon {finish:.4g}, more than its budget of "
        f"{limit:.4g}, because its release ledger ({ledger.path or 'in memory'}) shows releases that an interrupted "
        f"process already made and that finishing makes again ({repeats}; epsilon spent so far "
        f"{epsilon_spent(plan, entries):.4g}); {run_dir or 'the run'} is kept as it is: to finish anyway at epsilon "
        f"{allow:g}, run {how}, or start a new run with another --out"
    )


# Why each DP setting other than randomized response of the labels is refused for an algorithm whose label party takes
# its labels from a stream (AlgorithmTraits.streamed_labels); --dp-mechanism auto picks rr there.
_STREAM_REFUSALS = {
    "gradient": "the gradient mechanism calibrates and accounts its noise per epoch over a fixed training set (each "
                "sample released once per epoch), and {algo} learns from a stream, which has none",
    "rr-prior": "randomized response with a prior learns its prior in a first stage trained on part of a fixed "
                "training set, and {algo}'s stream has no fixed set to split",
    "alibi": "ALIBI trains the label party on soft labels (Bayesian posteriors), and {algo}'s label party trains on one "
             "label per round",
}


def _stream_refusal(config: DPConfig, algo: str) -> str | None:
    """Why ``config`` cannot protect a streamed run of ``algo`` (None: it can), with what to use instead."""
    if config.protects == "features":
        return (f"feature DP accounts clipped, noised releases per epoch over a fixed training set, and {algo}'s "
                "feature parties send an embedding of every stream sample as it arrives, with no feature mechanism "
                "accounted over a stream; use --dp-protect labels (each streamed label randomised once, as it "
                "arrives)")
    if config.mechanism in _STREAM_REFUSALS:
        if config.auto_reason:  # auto chose the gradient mechanism for a flag only it reads
            return (_STREAM_REFUSALS[config.mechanism].format(algo=algo) + f"; --dp-mechanism auto chose it because "
                    f"{config.auto_reason}: drop that, and give --epsilon (each streamed label randomised once)")
        return (_STREAM_REFUSALS[config.mechanism].format(algo=algo) + "; use --dp-mechanism rr (each streamed label "
                "randomised once, as it arrives) or auto")
    return None


def _attach(algo: Algorithm, layer: DPLayer, plan: DPPlan, noise: NoiseSource, cfg: TrainConfig, n_classes: int,
            before_epoch: list[Callable[[int], None]]) -> None:
    """Install the mechanism through the algorithm's public hooks (:class:`~secvfl.parties.ProtocolHooks`)."""
    c = plan.config
    hooks = algo.protocol_hooks()
    if c.protects == "labels" and c.stream:
        stream = hooks.label_stream
        if stream is None:
            raise UnsupportedError(f"label DP on a stream needs a label party that takes each label as it arrives; "
                                   f"{algo.name} offers none, so --privacy dp is refused for it")
        # each label once, when the label party takes its event from the feed (protocols.dp.stream)
        layer.stream = StreamRR(max(n_classes, 2), plan.epsilon, noise.derive("rr"))
        stream.install_label_transform(layer.stream)
        return
    if c.protects == "labels":
        lp = hooks.label
        if lp is None:
            raise UnsupportedError(
                f"label DP needs one label party whose backward pass it can privatise (splitnn, vafl, fdml); "
                f"{algo.name} trains differently, so --privacy dp is refused for it"
            )
        if c.mechanism == "gradient":
            denoise = cfg.options_for(DPOptions).dp_denoise == "posterior"
            rule = LabelDPRule(
                loss="bce" if n_classes == 2 else "ce", clip_norm=c.clip_norm, noise_multiplier=plan.noise_multiplier,
                noise=noise.derive("label-dp"), clip=c.clip, head_weight=c.head_weight,
                posterior_rows=int(lp.labels("train").shape[0]) if denoise else None,
            )
            lp.backward_rule = rule  # the rule gets each batch's row ids from the label party (its own bookkeeping)
            layer.rule = rule
        elif c.mechanism in ("rr-prior", "alibi"):
            _attach_targets(algo, hooks, layer, plan, noise, cfg, n_classes, before_epoch)
        else:
            true = lp.labels("train").cpu().numpy()
            layer.rr_install = lp.use_training_labels  # the label party trains on the randomised labels
            layer.rr_labels = randomized_response(true, max(n_classes, 2), plan.epsilon, noise.derive("rr"))
            layer.labels_released_here = True
            lp.use_training_labels(layer.rr_labels)
        return
    parties = hooks.releasing_parties()
    missing = [p for p in layer.protected if p not in parties]
    if missing:
        raise UnsupportedError(
            f"feature DP needs feature parties with one bottom model each (splitnn, vafl, fdml, laser); {algo.name} has "
            f"none named {missing}, so --dp-protect features is refused for it"
        )
    for name in layer.protected:

        def make(model: torch.nn.Module, name: str = name) -> FeatureDPRelease:
            mech = FeatureDP(
                model, embedding_clip=c.clip_norm, gradient_clip=c.gradient_clip_norm or c.clip_norm,
                noise_multiplier=plan.noise_multiplier, noise=noise.derive(f"feature-dp/{name}"),
            )
            layer.features[name] = mech
            return FeatureDPRelease(mech, layer)

        parties[name].install_release_rule(make)


def _attach_targets(algo: Algorithm, hooks: ProtocolHooks, layer: DPLayer, plan: DPPlan, noise: NoiseSource,
                    cfg: TrainConfig, n_classes: int, before_epoch: list[Callable[[int], None]]) -> None:
    """rr-prior and alibi: the label party trains on released target distributions (:class:`TargetBackward`)."""
    lp = hooks.label
    assert lp is not None
    k = max(n_classes, 2)
    true = lp.labels("train").cpu().numpy()
    # alibi trains on its posteriors (cross-entropy); rr-prior on the likelihood of its randomised labels
    rule = TargetBackward(likelihood=plan.mechanism == "rr-prior")
    install = lp.use_training_labels  # the label party swaps its own training labels for the released targets
    lp.backward_rule = rule
    layer.targets_rule, layer.targets_install = rule, install
    if plan.mechanism == "alibi":
        layer.alibi_targets = alibi_soft_labels(true, k, plan.epsilon, noise.derive("alibi"))
        layer.labels_released_here = True
        install(layer.alibi_targets)
        return
    predict = hooks.predict
    if predict is None:
        raise UnsupportedError(f"randomized response with a prior needs the model's predictions on the training rows "
                               f"for its second stage, and {algo.name} does not make them; use --dp-mechanism rr")
    staged = TwoStageRR(true, k, plan.epsilon, stage_split(true.size, plan.config.stage1_fraction, cfg.seed),
                        stage2_epoch_for(cfg.epochs))
    staged.release_stage1(noise.derive("rr-prior/stage1"))
    layer.staged = staged
    layer.labels_released_here = True
    install(staged.likelihoods())
    stage2_noise = noise.derive("rr-prior/stage2")

    def stage2(epoch: int) -> None:
        if epoch >= staged.stage2_epoch and not staged.stage2_done:
            # the stage-1 model's predicted distribution for each training row is the prior of its stage-2 label
            priors = predict("train")  # also when reusing a stored release: the same messages as an uninterrupted run
            stored = layer.stored_stage2()
            if stored is not None:  # an earlier process released stage 2 and was stopped before its next checkpoint
                staged.load_state_dict(stored)
            else:
                staged.release_stage2(priors, stage2_noise)
                layer.store_stage2(epoch)  # kept and recorded before the labels are used
            install(staged.likelihoods())

    before_epoch.append(stage2)
