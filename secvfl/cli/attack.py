"""`secvfl attack label-inference | feature-reconstruction | grid`: train (or load) a run, attack it, score it.

Every command accepts all `secvfl train` flags (protocols included: ``--privacy dp --epsilon 3``, ``--he ckks``, ...).
Whether the attack can serve the algorithm and the dataset is checked before any training. Everything a command
writes goes to one new (or empty) directory, ``--out`` (``--dir`` is the same flag; default: a fresh
``runs/attack-ATTACK-ALGO-DATASET-TIME``, or ``RUN/attack-ATTACK`` when attacking ``--run RUN``)::

    run/            the attacked training run (as `secvfl train --out`), with the attacker's recorded view
    reference/      the undefended run that gives MP* (only when the attacked run is defended and no MP* is given)
    honest/         active model completion: the honest run it is compared with
    summary.json    {"attack", "threat_model", "AP", "MP", "chance", "DCS", ...}
    *.png           ROC / accuracy-vs-N / reconstruction-error plot
    grid.{json,md,png}, runs/   `attack grid`: the table, the plot and (with --keep-runs) every training run

stdout gets a short table and the path of the JSON (``--json``: the whole JSON instead); training notes and the
progress bar (only on a terminal; ``--no-progress``: a line per epoch) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from attacks.base import AttackResult
from attacks.feature_reconstruction import GRNConfig
from attacks.grid import run_grid
from attacks.harness import (
    LABEL_ATTACKS,
    RecordedRun,
    check_attack,
    check_out_dir,
    check_run,
    feature_reconstruction,
    is_defended,
    label_inference,
    load_recorded,
    main_task,
    make_out_dir,
    model_completion,
    outline_of,
    short_dataset_name,
    train_recorded,
    undefended,
)
from attacks.metrics import dcs
from attacks.model_completion import CompletionConfig
from attacks.plots import plot_completion, plot_label_scores, plot_reconstruction
from secvfl.cli.registries import ATTACK_COMMANDS
from secvfl.cli.train import add_train_arguments, config_from_args
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.io import write_json_atomic
from secvfl.rundir import runs_root

__all__ = ["LabelInferenceCommand", "FeatureReconstructionCommand", "GridCommand"]

# argparse dests of the attack commands themselves; everything else is a train flag.
_OWN = {"attack", "attacker", "known_positives", "known_scope", "known_labels", "run", "reference_run",
        "mp_star", "gamma", "completion_epochs", "completion_method", "no_baselines", "target", "rows", "grn_epochs",
        "condition_on_scores", "defences", "seeds", "attacks", "keep_runs", "json"}


def _train_config(args: argparse.Namespace) -> TrainConfig:
    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _OWN})
    return config_from_args(ns)


def _out_dir(args: argparse.Namespace, name: str, cfg: TrainConfig | None) -> Path:
    """The output directory, checked but not created: a refused command leaves nothing behind."""
    if args.out is not None:
        out = Path(args.out)
    elif getattr(args, "run", None) is not None:
        out = Path(args.run) / f"attack-{name}"
    else:
        assert cfg is not None
        dataset = re.sub(r"[^A-Za-z0-9_.-]+", "-", short_dataset_name(cfg.dataset))
        stem = runs_root() / f"attack-{name}-{cfg.algo}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
        out, n = stem, 1
        while out.exists():  # two commands started in the same second
            n += 1
            out = stem.with_name(f"{stem.name}-{n}")
    check_out_dir(out, _what(args))
    return out


def _what(args: argparse.Namespace) -> str:
    return "--out" if args.out is not None else "the default output directory"


def _note(msg: str) -> None:
    """Training notes and progress: stderr, so that stdout holds only the result."""
    print(msg, file=sys.stderr, flush=True)


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _add_output_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--out", "--dir", dest="out", type=Path, default=None,
                   help="one new or empty directory for everything the command writes (runs, summary, plots); "
                        "default: a fresh runs/attack-ATTACK-ALGO-DATASET-TIME (RUN/attack-ATTACK with --run RUN)")
    g.add_argument("--no-progress", action="store_true",
                   help="print a line per training epoch instead of a progress bar (the bar shows only on a terminal)")
    g.add_argument("--json", action="store_true", help="print the whole summary JSON instead of the short table")


def _common(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    add_train_arguments(p)
    g = p.add_argument_group("attack")
    g.add_argument("--run", type=Path, default=None,
                   help="attack this finished run directory instead of training (gradient attacks need one trained "
                        "by `secvfl attack`, whose view was recorded); results go to RUN/attack-ATTACK unless --out")
    _add_output_arguments(g)
    g.add_argument("--reference-run", type=Path, default=None,
                   help="finished undefended run whose test metric is MP* (default: train one when the run is defended)")
    g.add_argument("--mp-star", type=float, default=None, help="MP* as a number (the undefended main-task metric)")
    return g


def _check_main_task_flags(args: argparse.Namespace) -> None:
    if args.mp_star is not None and not 0.0 <= args.mp_star <= 1.0:
        raise ConfigError(f"--mp-star is a test AUC or accuracy, in [0, 1]; got {args.mp_star}")
    ref = args.reference_run
    if ref is not None and not ((Path(ref) / "config.toml").is_file() and (Path(ref) / "summary.json").is_file()):
        raise ConfigError(f"--reference-run {ref}: not a finished run directory (needs config.toml and summary.json)")


def _obtain(args: argparse.Namespace, out: Path, attacker: str, attack: str, options: dict[str, Any], *,
            target: str | None = None) -> RecordedRun:
    """The attacked run: loaded from --run, or trained into OUT/run once the attack is known to serve it."""
    if args.run is not None:
        rec = load_recorded(args.run, attacker)
        check_attack(outline_of(rec.run), attack, attacker=attacker, target=target, **options)
        make_out_dir(out, _what(args))
        return rec
    cfg = _train_config(args)
    check_run(cfg, [attack], attacker=attacker, target=target, **options)
    make_out_dir(out, _what(args))
    _note(f"training {cfg.algo} on {cfg.dataset} ({cfg.parties} parties, {cfg.epochs} epochs) recording {attacker}'s "
          f"view -> {out / 'run'}")
    return train_recorded(cfg, attacker, run_dir=out / "run", log=_note, progress=_progress(args))


def _mp_star(args: argparse.Namespace, rec: RecordedRun, out: Path) -> tuple[float, str]:
    if args.mp_star is not None:
        return float(args.mp_star), "given (--mp-star)"
    if args.reference_run is not None:
        summary = json.loads((Path(args.reference_run) / "summary.json").read_text())
        return main_task(summary["metrics"]["test"])[1], f"reference run {args.reference_run}"
    if not is_defended(rec.cfg):
        return rec.mp[1], "this run (no defence)"
    _note(f"training the undefended reference run for MP* -> {out / 'reference'}")
    ref = train_recorded(undefended(rec.cfg), rec.attacker, run_dir=out / "reference", log=_note,
                         progress=_progress(args))
    return ref.mp[1], f"undefended reference run {out / 'reference'}"


def _f(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"


def _table(rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned on their widest cell; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _report(args: argparse.Namespace, summary: dict[str, Any], rows: Sequence[Sequence[str]], path: Path,
            notes: Sequence[str] = ()) -> None:
    """stdout: a short table, notes and where the JSON is (or, with --json, the JSON itself)."""
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return
    print(_table(rows))
    for note in notes:
        print(note)
    print(f"summary: {path}")


def _result_row(label: str, r: AttackResult, mp: float, mp_star: float) -> list[str]:
    return [label, r.metric, _f(r.ap), _f(r.chance), _f(mp), _f(mp_star),
            _f(dcs(r.ap, mp, ap_star=r.chance, mp_star=mp_star))]


def _finish(args: argparse.Namespace, out: Path, result: AttackResult, rec: RecordedRun, mp_star: float,
            star_source: str, extra: dict[str, Any], rows: Sequence[Sequence[str]] | None = None,
            notes: Sequence[str] = ()) -> dict[str, Any]:
    mp_name, mp = rec.mp
    summary = result.summary(mp=mp, mp_star=mp_star)
    summary.update(MP_metric=mp_name, MP_star_source=star_source, run=str(rec.run_dir) if rec.run_dir else None,
                   training={"algo": rec.cfg.algo, "dataset": rec.cfg.dataset, "parties": rec.cfg.parties,
                             "epochs": rec.cfg.epochs, "seed": rec.cfg.seed, "options": rec.cfg.options,
                             "privacy": rec.summary.get("privacy")}, **extra)
    summary["command"] = "secvfl " + " ".join(getattr(args, "_argv", sys.argv[1:]))
    path = out / "summary.json"
    write_json_atomic(path, summary)
    header = ["attack", "metric", "AP", "chance", f"MP (test {mp_name})", "MP*", "DCS"]
    _report(args, summary, [header, *(rows or [_result_row(result.attack, result, mp, mp_star)])], path,
            [*notes, f"MP* from {star_source}"])
    return summary


class LabelInferenceCommand:
    help = ("label inference by a feature party: norm / direction scoring (Li et al.), direct inference from logit "
            "gradients and passive / active model completion (Fu et al.)")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        g = _common(p)
        g.add_argument("--attack", required=True, choices=LABEL_ATTACKS,
                       help="norm / direction: scoring of the gradients a feature party receives; direct: labels "
                            "read off gradients with respect to logits (Fu et al.); model-completion / "
                            "active-model-completion: a completed model trained from a few known labels (Fu et al.)")
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

    writes_own_output = True

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        cfg = None if args.run is not None else _train_config(args)
        out = _out_dir(args, args.attack, cfg)
        _check_main_task_flags(args)
        if args.attack in ("norm", "direction", "direct"):
            rec = _obtain(args, out, args.attacker, args.attack, {"known_positives": args.known_positives})
            result, obj = label_inference(rec, args.attack, known_positives=args.known_positives,
                                          known_scope=args.known_scope, seed=rec.cfg.seed)
            mp_star, source = _mp_star(args, rec, out)
            extra: dict[str, Any] = {}
            if getattr(obj, "scored", None) is not None:
                extra["plot"] = str(plot_label_scores(
                    out / "roc.png", obj.scored["scores"], obj.scored["truth"], obj.scored["aucs"],
                    f"{args.attack} scoring on {short_dataset_name(rec.cfg.dataset)} ({rec.cfg.algo}, attacker "
                    f"{rec.attacker})", ceiling=result.details.get("rr_ceiling")))
            return _finish(args, out, result, rec, mp_star, source, extra)
        cfg_mc = CompletionConfig(epochs=args.completion_epochs, seed=args.seed, method=args.completion_method)
        sizes = sorted(set(args.known_labels))
        options: dict[str, Any] = {"known_labels": tuple(sizes), "method": args.completion_method}
        if args.attack == "model-completion":
            rec = _obtain(args, out, args.attacker, args.attack, options)
            results = model_completion(rec, sizes, config=cfg_mc, seed=rec.cfg.seed, baselines=not args.no_baselines)
            mp_star, source = _mp_star(args, rec, out)
            rows = [{"known_labels": r.details["known_labels"], "AP": r.ap, **r.details} for r in results]
            plot = plot_completion(out / "accuracy_vs_known_labels.png", rows,
                                   f"model completion by {rec.attacker}, {short_dataset_name(rec.cfg.dataset)}")
            table = [_result_row(f"{r.attack} N={r.details['known_labels']}", r, rec.mp[1], mp_star) for r in results]
            return _finish(args, out, results[-1], rec, mp_star, source,
                           {"by_known_labels": rows, "plot": str(plot), "AP_at": f"N = {sizes[-1]} known labels"},
                           rows=table)
        # active: a malicious run and an honest run with the same configuration and seed
        if args.run is not None:
            raise ConfigError("an active attack changes training; it cannot attack an existing --run (drop --run)")
        assert cfg is not None
        check_run(cfg, [args.attack], attacker=args.attacker, gamma=args.gamma, **options)
        honest = None
        if args.reference_run is not None:
            honest = load_recorded(args.reference_run, args.attacker)
            _same_setup(honest.cfg, cfg)  # before spending a training run on the malicious one
        make_out_dir(out, _what(args))
        if honest is None:
            _note(f"training the honest run -> {out / 'honest'}")
            honest = train_recorded(cfg, args.attacker, run_dir=out / "honest", log=_note, progress=_progress(args))
        _note(f"training the malicious run (gamma {args.gamma}) -> {out / 'run'}")
        rec = train_recorded(cfg, args.attacker, run_dir=out / "run", malicious_gamma=args.gamma, log=_note,
                             progress=_progress(args))
        passive = model_completion(honest, sizes, config=cfg_mc, seed=rec.cfg.seed, baselines=False)
        active = model_completion(rec, sizes, config=cfg_mc, seed=rec.cfg.seed, baselines=not args.no_baselines,
                                  name="active-model-completion")
        rows = []
        for p_res, a_res in zip(passive, active, strict=True):
            rows.append({"known_labels": a_res.details["known_labels"], "AP": a_res.ap, **a_res.details,
                         "passive_train_accuracy": p_res.ap, "passive_test_accuracy": p_res.details["test_accuracy"],
                         "gain_over_passive": a_res.ap - p_res.ap})
        plot = plot_completion(out / "accuracy_vs_known_labels.png", rows,
                               f"active vs passive model completion by {rec.attacker}, {short_dataset_name(rec.cfg.dataset)}")
        mp_star = honest.mp[1] if args.mp_star is None else float(args.mp_star)
        table = []
        for p_res, a_res in zip(passive, active, strict=True):
            n = a_res.details["known_labels"]
            table.append(_result_row(f"active N={n}", a_res, rec.mp[1], mp_star))
            table.append(_result_row(f"passive (honest run) N={n}", p_res, honest.mp[1], mp_star))
        return _finish(args, out, active[-1], rec, mp_star, "the honest run", {
            "by_known_labels": rows, "plot": str(plot), "AP_at": f"N = {sizes[-1]} known labels",
            "gamma": args.gamma, "honest_run": str(honest.run_dir), "main_task_change": rec.mp[1] - honest.mp[1]},
            rows=table)


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
        g.add_argument("--attack", required=True, choices=["grn", "equation"],
                       help="grn: generative regression network; equation: solving the linear equations that a "
                            "linear model's prediction scores give (Luo et al.)")
        g.add_argument("--target", default=None, help="the feature party whose features are reconstructed "
                                                      "(default: the last one); the attacker holds every other block")
        g.add_argument("--rows", type=int, default=2000, help="test rows to reconstruct (0: all)")
        g.add_argument("--grn-epochs", type=int, default=100, help="grn: training epochs of the generator")
        g.add_argument("--condition-on-scores", action="store_true",
                       help="GRN extension: feed the observed scores to the generator too")

    writes_own_output = True

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        cfg = None if args.run is not None else _train_config(args)
        out = _out_dir(args, args.attack, cfg)
        _check_main_task_flags(args)
        if args.rows < 0:
            raise ConfigError(f"--rows is a number of test rows (0: all of them), got {args.rows}")
        grn = GRNConfig(epochs=args.grn_epochs, seed=args.seed, condition_on_scores=args.condition_on_scores)
        rec = _obtain(args, out, "label", args.attack, {}, target=args.target)
        target = args.target or rec.run.algorithm.feature_parties[-1].name
        grn = replace(grn, seed=rec.cfg.seed)
        result = feature_reconstruction(rec, args.attack, target, grn=grn, rows=args.rows, seed=rec.cfg.seed)
        mp_star, source = _mp_star(args, rec, out)
        plot = plot_reconstruction(out / "reconstruction.png", result.details,
                                   f"{args.attack} reconstruction of {target}'s features, "
                                   f"{short_dataset_name(rec.cfg.dataset)}")
        d = result.details
        baselines = f"uniform random guess {_f(d.get('random_guess_mse'))}"
        if d.get("mean_guess_mse") is not None:
            baselines += f", each feature's mean {_f(d['mean_guess_mse'])}"
        note = (f"{target}: {d['target_columns']} features of {d['rows']} test rows, MSE {_f(d.get('mse'))} "
                f"({baselines})")
        return _finish(args, out, result, rec, mp_star, source, {"plot": str(plot)},
                       rows=[_result_row(f"{args.attack} ({target})", result, rec.mp[1], mp_star)], notes=[note])


def _mean_std(stat: dict[str, float] | None) -> str:
    if stat is None:
        return "n/a"
    return f"{stat['mean']:.3f} ± {stat['std']:.3f}" if stat["n"] > 1 else f"{stat['mean']:.3f}"


def _grid_table(result: dict[str, Any]) -> list[list[str]]:
    """A line per defence: MP, AP per attack (means over seeds) and why a cell is empty."""
    attacks, rows = result["attacks"], result["rows"]
    done = [r for r in rows if "mp" in r]
    mp_name = done[0]["mp_name"] if done else "metric"

    def chance(a: str) -> str:
        c = next((r["chance"][a] for r in done if r["chance"].get(a)), None)
        metric = next((r["metric"][a] for r in done if a in r["metric"]), "")
        return f" ({metric}, chance {c['mean']:.3f})" if c else ""

    table = [["defence", f"MP (test {mp_name})", *(f"AP {a}{chance(a)}" for a in attacks), "notes"]]
    for r in rows:
        if "refused" in r:
            table.append([r["defence"], "refused", *("-" for _ in attacks), r["refused"].split(";")[0][:80]])
            continue
        notes = [f"{a}: not applicable" for a in r.get("not_applicable", {})]
        if "rr_ceiling" in r:
            notes.append(f"RR ceiling {r['rr_ceiling']:.3f}")
        table.append([r["defence"], _mean_std(r["mp"]), *(_mean_std(r["ap"].get(a)) for a in attacks),
                      "; ".join(notes)])
    return table


class GridCommand:
    help = "label inference suite across defences and seeds: markdown table (MP, AP per attack, DCS) and AP-vs-MP plot"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_train_arguments(p)
        g = p.add_argument_group("grid")
        g.add_argument("--defences", nargs="+", default=["none", "dp:1", "dp:3", "dp:8", "rr:3", "topk:0.1", "ckks",
                                                         "mask"],
                       help="none, dp:EPS, rr:EPS, dpf:EPS, ckks, mask, topk:RATIO")
        g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds per defence")
        g.add_argument("--attacks", nargs="+", default=["norm", "direction"], choices=["norm", "direction", "direct"],
                       help="label-inference attacks run on every training run")
        g.add_argument("--attacker", default="party0", help="the attacking feature party")
        g.add_argument("--known-positives", type=int, default=1, help="direction: known positives per batch")
        _add_output_arguments(g)
        g.add_argument("--keep-runs", action="store_true", help="keep every training run under OUT/runs")

    writes_own_output = True

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        args.run = None
        base = _train_config(args)
        out = _out_dir(args, "grid", base)
        result = run_grid(base, args.defences, args.seeds, args.attacks, attacker=args.attacker,
                          known_positives=args.known_positives, out_dir=out, keep_runs=args.keep_runs, log=_note,
                          progress=_progress(args))
        _report(args, result, _grid_table(result), out / "grid.json",
                [f"DCS and the notes in full: {out / 'grid.md'}; plot: {out / 'grid.png'}"])
        return {k: v for k, v in result.items() if k != "runs"}


ATTACK_COMMANDS.add("label-inference", LabelInferenceCommand)
ATTACK_COMMANDS.add("feature-reconstruction", FeatureReconstructionCommand)
ATTACK_COMMANDS.add("grid", GridCommand)
