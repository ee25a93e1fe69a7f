"""A suite of label inference attacks across defences and seeds: MP, AP per attack, DCS; a table and a plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from attacks.harness import (
    check_attack,
    check_defence_available,
    defence_options,
    label_inference,
    make_out_dir,
    outline_run,
    train_recorded,
    undefended,
)
from attacks.metrics import dcs
from attacks.plots import plot_grid
from secvfl.config import TrainConfig
from secvfl.errors import UnsupportedError
from secvfl.io import write_json_atomic, write_text_atomic

__all__ = ["run_grid", "summarise_grid", "grid_markdown", "write_grid"]


def _stat(values: Sequence[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": float(np.mean(vals)), "std": float(np.std(vals)), "n": len(vals)}


def run_grid(base: TrainConfig, defences: Sequence[str], seeds: Sequence[int], attacks: Sequence[str], *,
             attacker: str = "party0", known_positives: int = 1, out_dir: Path | None = None, keep_runs: bool = False,
             log: Callable[[str], None] = print, progress: bool = False) -> dict[str, Any]:
    """Train one run per (defence, seed) with the attacker's view recorded, attack it, and summarise.

    MP* is the undefended run of the same seed (``none``, trained even when not listed); AP* is chance (0.5 AUC).
    A defence the algorithm cannot use is reported as refused, with the reason, instead of failing the suite; so is
    an attack that cannot serve the algorithm or dataset (decided before any training). When no attack can, the
    grid is refused before training.
    """
    specs = list(dict.fromkeys(["none", *defences]))
    options = {spec: defence_options(spec) for spec in specs}  # unknown specs fail before any training
    plain = undefended(base)
    outline = outline_run(plain)
    not_applicable: dict[str, str] = {}
    for attack in attacks:
        try:
            check_attack(outline, attack, attacker=attacker, known_positives=known_positives)
        except UnsupportedError as exc:
            not_applicable[attack] = str(exc)
    usable = [a for a in attacks if a not in not_applicable]
    if not usable:
        raise UnsupportedError(f"none of the attacks can serve {base.algo} on {outline.dataset}: "
                               + "; ".join(f"{a}: {why}" for a, why in not_applicable.items()))
    if out_dir is not None:
        make_out_dir(out_dir)
    log(f"attack grid: {base.algo} on {outline.dataset}, defences {', '.join(specs)}, attacks {', '.join(usable)}, "
        f"seeds {', '.join(map(str, seeds))}" + (f" -> {out_dir}" if out_dir is not None else ""))
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        for spec in specs:
            entry: dict[str, Any] = {"defence": spec, "seed": seed, "ap": {}, "details": {},
                                     "not_applicable": dict(not_applicable)}
            try:
                check_defence_available(options[spec], spec)
                cfg = replace(plain, seed=seed, options={**plain.options, **options[spec]})
                run_dir = out_dir / "runs" / f"{spec.replace(':', '-')}-seed{seed}" if keep_runs and out_dir else None
                rec = train_recorded(cfg, attacker, run_dir=run_dir, log=lambda _msg: None, progress=progress)
            except UnsupportedError as exc:
                entry["refused"] = str(exc)
                log(f"  {spec:>10} seed {seed}: refused ({str(exc).splitlines()[0]})")
                runs.append(entry)
                continue
            entry["mp_name"], entry["mp"] = rec.mp
            privacy = rec.summary.get("privacy")
            if privacy:
                entry["privacy"] = {k: privacy.get(k) for k in ("epsilon", "delta", "mechanism", "noise_multiplier")
                                    if k in privacy}
            for attack in usable:
                try:
                    result, _ = label_inference(rec, attack, known_positives=known_positives, seed=seed)
                except UnsupportedError as exc:
                    entry["not_applicable"][attack] = str(exc)
                    continue
                entry["ap"][attack] = result.ap
                entry.setdefault("chance", {})[attack] = result.chance
                entry.setdefault("metric", {})[attack] = result.metric
                entry["details"][attack] = {k: result.details[k] for k in ("p95_abs_auc_minus_half", "rr_ceiling")
                                            if k in result.details}
                if "rr_ceiling" in result.details:
                    entry["rr_ceiling"] = result.details["rr_ceiling"]
            shown = ", ".join(f"{a} {v:.3f}" for a, v in entry["ap"].items())
            log(f"  {spec:>10} seed {seed}: MP {entry['mp_name']} {entry['mp']:.4f}; AP {shown}")
            runs.append(entry)
    result = summarise_grid(runs, specs, attacks)
    result.update({
        "config": {k: v for k, v in plain.to_dict().items() if k != "options"},
        "seeds": list(seeds), "attacker": attacker, "known_positives_per_batch": known_positives,
    })
    result["markdown"] = grid_markdown(result)
    if out_dir is not None:
        write_grid(result, out_dir, f"{base.algo} on {base.dataset}, {base.parties} parties: attack vs main task")
    return result


def write_grid(result: dict[str, Any], out_dir: Path, title: str) -> None:
    """grid.json, grid.md and grid.png in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result["files"] = {k: str(out_dir / f"grid.{k}") for k in ("json", "md", "png")}
    write_json_atomic(out_dir / "grid.json", result)
    write_text_atomic(out_dir / "grid.md", result["markdown"] + "\n")
    rows = [r for r in result["rows"] if "mp" in r]
    mp_name = next((r["mp_name"] for r in rows), "metric")
    plot_grid(out_dir / "grid.png", rows, result["attacks"], mp_name, title)


def summarise_grid(runs: list[dict[str, Any]], specs: Sequence[str], attacks: Sequence[str]) -> dict[str, Any]:
    """Per-defence means and standard deviations over seeds, with DCS against the same seed's undefended run.

    AP* is each attack's chance level (0.5 for AUC; the majority-class rate for accuracy, e.g. direct inference).
    """
    star = {r["seed"]: r["mp"] for r in runs if r["defence"] == "none" and "mp" in r}
    for r in runs:
        if "mp" in r and r["seed"] in star:
            r["dcs"] = {a: dcs(ap, r["mp"], ap_star=r.get("chance", {}).get(a, 0.5), mp_star=star[r["seed"]])
                        for a, ap in r["ap"].items()}
    rows = []
    for spec in specs:
        mine = [r for r in runs if r["defence"] == spec]
        done = [r for r in mine if "mp" in r]
        row: dict[str, Any] = {"defence": spec, "seeds": [r["seed"] for r in done]}
        if not done:
            row["refused"] = mine[0].get("refused", "no run finished") if mine else "not run"
        else:
            row["mp"] = _stat([r["mp"] for r in done])
            row["mp_name"] = done[0]["mp_name"]
            row["ap"] = {a: _stat([r["ap"].get(a) for r in done]) for a in attacks}
            row["chance"] = {a: _stat([r.get("chance", {}).get(a) for r in done]) for a in attacks}
            row["dcs"] = {a: _stat([r.get("dcs", {}).get(a) for r in done]) for a in attacks}
            row["metric"] = dict(done[0].get("metric", {}))
            row["not_applicable"] = done[0]["not_applicable"]
            if "rr_ceiling" in done[0]:
                row["rr_ceiling"] = done[0]["rr_ceiling"]
            if "privacy" in done[0]:
                row["privacy"] = done[0]["privacy"]
        rows.append(row)
    return {"defences": list(specs), "attacks": list(attacks), "rows": rows, "runs": runs}


def _fmt(stat: dict[str, float] | None) -> str:
    if stat is None:
        return "n/a"
    return f"{stat['mean']:.3f} ± {stat['std']:.3f}" if stat["n"] > 1 else f"{stat['mean']:.3f}"


def grid_markdown(result: dict[str, Any]) -> str:
    attacks = result["attacks"]
    rows = result["rows"]
    mp_name = next((r["mp_name"] for r in rows if "mp_name" in r), "metric")
    metric = {a: next((r["metric"][a] for r in rows if a in r.get("metric", {})), "auc") for a in attacks}
    head = (["defence", f"MP (test {mp_name})"]
            + [f"AP {a}" + (f" ({metric[a]})" if metric[a] != "auc" else "") for a in attacks]
            + [f"DCS {a}" for a in attacks] + ["notes"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "refused" in r:
            reason = r["refused"].splitlines()[0].replace("|", "/")
            cells = [r["defence"], "refused"] + ["—"] * (2 * len(attacks)) + [reason]
        else:
            notes = []
            if "rr_ceiling" in r:
                notes.append(f"RR ceiling e^ε/(1+e^ε) = {r['rr_ceiling']:.3f}")
            for a, why in r.get("not_applicable", {}).items():
                notes.append(f"{a}: {why.split(';')[0]}")
            cells = ([r["defence"], _fmt(r["mp"])] + [_fmt(r["ap"].get(a)) for a in attacks]
                     + [_fmt(r["dcs"].get(a)) for a in attacks] + ["; ".join(notes).replace("|", "/")])
        lines.append("| " + " | ".join(cells) + " |")
    n = len(result["seeds"])
    lines.append("")
    lines.append(f"Means ± standard deviations over {n} seed{'s' * (n != 1)} ({', '.join(map(str, result['seeds']))}). "
                 f"AP: mean per-batch ROC AUC of the attack on the labels of {result['attacker']}'s training batches "
                 f"(chance 0.5; direction scoring knows {result['known_positives_per_batch']} positive per batch)"
                 + ("; for direct inference, accuracy (chance: the majority-class rate)" if "direct" in attacks else "")
                 + ". DCS (VFLAIR, β = 0.5): 1/(1 + sqrt(0.5·max(0, AP − AP*)² + 0.5·max(0, MP* − MP)²)), AP* = the "
                 "attack's chance level, MP* = the undefended run of the same seed.")
    return "\n".join(lines)
