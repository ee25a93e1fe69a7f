"""The saddle-point family: linear and MLP VFL trained on the Lagrangian (``--algo eg|gd|nesterov|admm|eg-mlp``).

Beznosikov et al., "Exploring New Frontiers in Vertical Federated Learning: the Role of Saddle Point
Reformulation". Feature party ``k`` holds the block ``A_k`` (N x d_k) of the training matrix and weights ``x_k``
(d_k x C); the label party holds the labels, ``z`` (N x C) and the dual variable ``lambda`` (N x C).

* minimisation form: ``min_x f(x) = l(sum_k A_k x_k) + sum_k r_k(x_k)``, ``l(z) = mean_n loss(z_n, y_n)``,
  ``r_k = (mu/2) ||x_k||^2``;
* saddle form: ``min_{x,z} max_lambda  l(z) + r(x) + <lambda, sum_k A_k x_k - z>``, with the monotone operator
  ``F(x, z, lambda) = (grad r_k(x_k) + A_k^T lambda  for each k,  grad l(z) - lambda,  -(sum_k A_k x_k - z))``.

Modules: ``losses`` (the loss on ``z``), ``federation`` (the parties, their network and the power iteration for
``lambda_max``), ``base`` (the methods' communication helpers and run loop), ``extragradient`` (EG, the family's
method), ``baselines`` (GD, Nesterov, ADMM, the centralised optimum), ``methods`` (the one builder ``secvfl train``
and ``secvfl reproduce saddle`` share, and step tuning), ``monitor`` (the experimenter's objective and curves),
``mlp`` (stochastic EG with MLP bottoms), ``train`` (the trainers behind ``secvfl train``) and ``flags`` (their
``--saddle-*`` flags). Everything between parties crosses a :class:`~secvfl.transport.network.Network`, so
compression, DP and secure aggregation layers apply and every byte is counted.

Threat model: as plain VFL with the same messages. The label party sees every ``A_k x_k`` (or only their sum under
CKKS/masking); feature parties see ``lambda``, which at the optimum is ``grad l(z*)`` -- a function of the labels,
like a gradient in split learning. Power iteration exposes ``A_k A_k^T v`` for random ``v`` once at setup.
"""

from secvfl.algorithms.saddle import train  # noqa: F401 - registers the family's algorithms
