"""Attacks that measure what a curious or malicious party learns under each protocol.

Every attack runs on its attacker's view only (a recorded :class:`~secvfl.transport.network.View` plus that party's
own objects) and states its threat model; ground truth is used only to score it. Registered by name in
:data:`ATTACKS`.
"""

from attacks.base import ATTACKS, FEATURE_RECONSTRUCTION, LABEL_INFERENCE, Attack, AttackResult, RunOutline
from attacks.feature_reconstruction import (
    EquationSolving,
    GenerativeRegressionNetwork,
    GRNConfig,
    LinearSolution,
    score_reconstruction,
    solve_linear_features,
    train_generator,
)
from attacks.label_inference import (
    DirectionScoring,
    DirectLabelInference,
    NormScoring,
    direct_predictions,
    direction_cluster_predictions,
    direction_scores,
    norm_scores,
    sample_known_labels,
)
from attacks.malicious_optimizer import MaliciousOptimizer
from attacks.metrics import (
    AucSummary,
    accuracy,
    best_label_matching,
    dcs,
    feature_mse,
    majority_rate,
    per_batch_auc,
    random_guess_mse,
    randomized_response_ceiling,
    roc_auc,
)
from attacks.model_completion import (
    ActiveModelCompletion,
    CompletedModel,
    CompletionConfig,
    PassiveModelCompletion,
    complete_model,
    predict,
)
from attacks.observations import GradientBatch, observe_gradients

__all__ = [
    "ATTACKS", "FEATURE_RECONSTRUCTION", "LABEL_INFERENCE", "Attack", "AttackResult", "RunOutline",
    "GradientBatch", "observe_gradients",
    "NormScoring", "DirectionScoring", "DirectLabelInference", "norm_scores", "direction_scores",
    "direction_cluster_predictions", "direct_predictions", "sample_known_labels",
    "PassiveModelCompletion", "ActiveModelCompletion", "CompletionConfig", "CompletedModel", "complete_model",
    "predict", "MaliciousOptimizer",
    "GenerativeRegressionNetwork", "EquationSolving", "GRNConfig", "LinearSolution", "train_generator",
    "solve_linear_features", "score_reconstruction",
    "AucSummary", "roc_auc", "per_batch_auc", "accuracy", "majority_rate", "best_label_matching", "feature_mse",
    "random_guess_mse", "dcs", "randomized_response_ceiling",
]
