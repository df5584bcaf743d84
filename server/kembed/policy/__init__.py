"""The rules both sides apply, pure (clocks and loads injected): admission (``admission``), the
offered demand (``demand``), bucket and batch shapes (``shapes``, the operator's too) and the
priority classes (``priority``). It imports the settings (``config``) and nothing of a process."""
