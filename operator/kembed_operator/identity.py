"""Names shared by the CRD, the renderer, the handlers and the chart: the resource and its labels."""

from typing import Final

GROUP: Final = "kembed.io"
VERSION: Final = "v1alpha1"
PLURAL: Final = "embeddingservices"
KIND: Final = "EmbeddingService"

FIELD_MANAGER: Final = "kembed-operator"
MANAGED_BY: Final = "kembed-operator"

LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
APP_NAME: Final = "kembed"
