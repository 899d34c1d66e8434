"""``make bench-fleet``: the control plane at fleet scale, measured.

A thousand simulated nodes (``python -m agents.fleet``: the real agent, engines in-process)
against PostgreSQL and Redis, two web processes and one worker (with beat), as two
control-plane hosts: ``cp1`` (web and the reconciler's worker, so the leader) and ``cp2`` (web
only). Each node lists both; half start with each. The catalog is mixed: single-GPU, multi-GPU
and two-node models, ``min_replicas`` 0 to 2. Phases, in order:

1. the fleet connects to an empty catalog; the catalog is written; time until every replica
   its minimums ask for is placed, then ready;
2. steady state: reconcile tick p50/p99 (each tick's runtime from the worker's Celery task
   events), heartbeat and other writes per second at the store (``pg_stat_user_tables``);
3. a wave: requests for ``--wave`` cold models recorded at once (demand, as the gateway
   records it); tick p50/p99 until all are ready;
4. ``--duration`` seconds of steady state: web-process RSS sampled, and its slope; database
   connections each web process holds (``pg_stat_activity`` by application name);
5. a reconnect storm: cp1's web process and worker are killed (SIGKILL); time until every
   node is connected to cp2 and has been sent its desired state, handshakes refused meanwhile,
   and the ERROR/FATAL lines PostgreSQL logged for this database.

Invariants are checked throughout (the cluster tests' store checker: no GPU or port given to
two live shards, no model above its maximum; and the fleet's own: no GPU used by two live
engines of one node). The table is printed, and written as JSON to ``--json`` (default
``var/bench-fleet.json``).

The modules, in the order a run uses them: :mod:`~bench.fleet.rig` (the run's options and its
processes), :mod:`~bench.fleet.catalog` (the models it places), :mod:`~bench.fleet.store`
(what the store is read for), :mod:`~bench.fleet.phases` (the phases above, one run) and
:mod:`~bench.fleet.figures` (the table).

    python -m bench.fleet [--nodes 1000] [--models 500] [--duration 600]
"""
