"""Measured label-inference attacks against each label-DP mechanism, quoted in every run's ``PRIVACY.md``.

These are measurements, not guarantees: they show what the attacks in ``attacks/`` actually achieved on a
reference setting, next to the bound that holds for every attacker. Each entry names its source; regenerate them with
the command given there when a mechanism changes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MEASURED_ATTACKS", "measured_attacks"]

_GRID = ("credit, splitnn, 4 parties, 5 epochs, attacker party0, 3 seeds; attacks/README.md (`secvfl attack grid "
         "--dataset credit --parties 4 --epochs 5 --defences none dp:1 dp:3 dp:8 rr:3 --seeds 0 1 2`)")

_DIGITS = ("digits, splitnn, 4 parties, 10 epochs, attacker party0, 3 seeds (0 1 2); `secvfl attack label-inference "
           "--attack direction --dataset digits --privacy dp --epsilon 3 --dp-mechanism M --seed S`; chance 0.10")

# mechanism -> rows (epsilon, number of classes, attack, metric, mean value, setting/source). Label-inference AUC:
# 0.5 is chance; label-inference accuracy: 1/K is chance.
MEASURED_ATTACKS: dict[str, list[dict[str, Any]]] = {
    "none": [
        {"epsilon": None, "classes": 2, "attack": "norm scoring", "metric": "AUC", "value": 0.885, "setting": _GRID},
        {"epsilon": None, "classes": 2, "attack": "direction scoring", "metric": "AUC", "value": 0.999, "setting": _GRID},
        {"epsilon": None, "classes": 10, "attack": "direction scoring", "metric": "accuracy", "value": 0.657,
         "setting": _DIGITS},
    ],
    "gradient": [
        {"epsilon": 1.0, "classes": 2, "attack": "norm scoring", "metric": "AUC", "value": 0.472, "setting": _GRID},
        {"epsilon": 1.0, "classes": 2, "attack": "direction scoring", "metric": "AUC", "value": 0.501, "setting": _GRID},
        {"epsilon": 3.0, "classes": 2, "attack": "norm scoring", "metric": "AUC", "value": 0.475, "setting": _GRID},
        {"epsilon": 3.0, "classes": 2, "attack": "direction scoring", "metric": "AUC", "value": 0.512, "setting": _GRID},
        {"epsilon": 8.0, "classes": 2, "attack": "norm scoring", "metric": "AUC", "value": 0.491, "setting": _GRID},
        {"epsilon": 8.0, "classes": 2, "attack": "direction scoring", "metric": "AUC", "value": 0.552, "setting": _GRID},
        {"epsilon": 3.0, "classes": 10, "attack": "direction scoring", "metric": "accuracy", "value": 0.104,
         "setting": _DIGITS + " (the model itself collapsed: test accuracy 0.16)"},
    ],
    "rr": [
        {"epsilon": 3.0, "classes": 2, "attack": "norm scoring", "metric": "AUC", "value": 0.829, "setting": _GRID},
        {"epsilon": 3.0, "classes": 2, "attack": "direction scoring", "metric": "AUC", "value": 0.942, "setting": _GRID},
        {"epsilon": 3.0, "classes": 10, "attack": "direction scoring", "metric": "accuracy", "value": 0.516,
         "setting": _DIGITS},
    ],
    "rr-prior": [
        {"epsilon": 3.0, "classes": 10, "attack": "direction scoring", "metric": "accuracy", "value": 0.295,
         "setting": _DIGITS},
    ],
    "alibi": [
        {"epsilon": 3.0, "classes": 10, "attack": "direction scoring", "metric": "accuracy", "value": 0.154,
         "setting": _DIGITS},
    ],
}


def measured_attacks(mechanism: str) -> list[dict[str, Any]]:
    return list(MEASURED_ATTACKS.get(mechanism, []))
