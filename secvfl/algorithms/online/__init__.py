"""Event-driven online VFL (Wang et al., ICLR 2025): OGD, SLR and DLR over a data stream, each round activating all
parties (full), each with probability P (random:P) or those whose features average above GAMMA (event:GAMMA).

Why these are :class:`~secvfl.algorithms.base.Algorithm` s run by the ordinary runner and not a separate command: an
online run is a sequence of rounds whose whole state (models, DLR windows, SLR input windows, activation generators,
the stream's generator, the prequential counters) fits a checkpoint, so an epoch can simply be a block of
``--samples`` rounds. The runner then gives checkpoints every block, exact ``--resume`` after kill -9, the progress
bar, the NaN guard, the protocol set-up (every layer's ``check``) and the run directory; the family adds one
metrics.jsonl record per block (``Algorithm.epoch_record``) and its summary and plot (``Algorithm.report``).

Modules: :mod:`.flags` (typed options), :mod:`.activation`, :mod:`.streams` (replay and per-party feeds),
:mod:`.buffers` (DLR windows), :mod:`.parties` and :mod:`.handles`, :mod:`.algorithms` (ogd, slr, dlr),
:mod:`.metrics` (prequential), :mod:`.live` (rounds from live per-party event sources).

Protocols. The label party needs each party's embedding (concatenation), so CKKS and masked aggregation do not
apply (they are refused: they need a sum or mean). Compression and the secure channel apply per message as for any
algorithm. Differential privacy over a stream is refused until a mechanism accounts for it honestly: the label-DP
mechanisms here replace the labels of a fixed training set once, while a stream's labels arrive one per round (a
per-sample guarantee, each sample seen once, would need the label replaced on arrival, and a replayed source row
appears many times, so it would not protect the source record); see the report of issue 17.
"""

from secvfl.algorithms.online import algorithms as _algorithms  # noqa: F401 - registers ogd, slr, dlr
