"""What the cluster's admins allow EmbeddingServices to run: an image and priority-class allowlist.

Creating an EmbeddingService is creating pods: the operator runs them with the image, env
(``valueFrom`` any Secret in the namespace), tolerations and priority class the CR asks for. In
a cluster where CR authors are not trusted with that, admins narrow it here, once, for every
namespace the operator watches (``--allowed-images``, ``--allowed-priority-classes``; Helm
``policy.*``). A CR outside the allowlist is refused before anything is applied, like any
other refusal: Degraded with ``ImageNotAllowed`` or ``PriorityClassNotAllowed``, the field
named, and no child created or changed.

Pure, like the builders: ``plan`` (and so ``embedding-operator render``) applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from embedding_operator.builders.common import RenderInput
from embedding_operator.status import IMAGE_NOT_ALLOWED, PRIORITY_CLASS_NOT_ALLOWED, Problem


@dataclass(frozen=True)
class WorkloadPolicy:
    """Empty tuples allow anything (the default: no allowlist configured).

    ``allowed_images`` are shell-style patterns matched against the whole image reference
    (``registry.example/embedding-server:*``, ``ghcr.io/embedding-operator/*``; ``*`` also
    matches ``/``, so end a registry prefix with ``/``). The operator's own ``--default-image``
    is always allowed: an admin configured it. ``allowed_priority_classes`` are exact names;
    a CR that sets no priority class is always allowed.
    """

    allowed_images: tuple[str, ...] = ()
    allowed_priority_classes: tuple[str, ...] = ()

    def refusal(self, render: RenderInput) -> Problem | None:
        """Why this spec may not run on this cluster, naming the field; None if it may."""
        spec = render.spec
        image = spec.server.image
        if (
            image is not None
            and image != render.default_image
            and self.allowed_images
            and not any(fnmatchcase(image, pattern) for pattern in self.allowed_images)
        ):
            return Problem(
                IMAGE_NOT_ALLOWED,
                f"spec.server.image: {image!r} is not in the operator's image allowlist "
                f"({', '.join(self.allowed_images)}); use an allowed image, or unset "
                f"spec.server.image for the default {render.default_image!r}; nothing is applied "
                "until then",
            )
        priority = spec.scheduling.priority_class_name
        if (
            priority
            and self.allowed_priority_classes
            and priority not in self.allowed_priority_classes
        ):
            return Problem(
                PRIORITY_CLASS_NOT_ALLOWED,
                f"spec.scheduling.priorityClassName: {priority!r} is not in the operator's "
                f"priority-class allowlist ({', '.join(self.allowed_priority_classes)}); use "
                "one of them or unset it; nothing is applied until then",
            )
        return None


ALLOW_ALL = WorkloadPolicy()
