"""The server's settings: :mod:`~kembed.config.settings` (the ``Settings`` model, one field per
``KEMBED_*`` variable), :mod:`~kembed.config.values` (the kinds of value a field takes, the error a
bad one raises) and :mod:`~kembed.config.env` (reading the environment; the generated tables)."""
