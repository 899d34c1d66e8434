"""The reconciler: compare what the catalog and demand want with what the fleet runs, and
converge. Leader-gated and fenced: it acts only while this process holds the lease, and every
write happens inside :func:`control.leases.fenced`, so a deposed leader's late writes change
nothing.

A tick reads one snapshot (:mod:`control.reconciler.snapshot`), decides with pure functions
(``control.lifecycle``, ``control.scaling``, ``control.placement``) and applies each decision,
in order (:mod:`control.reconciler.tick`), as its own state change in
:mod:`control.leader_operations`: one function, one fenced transaction, a conditional update
whose row count says whether the world still looked as the decision assumed, an Event, and the
affected nodes' desired-state revision bumped with a nudge sent on commit. Running a tick twice
is harmless: the second finds nothing to do. :mod:`control.reconciler.runner` keeps this
process's claim on the lease between ticks and runs one tick at a time on a host.
"""
