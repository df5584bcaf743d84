"""What an EmbeddingService's author may choose beyond what RBAC lets them create (pure).

Creating an EmbeddingService is running code in its namespace: the server image, and with ``env``
any Secret or ConfigMap of the namespace read into the pod (``valueFrom``). RBAC decides who may
create one; the operator's administrator additionally decides which images may run
(``allowedImages``). A spec naming another image is not reconciled: its children stay as they are
and the status says ``ImageNotAllowed``.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from kembed_operator.config import OperatorConfig
from kembed_operator.spec import EmbeddingServiceSpec, InvalidSpec


class ImageNotAllowed(InvalidSpec):
    """The spec names an image the operator's configuration does not allow."""

    reason = "ImageNotAllowed"


def image_allowed(image: str, config: OperatorConfig) -> bool:
    """The default image (the administrator's choice) always; others when a pattern matches all of it."""
    return image == config.default_image or any(fnmatchcase(image, pattern) for pattern in config.allowed_images)


def check_image(spec: EmbeddingServiceSpec, config: OperatorConfig) -> None:
    """:class:`ImageNotAllowed` unless the image the pods would run is allowed."""
    image = spec.image or config.default_image
    if image_allowed(image, config):
        return
    patterns = ", ".join(config.allowed_images) or "none"
    raise ImageNotAllowed(
        f"spec.image: {image!r} is not allowed by the operator: it runs {config.default_image!r} and images "
        f"matching its allowedImages ({patterns}); ask its administrator, or leave spec.image empty"
    )
