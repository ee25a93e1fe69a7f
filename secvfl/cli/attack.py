"""`secvfl attack label-inference | feature-reconstruction | grid`: train (or load) a run, attack it, score it.

Every command accepts all `secvfl train` flags (protocols included: ``--privacy dp --epsilon 3``, ``--he ckks``, ...).
Output directory (``--dir``, default ``runs/attack-NAME-DATASET-TIME``)::

    run/            the attacked training run (as `secvfl train --out`), with the attacker's recorded view
    reference/      the undefended run that gives MP* (only when the attacked run is defended and no MP* is given)
    summary.json    {"attack", "threat_model", "AP", "MP", "chance", "DCS", ...}
    *.png           ROC / accuracy-vs-N / reconstruction-error plot
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from attacks.base import AttackResult
from attacks.feature_reconstruction import GRNConfig
from attacks.grid import run_grid
from attacks.harness import (
    LABEL_ATTACKS,
    RecordedRun,
    feature_reconstruction,
    is_defended,
    label_inference,
    load_recorded,
    main_task,
    model_completion,
    train_recorded,
    undefended,
)
from attacks.model_completion import CompletionConfig
from attacks.plots import plot_completion, plot_label_scores, plot_reconstruction
from secvfl.cli.registries import ATTACK_COMMANDS
from secvfl.cli.train import add_train_arguments, config_from_args
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.io import write_json_atomic

__all__ = ["LabelInferenceCommand", "FeatureReconstructionCommand", "GridCommand"]

# argparse dests of the attack commands themselves; everything else is a train flag.
_OWN = {"attack", "attacker", "known_positives", "known_scope", "known_labels", "run", "dir", "reference_run",
        "mp_star", "gamma", "completion_epochs", "completion_method", "no_baselines", "target", "rows", "grn_epochs",
        "condition_on_scores", "defences", "seeds", "attacks", "keep_runs"}


def _train_config(args: argparse.Namespace) -> TrainConfig:
    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _OWN})
    return config_from_args(ns)


def _out_dir(args: argparse.Namespace, name: str) -> Path:
    if args.dir is not None:
        out = Path(args.dir)
    elif getattr(args, "run", None) is not None:
        out = Path(args.run) / f"attack-{name}"
    else:
        dataset = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.dataset)
        out = Path("runs") / f"attack-{name}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _log(msg: str) -> None:
    print(msg, flush=True)


def _common(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    add_train_arguments(p)
    g = p.add_argument_group("attack")
    g.add_argument("--run", type=Path, default=None,
                   help="attack this finished run directory instead of training (gradient attacks need one trained "
                        "by `secvfl attack`, whose view was recorded)")
    g.add_argument("--dir", type=Path, default=None, help="output directory (see `secvfl attack --help`)")
    g.add_argument("--reference-run", type=Path, default=None,
                   help="finished undefended run whose test metric is MP* (default: train one when the run is defended)")
    g.add_argument("--mp-star", type=float, default=None, help="MP* as a number (the undefended main-task metric)")
    return g


def _obtain(args: argparse.Namespace, out: Path, attacker: str, *, malicious_gamma: float | None = None,
            sub: str = "run") -> RecordedRun:
    if args.run is not None:
        if malicious_gamma is not None:
            raise ConfigError("an active attack changes training; it cannot attack an existing --run")
        return load_recorded(args.run, attacker)
    cfg = _train_config(args)
    _log(f"training {cfg.algo} on {cfg.dataset} ({cfg.parties} parties, {cfg.epochs} epochs) recording {attacker}'s "
         f"view -> {out / sub}")
    return train_recorded(cfg, attacker, run_dir=out / sub, malicious_gamma=malicious_gamma, log=_log)


def _mp_star(args: argparse.Namespace, rec: RecordedRun, out: Path) -> tuple[float, str]:
    if args.mp_star is not None:
        return float(args.mp_star), "given (--mp-star)"
    if args.reference_run is not None:
        summary = json.loads((Path(args.reference_run) / "summary.json").read_text())
        return main_task(summary["metrics"]["test"])[1], f"reference run {args.reference_run}"
    if not is_defended(rec.cfg):
        return rec.mp[1], "this run (no defence)"
    _log(f"training the undefended reference run for MP* -> {out / 'reference'}")
    ref = train_recorded(undefended(rec.cfg), rec.attacker, run_dir=out / "reference", log=_log)
    return ref.mp[1], f"undefended reference run {out / 'reference'}"


def _finish(out: Path, result: AttackResult, rec: RecordedRun, mp_star: float, star_source: str,
            extra: dict[str, Any]) -> dict[str, Any]:
    mp_name, mp = rec.mp
    summary = result.summary(mp=mp, mp_star=mp_star)
    summary.update(MP_metric=mp_name, MP_star_source=star_source, run=str(rec.run_dir) if rec.run_dir else None,
                   training={"algo": rec.cfg.algo, "dataset": rec.cfg.dataset, "parties": rec.cfg.parties,
                             "epochs": rec.cfg.epochs, "seed": rec.cfg.seed, "options": rec.cfg.options,
                             "privacy": rec.summary.get("privacy")}, **extra)
    write_json_atomic(out / "summary.json", summary)
    _log(f"{summary['attack']}: AP {summary['AP']:.4f} ({result.metric}, chance {result.chance:.4f}), "
         f"MP {mp_name} {mp:.4f} (MP* {mp_star:.4f}), DCS {summary['DCS']:.4f}; {out / 'summary.json'}")
    return summary


class LabelInferenceCommand:
    help = ("label inference by a feature party: norm / direction scoring (Li et al.), direct inference from logit "
            "gradients and passive / active model completion (Fu et al.)")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        g = _common(p)
        g.add_argument("--attack", required=True, choices=LABEL_ATTACKS)
        g.add_argument("--attacker", default="party0", help="the attacking feature party (default party0)")
        g.add_argument("--known-positives", type=int, default=1,
                       help="direction: known positive examples (per batch, or in all, see --known-scope)")
        g.add_argument("--known-scope", choices=["batch", "run"], default="batch",
                       help="direction: the attacker knows that many positives in every batch (Li et al.) or in all")
        g.add_argument("--known-labels", type=int, nargs="+", default=[10, 40, 100, 400],
                       help="model completion: numbers of known training labels N to try")
        g.add_argument("--completion-epochs", type=int, default=30, help="model completion: training epochs")
        g.add_argument("--completion-method", default="auto", choices=["auto", "label-spreading", "mixmatch"],
                       help="model completion: semi-supervised method (auto: label spreading on the bottom model's "
                            "embeddings + self-training; mixmatch needs image parties)")
        g.add_argument("--no-baselines", action="store_true", help="model completion: skip the supervised baselines")
        g.add_argument("--gamma", type=float, default=1.0, help="active model completion: gradient scaling gamma")

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        out = _out_dir(args, args.attack)
        if args.attack in ("norm", "direction", "direct"):
            rec = _obtain(args, out, args.attacker)
            result, obj = label_inference(rec, args.attack, known_positives=args.known_positives,
                                          known_scope=args.known_scope, seed=rec.cfg.seed)
            mp_star, source = _mp_star(args, rec, out)
            extra: dict[str, Any] = {}
            if getattr(obj, "scored", None) is not None:
                extra["plot"] = str(plot_label_scores(
                    out / "roc.png", obj.scored["scores"], obj.scored["truth"], obj.scored["aucs"],
                    f"{args.attack} scoring on {rec.cfg.dataset} ({rec.cfg.algo}, attacker {rec.attacker})",
                    ceiling=result.details.get("rr_ceiling")))
            return _finish(out, result, rec, mp_star, source, extra)
        cfg_mc = CompletionConfig(epochs=args.completion_epochs, seed=args.seed, method=args.completion_method)
        sizes = sorted(set(args.known_labels))
        if args.attack == "model-completion":
            rec = _obtain(args, out, args.attacker)
            results = model_completion(rec, sizes, config=cfg_mc, seed=rec.cfg.seed, baselines=not args.no_baselines)
            mp_star, source = _mp_star(args, rec, out)
            rows = [{"known_labels": r.details["known_labels"], "AP": r.ap, **r.details} for r in results]
            plot = plot_completion(out / "accuracy_vs_known_labels.png", rows,
                                   f"model completion by {rec.attacker}, {rec.cfg.dataset}")
            return _finish(out, results[-1], rec, mp_star, source,
                           {"by_known_labels": rows, "plot": str(plot), "AP_at": f"N = {sizes[-1]} known labels"})
        # active: a malicious run and an honest run with the same configuration and seed
        if args.reference_run is not None:
            honest = load_recorded(args.reference_run, args.attacker)
        else:
            cfg = _train_config(args)
            _log(f"training the honest run -> {out / 'honest'}")
            honest = train_recorded(cfg, args.attacker, run_dir=out / "honest", log=_log)
        _same_setup(honest.cfg, _train_config(args))  # before spending a training run on the malicious one
        rec = _obtain(args, out, args.attacker, malicious_gamma=args.gamma)
        passive = model_completion(honest, sizes, config=cfg_mc, seed=rec.cfg.seed, baselines=False)
        active = model_completion(rec, sizes, config=cfg_mc, seed=rec.cfg.seed, baselines=not args.no_baselines,
                                  name="active-model-completion")
        rows = []
        for p_res, a_res in zip(passive, active, strict=True):
            rows.append({"known_labels": a_res.details["known_labels"], "AP": a_res.ap, **a_res.details,
                         "passive_train_accuracy": p_res.ap, "passive_test_accuracy": p_res.details["test_accuracy"],
                         "gain_over_passive": a_res.ap - p_res.ap})
        plot = plot_completion(out / "accuracy_vs_known_labels.png", rows,
                               f"active vs passive model completion by {rec.attacker}, {rec.cfg.dataset}")
        mp_star = honest.mp[1] if args.mp_star is None else float(args.mp_star)
        return _finish(out, active[-1], rec, mp_star, "the honest run", {
            "by_known_labels": rows, "plot": str(plot), "AP_at": f"N = {sizes[-1]} known labels",
            "gamma": args.gamma, "honest_run": str(honest.run_dir), "main_task_change": rec.mp[1] - honest.mp[1]})


def _same_setup(a: TrainConfig, b: TrainConfig) -> None:
    """The honest and the malicious run must differ only in the attacker's behaviour."""
    ignore = {"data_dir", "device", "threads", "eval_batch_size"}

    def flat(c: TrainConfig) -> dict[str, Any]:  # None-valued options are not written to config.toml
        d = {k: v for k, v in c.to_dict().items() if k not in ignore | {"options"}}
        d.update({f"options.{k}": v for k, v in c.options.items() if v is not None})
        return d

    da, db = flat(a), flat(b)
    diff = sorted(k for k in da.keys() | db.keys() if da.get(k) != db.get(k))
    if diff:
        raise ConfigError(f"--reference-run was trained with different settings ({', '.join(diff)}); give the same "
                          "train flags as that run, or drop --reference-run to train the honest run too")


class FeatureReconstructionCommand:
    help = ("feature reconstruction by the label party at prediction time (white-box): generative regression network "
            "or equation solving (Luo et al.)")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        g = _common(p)
        g.add_argument("--attack", required=True, choices=["grn", "equation"])
        g.add_argument("--target", default=None, help="the feature party whose features are reconstructed "
                                                      "(default: the last one); the attacker holds every other block")
        g.add_argument("--rows", type=int, default=2000, help="test rows to reconstruct (0: all)")
        g.add_argument("--grn-epochs", type=int, default=100)
        g.add_argument("--condition-on-scores", action="store_true",
                       help="GRN extension: feed the observed scores to the generator too")

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        out = _out_dir(args, args.attack)
        rec = _obtain(args, out, "label")
        target = args.target or rec.run.algorithm.feature_parties[-1].name
        grn = GRNConfig(epochs=args.grn_epochs, seed=rec.cfg.seed, condition_on_scores=args.condition_on_scores)
        result = feature_reconstruction(rec, args.attack, target, grn=grn, rows=args.rows, seed=rec.cfg.seed)
        mp_star, source = _mp_star(args, rec, out)
        plot = plot_reconstruction(out / "reconstruction.png", result.details,
                                   f"{args.attack} reconstruction of {target}'s features, {rec.cfg.dataset}")
        return _finish(out, result, rec, mp_star, source, {"plot": str(plot)})


class GridCommand:
    help = "label inference suite across defences and seeds: markdown table (MP, AP per attack, DCS) and AP-vs-MP plot"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_train_arguments(p)
        g = p.add_argument_group("grid")
        g.add_argument("--defences", nargs="+", default=["none", "dp:1", "dp:3", "dp:8", "rr:3", "topk:0.1", "ckks",
                                                         "mask"],
                       help="none, dp:EPS, rr:EPS, dpf:EPS, ckks, mask, topk:RATIO")
        g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
        g.add_argument("--attacks", nargs="+", default=["norm", "direction"], choices=["norm", "direction", "direct"])
        g.add_argument("--attacker", default="party0")
        g.add_argument("--known-positives", type=int, default=1, help="direction: known positives per batch")
        g.add_argument("--dir", type=Path, default=None, help="where grid.md, grid.json and grid.png go")
        g.add_argument("--keep-runs", action="store_true", help="keep every training run under DIR/runs")

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        args.run = None
        out = _out_dir(args, "grid")
        base = _train_config(args)
        _log(f"attack grid: {base.algo} on {base.dataset}, defences {args.defences}, seeds {args.seeds} -> {out}")
        result = run_grid(base, args.defences, args.seeds, args.attacks, attacker=args.attacker,
                          known_positives=args.known_positives, out_dir=out, keep_runs=args.keep_runs, log=_log)
        _log(result["markdown"])
        return {k: v for k, v in result.items() if k != "runs"}


ATTACK_COMMANDS.add("label-inference", LabelInferenceCommand)
ATTACK_COMMANDS.add("feature-reconstruction", FeatureReconstructionCommand)
ATTACK_COMMANDS.add("grid", GridCommand)
