"""Serving a trained federation: online inference by entity id, one process per party (`secvfl serve`).

Modules:

* :mod:`secvfl.serve.party` -- a feature party's (or the CKKS aggregator's) serving process: its own table with the
  preprocessing fitted in training (secvfl.deploy.data), its own model, answers to the coordinator only;
* :mod:`secvfl.serve.coordinator` -- the label party's coordinator: loads its part of the model, scores batches of ids
  with the feature parties over the federation's mutual-TLS links, LASER-VFL without the parties that do not answer;
* :mod:`secvfl.serve.batching` -- dynamic batching with bounded waits and queues;
* :mod:`secvfl.serve.http` -- the Open Inference Protocol REST endpoint (uvicorn + Starlette, HTTPS, client
  certificates); :mod:`secvfl.serve.clientcerts` -- the client applications' CA and certificates;
* :mod:`secvfl.serve.wire` -- the serving messages and their checks; :mod:`secvfl.serve.audit` -- each party's
  append-only audit log; :mod:`secvfl.serve.model` -- a run rebuilt in one party's process;
  :mod:`secvfl.serve.demo` -- a federation of files on this host, for trying it.

Threat model. Parties are honest-but-curious as in training, and each checks what it receives: a feature party
answers only the coordinator (the label party named by the federation file, authenticated by mutual TLS), refuses
calls for more ids than agreed and calls out of order, and never sends raw features; the coordinator checks every
answer and output (sender, request, shape, dtype, finiteness) and names the party at fault. Client applications are
authenticated by certificates of their own CA and can only ask for scores by id. What serving reveals: a feature
party learns which ids were scored and when (the coordinator sends the ids; with LASER-VFL also the representations
of the parties it shares an id with); the label party learns which requested ids each party holds and the parties'
outputs -- only their sum under CKKS or masking. TLS hides none of this from the parties themselves, and none of it
from traffic analysis of sizes and timing. Every party's audit log records what it was asked.
"""
