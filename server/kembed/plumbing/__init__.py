"""What every process of the pod needs from its host, whatever its role: being a child of the
supervisor (``child``), the runtime folder (``runtime``), bind addresses (``listen``), TLS files
(``tls``) and API keys (``api_keys``). It imports the settings alone."""
