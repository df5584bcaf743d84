"""Names shared by the CRDs, the renderers, the handlers and the chart: the resources and their labels."""

from typing import Final

GROUP: Final = "kembed.io"
VERSION: Final = "v1alpha1"
PLURAL: Final = "embeddingservices"
KIND: Final = "EmbeddingService"
JOB_PLURAL: Final = "embeddingjobs"
JOB_KIND: Final = "EmbeddingJob"

FIELD_MANAGER: Final = "kembed-operator"
MANAGED_BY: Final = "kembed-operator"

LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
APP_NAME: Final = "kembed"
# An EmbeddingJob's pods carry another name than the servers', so no server's Service, disruption
# budget or PodMonitor selects them, whatever the two resources are called.
JOB_APP_NAME: Final = "kembed-job"
