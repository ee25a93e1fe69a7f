"""The VIM family: multi-head VFL with VIMSGD, VIMADMM and VIMADMM-J (``--algo vimsgd | vimadmm | vimadmm-j``).

Xie et al., "Improving Vertical Federated Learning by Efficient Communication with ADMM". Feature party k runs a
bottom model ``f(x^k; theta_k)`` giving ``h^k`` (``--embedding-dim`` is the paper's ``d_f``: the CLI's default 16,
the paper's 60 with ``--embedding-dim 60``); one linear head ``W_k`` (``d_f x d_c``) per party maps it to the
``d_c`` outputs (1 logit for a binary task, one per class otherwise), and the prediction is
``sum_k h^k W_k + b``. L2 weight ``beta`` (``--vim-beta``) on every bottom model and head, applied as SGD
weight decay. Losses are batch means.

* ``vimsgd`` (:mod:`.vimsgd`): heads at the label party, one SGD step per round on each side.
* ``vimadmm`` (:mod:`.vimadmm`): heads at the label party; per round the label party solves the per-sample
  z-update (:mod:`.zsolve`), updates the duals and takes one SGD step of the heads; parties take ``tau``
  (``--vim-local-steps``, 20) local steps on the ADMM objective from the dual, their residual and their head.
* ``vimadmm-j`` (:mod:`.joint`): each party holds its own head and sends logits; the label party needs only their sum
  (it sends every party ``z - sum o``), so it runs under ``--he ckks`` and ``--secagg mask``.

Modules: ``options`` (the ``--vim-*`` flags), ``model`` (the heads), ``zsolve`` (the batched z-update), ``parties``
and ``handles`` (the ADMM parties and the requests the coordinator makes of them), ``base`` (what the three share).

Defaults (the paper's Table 1, MNIST, adapted to the CLI's batch 64: :data:`.options.DEFAULT_LR` says how they were
chosen): ``--vim-lr`` 0.3 (vimsgd) / 0.01 (vimadmm, vimadmm-j), ``--vim-rho`` 2 (vimadmm) / 0.5 (vimadmm-j),
``--vim-local-steps`` 20, ``--vim-momentum`` 0.9 (parties' SGD; the label party's SGD has none), ``--vim-beta`` 0.005
(vimsgd) / 1e-4 (vimadmm, vimadmm-j), ``--vim-prox`` 0. No fixed step size is safe for every data set (the curvature
of a party's local objective grows with its embeddings, that of VIMADMM's head step with the number of parties), so
the ADMM methods guard their steps: a party's local step that blows its objective up is undone and the step size
halved for the round, and the label party's head step backtracks until it descends (:mod:`.parties`). When VIM pays
off against VAFL in bytes: BENCHMARKS.md, VIM, "At the command line's defaults" (``secvfl bench vim-defaults``).

Stability of the ADMM methods. All M parties close the same gap ``z - sum o`` in parallel, so their sum can overshoot
it up to M times (parallel multi-block ADMM); with many parties and a step size large enough to train in a few epochs
vimadmm diverges. ``--vim-prox C`` adds the proximal Jacobian term ``gamma/2 ||o^k - o^k_0||^2``, gamma = C (M - 1)
rho, to each party's local objective (Deng et al. 2017), and the local steps restart their momentum when their
objective rises and halve the step when it more than doubles (:class:`.parties.ADMMFeatureParty`). ``secvfl
reproduce vim`` (14 parties) uses C = 0.3 for vimadmm; the git history of BENCHMARKS.md ("Stabilising VIMADMM") has the measurements. ``--lr``, ``--optimizer`` and ``--weight-decay`` do not apply (refused). The batch size stays
the CLI's (``--batch-size``, 64); the paper uses 1024 (``--batch-size 1024``).

State. The label party keeps one dual ``lambda_j`` (``d_c`` values) per training row, checkpointed with it (``z_j`` is
recomputed from ``lambda_j`` each round, so it needs no state); ``--resume`` continues exactly.

Bytes per round and party (float32, batch B): vimsgd ``B d_f 4`` up and down; vimadmm ``B d_f 4`` up,
``2 B d_c 4 + d_f d_c 4`` down (messages ``dual`` and ``head``); vimadmm-j ``B d_c 4`` up (through the aggregation),
``2 B d_c 4`` down; plus one header per message. Evaluation sends the outputs only.

Protocols (decided by traits and the parties' hooks; no protocol code here):

* compression: both directions (forward: embeddings/logits; backward: gradients, or the ``dual``/``head`` messages).
  A sparsifier (topk/randk) needs error feedback (``+ef``/``+vr``): each message is stepped on as sent (vimsgd: SGD at
  a large step; the ADMM methods: tau local steps towards the dual and residual), and without memory randk:0.1 made
  vimsgd diverge and the ADMM methods fall below the majority class on breast_cancer. vimadmm-j refuses a sparsifier
  on its logits even with ``+ef`` (per-batch outputs keep no memory, and the z-update needs each row's sum).
* ``--he ckks``, ``--secagg mask``: refused for vimsgd and vimadmm (the label party needs each ``h^k`` to step
  ``W_k``), accepted for vimadmm-j (the label party sees only the sum of the logits).
* label DP: vimsgd takes every mechanism, as splitnn does (its messages are a split network's). vimadmm and
  vimadmm-j take ``rr``: the labels are randomised once before training and every later message is post-processing,
  so the rr accounting (one release of each label) holds. Mechanisms that replace the label party's backward pass
  (gradient, rr-prior, alibi) are refused with the reason: there is no backward pass, and the duals and residuals
  are not the gradients the gradient mechanism clips and accounts for.
* feature DP: vimsgd as splitnn; refused for vimadmm and vimadmm-j (``tau`` local steps per batch on the label
  party's duals are not the one clipped gradient per row and epoch its accounting covers).
* the secure channel: unchanged.

Missing feature blocks (``--p-miss-train/--p-miss-test``): a party sends zeros for a row it does not hold, so it adds
nothing to that row's prediction, its head gets no gradient from the row and its local steps none either.

For client-level explainability (the next step): :meth:`VIMAlgorithm.party_importance` returns ``{party: ||W_k||_F}``
after training, each norm reported by the party holding the head (the label party for vimsgd/vimadmm, the party
itself for vimadmm-j).
"""

from secvfl.algorithms.vim import joint, vimadmm, vimsgd  # noqa: F401 - registers the family's algorithms
