"""Pure builders: a validated spec in, the manifests of the children out.

``desired_children`` is the whole desired state of one EmbeddingService: the children that
must exist (in apply order: storage first, the Deployment before what points at it) and the
kinds that must not (an HPA after autoscaling was switched off or moved to KEDA, a
ScaledObject after it moved back, a PDB after scaling to one, a NetworkPolicy after it was
disabled).
"""

from __future__ import annotations

from dataclasses import dataclass

from embedding_operator.builders.common import Manifest, RenderInput, pvc_name
from embedding_operator.builders.deployment import build_deployment
from embedding_operator.builders.hpa import build_hpa, wants_hpa
from embedding_operator.builders.keda import build_scaled_object, wants_scaled_object
from embedding_operator.builders.networkpolicy import build_network_policy, wants_network_policy
from embedding_operator.builders.pdb import build_pdb, wants_pdb
from embedding_operator.builders.pvc import build_pvc, wants_pvc
from embedding_operator.builders.service import build_service
from embedding_operator.kube import ObjectRef


@dataclass(frozen=True)
class DesiredChildren:
    present: list[Manifest]
    absent: list[ObjectRef]


def desired_children(render: RenderInput) -> DesiredChildren:
    owner = render.owner
    present: list[Manifest] = []
    absent: list[ObjectRef] = []
    if wants_pvc(render):
        present.append(build_pvc(render))
    else:
        absent.append(ObjectRef("v1", "PersistentVolumeClaim", owner.namespace, pvc_name(owner)))
    present += [build_deployment(render), build_service(render)]
    if wants_hpa(render):
        present.append(build_hpa(render))
    else:
        absent.append(
            ObjectRef("autoscaling/v2", "HorizontalPodAutoscaler", owner.namespace, owner.name)
        )
    if wants_scaled_object(render):
        present.append(build_scaled_object(render))
    else:
        absent.append(ObjectRef("keda.sh/v1alpha1", "ScaledObject", owner.namespace, owner.name))
    if wants_pdb(render):
        present.append(build_pdb(render))
    else:
        absent.append(ObjectRef("policy/v1", "PodDisruptionBudget", owner.namespace, owner.name))
    if wants_network_policy(render):
        present.append(build_network_policy(render))
    else:
        absent.append(
            ObjectRef("networking.k8s.io/v1", "NetworkPolicy", owner.namespace, owner.name)
        )
    return DesiredChildren(present=present, absent=absent)


__all__ = ["DesiredChildren", "desired_children"]
