"""Loaded by ``kopf run`` beside the operator's handlers (``--module``) where a test waits for the
periodic audit: a period of 5 s instead of 30 (``kembed_operator.audit`` reads its constant at every
round). A test hook, never imported by the tests' own process."""

from kembed_operator import audit

audit.AUDIT_S = 5.0
