"""OGD, SLR and DLR over a stream (``--algo ogd | slr | dlr``), each under Full / Random / Event activation.

Message flow of one round t (every arrow a Message through the network, so layers apply and bytes are exact)::

    the stream -> each party's feed              (the environment: x_m^t to party m, y^t to the label party)
    feature party m --embedding (meta: entity, active)--> label party     (every party, active or passive)
    label party: predict and score (prequential), step the head
    label party --gradient--> active feature party m                     (passive parties get nothing)
    feature party m: enqueue (zeros if passive) and step if active

SLR sends the window's l embeddings and gradients instead of one (see :mod:`.parties`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import LABEL_PARTY, Algorithm, ProgressFn, RunContext, feature_party_names
from secvfl.algorithms.online.activation import Activation, check_event_threshold, parse_activation
from secvfl.algorithms.online.flags import OnlineOptions
from secvfl.algorithms.online.handles import OnlineFeatureHandle, OnlineLabelHandle
from secvfl.algorithms.online.live import RoundJoin
from secvfl.algorithms.online.metrics import PrequentialMeter, plot_error
from secvfl.algorithms.online.parties import (
    OnlineFeatureParty,
    OnlineLabelParty,
    WindowSpec,
    bottom_model,
    head_model,
)
from secvfl.algorithms.online.streams import Feed, StreamReplay
from secvfl.data import make_partition
from secvfl.errors import ConfigError
from secvfl.handles import PartyHandle, local_party
from secvfl.parties import ProtocolHooks
from secvfl.transport.layers import AlgorithmTraits
from secvfl.transport.network import Network

__all__ = ["OnlineVFL", "OGD", "SLR", "DLR"]


class OnlineVFL(Algorithm):
    """The coordinator of an online run (in the label party's process). An epoch is a block of ``--samples``
    rounds; ``evaluate("val")`` is the block's prequential score (each sample scored before the model learnt from
    it), ``evaluate("test")`` scores the current model on the dataset's held-out test split."""

    options_type = OnlineOptions
    unused_settings = {
        "lr": "each party takes plain gradient steps of --online-lr",
        "optimizer": "each party takes plain gradient steps, as in the paper; their size is --online-lr",
        "weight_decay": "the paper's plain gradient steps have no weight decay",
        "batch_size": "it learns from one stream sample per round; --samples sets the rounds per epoch",
        "hidden": "each party's model is one linear layer -> ReLU of width --online-embedding",
        "embedding_dim": "each party's embedding width is --online-embedding",
        "head_hidden": "the label party's hidden width is --online-head",
        "bottom": "each party's model is one linear layer -> ReLU (--online-embedding)",
    }
    val_name = "prequential"  # evaluate("val"): the block's prequential score, each sample scored before learning

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        cfg, data = ctx.config, ctx.data
        self.opts = opts = cfg.options_for(OnlineOptions)
        spec = parse_activation(opts.activation)
        part = ctx.partition
        if data.image_shape is not None and cfg.image_split == "auto":
            # the paper's cut: the flattened image in equal contiguous segments (4 x 196 for MNIST)
            flat = make_partition(data.n_features, cfg.parties)
            if flat.n_blocks == part.n_blocks:
                part = flat
        rounds = opts.samples * cfg.epochs
        if spec.kind == "random" and spec.value * rounds < 1:  # a degenerate value, not a setting
            raise ConfigError(f"--activation {spec}: a party would be activated in {spec.value * rounds:.2g} of the "
                              f"run's {rounds} rounds on average, so nothing would train; raise P (random:0.5, or "
                              "full: every round)")
        observed = ctx.masks["train"]
        check_event_threshold(spec, [data.X_train[observed[:, k]][:, np.asarray(cols)].mean(axis=1)
                                     for k, cols in enumerate(part.blocks)])
        window = self.window_spec(opts)
        n_out = max(2, data.n_classes)
        names = feature_party_names(part.n_blocks)
        self.feeds = [Feed() for _ in names]
        self.label_feed = Feed()
        self.feature_handles: list[OnlineFeatureHandle] = []
        for k, name in enumerate(names):
            cols = np.asarray(part.blocks[k])
            party = OnlineFeatureParty(
                name, self.feeds[k], bottom_model(len(cols), opts.online_embedding),
                Activation(spec, cfg.seed, k), window, lr=opts.online_lr,
                eval_blocks={s: part.take(getattr(data, f"X_{s}"), k) for s in ("val", "test")},
                observed={s: ctx.masks[s][:, k] for s in ("val", "test") if not ctx.masks[s][:, k].all()},
                dtype=ctx.dtype)
            self.feature_handles.append(OnlineFeatureHandle(party, net))
        head = head_model(part.n_blocks * opts.online_embedding, opts.online_head, n_out)
        self.label_handle = OnlineLabelHandle(OnlineLabelParty(
            LABEL_PARTY, self.label_feed, head, n_out, window, lr=opts.online_lr,
            eval_labels={s: getattr(data, f"y_{s}") for s in ("val", "test")}, dtype=ctx.dtype), net)
        self.names = names
        deform = opts.deform == "on" or (opts.deform == "auto" and data.image_shape is not None)
        self.stream = StreamReplay(data.X_train, data.y_train, n_out, [np.asarray(b) for b in part.blocks],
                                   seed=cfg.seed, nonstationary=opts.stream == "nonstationary",
                                   image_shape=data.image_shape if deform else None, deform=deform,
                                   observed=ctx.masks["train"])
        self.meter = PrequentialMeter(opts.metric_window)
        self.train_bytes = 0
        self.train_payload = 0  # tensor bytes only (what a paper counting floats reports), of the same messages
        self.last_block: dict[str, float] = {}
        self.block_curve: list[list[float]] = []
        self.compute_blocks: list[dict[str, dict[str, float]]] = []
        self._seconds_seen: dict[str, dict[str, float]] = {}

    window_spec: ClassVar  # (OnlineOptions) -> WindowSpec, per algorithm

    def step_size(self) -> tuple[str, float]:
        return "--online-lr", self.opts.online_lr

    def handles(self) -> dict[str, PartyHandle]:
        return {**{h.name: h for h in self.feature_handles}, LABEL_PARTY: self.label_handle}

    def protocol_hooks(self) -> ProtocolHooks:
        # no batch label party (no backward rule, no fixed training labels): each label comes from the stream
        return ProtocolHooks(label_stream=local_party(self.label_handle))

    def batches_per_epoch(self) -> int:
        return self.opts.samples

    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        before, payload = self.net.stats.bytes_total, self.net.stats.payload()
        for _ in range(self.opts.samples):
            self.stream.emit(self.stream.round, self.feeds, self.label_feed)
            loss = self.run_round()
            if progress is not None:
                progress(loss)
        self.train_bytes += self.net.stats.bytes_total - before
        self.train_payload += self.net.stats.payload() - payload
        self.last_block = self.meter.close_block()
        self.block_curve.append([self.meter.samples, self.last_block["error"]])
        return {"loss": self.last_block["loss"]}

    def run_round(self) -> float:
        """One round on the events at the head of the parties' feeds (put there by the replay or a live
        :class:`~secvfl.algorithms.online.live.RoundJoin`); returns the round's loss."""
        for h in self.feature_handles:
            h.forward(self.step, to=LABEL_PARTY)
        active = self.label_handle.receive(self.names)
        loss, correct = self.label_handle.train_round(self.step, self.names, active)
        for h in self.feature_handles:
            h.update(sender=LABEL_PARTY, active=h.name in active)
        self.meter.add(correct, loss)
        self.step += 1
        return loss

    def train_live(self, join: RoundJoin) -> int:
        """Run every round ``join`` has ready (live sources); returns how many ran."""
        before, payload, n = self.net.stats.bytes_total, self.net.stats.payload(), 0
        feeds = dict(zip(self.names, self.feeds, strict=True))
        for ready in join.ready():
            join.deliver(ready, self.step, feeds, self.label_feed)
            self.run_round()
            n += 1
        self.train_bytes += self.net.stats.bytes_total - before
        self.train_payload += self.net.stats.payload() - payload
        return n

    def evaluate(self, split: str) -> dict[str, float]:
        if split == "val":  # prequential: no extra communication, no sample seen twice
            return {k: self.last_block[k] for k in ("accuracy", "error")} if self.last_block else {}
        n = self.ctx.rows(split)
        if n == 0:
            return {}
        for start in range(0, n, self.cfg.eval_batch_size):
            ids = np.arange(start, min(n, start + self.cfg.eval_batch_size))
            for h in self.feature_handles:
                h.forward_eval(self.step, split, ids, to=LABEL_PARTY)
            self.label_handle.receive(self.names)
            self.label_handle.predict()
        return self.label_handle.score(split)

    # -- what the runner records ------------------------------------------------------------------------------
    def compute(self) -> dict[str, dict[str, Any]]:
        return {h.name: h.compute() for h in self.feature_handles}

    def epoch_record(self) -> dict[str, Any]:
        """The block's line: prequential errors, bytes, and each party's compute seconds in this block (measured by
        the party, active and passive rounds apart; a measurement, so not part of the checkpointed state)."""
        compute = self.compute()
        seconds = {n: {k: v - self._seconds_seen.get(n, {}).get(k, 0.0) for k, v in c["seconds"].items()}
                   for n, c in compute.items()}
        self._seconds_seen = {n: dict(c["seconds"]) for n, c in compute.items()}
        self.compute_blocks.append(seconds)
        return {"samples_seen": self.meter.samples, "block_error": self.last_block.get("error"),
                "accumulated_error": self.meter.accumulated_error, "train_bytes": self.train_bytes,
                "active_rounds": {n: c["rounds"]["active"] for n, c in compute.items()},
                "compute_seconds": {n: {k: round(v, 6) for k, v in s.items()} for n, s in seconds.items()}}

    def _compute_seconds(self, run_dir: Path | None) -> dict[str, dict[str, float]]:
        """Per party, active and passive compute seconds over the whole run: the blocks' measurements, read back
        from metrics.jsonl when there is one (blocks of an interrupted process included)."""
        blocks = self.compute_blocks
        path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
        if path is not None and path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            blocks = [r["compute_seconds"] for r in rows if "compute_seconds" in r]
        total: dict[str, dict[str, float]] = {}
        for block in blocks:
            for n, s in block.items():
                for k, v in s.items():
                    total.setdefault(n, {}).setdefault(k, 0.0)
                    total[n][k] += v
        return total

    def report(self, run_dir: Path | None) -> dict[str, Any]:
        compute = self.compute()
        seconds = self._compute_seconds(run_dir)
        rounds = max(1, self.meter.samples)
        online = {
            "samples": self.meter.samples, "accumulated_error": self.meter.accumulated_error,
            "metric_window": self.meter.window, "windowed_error": self.meter.curve, "block_error": self.block_curve,
            "train_bytes": self.train_bytes, "train_payload_bytes": self.train_payload,
            "activation": str(parse_activation(self.opts.activation)),
            "activation_rate": {n: c["rounds"]["active"] / rounds for n, c in compute.items()},
            "client_compute_seconds": seconds,
            "client_compute_seconds_total": sum(sum(s.values()) for s in seconds.values()),
        }
        if run_dir is not None:
            curve = self.meter.curve or self.block_curve
            every = self.meter.window if self.meter.curve else self.opts.samples
            plot_error(Path(run_dir) / "online_error.png", {f"{self.name} ({online['activation']})": curve},
                       f"{self.name} on {self.cfg.dataset}: prequential error per {every:,} samples")
        return {"online": online}

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {**super().state_dict(), "stream": self.stream.state_dict(), "meter": self.meter.state_dict(),
                "train_bytes": self.train_bytes, "train_payload": self.train_payload, "last_block": self.last_block,
                "block_curve": self.block_curve}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "stream" in state:  # absent when a caller restores the parties only
            self.stream.load_state_dict(state["stream"])
            self.meter.load_state_dict(state["meter"])
            self.train_bytes = int(state["train_bytes"])
            self.train_payload = int(state.get("train_payload", 0))
            self.last_block = dict(state["last_block"])
            self.block_curve = [list(p) for p in state["block_curve"]]


@ALGORITHMS.register("ogd")
class OGD(OnlineVFL):
    """Online gradient descent: each party steps on the round's own gradient."""

    name = "ogd"
    traits = AlgorithmTraits("ogd", "concat", streamed_labels=True)

    @staticmethod
    def window_spec(opts: OnlineOptions) -> WindowSpec:
        return WindowSpec("window", 1, 1.0)


@ALGORITHMS.register("slr")
class SLR(OnlineVFL):
    """Static local regret: the mean loss of the last l samples at the current parameters."""

    name = "slr"
    traits = AlgorithmTraits("slr", "concat", streamed_labels=True)

    @staticmethod
    def window_spec(opts: OnlineOptions) -> WindowSpec:
        return WindowSpec("static", opts.online_window)


@ALGORITHMS.register("dlr")
class DLR(OnlineVFL):
    """Dynamic local regret (the paper's method): exponentially weighted window of past gradients."""

    name = "dlr"
    traits = AlgorithmTraits("dlr", "concat", streamed_labels=True)

    @staticmethod
    def window_spec(opts: OnlineOptions) -> WindowSpec:
        return WindowSpec("window", opts.online_window, opts.online_alpha)


