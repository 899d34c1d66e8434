"""Model weights on nodes: removed when their model leaves the catalog and nothing uses them.

Desired state only: a node's ``remove_weights`` lists the weights it should delete; its agent
deletes them once no shard uses them (refusing clearly while one does) and reports the outcome,
after which the entry is dropped again. A model re-added with the same source cancels the removal.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from django.db.models.signals import pre_delete

from control import nudges
from control.models import Event, Node, ServedModel, Shard

logger = logging.getLogger(__name__)

FINISHED = {"removed", "absent"}


def schedule_removal(model: ServedModel) -> list[str]:
    """The model is being deleted: every node that ran it is asked to remove its weights,
    unless another catalog entry uses the same source. Runs inside the deleting transaction,
    so the removal is scheduled exactly when the deletion commits. Returns the node names."""
    if ServedModel.objects.filter(source=model.source).exclude(pk=model.pk).exists():
        return []
    node_ids = set(Shard.objects.filter(replica__model=model).values_list("node_id", flat=True))
    names = []
    for node in Node.objects.filter(pk__in=node_ids).select_for_update():
        if model.source not in node.remove_weights:
            Node.objects.filter(pk=node.pk).update(
                remove_weights=[*node.remove_weights, model.source]
            )
            nudges.nudge_node(node.pk)
            names.append(node.name)
    if names:
        Event.objects.create(
            kind=Event.Kind.OPERATOR,
            subject=f"model/{model.name}",
            message=f"model deleted: weights {model.source} to be removed from {', '.join(names)}",
        )
    return names


class NodeWeights(Protocol):
    """What :func:`settled_removals` reads of a node (a row, or the reconciler's view)."""

    @property
    def weights_report(self) -> Any: ...

    @property
    def remove_weights(self) -> Any: ...


def settled_removals(node: NodeWeights, catalog_sources: set[str]) -> list[str]:
    """What a node's ``remove_weights`` should still hold (pure): not what its agent reported
    removed or absent, and never the weights of a model in the catalog."""
    finished = {
        str(report.get("name"))
        for report in node.weights_report
        if isinstance(report, dict) and report.get("state") in FINISHED
    }
    return [w for w in node.remove_weights if w not in finished and w not in catalog_sources]


def _before_model_delete(sender: Any, instance: ServedModel, **kwargs: Any) -> None:
    schedule_removal(instance)


def install() -> None:
    pre_delete.connect(_before_model_delete, sender=ServedModel, dispatch_uid="llmgw-weights")
