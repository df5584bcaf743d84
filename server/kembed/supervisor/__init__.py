"""The supervisor (``python -m kembed``): one pod, one face, over the engine process and the front
ends; it serves the probes and the merged metrics (``process.py``, ``http.py``)."""
