"""EmbeddingJob: a corpus embedded once, as Kubernetes Jobs, against an EmbeddingService.

The second custom resource, with its own controller beside the EmbeddingService one and the
same shape: ``spec`` (the CR spec, drift-checked against ``crds/embeddingjobs.yaml``), pure
``builders`` (the ServiceAccount and the planner and worker Jobs), pure ``status`` (computed
from what the Jobs and their pods report), ``reconcile`` (one step per reconcile) and
``handlers`` (kopf watches that only enqueue).
"""
